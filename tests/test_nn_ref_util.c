/* test_nn_ref_util.c — see nn_ref_util.h (helpers; no tests here). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "tests/nn_ref_util.h"
#include "tests/testutil.h"

double nrt_rel(const float *a, const double *b, const double *ref, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        double x = a ? (double)a[i] : b[i];
        d += (x - ref[i]) * (x - ref[i]);
        r += ref[i] * ref[i];
    }
    return sqrt(d) / (sqrt(r) + 1e-30);
}

void nrt_read_refs(const char *dir, size_t total, double **ref, int nref)
{
    char path[4200];
    for (int i = 0; i < nref; i++) {
        if (i < 2)
            snprintf(path, sizeof path, "%s/ref.%s", dir, i == 0 ? "f64" : "f32");
        else
            snprintf(path, sizeof path, "%s/ref.pert%d", dir, i - 2);
        ref[i] = zt_read_f64(path, total);
    }
}

void nrt_check_tensor(const char *name, const float *mine, double *const *ref, size_t off,
                      size_t cnt, nrt_tally *ty)
{
    const double *t64 = ref[0];
    double ez = nrt_rel(mine, NULL, t64 + off, cnt);
    double e32 = nrt_rel(NULL, ref[1] + off, t64 + off, cnt), ep = 0;
    for (int i = 2; i < ty->nref; i++)
        ep = fmax(ep, nrt_rel(NULL, ref[i] + off, t64 + off, cnt));
    double bound = 1e-3 + 4 * fmax(e32, ep);
    ty->checked++;
    ty->tight += ez <= 1e-3;
    ty->torch_tight += e32 <= 1e-3;
    if (ez / bound > ty->worst)
        ty->worst = ez / bound, ty->worst_name = name;
    if (ty->verbose)
        fprintf(stderr, "%-48s zps %.3g  torch f32 %.3g  perturbed %.3g  bound %.3g\n", name, ez,
                e32, ep, bound);
    if (ez > bound) {
        ty->bad++;
        /* stderr, not cr_log_warn: that makes Criterion exit 1 (tests/testutil.h) */
        fprintf(stderr, "[over bound] %s: zps error %.3g, torch float32 %.3g, perturbed %.3g, "
                "bound %.3g\n", name, ez, e32, ep, bound);
    }
}
