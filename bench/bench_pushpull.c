/* bench_pushpull.c — `zps-bench pushpull`: push, pull and pushpull throughput and latency
 * of zps (zps-server processes + the client library) against the same transfers over raw
 * ZeroMQ DEALER/ROUTER with no zps logic, measured in the same run.
 *
 * Shapes: 1 server x 1 client and 2 servers x 2 clients on 127.0.0.1; payloads from 4 KiB to
 * 64 MiB per request (one float32 variable, cut by the zps plan; the raw run sends frames of
 * exactly the same sizes to the same servers); one request in flight per client. Each
 * client thread has its own client / sockets.
 *   zps_gbps / raw_gbps: payload bytes moved by all clients / wall time (pushpull counts
 *                        both directions), median of --reps repetitions
 *   *_p50_us, *_p99_us:  per-request latency over all repetitions
 *   ratio:               median over the repetitions of zps / raw; the repetitions
 *                        alternate (zps, raw, zps, raw, ...) so each pair shares the
 *                        machine's mood of the moment
 * The raw server is a separate process that never touches the payload: it replies to a push
 * with an empty ack and to a pull with zero-copy frames of a static buffer; the raw client
 * copies pulled frames into the destination buffer like the zps client does. The raw
 * server runs with glibc's default allocator settings (it is exec'd afresh, so nothing of
 * this process carries over); zps-server calls zps_malloc_keep_warm(), which is part of
 * what zps does; --raw-warm gives the raw server the same settings. The bench process
 * (both sides' clients) calls zps_malloc_keep_warm() too.
 * Output: a table on stdout and $ZPS_BENCH_DIR/pushpull.json. The raw side lives in
 * bench_pushpull_raw.c.
 */
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "bench/bench.h"
#include "bench/pushpull_int.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/proc.h"
#include "ps/client.h"

static const char *const s_ops[] = {"push", "pull", "pushpull"};

/* ------------------------------------------------------------------ process helpers */

typedef struct proc {
    pid_t pid;
    char uri[256];
} proc;

/* This program's own path (for re-running it as a raw server) or zps-server's. */
static int s_bin_path(char *bin, size_t len, const char *name)
{
    const char *dir = getenv("ZPS_BIN");
    if (name && dir && *dir) {
        snprintf(bin, len, "%s/%s", dir, name);
        return 0;
    }
    ssize_t k = readlink("/proc/self/exe", bin, len - 32);
    if (k <= 0)
        return -1;
    bin[k] = 0;
    char *slash = strrchr(bin, '/');
    if (name && slash)
        snprintf(slash + 1, len - (size_t)(slash + 1 - bin), "%s", name);
    return 0;
}

/* Starts argv[0] and reads the endpoint it announces (after tag, or up to a NUL byte when
 * tag is NULL) into p->uri. */
static int s_spawn(proc *p, const char *const *argv, const char *tag)
{
    int fd;
    if (zps_proc_start(argv, &p->pid, &fd) != ZPS_OK)
        return -1;
    zps_status st = zps_proc_read_line(fd, tag, p->uri, sizeof p->uri, 10);
    close(fd);
    return st == ZPS_OK ? 0 : -1;
}

/* The raw server is a fresh exec of this program (`zps-bench pushpull --raw-server-fd 1`,
 * its stdout), so it runs with glibc's default allocator settings: a fork would inherit the
 * zps_malloc_keep_warm() of this process, which is zps logic. */
static int s_spawn_raw(proc *p, int warm)
{
    char bin[PATH_MAX];
    if (s_bin_path(bin, sizeof bin, NULL))
        return -1;
    const char *argv[] = {bin, "pushpull", "--raw-server-fd", "1", warm ? "--raw-warm" : NULL,
                          NULL};
    return s_spawn(p, argv, NULL);
}

static int s_zps_io_threads = 1;    // --server-io-threads
static int s_zps_apply_threads = 1; // --server-apply-threads

static int s_spawn_zps(proc *p, int n_clients)
{
    char bin[PATH_MAX];
    if (s_bin_path(bin, sizeof bin, "zps-server"))
        return -1;
    char nt[16], io[16], ap[16];
    snprintf(nt, sizeof nt, "%d", n_clients);
    snprintf(io, sizeof io, "%d", s_zps_io_threads);
    snprintf(ap, sizeof ap, "%d", s_zps_apply_threads);
    const char *argv[] = {bin, "--bind", "tcp://127.0.0.1:0", "--mode", "async",
                          "--num-trainers", nt, "--stats-every", "0", "--log-level", "warn",
                          "--max-message-bytes", "1073741824", "--io-threads", io,
                          "--apply-threads", ap, NULL};
    return s_spawn(p, argv, "zps-server listening on ");
}

static void s_reap(proc *p)
{
    if (!p->pid)
        return;
    kill(p->pid, SIGTERM);
    for (int i = 0; i < 500; i++) {
        if (waitpid(p->pid, NULL, WNOHANG) == p->pid) {
            p->pid = 0;
            return;
        }
        zps_sleep_ns(10000000);
    }
    kill(p->pid, SIGKILL);
    waitpid(p->pid, NULL, 0);
    p->pid = 0;
}

/* ------------------------------------------------------------------ clients */

/* User + system CPU seconds of process pid so far (0 when unreadable). */
static double s_proc_cpu(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t k = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[k] = 0;
    const char *p = strrchr(buf, ')'); // the command name may hold spaces
    unsigned long long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return 0;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* CPU seconds of this process (the clients and their ZeroMQ threads) and the servers. */
static double s_cpu_now(const bench_pp_run *r)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double t = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
               ru.ru_stime.tv_usec / 1e6;
    for (int s = 0; s < r->servers; s++)
        t += s_proc_cpu(r->pids[s]);
    return t;
}

void bench_pp_client_buffers(uint64_t n, float **grad, float **val)
{
    *grad = zps_xaligned(64, n * 4 + 64);
    *val = zps_xaligned(64, n * 4 + 64);
    for (uint64_t i = 0; i < n; i++)
        (*grad)[i] = 1e-3f * (float)(i % 97);
    zps_prefault(*val, n * 4);
}

void bench_pp_timed_loop(bench_pp_run *r, int id, bench_pp_request_fn request, void *ctx,
                         int failed)
{
    pthread_barrier_wait(&r->start);
    for (int it = 0; it < r->warmup + r->iters; it++) {
        if (it == r->warmup) {
            pthread_barrier_wait(&r->start);
            if (id == 0)
                r->t0 = zps_now_s(), r->cpu0 = s_cpu_now(r);
        }
        if (failed)
            continue;
        double t0 = zps_now_s();
        failed = request(ctx);
        if (it >= r->warmup)
            r->lat_us[id * r->iters + it - r->warmup] = (zps_now_s() - t0) * 1e6;
    }
    pthread_barrier_wait(&r->start);
    if (id == 0)
        r->t1 = zps_now_s(), r->cpu1 = s_cpu_now(r);
}

typedef struct zps_side {
    const bench_pp_run *r;
    ps_client *c;
    float *grad, *val;
    zps_status st; // the first failure
} zps_side;

static int s_zps_request(void *ctx)
{
    zps_side *z = ctx;
    ps_ticket t;
    if (z->r->op == OP_PUSH)
        z->st = ps_client_push(z->c, 0, 1, z->grad, 0, &t);
    else if (z->r->op == OP_PULL)
        z->st = ps_client_pull(z->c, 0, 1, z->val, 0, &t);
    else
        z->st = ps_client_pushpull(z->c, 0, 1, z->grad, z->val, 0, &t);
    if (z->st == ZPS_OK)
        z->st = ps_client_wait(z->c, t);
    return z->st != ZPS_OK;
}

/* Client id's connection to the zps servers: registered, and (client 0) INIT with lr 0 so
 * that the values stay as they are. */
static zps_status s_zps_connect(const bench_pp_run *r, int id, zps_side *z)
{
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.heartbeat_ms = 0;
    o.msg_bytes = r->msg_bytes;
    o.streams = r->streams;
    o.push_dtype = r->dtype;
    zps_status st = ps_client_new(r->uris, r->servers, (uint32_t)id, &o, &z->c);
    if (st == ZPS_OK)
        st = ps_client_register(z->c, r->plan, NULL, NULL);
    if (st == ZPS_OK && id == 0) {
        ps_optim_config oc;
        ps_optim_default(&oc);
        oc.lr = 0.0;
        st = ps_client_init(z->c, z->grad, &oc, NULL);
    }
    return st;
}

static void *s_zps_client(void *arg)
{
    bench_pp_arg *a = arg;
    bench_pp_run *r = a->r;
    zps_side z = {.r = r};
    bench_pp_client_buffers(r->plan->total, &z.grad, &z.val);
    z.st = s_zps_connect(r, a->id, &z);
    bench_pp_timed_loop(r, a->id, s_zps_request, &z, z.st != ZPS_OK);
    if (z.st != ZPS_OK) {
        r->failed = 1;
        snprintf(r->err, sizeof r->err, "%s: %s", zps_status_name(z.st),
                 z.c ? ps_client_last_error(z.c) : "");
    }
    /* the next repetition's client is a new process-like incarnation of the same trainer
     * id: LEAVE frees the id (docs/ps.md "Trainer identity"), outside the timed loop */
    if (z.c && z.st == ZPS_OK && ps_client_leave(z.c) != ZPS_OK)
        fprintf(stderr, "zps-bench pushpull: LEAVE failed: %s\n", ps_client_last_error(z.c));
    ps_client_destroy(&z.c);
    zps_aligned_free(z.grad);
    zps_aligned_free(z.val);
    return NULL;
}

typedef struct result {
    double gbps, p50, p99;
    double cpu_s_per_gb; // CPU seconds of clients and servers (user + system) per GB moved
    int ok;
} result;

/* One side's repetitions of a cell, gathered as they run (s_rep) and summed up at the end
 * (s_result). The two sides' repetitions alternate, zps then raw, so that a slow spell of
 * this noisy machine falls on both. */
typedef struct acc {
    double gbps[64];
    double *lat; // (reps * clients * iters)
    size_t nlat;
    double cpu, moved;
    int reps, ok;
} acc;

static void s_acc_init(acc *a, const bench_pp_run *r, int reps)
{
    memset(a, 0, sizeof *a);
    a->lat = zps_xmalloc(sizeof(double) * (size_t)(reps * r->clients * r->iters));
    a->ok = 1;
}

static void s_rep(bench_pp_run *r, acc *a)
{
    pthread_t th[MAX_CLIENTS];
    bench_pp_arg ca[MAX_CLIENTS];
    pthread_barrier_init(&r->start, NULL, (unsigned)r->clients);
    r->lat_us = zps_xcalloc((size_t)(r->clients * r->iters), sizeof(double));
    r->failed = 0;
    for (int c = 0; c < r->clients; c++) {
        ca[c] = (bench_pp_arg){r, c};
        pthread_create(&th[c], NULL, r->raw ? bench_pp_raw_client : s_zps_client, &ca[c]);
    }
    for (int c = 0; c < r->clients; c++)
        pthread_join(th[c], NULL);
    pthread_barrier_destroy(&r->start);
    if (r->failed) {
        fprintf(stderr, "zps-bench pushpull: zps run failed: %s\n", r->err);
        a->ok = 0;
    }
    double bytes = (double)r->bytes * (r->op == OP_PUSHPULL ? 2 : 1) * r->clients * r->iters;
    a->gbps[a->reps++] = bytes / (r->t1 - r->t0) / 1e9;
    a->moved += bytes;
    a->cpu += r->cpu1 - r->cpu0;
    memcpy(a->lat + a->nlat, r->lat_us, sizeof(double) * (size_t)(r->clients * r->iters));
    a->nlat += (size_t)(r->clients * r->iters);
    free(r->lat_us);
}

static result s_result(acc *a)
{
    result res = {0, 0, 0, 0, a->ok};
    if (a->reps) {
        double g[64];
        memcpy(g, a->gbps, sizeof(double) * (size_t)a->reps); // bench_median sorts
        res.cpu_s_per_gb = a->cpu / (a->moved / 1e9);
        res.gbps = bench_median(g, (size_t)a->reps);
        res.p50 = bench_percentile(a->lat, a->nlat, 50);
        res.p99 = bench_percentile(a->lat, a->nlat, 99);
    }
    free(a->lat);
    return res;
}

static void s_more_help(FILE *f)
{
    fprintf(f, "Each cell runs three sides, their repetitions alternating: zps; raw ZeroMQ with\n"
               "glibc's allocator defaults (the issue's limit: 'ratio'); raw ZeroMQ whose server\n"
               "keeps freed memory warm as zps-server does (the stricter 'ratio_warm').\n");
}

/* The command line: which cells run, and how. */
typedef struct cfg {
    int quick, reps, op_mask, shape_mask;
    int sides;             // bits: zps, raw, raw-warm
    size_t max_bytes;      // largest payload
    size_t only_bytes;     // 0: every size
    uint64_t msg_bytes;    // ps_client_opts.msg_bytes
    int streams;           // ps_client_opts.streams
    ps_dtype dtype;        // --push-dtype
    int io_threads;        // zps-server --io-threads
    int apply_threads;     // zps-server --apply-threads
    int raw_warm, raw_fd;  // internal: run as a raw server writing its endpoint to raw_fd
} cfg;

static void s_defaults(void *p)
{
    *(cfg *)p = (cfg){.reps = 3, .op_mask = 7, .shape_mask = 3, .sides = 7,
                      .max_bytes = 64u << 20, .msg_bytes = 1u << 20, .streams = 1,
                      .dtype = PS_DTYPE_F32, .io_threads = 1, .apply_threads = 1,
                      .raw_fd = -1};
}

#define F(f) ZPS_OPT_FIELD(cfg, f)
static const zps_opt_name s_op_names[] = {{"push", 1}, {"pull", 2}, {"pushpull", 4}, {NULL, 0}};
static const zps_opt_name s_shape_names[] = {{"1x1", 1}, {"2x2", 2}, {NULL, 0}};
static const zps_opt_name s_side_names[] = {{"zps", 1}, {"raw", 2}, {"raw-warm", 4}, {NULL, 0}};
static const zps_opt_name s_dtype_names[] = {
    {"f32", PS_DTYPE_F32}, {"bf16", PS_DTYPE_BF16}, {NULL, 0}};

static const zps_opt s_opt[] = {
    {"quick", ZPS_OPT_SET, F(quick), .help = "4 KiB, 1 MiB and 16 MiB only, fewer iterations"},
    {"reps", ZPS_OPT_INT, F(reps), 1, 64, .meta = "N",
     .help = "repetitions per cell, zps and raw alternating (1..64)"},
    {"max-bytes", ZPS_OPT_UINT, F(max_bytes), 0, 1e12, .meta = "B", .help = "largest payload"},
    {"bytes", ZPS_OPT_UINT, F(only_bytes), 0, 1e12, .meta = "B", .dflt = "",
     .help = "only this payload size"},
    {"op", ZPS_OPT_ENUM, F(op_mask), .names = s_op_names, .dflt = "all",
     .help = "only this op"},
    {"shape", ZPS_OPT_ENUM, F(shape_mask), .names = s_shape_names, .dflt = "both",
     .help = "only this shape"},
    {"msg-bytes", ZPS_OPT_UINT, F(msg_bytes), 1, 1e12, .meta = "B",
     .help = "client message size (ps_client_opts.msg_bytes)"},
    {"only", ZPS_OPT_ENUM, F(sides), .names = s_side_names, .dflt = "all three",
     .help = "run one side only (for profiling; ratios printed as 0)"},
    {"streams", ZPS_OPT_INT, F(streams), 1, 8, .meta = "N",
     .help = "zps: TCP connections per server (ps_client_opts.streams)"},
    {"push-dtype", ZPS_OPT_ENUM, F(dtype), .names = s_dtype_names,
     .help = "gradients on the wire; with bf16 both sides push half\n"
             "the bytes, and GB/s still counts 4 bytes per value"},
    {"server-io-threads", ZPS_OPT_INT, F(io_threads), 1, 16, .meta = "N",
     .help = "zps-server --io-threads"},
    {"server-apply-threads", ZPS_OPT_INT, F(apply_threads), 1, 64, .meta = "N",
     .help = "zps-server --apply-threads"},
    {"raw-warm", ZPS_OPT_SET, F(raw_warm), .help = "internal: the raw server keeps memory warm"},
    {"raw-server-fd", ZPS_OPT_INT, F(raw_fd), 0, 1 << 20, .meta = "FD", .dflt = "",
     .help = "internal: run as a raw server writing its endpoint to FD"},
    {.type = ZPS_OPT_END},
};
#undef F

static const zps_opts s_spec = BENCH_OPTS("pushpull", cfg, s_opt, s_defaults, s_more_help);

/* Fills c from the command line; -1 to go on, else the exit code (usage shown). */
static int s_parse(int argc, char **argv, cfg *c)
{
    int rc = bench_opts_parse(&s_spec, c, argc, argv);
    s_zps_io_threads = c->io_threads;
    s_zps_apply_threads = c->apply_threads;
    return rc;
}

/* One row of the table: a shape, a payload size and an op. */
typedef struct cell {
    int ns, nc;          // servers, clients
    size_t bytes;        // payload per request
    int op;              // OP_*
    int iters;           // measured requests per client and repetition
    const ps_plan *plan; // one variable of bytes / 4 floats over ns servers
} cell;

/* The cell's three sides, their repetitions alternating (zps, raw, raw-warm, zps, ...):
 * res per side and the medians of the paired repetitions' ratios zps / raw (ratio[0]) and
 * zps / raw-warm (ratio[1]), 0 where a side did not run. srv: each side's servers. */
static void s_run_cell(const cfg *c, const cell *cl, const proc *const srv[3], result res[3],
                       double ratio[2])
{
    bench_pp_run rs[3];
    acc ac[3];
    double pair[2][64];
    for (int k = 0; k < 3; k++) {
        rs[k] = (bench_pp_run){.servers = cl->ns, .clients = cl->nc, .op = cl->op, .iters = cl->iters,
                      .warmup = cl->iters / 8 + 2, .bytes = cl->bytes, .plan = cl->plan,
                      .msg_bytes = c->msg_bytes, .streams = c->streams, .raw = k > 0,
                      .dtype = c->dtype};
        for (int s = 0; s < cl->ns; s++)
            rs[k].uris[s] = srv[k][s].uri, rs[k].pids[s] = srv[k][s].pid;
        s_acc_init(&ac[k], &rs[k], c->reps);
    }
    for (int rep = 0; rep < c->reps; rep++) {
        for (int k = 0; k < 3; k++)
            if (c->sides & (1 << k))
                s_rep(&rs[k], &ac[k]);
        for (int k = 1; k < 3; k++)
            if ((c->sides & 1) && (c->sides & (1 << k)))
                pair[k - 1][rep] = ac[0].gbps[rep] / ac[k].gbps[rep];
    }
    for (int k = 0; k < 3; k++)
        res[k] = s_result(&ac[k]);
    /* the median of the paired repetitions' ratios: a slow spell moves both halves of a
     * pair, not the ratio */
    ratio[0] = (c->sides & 3) == 3 ? bench_median(pair[0], (size_t)c->reps) : 0;
    ratio[1] = (c->sides & 5) == 5 ? bench_median(pair[1], (size_t)c->reps) : 0;
}

/* The cell's table row on stdout and its object in the JSON list js. */
static void s_report_cell(FILE *js, int first, const cfg *c, const cell *cl, const result res[3],
                          const double ratio[2])
{
    const result *z = &res[0], *w = &res[1], *m = &res[2];
    printf("%dx%-3d %-9zu %-9s %9.3f %9.3f %6.2f %9.3f %6.2f %9.1f %9.1f %9.1f %9.1f %8.3f %8.3f\n",
           cl->ns, cl->nc, cl->bytes, s_ops[cl->op], z->gbps, w->gbps, ratio[0], m->gbps, ratio[1],
           z->p50, w->p50, z->p99, w->p99, z->cpu_s_per_gb, w->cpu_s_per_gb);
    fflush(stdout);
    fprintf(js,
            "%s  {\"servers\": %d, \"clients\": %d, \"bytes\": %zu, \"op\": \"%s\", "
            "\"push_dtype\": \"%s\", \"server_apply_threads\": %d, "
            "\"zps_gbps\": %.4f, \"raw_gbps\": %.4f, \"ratio\": %.4f, "
            "\"raw_warm_gbps\": %.4f, \"ratio_warm\": %.4f, \"zps_p50_us\": %.1f, "
            "\"raw_p50_us\": %.1f, \"raw_warm_p50_us\": %.1f, \"zps_p99_us\": %.1f, "
            "\"raw_p99_us\": %.1f, \"zps_cpu_s_per_gb\": %.4f, \"raw_cpu_s_per_gb\": %.4f, "
            "\"raw_warm_cpu_s_per_gb\": %.4f}",
            first ? "" : ",\n", cl->ns, cl->nc, cl->bytes, s_ops[cl->op], ps_dtype_name(c->dtype),
            c->apply_threads, z->gbps, w->gbps, ratio[0], m->gbps, ratio[1], z->p50, w->p50, m->p50, z->p99, w->p99,
            z->cpu_s_per_gb, w->cpu_s_per_gb, m->cpu_s_per_gb);
}

/* Measured requests per client and repetition: about 256 MiB (64 MiB quick) of payload,
 * 8 at least. */
static int s_iters(const cfg *c, size_t bytes)
{
    int iters = (int)((c->quick ? 64u << 20 : 256u << 20) / bytes);
    if (iters > (c->quick ? 300 : 2000))
        iters = c->quick ? 300 : 2000;
    return iters < 8 ? 8 : iters;
}

/* Every cell of shape ns x nc, each side on its own fresh servers. 1 when servers could not
 * start; *failed is set when a zps run failed. */
static int s_run_shape(const cfg *c, int ns, int nc, FILE *js, int *first, int *failed)
{
    const size_t all_sizes[] = {4u << 10, 64u << 10, 1u << 20, 16u << 20, 64u << 20};
    const size_t quick_sizes[] = {4u << 10, 1u << 20, 16u << 20};
    const size_t *sizes = c->quick ? quick_sizes : all_sizes;
    int n_sizes = c->quick ? 3 : 5;
    /* the raw servers are forked before any ZeroMQ context exists in this thread's
     * clients; each shape gets fresh servers */
    proc raw[MAX_SERVERS] = {{0}}, warm[MAX_SERVERS] = {{0}}, zs[MAX_SERVERS] = {{0}};
    for (int s = 0; s < ns; s++)
        if (s_spawn_raw(&raw[s], 0) || s_spawn_raw(&warm[s], 1) || s_spawn_zps(&zs[s], nc)) {
            fprintf(stderr, "zps-bench pushpull: cannot start servers\n");
            return 1;
        }
    const proc *const srv[3] = {zs, raw, warm};
    for (int si = 0; si < n_sizes; si++) {
        size_t bytes = c->only_bytes ? c->only_bytes : sizes[si];
        if (bytes > c->max_bytes || (c->only_bytes && si > 0))
            continue;
        ps_var var = {"payload", bytes / 4};
        ps_plan *plan;
        ps_plan_new(&var, 1, ns, 0, &plan);
        cell cl = {.ns = ns, .nc = nc, .bytes = bytes, .iters = s_iters(c, bytes), .plan = plan};
        for (cl.op = 0; cl.op < 3; cl.op++) {
            if (!(c->op_mask & (1 << cl.op)))
                continue;
            /* restart zps servers per size: a new plan needs a new INIT */
            for (int s = 0; s < ns; s++) {
                s_reap(&zs[s]);
                if (s_spawn_zps(&zs[s], nc)) {
                    fprintf(stderr, "zps-bench pushpull: cannot restart zps-server\n");
                    return 1;
                }
            }
            result res[3];
            double ratio[2];
            s_run_cell(c, &cl, srv, res, ratio);
            *failed |= !res[0].ok;
            s_report_cell(js, *first, c, &cl, res, ratio);
            *first = 0;
        }
        ps_plan_destroy(&plan);
    }
    for (int s = 0; s < ns; s++) {
        s_reap(&raw[s]);
        s_reap(&warm[s]);
        s_reap(&zs[s]);
    }
    return 0;
}

ZPS_BENCH(pushpull, "zps push/pull/pushpull vs raw ZeroMQ DEALER/ROUTER, 1x1 and 2x2")
{
    cfg c;
    int rc = s_parse(argc, argv, &c);
    if (rc >= 0)
        return rc;
    if (c.raw_fd >= 0) { // internal: this process is a raw server (s_spawn_raw)
        if (c.raw_warm)
            zps_malloc_keep_warm();
        bench_pp_raw_server(c.raw_fd);
    }
    zps_malloc_keep_warm();
    signal(SIGPIPE, SIG_IGN);
    const int shapes[2][2] = {{1, 1}, {2, 2}};
    char path[1024];
    FILE *js = bench_json_open("pushpull", "pushpull.json", path, sizeof path);
    if (!js)
        return 1;
    fprintf(js, "[\n");
    int first = 1, failed = 0;
    printf("%-5s %-9s %-9s %9s %9s %6s %9s %6s %9s %9s %9s %9s %8s %8s\n", "shape", "bytes", "op",
           "zps GB/s", "raw GB/s", "ratio", "warm GB/s", "ratio", "zps p50us", "raw p50us",
           "zps p99us", "raw p99us", "zps cpu", "raw cpu");
    for (int sh = 0; sh < 2; sh++)
        if ((c.shape_mask & (1 << sh)) &&
            s_run_shape(&c, shapes[sh][0], shapes[sh][1], js, &first, &failed)) {
            fclose(js);
            return 1;
        }
    fprintf(js, "\n]\n");
    fclose(js);
    printf("ps-lite on this machine (issue 3), 1x1 push 2.26 / 2.37 / 1.37 GB/s and pull 1.86 / 2.10 / "
           "1.23 GB/s at 1 / 16 / 100 MiB; 2x2 push 2.82 / 2.88 / 1.85 GB/s\n");
    printf("wrote %s\n", path);
    return failed;
}
