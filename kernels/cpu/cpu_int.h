/* cpu_int.h — private to the cpu back-end (the .c files of kernels/cpu): the oneDNN plumbing shared by its
 * op files and the ops its table (cpu.c) names. Not part of any public header.
 *
 *   cpu.c         engine, per-thread streams and scratch, primitives with their argument
 *                 lists, release of an op's state, the table
 *   conv.c        convolution (weight reorders into the primitives' layouts, activation
 *                 reorders where a layout pair has no direct kernel)
 *   bn.c          batchnorm (+ fused ReLU) with zps's own batch statistics
 *   bn_plain.c    its training forward and backward on NCHW data, own loops
 *   pool_dense.c  pooling and inner product
 *   bn_pool.c     batchnorm + ReLU + 2x2 max pooling fused (16-blocks, AVX-512)
 *
 * Every op's state lives in its descriptor's impl slot and starts with a k_cpu_head, so the
 * table's release can tell the kinds apart.
 */
#ifndef ZPS_KERNELS_CPU_CPU_INT_H
#define ZPS_KERNELS_CPU_CPU_INT_H

#include <dnnl.h>
#include <stdint.h>

#include "common/log.h"
#include "kernels/kernels.h"

/* Checks a oneDNN call: on failure logs the call and status, returns ZPS_ERR_DNNL. */
#define K_CPU_DNNL(expr)                                                               \
    do {                                                                               \
        dnnl_status_t k_cpu_st_ = (expr);                                              \
        if (k_cpu_st_ != dnnl_success) {                                               \
            zps_log(ZPS_ERROR, "kernels", "%s failed: oneDNN status %d", #expr,         \
                    (int)k_cpu_st_);                                                   \
            return ZPS_ERR_DNNL;                                                       \
        }                                                                              \
    } while (0)

typedef enum k_cpu_kind { K_CPU_CONV = 1, K_CPU_BN, K_CPU_POOL, K_CPU_DENSE } k_cpu_kind;

/* Every impl starts with its kind so release() can tell them apart. */
typedef struct k_cpu_head {
    k_cpu_kind kind;
} k_cpu_head;

/* A new zeroed op state of `size` bytes starting with a k_cpu_head of `kind`, stored in the
 * descriptor's impl slot (which must be empty) and returned. */
void *k_cpu_impl_new(void **impl, k_cpu_kind kind, size_t size);

/* The process's engine (valid after k_cpu_ready). */
dnnl_engine_t k_cpu_engine(void);
/* The engine, once, and this thread's stream; ZPS_ERR_DNNL when oneDNN refuses. */
zps_status k_cpu_ready(void);
/* Thread-local scratch of n floats for outputs that oneDNN overwrites but the API accumulates;
 * valid until the next call in this thread; use after k_cpu_ready (which arranges its
 * release at thread exit). */
float *k_cpu_scratch(size_t n);
/* dst[i] = zps_bf16_round(src[i]) (kernels.h): a bf16 convolution's inputs for float kernels. */
void k_cpu_round_bf16(size_t n, const float *src, float *dst);
/* dst[i] += src[i]. */
void k_cpu_acc(size_t n, const float *src, float *dst);

/* ---- one primitive with its argument list ---- */

enum { K_CPU_MAX_ARGS = 12 };

typedef struct k_cpu_prim {
    dnnl_primitive_desc_t pd;              // owned
    dnnl_primitive_t p;                    // owned
    int nargs;                             // used entries of args
    dnnl_exec_arg_t args[K_CPU_MAX_ARGS];  // memory objects (owned unless shared[i])
    int shared[K_CPU_MAX_ARGS];            // 1: memory owned elsewhere (workspace)
} k_cpu_prim;

void k_cpu_prim_free(k_cpu_prim *p);
zps_status k_cpu_prim_create(k_cpu_prim *p, const_dnnl_op_desc_t desc,
                             const_dnnl_primitive_desc_t hint);
/* Adds argument `arg` with the layout the primitive expects for query q, index `index`. Its
 * data handle is set by each k_cpu_prim_run. */
zps_status k_cpu_prim_arg_at(k_cpu_prim *p, int arg, dnnl_query_t q, int index);
/* The same at index 0. */
zps_status k_cpu_prim_arg(k_cpu_prim *p, int arg, dnnl_query_t q);
/* Adds argument `arg` with layout md. */
zps_status k_cpu_prim_arg_md(k_cpu_prim *p, int arg, const dnnl_memory_desc_t *md);
/* Adds memory owned elsewhere (a workspace shared by forward and backward). */
void k_cpu_prim_shared(k_cpu_prim *p, int arg, dnnl_memory_t m);
/* Points the first n non-shared arguments at ptrs (in the order they were added), runs and
 * waits. */
zps_status k_cpu_prim_run(k_cpu_prim *p, const void *const *ptrs, int n);
/* Workspace memory sized as the primitive asks, allocated by oneDNN; *out NULL when none. */
zps_status k_cpu_workspace(k_cpu_prim *p, dnnl_memory_t *out);

/* A reorder between two layouts of the same tensor (args: from, to); p->p stays NULL when they
 * are equal. accumulate: it adds into its destination (a sum post-op). */
zps_status k_cpu_reorder_create(k_cpu_prim *p, const dnnl_memory_desc_t *from,
                                const dnnl_memory_desc_t *to, int accumulate);

/* Plain f32 memory descriptors; the layout of activations (blocked: nChw16c). */
zps_status k_cpu_md4(dnnl_memory_desc_t *md, int a, int b, int c, int d, dnnl_format_tag_t tag);
zps_status k_cpu_md2(dnnl_memory_desc_t *md, int a, int b);
zps_status k_cpu_md1(dnnl_memory_desc_t *md, int a);
dnnl_format_tag_t k_cpu_act_tag(int blocked);

/* ---- the ops (table entries) and the release of their state ---- */

/* conv.c: weights reordered per forward, weight gradient added back through a reorder. */
k_conv2d_fwd_fn k_cpu_conv2d_fwd;
k_conv2d_bwd_fn k_cpu_conv2d_bwd;
void k_cpu_conv_release(k_cpu_head *impl);

/* bn.c: statistics summed in double by zps, then oneDNN's forward with them as inputs. */
k_bn_fwd_train_fn k_cpu_bn_fwd_train;
/* Inference: running statistics; its primitive is created on first use. */
k_bn_fwd_infer_fn k_cpu_bn_fwd_infer;
/* Without dx, diff_src goes to scratch (oneDNN always writes it). */
k_bn_bwd_fn k_cpu_bn_bwd;
void k_cpu_bn_release(k_cpu_head *impl);
/* The training forward's first half, shared with bn_pool.c: the batch statistics into mean and
 * var, the running averages updated, and *shift: the per-channel shift (beta corrected for the
 * float mean's rounding, c floats in d's impl) that normalises as y = gamma (x - mean) / sd +
 * shift. */
zps_status k_cpu_bn_train_stats(k_bn *d, const float *x, const float *gamma, const float *beta,
                                float *mean, float *var, float *run_mean, float *run_var,
                                const float **shift);
/* bn_plain.c: the NCHW training forward with given statistics and shift, and the backward
 * (dgamma and dbeta overwritten, dx overwritten unless NULL; y: the forward's output, read for
 * the ReLU mask). */
void k_cpu_bn_plain_fwd(const k_bn *d, const float *x, const float *mean, const float *var,
                        const float *gamma, const float *shift, float *y);
void k_cpu_bn_plain_bwd(const k_bn *d, const float *x, const float *y, const float *dy,
                        const float *gamma, const float *mean, const float *var, float *dx,
                        float *dgamma, float *dbeta);

/* pool_dense.c: max pooling keeps its argmax workspace from forward to backward. */
k_pool_fwd_fn k_cpu_pool_fwd;
k_pool_bwd_fn k_cpu_pool_bwd;
void k_cpu_pool_release(k_cpu_head *impl);
/* 1 where zps's own 2x2 stride-2 max-pool loops run d (16-blocks, even maps, AVX-512). */
int k_cpu_pool_max2(const k_pool *d);
/* 1 on an x86-64 CPU with AVX-512F, unless ZPS_CPU_NO_AVX512 is set (not "0"): the layouts
 * prefers_blocked picks and zps's own AVX-512 loops follow it. */
int k_cpu_has_avx512(void);
/* The fused op's workspace in d's impl, made on first use: arg, two 16-bit masks per 16
 * outputs (where the maximum was, as the max-pool loops write them), act, one mask per 16
 * outputs (the maximum was above 0), xmax, x at the maximum (one float per output). */
zps_status k_cpu_pool_max2_ws(k_pool *d, uint16_t **arg, uint16_t **act, float **xmax);

/* bn_pool.c: the fusion of batchnorm + ReLU with the 2x2 max pool after it. */
k_bn_pool_fuses_fn k_cpu_bn_pool_fuses;
k_bn_pool_fwd_fn k_cpu_bn_pool_fwd;
k_bn_pool_bwd_fn k_cpu_bn_pool_bwd;

/* pool_dense.c: inner product; a NULL bias is a zero bias. */
k_dense_fwd_fn k_cpu_dense_fwd;
k_dense_bwd_fn k_cpu_dense_bwd;
void k_cpu_dense_release(k_cpu_head *impl);

#endif
