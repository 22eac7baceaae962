/* bench_optim.c — `zps-bench optim`: the optimizer's update as a server applies it
 * (ps_apply_pool_run over ps_optim_apply: common/optim_apply.c's vectorised loop, on 1 and
 * on --threads threads) against PyTorch's optimizer.step() on the CPU
 * (scripts/optim_step.py, Debian's /usr/bin/python3) in the same run, for sgd, momentum,
 * rmsprop, adam and adagrad, over one tensor of each --sizes count (default 1 Mi floats,
 * which stay in this machine's 32 MiB L3, and 16 Mi, which do not).
 *
 * A figure is the median over --reps updates (after --warmup untimed ones) of the time of
 * one update, in ms. zps's arrays are allocated and pre-faulted once per size; PyTorch's
 * are its own tensors. ratio = torch_ms / zps_ms on one thread each (above 1: zps faster).
 * Both sides use the same hyperparameters (scripts/optim_step.py lists them; torch's
 * rmsprop orders its operations differently, with the same passes over memory).
 * Writes $ZPS_BENCH_DIR/optim.json: [{optimizer, floats, zps_ms, zps_threads_ms, threads,
 * torch_ms, ratio, load}, ...] (torch_ms and ratio null with --no-torch or when the peer
 * could not run).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench.h"
#include "common/clock.h"
#include "common/mem.h"
#include "ps/apply_pool.h"
#include "ps/optim.h"

#define S_MAX_SIZES 8
#define S_MAX_REPS 200
#define S_KINDS 5

static const char *const s_kind_names[S_KINDS] = {"sgd", "momentum", "rmsprop", "adam",
                                                  "adagrad"};
static const ps_optim_kind s_kinds[S_KINDS] = {PS_OPT_SGD, PS_OPT_MOMENTUM, PS_OPT_RMSPROP,
                                               PS_OPT_ADAM, PS_OPT_ADAGRAD};

typedef struct {
    int reps, warmup, threads, n_sizes;
    int no_torch;
    size_t sizes[S_MAX_SIZES]; // floats
} s_cfg;

/* The hyperparameters of scripts/optim_step.py. */
static ps_optim_config s_config(ps_optim_kind k)
{
    ps_optim_config o;
    ps_optim_default(&o);
    o.kind = k;
    o.lr = 0.01;
    o.weight_decay = 1e-4;
    o.momentum = k == PS_OPT_SGD ? 0 : 0.9;
    o.decay = 0.9;
    o.epsilon = k == PS_OPT_RMSPROP ? 1.0 : k == PS_OPT_ADAM ? 1e-8 : 1e-10;
    o.beta1 = 0.9;
    o.beta2 = 0.999;
    o.initial_accumulator = 0.1;
    return o;
}

/* Median ms of one update of n floats through pool. */
static double s_time(const s_cfg *c, ps_apply_pool *pool, const ps_optim_config *o, float *w,
                     float **slots, const float *g, size_t n)
{
    double t[S_MAX_REPS];
    for (int r = 0; r < c->warmup + c->reps; r++) {
        uint64_t t0 = zps_now_ns();
        ps_apply_pool_run(pool, o, (uint64_t)r, w, slots, g, n);
        if (r >= c->warmup)
            t[r - c->warmup] = (double)(zps_now_ns() - t0) * 1e-6;
    }
    return bench_median(t, (size_t)c->reps);
}

/* Runs the PyTorch peer; torch[k * n_sizes + i] its median ms (negative where it failed). */
static void s_run_torch(const s_cfg *c, double *torch)
{
    for (int i = 0; i < S_KINDS * c->n_sizes; i++)
        torch[i] = -1;
    char args[512], sizes[256] = "";
    size_t o = 0;
    for (int i = 0; i < c->n_sizes; i++)
        o += (size_t)snprintf(sizes + o, sizeof sizes - o, "%s%zu", i ? "," : "", c->sizes[i]);
    snprintf(args, sizeof args, "--sizes %s --reps %d --warmup %d --threads 1", sizes, c->reps,
             c->warmup);
    static char out[1 << 18];
    /* [{"kind": K, "floats": N, "median_ms": T, ...}, ...], kinds outer, sizes inner */
    if (bench_peer("optim_step.py", args, out, sizeof out) == 0)
        bench_json_numbers(out, "median_ms", torch, S_KINDS * c->n_sizes);
}

static int s_parse_sizes(void *cfg, const char *arg)
{
    s_cfg *c = cfg;
    c->n_sizes = 0;
    char *copy = zps_xstrdup(arg), *save = NULL;
    int ok = 1;
    for (char *t = strtok_r(copy, ",", &save); t && ok; t = strtok_r(NULL, ",", &save)) {
        char *end;
        unsigned long long v = strtoull(t, &end, 10);
        ok = *end == 0 && v >= 1 && v <= (1ull << 30) && c->n_sizes < S_MAX_SIZES;
        if (ok)
            c->sizes[c->n_sizes++] = (size_t)v;
    }
    free(copy);
    return ok && c->n_sizes > 0 ? 0 : -1;
}

static zps_status s_sizes_opt(void *cfg, const char *arg, char *why, size_t cap)
{
    if (s_parse_sizes(cfg, arg) == 0)
        return ZPS_OK;
    snprintf(why, cap, "wants up to %d counts of floats, 1 to 2^30 each, got '%s'",
             S_MAX_SIZES, arg);
    return ZPS_ERR_INVALID;
}

static void s_defaults(void *p)
{
    s_cfg *c = p;
    *c = (s_cfg){.reps = 15, .warmup = 3, .threads = 2};
    s_parse_sizes(c, "1048576,16777216");
}

static void s_more_help(FILE *f)
{
    fprintf(f, "ms per update, median; ratio = PyTorch's ms / zps's ms on one thread each.\n");
}

#define F(f) ZPS_OPT_FIELD(s_cfg, f)
static const zps_opt s_opt[] = {
    {"sizes", ZPS_OPT_FUNC, .fn = s_sizes_opt, .meta = "LIST", .dflt = "1048576,16777216",
     .help = "tensor sizes in float32 elements, comma-separated"},
    {"reps", ZPS_OPT_INT, F(reps), 1, S_MAX_REPS, .meta = "N", .help = "timed updates"},
    {"warmup", ZPS_OPT_INT, F(warmup), 0, 1000, .meta = "N", .help = "updates before timing"},
    {"threads", ZPS_OPT_INT, F(threads), 1, PS_APPLY_MAX_THREADS, .meta = "N",
     .help = "zps's second run: its update on N threads (zps-server --apply-threads)"},
    {"no-torch", ZPS_OPT_SET, F(no_torch), .help = "skip the PyTorch peer"},
    {.type = ZPS_OPT_END},
};
#undef F

static const zps_opts s_spec = BENCH_OPTS("optim", s_cfg, s_opt, s_defaults, s_more_help);

ZPS_BENCH(optim, "the servers' optimizer update (1 and N threads) vs PyTorch's step, ms")
{
    s_cfg c;
    int rc = bench_opts_parse(&s_spec, &c, argc, argv);
    if (rc >= 0)
        return rc;
    ps_apply_pool *one = NULL, *many = NULL;
    if (ps_apply_pool_new(1, &one) != ZPS_OK || ps_apply_pool_new(c.threads, &many) != ZPS_OK) {
        fprintf(stderr, "zps-bench optim: cannot start %d threads\n", c.threads);
        ps_apply_pool_destroy(&one);
        return 1;
    }
    double zps1[S_KINDS * S_MAX_SIZES], zpsn[S_KINDS * S_MAX_SIZES];
    double torch[S_KINDS * S_MAX_SIZES], load[S_KINDS * S_MAX_SIZES];
    for (int i = 0; i < c.n_sizes; i++) {
        size_t n = c.sizes[i];
        float *w = zps_xaligned(64, n * 4), *g = zps_xaligned(64, n * 4);
        float *s0 = zps_xaligned(64, n * 4), *s1 = zps_xaligned(64, n * 4);
        for (int k = 0; k < S_KINDS; k++) {
            ps_optim_config o = s_config(s_kinds[k]);
            for (size_t j = 0; j < n; j++) { /* every page touched before timing */
                w[j] = (float)(j % 1000) * 1e-3f - 0.5f;
                g[j] = (float)(j % 777) * 1e-5f - 0.004f;
                s0[j] = ps_optim_slot_init(&o, 0);
                s1[j] = ps_optim_slot_init(&o, 1);
            }
            float *slots[2] = {s0, s1};
            int at = k * c.n_sizes + i;
            zps1[at] = s_time(&c, one, &o, w, slots, g, n);
            zpsn[at] = s_time(&c, many, &o, w, slots, g, n);
            bench_loadavg(&load[at]);
        }
        zps_aligned_free(w), zps_aligned_free(g), zps_aligned_free(s0), zps_aligned_free(s1);
    }
    ps_apply_pool_destroy(&one);
    ps_apply_pool_destroy(&many);
    if (c.no_torch)
        for (int i = 0; i < S_KINDS * c.n_sizes; i++)
            torch[i] = -1;
    else
        s_run_torch(&c, torch);
    char path[1024];
    FILE *js = bench_json_open("optim", "optim.json", path, sizeof path);
    if (!js)
        return 1;
    printf("%-9s %10s %9s %11s %10s %7s %6s\n", "optimizer", "floats", "zps ms", "zps ms/N",
           "torch ms", "ratio", "load");
    fprintf(js, "[\n");
    int missing = 0;
    for (int k = 0; k < S_KINDS; k++)
        for (int i = 0; i < c.n_sizes; i++) {
            int at = k * c.n_sizes + i;
            int peer = torch[at] > 0;
            missing += !peer && !c.no_torch;
            double ratio = peer ? torch[at] / zps1[at] : 0;
            printf("%-9s %10zu %9.3f %11.3f %10.3f %7.2f %6.1f%s\n", s_kind_names[k], c.sizes[i],
                   zps1[at], zpsn[at], peer ? torch[at] : 0.0, ratio, load[at],
                   bench_busy(load[at]) ? " BUSY" : "");
            char tm[32] = "null", ra[32] = "null";
            if (peer) {
                snprintf(tm, sizeof tm, "%.4f", torch[at]);
                snprintf(ra, sizeof ra, "%.4f", ratio);
            }
            fprintf(js,
                    "%s  {\"optimizer\": \"%s\", \"floats\": %zu, \"zps_ms\": %.4f, "
                    "\"zps_threads_ms\": %.4f, \"threads\": %d, \"torch_ms\": %s, "
                    "\"ratio\": %s, \"load\": %.2f}",
                    at ? ",\n" : "", s_kind_names[k], c.sizes[i], zps1[at], zpsn[at], c.threads,
                    tm, ra, load[at]);
        }
    fprintf(js, "\n]\n");
    fclose(js);
    printf("zps ms/N: the update on %d threads (zps-server --apply-threads %d); ratio: "
           "PyTorch's ms / zps's, one thread each\n", c.threads, c.threads);
    printf("wrote %s\n", path);
    if (missing)
        fprintf(stderr, "zps-bench optim: the PyTorch peer did not run; no ratio\n");
    return 0;
}
