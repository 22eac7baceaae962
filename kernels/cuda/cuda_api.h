/* cuda_api.h — the plain-C entry points of libzps_cuda.so, looked up with dlsym.
 * Compiled by gcc (as declarations only) and by nvcc (the .cu files beside it define them). */
#ifndef ZPS_KERNELS_CUDA_API_H
#define ZPS_KERNELS_CUDA_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Counts devices; fills name with device 0's name and msg with the CUDA error text when
 * none answers. Returns 0 when the query itself worked (count may still be 0). */
typedef int (*k_cuda_probe_fn)(int *count, char *name, size_t name_len, char *msg,
                               size_t msg_len);
int k_cuda_probe(int *count, char *name, size_t name_len, char *msg, size_t msg_len);

#ifdef __cplusplus
}
#endif

#endif
