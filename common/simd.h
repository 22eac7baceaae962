/* simd.h — ZPS_SIMD_CLONES: compile a hot elementwise loop for AVX-512, AVX2 and the baseline
 * x86-64 and pick one at load time (GCC/clang function multi-versioning, an ifunc).
 *
 * The build targets the baseline (it must run on any x86-64), so without this the server's
 * per-element streams run as SSE2: the NaN/Inf check of a 1 MiB push took 35 us as SSE2 and
 * 17 us as AVX-512 on the 2-core machine, data in cache. Every clone gives the same bits:
 * without -ffast-math the compiler never reorders floating-point additions (so a reduction
 * vectorises only across lanes the code spells out, as kernels/cpu's batchnorm sums do), and
 * -std=c11 keeps -ffp-contract=off, so no clone fuses a multiply and an add.
 */
#ifndef ZPS_COMMON_SIMD_H
#define ZPS_COMMON_SIMD_H

#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ZPS_SIMD_NO_CLONES 1 // ifunc resolvers run before the sanitizer's runtime is ready
#endif
#endif
#if defined(__x86_64__) && defined(__has_attribute) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__) && !defined(ZPS_SIMD_NO_CLONES)
#if __has_attribute(target_clones)
#define ZPS_SIMD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef ZPS_SIMD_CLONES
#define ZPS_SIMD_CLONES
#endif

#endif
