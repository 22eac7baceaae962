/* bench_train_step.c — `zps-bench train-step`: images per second of one CPU training step
 * (forward + backward + SGD momentum 0.9) of a model, against TensorFlow 2.21 and PyTorch 1.13
 * on the same model, shape and batch in the same run.
 *
 * Models: --model inception_v3 (default; --width, --channels, --classes: default 1, 3, 1000;
 * shapes 299x8, 299x32 with the aux head, 139x32 and 75x32 without) or convnet (1 channel, 10
 * classes, 28x32). The demo's Inception-v3 is `--model inception_v3 --width 0.25 --channels 1
 * --classes 10 --shapes 75x32`. --threads N runs every side on N threads: zps through
 * common/omp_env (OMP_NUM_THREADS), PyTorch with torch.set_num_threads(N), TF with intra-op
 * N (inter-op 1 where N is 1); 0 (default) gives zps all cores and the peers 2.
 *
 * Each shape runs --pairs rounds; a round runs the three sides one after the other, the
 * order reversed every other round so neither side always runs first. zps runs in a forked
 * child (its peak RSS is its own) and reports the median step time over --steps timed steps
 * after --warmup steps; PyTorch runs tests/ref/train_step_ref.py under Debian's
 * /usr/bin/python3 with jemalloc preloaded (MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1);
 * TF runs scripts/bench.d/peers_tf.py train-step with the python of --tf-python (default:
 * peers-venv/bin/python next to the JSON directory, made by `make bench-peers`), skipped
 * when it is not there, for the aux head (TF's model has none) or with --no-tf. Every side
 * prints its trainable parameter count; a peer whose count differs from zps's is an error.
 *
 * Writes BENCH_DIR/train_step.json (with --append: adds to the records there): a list of
 * {"shape", "batch", "aux", "zps_ips", "torch_ips", "ratio", "zps_peak_rss_mb",
 * "omp_wait_policy", "cores", "load_before", "load_after", "busy", "model", "width",
 * "classes", "threads", "omp_num_threads", "params", "tf_ips", "tf_ratio", "pairs",
 * "zps_cpu_ips", "torch_cpu_ips", "tf_cpu_ips", "cpu_ratio", "tf_cpu_ratio"}: the img/s are
 * the medians over the rounds, ratio (zps / PyTorch) and tf_ratio (zps / TF) the medians of
 * the rounds' paired ratios (null where that side did not run); the *_cpu_* figures are the
 * same over each side's CPU time of a step (all its process's threads: a measure that a busy
 * machine disturbs less than the wall clock, and that counts the helper threads a peer
 * starts beside its compute thread); load_before and
 * load_after the 1-minute load average before the first round and after the last, busy
 * either above the cores (discard that figure).
 *
 * The zps side runs with zps-trainer's OpenMP policy (common/omp_env.h: the command
 * re-executes itself once to set it); the peers run without what it set for zps.
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
#include "kernels/device.h"
#include "ps/optim.h"
#include "trainer/models/models.h"

/* One model at one input shape. */
typedef struct s_case {
    const char *model;
    float width;
    int channels, classes, size, batch, aux;
    int cuda;           // --device cuda: zps and PyTorch on the GPU
    double peak_tflops; // --peak-tflops (0: from the GPU's name, in the child)
    int recompute;      // --recompute: zps with gradient checkpointing
    int bf16;           // --precision bf16: zps's convolutions, PyTorch's autocast
} s_case;

/* What one side measured in one round. */
typedef struct s_side {
    double ips, params; // params: the trainable parameter count it printed
    double cpu_ips;     // batch / median CPU time of a step (all the process's threads)
    double flops;       // zps: forward FLOPs per image of its convolutions and dense layers
    double peak;        // zps on a GPU: its dense peak in TFLOP/s, TF32 or BF16 (0: unknown)
    double act_mib;     // zps: its planned activation block (nn_model_activation_bytes)
} s_side;

/* Dense TF32 tensor-core peaks (TFLOP/s, NVIDIA's data sheets, without sparsity) by name,
 * doubled for BF16 (twice TF32's rate on every GPU listed); 0 for a GPU not listed
 * (--peak-tflops then). Only the child touches CUDA: a parent that initialised it could not
 * fork a child that uses it. */
static double s_peak_by_name(const char *name, int bf16)
{
    static const struct {
        const char *part;
        double tflops;
    } peaks[] = {{"H200", 494.7}, {"H100 PCIe", 378.0}, {"H100 NVL", 417.5}, {"H100", 494.7},
                 {"A100", 156.0}, {"L40S", 183.0}, {"A10", 62.5}};
    for (size_t i = 0; i < sizeof peaks / sizeof *peaks; i++)
        if (strstr(name, peaks[i].part))
            return peaks[i].tflops * (bf16 ? 2 : 1);
    return 0;
}

static double s_clock(clockid_t id)
{
    struct timespec t;
    clock_gettime(id, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static nn_model *s_model(const s_case *c, const k_backend *be)
{
    nn_model_opts o;
    nn_model_opts_default(&o, c->model);
    o.in_size = c->size, o.aux = c->aux, o.in_channels = c->channels, o.classes = c->classes;
    o.width = c->width;
    nn_model *m;
    return nn_model_create(be, &o, &m) == ZPS_OK ? m : NULL;
}

/* The timed steps on the model's back-end: forward, backward and SGD momentum through
 * k_optim_apply (the trainer's local update, ps_optim_apply's arithmetic), then a 4-byte read
 * of the values, so that a device's step time includes its last kernel. On a device the
 * batch comes from pinned memory each step, as the trainer's does. Median-able times of the
 * last `steps` into t and cpu; 0, or 1 on a failure. */
static int s_steps(const s_case *c, nn_model *m, const float *x_src, const int32_t *y,
                   int warmup, int steps, double *t, double *cpu)
{
    const k_backend *be = nn_model_backend(m);
    size_t nx = (size_t)c->batch * (size_t)c->channels * (size_t)c->size * (size_t)c->size;
    size_t np = nn_model_param_count(m);
    int dev = k_backend_async(be);
    float *pinned = dev ? be->host_alloc(nx * sizeof *pinned) : NULL;
    float *mom = be->alloc(np * sizeof *mom);
    float probe;
    if ((dev && !pinned) || !mom || k_fill(be, np, 0.0f, mom) != ZPS_OK) {
        fprintf(stderr, "zps-bench train-step: cannot allocate the %s back-end's pinned input "
                "(%zu floats) or momentum (%zu floats)\n", be->name, nx, np);
        return 1; /* a child: its exit frees the rest */
    }
    if (dev)
        memcpy(pinned, x_src, nx * sizeof *pinned);
    const float *x = dev ? pinned : x_src;
    ps_optim_config opt;
    ps_optim_default(&opt);
    opt.kind = PS_OPT_MOMENTUM, opt.lr = 0.001, opt.momentum = 0.9;
    int rc = 0;
    for (int s = 0; s < warmup + steps && !rc; s++) {
        double t0 = s_clock(CLOCK_MONOTONIC), c0 = s_clock(CLOCK_PROCESS_CPUTIME_ID);
        float loss;
        zps_optim_step st;
        ps_optim_prepare(&opt, (uint64_t)s, &st);
        zps_status e = nn_model_forward(m, x, y, c->batch, 1, &loss, NULL);
        const char *what = "forward";
        if (e == ZPS_OK && (e = nn_model_backward(m, NULL, NULL)) != ZPS_OK)
            what = "backward";
        if (e == ZPS_OK && (e = k_optim_apply(be, &st, np, nn_model_params(m), mom, NULL,
                                              nn_model_grads(m))) != ZPS_OK)
            what = "the optimizer";
        if (e == ZPS_OK && (e = be->copy_out(&probe, nn_model_params(m), sizeof probe)) != ZPS_OK)
            what = "reading a value back";
        if (e != ZPS_OK) {
            fprintf(stderr, "zps-bench train-step: step %d, %s: %s\n", s + 1, what,
                    zps_strerror(e));
            rc = 1;
        }
        if (s >= warmup) {
            t[s - warmup] = s_clock(CLOCK_MONOTONIC) - t0;
            cpu[s - warmup] = s_clock(CLOCK_PROCESS_CPUTIME_ID) - c0;
        }
    }
    be->free(mom);
    if (dev)
        be->host_free(pinned);
    return rc;
}

/* Child: times the zps steps and writes its s_side to fd. Returns the
 * exit code. */
static int s_zps_child(const s_case *c, int warmup, int steps, int fd)
{
    char why[320] = "";
    const k_backend *be = c->cuda ? k_backend_cuda(why, sizeof why) : k_backend_cpu();
    if (!be) {
        fprintf(stderr, "zps-bench train-step: --device cuda: %s\n", why);
        return 1;
    }
    nn_model *m = s_model(c, be);
    if (!m)
        return 1;
    nn_model_set_recompute(m, c->recompute);
    nn_model_set_bf16(m, c->bf16);
    size_t nx = (size_t)c->batch * (size_t)c->channels * (size_t)c->size * (size_t)c->size;
    float *x = malloc(nx * sizeof *x);
    int32_t *y = malloc(sizeof(int32_t) * (size_t)c->batch);
    uint64_t r = 88172645463325252ull;
    for (size_t i = 0; i < nx; i++) {
        r ^= r << 13, r ^= r >> 7, r ^= r << 17;
        x[i] = (float)(r % 20001) / 10000.0f - 1.0f;
    }
    for (int i = 0; i < c->batch; i++)
        y[i] = i % c->classes;
    size_t np = nn_model_param_count(m);
    double *t = calloc(2 * (size_t)steps, sizeof *t), *cpu = t + steps;
    if (s_steps(c, m, x, y, warmup, steps, t, cpu) != 0)
        return 1;
    s_side out = {c->batch / bench_median(t, (size_t)steps), (double)np,
                  c->batch / bench_median(cpu, (size_t)steps), nn_model_flops_per_sample(m),
                  c->peak_tflops, nn_model_activation_bytes(m) / 1048576.0};
    if (c->cuda && !out.peak) {
        k_device_info info;
        if (k_device_select("cuda", &info) == ZPS_OK)
            out.peak = s_peak_by_name(info.name, c->bf16);
    }
    if (write(fd, &out, sizeof out) != (ssize_t)sizeof out)
        return 1;
    free(t), free(x), free(y);
    nn_model_destroy(&m);
    return 0;
}

static int s_run_zps(const s_case *c, int warmup, int steps, s_side *z, double *rss_mb)
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
        _exit(s_zps_child(c, warmup, steps, p[1]));
    }
    close(p[1]);
    ssize_t got = read(p[0], z, sizeof *z);
    close(p[0]);
    int status;
    struct rusage ru;
    if (wait4(pid, &status, 0, &ru) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0 ||
        got != (ssize_t)sizeof *z)
        return -1;
    *rss_mb = (double)ru.ru_maxrss / 1024.0;
    return 0;
}

/* Runs a peer's command line and reads KEY's number, "params" and "cpu_ips" from its
 * output. */
static int s_run_peer(const char *cmd, const char *key, s_side *out)
{
    fflush(NULL);
    FILE *f = popen(cmd, "r");
    if (!f)
        return -1;
    char line[8192];
    int ok = -1;
    size_t kn = strlen(key);
    while (fgets(line, sizeof line, f)) {
        char *p = strstr(line, key), *q = strstr(line, "\"params\": ");
        char *c = strstr(line, "\"cpu_ips\": ");
        if (p && q && c && sscanf(p + kn, "%lf", &out->ips) == 1 &&
            sscanf(q + 10, "%lf", &out->params) == 1 && sscanf(c + 11, "%lf", &out->cpu_ips) == 1)
            ok = 0;
    }
    if (pclose(f) != 0)
        ok = -1;
    return ok;
}

/* The environment prefix of a peer: without what zps_omp_env set for zps's policy (its
 * thread count stays: it is the one the peers are asked for too). */
static const char *s_peer_env(void)
{
    return zps_omp_env_set("GOMP_SPINCOUNT") ? "env -u GOMP_SPINCOUNT -u ZPS_OMP_CONFIGURED"
                                             : "env -u ZPS_OMP_CONFIGURED";
}

static const char *s_root(void)
{
    const char *root = getenv("ZPS_ROOT");
    return root ? root : ".";
}

static int s_run_torch(const s_case *c, int threads, int warmup, int steps, s_side *out)
{
    char cmd[8192];
    if (c->cuda) { /* the GPU machine's python (with CUDA PyTorch): $ZPS_PYTHON, else python3 */
        const char *py = getenv("ZPS_PYTHON");
        snprintf(cmd, sizeof cmd,
                 "%s %s %s/tests/ref/train_step_ref.py --device cuda --model %s --width %g "
                 "--channels %d --classes %d --size %d --batch %d --aux %d --warmup %d "
                 "--steps %d --threads %d --precision %s",
                 s_peer_env(), py && *py ? py : "python3", s_root(), c->model, (double)c->width,
                 c->channels, c->classes, c->size, c->batch, c->aux, warmup, steps, threads,
                 c->bf16 ? "bf16" : "f32");
        return s_run_peer(cmd, "\"ips\": ", out);
    }
    snprintf(cmd, sizeof cmd,
             "%s LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 "
             "MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1 /usr/bin/python3 "
             "%s/tests/ref/train_step_ref.py --model %s --width %g --channels %d --classes %d "
             "--size %d --batch %d --aux %d --warmup %d --steps %d --threads %d --precision %s",
             s_peer_env(), s_root(), c->model, (double)c->width, c->channels, c->classes,
             c->size, c->batch, c->aux, warmup, steps, threads, c->bf16 ? "bf16" : "f32");
    return s_run_peer(cmd, "\"ips\": ", out);
}

static int s_run_tf(const char *python, const s_case *c, int threads, int warmup, int steps,
                    s_side *out)
{
    char cmd[8192];
    snprintf(cmd, sizeof cmd,
             "%s %s %s/scripts/bench.d/peers_tf.py train-step '{\"model\": \"%s\", \"width\": "
             "%g, \"channels\": %d, \"classes\": %d, \"size\": %d, \"batch\": %d, \"warmup\": "
             "%d, \"steps\": %d, \"threads\": %d}' 2>/dev/null",
             s_peer_env(), python, s_root(), c->model, (double)c->width, c->channels, c->classes,
             c->size, c->batch, warmup, steps, threads);
    return s_run_peer(cmd, "\"img_s\": ", out);
}

static int s_train_step(int argc, char **argv);

/* Registered by hand: the subcommand name has a dash, which ZPS_BENCH cannot spell. */
__attribute__((constructor)) static void s_register(void)
{
    bench_register("train-step", s_train_step,
                   "CPU training step img/s vs TensorFlow and PyTorch (train_step.json)");
}

/* The command line. */
typedef struct s_cfg {
    int convnet;                      // --model: 0 inception_v3, 1 convnet
    const char *shapes, *tf_python; // shapes: SIZExBATCH,...
    double width;
    int channels, classes, threads; // 0: the model's default; threads 0: zps all cores
    int steps, warmup, pairs;
    int torch, tf, append; // run PyTorch, run TF, add to train_step.json
    int cuda;              // --device: 0 cpu, 1 cuda
    double peak_tflops;    // the GPU's dense peak, TF32 or BF16 (0: from its name)
    int recompute;         // zps with --recompute
    int bf16;              // --precision bf16
} s_cfg;

static void s_defaults(void *p)
{
    *(s_cfg *)p = (s_cfg){.width = 1, .steps = 5, .warmup = 2,
                          .pairs = 1, .torch = 1, .tf = 1};
}

static const zps_opt_name s_models[] = {{"inception_v3", 0}, {"convnet", 1}, {NULL, 0}};
static const zps_opt_name s_devices[] = {{"cpu", 0}, {"cuda", 1}, {NULL, 0}};
static const zps_opt_name s_precisions[] = {{"f32", 0}, {"bf16", 1}, {NULL, 0}};

static const zps_opt s_opt[] = {
    {"model", ZPS_OPT_ENUM, ZPS_OPT_FIELD(s_cfg, convnet), .names = s_models,
     .dflt = "inception_v3", .help = "the model"},
    {"shapes", ZPS_OPT_ARG, ZPS_OPT_FIELD(s_cfg, shapes), .meta = "SIZExBATCH,...",
     .dflt = "299x8,299x32,139x32,75x32 (convnet 28x32)",
     .help = "input shapes; inception_v3's aux head on where SIZE >= 299"},
    {"width", ZPS_OPT_DOUBLE, ZPS_OPT_FIELD(s_cfg, width), 0.01, 4, .meta = "W",
     .help = "inception_v3 channel multiplier"},
    {"channels", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, channels), 0, 64, .meta = "N",
     .dflt = "inception_v3 3, convnet 1", .help = "input channels"},
    {"classes", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, classes), 0, 100000, .meta = "N",
     .dflt = "inception_v3 1000, convnet 10", .help = "classes"},
    {"threads", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, threads), 0, 1024, .meta = "N",
     .dflt = "0", .help = "threads of every side (0: zps all cores, the peers 2)"},
    {"steps", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, steps), 1, 1000000, .meta = "N",
     .help = "timed steps"},
    {"warmup", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, warmup), 0, 1000000, .meta = "N",
     .help = "steps before timing"},
    {"pairs", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, pairs), 1, 1000, .meta = "N",
     .help = "alternating rounds of all sides per shape (medians over them)"},
    {"no-torch", ZPS_OPT_CLEAR, ZPS_OPT_FIELD(s_cfg, torch), .help = "skip the PyTorch side"},
    {"no-tf", ZPS_OPT_CLEAR, ZPS_OPT_FIELD(s_cfg, tf), .help = "skip the TensorFlow side"},
    {"tf-python", ZPS_OPT_ARG, ZPS_OPT_FIELD(s_cfg, tf_python), .meta = "PATH",
     .dflt = "BENCH_DIR/../peers-venv/bin/python", .help = "python with tensorflow-cpu"},
    {"append", ZPS_OPT_SET, ZPS_OPT_FIELD(s_cfg, append),
     .help = "add the records to train_step.json instead of replacing it"},
    {"device", ZPS_OPT_ENUM, ZPS_OPT_FIELD(s_cfg, cuda), .names = s_devices, .dflt = "cpu",
     .help = "cuda: zps and PyTorch ($ZPS_PYTHON or python3) on the GPU,\n"
             "f32 with TF32 convolutions (both sides' defaults); no TF"},
    {"precision", ZPS_OPT_ENUM, ZPS_OPT_FIELD(s_cfg, bf16), .names = s_precisions,
     .dflt = "f32",
     .help = "bf16: zps's convolutions in bf16 (zps-trainer --precision), PyTorch\n"
             "under bf16 autocast; no TF side"},
    {"recompute", ZPS_OPT_SET, ZPS_OPT_FIELD(s_cfg, recompute),
     .help = "zps with gradient checkpointing (zps-trainer --recompute)"},
    {"peak-tflops", ZPS_OPT_DOUBLE, ZPS_OPT_FIELD(s_cfg, peak_tflops), 0, 1e6, .meta = "T",
     .dflt = "from the GPU's name",
     .help = "the GPU's dense tensor peak in the precision measured (TF32,\n"
             "or BF16 with --precision bf16), for the fraction of it the\n"
             "convolutions reach"},
    {.type = ZPS_OPT_END},
};

static const zps_opts s_spec = BENCH_OPTS("train-step", s_cfg, s_opt, s_defaults, NULL);

/* The medians of one shape's rounds; NAN where a side did not run. */
typedef struct s_result {
    double zps, torch, tf, ratio, tf_ratio, rss, params;
    double flops, peak; // zps's forward FLOPs per image; the GPU's peak (TFLOP/s)
    double act_mib;     // zps's activation block
    double zps_cpu, torch_cpu, tf_cpu, cpu_ratio, tf_cpu_ratio; // per CPU-second
} s_result;

/* One side's paired figures: its img/s and zps's over it in each round where it ran. */
typedef struct s_pairs {
    double ips[1000], ratio[1000], cpu[1000], cpu_ratio[1000];
    int n;
} s_pairs;

static double s_med(double *v, int n)
{
    return n > 0 ? bench_median(v, (size_t)n) : NAN;
}

/* A peer's round: its figures, checked against zps's parameter count. 0 ok (or not run),
 * 1 for a count that differs. */
static int s_peer_round(const char *name, int rc, const s_side *z, const s_side *p,
                        s_pairs *acc)
{
    if (rc != 0)
        return 0;
    if (p->params != z->params) {
        fprintf(stderr, "zps-bench train-step: %s's model has %.0f parameters, zps's %.0f\n",
                name, p->params, z->params);
        return 1;
    }
    acc->ips[acc->n] = p->ips, acc->ratio[acc->n] = z->ips / p->ips;
    acc->cpu[acc->n] = p->cpu_ips, acc->cpu_ratio[acc->n++] = z->cpu_ips / p->cpu_ips;
    return 0;
}

/* The rounds of one case: zps, TF, PyTorch, reversed every other round. 0, or 1 when zps
 * failed or a peer's parameter count differs. */
static int s_rounds(const s_cfg *cfg, const s_case *c, const char *tf_py, s_result *res)
{
    int th = cfg->threads > 0 ? cfg->threads : 2, bad = 0, fails = 0, nz = 0;
    static s_pairs pt, pf;
    double zi[1000], zc[1000];
    pt.n = pf.n = 0;
    for (int r = 0; r < cfg->pairs && !bad; r++) {
        s_side z = {0}, t = {0}, f = {0};
        int zrc = 0, trc = -1, frc = -1;
        for (int k = 0; k < 3; k++) {
            int side = r % 2 ? 2 - k : k;
            if (side == 0)
                zrc = s_run_zps(c, cfg->warmup, cfg->steps, &z, &res->rss);
            else if (side == 1 && tf_py)
                frc = s_run_tf(tf_py, c, th, cfg->warmup, cfg->steps, &f);
            else if (side == 2 && cfg->torch)
                trc = s_run_torch(c, th, cfg->warmup, cfg->steps, &t);
        }
        if (zrc != 0)
            return 1;
        fails += (tf_py && frc != 0) + (cfg->torch && trc != 0);
        zi[nz] = z.ips, zc[nz++] = z.cpu_ips, res->params = z.params;
        res->flops = z.flops, res->peak = z.peak, res->act_mib = z.act_mib;
        bad = s_peer_round("PyTorch", trc, &z, &t, &pt) | s_peer_round("TF", frc, &z, &f, &pf);
    }
    if (fails)
        fprintf(stderr, "zps-bench train-step: a peer failed %d time(s) at %s %dx%d (python3-torch "
                        "or the TF venv missing?)\n", fails, c->model, c->size, c->batch);
    res->zps = s_med(zi, nz), res->zps_cpu = s_med(zc, nz);
    res->torch_cpu = s_med(pt.cpu, pt.n), res->cpu_ratio = s_med(pt.cpu_ratio, pt.n);
    res->tf_cpu = s_med(pf.cpu, pf.n), res->tf_cpu_ratio = s_med(pf.cpu_ratio, pf.n);
    res->torch = s_med(pt.ips, pt.n), res->ratio = s_med(pt.ratio, pt.n);
    res->tf = s_med(pf.ips, pf.n), res->tf_ratio = s_med(pf.ratio, pf.n);
    return bad;
}

static const char *s_num(char *buf, size_t n, double v)
{
    if (isnan(v))
        snprintf(buf, n, "null");
    else
        snprintf(buf, n, "%.3f", v);
    return buf;
}

/* One shape, all sides: its table line and JSON object (first: no leading comma). 0 when
 * it ran, 1 when it failed, 2 for a malformed shape. */
static int s_one_shape(const s_cfg *cfg, const char *tf_py, const char *tok, FILE *out,
                       int first)
{
    int convnet = cfg->convnet;
    s_case c = {s_models[convnet].name, (float)cfg->width, cfg->channels ? cfg->channels : convnet ? 1 : 3,
                cfg->classes ? cfg->classes : convnet ? 10 : 1000, 0, 0, 0, cfg->cuda,
                cfg->peak_tflops, cfg->recompute, cfg->bf16};
    if (sscanf(tok, "%dx%d", &c.size, &c.batch) != 2 || c.size < (convnet ? 1 : 75) ||
        c.batch < 1) {
        fprintf(stderr, "zps-bench train-step: bad shape '%s' (want SIZExBATCH)\n", tok);
        return 2;
    }
    c.aux = !convnet && c.size >= 299;
    const char *nth = getenv("OMP_NUM_THREADS");
    char policy[48]; /* the user's OMP_WAIT_POLICY, or the spin zps_omp_env set */
    if (getenv("OMP_WAIT_POLICY"))
        snprintf(policy, sizeof policy, "%s", getenv("OMP_WAIT_POLICY"));
    else if (getenv("GOMP_SPINCOUNT"))
        snprintf(policy, sizeof policy, "spin %s", getenv("GOMP_SPINCOUNT"));
    else
        snprintf(policy, sizeof policy, "default");
    double before = -1, after = -1;
    s_result r = {0};
    bench_loadavg(&before);
    if (s_rounds(cfg, &c, c.aux || c.cuda || c.bf16 ? NULL : tf_py, &r) != 0) {
        fprintf(stderr, "zps-bench train-step: %s %s failed\n", c.model, tok);
        return 1;
    }
    bench_loadavg(&after);
    int busy = bench_busy(before) || bench_busy(after);
    char tb[32], rb[32], fb[32], qb[32], tc[32], rc[32], fc[32], qc[32];
    printf("%-12s %-9s %8.0f %10.2f %10s %7s %10s %7s %7s %7s %8.0f %5.2f/%-5.2f%s\n", c.model,
           tok, r.params, r.zps, s_num(tb, 32, r.torch), s_num(rb, 32, r.ratio),
           s_num(fb, 32, r.tf), s_num(qb, 32, r.tf_ratio), s_num(rc, 32, r.cpu_ratio),
           s_num(qc, 32, r.tf_cpu_ratio), r.rss, before, after,
           busy ? "  BUSY: discard this line" : "");
    /* training ~ 3 x the forward's FLOPs (forward, input gradients, weight gradients) */
    double tflops = 3 * r.flops * r.zps * 1e-12, torch_tflops = 3 * r.flops * r.torch * 1e-12;
    double frac = r.peak > 0 ? tflops / r.peak : NAN;
    char pk[32], fr[32], tt[32];
    if (c.cuda)
        printf("%-22s zps %.1f TFLOP/s, PyTorch %s, of a %s TFLOP/s %s peak: zps %s\n", "",
               tflops, s_num(tt, 32, torch_tflops), s_num(pk, 32, r.peak > 0 ? r.peak : NAN),
               c.bf16 ? "BF16" : "TF32", s_num(fr, 32, frac));
    printf("%-22s zps activations and gradients: %.1f MiB%s\n", "", r.act_mib,
           c.recompute ? " (--recompute)" : "");
    fflush(stdout);
    fprintf(out,
            "%s\n  {\"shape\": \"%dx%dx%d\", \"batch\": %d, \"aux\": %d, \"zps_ips\": %.3f, "
            "\"torch_ips\": %s, \"ratio\": %s, \"zps_peak_rss_mb\": %.0f, "
            "\"omp_wait_policy\": \"%s\", \"cores\": %ld, \"load_before\": %.2f, "
            "\"load_after\": %.2f, \"busy\": %s, \"model\": \"%s\", \"width\": %g, "
            "\"classes\": %d, \"threads\": %d, \"omp_num_threads\": \"%s\", \"params\": %.0f, "
            "\"tf_ips\": %s, \"tf_ratio\": %s, \"pairs\": %d, \"zps_cpu_ips\": %.3f, "
            "\"torch_cpu_ips\": %s, \"tf_cpu_ips\": %s, \"cpu_ratio\": %s, \"tf_cpu_ratio\": %s, "
            "\"device\": \"%s\", \"train_flops_per_image\": %.0f, \"zps_tflops\": %.3f, "
            "\"torch_tflops\": %s, \"peak_tflops\": %s, \"zps_peak_fraction\": %s, "
            "\"recompute\": %d, \"zps_activation_mib\": %.1f, \"precision\": \"%s\"}",
            first ? "" : ",", c.channels, c.size, c.size, c.batch, c.aux, r.zps, tb, rb, r.rss,
            policy, sysconf(_SC_NPROCESSORS_ONLN), before, after,
            busy ? "true" : "false", c.model, (double)c.width, c.classes, cfg->threads,
            nth ? nth : "", r.params, fb, qb, cfg->pairs, r.zps_cpu, s_num(tc, 32, r.torch_cpu),
            s_num(fc, 32, r.tf_cpu), rc, qc, c.cuda ? "cuda" : "cpu", 3 * r.flops, tflops,
            s_num(tt, 32, torch_tflops), s_num(pk, 32, r.peak > 0 ? r.peak : NAN),
            s_num(fr, 32, frac), c.recompute, r.act_mib, c.bf16 ? "bf16" : "f32");
    return 0;
}

/* Opens train_step.json; with append, rewrites the records it held first (*first 0 when
 * there were any). */
static FILE *s_open_json(int append, char *path, size_t len, int *first)
{
    char *old = NULL;
    size_t n = 0;
    *first = 1;
    snprintf(path, len, "%s/train_step.json", bench_out_dir());
    FILE *in = append ? fopen(path, "r") : NULL;
    if (in) {
        old = malloc(1 << 20);
        n = old ? fread(old, 1, (1 << 20) - 1, in) : 0;
        fclose(in);
        char *end = n ? memrchr(old, ']', n) : NULL;
        n = end && memchr(old, '{', (size_t)(end - old)) ? (size_t)(end - old) : 0;
        while (n && (old[n - 1] == '\n' || old[n - 1] == ' '))
            n--;
    }
    FILE *out = bench_json_open("train-step", "train_step.json", path, len);
    if (out && n) {
        fwrite(old, 1, n, out);
        *first = 0;
    } else if (out)
        fprintf(out, "[");
    free(old);
    return out;
}

static int s_train_step(int argc, char **argv)
{
    s_cfg cfg;
    int rc = bench_opts_parse(&s_spec, &cfg, argc, argv);
    if (rc >= 0)
        return rc;
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    /* OMP_NUM_THREADS = cores / local: local processes of threads threads each */
    zps_omp_env(cfg.threads > 0 && cores > cfg.threads ? (int)(cores / cfg.threads) : 1,
                bench_argv());
    char tf_buf[4096];
    const char *tf_py = cfg.tf_python;
    if (!tf_py) {
        snprintf(tf_buf, sizeof tf_buf, "%s/../peers-venv/bin/python", bench_out_dir());
        tf_py = tf_buf;
    }
    if (!cfg.tf || access(tf_py, X_OK) != 0)
        tf_py = NULL;
    char path[4096];
    int first;
    FILE *out = s_open_json(cfg.append, path, sizeof path, &first);
    if (!out)
        return 1;
    rc = 0;
    char *list = strdup(cfg.shapes           ? cfg.shapes
                        : cfg.convnet ? "28x32"
                                      : "299x8,299x32,139x32,75x32");
    char *save = NULL;
    const char *nth = getenv("OMP_NUM_THREADS");
    printf("train-step: zps threads %s, TF %s\n", nth ? nth : "all", tf_py ? tf_py : "not run");
    printf("%-12s %-9s %8s %10s %10s %7s %10s %7s %7s %7s %8s %s\n", "model", "shape", "params",
           "zps img/s", "torch", "z/torch", "TF", "z/TF", "z/t cpu", "z/TF cpu", "RSS MiB",
           "load before/after");
    for (char *tok = strtok_r(list, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int r = s_one_shape(&cfg, tf_py, tok, out, first);
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
           path, cores);
    return rc;
}
