/* hd.h — ZPS_HD marks a small function that the host and the CUDA kernels both call, so one
 * definition serves the CPU back-ends, the kernels and the CPU suite's checks of the kernels'
 * math (bf16.h, optim_math.h, kernels.h's hash, the kernels' *_math.h headers). Under nvcc it is
 * compiled for both sides; elsewhere it is a plain static inline function. */
#ifndef ZPS_COMMON_HD_H
#define ZPS_COMMON_HD_H

#ifdef __CUDACC__
#define ZPS_HD static inline __host__ __device__
#else
#define ZPS_HD static inline
#endif

#endif
