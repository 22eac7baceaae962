/* conv.cu — the CUDA back-end's convolutions (kernels/kernels.h k_conv2d): cuDNN, in float
 * and, for k_conv2d.bf16, on the BF16 tensor cores; and the bfloat16 packing (k_pack_bf16)
 * they share with the trainer's bf16 pushes. Every cuDNN call of the library is here.
 *
 * A descriptor's cuDNN state (s_conv_impl) is made on its first use, once per shape: a float
 * set of descriptors and algorithms (cuDNN's heuristics, checked), and a BF16 set on first
 * bf16 use. Each of the three operations takes the first of cuDNN's candidates that cuDNN
 * reports usable and can size the workspace of, with that candidate's math type, which is
 * set on the convolution descriptor before the operation runs (the three may differ). A
 * float algorithm cuDNN refuses when it runs is replaced by the next candidate (s_run_f). A
 * BF16 set that cuDNN refuses (no candidate, no workspace, or a refusal when it runs) leaves
 * that shape emulated (below; the first such shape is said on stderr). Every convolution
 * shares one grow-only workspace and one grow-only bf16 scratch: they all run on the compute stream, one after another. Backward
 * accumulates (+=) into dw and db and overwrites dx.
 */
#include <cudnn.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_int.h"

#define KC_CUDNN(expr)                                                                 \
    KC_CHECK(cudnnStatus_t, CUDNN_STATUS_SUCCESS, cudnnGetErrorString, ZPS_ERR_CUDNN, expr)

static cudnnHandle_t s_cudnn;

zps_status k_cuda_conv_open(void)
{
    KC_CUDNN(cudnnCreate(&s_cudnn));
    KC_CUDNN(cudnnSetStream(s_cudnn, k_cuda_stream));
    return ZPS_OK;
}

/* The PS wire's bfloat16 bits (common/bf16.h), for gradients that leave as --push-dtype bf16. */
__global__ void g_pack_bf16(size_t n, const float *x, uint16_t *y)
{
    KC_LOOP(i, n) y[i] = zps_bf16_bits(x[i]);
}
zps_status k_cuda_pack_bf16(size_t n, const float *x, uint16_t *y)
{
    if (!n)
        return ZPS_OK;
    g_pack_bf16<<<kc_blocks(n), KC_T, 0, k_cuda_stream>>>(n, x, y);
    KC_LAUNCHED();
    return ZPS_OK;
}


/* The three operations of a convolution (s_conv_set.algo and .math are indexed by them). */
enum { S_FWD, S_BWD_DATA, S_BWD_FILTER, S_OPS };

/* One convolution's descriptors in one data type, and cuDNN's algorithms for them. */
typedef struct s_conv_set {
    cudnnTensorDescriptor_t x, y;      // input, output
    cudnnFilterDescriptor_t w;
    cudnnConvolutionDescriptor_t conv; // products summed in float; math type per operation
    int algo[S_OPS];                   // cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t
    cudnnMathType_t math[S_OPS];
    unsigned refused[S_OPS];           // bit a: algorithm a refused when it ran (s_run_f; a
                                       // value is below its *_ALGO_COUNT <= S_MAX_CANDS)
} s_conv_set;

typedef struct s_conv_impl {
    int kind;                          // KC_IMPL_CONV
    s_conv_set f;                      // float
    s_conv_set h;                      // bfloat16 on the tensor cores (s_conv_tc)
    int tc;                            // h: 0 not set up; 1 ready; -1 emulated instead
    cudnnTensorDescriptor_t b;         // bias (1, k, 1, 1), float
    size_t ws_need;                    // workspace its algorithms need (both sets)
} s_conv_impl;

/* One workspace for every convolution (s_conv_set_fit): they all run on the compute stream, one
 * after another, so a per-shape workspace each (about 94 in Inception-v3, some algorithms
 * asking hundreds of MB at batch 128) would only hold memory. Grows to the largest need
 * once, on the first step (cudaFree waits for the device). */
static void *s_ws;
static size_t s_ws_cap;

/* Makes set's descriptors for d in dtype (float or bfloat16; bfloat16 with tensor-op math). */
static zps_status s_conv_set_make(const k_conv2d *d, s_conv_set *set, cudnnDataType_t dt)
{
    KC_CUDNN(cudnnCreateTensorDescriptor(&set->x));
    KC_CUDNN(cudnnCreateTensorDescriptor(&set->y));
    KC_CUDNN(cudnnCreateFilterDescriptor(&set->w));
    KC_CUDNN(cudnnCreateConvolutionDescriptor(&set->conv));
    KC_CUDNN(cudnnSetTensor4dDescriptor(set->x, CUDNN_TENSOR_NCHW, dt, d->n, d->c, d->h, d->w));
    KC_CUDNN(cudnnSetTensor4dDescriptor(set->y, CUDNN_TENSOR_NCHW, dt, d->n, d->k, d->oh, d->ow));
    KC_CUDNN(cudnnSetFilter4dDescriptor(set->w, dt, CUDNN_TENSOR_NCHW, d->k, d->c, d->r, d->s));
    KC_CUDNN(cudnnSetConvolution2dDescriptor(set->conv, d->pad_h, d->pad_w, d->stride_h, d->stride_w,
                                            1, 1, CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
    if (dt == CUDNN_DATA_BFLOAT16)
        KC_CUDNN(cudnnSetConvolutionMathType(set->conv, CUDNN_TENSOR_OP_MATH));
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

/* One of cuDNN's candidate algorithms for an operation (its perf struct, whatever the op). */
typedef struct s_cand {
    int algo;
    cudnnStatus_t status;
    cudnnMathType_t math;
} s_cand;
#define S_MAX_CANDS 16 /* more than any *_ALGO_COUNT (8, 6, 7 in cuDNN 9) */
static_assert(CUDNN_CONVOLUTION_FWD_ALGO_COUNT <= S_MAX_CANDS &&
                  CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT <= S_MAX_CANDS &&
                  CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT <= S_MAX_CANDS,
              "S_MAX_CANDS holds every candidate cuDNN may return");
static_assert(S_MAX_CANDS <= 32, "s_conv_set.refused has a bit for every algorithm");

/* cuDNN's candidates for operation op of set (heuristics, best first) into c, *n of them. */
static cudnnStatus_t s_candidates(const s_conv_set *set, int op, s_cand *c, int *n)
{
    cudnnStatus_t st;
    *n = 0;
    if (op == S_FWD) {
        cudnnConvolutionFwdAlgoPerf_t p[S_MAX_CANDS];
        st = cudnnGetConvolutionForwardAlgorithm_v7(s_cudnn, set->x, set->w, set->conv, set->y,
                                                    CUDNN_CONVOLUTION_FWD_ALGO_COUNT, n, p);
        for (int i = 0; st == CUDNN_STATUS_SUCCESS && i < *n; i++)
            c[i] = (s_cand){(int)p[i].algo, p[i].status, p[i].mathType};
    } else if (op == S_BWD_DATA) {
        cudnnConvolutionBwdDataAlgoPerf_t p[S_MAX_CANDS];
        st = cudnnGetConvolutionBackwardDataAlgorithm_v7(s_cudnn, set->w, set->y, set->conv,
                                                         set->x,
                                                         CUDNN_CONVOLUTION_BWD_DATA_ALGO_COUNT,
                                                         n, p);
        for (int i = 0; st == CUDNN_STATUS_SUCCESS && i < *n; i++)
            c[i] = (s_cand){(int)p[i].algo, p[i].status, p[i].mathType};
    } else {
        cudnnConvolutionBwdFilterAlgoPerf_t p[S_MAX_CANDS];
        st = cudnnGetConvolutionBackwardFilterAlgorithm_v7(s_cudnn, set->x, set->y, set->conv,
                                                           set->w,
                                                           CUDNN_CONVOLUTION_BWD_FILTER_ALGO_COUNT,
                                                           n, p);
        for (int i = 0; st == CUDNN_STATUS_SUCCESS && i < *n; i++)
            c[i] = (s_cand){(int)p[i].algo, p[i].status, p[i].mathType};
    }
    return st;
}

/* The workspace operation op of set needs with algorithm algo (under the math type set on
 * set->conv). */
static cudnnStatus_t s_workspace(const s_conv_set *set, int op, int algo, size_t *bytes)
{
    if (op == S_FWD)
        return cudnnGetConvolutionForwardWorkspaceSize(s_cudnn, set->x, set->w, set->conv,
                                                       set->y, (cudnnConvolutionFwdAlgo_t)algo,
                                                       bytes);
    if (op == S_BWD_DATA)
        return cudnnGetConvolutionBackwardDataWorkspaceSize(
            s_cudnn, set->w, set->y, set->conv, set->x, (cudnnConvolutionBwdDataAlgo_t)algo,
            bytes);
    return cudnnGetConvolutionBackwardFilterWorkspaceSize(
        s_cudnn, set->x, set->y, set->conv, set->w, (cudnnConvolutionBwdFilterAlgo_t)algo,
        bytes);
}

/* The math type a set's queries start from, and the candidates it takes. cuDNN's _v7
 * heuristics offer only what the descriptor's math type allows (CUDNN_FMA_MATH set by one
 * operation's candidate would hide the tensor cores from the next operation's query), so
 * every query starts from the set's base. A float set starts from CUDNN_DEFAULT_MATH (TF32
 * allowed, as PyTorch's default) and refuses CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION (float
 * data rounded to half precision); a BF16 set takes CUDNN_TENSOR_OP_MATH only (FMA is no
 * tensor core, ALLOW_CONVERSION would round bfloat16 to half's narrower range). */
static cudnnMathType_t s_base_math(int bf16)
{
    return bf16 ? CUDNN_TENSOR_OP_MATH : CUDNN_DEFAULT_MATH;
}
static int s_math_taken(int bf16, cudnnMathType_t m)
{
    return bf16 ? m == CUDNN_TENSOR_OP_MATH : m != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION;
}

/* cuDNN's choice of the three algorithms for set (heuristics, once per shape): for each
 * operation the first candidate cuDNN reports usable, in a math type the set takes
 * (s_math_taken), not refused before (s_run_f), whose workspace it can size under that math
 * type and is at most limit bytes. The workspace they need in *ws. 0 when an operation has
 * none: *st then holds the failed query's status (CUDNN_STATUS_SUCCESS when cuDNN answered with no usable
 * candidate). */
static int s_conv_set_algos(s_conv_set *set, int bf16, size_t limit, size_t *ws,
                            cudnnStatus_t *st)
{
    size_t need = 0;
    for (int op = 0; op < S_OPS; op++) {
        s_cand c[S_MAX_CANDS];
        int n = 0, found = 0;
        if ((*st = cudnnSetConvolutionMathType(set->conv, s_base_math(bf16))) !=
                CUDNN_STATUS_SUCCESS ||
            (*st = s_candidates(set, op, c, &n)) != CUDNN_STATUS_SUCCESS)
            return 0;
        for (int i = 0; i < n && !found; i++) {
            size_t b = 0;
            if (c[i].status != CUDNN_STATUS_SUCCESS || !s_math_taken(bf16, c[i].math) ||
                (set->refused[op] >> c[i].algo & 1u) ||
                cudnnSetConvolutionMathType(set->conv, c[i].math) != CUDNN_STATUS_SUCCESS ||
                s_workspace(set, op, c[i].algo, &b) != CUDNN_STATUS_SUCCESS || b > limit)
                continue;
            set->algo[op] = c[i].algo;
            set->math[op] = c[i].math;
            need = b > need ? b : need;
            found = 1;
        }
        if (!found) {
            *st = CUDNN_STATUS_SUCCESS;
            return 0;
        }
    }
    *ws = need;
    return 1;
}

/* set's algorithms (s_conv_set_algos) with the shared workspace grown to hold them (noted in
 * im->ws_need). The heuristics rank by speed, not memory: when the workspace of the fastest
 * cannot be had (a large FFT's at batch 128, beside the model), the choice is made again
 * under a smaller limit, down to the algorithms that need none. 0 when nothing fits (*st as
 * s_conv_set_algos's; CUDNN_STATUS_ALLOC_FAILED when it was the workspace). */
static int s_conv_set_fit(s_conv_impl *im, s_conv_set *set, int bf16, cudnnStatus_t *st)
{
    size_t limit = SIZE_MAX, ws = 0;
    for (;;) {
        if (!s_conv_set_algos(set, bf16, limit, &ws, st)) {
            if (limit != SIZE_MAX && *st == CUDNN_STATUS_SUCCESS)
                *st = CUDNN_STATUS_ALLOC_FAILED;
            return 0;
        }
        size_t need = ws > im->ws_need ? ws : im->ws_need;
        if (k_cuda_grow(&s_ws, &s_ws_cap, need, 0) == ZPS_OK) { /* a failure clears CUDA's error */
            im->ws_need = need;
            return 1;
        }
        if (ws == 0 || ws <= im->ws_need) { /* the other set's need failed: nothing smaller helps */
            *st = CUDNN_STATUS_ALLOC_FAILED;
            return 0;
        }
        limit = ws - 1;
    }
}

static zps_status s_conv_build(const k_conv2d *d, s_conv_impl *im)
{
    ZPS_TRY(s_conv_set_make(d, &im->f, CUDNN_DATA_FLOAT));
    KC_CUDNN(cudnnCreateTensorDescriptor(&im->b));
    KC_CUDNN(cudnnSetTensor4dDescriptor(im->b, CUDNN_TENSOR_NCHW, CUDNN_DATA_FLOAT, 1, d->k, 1, 1));
    cudnnStatus_t cst;
    if (!s_conv_set_fit(im, &im->f, 0, &cst)) {
        snprintf(k_cuda_err, sizeof k_cuda_err, "%s:%d cuDNN has no algorithm for the convolution "
                 "%dx%dx%dx%d * %dx%dx%d (stride %dx%d, pad %dx%d)%s: %s", __FILE__, __LINE__,
                 d->n, d->c, d->h, d->w, d->k, d->r, d->s, d->stride_h, d->stride_w, d->pad_h,
                 d->pad_w, cst == CUDNN_STATUS_ALLOC_FAILED ? " whose workspace fits" : "",
                 cst ? cudnnGetErrorString(cst) : "none offered");
        return ZPS_ERR_CUDNN;
    }
    return ZPS_OK;
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
        im->kind = KC_IMPL_CONV;
        zps_status st = s_conv_build(d, im);
        if (st != ZPS_OK) {
            k_cuda_conv_release(im);
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
    KC_LOOP(i, n) y[i] = zps_bf16_round(x[i]); /* common/bf16.h, the host's rounding */
}
__global__ void g_widen_bf16(size_t n, const uint16_t *x, float *y, int acc)
{
    KC_LOOP(i, n)
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
    ZPS_TRY(k_cuda_grow((void **)&s_bscr, &s_bscr_cap, total * sizeof(float), 0));
    float *at = s_bscr;
    for (int i = 0; i < k; i++) {
        out[i] = NULL;
        if (!src[i])
            continue;
        g_bf16<<<kc_blocks(n[i]), KC_T, 0, k_cuda_stream>>>(n[i], src[i], at);
        KC_LAUNCHED();
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
    ZPS_TRY(k_cuda_grow((void **)&s_bscr, &s_bscr_cap, total * sizeof(uint16_t), 0));
    uint16_t *at = (uint16_t *)s_bscr;
    for (int i = 0; i < k; i++) {
        out[i] = at;
        at += s_al64(n[i]);
        if (!src[i] || !n[i])
            continue;
        g_pack_bf16<<<kc_blocks(n[i]), KC_T, 0, k_cuda_stream>>>(n[i], src[i], out[i]);
        KC_LAUNCHED();
    }
    return ZPS_OK;
}
static zps_status s_widen(size_t n, const uint16_t *x, float *y, int acc)
{
    g_widen_bf16<<<kc_blocks(n), KC_T, 0, k_cuda_stream>>>(n, x, y, acc);
    KC_LAUNCHED();
    return ZPS_OK;
}

static int s_bf16_emulate = -1; // ZPS_CUDA_BF16=emulate: every bf16 convolution emulated

/* cuDNN refusing a request (a parameter, shape or type it does not take: the status ranges
 * 2000-3999 of cuDNN 9), as opposed to failing in itself (internal, execution). */
static int s_refused(cudnnStatus_t c)
{
    return c >= CUDNN_STATUS_BAD_PARAM && c < CUDNN_STATUS_INTERNAL_ERROR;
}

/* Marks d's shape emulated (im->tc = -1) where cuDNN refused its BF16 path (what: the set-up
 * or the operation refused; c: cuDNN's status, CUDNN_STATUS_SUCCESS for none offered), and
 * says so on stderr for the first such shape of the process: bf16 then runs at float's speed,
 * which a benchmark's figure alone would not show (the library has no logger of its own).
 * ZPS_CUDA_BF16=emulate asks for it and is not said. */
static int s_emulated_said;
static void s_emulated(const k_conv2d *d, s_conv_impl *im, const char *what, cudnnStatus_t c)
{
    im->tc = -1;
    if (s_emulated_said++)
        return;
    fprintf(stderr, "zps cuda: bf16 convolution %dx%dx%dx%d * %dx%dx%d emulated in float "
            "(cuDNN's BF16 %s: %s); later shapes that are emulated are not said\n", d->n, d->c,
            d->h, d->w, d->k, d->r, d->s, what,
            c == CUDNN_STATUS_SUCCESS ? "no algorithm offered, or its workspace"
                                      : cudnnGetErrorString(c));
}

/* The tensor-core set-up of a bf16 convolution, once per shape: im->tc = 1, or -1 (emulated)
 * when cuDNN offers no BF16 algorithm for it, the workspace they need cannot be had, or
 * ZPS_CUDA_BF16=emulate. */
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
    cudnnStatus_t cst;
    if (st == ZPS_OK && !s_conv_set_fit(im, &im->h, 1, &cst)) {
        /* None offered, no workspace for any, or a refusal of the request: no BF16 path,
         * emulate (a failed growth freed the workspace: each call grows it back to
         * ws_need before it runs). cuDNN failing in itself (internal, execution,
         * initialisation) is an error. */
        if (cst == CUDNN_STATUS_SUCCESS || cst == CUDNN_STATUS_ALLOC_FAILED || s_refused(cst)) {
            s_emulated(d, im, "set-up", cst);
            return ZPS_OK;
        }
        snprintf(k_cuda_err, sizeof k_cuda_err, "%s:%d cuDNN's BF16 algorithms for the "
                 "convolution %dx%dx%dx%d * %dx%dx%d: %s", __FILE__, __LINE__, d->n, d->c,
                 d->h, d->w, d->k, d->r, d->s, cudnnGetErrorString(cst));
        st = ZPS_ERR_CUDNN;
    }
    if (st != ZPS_OK) { /* an error, not a missing path: none made, the next call tries again */
        s_conv_set_free(&im->h);
        memset(&im->h, 0, sizeof im->h);
        return st;
    }
    im->tc = 1;
    return ZPS_OK;
}

/* Operation op of set with its algorithm and math type: y = a (*) b + beta * y, a and b
 * being (x, w) forward, (w, dy) backward-data and (x, dy) backward-filter. */
static cudnnStatus_t s_run(const s_conv_set *set, int op, const void *a, const void *b,
                           float beta, void *out)
{
    float one = 1;
    cudnnStatus_t c = cudnnSetConvolutionMathType(set->conv, set->math[op]);
    if (c != CUDNN_STATUS_SUCCESS)
        return c;
    if (op == S_FWD)
        return cudnnConvolutionForward(s_cudnn, &one, set->x, a, set->w, b, set->conv,
                                       (cudnnConvolutionFwdAlgo_t)set->algo[op], s_ws, s_ws_cap,
                                       &beta, set->y, out);
    if (op == S_BWD_DATA)
        return cudnnConvolutionBackwardData(s_cudnn, &one, set->w, a, set->y, b, set->conv,
                                            (cudnnConvolutionBwdDataAlgo_t)set->algo[op], s_ws,
                                            s_ws_cap, &beta, set->x, out);
    return cudnnConvolutionBackwardFilter(s_cudnn, &one, set->x, a, set->y, b, set->conv,
                                          (cudnnConvolutionBwdFilterAlgo_t)set->algo[op], s_ws,
                                          s_ws_cap, &beta, set->w, out);
}

static const char *const s_op_name[S_OPS] = {"forward", "backward-data", "backward-filter"};

/* Operation op of d's float set, as s_run, on the next of cuDNN's candidates where cuDNN
 * refuses the chosen one when it runs: the heuristics only predict (the legacy API has listed
 * algorithms that then refuse a shape, and PyTorch too tries the next one). A refused
 * algorithm stays out of that operation's choice for the shape; the call fails when none is
 * left, or when cuDNN fails in itself. A refusal runs nothing, so the retry sees out as it
 * was (beta = 1 accumulates once). */
static zps_status s_run_f(const k_conv2d *d, s_conv_impl *im, int op, const void *a,
                          const void *b, float beta, void *out)
{
    for (;;) {
        cudnnStatus_t c = s_run(&im->f, op, a, b, beta, out);
        if (c == CUDNN_STATUS_SUCCESS)
            return ZPS_OK;
        int algo = im->f.algo[op];
        cudnnStatus_t cst = c;
        if (s_refused(c)) {
            (void)cudaGetLastError();
            im->f.refused[op] |= 1u << algo;
            if (s_conv_set_fit(im, &im->f, 0, &cst))
                continue;
        }
        snprintf(k_cuda_err, sizeof k_cuda_err, "%s:%d cuDNN's %s of the convolution "
                 "%dx%dx%dx%d * %dx%dx%d with algorithm %d: %s%s%s", __FILE__, __LINE__,
                 s_op_name[op], d->n, d->c, d->h, d->w, d->k, d->r, d->s, algo,
                 cudnnGetErrorString(c), s_refused(c) ? "; no other algorithm: " : "",
                 s_refused(c) ? (cst ? cudnnGetErrorString(cst) : "none offered") : "");
        return ZPS_ERR_CUDNN;
    }
}

/* A BF16 execution that did not succeed: a refusal makes the shape emulated from now on
 * (ZPS_OK: the caller emulates this call too); a failure of cuDNN itself is the error. */
static zps_status s_tc_failed(const k_conv2d *d, s_conv_impl *im, cudnnStatus_t c, int op)
{
    if (s_refused(c)) {
        (void)cudaGetLastError();
        s_emulated(d, im, s_op_name[op], c);
        return ZPS_OK;
    }
    snprintf(k_cuda_err, sizeof k_cuda_err, "%s:%d cuDNN's BF16 %s of the convolution "
             "%dx%dx%dx%d * %dx%dx%d: %s", __FILE__, __LINE__, s_op_name[op], d->n, d->c, d->h,
             d->w, d->k, d->r, d->s, cudnnGetErrorString(c));
    return ZPS_ERR_CUDNN;
}

/* Forward on the tensor cores: x and w packed, y back from bfloat16. *done = 0 when cuDNN
 * refused it (the shape is emulated from now on). */
static zps_status s_conv2d_fwd_tc(k_conv2d *d, s_conv_impl *im, const float *x, const float *w,
                                  float *y, int *done)
{
    const float *in[3] = {x, w, NULL};
    size_t n[3] = {(size_t)d->n * d->c * d->h * d->w, (size_t)d->k * d->c * d->r * d->s,
                   (size_t)d->n * d->k * d->oh * d->ow};
    uint16_t *h[3];
    ZPS_TRY(s_bf16_buffers(3, in, n, h));
    cudnnStatus_t c = s_run(&im->h, S_FWD, h[0], h[1], 0.0f, h[2]);
    *done = c == CUDNN_STATUS_SUCCESS;
    if (!*done)
        return s_tc_failed(d, im, c, S_FWD);
    return s_widen(n[2], h[2], y, 0);
}

zps_status k_cuda_conv2d_fwd(k_conv2d *d, const float *x, const float *w, const float *b, float *y)
{
    s_conv_impl *im;
    zps_status st = s_conv_get(d, &im);
    if (st != ZPS_OK)
        return st;
    float one = 1;
    if (d->bf16)
        ZPS_TRY(s_conv_tc(d, im));
    ZPS_TRY(k_cuda_grow(&s_ws, &s_ws_cap, im->ws_need, 0)); /* a no-op but after a failed growth */
    int done = 0;
    if (d->bf16 && im->tc > 0)
        ZPS_TRY(s_conv2d_fwd_tc(d, im, x, w, y, &done));
    if (!done) {
        if (d->bf16) {
            const float *in[2] = {x, w}, *r[2];
            size_t n[2] = {(size_t)d->n * d->c * d->h * d->w, (size_t)d->k * d->c * d->r * d->s};
            ZPS_TRY(s_bf16_inputs(2, in, n, r));
            x = r[0], w = r[1];
        }
        ZPS_TRY(s_run_f(d, im, S_FWD, x, w, 0.0f, y));
    }
    if (b)
        KC_CUDNN(cudnnAddTensor(s_cudnn, &one, im->b, b, &one, im->f.y, y));
    return ZPS_OK;
}

/* Backward on the tensor cores: dy, w, x packed; dx and dw come back as bfloat16 (dx
 * overwritten, dw accumulated in float). *done = 0 when cuDNN refused a part: the shape is
 * emulated from now on, and the caller redoes the whole backward (dw is touched only by a
 * part that succeeded, and then by nothing after it). */
static zps_status s_conv2d_bwd_tc(k_conv2d *d, s_conv_impl *im, const float *x, const float *w,
                                  const float *dy, float *dx, float *dw, int *done)
{
    size_t nx = (size_t)d->n * d->c * d->h * d->w, nw = (size_t)d->k * d->c * d->r * d->s;
    const float *in[5] = {dy, dx ? w : NULL, dw ? x : NULL, NULL, NULL};
    size_t n[5] = {(size_t)d->n * d->k * d->oh * d->ow, dx ? nw : 0, dw ? nx : 0, dx ? nx : 0,
                   dw ? nw : 0};
    uint16_t *h[5]; // dy, w, x, dx, dw
    ZPS_TRY(s_bf16_buffers(5, in, n, h));
    *done = 0;
    cudnnStatus_t c;
    if (dx) {
        if ((c = s_run(&im->h, S_BWD_DATA, h[1], h[0], 0.0f, h[3])) != CUDNN_STATUS_SUCCESS)
            return s_tc_failed(d, im, c, S_BWD_DATA);
    }
    if (dw) {
        if ((c = s_run(&im->h, S_BWD_FILTER, h[2], h[0], 0.0f, h[4])) != CUDNN_STATUS_SUCCESS)
            return s_tc_failed(d, im, c, S_BWD_FILTER);
    }
    if (dx)
        ZPS_TRY(s_widen(nx, h[3], dx, 0));
    if (dw) /* accumulate: the bfloat16 result added to dw in float */
        ZPS_TRY(s_widen(nw, h[4], dw, 1));
    *done = 1;
    return ZPS_OK;
}

zps_status k_cuda_conv2d_bwd(k_conv2d *d, const float *x, const float *w, const float *dy,
                             float *dx, float *dw, float *db)
{
    s_conv_impl *im;
    zps_status st = s_conv_get(d, &im);
    if (st != ZPS_OK)
        return st;
    float one = 1;
    if (d->bf16)
        ZPS_TRY(s_conv_tc(d, im));
    ZPS_TRY(k_cuda_grow(&s_ws, &s_ws_cap, im->ws_need, 0));
    if (db) /* the float sum of dy, bf16 or not: before dy is rounded; after what can fail
             * before any output is touched, so a failed call leaves db as it was */
        KC_CUDNN(cudnnConvolutionBackwardBias(s_cudnn, &one, im->f.y, dy, &one, im->b, db));
    if (d->bf16 && im->tc > 0) {
        int done = 0;
        ZPS_TRY(s_conv2d_bwd_tc(d, im, x, w, dy, dx, dw, &done));
        if (done)
            return ZPS_OK;
    }
    if (d->bf16) {
        const float *in[3] = {dx ? w : NULL, dw ? x : NULL, dy}, *r[3];
        size_t n[3] = {(size_t)d->k * d->c * d->r * d->s, (size_t)d->n * d->c * d->h * d->w,
                       (size_t)d->n * d->k * d->oh * d->ow};
        ZPS_TRY(s_bf16_inputs(3, in, n, r));
        w = r[0], x = r[1], dy = r[2];
    }
    if (dx)
        ZPS_TRY(s_run_f(d, im, S_BWD_DATA, w, dy, 0.0f, dx));
    if (dw) /* beta = 1: accumulate */
        ZPS_TRY(s_run_f(d, im, S_BWD_FILTER, x, dy, 1.0f, dw));
    return ZPS_OK;
}

void k_cuda_conv_release(void *impl)
{
    s_conv_impl *im = (s_conv_impl *)impl;
    if (!im)
        return;
    s_conv_set_free(&im->f);
    s_conv_set_free(&im->h);
    if (im->b)
        cudnnDestroyTensorDescriptor(im->b);
    free(im);
}
