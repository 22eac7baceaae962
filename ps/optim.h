/* optim.h — server-side optimizers and learning-rate schedules.
 *
 * A server keeps, for the elements it owns, the values and `ps_optim_slots()` slot arrays
 * of the same length. ps_optim_apply() updates one contiguous slice in place from an
 * averaged gradient. Every formula works in float32 in a fixed order (no FMA contraction on
 * the baseline x86-64 target), so the same inputs give the same bits on every server and in
 * tests. `step` is the number of updates already applied to the slice (its version); the
 * learning rate is computed from it in double precision and rounded to float once.
 *
 * Weight decay is L2 added to the gradient: g' = g + wd * w (TF / PyTorch SGD style).
 *   sgd       w -= lr * g'
 *   momentum  m = mu * m + g';  w -= lr * m,  or nesterov: w -= lr * (g' + mu * m)
 *   rmsprop   (TF, Inception-v3 recipe; ms starts at 1)  ms = rho * ms + (1 - rho) * g'^2;
 *             mom = mu * mom + lr * g' / sqrt(ms + eps);  w -= mom
 *   adam      t = step + 1; m = b1 m + (1 - b1) g'; v = b2 v + (1 - b2) g'^2;
 *             w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)
 *   adagrad   acc (starts at initial_accumulator, default 0.1) += g'^2;
 *             w -= lr * g' / (sqrt(acc) + eps)
 * Schedules (s = step):
 *   warm-up   s < warmup_steps: lr * (s + 1) / warmup_steps; afterwards s -= warmup_steps
 *   constant  lr
 *   exponential lr * rate^(s / decay_steps), floor of the exponent when staircase
 *   cosine    min_lr + (lr - min_lr) * (1 + cos(pi * min(s, total_steps) / total_steps)) / 2
 */
#ifndef ZPS_PS_OPTIM_H
#define ZPS_PS_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "common/optim_math.h"
#include "common/proto.h"
#include "common/status.h"

typedef enum ps_optim_kind { /* numbered as common/optim_math.h's kernels know them */
    PS_OPT_SGD = ZPS_OPTK_SGD,
    PS_OPT_MOMENTUM = ZPS_OPTK_MOMENTUM,
    PS_OPT_RMSPROP = ZPS_OPTK_RMSPROP,
    PS_OPT_ADAM = ZPS_OPTK_ADAM,
    PS_OPT_ADAGRAD = ZPS_OPTK_ADAGRAD,
} ps_optim_kind;

typedef enum ps_sched_kind {
    PS_SCHED_CONSTANT = 0,
    PS_SCHED_EXPONENTIAL,
    PS_SCHED_COSINE,
} ps_sched_kind;

typedef struct ps_optim_config {
    ps_optim_kind kind;
    double lr;
    double momentum;       // momentum, rmsprop
    int nesterov;          // momentum
    double decay;          // rmsprop rho
    double epsilon;        // rmsprop, adam, adagrad
    double beta1, beta2;   // adam
    double weight_decay;   // L2, every optimizer
    double initial_accumulator; // adagrad
    ps_sched_kind sched;
    double decay_rate;     // exponential
    uint64_t decay_steps;  // exponential (>= 1)
    int staircase;         // exponential
    uint64_t total_steps;  // cosine (>= 1)
    double min_lr;         // cosine
    uint64_t warmup_steps; // linear warm-up, 0 = none
} ps_optim_config;

/* sgd, lr 0.01, and the usual defaults for the other fields (rho 0.9, eps 1e-8 for adam,
 * 1.0 for rmsprop as in the Inception recipe is NOT the default: eps 1e-10; betas 0.9 /
 * 0.999; adagrad accumulator 0.1). */
void ps_optim_default(ps_optim_config *c);
/* Parses "sgd|momentum|rmsprop|adam|adagrad". */
zps_status ps_optim_kind_parse(const char *s, ps_optim_kind *out);
const char *ps_optim_kind_name(ps_optim_kind k);
/* Checks ranges (lr >= 0, 0 <= rho/beta < 1, eps > 0 where used, decay_steps >= 1 ...).
 * Writes a reason into why (may be NULL) on failure: ZPS_ERR_INVALID. */
zps_status ps_optim_validate(const ps_optim_config *c, char *why, size_t why_len);

/* Number of slot arrays (0 sgd, 1 momentum/adagrad, 2 rmsprop/adam). */
int ps_optim_slots(ps_optim_kind k);
/* Initial value of slot i (1 for the rmsprop mean square, initial_accumulator for
 * adagrad, else 0). */
float ps_optim_slot_init(const ps_optim_config *c, int slot);
/* Learning rate after `step` applied updates. */
double ps_optim_lr(const ps_optim_config *c, uint64_t step);

/* Updates n values w from gradient g. slots[i] points at slot i of the same n elements.
 * The update itself is common/optim_math.h's, shared with k_optim_apply (kernels.h). */
void ps_optim_apply(const ps_optim_config *c, uint64_t step, float *w, float *const *slots,
                    const float *g, size_t n);
/* The constants of step `step` for zps_optim_apply_host / k_optim_apply. */
void ps_optim_prepare(const ps_optim_config *c, uint64_t step, zps_optim_step *s);

/* Proto conversion; from_proto validates (ZPS_ERR_INVALID with why). to_proto fills the
 * caller's messages (sched is linked from opt) and borrows string constants. */
zps_status ps_optim_from_proto(const Zps__OptimizerConfig *m, ps_optim_config *c, char *why,
                               size_t why_len);
void ps_optim_to_proto(const ps_optim_config *c, Zps__OptimizerConfig *m, Zps__Schedule *sched);
/* 1 when both configs are the same in every field. */
int ps_optim_equal(const ps_optim_config *a, const ps_optim_config *b);

#endif
