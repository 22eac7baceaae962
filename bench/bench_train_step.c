/* bench_train_step.c — `zps-bench train-step`: images per second of one CPU training step
 * (forward + backward + SGD momentum) of inception_v3, against PyTorch in the same run.
 *
 * Shapes (default): 299 batch 8 (aux on), 299 batch 32 (aux on), 139 batch 32 and 75 batch
 * 32 (aux off). Each zps shape runs in a forked child so its peak RSS is its own; the child
 * reports the median step time over --steps timed steps after --warmup steps. PyTorch runs
 * tests/ref/train_step_ref.py under Debian's /usr/bin/python3 with torch.set_num_threads(2),
 * jemalloc preloaded (MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1), the same
 * warm-up/steps and median. Writes BENCH_DIR/train_step.json: a list of {"shape", "batch",
 * "zps_ips", "torch_ips", "ratio", "zps_peak_rss_mb"} (torch_ips and ratio null when PyTorch
 * is unavailable or --no-torch), with the machine's state: "omp_wait_policy" (what the zps side
 * ran with), "cores", "load_before" and "load_after" (1-minute load average before the zps
 * side and after both) and "busy" (either load above the cores: discard that figure).
 *
 * The zps side runs with zps-trainer's OpenMP policy (common/omp_env.h: the command
 * re-executes itself once to set it); PyTorch keeps the environment the user gave.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/omp_env.h"
#include "ps/optim.h"
#include "trainer/models/models.h"

typedef struct s_shape {
    int size, batch, aux;
} s_shape;

static double s_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Child: times the zps steps and writes the median ips to fd. Returns the exit code. */
static int s_zps_child(const s_shape *sh, int warmup, int steps, int fd)
{
    nn_model_opts o;
    nn_model_opts_default(&o, "inception_v3");
    o.in_size = sh->size, o.aux = sh->aux;
    nn_model *m;
    if (nn_model_create(k_backend_cpu(), &o, &m) != ZPS_OK)
        return 1;
    size_t nx = (size_t)sh->batch * 3 * sh->size * sh->size;
    float *x = malloc(nx * sizeof *x);
    int32_t *y = malloc(sizeof(int32_t) * (size_t)sh->batch);
    uint64_t r = 88172645463325252ull;
    for (size_t i = 0; i < nx; i++) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        x[i] = (float)(r % 20001) / 10000.0f - 1.0f;
    }
    for (int i = 0; i < sh->batch; i++)
        y[i] = i % 1000;
    /* SGD momentum through the one optimizer (ps/optim.c), as the trainer applies it */
    ps_optim_config opt;
    ps_optim_default(&opt);
    opt.kind = PS_OPT_MOMENTUM, opt.lr = 0.001, opt.momentum = 0.9;
    size_t np = nn_model_param_count(m);
    float *mom = calloc(np, sizeof *mom);
    double *t = calloc((size_t)steps, sizeof *t);
    for (int s = 0; s < warmup + steps; s++) {
        double t0 = s_now();
        float loss;
        if (nn_model_forward(m, x, y, sh->batch, 1, &loss, NULL) != ZPS_OK ||
            nn_model_backward(m, NULL, NULL) != ZPS_OK)
            return 1;
        ps_optim_apply(&opt, (uint64_t)s, nn_model_params(m), &mom, nn_model_grads(m), np);
        if (s >= warmup)
            t[s - warmup] = s_now() - t0;
    }
    double ips = sh->batch / bench_median(t, (size_t)steps);
    if (write(fd, &ips, sizeof ips) != (ssize_t)sizeof ips)
        return 1;
    free(t), free(x), free(y), free(mom);
    nn_model_destroy(&m);
    return 0;
}

static int s_run_zps(const s_shape *sh, int warmup, int steps, double *ips, double *rss_mb)
{
    int p[2];
    if (pipe(p) != 0)
        return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        close(p[0]);
        _exit(s_zps_child(sh, warmup, steps, p[1]));
    }
    close(p[1]);
    ssize_t got = read(p[0], ips, sizeof *ips);
    close(p[0]);
    int status;
    struct rusage ru;
    if (wait4(pid, &status, 0, &ru) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0 ||
        got != (ssize_t)sizeof *ips)
        return -1;
    *rss_mb = (double)ru.ru_maxrss / 1024.0;
    return 0;
}

static int s_run_torch(const s_shape *sh, int warmup, int steps, double *ips)
{
    const char *root = getenv("ZPS_ROOT");
    /* undo what zps_omp_env set for zps, so PyTorch runs as its users run it */
    const char *unset = zps_omp_env_set("OMP_WAIT_POLICY") ? "-u OMP_WAIT_POLICY " : "";
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "env %s-u ZPS_OMP_CONFIGURED LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 "
             "MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1 /usr/bin/python3 "
             "%s/tests/ref/train_step_ref.py --size %d --batch %d --aux %d --warmup %d "
             "--steps %d --threads 2",
             unset, root ? root : ".", sh->size, sh->batch, sh->aux, warmup, steps);
    fflush(NULL);
    FILE *f = popen(cmd, "r");
    if (!f)
        return -1;
    char line[4096];
    int ok = -1;
    while (fgets(line, sizeof line, f)) {
        char *p = strstr(line, "\"ips\": ");
        if (p && sscanf(p + 7, "%lf", ips) == 1)
            ok = 0;
    }
    if (pclose(f) != 0)
        ok = -1;
    return ok;
}

static int s_train_step(int argc, char **argv);

/* Registered by hand: the subcommand name has a dash, which ZPS_BENCH cannot spell. */
__attribute__((constructor)) static void s_register(void)
{
    bench_register("train-step", s_train_step,
                   "inception_v3 CPU training step img/s vs PyTorch 1.13 (train_step.json)");
}

/* The command line. */
typedef struct s_cfg {
    const char *shapes; // SIZExBATCH,...
    int steps, warmup;
    int torch; // run the PyTorch side
} s_cfg;

static void s_defaults(void *p)
{
    *(s_cfg *)p = (s_cfg){.shapes = "299x8,299x32,139x32,75x32", .steps = 5, .warmup = 2,
                          .torch = 1};
}

static const zps_opt s_opt[] = {
    {"shapes", ZPS_OPT_ARG, ZPS_OPT_FIELD(s_cfg, shapes), .meta = "SIZExBATCH,...",
     .help = "input shapes; aux head on where SIZE >= 299"},
    {"steps", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, steps), 1, 1000000, .meta = "N",
     .help = "timed steps"},
    {"warmup", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, warmup), 0, 1000000, .meta = "N",
     .help = "steps before timing"},
    {"no-torch", ZPS_OPT_CLEAR, ZPS_OPT_FIELD(s_cfg, torch), .help = "skip the PyTorch side"},
    {.type = ZPS_OPT_END},
};

static const zps_opts s_spec = BENCH_OPTS("train-step", s_cfg, s_opt, s_defaults, NULL);

/* One shape, both sides: its table line and JSON object (first: no leading comma). 0 when
 * the zps side ran, 1 when it failed, 2 for a malformed shape. */
static int s_one_shape(const s_cfg *cfg, const char *tok, FILE *out, int first)
{
    s_shape sh;
    if (sscanf(tok, "%dx%d", &sh.size, &sh.batch) != 2 || sh.size < 75 || sh.batch < 1) {
        fprintf(stderr, "zps-bench train-step: bad shape '%s' (want SIZExBATCH)\n", tok);
        return 2;
    }
    sh.aux = sh.size >= 299;
    double zi = 0, ti = NAN, rss = 0, before = -1, after = -1;
    const char *policy = getenv("OMP_WAIT_POLICY");
    bench_loadavg(&before);
    if (s_run_zps(&sh, cfg->warmup, cfg->steps, &zi, &rss) != 0) {
        fprintf(stderr, "zps-bench train-step: zps run failed at %s\n", tok);
        return 1;
    }
    if (cfg->torch && s_run_torch(&sh, cfg->warmup, cfg->steps, &ti) != 0) {
        fprintf(stderr, "zps-bench train-step: PyTorch run failed at %s (python3-torch missing?)\n",
                tok);
        ti = NAN;
    }
    bench_loadavg(&after);
    int busy = bench_busy(before) || bench_busy(after);
    char tbuf[32] = "null", rbuf[32] = "null";
    if (!isnan(ti)) {
        snprintf(tbuf, sizeof tbuf, "%.3f", ti);
        snprintf(rbuf, sizeof rbuf, "%.3f", zi / ti);
    }
    printf("%-9s %6d %10.2f %10s %7s %12.0f %5.2f/%-5.2f%s\n", tok, sh.batch, zi, tbuf, rbuf, rss,
           before, after, busy ? "  BUSY: discard this line" : "");
    fflush(stdout);
    fprintf(out,
            "%s\n  {\"shape\": \"%dx%dx%d\", \"batch\": %d, \"aux\": %d, \"zps_ips\": %.3f, "
            "\"torch_ips\": %s, \"ratio\": %s, \"zps_peak_rss_mb\": %.0f, "
            "\"omp_wait_policy\": \"%s\", \"cores\": %ld, \"load_before\": %.2f, "
            "\"load_after\": %.2f, \"busy\": %s}",
            first ? "" : ",", 3, sh.size, sh.size, sh.batch, sh.aux, zi, tbuf, rbuf, rss,
            policy ? policy : "", sysconf(_SC_NPROCESSORS_ONLN), before, after,
            busy ? "true" : "false");
    return 0;
}

static int s_train_step(int argc, char **argv)
{
    s_cfg cfg;
    int rc = bench_opts_parse(&s_spec, &cfg, argc, argv);
    if (rc >= 0)
        return rc;
    zps_omp_env(1, bench_argv());
    char path[4096];
    FILE *out = bench_json_open("train-step", "train_step.json", path, sizeof path);
    if (!out)
        return 1;
    fprintf(out, "[");
    int first = 1;
    rc = 0;
    char *list = strdup(cfg.shapes), *save = NULL;
    printf("%-9s %6s %10s %10s %7s %12s %s\n", "shape", "batch", "zps img/s", "torch img/s",
           "ratio", "zps RSS MiB", "load before/after");
    for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int r = s_one_shape(&cfg, tok, out, first);
        if (r == 2) {
            rc = 2;
            break;
        }
        if (r == 0)
            first = 0;
        else
            rc = 1;
    }
    fprintf(out, "\n]\n");
    fclose(out);
    free(list);
    printf("train-step: wrote %s (a line marked BUSY ran with the load above the %ld cores)\n",
           path, sysconf(_SC_NPROCESSORS_ONLN));
    return rc;
}
