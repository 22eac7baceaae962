/* nn_int.h — what the files of trainer/nn share; not part of the API (that is nn.h).
 *
 *   graph.c    building: layer calls, loss heads, variable tables, initialisation, finish,
 *              introspection, destroy;
 *   memplan.c  the memory plan: layouts, op descriptors, activation and gradient buffers for
 *              one batch size;
 *   recompute.c gradient checkpointing: the segments and the backward that reruns them;
 *   nn.c       the step: forward, loss heads, backward with its gradient hooks;
 *   weights.c  the weights file format and model save/load;
 *   external.c outputs whose loss is computed outside nn: marking, the forward without
 *              heads, reading them, and the backward from gradients injected into them.
 *
 * Invariants every file relies on:
 *   - nodes run forward in the order they were added and backward in reverse; a node's
 *     variables are declared when it is added, so backward completes variables in decreasing
 *     table order and each node's range [var0, var0 + nvars) is contiguous;
 *   - every tensor has at most one producer; tensor 0 is the input (no gradient buffer
 *     unless input_grad: has_dx says which tensors have one);
 *   - plan_n != 0 means every tensor's x (and dx where has_dx), every node's descriptors and
 *     scratch, tmp_pre and tmp_acc point into the block planned for plan_n samples.
 */
#ifndef ZPS_TRAINER_NN_NN_INT_H
#define ZPS_TRAINER_NN_NN_INT_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/mem.h"

#include "trainer/nn/nn.h"

enum { NN_MAX_IN = 8, NN_MAX_HEADS = 4, NN_MAX_OUTS = 16 };

typedef enum nn_kind {
    NN_CONV_BN,
    NN_MAXPOOL,
    NN_AVGPOOL,
    NN_GAP,
    NN_CONCAT,
    NN_DROPOUT,
    NN_DENSE,
    NN_CONV         // convolution with bias, nothing after it (detector heads)
} nn_kind;

typedef struct nn_tensor {
    char name[96];   // name of the producing layer ("input" for tensor 0)
    int c, h, w;     // per-sample shape
    float *x;        // (n, c, h, w) activation, planned
    float *dx;       // gradient, planned (shares the gradient pool)
    int dx_set;      // gradient written this backward
    int has_dx;      // the plan gave it a gradient buffer
    int blocked;     // kept in the back-end's blocked layout (kernels.h)
    int local;       // recompute: lives in its segment's shared region (recompute.c)
} nn_tensor;

typedef struct nn_node {
    nn_kind kind;
    char name[96];
    int in[NN_MAX_IN];  // input tensor ids
    int nin;            // number of inputs
    int out;            // output tensor id
    int train_only;     // skipped in evaluation
    int k, r, s, sh, sw, ph, pw; // conv / pool geometry (k: out channels or features)
    int relu;           // dense: ReLU after
    float p;            // dropout rate
    float std;          // init standard deviation
    size_t var0, nvars; // range in the variable table
    size_t stat0;       // first statistic (batchnorm)
    k_conv2d conv;      // planned descriptors
    k_bn bn;
    k_pool pool;
    k_dense dense;
    int fuse;           // planned (memplan.c): CONV_BN, 1 + the max-pool node its training
                        // forward and backward run with it (k_bn_pool_fwd); MAXPOOL, -1
                        // when its producer runs it so; else 0
    float *pre;         // conv output before batchnorm (n, k, oh, ow)
    float *mean, *var;  // batch statistics (k)
    uint64_t seed;      // dropout seed of the last forward
    int seg;            // recompute: its segment (recompute.c; 0 without)
} nn_node;

typedef struct nn_head {
    int t;        // logits tensor
    float weight; // loss weight
} nn_head;

struct nn_model {
    const k_backend *be;
    nn_tensor *t;           // tensors (nt)
    int nt, cap_t;
    nn_node *nodes;         // layers (nn)
    int nn, cap_n;
    nn_head heads[NN_MAX_HEADS];
    int nheads;
    int outs[NN_MAX_OUTS];  // tensors marked by nn_model_output, in marking order
    int nouts;
    int input_grad;         // the plan gives the input a gradient (nn_model_set_input_grad)
    nn_var *vars, *stats;   // tables
    size_t nvars, nstats, cap_v, cap_s;
    size_t nparams, nstatf; // floats
    float *params, *grads, *statbuf;
    int train_only;         // current building section
    zps_status err;         // first building error
    int finished;
    /* plan (memplan.c) */
    int plan_n;             // batch size planned (0: none)
    int plan_infer;         // the plan is an inference plan (nn_plan)
    int fwd_n;              // rows of the last forward (<= plan_n; nn_forward_in)
    size_t plan_bytes;
    zps_arena *arena;       // host back-ends
    void *dev_block;        // non-host back-ends
    float *tmp_pre;         // conv+bn: gradient before batchnorm
    float *tmp_acc;         // gradient of a tensor already set, before adding
    int32_t *labels;        // device copy of labels (non-host back-ends)
    int32_t *labels_host;   // back-ends with queues: the labels' pinned staging, and the
    struct k_event *labels_in; // end of their copy (s_batch_in)
    float *input_plan;      // the plan's own input buffer (tensor 0's x when copying in)
    const float *input_next; // nn_model_set_input: the next forward reads its batch here
    int recompute;          // nn_model_set_recompute: plan with segments (recompute.c)
    int bf16;               // nn_model_set_bf16: convolutions in bf16 compute
    int nseg;               // segments of the plan (1: no recompute)
    float *tmp_stats;       // recompute: running statistics a rerun writes and nobody reads
    int recomputing;        // a segment's forward is running again
    /* step (nn.c) */
    int have_forward;       // a training forward ran since the last backward
    uint64_t step;          // training forwards so far (dropout seeds)
    uint64_t seed;          // init seed
    nn_grad_hook fwd_hook;  // called before a layer with parameters runs forward
    void *fwd_ctx;
    float bn_momentum;      // > 0: batchnorm momentum of training forwards (0: the 0.1 planned)
    void *scratch;          // nn_model_scratch: host bytes, grown, reused, freed with m
    size_t scratch_cap;
    float *relayout;        // host floats between a device and a blocked layout (external.c)
    size_t relayout_cap;    // its capacity in floats (grown, reused, freed with m)
};

/* Floats of tensor t for n samples. */
static inline size_t nn_tensor_floats(const nn_model *m, int t, int n)
{
    return (size_t)n * m->t[t].c * m->t[t].h * m->t[t].w;
}

/* memplan.c: makes plan_n == n and plan_infer == infer (nothing to do when they already
 * are). An inference plan (infer) holds what a forward with train=0 needs and no more: no
 * gradients, activations sharing space by liveness (only the input, the loss heads and the
 * marked outputs keep their values after the forward). On failure no plan is left
 * (plan_n == 0). */
zps_status nn_plan(nn_model *m, int n, int infer);
/* memplan.c: whether an inference plan keeps tensor t's values after the forward (the input,
 * the loss heads, the marked outputs); the others' space goes to later tensors. */
int nn_kept_by_inference(const nn_model *m, int t);
/* nn.c: runs the nodes forward on the batch already in tensor 0 (plan made). */
zps_status nn_forward_nodes(nn_model *m, int train);
/* memplan.c: everything the plans took (descriptors, block, label buffer); for destroy. */
void nn_plan_free(nn_model *m);
/* nn.c: one node's forward (train: batch statistics, dropout, the fused pool); one node's
 * backward: its gradient range zeroed, its ops where a gradient reached its output, then the
 * hook. */
zps_status nn_node_fwd(nn_model *m, nn_node *nd, int train);
/* nn.c: what nn_model_set_input gave (NULL: nothing), taken by a forward at its start so
 * that it serves that forward only, even one that fails early; then the plan a forward of n
 * samples runs on, and the batch into tensor 0: in_place read as it is, else host x copied
 * into the plan's buffer. A training forward needs a training plan of exactly n (batch
 * statistics see every row). An inference forward runs on any plan of at least n rows (its
 * rows are independent, so the first n come out the same) with the rows past n zeroed, and
 * makes an inference plan only where there is none: an evaluation in the training batch
 * makes no plan of its own, nor does its last partial batch or the one image drawn (on a
 * device: no memory freed and taken again, no descriptor rebuilt, twice per evaluation). */
const float *nn_input_take(nn_model *m);
zps_status nn_forward_in(nn_model *m, const float *x, const float *in_place, int n, int train);
zps_status nn_node_backward(nn_model *m, nn_node *nd, nn_grad_hook hook, void *ctx);
/* recompute.c: the segments of a plan for n samples (nodes' seg, tensors' local, nseg), or
 * none (nseg 1); the backward of a plan with segments. */
void nn_segments(nn_model *m, int n);
void nn_segments_clear(nn_model *m);
zps_status nn_backward_segments(nn_model *m, nn_grad_hook hook, void *ctx);

/* Weights files are written whole or not at all: to PATH.tmp (tmp, 4096 bytes), renamed
 * over PATH at the end. nn_file_begin opens it (NULL: logged); nn_file_end closes it and,
 * unless bad or the close failed, renames it, else removes it (logged: ZPS_ERR_IO). */
FILE *nn_file_begin(const char *path, char *tmp);
zps_status nn_file_end(FILE *f, const char *tmp, const char *path, int bad);

#endif
