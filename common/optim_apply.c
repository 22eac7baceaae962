/* optim_apply.c — the host loop of the optimizers' update (common/optim_math.h): one switch
 * per call, then a loop the compiler vectorises per kind (AVX-512, AVX2 or baseline clones,
 * all giving the same bits: common/simd.h). ps_optim_apply (servers, local and all-reduce
 * training) and the ref and cpu back-ends' k_optim_apply run this. */
#include "common/optim_math.h"

#include "common/simd.h"

ZPS_SIMD_CLONES
void zps_optim_apply_host(const zps_optim_step *s, size_t n, float *restrict w,
                          float *restrict s0, float *restrict s1, const float *restrict g)
{
    const zps_optim_step st = *s; /* a local copy: nothing a store through w can change */
    s = &st;
    switch (s->kind) {
    case ZPS_OPTK_SGD:
        for (size_t i = 0; i < n; i++)
            zps_opt_sgd(s, &w[i], g[i]);
        break;
    case ZPS_OPTK_MOMENTUM:
        if (s->nesterov)
            for (size_t i = 0; i < n; i++)
                zps_opt_nesterov(s, &w[i], &s0[i], g[i]);
        else
            for (size_t i = 0; i < n; i++)
                zps_opt_momentum(s, &w[i], &s0[i], g[i]);
        break;
    case ZPS_OPTK_RMSPROP:
        for (size_t i = 0; i < n; i++)
            zps_opt_rmsprop(s, &w[i], &s0[i], &s1[i], g[i]);
        break;
    case ZPS_OPTK_ADAM:
        for (size_t i = 0; i < n; i++)
            zps_opt_adam(s, &w[i], &s0[i], &s1[i], g[i]);
        break;
    case ZPS_OPTK_ADAGRAD:
        for (size_t i = 0; i < n; i++)
            zps_opt_adagrad(s, &w[i], &s0[i], g[i]);
        break;
    }
}
