/* bench_allreduce.c — `zps-bench allreduce`: the shared-memory all-reduce (trainer/allreduce.h)
 * against torch.distributed's gloo all-reduce (scripts/gloo_allreduce.py, Debian's
 * /usr/bin/python3) in the same run.
 *
 * GB/s is algorithm bandwidth for both: bytes of one rank's buffer / time of one collective,
 * 1 GB = 1e9 bytes. A repetition is timed on every rank from the end of a barrier to the end
 * of the all-reduce; the repetition's time is the slowest rank's; figures are medians over
 * repetitions (after warm-up calls). Buffers are allocated and pre-faulted once per size, and
 * both sides reduce the same buffer repeatedly (sum, no refill). zps runs half its
 * repetitions before gloo and half after (one median over both), so the two never share the
 * cores and a change of background load during the run affects both alike.
 *
 * Writes $ZPS_BENCH_DIR/allreduce.json: [{bytes, zps_gbps, gloo_gbps, ratio}, ...] with
 * ratio = zps_gbps / gloo_gbps (gloo_gbps and ratio null with --no-gloo or when the peer
 * could not run).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/bench.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "trainer/allreduce.h"

#define S_MAX_SIZES 16
#define S_MAX_REPS 200
#define S_MAX_RANKS 8

typedef struct {
    int ranks, reps, warmup, n_sizes;
    int no_gloo; // --no-gloo: zps only
    int rep0; // index of this pass's first repetition in s_times
    size_t sizes[S_MAX_SIZES]; // bytes
    tr_allreduce_opts opts;
    char job[64];
} s_cfg;

/* times[size][rep][rank], in a MAP_SHARED anonymous region the children write */
static double *s_times;

static double *s_slot(int si, int rep, int rank)
{
    return &s_times[((size_t)si * S_MAX_REPS + (size_t)rep) * S_MAX_RANKS + (size_t)rank];
}

static int s_rank_main(const s_cfg *c, int rank)
{
    zps_log_init("bench", rank);
    size_t max_bytes = 0;
    for (int i = 0; i < c->n_sizes; i++)
        if (c->sizes[i] > max_bytes)
            max_bytes = c->sizes[i];
    size_t max_floats = max_bytes / sizeof(float);
    tr_allreduce *ar = NULL;
    if (tr_allreduce_new(c->job, rank, c->ranks, max_floats, &c->opts, &ar) != ZPS_OK)
        return 1;
    float *buf = zps_xaligned(64, max_floats * sizeof(float));
    uint64_t x = 0x9e3779b97f4a7c15ull * (uint64_t)(rank + 1);
    for (size_t i = 0; i < max_floats; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        buf[i] = (float)(x >> 40) / (float)(1u << 24) - 0.5f;
    }
    int rc = 0;
    for (int si = 0; si < c->n_sizes && !rc; si++) {
        size_t n = c->sizes[si] / sizeof(float);
        for (int w = 0; w < c->warmup && !rc; w++)
            rc = tr_allreduce_sum(ar, buf, n, 0) != ZPS_OK;
        for (int r = 0; r < c->reps && !rc; r++) {
            rc = tr_allreduce_barrier(ar) != ZPS_OK;
            uint64_t t0 = zps_now_ns();
            rc = rc || tr_allreduce_sum(ar, buf, n, 0) != ZPS_OK;
            *s_slot(si, c->rep0 + r, rank) = (double)(zps_now_ns() - t0) * 1e-9;
        }
    }
    zps_aligned_free(buf);
    tr_allreduce_destroy(&ar);
    return rc;
}

/* Forks the ranks of one zps pass and reaps them; 0 when all succeeded. */
static int s_run_zps(const s_cfg *c)
{
    fflush(NULL);
    pid_t pids[S_MAX_RANKS];
    int failed = 0, n = 0;
    for (int r = 0; r < c->ranks; r++, n++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            perror("fork");
            failed = 1;
            break;
        }
        if (pids[r] == 0)
            _exit(s_rank_main(c, r));
    }
    for (int r = 0; r < n; r++) {
        int st;
        if (waitpid(pids[r], &st, 0) != pids[r] || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
            failed = 1;
    }
    return failed;
}

/* Runs the gloo peer; fills gbps[i] (negative when it failed). */
static void s_run_gloo(const s_cfg *c, double *gbps)
{
    for (int i = 0; i < c->n_sizes; i++)
        gbps[i] = -1;
    char args[1024], sizes[512] = "";
    size_t o = 0;
    for (int i = 0; i < c->n_sizes; i++)
        o += (size_t)snprintf(sizes + o, sizeof sizes - o, "%s%zu", i ? "," : "", c->sizes[i]);
    snprintf(args, sizeof args, "--ranks %d --sizes %s --reps %d --warmup %d", c->ranks, sizes,
             c->reps, c->warmup);
    static char out[1 << 16];
    /* the peer prints [{"bytes": B, "median_s": T, "gbps": G, ...}, ...] in size order */
    if (bench_peer("gloo_allreduce.py", args, out, sizeof out) == 0)
        bench_json_numbers(out, "gbps", gbps, c->n_sizes);
}

static int s_parse_sizes(const char *arg, s_cfg *c)
{
    c->n_sizes = 0;
    char *copy = zps_xstrdup(arg), *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        char *end;
        double v = strtod(t, &end);
        double mult = 1e6; // default unit MB
        if (!strcmp(end, "KB") || !strcmp(end, "K"))
            mult = 1e3;
        else if (!strcmp(end, "B"))
            mult = 1;
        else if (*end && strcmp(end, "MB") && strcmp(end, "M"))
            v = -1;
        if (v <= 0 || c->n_sizes == S_MAX_SIZES) {
            free(copy);
            return -1;
        }
        size_t b = (size_t)(v * mult) / 64 * 64;
        c->sizes[c->n_sizes++] = b ? b : 64;
    }
    free(copy);
    return c->n_sizes ? 0 : -1;
}

static zps_status s_sizes_opt(void *cfg, const char *arg, char *why, size_t cap)
{
    if (s_parse_sizes(arg, cfg) == 0)
        return ZPS_OK;
    snprintf(why, cap, "wants up to %d sizes in MB (or 512KB, 64B), got '%s'", S_MAX_SIZES,
             arg);
    return ZPS_ERR_INVALID;
}

static void s_more_help(FILE *f)
{
    fprintf(f, "GB/s = bytes per rank / time of one all-reduce (1 GB = 1e9 B), median.\n");
}

static void s_defaults(void *p)
{
    s_cfg *c = p;
    *c = (s_cfg){.ranks = 2, .reps = 15, .warmup = 3};
    s_parse_sizes("1,4,16,64,100", c);
}

#define F(f) ZPS_OPT_FIELD(s_cfg, f)
static const zps_opt s_opt[] = {
    {"sizes", ZPS_OPT_FUNC, .fn = s_sizes_opt, .meta = "LIST", .dflt = "1,4,16,64,100",
     .help = "buffer sizes, comma-separated, in MB (or 512KB, 64B)"},
    {"ranks", ZPS_OPT_INT, F(ranks), 2, S_MAX_RANKS, .meta = "N", .help = "processes"},
    {"reps", ZPS_OPT_INT, F(reps), 1, S_MAX_REPS, .meta = "N", .help = "repetitions"},
    {"warmup", ZPS_OPT_INT, F(warmup), 0, 1000000, .meta = "N", .help = "calls before timing"},
    {"slice", ZPS_OPT_UINT, F(opts.slice_floats), 0, 1 << 30, .meta = "FLOATS",
     .dflt = "the all-reduce's", .help = "tr_allreduce_opts.slice_floats"},
    {"ring", ZPS_OPT_INT, F(opts.ring), 0, 1 << 20, .meta = "N", .dflt = "the all-reduce's",
     .help = "tr_allreduce_opts.ring"},
    {"no-gloo", ZPS_OPT_SET, F(no_gloo), .help = "skip the gloo peer"},
    {.type = ZPS_OPT_END},
};
#undef F

static const zps_opts s_spec = BENCH_OPTS("allreduce", s_cfg, s_opt, s_defaults, s_more_help);

/* zps GB/s per size (the median over repetitions of the slowest rank) and gloo's (negative
 * where it did not run). zps runs before and after gloo (half the repetitions each) and its
 * median is over both passes, so a change of background load during the run hits both
 * sides alike. 0, or 1 when a zps rank failed. */
static int s_measure(const s_cfg *c, double *zps, double *gloo)
{
    size_t tbytes = (size_t)S_MAX_SIZES * S_MAX_REPS * S_MAX_RANKS * sizeof(double);
    s_times = mmap(NULL, tbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (s_times == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    double per_rep[S_MAX_REPS];
    for (int si = 0; si < c->n_sizes; si++)
        gloo[si] = -1;
    int half = (c->reps + 1) / 2;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !c->no_gloo)
            s_run_gloo(c, gloo);
        s_cfg pc = *c;
        pc.reps = pass == 0 ? half : c->reps - half;
        pc.rep0 = pass == 0 ? 0 : half;
        snprintf(pc.job, sizeof pc.job, "bench-%d-%d", (int)getpid(), pass);
        if (pc.reps > 0 && s_run_zps(&pc) != 0) {
            fprintf(stderr, "zps-bench allreduce: a zps rank failed\n");
            munmap(s_times, tbytes);
            return 1;
        }
    }
    for (int si = 0; si < c->n_sizes; si++) {
        for (int r = 0; r < c->reps; r++) {
            double m = 0;
            for (int k = 0; k < c->ranks; k++)
                if (*s_slot(si, r, k) > m)
                    m = *s_slot(si, r, k);
            per_rep[r] = m;
        }
        zps[si] = (double)c->sizes[si] / bench_median(per_rep, (size_t)c->reps) / 1e9;
    }
    munmap(s_times, tbytes);
    return 0;
}

/* The table on stdout and allreduce.json. 0, or 1 when the file could not be written or
 * gloo was wanted and did not run. */
static int s_report(const s_cfg *c, const double *zps, const double *gloo)
{
    char path[4096];
    FILE *f = bench_json_open("allreduce", "allreduce.json", path, sizeof path);
    if (!f)
        return 1;
    printf("all-reduce, %d processes, median of %d (GB/s = bytes per rank / time, 1e9 B)\n",
           c->ranks, c->reps);
    printf("%12s %10s %10s %8s\n", "bytes", "zps GB/s", "gloo GB/s", "ratio");
    fprintf(f, "[");
    int gloo_ok = 1;
    for (int si = 0; si < c->n_sizes; si++) {
        int g = gloo[si] > 0;
        gloo_ok &= g;
        char gs[32] = "-", rs[32] = "-", gj[32] = "null", rj[32] = "null";
        if (g) {
            snprintf(gs, sizeof gs, "%.3f", gloo[si]);
            snprintf(rs, sizeof rs, "%.2fx", zps[si] / gloo[si]);
            snprintf(gj, sizeof gj, "%.4f", gloo[si]);
            snprintf(rj, sizeof rj, "%.3f", zps[si] / gloo[si]);
        }
        printf("%12zu %10.3f %10s %8s\n", c->sizes[si], zps[si], gs, rs);
        fprintf(f, "%s\n  {\"bytes\": %zu, \"zps_gbps\": %.4f, \"gloo_gbps\": %s, \"ratio\": %s}",
                si ? "," : "", c->sizes[si], zps[si], gj, rj);
    }
    fprintf(f, "\n]\n");
    if (fclose(f) != 0) {
        perror(path);
        return 1;
    }
    printf("wrote %s\n", path);
    if (!c->no_gloo && !gloo_ok) {
        fprintf(stderr, "zps-bench allreduce: the gloo peer did not run; no ratio\n");
        return 1;
    }
    return 0;
}

ZPS_BENCH(allreduce, "in-node shared-memory all-reduce vs torch gloo, 1-100 MB, GB/s")
{
    s_cfg c;
    int rc = bench_opts_parse(&s_spec, &c, argc, argv);
    if (rc >= 0)
        return rc;
    snprintf(c.job, sizeof c.job, "bench-%d", (int)getpid());
    double zps[S_MAX_SIZES], gloo[S_MAX_SIZES];
    if (s_measure(&c, zps, gloo) != 0)
        return 1;
    return s_report(&c, zps, gloo);
}
