/* optim_math.h — the optimizers' update of one element, defined once for every place that
 * applies it: the servers and local/all-reduce training on the host (common/optim_apply.c,
 * behind ps_optim_apply and the ref/cpu back-ends' k_optim_apply) and the CUDA back-end's
 * k_optim_apply (kernels/cuda/backend.cu). The formulas are ps/optim.h's.
 *
 * A zps_optim_step holds one step's constants, computed once on the host from the
 * configuration and the step (ps_optim_prepare: the schedule in double precision, rounded
 * to float once), so a kernel gets plain floats.
 *
 * Same bits everywhere: on the host -std=c11 keeps -ffp-contract=off (no fused
 * multiply-add, common/simd.h); on the device nvcc contracts by default, so every operation
 * here is the round-to-nearest intrinsic (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn),
 * which it never fuses. A GPU update therefore equals the host's bit for bit.
 */
#ifndef ZPS_COMMON_OPTIM_MATH_H
#define ZPS_COMMON_OPTIM_MATH_H

#include "common/hd.h"

#include <math.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The optimizers, numbered as ps/optim.h's ps_optim_kind. */
enum { ZPS_OPTK_SGD = 0, ZPS_OPTK_MOMENTUM, ZPS_OPTK_RMSPROP, ZPS_OPTK_ADAM, ZPS_OPTK_ADAGRAD };

/* One step's constants (ps_optim_prepare fills it). */
typedef struct zps_optim_step {
    int kind;           // ZPS_OPTK_*
    int nesterov;       // momentum
    float lr;           // the scheduled learning rate of this step
    float wd;           // L2 weight decay
    float mu;           // momentum (momentum, rmsprop)
    float rho, one_m_rho; // rmsprop decay and 1 - decay
    float eps;          // rmsprop, adam, adagrad
    float b1, b2, ob1, ob2; // adam betas and 1 - betas
    float lr_t;         // adam: lr * sqrt(1 - b2^t) / (1 - b1^t), t = step + 1
} zps_optim_step;

#if defined(__CUDA_ARCH__)
#define ZO_ADD(a, b) __fadd_rn((a), (b))
#define ZO_SUB(a, b) __fsub_rn((a), (b))
#define ZO_MUL(a, b) __fmul_rn((a), (b))
#define ZO_DIV(a, b) __fdiv_rn((a), (b))
#define ZO_SQRT(a) __fsqrt_rn(a)
#else
#define ZO_ADD(a, b) ((a) + (b))
#define ZO_SUB(a, b) ((a) - (b))
#define ZO_MUL(a, b) ((a) * (b))
#define ZO_DIV(a, b) ((a) / (b))
#define ZO_SQRT(a) sqrtf(a)
#endif

/* g' = g + wd * w */
ZPS_HD float zps_opt_grad(const zps_optim_step *s, float w, float g)
{
    return ZO_ADD(g, ZO_MUL(s->wd, w));
}

ZPS_HD void zps_opt_sgd(const zps_optim_step *s, float *w, float g)
{
    *w = ZO_SUB(*w, ZO_MUL(s->lr, zps_opt_grad(s, *w, g)));
}

ZPS_HD void zps_opt_momentum(const zps_optim_step *s, float *w, float *m, float g)
{
    float gi = zps_opt_grad(s, *w, g);
    *m = ZO_ADD(ZO_MUL(s->mu, *m), gi);
    *w = ZO_SUB(*w, ZO_MUL(s->lr, *m));
}

ZPS_HD void zps_opt_nesterov(const zps_optim_step *s, float *w, float *m, float g)
{
    float gi = zps_opt_grad(s, *w, g);
    *m = ZO_ADD(ZO_MUL(s->mu, *m), gi);
    *w = ZO_SUB(*w, ZO_MUL(s->lr, ZO_ADD(gi, ZO_MUL(s->mu, *m))));
}

ZPS_HD void zps_opt_rmsprop(const zps_optim_step *s, float *w, float *ms, float *mom, float g)
{
    float gi = zps_opt_grad(s, *w, g);
    *ms = ZO_ADD(ZO_MUL(s->rho, *ms), ZO_MUL(s->one_m_rho, ZO_MUL(gi, gi)));
    *mom = ZO_ADD(ZO_MUL(s->mu, *mom), ZO_DIV(ZO_MUL(s->lr, gi), ZO_SQRT(ZO_ADD(*ms, s->eps))));
    *w = ZO_SUB(*w, *mom);
}

ZPS_HD void zps_opt_adam(const zps_optim_step *s, float *w, float *m, float *v, float g)
{
    float gi = zps_opt_grad(s, *w, g);
    *m = ZO_ADD(ZO_MUL(s->b1, *m), ZO_MUL(s->ob1, gi));
    *v = ZO_ADD(ZO_MUL(s->b2, *v), ZO_MUL(s->ob2, ZO_MUL(gi, gi)));
    *w = ZO_SUB(*w, ZO_DIV(ZO_MUL(s->lr_t, *m), ZO_ADD(ZO_SQRT(*v), s->eps)));
}

ZPS_HD void zps_opt_adagrad(const zps_optim_step *s, float *w, float *acc, float g)
{
    float gi = zps_opt_grad(s, *w, g);
    *acc = ZO_ADD(*acc, ZO_MUL(gi, gi));
    *w = ZO_SUB(*w, ZO_DIV(ZO_MUL(s->lr, gi), ZO_ADD(ZO_SQRT(*acc), s->eps)));
}

/* The host loop over n elements (common/optim_apply.c): w, the slots s0 and s1 (NULL where
 * the optimizer has fewer, ps_optim_slots) and g are host arrays of n floats. */
void zps_optim_apply_host(const zps_optim_step *s, size_t n, float *w, float *s0, float *s1,
                          const float *g);

#ifdef __cplusplus
}
#endif

#endif
