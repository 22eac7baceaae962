/* test_train_util.c — see train_test_util.h. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tests/train_test_util.h"
#include "trainer/nn/nn.h"

void trt_spawn(pst_server *p, const char *prog, const char *log, const char *const *args)
{
    cr_assert_not_null(getenv("ZPS_BIN"), "ZPS_BIN unset: run through make test");
    cr_assert_eq(pst_start(p, prog, log, args), 0, "cannot start %s", prog);
}

void trt_expect_ok(pst_server *p, const char *log, double timeout_s)
{
    int st = pst_wait(p, timeout_s);
    if (st == -1) {
        pst_kill(p, SIGKILL);
        pst_dump(log);
        cr_assert_fail("%s did not finish in %.0f s", log, timeout_s);
    }
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        pst_dump(log);
        cr_assert_fail("%s failed (wait status %d)", log, st);
    }
    p->pid = 0;
}

void trt_trainer(pst_server *p, const char *dir, const char *name, char *log, size_t log_len,
                 const char *const *base, int nb, const char *const *more)
{
    const char *args[64];
    int n = 0;
    for (int i = 0; i < nb; i++)
        args[n++] = base[i];
    for (int i = 0; more[i]; i++)
        args[n++] = more[i];
    args[n] = NULL;
    snprintf(log, log_len, "%s/%s.log", dir, name);
    trt_spawn(p, "zps-trainer", log, args);
}

void trt_servers(pst_server srv[2], const char *const *sargs, char *servers, size_t len)
{
    for (int s = 0; s < 2; s++)
        cr_assert_eq(pst_spawn(&srv[s], NULL, sargs), 0, "server %d did not start", s);
    snprintf(servers, len, "%s,%s", srv[0].uri, srv[1].uri);
}

double trt_compare(const char *ref_path, const char *other_path, const char *what)
{
    nn_weights *a = NULL, *b = NULL;
    cr_assert_eq(nn_weights_read(ref_path, &a), ZPS_OK, "cannot read %s", ref_path);
    cr_assert_eq(nn_weights_read(other_path, &b), ZPS_OK, "cannot read %s", other_path);
    cr_assert_eq(a->param_count, b->param_count);
    double worst = 0, maxdiff = 0;
    size_t at = 0;
    for (size_t i = 0; i < a->param_count; i++) {
        double d = fabs((double)a->params[i] - (double)b->params[i]);
        double lim = 1e-5 + 1e-3 * fabs((double)a->params[i]);
        if (d / lim > worst) {
            worst = d / lim;
            at = i;
        }
        if (d > maxdiff)
            maxdiff = d;
    }
    cr_log_info("%s: max |diff| %.3g, worst ratio to tolerance %.3g at %zu", what, maxdiff,
                worst, at);
    cr_assert(worst <= 1.0, "%s differs from local at weight %zu: %g vs %g (max diff %.3g)",
              what, at, (double)b->params[at], (double)a->params[at], maxdiff);
    nn_weights_destroy(&a);
    nn_weights_destroy(&b);
    return maxdiff;
}

double trt_max_diff(const char *a_path, const char *b_path)
{
    nn_weights *a = NULL, *b = NULL;
    cr_assert_eq(nn_weights_read(a_path, &a), ZPS_OK, "cannot read %s", a_path);
    cr_assert_eq(nn_weights_read(b_path, &b), ZPS_OK, "cannot read %s", b_path);
    cr_assert_eq(a->param_count, b->param_count);
    double moved = 0;
    for (size_t i = 0; i < a->param_count; i++)
        moved = fmax(moved, fabs((double)a->params[i] - (double)b->params[i]));
    nn_weights_destroy(&a);
    nn_weights_destroy(&b);
    return moved;
}

double trt_summary(const char *path, const char *key)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "no metrics file %s", path);
    char line[4096], pat[64];
    double v = -1;
    snprintf(pat, sizeof pat, "\"%s\":", key);
    while (fgets(line, sizeof line, f)) {
        if (!strstr(line, "\"type\":\"summary\""))
            continue;
        char *p = strstr(line, pat);
        if (p && strncmp(p + strlen(pat), "null", 4) != 0)
            v = strtod(p + strlen(pat), NULL);
    }
    fclose(f);
    return v;
}
