/* cpu.c — the fast CPU back-end: oneDNN 2.6 (C API) for convolution (conv.c), batchnorm with
 * the ReLU fused (bn.c), pooling and inner product (pool_dense.c); this file holds what they
 * share (engine, streams, scratch, primitives) and the table, which names ref's functions for
 * relu, concat, dropout, the losses, the elementwise ops, the reductions and host memory.
 *
 * Every op descriptor (k_conv2d, k_bn, ...) gets its primitives created once, on first use,
 * in its `impl` slot: a forward primitive and the backward ones, with memory objects whose data
 * handles are re-pointed at the caller's buffers on each call (no per-call allocation). The
 * max-pool and fused batchnorm+ReLU workspaces live in impl from forward to backward.
 * Tensors are plain NCHW/KCRS at this API, or nChw16c for blocked descriptors; oneDNN picks its
 * own kernels for those layouts and uses every core (its OpenMP runtime).
 *
 * oneDNN backward-weights primitives overwrite their output, but the kernels API accumulates
 * into parameter gradients: they write into a thread-local scratch that is then added.
 * Backward ops accumulate (+=) into parameter gradients and overwrite input gradients.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/mem.h"
#include "common/simd.h"
#include "kernels/cpu/cpu_int.h"
#include "kernels/ref/ref.h"

/* One engine for the process; one stream per thread (several models may train in different
 * threads, e.g. all-reduce replicas; each model itself is used by one thread at a time). */
static dnnl_engine_t s_engine;
static _Thread_local dnnl_stream_t s_stream;
static dnnl_status_t s_init_status = dnnl_success;
static pthread_once_t s_once = PTHREAD_ONCE_INIT;
static pthread_key_t s_stream_key; // destroys a thread's stream when the thread exits

static _Thread_local float *s_scratch;
static _Thread_local size_t s_scratch_len;

/* Thread exit: the stream and the scratch of that thread. */
static void s_stream_free(void *st)
{
    dnnl_stream_destroy((dnnl_stream_t)st);
    zps_aligned_free(s_scratch);
    s_scratch = NULL;
    s_scratch_len = 0;
}

static void s_init(void)
{
    s_init_status = dnnl_engine_create(&s_engine, dnnl_cpu, 0);
    if (pthread_key_create(&s_stream_key, s_stream_free) != 0)
        s_init_status = dnnl_runtime_error;
}

zps_status k_cpu_ready(void)
{
    pthread_once(&s_once, s_init);
    K_CPU_DNNL(s_init_status);
    if (!s_stream) {
        K_CPU_DNNL(dnnl_stream_create(&s_stream, s_engine, dnnl_stream_default_flags));
        pthread_setspecific(s_stream_key, s_stream);
    }
    return ZPS_OK;
}

dnnl_engine_t k_cpu_engine(void) { return s_engine; }

float *k_cpu_scratch(size_t n)
{
    if (n > s_scratch_len) {
        zps_aligned_free(s_scratch);
        s_scratch = zps_xaligned(64, n * sizeof(float));
        s_scratch_len = n;
    }
    return s_scratch;
}

ZPS_SIMD_CLONES void k_cpu_round_bf16(size_t n, const float *src, float *dst)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = zps_bf16_round(src[i]);
}

ZPS_SIMD_CLONES void k_cpu_acc(size_t n, const float *src, float *dst)
{
    for (size_t i = 0; i < n; i++)
        dst[i] += src[i];
}

/* ---- one primitive with its argument list ---- */

void k_cpu_prim_free(k_cpu_prim *p)
{
    for (int i = 0; i < p->nargs; i++)
        if (!p->shared[i])
            dnnl_memory_destroy(p->args[i].memory);
    if (p->p)
        dnnl_primitive_destroy(p->p);
    if (p->pd)
        dnnl_primitive_desc_destroy(p->pd);
    memset(p, 0, sizeof *p);
}

zps_status k_cpu_prim_create(k_cpu_prim *p, const_dnnl_op_desc_t desc,
                                const_dnnl_primitive_desc_t hint)
{
    /* "unimplemented" is an answer the callers fall back from (a bf16 kernel this CPU lacks,
     * a layout pair): not worth an error line; the caller says so when nothing is left */
    dnnl_status_t st = dnnl_primitive_desc_create(&p->pd, desc, NULL, s_engine, hint);
    if (st == dnnl_unimplemented) {
        zps_log(ZPS_DEBUG, "kernels", "oneDNN has no primitive for this descriptor");
        return ZPS_ERR_DNNL;
    }
    K_CPU_DNNL(st);
    K_CPU_DNNL(dnnl_primitive_create(&p->p, p->pd));
    return ZPS_OK;
}

zps_status k_cpu_prim_arg_md(k_cpu_prim *p, int arg, const dnnl_memory_desc_t *md)
{
    if (!md)
        return ZPS_ERR_DNNL;
    dnnl_memory_t m;
    K_CPU_DNNL(dnnl_memory_create(&m, md, s_engine, DNNL_MEMORY_NONE));
    p->args[p->nargs].arg = arg;
    p->args[p->nargs].memory = m;
    p->shared[p->nargs++] = 0;
    return ZPS_OK;
}

zps_status k_cpu_prim_arg_at(k_cpu_prim *p, int arg, dnnl_query_t q, int index)
{
    return k_cpu_prim_arg_md(p, arg, dnnl_primitive_desc_query_md(p->pd, q, index));
}

zps_status k_cpu_prim_arg(k_cpu_prim *p, int arg, dnnl_query_t q)
{
    return k_cpu_prim_arg_at(p, arg, q, 0);
}

void k_cpu_prim_shared(k_cpu_prim *p, int arg, dnnl_memory_t m)
{
    p->args[p->nargs].arg = arg;
    p->args[p->nargs].memory = m;
    p->shared[p->nargs++] = 1;
}

zps_status k_cpu_prim_run(k_cpu_prim *p, const void *const *ptrs, int n)
{
    ZPS_TRY(k_cpu_ready()); /* this thread's stream */
    int k = 0;
    for (int i = 0; i < p->nargs && k < n; i++) {
        if (p->shared[i])
            continue;
        K_CPU_DNNL(dnnl_memory_set_data_handle(p->args[i].memory, (void *)ptrs[k++]));
    }
    K_CPU_DNNL(dnnl_primitive_execute(p->p, s_stream, p->nargs, p->args));
    K_CPU_DNNL(dnnl_stream_wait(s_stream));
    return ZPS_OK;
}

zps_status k_cpu_workspace(k_cpu_prim *p, dnnl_memory_t *out)
{
    *out = NULL;
    const dnnl_memory_desc_t *md = dnnl_primitive_desc_query_md(p->pd, dnnl_query_workspace_md, 0);
    if (!md || dnnl_memory_desc_get_size(md) == 0)
        return ZPS_OK;
    K_CPU_DNNL(dnnl_memory_create(out, md, s_engine, DNNL_MEMORY_ALLOCATE));
    return ZPS_OK;
}

zps_status k_cpu_md4(dnnl_memory_desc_t *md, int a, int b, int c, int d,
                        dnnl_format_tag_t tag)
{
    dnnl_dims_t dims = {a, b, c, d};
    K_CPU_DNNL(dnnl_memory_desc_init_by_tag(md, 4, dims, dnnl_f32, tag));
    return ZPS_OK;
}

zps_status k_cpu_md2(dnnl_memory_desc_t *md, int a, int b)
{
    dnnl_dims_t dims = {a, b};
    K_CPU_DNNL(dnnl_memory_desc_init_by_tag(md, 2, dims, dnnl_f32, dnnl_ab));
    return ZPS_OK;
}

zps_status k_cpu_md1(dnnl_memory_desc_t *md, int a)
{
    dnnl_dims_t dims = {a};
    K_CPU_DNNL(dnnl_memory_desc_init_by_tag(md, 1, dims, dnnl_f32, dnnl_a));
    return ZPS_OK;
}

zps_status k_cpu_reorder_create(k_cpu_prim *p, const dnnl_memory_desc_t *from,
                                const dnnl_memory_desc_t *to, int accumulate)
{
    memset(p, 0, sizeof *p);
    if (dnnl_memory_desc_equal(from, to))
        return ZPS_OK;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t po = NULL;
    if (accumulate) {
        K_CPU_DNNL(dnnl_primitive_attr_create(&attr));
        K_CPU_DNNL(dnnl_post_ops_create(&po));
        K_CPU_DNNL(dnnl_post_ops_append_sum(po, 1.0f));
        K_CPU_DNNL(dnnl_primitive_attr_set_post_ops(attr, po));
    }
    dnnl_status_t st =
        dnnl_reorder_primitive_desc_create(&p->pd, from, k_cpu_engine(), to, k_cpu_engine(), attr);
    if (po)
        dnnl_post_ops_destroy(po);
    if (attr)
        dnnl_primitive_attr_destroy(attr);
    K_CPU_DNNL(st);
    K_CPU_DNNL(dnnl_primitive_create(&p->p, p->pd));
    dnnl_memory_t a, b;
    K_CPU_DNNL(dnnl_memory_create(&a, from, k_cpu_engine(), DNNL_MEMORY_NONE));
    K_CPU_DNNL(dnnl_memory_create(&b, to, k_cpu_engine(), DNNL_MEMORY_NONE));
    p->args[0].arg = DNNL_ARG_FROM, p->args[0].memory = a;
    p->args[1].arg = DNNL_ARG_TO, p->args[1].memory = b;
    p->nargs = 2;
    return ZPS_OK;
}

dnnl_format_tag_t k_cpu_act_tag(int blocked)
{
    return blocked == K_BLOCK8 ? dnnl_nChw8c : blocked ? dnnl_nChw16c : dnnl_nchw;
}

void *k_cpu_impl_new(void **impl, k_cpu_kind kind, size_t size)
{
    k_cpu_head *h = zps_xcalloc(1, size);
    h->kind = kind;
    *impl = h;
    return h;
}

static void s_release(void **impl)
{
    k_cpu_head *h = *impl;
    if (!h)
        return;
    switch (h->kind) {
    case K_CPU_CONV:
        k_cpu_conv_release(h);
        break;
    case K_CPU_BN:
        k_cpu_bn_release(h);
        break;
    case K_CPU_POOL:
        k_cpu_pool_release(h);
        break;
    case K_CPU_DENSE:
        k_cpu_dense_release(h);
        break;
    }
    free(h);
    *impl = NULL;
}

/* 16 channels side by side where they divide c on a CPU with AVX-512 (its kernels' vector),
 * else 8 (oneDNN's AVX2 kernels: still direct convolutions and its jit batchnorm where NCHW
 * gets gemm and ncsp). An AVX2-only CPU gets 8 wherever it divides c: oneDNN 2.6 has no AVX2
 * batchnorm or pooling for nChw16c, and its reference loops there made the convnet's step 12x
 * slower than with 8-blocks on the same CPU (187 against 2,202 img/s, an AMD EPYC). */
static int s_prefers_blocked(int c)
{
    if (c <= 0 || c % 8)
        return 0;
    return c % 16 == 0 && k_cpu_has_avx512() ? K_BLOCK16 : K_BLOCK8;
}

int k_cpu_has_avx512(void)
{
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    const char *e = getenv("ZPS_CPU_NO_AVX512"); /* the AVX2 path on any CPU (tests) */
    return !(e && *e && strcmp(e, "0")) && __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

static const k_backend s_cpu = {
    .name = "cpu",
    .host_memory = 1,
    K_REF_HOST_MEMORY_ENTRIES, /* plain aligned host memory, as ref's */
    .release = s_release,
    .prefers_blocked = s_prefers_blocked,
    .conv2d_fwd = k_cpu_conv2d_fwd,
    .conv2d_bwd = k_cpu_conv2d_bwd,
    .bn_fwd_train = k_cpu_bn_fwd_train,
    .bn_fwd_infer = k_cpu_bn_fwd_infer,
    .bn_bwd = k_cpu_bn_bwd,
    .pool_fwd = k_cpu_pool_fwd,
    .pool_bwd = k_cpu_pool_bwd,
    .bn_pool_fuses = k_cpu_bn_pool_fuses,
    .bn_pool_fwd = k_cpu_bn_pool_fwd,
    .bn_pool_bwd = k_cpu_bn_pool_bwd,
    .dense_fwd = k_cpu_dense_fwd,
    .dense_bwd = k_cpu_dense_bwd,
    /* ref's loops for relu, concat, dropout, losses, elementwise ops and reductions, on the
     * same host memory: memory-bound streams or tiny, and indifferent to the blocked layout */
    K_REF_LAYOUT_FREE_ENTRIES,
};

const k_backend *k_backend_cpu(void) { return &s_cpu; }
