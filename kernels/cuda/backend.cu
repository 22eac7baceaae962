/* backend.cu — the CUDA back-end (kernels/backend.h) and its table: cuDNN for convolution,
 * cuBLAS for dense layers, own kernels for batchnorm (+ReLU), pooling, concat, dropout, losses
 * and elementwise ops, written to the ref back-end's exact semantics (biased batch variance,
 * unbiased running variance, padding counted by average pooling, the same dropout hash).
 *
 * Everything runs on one device per process (k_cuda_backend's argument, an index among the
 * devices CUDA_VISIBLE_DEVICES leaves visible): the ops, cuDNN and cuBLAS on the back-end's
 * compute stream, the asynchronous copies (backend.h's group) on its copy stream, both
 * non-blocking, ordered against each other by events only; copy_in/copy_out run on the
 * compute stream and synchronise it. Tensors are device pointers; losses and reductions come
 * back to the host (synchronising the compute stream). Every CUDA, cuDNN and cuBLAS call that an op's result
 * depends on, and every kernel launch, is checked; the failure's text is kept in s_err (the
 * latest one; this library cannot call zps_log: it is dlopened by binaries that do not export
 * it; k_cuda_last_error returns it) and the call returns ZPS_ERR_CUDA/CUDNN/CUBLAS. Not
 * checked, on purpose: frees and descriptor destruction on release and error paths, whose
 * failure leaves nothing to undo. Allocation failure in the table's alloc is its NULL return.
 * Backward ops accumulate (+=) into parameter gradients and overwrite input gradients.
 * Nothing is allocated per call on the step path: reductions and losses use one grow-only
 * device and pinned-host scratch (s_scratch), the bf16 convolutions' buffers one grow-only
 * scratch (s_bscr), and every convolution one shared grow-only workspace (s_ws); a
 * convolution's descriptors and algorithms and a batchnorm's sums are made once per
 * descriptor (per shape), on first use.
 * No blocked layouts (prefers_blocked is NULL).
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/cuda_int.h"
#include "kernels/kernels.h"

static char s_err[256];
static cudnnHandle_t s_cudnn;
static cublasHandle_t s_cublas;
static cudaStream_t s_stream; // the compute stream: every op and the synchronous copies
static cudaStream_t s_copy;   // the copy stream: copy_in_async, copy_out_async

cudaStream_t k_cuda_compute_stream(void) { return s_stream; }

/* Checks a CUDA, cuDNN or cuBLAS call: on failure keeps file:line, the call and the
 * library's own text in s_err (k_cuda_last_error) and returns status. */
#define S_CHECK(type, ok, text, status, expr)                                          \
    do {                                                                               \
        type e_ = (expr);                                                              \
        if (e_ != (ok)) {                                                              \
            snprintf(s_err, sizeof s_err, "%s:%d %s: %s", __FILE__, __LINE__, #expr,   \
                     text(e_));                                                        \
            return status;                                                             \
        }                                                                              \
    } while (0)
#define S_CUDA(expr) S_CHECK(cudaError_t, cudaSuccess, cudaGetErrorString, ZPS_ERR_CUDA, expr)
#define S_CUDNN(expr)                                                                  \
    S_CHECK(cudnnStatus_t, CUDNN_STATUS_SUCCESS, cudnnGetErrorString, ZPS_ERR_CUDNN, expr)
#define S_CUBLAS(expr)                                                                 \
    S_CHECK(cublasStatus_t, CUBLAS_STATUS_SUCCESS, cublasGetStatusString, ZPS_ERR_CUBLAS, expr)
#define S_LAUNCHED() S_CUDA(cudaGetLastError())
#define S_TRY(expr)                                                                    \
    do {                                                                               \
        zps_status t_ = (expr);                                                        \
        if (t_ != ZPS_OK)                                                              \
            return t_;                                                                 \
    } while (0)


static const int S_T = 256;
/* Blocks of a grid-stride kernel over n elements: at least 1, so n = 0 is a launch that does
 * nothing (a grid of 0 blocks is cudaErrorInvalidConfiguration), as ref's loops do nothing. */
static unsigned s_blocks(size_t n)
{
    size_t b = (n + S_T - 1) / S_T;
    return (unsigned)(b < 1 ? 1 : b < 65535 ? b : 65535);
}
#define S_LOOP(i, n) for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)blockDim.x * gridDim.x)

extern "C" const char *k_cuda_last_error(void) { return s_err; }

/* ---- memory ---- */

static int s_device; // the one this back-end opened (s_open)

/* A failed allocation is its NULL: its error is cleared, or the next launch check would
 * report it as its own. */
static void *s_alloc(size_t n)
{
    void *p = NULL;
    if (cudaMalloc(&p, n ? n : 64) == cudaSuccess)
        return p;
    (void)cudaGetLastError();
    return NULL;
}
static void s_free(void *p)
{
    if (p)
        cudaFree(p);
}
static zps_status s_copy_in(void *dst, const void *src, size_t n)
{
    S_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s_stream));
    S_CUDA(cudaStreamSynchronize(s_stream));
    return ZPS_OK;
}
static zps_status s_copy_out(void *dst, const void *src, size_t n)
{
    S_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s_stream));
    S_CUDA(cudaStreamSynchronize(s_stream));
    return ZPS_OK;
}

/* ---- the asynchronous group: pinned host memory, the copy stream, events ---- */

struct k_event {
    cudaEvent_t ev; // timing disabled: only ordering
};

static void *s_host_alloc(size_t n)
{
    void *p = NULL;
    if (cudaHostAlloc(&p, n ? n : 64, cudaHostAllocDefault) == cudaSuccess)
        return p;
    (void)cudaGetLastError();
    return NULL;
}
static void s_host_free(void *p)
{
    if (p)
        cudaFreeHost(p);
}
static zps_status s_copy_in_async(void *dst, const void *src, size_t n)
{
    S_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s_copy));
    return ZPS_OK;
}
static zps_status s_copy_out_async(void *dst, const void *src, size_t n)
{
    S_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s_copy));
    return ZPS_OK;
}
static zps_status s_event_new(k_event **out)
{
    *out = NULL;
    k_event *e = (k_event *)calloc(1, sizeof *e);
    if (!e)
        return ZPS_ERR_NOMEM;
    cudaError_t r = cudaEventCreateWithFlags(&e->ev, cudaEventDisableTiming);
    if (r != cudaSuccess) {
        snprintf(s_err, sizeof s_err, "cudaEventCreateWithFlags: %s", cudaGetErrorString(r));
        free(e);
        return ZPS_ERR_CUDA;
    }
    *out = e;
    return ZPS_OK;
}
static void s_event_free(k_event *e)
{
    if (e) {
        cudaEventDestroy(e->ev);
        free(e);
    }
}
static cudaStream_t s_queue(int q) { return q == K_QUEUE_COPY ? s_copy : s_stream; }
static zps_status s_event_record(k_event *e, int q)
{
    S_CUDA(cudaEventRecord(e->ev, s_queue(q)));
    return ZPS_OK;
}
static zps_status s_event_wait(int q, k_event *e)
{
    S_CUDA(cudaStreamWaitEvent(s_queue(q), e->ev, 0));
    return ZPS_OK;
}
/* Also called from other threads (trainer/stage.c's staging thread): the thread is put on
 * this back-end's device first, or CUDA would make a context on device 0 for it. */
static zps_status s_event_sync(k_event *e)
{
    S_CUDA(cudaSetDevice(s_device));
    S_CUDA(cudaEventSynchronize(e->ev));
    return ZPS_OK;
}

/* ---- elementwise ---- */

__global__ void g_fill(size_t n, float v, float *y) { S_LOOP(i, n) y[i] = v; }
__global__ void g_add(size_t n, const float *a, const float *b, float *y) { S_LOOP(i, n) y[i] = a[i] + b[i]; }
__global__ void g_scale(size_t n, float a, float *x) { S_LOOP(i, n) x[i] *= a; }
__global__ void g_axpy(size_t n, float a, const float *x, float *y) { S_LOOP(i, n) y[i] += a * x[i]; }
__global__ void g_relu(size_t n, const float *x, float *y) { S_LOOP(i, n) y[i] = x[i] > 0 ? x[i] : 0.0f; }
__global__ void g_relu_bwd(size_t n, const float *y, const float *dy, float *dx)
{
    S_LOOP(i, n) dx[i] = y[i] > 0 ? dy[i] : 0.0f;
}
__global__ void g_sum(size_t n, const float *x, int sq, double *out)
{
    double acc = 0;
    S_LOOP(i, n) acc += sq ? (double)x[i] * x[i] : (double)x[i];
    atomicAdd(out, acc);
}

/* The same hash as k_hash_u32 (kernels.c), so masks agree across back-ends. */
__device__ uint32_t d_hash(uint64_t seed, uint64_t index)
{
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + index + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (uint32_t)(z >> 32);
}
__global__ void g_dropout(size_t n, uint64_t thr, float keep, uint64_t seed, const float *x, float *y)
{
    S_LOOP(i, n) y[i] = (uint64_t)d_hash(seed, i) < thr ? 0.0f : x[i] * keep;
}

/* One grid-stride kernel over n elements on the default stream, launch checked. */
#define S_ELEMWISE(kernel, n, ...)                                                     \
    do {                                                                               \
        kernel<<<s_blocks(n), S_T, 0, s_stream>>>((n), __VA_ARGS__);                                \
        S_LAUNCHED();                                                                  \
        return ZPS_OK;                                                                 \
    } while (0)

static zps_status s_fill(size_t n, float v, float *y) { S_ELEMWISE(g_fill, n, v, y); }
static zps_status s_add(size_t n, const float *a, const float *b, float *y)
{
    S_ELEMWISE(g_add, n, a, b, y);
}
static zps_status s_scale(size_t n, float a, float *x) { S_ELEMWISE(g_scale, n, a, x); }
static zps_status s_axpy(size_t n, float a, const float *x, float *y)
{
    S_ELEMWISE(g_axpy, n, a, x, y);
}
/* The optimizers' update (common/optim_math.h: the host's formulas with explicitly rounded
 * operations, so the bits equal ps_optim_apply's). The kind is uniform across the grid. */
__global__ void g_optim(size_t n, zps_optim_step s, float *w, float *s0, float *s1, const float *g)
{
    switch (s.kind) {
    case ZPS_OPTK_SGD: S_LOOP(i, n) zps_opt_sgd(&s, &w[i], g[i]); break;
    case ZPS_OPTK_MOMENTUM:
        if (s.nesterov)
            S_LOOP(i, n) zps_opt_nesterov(&s, &w[i], &s0[i], g[i]);
        else
            S_LOOP(i, n) zps_opt_momentum(&s, &w[i], &s0[i], g[i]);
        break;
    case ZPS_OPTK_RMSPROP: S_LOOP(i, n) zps_opt_rmsprop(&s, &w[i], &s0[i], &s1[i], g[i]); break;
    case ZPS_OPTK_ADAM: S_LOOP(i, n) zps_opt_adam(&s, &w[i], &s0[i], &s1[i], g[i]); break;
    case ZPS_OPTK_ADAGRAD: S_LOOP(i, n) zps_opt_adagrad(&s, &w[i], &s0[i], g[i]); break;
    }
}
static zps_status s_optim_apply(const zps_optim_step *s, size_t n, float *w, float *s0, float *s1,
                                const float *g)
{
    if (!n)
        return ZPS_OK;
    S_ELEMWISE(g_optim, n, *s, w, s0, s1, g);
}
/* The PS wire's bfloat16 bits (common/bf16.h), for gradients that leave as --push-dtype bf16. */
__global__ void g_pack_bf16(size_t n, const float *x, uint16_t *y)
{
    S_LOOP(i, n) y[i] = zps_bf16_bits(x[i]);
}
static zps_status s_pack_bf16(size_t n, const float *x, uint16_t *y)
{
    if (!n)
        return ZPS_OK;
    S_ELEMWISE(g_pack_bf16, n, x, y);
}
static zps_status s_relu_fwd(size_t n, const float *x, float *y) { S_ELEMWISE(g_relu, n, x, y); }
static zps_status s_relu_bwd(size_t n, const float *y, const float *dy, float *dx)
{
    S_ELEMWISE(g_relu_bwd, n, y, dy, dx);
}
/* Grow-only scratch for the ops whose results come back to the host (reductions, losses):
 * one device and one pinned host buffer, so the step path allocates nothing once the
 * largest batch has been seen. Every op runs on the one compute stream, so one buffer of
 * each serves all ops in turn (a growth frees the old one: cudaFree waits for the device). */
static void *s_dscr, *s_hscr;
static size_t s_dscr_cap, s_hscr_cap;
/* buf (device, or pinned host) holds at least bytes afterwards. */
static zps_status s_grow(void **buf, size_t *cap, size_t bytes, int host)
{
    if (bytes <= *cap)
        return ZPS_OK;
    if (*buf)
        S_CUDA(host ? cudaFreeHost(*buf) : cudaFree(*buf));
    *buf = NULL, *cap = 0;
    size_t want = bytes < 4096 ? 4096 : bytes;
    S_CUDA(host ? cudaMallocHost(buf, want) : cudaMalloc(buf, want));
    *cap = want;
    return ZPS_OK;
}
static zps_status s_scratch(size_t bytes, void **dev, void **host)
{
    if (dev)
        S_TRY(s_grow(&s_dscr, &s_dscr_cap, bytes, 0));
    if (host)
        S_TRY(s_grow(&s_hscr, &s_hscr_cap, bytes, 1));
    if (dev)
        *dev = s_dscr;
    if (host)
        *host = s_hscr;
    return ZPS_OK;
}
/* A zeroed device double (scratch) for a kernel to accumulate into. */
static zps_status s_dev_zero(double **d)
{
    S_TRY(s_scratch(sizeof(double), (void **)d, NULL));
    S_CUDA(cudaMemsetAsync(*d, 0, sizeof(double), s_stream));
    return ZPS_OK;
}
/* After the kernel that accumulated into d: its launch status, then d's value into *out. */
static zps_status s_dev_take(double *d, double *out)
{
    S_CUDA(cudaGetLastError());
    S_CUDA(cudaMemcpyAsync(out, d, sizeof(double), cudaMemcpyDeviceToHost, s_stream));
    S_CUDA(cudaStreamSynchronize(s_stream));
    return ZPS_OK;
}
static zps_status s_reduce(size_t n, const float *x, int sq, double *out)
{
    double *d;
    zps_status st = s_dev_zero(&d);
    if (st != ZPS_OK)
        return st;
    g_sum<<<s_blocks(n), S_T, 0, s_stream>>>(n, x, sq, d);
    return s_dev_take(d, out);
}
static zps_status s_sum(size_t n, const float *x, double *out) { return s_reduce(n, x, 0, out); }
static zps_status s_sumsq(size_t n, const float *x, double *out) { return s_reduce(n, x, 1, out); }
static zps_status s_dropout_fwd(size_t n, float p, uint64_t seed, const float *x, float *y)
{
    uint64_t thr = (uint64_t)((double)p * 4294967296.0);
    S_ELEMWISE(g_dropout, n, thr, 1.0f / (1.0f - p), seed, x, y);
}
static zps_status s_dropout_bwd(size_t n, float p, uint64_t seed, const float *dy, float *dx)
{
    return s_dropout_fwd(n, p, seed, dy, dx);
}

/* ---- concat ---- */

static zps_status s_concat(int n, int hw, int nin, const int *c, float *cat, float *const *parts,
                           int split)
{
    int ctot = 0;
    for (int i = 0; i < nin; i++)
        ctot += c[i];
    size_t off = 0, pitch = (size_t)ctot * hw * sizeof(float);
    for (int i = 0; i < nin; i++) {
        size_t w = (size_t)c[i] * hw * sizeof(float);
        if (parts[i]) {
            if (split)
                S_CUDA(cudaMemcpy2DAsync(parts[i], w, (char *)cat + off, pitch, w, (size_t)n,
                                    cudaMemcpyDeviceToDevice, s_stream));
            else
                S_CUDA(cudaMemcpy2DAsync((char *)cat + off, pitch, parts[i], w, w, (size_t)n,
                                    cudaMemcpyDeviceToDevice, s_stream));
        }
        off += w;
    }
    return ZPS_OK;
}
static zps_status s_concat_fwd(int n, int hw, int nin, const int *c, const float *const *xs, float *y)
{
    return s_concat(n, hw, nin, c, y, (float *const *)xs, 0);
}
static zps_status s_concat_bwd(int n, int hw, int nin, const int *c, const float *dy, float *const *dxs)
{
    return s_concat(n, hw, nin, c, (float *)dy, dxs, 1);
}

/* ---- batchnorm ----
 * Statistics and gradient sums: a grid of (channel, split) blocks, each summing its channel
 * over a run of images in double, its partials written to the descriptor's scratch; one
 * thread per channel then adds a channel's partials in split order (deterministic: no
 * atomics) into the mean and biased variance, or the two gradient sums. Splits are chosen so
 * that the grid has about S_BN_BLOCKS blocks even for a few channels of large maps (the
 * stem's 32 channels at 147x147), where one block per channel would leave most of the GPU
 * idle. Elementwise passes run one block per (image, channel) plane, so no thread divides an
 * index by the map size. */

#define S_BN_BLOCKS 2048

/* Each thread's a and b summed over the block into s1[0] and s2[0] (shared arrays of
 * blockDim.x, a power of two), the same tree in both statistics and gradient sums. */
__device__ void d_block_sum2(double *s1, double *s2, double a, double b)
{
    s1[threadIdx.x] = a, s2[threadIdx.x] = b;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s)
            s1[threadIdx.x] += s1[threadIdx.x + s], s2[threadIdx.x] += s2[threadIdx.x + s];
        __syncthreads();
    }
}

/* Block (ch, split): images [split * per, +per) of channel ch. mode 0: sums of x and x^2;
 * mode 1: sums of g and g * xhat, g = dy masked by y > 0 where relu. Partials at
 * part[ch * splits + split] and part[(c + ch) * splits + split]. */
__global__ void g_bn_part(int mode, int n, int c, int hw, int per, const float *x,
                          const float *y, const float *dy, const float *mean, const float *var,
                          float eps, int relu, double *part)
{
    int ch = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    __shared__ double s1[S_T], s2[S_T];
    double a = 0, b = 0, m = 0, inv = 0;
    if (mode)
        m = mean[ch], inv = rsqrt((double)var[ch] + eps);
    int n0 = split * per, n1 = n0 + per < n ? n0 + per : n;
    for (int img = n0; img < n1; img++) {
        size_t base = ((size_t)img * c + ch) * hw;
        for (int i = threadIdx.x; i < hw; i += blockDim.x) {
            double v = x[base + i];
            if (!mode) {
                a += v, b += v * v;
                continue;
            }
            double gv = relu && !(y[base + i] > 0) ? 0.0 : dy[base + i];
            a += gv, b += gv * (v - m) * inv;
        }
    }
    d_block_sum2(s1, s2, a, b);
    if (threadIdx.x == 0)
        part[(size_t)ch * splits + split] = s1[0], part[(size_t)(c + ch) * splits + split] = s2[0];
}
/* A channel's partials in split order: its two sums. */
__device__ void d_bn_total(const double *part, int c, int splits, int ch, double *a, double *b)
{
    *a = 0, *b = 0;
    for (int s = 0; s < splits; s++)
        *a += part[(size_t)ch * splits + s], *b += part[(size_t)(c + ch) * splits + s];
}
__global__ void g_bn_stats_fin(int c, int splits, double cnt, const double *part, float *mean,
                               float *var)
{
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c)
        return;
    double a, b;
    d_bn_total(part, c, splits, ch, &a, &b);
    double m = a / cnt, v = b / cnt - m * m;
    mean[ch] = (float)m;
    var[ch] = (float)(v > 0 ? v : 0);
}
__global__ void g_bn_grad_fin(int c, int splits, const double *part, float *sg, float *sgx,
                              float *dgamma, float *dbeta)
{
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c)
        return;
    double a, b;
    d_bn_total(part, c, splits, ch, &a, &b);
    sg[ch] = (float)a, sgx[ch] = (float)b;
    if (dbeta)
        dbeta[ch] += (float)a;
    if (dgamma)
        dgamma[ch] += (float)b;
}
/* One block per (image, channel) plane. */
__global__ void g_bn_apply(int c, int hw, const float *x, const float *g, const float *b,
                           const float *mean, const float *var, float eps, int relu, float *y)
{
    size_t plane = blockIdx.x;
    int ch = (int)(plane % c);
    float m = mean[ch], inv = rsqrtf(var[ch] + eps), gg = g[ch], bb = b[ch];
    const float *px = x + plane * hw;
    float *py = y + plane * hw;
    for (int i = threadIdx.x; i < hw; i += blockDim.x) {
        float v = gg * (px[i] - m) * inv + bb;
        py[i] = relu && v < 0 ? 0.0f : v;
    }
}
__global__ void g_bn_running(int c, float m, float unbias, const float *mean, const float *var,
                             float *rm, float *rv)
{
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch < c) {
        if (rm)
            rm[ch] = (1.0f - m) * rm[ch] + m * mean[ch];
        if (rv)
            rv[ch] = (1.0f - m) * rv[ch] + m * var[ch] * unbias;
    }
}
__global__ void g_bn_bwd_dx(int c, int hw, float cnt, const float *x, const float *y,
                            const float *dy, const float *gamma, const float *mean,
                            const float *var, float eps, int relu, const float *sg,
                            const float *sgx, float *dx)
{
    size_t plane = blockIdx.x, base = plane * hw;
    int ch = (int)(plane % c);
    float inv = rsqrtf(var[ch] + eps), m = mean[ch], k = gamma[ch] * inv;
    float mg = sg[ch] / cnt, mgx = sgx[ch] / cnt;
    for (int i = threadIdx.x; i < hw; i += blockDim.x) {
        float gv = relu && !(y[base + i] > 0) ? 0.0f : dy[base + i];
        float xh = (x[base + i] - m) * inv;
        dx[base + i] = k * (gv - mg - xh * mgx);
    }
}

/* A descriptor's scratch, made on first use (forward or backward) for its shape. */
typedef struct s_bn_impl {
    int kind;     // 2
    int splits;   // blocks per channel in the sums
    int per;      // images per split
    double *part; // (2 c splits) device partial sums
    float *sums;  // (2c) device: the gradient sums sg, sgx
} s_bn_impl;

static void s_release(void **impl);

static zps_status s_bn_build(const k_bn *d, s_bn_impl *im)
{
    int want = (S_BN_BLOCKS + d->c - 1) / d->c;
    im->splits = want < 1 ? 1 : want > d->n ? d->n : want;
    im->per = (d->n + im->splits - 1) / im->splits;
    im->splits = (d->n + im->per - 1) / im->per; /* none empty */
    S_CUDA(cudaMalloc(&im->part, sizeof(double) * 2 * (size_t)d->c * im->splits));
    S_CUDA(cudaMalloc(&im->sums, sizeof(float) * 2 * (size_t)d->c));
    return ZPS_OK;
}

/* d's scratch, made on first use; a set-up that fails leaves none (the next call tries
 * again), never a half-made one. */
static zps_status s_bn_get(k_bn *d, s_bn_impl **out)
{
    s_bn_impl *im = (s_bn_impl *)d->impl;
    if (!im) {
        im = (s_bn_impl *)calloc(1, sizeof *im);
        if (!im)
            return ZPS_ERR_NOMEM;
        im->kind = 2;
        zps_status st = s_bn_build(d, im);
        if (st != ZPS_OK) {
            void *p = im;
            s_release(&p);
            return st;
        }
        d->impl = im;
    }
    *out = im;
    return ZPS_OK;
}

/* Threads for a block that walks hw values: a warp multiple, at most S_T. */
static unsigned s_plane_threads(int hw) { return hw >= S_T ? S_T : (unsigned)((hw + 31) / 32 * 32); }

static zps_status s_bn_fwd_train(k_bn *d, const float *x, const float *gamma, const float *beta,
                                 float *y, float *mean, float *var, float *rm, float *rv)
{
    s_bn_impl *im;
    S_TRY(s_bn_get(d, &im));
    int hw = d->h * d->w;
    double cnt = (double)d->n * hw;
    g_bn_part<<<dim3(d->c, im->splits), S_T, 0, s_stream>>>(0, d->n, d->c, hw, im->per, x, NULL,
                                                            NULL, NULL, NULL, 0, 0, im->part);
    g_bn_stats_fin<<<(d->c + 127) / 128, 128, 0, s_stream>>>(d->c, im->splits, cnt, im->part,
                                                             mean, var);
    g_bn_apply<<<(unsigned)((size_t)d->n * d->c), s_plane_threads(hw), 0, s_stream>>>(
        d->c, hw, x, gamma, beta, mean, var, d->eps, d->relu, y);
    g_bn_running<<<(d->c + 127) / 128, 128, 0, s_stream>>>(
        d->c, d->momentum, cnt > 1 ? (float)(cnt / (cnt - 1)) : 1.0f, mean, var, rm, rv);
    S_LAUNCHED();
    return ZPS_OK;
}
static zps_status s_bn_fwd_infer(k_bn *d, const float *x, const float *gamma, const float *beta,
                                 const float *rm, const float *rv, float *y)
{
    int hw = d->h * d->w;
    g_bn_apply<<<(unsigned)((size_t)d->n * d->c), s_plane_threads(hw), 0, s_stream>>>(
        d->c, hw, x, gamma, beta, rm, rv, d->eps, d->relu, y);
    S_LAUNCHED();
    return ZPS_OK;
}

static zps_status s_bn_bwd(k_bn *d, const float *x, const float *y, const float *dy,
                           const float *gamma, const float *mean, const float *var, float *dx,
                           float *dgamma, float *dbeta)
{
    s_bn_impl *im;
    S_TRY(s_bn_get(d, &im));
    int hw = d->h * d->w;
    g_bn_part<<<dim3(d->c, im->splits), S_T, 0, s_stream>>>(1, d->n, d->c, hw, im->per, x, y,
                                                            dy, mean, var, d->eps, d->relu,
                                                            im->part);
    g_bn_grad_fin<<<(d->c + 127) / 128, 128, 0, s_stream>>>(d->c, im->splits, im->part,
                                                            im->sums, im->sums + d->c, dgamma,
                                                            dbeta);
    if (dx)
        g_bn_bwd_dx<<<(unsigned)((size_t)d->n * d->c), s_plane_threads(hw), 0, s_stream>>>(
            d->c, hw, (float)((double)d->n * hw), x, y, dy, gamma, mean, var, d->eps, d->relu,
            im->sums, im->sums + d->c, dx);
    S_LAUNCHED();
    return ZPS_OK;
}

/* ---- pooling: one thread per output (forward) / per input (backward) ---- */

__global__ void g_pool_fwd(k_pool d, const float *x, float *y)
{
    size_t total = (size_t)d.n * d.c * d.oh * d.ow;
    S_LOOP(i, total)
    {
        int ox = (int)(i % d.ow), oy = (int)((i / d.ow) % d.oh);
        const float *p = x + (i / ((size_t)d.oh * d.ow)) * d.h * d.w;
        float best = 0;
        int found = 0;
        double acc = 0;
        for (int r = 0; r < d.r; r++) {
            int iy = oy * d.stride_h - d.pad_h + r;
            if (iy < 0 || iy >= d.h)
                continue;
            for (int s = 0; s < d.s; s++) {
                int ix = ox * d.stride_w - d.pad_w + s;
                if (ix < 0 || ix >= d.w)
                    continue;
                float v = p[iy * d.w + ix];
                if (!found || v > best)
                    best = v;
                found = 1;
                acc += v;
            }
        }
        y[i] = d.kind == K_POOL_MAX ? best : (float)(acc / (d.r * d.s));
    }
}
/* Backward per input element: sums the outputs whose window holds it (max: whose argmax it
 * is, first maximum in scan order as in ref). */
__global__ void g_pool_bwd(k_pool d, const float *x, const float *dy, float *dx)
{
    size_t total = (size_t)d.n * d.c * d.h * d.w;
    S_LOOP(i, total)
    {
        int ix = (int)(i % d.w), iy = (int)((i / d.w) % d.h);
        size_t plane = i / ((size_t)d.h * d.w);
        const float *p = x + plane * d.h * d.w;
        const float *g = dy + plane * d.oh * d.ow;
        float acc = 0;
        for (int oy = 0; oy < d.oh; oy++) {
            int y0 = oy * d.stride_h - d.pad_h;
            if (iy < y0 || iy >= y0 + d.r)
                continue;
            for (int ox = 0; ox < d.ow; ox++) {
                int x0 = ox * d.stride_w - d.pad_w;
                if (ix < x0 || ix >= x0 + d.s)
                    continue;
                if (d.kind == K_POOL_AVG) {
                    acc += g[oy * d.ow + ox] / (float)(d.r * d.s);
                    continue;
                }
                int by = -1, bx = -1;
                float bv = 0;
                for (int r = 0; r < d.r; r++) {
                    int yy = y0 + r;
                    if (yy < 0 || yy >= d.h)
                        continue;
                    for (int s = 0; s < d.s; s++) {
                        int xx = x0 + s;
                        if (xx < 0 || xx >= d.w)
                            continue;
                        if (by < 0 || p[yy * d.w + xx] > bv)
                            bv = p[yy * d.w + xx], by = yy, bx = xx;
                    }
                }
                if (by == iy && bx == ix)
                    acc += g[oy * d.ow + ox];
            }
        }
        dx[i] = acc;
    }
}
static zps_status s_pool_fwd(k_pool *d, const float *x, float *y)
{
    g_pool_fwd<<<s_blocks((size_t)d->n * d->c * d->oh * d->ow), S_T, 0, s_stream>>>(*d, x, y);
    S_LAUNCHED();
    return ZPS_OK;
}
static zps_status s_pool_bwd(k_pool *d, const float *x, const float *y, const float *dy, float *dx)
{
    (void)y;
    g_pool_bwd<<<s_blocks((size_t)d->n * d->c * d->h * d->w), S_T, 0, s_stream>>>(*d, x, dy, dx);
    S_LAUNCHED();
    return ZPS_OK;
}

/* ---- dense: cuBLAS (column-major: y^T = w x^T) ---- */

__global__ void g_bias_rows(int n, int out, const float *b, float *y)
{
    S_LOOP(i, (size_t)n * out) y[i] += b[i % out];
}
__global__ void g_col_sums(int n, int out, const float *dy, float *db)
{
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o < out) {
        float acc = 0;
        for (int r = 0; r < n; r++)
            acc += dy[(size_t)r * out + o];
        db[o] += acc;
    }
}
static zps_status s_dense_fwd(k_dense *d, const float *x, const float *w, const float *b, float *y)
{
    float one = 1, zero = 0;
    S_CUBLAS(cublasSgemm(s_cublas, CUBLAS_OP_T, CUBLAS_OP_N, d->out, d->n, d->in, &one, w, d->in,
                         x, d->in, &zero, y, d->out));
    if (b) {
        g_bias_rows<<<s_blocks((size_t)d->n * d->out), S_T, 0, s_stream>>>(d->n, d->out, b, y);
        S_LAUNCHED();
    }
    return ZPS_OK;
}
static zps_status s_dense_bwd(k_dense *d, const float *x, const float *w, const float *dy,
                              float *dx, float *dw, float *db)
{
    float one = 1, zero = 0;
    if (dx) /* dx (n, in) = dy (n, out) . w (out, in) */
        S_CUBLAS(cublasSgemm(s_cublas, CUBLAS_OP_N, CUBLAS_OP_N, d->in, d->n, d->out, &one, w,
                             d->in, dy, d->out, &zero, dx, d->in));
    if (dw) /* dw (out, in) += dy^T . x */
        S_CUBLAS(cublasSgemm(s_cublas, CUBLAS_OP_N, CUBLAS_OP_T, d->in, d->out, d->n, &one, x,
                             d->in, dy, d->out, &one, dw, d->in));
    if (db) {
        g_col_sums<<<(d->out + 127) / 128, 128, 0, s_stream>>>(d->n, d->out, dy, db);
        S_LAUNCHED();
    }
    return ZPS_OK;
}

/* ---- softmax cross-entropy and smooth-L1 (results summed on the host) ---- */

__global__ void g_xent(int n, int k, const float *z, const int32_t *labels, float smooth,
                       float scale, float *rowloss, int *right, float *dz)
{
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n)
        return;
    if (labels[b] < 0 || labels[b] >= k) { /* the host refuses the call: -1 says why */
        rowloss[b] = 0, right[b] = -1;
        return;
    }
    const float *r = z + (size_t)b * k;
    int arg = 0;
    for (int j = 1; j < k; j++)
        if (r[j] > r[arg])
            arg = j;
    double se = 0;
    for (int j = 0; j < k; j++)
        se += exp((double)r[j] - r[arg]);
    double lse = r[arg] + log(se), off = smooth / k, on = 1.0 - smooth + off, l = 0;
    for (int j = 0; j < k; j++) {
        double t = j == labels[b] ? on : off, lp = r[j] - lse;
        l -= t * lp;
        if (dz)
            dz[(size_t)b * k + j] = (float)(scale * (exp(lp) - t) / n);
    }
    rowloss[b] = (float)l;
    right[b] = arg == labels[b];
}
static zps_status s_softmax_xent(int n, int k, const float *z, const int32_t *labels, float smooth,
                                 float scale, float *loss, int *correct, float *dz)
{
    /* per row: a float loss and an int verdict (-1: a label outside [0, k)), on the device
     * and back on the host: one wait for the stream, after the kernel */
    size_t bytes = (sizeof(float) + sizeof(int)) * (size_t)n;
    void *dv, *hv;
    S_TRY(s_scratch(bytes, &dv, &hv));
    float *rl = (float *)dv;
    int *rr = (int *)(rl + n);
    g_xent<<<(n + 127) / 128, 128, 0, s_stream>>>(n, k, z, labels, smooth, scale, rl, rr, dz);
    S_LAUNCHED();
    float *h = (float *)hv;
    S_CUDA(cudaMemcpyAsync(h, rl, bytes, cudaMemcpyDeviceToHost, s_stream));
    S_CUDA(cudaStreamSynchronize(s_stream));
    double t = 0;
    int c = 0;
    for (int i = 0; i < n; i++) {
        int r = ((int *)(h + n))[i];
        if (r < 0)
            return ZPS_ERR_INVALID;
        t += h[i], c += r;
    }
    *loss = (float)(t / n);
    if (correct)
        *correct = c;
    return ZPS_OK;
}

__global__ void g_smooth_l1(size_t n, const float *x, const float *t, float beta, float scale,
                            double *loss, float *dx)
{
    double acc = 0;
    S_LOOP(i, n)
    {
        double d = (double)x[i] - t[i], a = fabs(d), g;
        if (a < beta)
            acc += 0.5 * d * d / beta, g = d / beta;
        else
            acc += a - 0.5 * beta, g = d > 0 ? 1.0 : -1.0;
        if (dx)
            dx[i] = (float)(scale * g);
    }
    atomicAdd(loss, acc);
}
static zps_status s_smooth_l1(size_t n, const float *x, const float *t, float beta, float scale,
                              float *loss, float *dx)
{
    double *d, h = 0;
    zps_status st = s_dev_zero(&d);
    if (st != ZPS_OK)
        return st;
    g_smooth_l1<<<s_blocks(n), S_T, 0, s_stream>>>(n, x, t, beta, scale, d, dx);
    if ((st = s_dev_take(d, &h)) == ZPS_OK)
        *loss = (float)h;
    return st;
}

/* ---- convolution: cuDNN ---- */

/* One convolution's descriptors in one data type, and cuDNN's algorithms for them. */
typedef struct s_conv_set {
    cudnnTensorDescriptor_t x, y;      // input, output
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv; // products summed in float
    cudnnConvolutionFwdAlgo_t fa;
    cudnnConvolutionBwdDataAlgo_t da;
    cudnnConvolutionBwdFilterAlgo_t wa;
} s_conv_set;

typedef struct s_conv_impl {
    int kind;                          // 1
    s_conv_set f;                      // float
    s_conv_set h;                      // bfloat16 on the tensor cores (s_conv_tc)
    int tc;                            // h: 0 not set up; 1 ready; -1 emulated instead
    cudnnTensorDescriptor_t b;         // bias (1, k, 1, 1), float
    size_t ws_need;                    // workspace its algorithms need (both sets)
} s_conv_impl;

/* One workspace for every convolution (s_conv_ws): they all run on the compute stream, one
 * after another, so a per-shape workspace each (about 94 in Inception-v3, some algorithms
 * asking hundreds of MB at batch 128) would only hold memory. Grows to the largest need
 * once, on the first step (cudaFree waits for the device). */
static void *s_ws;
static size_t s_ws_cap;

/* Makes set's descriptors for d in dtype (float or bfloat16; bfloat16 with tensor-op math). */
static zps_status s_conv_set_make(const k_conv2d *d, s_conv_set *set, cudnnDataType_t dt)
{
    S_CUDNN(cudnnCreateTensorDescriptor(&set->x));
    S_CUDNN(cudnnCreateTensorDescriptor(&set->y));
    S_CUDNN(cudnnCreateFilterDescriptor(&set->w));
    S_CUDNN(cudnnCreateConvolutionDescriptor(&set->conv));
    S_CUDNN(cudnnSetTensor4dDescriptor(set->x, CUDNN_TENSOR_NCHW, dt, d->n, d->c, d->h, d->w));
    S_CUDNN(cudnnSetTensor4dDescriptor(set->y, CUDNN_TENSOR_NCHW, dt, d->n, d->k, d->oh, d->ow));
    S_CUDNN(cudnnSetFilter4dDescriptor(set->w, dt, CUDNN_TENSOR_NCHW, d->k, d->c, d->r, d->s));
    S_CUDNN(cudnnSetConvolution2dDescriptor(set->conv, d->pad_h, d->pad_w, d->stride_h, d->stride_w,
                                            1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    if (dt == CUDNN_DATA_BFLOAT16)
        S_CUDNN(cudnnSetConvolutionMathType(set->conv, CUDNN_TENSOR_OP_MATH));
    return ZPS_OK;
}

static void s_conv_set_free(s_conv_set *set)
{
    if (set->x)
        cudnnDestroyTensorDescriptor(set->x);
    if (set->y)
        cudnnDestroyTensorDescriptor(set->y);
    if (set->w)
        cudnnDestroyFilterDescriptor(set->w);
    if (set->conv)
        cudnnDestroyConvolutionDescriptor(set->conv);
}

/* cuDNN's choice of the three algorithms for set (heuristics, once per shape), and the
 * workspace they need in *ws. 0 when it has none for one of them: *st then holds the failed
 * query's status (CUDNN_STATUS_SUCCESS when it answered with no usable algorithm). */
static int s_conv_set_algos(s_conv_set *set, size_t *ws, cudnnStatus_t *st)
{
    int got[3] = {0, 0, 0};
    cudnnConvolutionFwdAlgoPerf_t fp;
    cudnnConvolutionBwdDataAlgoPerf_t dp;
    cudnnConvolutionBwdFilterAlgoPerf_t wp;
    if ((*st = cudnnGetConvolutionForwardAlgorithm_v7(s_cudnn, set->x, set->w, set->conv, set->y, 1, &got[0], &fp)) ||
        (*st = cudnnGetConvolutionBackwardDataAlgorithm_v7(s_cudnn, set->w, set->y, set->conv, set->x, 1, &got[1], &dp)) ||
        (*st = cudnnGetConvolutionBackwardFilterAlgorithm_v7(s_cudnn, set->x, set->y, set->conv, set->w, 1, &got[2], &wp)))
        return 0;
    if (got[0] < 1 || got[1] < 1 || got[2] < 1 || fp.status != CUDNN_STATUS_SUCCESS ||
        dp.status != CUDNN_STATUS_SUCCESS || wp.status != CUDNN_STATUS_SUCCESS)
        return 0;
    set->fa = fp.algo, set->da = dp.algo, set->wa = wp.algo;
    size_t a = 0, b = 0, c = 0;
    if ((*st = cudnnGetConvolutionForwardWorkspaceSize(s_cudnn, set->x, set->w, set->conv, set->y, set->fa, &a)) ||
        (*st = cudnnGetConvolutionBackwardDataWorkspaceSize(s_cudnn, set->w, set->y, set->conv, set->x, set->da, &b)) ||
        (*st = cudnnGetConvolutionBackwardFilterWorkspaceSize(s_cudnn, set->x, set->y, set->conv, set->w, set->wa, &c)))
        return 0;
    *ws = a > b ? (a > c ? a : c) : (b > c ? b : c);
    return 1;
}

/* im's algorithms need bytes of workspace: noted, and the shared one grown to hold them. */
static zps_status s_conv_ws(s_conv_impl *im, size_t bytes)
{
    if (bytes > im->ws_need)
        im->ws_need = bytes;
    return s_grow(&s_ws, &s_ws_cap, im->ws_need, 0);
}

static zps_status s_conv_build(const k_conv2d *d, s_conv_impl *im)
{
    S_TRY(s_conv_set_make(d, &im->f, CUDNN_DATA_FLOAT));
    S_CUDNN(cudnnCreateTensorDescriptor(&im->b));
    S_CUDNN(cudnnSetTensor4dDescriptor(im->b, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, d->k, 1, 1));
    size_t ws = 0;
    cudnnStatus_t cst;
    if (!s_conv_set_algos(&im->f, &ws, &cst)) {
        snprintf(s_err, sizeof s_err, "%s:%d cuDNN has no algorithm for the convolution "
                 "%dx%dx%dx%d * %dx%dx%d (stride %d, pad %d): %s", __FILE__, __LINE__, d->n,
                 d->c, d->h, d->w, d->k, d->r, d->s, d->stride_h, d->pad_h,
                 cst ? cudnnGetErrorString(cst) : "none offered");
        return ZPS_ERR_CUDNN;
    }
    return s_conv_ws(im, ws);
}

/* d's descriptors, algorithms and workspace, made on first use; a set-up that fails leaves
 * none (the next call tries again), never a half-made one. */
static zps_status s_conv_get(k_conv2d *d, s_conv_impl **out)
{
    s_conv_impl *im = (s_conv_impl *)d->impl;
    if (!im) {
        im = (s_conv_impl *)calloc(1, sizeof *im);
        if (!im)
            return ZPS_ERR_NOMEM;
        im->kind = 1;
        zps_status st = s_conv_build(d, im);
        if (st != ZPS_OK) {
            void *p = im;
            s_release(&p);
            return st;
        }
        d->impl = im;
    }
    *out = im;
    return ZPS_OK;
}

/* ---- bf16 convolutions (k_conv2d.bf16) ----
 * On the tensor cores where cuDNN has a BF16 algorithm for the shape (s_conv_tc): x, w and dy
 * are rounded to bfloat16 (common/bf16.h's rounding, g_pack_bf16) into a grow-only scratch,
 * cuDNN multiplies them and sums in float, and writes its result as bfloat16, which is widened
 * back (y and dx overwritten, dw accumulated in float). That is bf16 compute with each conv
 * output rounded once to bfloat16, as PyTorch's autocast does; ref keeps the float sum, so the
 * results differ by that rounding (k_cuda's bf16 tolerance). The bias and its gradient stay
 * float. Otherwise (no algorithm, or ZPS_CUDA_BF16=emulate) emulated: the rounded inputs go
 * through the float convolution at float's speed. With GEMM-type algorithms the products of
 * bf16 values are exact in float and TF32, so that gives ref's results; Winograd and FFT
 * transform the inputs first, so their results are ref's within the float tolerance. */
__global__ void g_bf16(size_t n, const float *x, float *y)
{
    S_LOOP(i, n) y[i] = zps_bf16_round(x[i]); /* common/bf16.h, the host's rounding */
}
__global__ void g_widen_bf16(size_t n, const uint16_t *x, float *y, int acc)
{
    S_LOOP(i, n)
    {
        float v = __uint_as_float((unsigned)x[i] << 16);
        y[i] = acc ? y[i] + v : v;
    }
}
static float *s_bscr;
static size_t s_bscr_cap;
static size_t s_al64(size_t n) { return (n + 63) / 64 * 64; }
/* The inputs of an emulated bf16 convolution, rounded: each (src, n) pair into its own
 * stretch of the scratch; *out[i] = the rounded copy (or NULL for a NULL src). */
static zps_status s_bf16_inputs(int k, const float *const *src, const size_t *n, const float **out)
{
    size_t total = 0;
    for (int i = 0; i < k; i++)
        total += src[i] ? s_al64(n[i]) : 0;
    S_TRY(s_grow((void **)&s_bscr, &s_bscr_cap, total * sizeof(float), 0));
    float *at = s_bscr;
    for (int i = 0; i < k; i++) {
        out[i] = NULL;
        if (!src[i])
            continue;
        g_bf16<<<s_blocks(n[i]), S_T, 0, s_stream>>>(n[i], src[i], at);
        S_LAUNCHED();
        out[i] = at;
        at += s_al64(n[i]);
    }
    return ZPS_OK;
}
/* The tensor-core path's bfloat16 buffers, in the same scratch: out[i] holds n[i] values;
 * those with a src get src packed into them (the others are outputs). */
static zps_status s_bf16_buffers(int k, const float *const *src, const size_t *n, uint16_t **out)
{
    size_t total = 0;
    for (int i = 0; i < k; i++)
        total += s_al64(n[i]);
    S_TRY(s_grow((void **)&s_bscr, &s_bscr_cap, total * sizeof(uint16_t), 0));
    uint16_t *at = (uint16_t *)s_bscr;
    for (int i = 0; i < k; i++) {
        out[i] = at;
        at += s_al64(n[i]);
        if (!src[i] || !n[i])
            continue;
        g_pack_bf16<<<s_blocks(n[i]), S_T, 0, s_stream>>>(n[i], src[i], out[i]);
        S_LAUNCHED();
    }
    return ZPS_OK;
}
static zps_status s_widen(size_t n, const uint16_t *x, float *y, int acc)
{
    g_widen_bf16<<<s_blocks(n), S_T, 0, s_stream>>>(n, x, y, acc);
    S_LAUNCHED();
    return ZPS_OK;
}

static int s_bf16_emulate = -1; // ZPS_CUDA_BF16=emulate: every bf16 convolution emulated

/* The tensor-core set-up of a bf16 convolution, once per shape: im->tc = 1, or -1 (emulated)
 * when cuDNN offers no BF16 algorithm for it or ZPS_CUDA_BF16=emulate. Grows the workspace
 * to what the BF16 algorithms need. */
static zps_status s_conv_tc(const k_conv2d *d, s_conv_impl *im)
{
    if (im->tc)
        return ZPS_OK;
    if (s_bf16_emulate < 0) {
        const char *e = getenv("ZPS_CUDA_BF16");
        s_bf16_emulate = e && strcmp(e, "emulate") == 0;
    }
    if (s_bf16_emulate) {
        im->tc = -1;
        return ZPS_OK;
    }
    zps_status st = s_conv_set_make(d, &im->h, CUDNN_DATA_BFLOAT16);
    size_t ws = 0;
    cudnnStatus_t cst;
    if (st == ZPS_OK && !s_conv_set_algos(&im->h, &ws, &cst)) { /* no BF16 path: emulate */
        im->tc = -1;
        return ZPS_OK;
    }
    if (st == ZPS_OK)
        st = s_conv_ws(im, ws);
    if (st != ZPS_OK) { /* an error, not a missing path: none made, the next call tries again */
        s_conv_set_free(&im->h);
        memset(&im->h, 0, sizeof im->h);
        return st;
    }
    im->tc = 1;
    return ZPS_OK;
}

static zps_status s_conv2d_fwd(k_conv2d *d, const float *x, const float *w, const float *b, float *y)
{
    s_conv_impl *im;
    zps_status st = s_conv_get(d, &im);
    if (st != ZPS_OK)
        return st;
    float one = 1, zero = 0;
    if (d->bf16)
        S_TRY(s_conv_tc(d, im));
    S_TRY(s_grow(&s_ws, &s_ws_cap, im->ws_need, 0)); /* a no-op but after a failed growth */
    if (d->bf16 && im->tc > 0) {
        const float *in[3] = {x, w, NULL};
        size_t n[3] = {(size_t)d->n * d->c * d->h * d->w, (size_t)d->k * d->c * d->r * d->s,
                       (size_t)d->n * d->k * d->oh * d->ow};
        uint16_t *h[3];
        S_TRY(s_bf16_buffers(3, in, n, h));
        S_CUDNN(cudnnConvolutionForward(s_cudnn, &one, im->h.x, h[0], im->h.w, h[1], im->h.conv,
                                        im->h.fa, s_ws, s_ws_cap, &zero, im->h.y, h[2]));
        S_TRY(s_widen(n[2], h[2], y, 0));
    } else {
        if (d->bf16) {
            const float *in[2] = {x, w}, *r[2];
            size_t n[2] = {(size_t)d->n * d->c * d->h * d->w, (size_t)d->k * d->c * d->r * d->s};
            S_TRY(s_bf16_inputs(2, in, n, r));
            x = r[0], w = r[1];
        }
        S_CUDNN(cudnnConvolutionForward(s_cudnn, &one, im->f.x, x, im->f.w, w, im->f.conv, im->f.fa,
                                        s_ws, s_ws_cap, &zero, im->f.y, y));
    }
    if (b)
        S_CUDNN(cudnnAddTensor(s_cudnn, &one, im->b, b, &one, im->f.y, y));
    return ZPS_OK;
}

/* Backward on the tensor cores: dy, w, x packed; dx and dw come back as bfloat16. */
static zps_status s_conv2d_bwd_tc(k_conv2d *d, s_conv_impl *im, const float *x, const float *w,
                                  const float *dy, float *dx, float *dw)
{
    float one = 1, zero = 0;
    size_t nx = (size_t)d->n * d->c * d->h * d->w, nw = (size_t)d->k * d->c * d->r * d->s;
    const float *in[5] = {dy, dx ? w : NULL, dw ? x : NULL, NULL, NULL};
    size_t n[5] = {(size_t)d->n * d->k * d->oh * d->ow, dx ? nw : 0, dw ? nx : 0, dx ? nx : 0,
                   dw ? nw : 0};
    uint16_t *h[5]; // dy, w, x, dx, dw
    S_TRY(s_bf16_buffers(5, in, n, h));
    if (dx) {
        S_CUDNN(cudnnConvolutionBackwardData(s_cudnn, &one, im->h.w, h[1], im->h.y, h[0],
                                             im->h.conv, im->h.da, s_ws, s_ws_cap, &zero,
                                             im->h.x, h[3]));
        S_TRY(s_widen(nx, h[3], dx, 0));
    }
    if (dw) { /* accumulate: the bfloat16 result added to dw in float */
        S_CUDNN(cudnnConvolutionBackwardFilter(s_cudnn, &one, im->h.x, h[2], im->h.y, h[0],
                                               im->h.conv, im->h.wa, s_ws, s_ws_cap, &zero,
                                               im->h.w, h[4]));
        S_TRY(s_widen(nw, h[4], dw, 1));
    }
    return ZPS_OK;
}

static zps_status s_conv2d_bwd(k_conv2d *d, const float *x, const float *w, const float *dy,
                               float *dx, float *dw, float *db)
{
    s_conv_impl *im;
    zps_status st = s_conv_get(d, &im);
    if (st != ZPS_OK)
        return st;
    float one = 1, zero = 0;
    if (db) /* the float sum of dy, bf16 or not: before dy is rounded */
        S_CUDNN(cudnnConvolutionBackwardBias(s_cudnn, &one, im->f.y, dy, &one, im->b, db));
    if (d->bf16)
        S_TRY(s_conv_tc(d, im));
    S_TRY(s_grow(&s_ws, &s_ws_cap, im->ws_need, 0));
    if (d->bf16 && im->tc > 0)
        return s_conv2d_bwd_tc(d, im, x, w, dy, dx, dw);
    if (d->bf16) {
        const float *in[3] = {dx ? w : NULL, dw ? x : NULL, dy}, *r[3];
        size_t n[3] = {(size_t)d->k * d->c * d->r * d->s, (size_t)d->n * d->c * d->h * d->w,
                       (size_t)d->n * d->k * d->oh * d->ow};
        S_TRY(s_bf16_inputs(3, in, n, r));
        w = r[0], x = r[1], dy = r[2];
    }
    if (dx)
        S_CUDNN(cudnnConvolutionBackwardData(s_cudnn, &one, im->f.w, w, im->f.y, dy, im->f.conv, im->f.da,
                                             s_ws, s_ws_cap, &zero, im->f.x, dx));
    if (dw) /* beta = 1: accumulate */
        S_CUDNN(cudnnConvolutionBackwardFilter(s_cudnn, &one, im->f.x, x, im->f.y, dy, im->f.conv,
                                               im->f.wa, s_ws, s_ws_cap, &one, im->f.w, dw));
    return ZPS_OK;
}

static void s_release(void **impl)
{
    int *kind = (int *)*impl;
    if (!kind)
        return;
    if (*kind == 1) {
        s_conv_impl *im = (s_conv_impl *)*impl;
        s_conv_set_free(&im->f);
        s_conv_set_free(&im->h);
        if (im->b)
            cudnnDestroyTensorDescriptor(im->b);
    } else if (*kind == 2) {
        cudaFree(((s_bn_impl *)*impl)->part);
        cudaFree(((s_bn_impl *)*impl)->sums);
    }
    free(*impl);
    *impl = NULL;
}

static k_backend s_cuda;

/* The device, its two streams, and cuDNN and cuBLAS on the compute stream; 0 on failure
 * (s_err says which step). */
static int s_open(int device)
{
    s_device = device;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&s_stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&s_copy, cudaStreamNonBlocking) != cudaSuccess) {
        snprintf(s_err, sizeof s_err, "cannot open CUDA device %d or create its streams: %s",
                 device, cudaGetErrorString(cudaGetLastError()));
        return 0;
    }
    if (cudnnCreate(&s_cudnn) != CUDNN_STATUS_SUCCESS ||
        cudnnSetStream(s_cudnn, s_stream) != CUDNN_STATUS_SUCCESS ||
        cublasCreate(&s_cublas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(s_cublas, s_stream) != CUBLAS_STATUS_SUCCESS) {
        snprintf(s_err, sizeof s_err, "cannot initialise cuDNN or cuBLAS on CUDA device %d",
                 device);
        return 0;
    }
    return 1;
}

extern "C" const struct k_backend *k_cuda_backend(int device)
{
    static int done, ok, on;
    if (done) {
        if (ok && device != on) {
            snprintf(s_err, sizeof s_err, "the CUDA back-end runs on device %d already; a "
                     "process uses one device (asked for %d)", on, device);
            return NULL;
        }
        return ok ? &s_cuda : NULL;
    }
    done = 1, on = device;
    if (!s_open(device))
        return NULL;
    s_cuda.name = "cuda";
    s_cuda.host_memory = 0;
    s_cuda.alloc = s_alloc;
    s_cuda.free = s_free;
    s_cuda.copy_in = s_copy_in;
    s_cuda.copy_out = s_copy_out;
    s_cuda.release = s_release;
    s_cuda.prefers_blocked = NULL;
    s_cuda.host_alloc = s_host_alloc;
    s_cuda.host_free = s_host_free;
    s_cuda.copy_in_async = s_copy_in_async;
    s_cuda.copy_out_async = s_copy_out_async;
    s_cuda.event_new = s_event_new;
    s_cuda.event_free = s_event_free;
    s_cuda.event_record = s_event_record;
    s_cuda.event_wait = s_event_wait;
    s_cuda.event_sync = s_event_sync;
    s_cuda.conv2d_fwd = s_conv2d_fwd;
    s_cuda.conv2d_bwd = s_conv2d_bwd;
    s_cuda.bn_fwd_train = s_bn_fwd_train;
    s_cuda.bn_fwd_infer = s_bn_fwd_infer;
    s_cuda.bn_bwd = s_bn_bwd;
    s_cuda.pool_fwd = s_pool_fwd;
    s_cuda.pool_bwd = s_pool_bwd;
    s_cuda.dense_fwd = s_dense_fwd;
    s_cuda.dense_bwd = s_dense_bwd;
    s_cuda.relu_fwd = s_relu_fwd;
    s_cuda.relu_bwd = s_relu_bwd;
    s_cuda.concat_fwd = s_concat_fwd;
    s_cuda.concat_bwd = s_concat_bwd;
    s_cuda.dropout_fwd = s_dropout_fwd;
    s_cuda.dropout_bwd = s_dropout_bwd;
    s_cuda.softmax_xent = s_softmax_xent;
    s_cuda.smooth_l1 = s_smooth_l1;
    s_cuda.fill = s_fill;
    s_cuda.add = s_add;
    s_cuda.scale = s_scale;
    s_cuda.axpy = s_axpy;
    s_cuda.sum = s_sum;
    s_cuda.sumsq = s_sumsq;
    s_cuda.optim_apply = s_optim_apply;
    s_cuda.pack_bf16 = s_pack_bf16;
    ok = 1;
    return &s_cuda;
}
