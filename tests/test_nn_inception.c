/* test_nn_inception.c — Inception-v3 in zps against torchvision (tests/ref/inception_ref.py).
 *
 * The C side builds the model on the cpu back-end, writes its weights, a random batch and
 * labels; the script loads them into torchvision's Inception3 and writes the loss, logits, every
 * variable's gradient and the running statistics after one float32 training step, on the batch
 * (ref) and on the batch perturbed by p relative (pert). Shapes: 299x299 batch 2 with the aux
 * head (p = 1e-6), 75x75 batch 8 without (p = 1e-5: at 75x75 Mixed_7 is 1x1 and batchnorm over
 * 8 values makes the network so chaotic that zps and PyTorch, each correct in float32, differ
 * by about ten times what a 1e-6 input change does).
 *
 * Error bound, per tensor (logits, each gradient, each running statistic), relative L2 against
 * PyTorch:  err_zps <= 1e-3 + 4 * err_pert, err_pert being how far PyTorch's own result moves
 * under the input perturbation. A randomly initialised Inception-v3 with batchnorm is
 * chaotic: such a perturbation moves some gradients by several percent (batchnorm gradients
 * explode with depth at initialisation, and ReLU masks flip), so two correct float32
 * implementations cannot agree to 1e-3 on those tensors; where PyTorch is stable
 * (err_pert <= 2.5e-4) zps is held to 2e-3 or better. A single ReLU-mask flip in a narrow layer
 * shifts a gradient by ~1/(batch*h*w) of its norm, so up to 2% of the tensors may exceed the
 * bound if each stays under 3e-2; all of them are logged by name. The loss must agree to
 * 1e-4 relative + 4 times its own perturbation change.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tests/testutil.h"
#include "common/log.h"
#include "trainer/models/models.h"

static uint64_t s_seed;

static void s_init(void)
{
    s_seed = zt_seed_init();
    zps_log_set_level(ZPS_LOG_WARN);
}

static void s_write(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot write %s", path);
    cr_assert_eq(fwrite(p, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

static double *s_read(const char *path, size_t n)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "reference output %s missing", path);
    double *v = malloc(n * sizeof *v);
    size_t got = fread(v, sizeof *v, n, f);
    char extra;
    cr_assert_eq(got, n, "%s: %zu values, want %zu", path, got, n);
    cr_assert_eq(fread(&extra, 1, 1, f), 0u, "%s longer than expected", path);
    fclose(f);
    return v;
}

/* Relative L2 error of a (float) or b (double) against ref (double). */
static double s_rel(const float *a, const double *b, const double *ref, size_t n)
{
    double d = 0, r = 0;
    for (size_t i = 0; i < n; i++) {
        double x = a ? (double)a[i] : b[i];
        d += (x - ref[i]) * (x - ref[i]);
        r += ref[i] * ref[i];
    }
    return sqrt(d) / (sqrt(r) + 1e-30);
}

static void s_run_python(const char *dir, int n, int size, int classes, int aux, double perturb)
{
    const char *root = getenv("ZPS_ROOT");
    char script[4096], args[9][4200];
    snprintf(script, sizeof script, "%s/tests/ref/inception_ref.py", root ? root : ".");
    snprintf(args[0], sizeof args[0], "--weights=%s/w.bin", dir);
    snprintf(args[1], sizeof args[1], "--input=%s/x.bin", dir);
    snprintf(args[2], sizeof args[2], "--labels=%s/y.bin", dir);
    snprintf(args[3], sizeof args[3], "--batch=%d", n);
    snprintf(args[4], sizeof args[4], "--size=%d", size);
    snprintf(args[5], sizeof args[5], "--classes=%d", classes);
    snprintf(args[6], sizeof args[6], "--aux=%d", aux);
    snprintf(args[7], sizeof args[7], "--out=%s/ref", dir);
    snprintf(args[8], sizeof args[8], "--perturb=%g", perturb);
    pid_t pid = fork();
    cr_assert(pid >= 0, "fork failed");
    if (pid == 0) {
        execl("/usr/bin/python3", "python3", script, args[0], args[1], args[2], args[3], args[4],
              args[5], args[6], args[7], args[8], (char *)NULL);
        _exit(127);
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "%s failed (status %d); needs Debian's python3-torch and python3-torchvision",
              script, status);
}

static void s_compare(int size, int n, int aux, int classes, double perturb)
{
    nn_model_opts o;
    nn_model_opts_default(&o, "inception_v3");
    o.in_size = size, o.aux = aux, o.classes = classes, o.dropout = 0, o.seed = zt_rand();
    nn_model *m;
    /* ZPS_INCEPTION_BACKEND=ref runs the oracle instead (slow; for investigating) */
    const char *bn = getenv("ZPS_INCEPTION_BACKEND");
    const k_backend *be = k_backend_by_name(bn ? bn : "cpu");
    cr_assert_not_null(be, "no back-end %s", bn);
    cr_assert_eq(nn_model_create(be, &o, &m), ZPS_OK);
    char dir[] = "/tmp/zps-inception-XXXXXX", path[4200];
    cr_assert_not_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/w.bin", dir);
    cr_assert_eq(nn_model_save(m, path), ZPS_OK);
    size_t nx = (size_t)n * 3 * size * size;
    float *x = malloc(nx * sizeof *x);
    int32_t *y = malloc((size_t)n * sizeof *y);
    for (size_t i = 0; i < nx; i++)
        x[i] = (float)(zt_rand() % 2000001) / 1e6f - 1.0f;
    for (int i = 0; i < n; i++)
        y[i] = (int32_t)(zt_rand() % (uint32_t)classes);
    snprintf(path, sizeof path, "%s/x.bin", dir);
    s_write(path, x, nx * sizeof *x);
    snprintf(path, sizeof path, "%s/y.bin", dir);
    s_write(path, y, (size_t)n * sizeof *y);
    s_run_python(dir, n, size, classes, aux, perturb);

    float loss;
    cr_assert_eq(nn_model_forward(m, x, y, n, 1, &loss, NULL), ZPS_OK);
    float *logits;
    int ln, lc, lh, lw;
    cr_assert_eq(nn_model_tensor(m, "fc", &logits, &ln, &lc, &lh, &lw), ZPS_OK);
    cr_assert_eq(nn_model_backward(m, NULL, NULL), ZPS_OK);

    size_t nv, ns, np = nn_model_param_count(m), nst = nn_model_stat_count(m);
    const nn_var *v = nn_model_vars(m, &nv), *st = nn_model_stats(m, &ns);
    size_t total = 1 + (size_t)n * classes + np + nst;
    snprintf(path, sizeof path, "%s/ref.pert", dir);
    double *t32 = s_read(path, total);
    snprintf(path, sizeof path, "%s/ref.ref", dir);
    double *t64 = s_read(path, total);

    cr_assert(fabs(loss - t64[0]) <= 1e-4 * fabs(t64[0]) + 4 * fabs(t32[0] - t64[0]),
              "loss %.7g, torch %.7g, perturbed torch %.7g (seed %llu)", loss, t64[0], t32[0],
              (unsigned long long)s_seed);
    int bad = 0, tight = 0, checked = 0, hard = 0;
    double worst = 0;
    const char *worst_name = "";
    /* tensors: logits, gradients, running statistics */
    for (size_t k = 0; k < 1 + nv + ns; k++) {
        const char *name;
        const float *mine;
        size_t off, cnt;
        if (k == 0) {
            name = "logits", mine = logits, off = 1, cnt = (size_t)n * classes;
        } else if (k <= nv) {
            const nn_var *q = &v[k - 1];
            name = q->name, mine = nn_model_grads(m) + q->offset, off = 1 + (size_t)n * classes + q->offset,
            cnt = q->count;
        } else {
            const nn_var *q = &st[k - 1 - nv];
            name = q->name, mine = nn_model_statbuf(m) + q->offset,
            off = 1 + (size_t)n * classes + np + q->offset, cnt = q->count;
        }
        double ez = s_rel(mine, NULL, t64 + off, cnt), et = s_rel(NULL, t32 + off, t64 + off, cnt);
        double bound = 1e-3 + 4 * et;
        checked++;
        tight += ez <= 1e-3;
        if (ez / bound > worst)
            worst = ez / bound, worst_name = name;
        if (ez > bound) {
            bad++;
            hard += ez > 3e-2;
            /* stderr, not cr_log_warn: that makes Criterion exit 1 (tests/testutil.h) */
            fprintf(stderr, "[over bound] %s: zps error %.3g, torch perturbation error %.3g, "
                    "bound %.3g\n", name, ez, et, bound);
        }
    }
    fprintf(stderr, "inception %dx%d batch %d aux %d: %d tensors, %d within 1e-3 of torch, worst "
                "error/bound %.2f (%s)\n",
                size, size, n, aux, checked, tight, worst, worst_name);
    cr_assert(bad * 50 <= checked && hard == 0,
              "%d of %d tensors outside the bound, %d beyond 3e-2 (seed %llu)", bad, checked, hard,
              (unsigned long long)s_seed);
    const char *files[] = {"w.bin", "x.bin", "y.bin", "ref.ref", "ref.pert"};
    for (int i = 0; i < 5; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        unlink(path);
    }
    rmdir(dir);
    free(x), free(y), free(t32), free(t64);
    nn_model_destroy(&m);
}

Test(it_nn_inception, matches_pytorch_at_299_with_aux, .init = s_init, .timeout = 120)
{
    s_compare(299, 2, 1, 1000, 1e-6);
}

Test(it_nn_inception, matches_pytorch_at_75_without_aux, .init = s_init, .timeout = 120)
{
    s_compare(75, 8, 0, 10, 1e-5);
}
