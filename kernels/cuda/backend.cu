/* backend.cu — the CUDA back-end (kernels/backend.h): its table (k_cuda_backend), the device
 * and its streams, memory, the asynchronous group, and the ops that need neither cuDNN nor
 * cuBLAS nor their own file: elementwise ops, the optimizer, reductions, concat, dropout and
 * the losses, written to the ref back-end's exact semantics (the same dropout hash, the same
 * update as ps_optim_apply). Convolutions are in conv.cu, dense layers in dense.cu,
 * batchnorm and pooling in bn_pool.cu (cuda_int.h lists the files).
 *
 * Everything runs on one device per process (k_cuda_backend's argument, an index among the
 * devices CUDA_VISIBLE_DEVICES leaves visible): the ops, cuDNN and cuBLAS on the back-end's
 * compute stream, the asynchronous copies (backend.h's group) on two copy streams, one per
 * direction, all three non-blocking and ordered against each other by events only;
 * copy_in/copy_out run on the compute stream and synchronise it. Tensors are device
 * pointers; losses and reductions come back to the host (synchronising the compute stream). Every CUDA, cuDNN and cuBLAS call that
 * an op's result depends on, and every kernel launch, is checked (cuda_int.h's KC_CHECK); the
 * failure's text is kept in k_cuda_err (k_cuda_last_error returns it) and the call returns
 * ZPS_ERR_CUDA/CUDNN/CUBLAS. Not checked, on purpose: frees and descriptor destruction on
 * release and error paths, whose failure leaves nothing to undo. Allocation failure in the
 * table's alloc is its NULL return. Backward ops accumulate (+=) into parameter gradients and
 * overwrite input gradients. Nothing is allocated per call on the step path: reductions and
 * losses use one grow-only device and pinned-host scratch (s_scratch); conv.cu and bn_pool.cu
 * keep theirs per shape or grow-only likewise. No blocked layouts (prefers_blocked is NULL).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/cuda_int.h"
#include "kernels/cuda/loss_math.h"

char k_cuda_err[256];
cudaStream_t k_cuda_stream; // the compute stream: every op and the synchronous copies
static cudaStream_t s_in;   // the host-to-device copy stream: copy_in_async (K_QUEUE_IN)
static cudaStream_t s_out;  // the device-to-host copy stream: copy_out_async (K_QUEUE_OUT)

extern "C" const char *k_cuda_last_error(void) { return k_cuda_err; }

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
    KC_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, k_cuda_stream));
    KC_CUDA(cudaStreamSynchronize(k_cuda_stream));
    return ZPS_OK;
}
static zps_status s_copy_out(void *dst, const void *src, size_t n)
{
    KC_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, k_cuda_stream));
    KC_CUDA(cudaStreamSynchronize(k_cuda_stream));
    return ZPS_OK;
}

/* ---- the asynchronous group: pinned host memory, the copy streams, events ---- */

static void *s_host_alloc(size_t n)
{
    void *p = NULL;
    if (cudaHostAlloc(&p, n ? n : 64, cudaHostAllocDefault) == cudaSuccess)
        return p;
    (void)cudaGetLastError();
    return NULL;
}
/* Pinned memory goes back only after the copy and compute streams drained (an early stop can
 * free a batch or mirror buffer with a read-ahead still queued): cudaFreeHost is not
 * documented to wait for it. Frees are rare, so the wait costs nothing on the step path. */
static void s_host_free(void *p)
{
    if (!p)
        return;
    (void)cudaStreamSynchronize(s_in);
    (void)cudaStreamSynchronize(s_out);
    (void)cudaStreamSynchronize(k_cuda_stream);
    cudaFreeHost(p);
}
static zps_status s_copy_in_async(void *dst, const void *src, size_t n)
{
    KC_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s_in));
    return ZPS_OK;
}
static zps_status s_copy_out_async(void *dst, const void *src, size_t n)
{
    KC_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s_out));
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
        snprintf(k_cuda_err, sizeof k_cuda_err, "cudaEventCreateWithFlags: %s", cudaGetErrorString(r));
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
static cudaStream_t s_queue(int q)
{
    return q == K_QUEUE_IN ? s_in : q == K_QUEUE_OUT ? s_out : k_cuda_stream;
}
static zps_status s_event_record(k_event *e, int q)
{
    KC_CUDA(cudaEventRecord(e->ev, s_queue(q)));
    return ZPS_OK;
}
static zps_status s_event_wait(int q, k_event *e)
{
    KC_CUDA(cudaStreamWaitEvent(s_queue(q), e->ev, 0));
    return ZPS_OK;
}
/* Also called from other threads (trainer/stage.c's staging thread): the thread is put on
 * this back-end's device first, or CUDA would make a context on device 0 for it. */
static zps_status s_event_sync(k_event *e)
{
    KC_CUDA(cudaSetDevice(s_device));
    KC_CUDA(cudaEventSynchronize(e->ev));
    return ZPS_OK;
}

/* ---- elementwise ---- */

__global__ void g_fill(size_t n, float v, float *y) { KC_LOOP(i, n) y[i] = v; }
__global__ void g_add(size_t n, const float *a, const float *b, float *y) { KC_LOOP(i, n) y[i] = a[i] + b[i]; }
__global__ void g_scale(size_t n, float a, float *x) { KC_LOOP(i, n) x[i] *= a; }
__global__ void g_axpy(size_t n, float a, const float *x, float *y) { KC_LOOP(i, n) y[i] += a * x[i]; }
__global__ void g_relu(size_t n, const float *x, float *y) { KC_LOOP(i, n) y[i] = x[i] > 0 ? x[i] : 0.0f; }
__global__ void g_relu_bwd(size_t n, const float *y, const float *dy, float *dx)
{
    KC_LOOP(i, n) dx[i] = y[i] > 0 ? dy[i] : 0.0f;
}
/* Adds every thread's acc of the block to *out: a tree in shared memory (KC_T is a power of
 * two), then one atomic per block, not one per thread (16.7 M on the one address for a large
 * n). Every thread of the block must call it. */
__device__ void kc_block_add(double acc, double *out)
{
    __shared__ double part[KC_T];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned s = KC_T / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s)
            part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        atomicAdd(out, part[0]);
}

__global__ void g_sum(size_t n, const float *x, int sq, double *out)
{
    double acc = 0;
    KC_LOOP(i, n) acc += sq ? (double)x[i] * x[i] : (double)x[i];
    kc_block_add(acc, out);
}

__global__ void g_dropout(size_t n, uint64_t thr, float keep, uint64_t seed, const float *x, float *y)
{
    KC_LOOP(i, n) y[i] = (uint64_t)k_hash_u32(seed, i) < thr ? 0.0f : x[i] * keep;
}

/* One grid-stride kernel over n elements on the compute stream, launch checked. */
#define S_ELEMWISE(kernel, n, ...)                                                     \
    do {                                                                               \
        kernel<<<kc_blocks(n), KC_T, 0, k_cuda_stream>>>((n), __VA_ARGS__);             \
        KC_LAUNCHED();                                                                 \
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
    case ZPS_OPTK_SGD: KC_LOOP(i, n) zps_opt_sgd(&s, &w[i], g[i]); break;
    case ZPS_OPTK_MOMENTUM:
        if (s.nesterov)
            KC_LOOP(i, n) zps_opt_nesterov(&s, &w[i], &s0[i], g[i]);
        else
            KC_LOOP(i, n) zps_opt_momentum(&s, &w[i], &s0[i], g[i]);
        break;
    case ZPS_OPTK_RMSPROP: KC_LOOP(i, n) zps_opt_rmsprop(&s, &w[i], &s0[i], &s1[i], g[i]); break;
    case ZPS_OPTK_ADAM: KC_LOOP(i, n) zps_opt_adam(&s, &w[i], &s0[i], &s1[i], g[i]); break;
    case ZPS_OPTK_ADAGRAD: KC_LOOP(i, n) zps_opt_adagrad(&s, &w[i], &s0[i], g[i]); break;
    }
}
static zps_status s_optim_apply(const zps_optim_step *s, size_t n, float *w, float *s0, float *s1,
                                const float *g)
{
    if (!n)
        return ZPS_OK;
    S_ELEMWISE(g_optim, n, *s, w, s0, s1, g);
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
zps_status k_cuda_grow(void **buf, size_t *cap, size_t bytes, int host)
{
    if (bytes <= *cap)
        return ZPS_OK;
    if (*buf)
        KC_CUDA(host ? cudaFreeHost(*buf) : cudaFree(*buf));
    *buf = NULL, *cap = 0;
    size_t want = bytes < 4096 ? 4096 : bytes;
    cudaError_t r = host ? cudaMallocHost(buf, want) : cudaMalloc(buf, want);
    if (r != cudaSuccess) { /* cleared, or the next launch check would report it as its own */
        (void)cudaGetLastError();
        *buf = NULL;
        snprintf(k_cuda_err, sizeof k_cuda_err, "%s:%d %s of %zu bytes: %s", __FILE__, __LINE__,
                 host ? "cudaMallocHost" : "cudaMalloc", want, cudaGetErrorString(r));
        return ZPS_ERR_CUDA;
    }
    *cap = want;
    return ZPS_OK;
}
static zps_status s_scratch(size_t bytes, void **dev, void **host)
{
    if (dev)
        ZPS_TRY(k_cuda_grow(&s_dscr, &s_dscr_cap, bytes, 0));
    if (host)
        ZPS_TRY(k_cuda_grow(&s_hscr, &s_hscr_cap, bytes, 1));
    if (dev)
        *dev = s_dscr;
    if (host)
        *host = s_hscr;
    return ZPS_OK;
}
/* A zeroed device double (scratch) for a kernel to accumulate into. */
static zps_status s_dev_zero(double **d)
{
    ZPS_TRY(s_scratch(sizeof(double), (void **)d, NULL));
    KC_CUDA(cudaMemsetAsync(*d, 0, sizeof(double), k_cuda_stream));
    return ZPS_OK;
}
/* After the kernel that accumulated into d: its launch status, then d's value into *out. */
static zps_status s_dev_take(double *d, double *out)
{
    KC_CUDA(cudaGetLastError());
    KC_CUDA(cudaMemcpyAsync(out, d, sizeof(double), cudaMemcpyDeviceToHost, k_cuda_stream));
    KC_CUDA(cudaStreamSynchronize(k_cuda_stream));
    return ZPS_OK;
}
static zps_status s_reduce(size_t n, const float *x, int sq, double *out)
{
    double *d;
    zps_status st = s_dev_zero(&d);
    if (st != ZPS_OK)
        return st;
    g_sum<<<kc_blocks(n), KC_T, 0, k_cuda_stream>>>(n, x, sq, d);
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
                KC_CUDA(cudaMemcpy2DAsync(parts[i], w, (char *)cat + off, pitch, w, (size_t)n,
                                    cudaMemcpyDeviceToDevice, k_cuda_stream));
            else
                KC_CUDA(cudaMemcpy2DAsync((char *)cat + off, pitch, parts[i], w, w, (size_t)n,
                                    cudaMemcpyDeviceToDevice, k_cuda_stream));
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
    k_xent_row(k, z + (size_t)b * k, labels[b], smooth, scale, n,
               dz ? dz + (size_t)b * k : NULL, &rowloss[b], &right[b]);
}
static zps_status s_softmax_xent(int n, int k, const float *z, const int32_t *labels, float smooth,
                                 float scale, float *loss, int *correct, float *dz)
{
    if (n <= 0) { /* ref's answer for no rows (a grid of no blocks is a launch error) */
        *loss = NAN;
        if (correct)
            *correct = 0;
        return ZPS_OK;
    }
    /* per row: a float loss and an int verdict (-1: a label outside [0, k)), on the device
     * and back on the host: one wait for the stream, after the kernel. A bad label is
     * refused after the other rows' dlogits were written (kernels.h allows it: nn checks
     * the labels on the host first, so the step path pays no second pass for it) */
    size_t bytes = (sizeof(float) + sizeof(int)) * (size_t)n;
    void *dv, *hv;
    ZPS_TRY(s_scratch(bytes, &dv, &hv));
    float *rl = (float *)dv;
    int *rr = (int *)(rl + n);
    g_xent<<<(n + 127) / 128, 128, 0, k_cuda_stream>>>(n, k, z, labels, smooth, scale, rl, rr, dz);
    KC_LAUNCHED();
    float *h = (float *)hv;
    KC_CUDA(cudaMemcpyAsync(h, rl, bytes, cudaMemcpyDeviceToHost, k_cuda_stream));
    KC_CUDA(cudaStreamSynchronize(k_cuda_stream));
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
    KC_LOOP(i, n)
    {
        float g;
        acc += k_smooth_l1_el(x[i], t[i], beta, scale, &g);
        if (dx)
            dx[i] = g;
    }
    kc_block_add(acc, loss);
}
static zps_status s_smooth_l1(size_t n, const float *x, const float *t, float beta, float scale,
                              float *loss, float *dx)
{
    double *d, h = 0;
    zps_status st = s_dev_zero(&d);
    if (st != ZPS_OK)
        return st;
    g_smooth_l1<<<kc_blocks(n), KC_T, 0, k_cuda_stream>>>(n, x, t, beta, scale, d, dx);
    if ((st = s_dev_take(d, &h)) == ZPS_OK)
        *loss = (float)h;
    return st;
}

static void s_release(void **impl)
{
    int *kind = (int *)*impl;
    if (!kind)
        return;
    if (*kind == KC_IMPL_CONV)
        k_cuda_conv_release(*impl);
    else /* KC_IMPL_BN: no other op keeps state */
        k_cuda_bn_release(*impl);
    *impl = NULL;
}

static k_backend s_cuda;

/* The device, its three streams, and cuDNN and cuBLAS on the compute stream; 0 on failure
 * (k_cuda_err says which step). */
static int s_open(int device)
{
    s_device = device;
    if (cudaSetDevice(device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&k_cuda_stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&s_in, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&s_out, cudaStreamNonBlocking) != cudaSuccess) {
        snprintf(k_cuda_err, sizeof k_cuda_err, "cannot open CUDA device %d or create its streams: %s",
                 device, cudaGetErrorString(cudaGetLastError()));
        return 0;
    }
    return k_cuda_conv_open() == ZPS_OK && k_cuda_dense_open() == ZPS_OK; /* k_cuda_err says */
}

extern "C" const struct k_backend *k_cuda_backend(int device)
{
    static int done, ok;
    if (done) {
        if (ok && device != s_device) {
            snprintf(k_cuda_err, sizeof k_cuda_err, "the CUDA back-end runs on device %d already; a "
                     "process uses one device (asked for %d)", s_device, device);
            return NULL;
        }
        return ok ? &s_cuda : NULL;
    }
    done = 1;
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
    s_cuda.conv2d_fwd = k_cuda_conv2d_fwd;
    s_cuda.conv2d_bwd = k_cuda_conv2d_bwd;
    s_cuda.bn_fwd_train = k_cuda_bn_fwd_train;
    s_cuda.bn_fwd_infer = k_cuda_bn_fwd_infer;
    s_cuda.bn_bwd = k_cuda_bn_bwd;
    s_cuda.pool_fwd = k_cuda_pool_fwd;
    s_cuda.pool_bwd = k_cuda_pool_bwd;
    s_cuda.dense_fwd = k_cuda_dense_fwd;
    s_cuda.dense_bwd = k_cuda_dense_bwd;
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
    s_cuda.pack_bf16 = k_cuda_pack_bf16;
    ok = 1;
    return &s_cuda;
}
