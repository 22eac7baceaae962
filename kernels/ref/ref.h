/* ref.h — the plain-C reference back-end: obviously correct loops, the oracle for every other
 * back-end and for finite-difference checks. Single-threaded, no blocking or vectorisation
 * tricks, plain NCHW only (no blocked layouts). k_backend_ref() (kernels.h) is its table,
 * defined in ref.c next to the functions below, which match the table entries (backend.h) one
 * to one. They are public so that another host-memory back-end can name them explicitly in
 * its own table for the ops it does not accelerate: the cpu back-end does so for relu, concat,
 * dropout, the losses, the elementwise ops and the reductions, and for its host memory.
 *
 * Backward ops accumulate (+=) into parameter gradients and overwrite input gradients.
 */
#ifndef ZPS_KERNELS_REF_REF_H
#define ZPS_KERNELS_REF_REF_H

#include "kernels/backend.h"

/* Host memory: 64-byte aligned (zps_xaligned: out of memory aborts), memmove copies. */
void *k_ref_alloc(size_t bytes);
void k_ref_free(void *p);
zps_status k_ref_copy(void *dst, const void *src, size_t bytes);

zps_status k_ref_conv2d_fwd(k_conv2d *d, const float *x, const float *w, const float *b,
                            float *y);
zps_status k_ref_conv2d_bwd(k_conv2d *d, const float *x, const float *w, const float *dy,
                            float *dx, float *dw, float *db);
zps_status k_ref_bn_fwd_train(k_bn *d, const float *x, const float *gamma, const float *beta,
                              float *y, float *mean, float *var, float *run_mean,
                              float *run_var);
zps_status k_ref_bn_fwd_infer(k_bn *d, const float *x, const float *gamma, const float *beta,
                              const float *run_mean, const float *run_var, float *y);
zps_status k_ref_bn_bwd(k_bn *d, const float *x, const float *y, const float *dy,
                        const float *gamma, const float *mean, const float *var, float *dx,
                        float *dgamma, float *dbeta);
zps_status k_ref_pool_fwd(k_pool *d, const float *x, float *y);
zps_status k_ref_pool_bwd(k_pool *d, const float *x, const float *y, const float *dy,
                          float *dx);
zps_status k_ref_dense_fwd(k_dense *d, const float *x, const float *w, const float *b,
                           float *y);
zps_status k_ref_dense_bwd(k_dense *d, const float *x, const float *w, const float *dy,
                           float *dx, float *dw, float *db);
zps_status k_ref_relu_fwd(size_t n, const float *x, float *y);
zps_status k_ref_relu_bwd(size_t n, const float *y, const float *dy, float *dx);
zps_status k_ref_concat_fwd(int n, int hw, int nin, const int *c, const float *const *xs,
                            float *y);
zps_status k_ref_concat_bwd(int n, int hw, int nin, const int *c, const float *dy,
                            float *const *dxs);
zps_status k_ref_dropout_fwd(size_t n, float p, uint64_t seed, const float *x, float *y);
zps_status k_ref_dropout_bwd(size_t n, float p, uint64_t seed, const float *dy, float *dx);
zps_status k_ref_softmax_xent(int n, int classes, const float *logits, const int32_t *labels,
                              float smoothing, float grad_scale, float *loss, int *correct,
                              float *dlogits);
zps_status k_ref_smooth_l1(size_t n, const float *x, const float *target, float beta,
                           float grad_scale, float *loss, float *dx);
zps_status k_ref_fill(size_t n, float v, float *y);
zps_status k_ref_add(size_t n, const float *a, const float *b, float *y);
zps_status k_ref_scale(size_t n, float alpha, float *x);
zps_status k_ref_axpy(size_t n, float alpha, const float *x, float *y);
zps_status k_ref_sum(size_t n, const float *x, double *out);
zps_status k_ref_sumsq(size_t n, const float *x, double *out);

#endif
