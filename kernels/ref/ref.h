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

/* The ops, with the table entries' signatures (backend.h). */
k_conv2d_fwd_fn k_ref_conv2d_fwd;
k_conv2d_bwd_fn k_ref_conv2d_bwd;
k_bn_fwd_train_fn k_ref_bn_fwd_train;
k_bn_fwd_infer_fn k_ref_bn_fwd_infer;
k_bn_bwd_fn k_ref_bn_bwd;
k_pool_fwd_fn k_ref_pool_fwd;
k_pool_bwd_fn k_ref_pool_bwd;
k_dense_fwd_fn k_ref_dense_fwd;
k_dense_bwd_fn k_ref_dense_bwd;
k_relu_fwd_fn k_ref_relu_fwd;
k_relu_bwd_fn k_ref_relu_bwd;
k_concat_fwd_fn k_ref_concat_fwd;
k_concat_bwd_fn k_ref_concat_bwd;
k_dropout_fwd_fn k_ref_dropout_fwd;
k_dropout_bwd_fn k_ref_dropout_bwd;
k_softmax_xent_fn k_ref_softmax_xent;
k_smooth_l1_fn k_ref_smooth_l1;
k_fill_fn k_ref_fill;
k_add_fn k_ref_add;
k_scale_fn k_ref_scale;
k_axpy_fn k_ref_axpy;
k_optim_apply_fn k_ref_optim_apply;
k_sum_fn k_ref_sum;
k_sumsq_fn k_ref_sumsq;
k_pack_bf16_fn k_ref_pack_bf16;

/* Table entries (backend.h) for host memory and for the ops that do not care about layout:
 * elementwise over n*c*h*w floats, concat by per-image chunks, losses and reductions. ref's
 * table uses them, and so does any host-memory back-end that runs these ops as ref does, so
 * that its table names ref's functions in one visible place (cpu's does). */
#define K_REF_HOST_MEMORY_ENTRIES                                                      \
    .alloc = k_ref_alloc, .free = k_ref_free, .copy_in = k_ref_copy, .copy_out = k_ref_copy
#define K_REF_LAYOUT_FREE_ENTRIES                                                      \
    .relu_fwd = k_ref_relu_fwd, .relu_bwd = k_ref_relu_bwd, .concat_fwd = k_ref_concat_fwd,    \
    .concat_bwd = k_ref_concat_bwd, .dropout_fwd = k_ref_dropout_fwd,                  \
    .dropout_bwd = k_ref_dropout_bwd, .softmax_xent = k_ref_softmax_xent,              \
    .smooth_l1 = k_ref_smooth_l1, .fill = k_ref_fill, .add = k_ref_add,                \
    .scale = k_ref_scale, .axpy = k_ref_axpy, .sum = k_ref_sum, .sumsq = k_ref_sumsq,                    \
    .optim_apply = k_ref_optim_apply, .pack_bf16 = k_ref_pack_bf16

#endif
