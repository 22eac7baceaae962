/* cuda_int.h — what the .cu files of libzps_cuda.so share and export to nobody (nvcc only). */
#ifndef ZPS_KERNELS_CUDA_INT_H
#define ZPS_KERNELS_CUDA_INT_H

#include <cuda_runtime.h>

/* The back-end's compute stream (backend.cu): every op runs on it, so the NCCL calls that
 * must follow or precede the ops order themselves against it with events. NULL (the legacy
 * stream) before k_cuda_backend opened the device. */
cudaStream_t k_cuda_compute_stream(void);

#endif
