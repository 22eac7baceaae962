/* nn.h — models as ordered graphs of layers over one flat parameter buffer.
 *
 * A model owns two flat float buffers, both in its back-end's memory:
 *   params  the trainable variables, in declaration order (torchvision's state_dict order for
 *           inception_v3), described by the variable table: variable i is at offset
 *           sum(count[0..i-1]), so the table is contiguous and a PS shard is an offset range;
 *   grads   the same layout; nn_model_backward() overwrites it every step.
 * The model has no optimizer: updates are ps/optim.c's (servers, local and all-reduce
 * training alike), and its slots belong to whoever applies them.
 * Batchnorm running statistics (running_mean, running_var per batchnorm) are a third buffer
 * with its own table; they are not trainable and are never pushed to servers.
 *
 * Activations, their gradients and per-layer scratch live in one block planned for the
 * current batch size and taken from a zps_arena (host back-ends) or the back-end's allocator
 * (cuda): a new batch size re-plans once; the same size never allocates again. Gradient
 * buffers are reused across layers (a buffer lives from its consumer's backward to its
 * producer's backward).
 *
 * Building: nn_model_new(), then layer calls that each return the id of their output tensor
 * (tensor 0 is the input), nn_model_head() for each loss head, then nn_model_finish() which
 * allocates the buffers and initialises the parameters from a seed. A layer call with bad
 * arguments makes nn_model_finish() fail (the first error is kept and logged).
 *
 * One step: nn_model_forward(train=1) computes the loss (sum of head weight * mean softmax
 * cross-entropy) and keeps what backward needs; nn_model_backward() walks the layers last to
 * first and calls the hook after each layer with parameters, so the gradients of variables
 * [first, first + count) can be pushed while backward continues (hooks arrive in decreasing
 * variable order and together cover every variable exactly once). A model is used by one
 * thread at a time.
 *
 * Models whose loss is computed outside nn (the ssd detector: its matching and hard-negative
 * mining run on the host, trainer/detect) mark output tensors instead of, or beside, loss
 * heads: nn_model_output(m, t) while building. A step is then
 *     nn_model_forward_outputs(m, x, n, 1);          // the layers only, no head
 *     nn_model_output_read(m, i, y_i);               // each output, NCHW, host memory
 *     ... the caller's loss: dL/dy_i, same shape ...
 *     nn_model_backward_outputs(m, dy, hook, ctx);   // dy[i] injected into output i
 * The outputs' activations may be kept in a blocked layout (cpu back-end): reading converts
 * them to NCHW and the injected gradients are converted into the tensor's layout, so callers
 * only ever see NCHW. The backward is nn_model_backward's (same order, same hooks) starting
 * from the injected gradients; an output given no gradient (NULL) contributes none. An
 * output may be an intermediate tensor other layers read: its injected gradient and theirs
 * add up. A model with heads keeps nn_model_forward/backward unchanged.
 */
#ifndef ZPS_TRAINER_NN_NN_H
#define ZPS_TRAINER_NN_NN_H

#include <stddef.h>
#include <stdint.h>

#include "common/opts.h"
#include "common/status.h"
#include "kernels/kernels.h"

/* One variable (or running statistic) of the flat buffer. */
typedef struct nn_var {
    char name[96];   // torchvision's name, e.g. "Mixed_5b.branch1x1.conv.weight"
    size_t offset;   // first float in the flat buffer
    size_t count;    // number of floats (product of shape)
    int ndim;        // 1..4
    int shape[4];    // e.g. (K, C, R, S) for a convolution
} nn_var;

typedef struct nn_model nn_model;

/* Called after the backward of a layer with parameters: the gradients of variables
 * [first_var, first_var + nvars) are final for this step. */
typedef void (*nn_grad_hook)(void *ctx, size_t first_var, size_t nvars);

/* ---- building ---- */

/* An empty model on back-end be for inputs of (c, h, w) per sample. Never NULL. */
nn_model *nn_model_new(const k_backend *be, int c, int h, int w);
void nn_model_destroy(nn_model **pm);

/* Convolution without bias + batchnorm (eps 0.001, momentum 0.1) + ReLU: torchvision's
 * BasicConv2d. Variables name.conv.weight (k, c, r, s), name.bn.weight, name.bn.bias;
 * statistics name.bn.running_mean, name.bn.running_var. Weights ~ N(0, init_std) truncated
 * to [-2, 2] (torchvision's rule). */
int nn_conv_bn_relu(nn_model *m, const char *name, int in, int k, int r, int s, int stride_h,
                    int stride_w, int pad_h, int pad_w, float init_std);
int nn_maxpool(nn_model *m, const char *name, int in, int r, int stride, int pad);
/* Average pooling, padding counted in the divisor (count_include_pad=True). */
int nn_avgpool(nn_model *m, const char *name, int in, int r, int stride, int pad);
/* Global average pool to (c, 1, 1). */
int nn_gap(nn_model *m, const char *name, int in);
/* Channel concat of n tensors of equal h, w (n <= 8). */
int nn_concat(nn_model *m, const char *name, int n, const int *ins);
/* Dropout with rate p (identity in evaluation). */
int nn_dropout(nn_model *m, const char *name, int in, float p);
/* Fully connected on the flattened input: variables name.weight (out, in), name.bias (out).
 * Weights ~ N(0, init_std) truncated to [-2, 2]; bias ~ U(-1/sqrt(in), 1/sqrt(in)). */
int nn_dense(nn_model *m, const char *name, int in, int out, int relu, float init_std);
/* Convolution with bias and nothing after it (no batchnorm, no ReLU), for detector heads:
 * variables name.weight (k, c, r, s) ~ N(0, init_std) truncated to [-2, 2], name.bias (k)
 * starting at 0 (torchvision's SSD heads). */
int nn_conv(nn_model *m, const char *name, int in, int k, int r, int s, int stride, int pad,
            float init_std);
/* Marks the layers added from now on as training-only (skipped by evaluation), e.g. the
 * auxiliary head; 0 ends the section. */
void nn_model_train_only(nn_model *m, int on);
/* A loss head: mean softmax cross-entropy of logits tensor t (c classes, h = w = 1) with the
 * labels, weighted by weight. The first head gives the correct count and the eval loss. */
void nn_model_head(nn_model *m, int t, float weight);
/* Marks tensor t as an output whose loss is computed outside nn (at most 16, each once);
 * returns its index among the outputs (marking order), -1 on a bad call (finish fails). */
int nn_model_output(nn_model *m, int t);
/* Allocates params, grads, statistics and initialises them from seed. A model needs a loss
 * head or a marked output. */
zps_status nn_model_finish(nn_model *m, uint64_t seed);

/* ---- introspection ---- */

const k_backend *nn_model_backend(const nn_model *m);
const nn_var *nn_model_vars(const nn_model *m, size_t *nvars);
const nn_var *nn_model_stats(const nn_model *m, size_t *nstats);
size_t nn_model_param_count(const nn_model *m);
size_t nn_model_stat_count(const nn_model *m);
float *nn_model_params(nn_model *m);  // (param_count) in back-end memory
float *nn_model_grads(nn_model *m);   // (param_count) in back-end memory
float *nn_model_statbuf(nn_model *m); // (stat_count) running statistics
/* Input shape per sample and number of classes of the first head. */
void nn_model_input_shape(const nn_model *m, int *c, int *h, int *w);
int nn_model_classes(const nn_model *m);
/* The output of the layer called name after the last forward (a feature map for detector
 * heads): data in back-end memory, shape (n, c, h, w), n that forward's rows (the buffer
 * may hold more: an inference forward of fewer rows than planned runs on that plan). ZPS_ERR_NOT_FOUND for unknown names,
 * ZPS_ERR_INVALID for a tensor that recompute does not keep (nn_model_set_recompute). */
zps_status nn_model_tensor(nn_model *m, const char *name, float **data, int *n, int *c, int *h,
                           int *w);
/* The layout that tensor is kept in (kernels.h: K_BLOCK16 or K_BLOCK8 on the cpu back-end,
 * chosen wherever the graph allows, so activations are not reordered between layers);
 * convert with k_from_layout. 0 (K_NCHW) for plain NCHW or unknown names. */
int nn_model_tensor_blocked(const nn_model *m, const char *name);
/* 1 when the named conv+bn+ReLU layer runs the max pool after it in one op in training
 * (kernels.h, k_bn_pool_fwd: the back-end fuses the pair and nothing else reads the layer's
 * output); known once a batch size is planned (a forward ran). 0 otherwise. */
int nn_model_layer_fused(const nn_model *m, const char *name);
/* Gradient checkpointing (trainer/nn/recompute.c): on, a training forward keeps only the
 * activations at segment boundaries (about sqrt(layers) segments, cut where one tensor is
 * live) and backward recomputes each segment's forward before its backward. Gradients,
 * losses and running statistics are the same as without (bit for bit on a deterministic
 * back-end); the activation block shrinks and a step costs about one more forward. After a
 * forward, only boundary tensors, heads and marked outputs hold values (nn_model_tensor).
 * Changing it re-plans at the next forward. nn_model_segments: the plan's segments (1:
 * none; 0 before a forward). */
void nn_model_set_recompute(nn_model *m, int on);
/* Mixed precision (--precision bf16): the convolutions compute in bf16 (kernels.h,
 * k_conv2d.bf16: inputs read as bfloat16, products summed in float) while parameters,
 * gradients, activations and the optimizer stay float32 (the master weights). No loss
 * scaling: bf16 has float's range. Dense layers, batchnorm and the losses stay float.
 * Changing it re-plans at the next forward. */
void nn_model_set_bf16(nn_model *m, int on);
int nn_model_segments(const nn_model *m);
/* Bytes of the activation block planned for the current batch size (0 before a forward). */
size_t nn_model_activation_bytes(const nn_model *m);
/* Forward FLOPs per sample of the convolutions and dense layers. */
double nn_model_flops_per_sample(const nn_model *m);

/* ---- running ---- */

/* Called during every forward just before a layer with parameters reads variables
 * [first_var, first_var + nvars), in forward order: the caller makes sure their values are in
 * place (the PS back-end waits for their pull here, so the first layers run while the later
 * layers' values are still arriving). NULL removes it. */
void nn_model_set_forward_hook(nn_model *m, nn_grad_hook hook, void *ctx);

/* The next forward (of either kind) reads its batch from x, (n, c, h, w) floats already in
 * the back-end's memory, in place, instead of copying its x argument (which it then
 * ignores): a batch the caller copied in itself (a device's copy queue, ahead of time) or a
 * host batch on a host back-end (no copy at all). x must not change until that forward's
 * backward is done (on a device: until the work it queued ran). Once: the next forward
 * takes it even when it fails early, and the one after copies again. */
void nn_model_set_input(nn_model *m, const float *x);

/* The batchnorm momentum of the training forwards from now on, in (0, 1] (PyTorch's
 * convention: run = (1 - momentum) * run + momentum * batch; 0.1 until set). Recalibrating
 * the running statistics (torch.optim.swa_utils.update_bn) sets 1 / (k + 1) before batch k,
 * so they end as the exact mean of the batches' statistics. */
void nn_model_set_bn_momentum(nn_model *m, float momentum);

/* A model with loss heads (ZPS_ERR_INVALID without; see nn_model_forward_outputs).
 * x: (n, c, h, w) floats in host memory; labels: n int32 in host memory, each in
 * [0, classes). train=1: batch statistics, dropout, every head, state kept for backward;
 * train=0: running statistics, no dropout, first head only. loss: weighted sum of the heads'
 * mean losses; correct (may be NULL): rows where the first head's argmax is the label.
 * A training forward plans for n (the plan is remade when n changes: descriptors, and on a
 * device its memory); one with train=0 runs on the plan already made when n is no larger,
 * so evaluating in batches of the training batch makes no plan of its own. */
zps_status nn_model_forward(nn_model *m, const float *x, const int32_t *labels, int n, int train,
                            float *loss, int *correct);
/* Gradients of the last training forward's loss into grads (overwritten); hook may be NULL. */
zps_status nn_model_backward(nn_model *m, nn_grad_hook hook, void *ctx);
/* Evaluation forward (inference batchnorm): nn_model_forward with train = 0. */
zps_status nn_model_eval(nn_model *m, const float *x, const int32_t *labels, int n, float *loss,
                         int *correct);

/* ---- outputs whose loss is computed outside nn (see the top of this file) ---- */

/* Number of marked outputs, and output i's shape per sample. */
int nn_model_outputs(const nn_model *m);
void nn_model_output_shape(const nn_model *m, int i, int *c, int *h, int *w);
/* x: (n, c, h, w) floats in host memory. Runs the layers (no loss head); train=1: batch
 * statistics, dropout, state kept for nn_model_backward_outputs; train=0: running
 * statistics, training-only layers skipped. */
zps_status nn_model_forward_outputs(nn_model *m, const float *x, int n, int train);
/* Host scratch of at least `bytes`, owned by m: grown when asked for more, reused by every
 * later call (so a per-step caller allocates once), freed with m. One user at a time: the
 * next call may move it. */
void *nn_model_scratch(nn_model *m, size_t bytes);
/* Output i of the last forward into dst: (n, c, h, w) floats, NCHW, host memory (n: that
 * forward's rows, which an inference forward may run on a plan of more rows). */
zps_status nn_model_output_read(nn_model *m, int i, float *dst);
/* Gradients into grads (overwritten) from dys[i] = dL/d(output i), (n, c, h, w) NCHW host
 * floats of the last training forward's batch (NULL: no gradient reaches output i). The
 * hook is nn_model_backward's. */
zps_status nn_model_backward_outputs(nn_model *m, const float *const *dys, nn_grad_hook hook,
                                     void *ctx);
/* On request the backward also computes dL/d(input) (any step: heads or outputs), e.g. to
 * check a model against a reference; off by default (the first layer then skips its input
 * gradient). Changing it re-plans at the next forward. */
void nn_model_set_input_grad(nn_model *m, int on);
/* dL/d(input) of the last backward into dst: (n, c, h, w) NCHW host floats (zeros when no
 * gradient reached it). ZPS_ERR_INVALID when not requested or before a forward. */
zps_status nn_model_input_grad(nn_model *m, float *dst);

/* ---- weights files ----
 * Little-endian binary:
 *   "ZPSWGT01" (8 bytes), u32 version (1), u32 nvars, u32 nstats,
 *   nvars + nstats records: u16 name length, name bytes (no NUL), u32 ndim, ndim x u32 shape,
 *                           u64 count,
 *   float32 data of the variables in table order (sum of counts), then of the statistics.
 * Loading requires the same names, shapes and order as the model. */
zps_status nn_model_save(nn_model *m, const char *path);
zps_status nn_model_load(nn_model *m, const char *path);

/* The formats a weights file can be written in (--export-format): the zps file above, or
 * safetensors (trainer/nn/safetensors.c: the variables and statistics under their
 * torchvision names, plus one num_batches_tracked per batchnorm, so torchvision's
 * state_dict loads it with strict=True). Only the zps format is read back. */
typedef enum nn_weights_format { NN_WEIGHTS_ZPS, NN_WEIGHTS_SAFETENSORS } nn_weights_format;
/* The names for flags (common/opts.h ENUM): "zps", "safetensors". */
extern const zps_opt_name nn_weights_format_names[];
zps_status nn_model_save_as(nn_model *m, nn_weights_format f, const char *path);

/* A weights file read without a model (e.g. PS INIT): tables and data owned by the struct. */
typedef struct nn_weights {
    size_t nvars, nstats;   // table sizes
    nn_var *vars;           // (nvars) offsets into params
    nn_var *stats;          // (nstats) offsets into statdata
    float *params;          // (sum of var counts)
    float *statdata;        // (sum of stat counts)
    size_t param_count;     // floats in params
    size_t stat_count;      // floats in statdata
} nn_weights;

zps_status nn_weights_read(const char *path, nn_weights **out);
void nn_weights_destroy(nn_weights **pw);
/* Writes a file from host tables and data (stats may be empty). */
zps_status nn_weights_write(const char *path, const nn_var *vars, size_t nvars,
                            const float *params, const nn_var *stats, size_t nstats,
                            const float *statdata);
zps_status nn_safetensors_write(const char *path, const nn_var *vars, size_t nvars,
                                const float *params, const nn_var *stats, size_t nstats,
                                const float *statdata);
/* nn_weights_write or nn_safetensors_write, by f. */
zps_status nn_weights_write_as(nn_weights_format f, const char *path, const nn_var *vars,
                               size_t nvars, const float *params, const nn_var *stats,
                               size_t nstats, const float *statdata);

#endif
