/* dense.cu — the CUDA back-end's fully connected layers (kernels/kernels.h k_dense): cuBLAS
 * SGEMMs in column-major terms (y^T = w x^T), the bias and its gradient by small kernels.
 * Every cuBLAS call of the library is here. Backward accumulates (+=) into dw and db and
 * overwrites dx.
 */
#include <cublas_v2.h>

#include "kernels/cuda/cuda_int.h"

#define KC_CUBLAS(expr)                                                                \
    KC_CHECK(cublasStatus_t, CUBLAS_STATUS_SUCCESS, cublasGetStatusString, ZPS_ERR_CUBLAS, expr)

static cublasHandle_t s_cublas;

zps_status k_cuda_dense_open(void)
{
    KC_CUBLAS(cublasCreate(&s_cublas));
    KC_CUBLAS(cublasSetStream(s_cublas, k_cuda_stream));
    return ZPS_OK;
}

__global__ void g_bias_rows(int n, int out, const float *b, float *y)
{
    KC_LOOP(i, (size_t)n * out) y[i] += b[i % out];
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
zps_status k_cuda_dense_fwd(k_dense *d, const float *x, const float *w, const float *b, float *y)
{
    float one = 1, zero = 0;
    KC_CUBLAS(cublasSgemm(s_cublas, CUBLAS_OP_T, CUBLAS_OP_N, d->out, d->n, d->in, &one, w, d->in,
                         x, d->in, &zero, y, d->out));
    if (b) {
        g_bias_rows<<<kc_blocks((size_t)d->n * d->out), KC_T, 0, k_cuda_stream>>>(d->n, d->out, b, y);
        KC_LAUNCHED();
    }
    return ZPS_OK;
}
zps_status k_cuda_dense_bwd(k_dense *d, const float *x, const float *w, const float *dy,
                            float *dx, float *dw, float *db)
{
    float one = 1, zero = 0;
    if (dx) /* dx (n, in) = dy (n, out) . w (out, in) */
        KC_CUBLAS(cublasSgemm(s_cublas, CUBLAS_OP_N, CUBLAS_OP_N, d->in, d->n, d->out, &one, w,
                             d->in, dy, d->out, &zero, dx, d->in));
    if (dw) /* dw (out, in) += dy^T . x */
        KC_CUBLAS(cublasSgemm(s_cublas, CUBLAS_OP_N, CUBLAS_OP_T, d->in, d->out, d->n, &one, x,
                             d->in, dy, d->out, &one, dw, d->in));
    if (db) {
        g_col_sums<<<(d->out + 127) / 128, 128, 0, k_cuda_stream>>>(d->n, d->out, dy, db);
        KC_LAUNCHED();
    }
    return ZPS_OK;
}

