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

/* The CUDA op table (kernels.h), initialised on device 0 (cuDNN and cuBLAS handles); NULL
 * when initialisation fails. Defined in kernels/cuda/backend.cu. */
struct k_backend;
typedef const struct k_backend *(*k_cuda_backend_fn)(void);
const struct k_backend *k_cuda_backend(void);
/* Text of the last CUDA/cuDNN/cuBLAS failure in the library ("" when none). */
typedef const char *(*k_cuda_last_error_fn)(void);
const char *k_cuda_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
