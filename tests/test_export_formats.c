/* test_export_formats.c — outputs other tools read (suite it_export): the safetensors export
 * (trainer/nn/safetensors.c), checked by the safetensors package itself and by torchvision,
 * and the TensorBoard converter.
 *
 *  - Inception-v3 (width 1, 3 channels, 10 classes, 75x75, no aux head), its weights moved
 *    off their initial values by SGD steps and its batchnorm statistics by training
 *    forwards, is written as safetensors; torchvision's inception_v3 loads it with
 *    strict=True (every key present, none extra: num_batches_tracked included) and its
 *    eval-mode logits on the same input equal zps's within the op tolerance.
 *  - `zps-trainer --export F --export-format safetensors` writes every variable and
 *    statistic of the model under its name, dtype and shape (read back by the safetensors
 *    package); --resume with that format is refused as a usage error.
 *  - scripts/zps-tensorboard's event files hold what the metrics file says (read back
 *    with TensorBoard's own reader).
 * The Python side (tests/ref/safetensors_check.py) runs in scripts/py-venv's environment;
 * without it the tests skip and say why.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps/optim.h"
#include "tests/testutil.h"
#include "trainer/models/models.h"

static char s_tmp[512];

static void s_fini(void)
{
    if (s_tmp[0])
        zt_rmtmp(s_tmp);
    s_tmp[0] = 0;
}

static const char *s_python_or_skip(const char *modules)
{
    static char why[600];
    const char *py = zt_py_venv(modules, why, sizeof why);
    if (!py)
        cr_skip_test("%s", why);
    return py;
}

static void s_write_floats(const char *path, const float *v, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot create %s", path);
    cr_assert_eq(fwrite(v, sizeof *v, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

/* Runs the script at ZPS_ROOT/rel under py with args (NULL-terminated); its exit code, and
 * its output in *out (caller frees). */
static int s_py(const char *py, const char *rel, const char *const *args, char **out)
{
    const char *root = getenv("ZPS_ROOT");
    char script[4096];
    snprintf(script, sizeof script, "%s/%s", root ? root : ".", rel);
    const char *argv[16] = {script};
    int n = 1;
    for (; args[n - 1] && n < 15; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    return zt_run_tmp(py, argv, NULL, 300, out);
}

static int s_check(const char *py, const char *const *args, char **out)
{
    return s_py(py, "tests/ref/safetensors_check.py", args, out);
}

/* m's weights off their initial values (two SGD steps) and its statistics off 0 and 1
 * (training forwards at momentum 0.5), from batches of n random images. */
static void s_train_a_little(nn_model *m, int n, int size)
{
    size_t nx = (size_t)n * 3 * size * size, np = nn_model_param_count(m);
    float *x = malloc(nx * sizeof *x);
    int32_t y[8];
    for (int i = 0; i < n; i++)
        y[i] = zt_irand(0, 9);
    ps_optim_config o;
    ps_optim_default(&o);
    o.lr = 0.05;
    nn_model_set_bn_momentum(m, 0.5f);
    for (int s = 0; s < 2; s++) {
        for (size_t i = 0; i < nx; i++)
            x[i] = zt_unif(-1, 1);
        float loss;
        cr_assert_eq(nn_model_forward(m, x, y, n, 1, &loss, NULL), ZPS_OK);
        cr_assert_eq(nn_model_backward(m, NULL, NULL), ZPS_OK);
        ps_optim_apply(&o, (uint64_t)s, nn_model_params(m), NULL, nn_model_grads(m), np);
    }
    free(x);
}

Test(it_export, safetensors_inception_loads_into_torchvision_with_the_same_logits,
     .timeout = 600, .fini = s_fini)
{
    const char *py = s_python_or_skip("safetensors, torch, torchvision");
    uint64_t seed = zt_seed_init();
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-export");
    enum { N = 2, SIZE = 75, CLASSES = 10 };
    nn_model_opts o;
    nn_model_opts_default(&o, "inception_v3");
    o.classes = CLASSES, o.in_channels = 3, o.in_size = SIZE, o.aux = 0, o.seed = seed;
    nn_model *m;
    cr_assert_eq(nn_model_create(k_backend_cpu(), &o, &m), ZPS_OK);
    s_train_a_little(m, 4, SIZE);
    size_t nx = (size_t)N * 3 * SIZE * SIZE;
    float *x = malloc(nx * sizeof *x), logits[N * CLASSES];
    for (size_t i = 0; i < nx; i++)
        x[i] = zt_unif(-1, 1);
    int32_t y[N] = {0, 1};
    float loss;
    cr_assert_eq(nn_model_eval(m, x, y, N, &loss, NULL), ZPS_OK);
    float *fc;
    int n, c, h, w;
    cr_assert_eq(nn_model_tensor(m, "fc", &fc, &n, &c, &h, &w), ZPS_OK);
    cr_assert(n == N && c == CLASSES && h == 1 && w == 1, "fc is %dx%dx%dx%d", n, c, h, w);
    k_from_layout(nn_model_tensor_blocked(m, "fc"), n, c, h, w, fc, logits);
    char wpath[600], xpath[600], lpath[600], dims[32];
    snprintf(wpath, sizeof wpath, "%s/w.safetensors", s_tmp);
    snprintf(xpath, sizeof xpath, "%s/x.bin", s_tmp);
    snprintf(lpath, sizeof lpath, "%s/logits.bin", s_tmp);
    snprintf(dims, sizeof dims, "%d,%d", SIZE, CLASSES);
    cr_assert_eq(nn_model_save_as(m, NN_WEIGHTS_SAFETENSORS, wpath), ZPS_OK);
    s_write_floats(xpath, x, nx);
    s_write_floats(lpath, logits, N * CLASSES);
    const char *args[] = {"--file", wpath, "--torchvision", dims, "--input", xpath,
                          "--logits", lpath, NULL};
    char *out;
    int rc = s_check(py, args, &out);
    cr_assert_eq(rc, 0, "torchvision did not take the export, or its logits differ (seed "
                 "%llu):\n%s", (unsigned long long)seed, out);
    cr_assert(strstr(out, "loaded strictly"), "%s", out);
    free(out);
    free(x);
    nn_model_destroy(&m);
}

/* The "name dtype shape" lines zps expects of a safetensors export of m, sorted. */
static char *s_expected_list(nn_model *m)
{
    size_t nv, ns, cap = 1 << 16, len = 0;
    const nn_var *vars = nn_model_vars(m, &nv), *stats = nn_model_stats(m, &ns);
    char(*lines)[160] = calloc(2 * (nv + ns), sizeof *lines);
    size_t k = 0;
    for (size_t i = 0; i < nv + ns; i++) {
        const nn_var *v = i < nv ? &vars[i] : &stats[i - nv];
        int o = snprintf(lines[k], sizeof lines[k], "%s float32 ", v->name);
        for (int d = 0; d < v->ndim; d++)
            o += snprintf(lines[k] + o, sizeof lines[k] - (size_t)o, "%s%d", d ? "," : "",
                          v->shape[d]);
        k++;
        size_t nl = strlen(v->name), sl = strlen(".running_var");
        if (i >= nv && nl > sl && !strcmp(v->name + nl - sl, ".running_var"))
            snprintf(lines[k++], sizeof lines[k], "%.*s.num_batches_tracked int64 ",
                     (int)(nl - sl), v->name);
    }
    qsort(lines, k, sizeof *lines, (int (*)(const void *, const void *))strcmp);
    char *text = calloc(cap, 1);
    for (size_t i = 0; i < k; i++)
        len += (size_t)snprintf(text + len, cap - len, "%s\n", lines[i]);
    free(lines);
    return text;
}

Test(it_export, trainer_exports_safetensors_with_every_variable_and_statistic, .timeout = 300,
     .fini = s_fini)
{
    const char *py = s_python_or_skip("safetensors, numpy");
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-export");
    char data[600], log[600], wpath[600], list[600];
    snprintf(data, sizeof data, "%s/fm", s_tmp);
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    snprintf(wpath, sizeof wpath, "%s/convnet.safetensors", s_tmp);
    snprintf(list, sizeof list, "%s/list.txt", s_tmp);
    zt_make_fashion(data, 256, 1, log);
    const char *targs[] = {"--data", data, "--model", "convnet", "--steps", "3", "--no-progress",
                           "--export", wpath, "--export-format", "safetensors", NULL};
    char *out;
    cr_assert_eq(zt_run_tmp("zps-trainer", targs, NULL, 120, &out), 0, "%s", out);
    free(out);
    const char *args[] = {"--file", wpath, "--list", list, NULL};
    cr_assert_eq(s_check(py, args, &out), 0, "the safetensors package refused %s:\n%s", wpath,
                 out);
    free(out);
    nn_model_opts o;
    nn_model_opts_default(&o, "convnet");
    nn_model *m;
    cr_assert_eq(nn_model_create(k_backend_cpu(), &o, &m), ZPS_OK);
    char *want = s_expected_list(m), got[1 << 16] = "";
    FILE *f = fopen(list, "r");
    cr_assert_not_null(f);
    size_t n = fread(got, 1, sizeof got - 1, f);
    got[n] = 0;
    fclose(f);
    cr_assert_str_eq(got, want, "tensors in the export differ from the model's table");
    free(want);
    nn_model_destroy(&m);
    const char *bad[] = {"--data", data, "--model", "convnet", "--steps", "3", "--export", wpath,
                         "--export-format", "safetensors", "--resume", NULL};
    int rc = zt_run_tmp("zps-trainer", bad, NULL, 60, &out);
    cr_assert_eq(rc, 2, "--resume with a safetensors export: exit %d\n%s", rc, out);
    cr_assert(strstr(out, "only works in the zps format"), "%s", out);
    free(out);
}

/* scripts/zps-tensorboard turns a trainer's metrics file into event files that TensorBoard's
 * own reader (tests/ref/tensorboard_check.py) finds every step's loss, img/s and lr and
 * every evaluation's accuracy and loss in, at their steps; a malformed file is refused with
 * its line named and nothing written. */
Test(it_export, metrics_convert_to_tensorboard_events, .timeout = 300, .fini = s_fini)
{
    const char *py = s_python_or_skip("tensorboardX, tensorboard");
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-export");
    char data[600], log[600], metrics[600], logdir[600], run[700], bad[600];
    snprintf(data, sizeof data, "%s/fm", s_tmp);
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    snprintf(metrics, sizeof metrics, "%s/metrics-0.jsonl", s_tmp);
    snprintf(logdir, sizeof logdir, "%s/tb", s_tmp);
    snprintf(run, sizeof run, "%s/trainer-0", logdir);
    snprintf(bad, sizeof bad, "%s/bad.jsonl", s_tmp);
    zt_make_fashion(data, 512, 1, log);
    const char *targs[] = {"--data", data, "--model", "mlp", "--steps", "30", "--eval-every", "10",
                           "--eval-batches", "2", "--no-progress", "--metrics", metrics, NULL};
    char *out;
    cr_assert_eq(zt_run_tmp("zps-trainer", targs, NULL, 120, &out), 0, "%s", out);
    free(out);
    const char *conv[] = {metrics, "--logdir", logdir, NULL};
    cr_assert_eq(s_py(py, "scripts/zps-tensorboard", conv, &out), 0, "%s", out);
    cr_assert(strstr(out, "scalars into"), "%s", out);
    free(out);
    const char *chk[] = {"--metrics", metrics, "--run", run, NULL};
    int rc = s_py(py, "tests/ref/tensorboard_check.py", chk, &out);
    cr_assert_eq(rc, 0, "TensorBoard's reader disagrees with the metrics file:\n%s", out);
    cr_assert(strstr(out, "3 evaluations"), "%s", out);
    free(out);
    FILE *f = fopen(bad, "w");
    cr_assert_not_null(f);
    fputs("{\"type\":\"start\",\"trainer\":5}\n{\"type\":\"step\",\"step\":1,\n", f);
    cr_assert_eq(fclose(f), 0);
    const char *badargs[] = {bad, "--logdir", logdir, NULL};
    rc = s_py(py, "scripts/zps-tensorboard", badargs, &out);
    cr_assert_eq(rc, 1, "a malformed file: exit %d\n%s", rc, out);
    cr_assert(strstr(out, "bad.jsonl:2: not JSON"), "%s", out);
    snprintf(run, sizeof run, "%s/trainer-5", logdir);
    cr_assert(access(run, F_OK) != 0, "a refused file still made %s", run);
    free(out);
}
