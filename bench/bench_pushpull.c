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
 * Output: a table on stdout and $ZPS_BENCH_DIR/pushpull.json.
 */
#include <getopt.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "bench/bench.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "ps/client.h"
#include "ps/dtype.h"
#include "ps/plan.h"
#include "ps/server.h"

enum { OP_PUSH = 0, OP_PULL = 1, OP_PUSHPULL = 2 };
static const char *const s_ops[] = {"push", "pull", "pushpull"};

#define MAX_SERVERS 2
#define MAX_CLIENTS 2
#define RAW_MAX_FRAMES 4096

/* ------------------------------------------------------------------ raw server */

typedef struct raw_hdr {
    int op;        // OP_*, or -1: exit
    int nframes;   // payload frames wanted in the reply (pull, pushpull)
    size_t sizes[]; // (nframes) byte sizes of the reply frames
} raw_hdr;

static void s_noop_free(void *d, void *h)
{
    (void)d;
    (void)h;
}

/* Child process: one ROUTER, replies as described at the top. Writes its endpoint to fd. */
static void s_raw_server(int fd)
{
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(sock, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(sock, ZMQ_RCVHWM, &zero, sizeof zero);
    if (zmq_bind(sock, "tcp://127.0.0.1:*") == -1)
        _exit(3);
    char ep[256];
    size_t el = sizeof ep;
    zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, ep, &el);
    if (write(fd, ep, strlen(ep) + 1) < 0)
        _exit(4);
    close(fd);
    size_t cap = 128u << 20;
    char *data = zps_xmalloc(cap);
    memset(data, 1, cap);
    zmq_msg_t f[2];
    for (;;) {
        zmq_msg_init(&f[0]);
        zmq_msg_init(&f[1]);
        if (zmq_msg_recv(&f[0], sock, 0) == -1 || zmq_msg_recv(&f[1], sock, 0) == -1)
            break;
        raw_hdr h0;
        memcpy(&h0, zmq_msg_data(&f[1]), sizeof h0);
        size_t *sizes = zps_xmalloc(sizeof(size_t) * (size_t)(h0.nframes + 1));
        memcpy(sizes, (char *)zmq_msg_data(&f[1]) + sizeof h0, sizeof(size_t) * (size_t)h0.nframes);
        int more = zmq_msg_more(&f[1]);
        while (more) { // push payload: receive and drop
            zmq_msg_t m;
            zmq_msg_init(&m);
            zmq_msg_recv(&m, sock, 0);
            more = zmq_msg_more(&m);
            zmq_msg_close(&m);
        }
        if (h0.op < 0) {
            free(sizes);
            break;
        }
        int reply_frames = h0.op == OP_PUSH ? 0 : h0.nframes;
        zmq_msg_send(&f[0], sock, ZMQ_SNDMORE);
        zmq_send(sock, "ok", 2, reply_frames ? ZMQ_SNDMORE : 0);
        size_t off = 0;
        for (int i = 0; i < reply_frames; i++) {
            zmq_msg_t m;
            if (off + sizes[i] > cap)
                off = 0;
            zmq_msg_init_data(&m, data + off, sizes[i], s_noop_free, NULL);
            off += sizes[i];
            zmq_msg_send(&m, sock, i + 1 < reply_frames ? ZMQ_SNDMORE : 0);
        }
        zmq_msg_close(&f[1]);
        free(sizes);
    }
    zmq_close(sock);
    zmq_ctx_term(ctx);
    _exit(0);
}

/* ------------------------------------------------------------------ process helpers */

typedef struct proc {
    pid_t pid;
    char uri[256];
} proc;

static int s_read_line(int fd, char *buf, size_t len, const char *tag, double timeout_s)
{
    size_t got = 0;
    double end = zps_now_s() + timeout_s;
    while (zps_now_s() < end && got < len - 1) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 100) <= 0)
            continue;
        ssize_t k = read(fd, buf + got, len - 1 - got);
        if (k <= 0)
            return -1;
        got += (size_t)k;
        buf[got] = 0;
        if (!tag && memchr(buf, 0, got))
            return 0;
        char *at = tag ? strstr(buf, tag) : NULL;
        char *nl = at ? strchr(at, '\n') : NULL;
        if (at && nl) {
            *nl = 0;
            memmove(buf, at + strlen(tag), strlen(at + strlen(tag)) + 1);
            return 0;
        }
    }
    return -1;
}

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

/* The raw server is a fresh exec of this program (`zps-bench pushpull --raw-server-fd N`),
 * so it runs with glibc's default allocator settings: a fork would inherit the
 * zps_malloc_keep_warm() of this process, which is zps logic. */
static int s_spawn_raw(proc *p, int warm)
{
    char bin[PATH_MAX];
    if (s_bin_path(bin, sizeof bin, NULL))
        return -1;
    int fds[2];
    if (pipe(fds) == -1)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        close(fds[0]);
        char fd[16];
        snprintf(fd, sizeof fd, "%d", fds[1]);
        execl(bin, bin, "pushpull", "--raw-server-fd", fd, warm ? "--raw-warm" : NULL,
              (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    p->pid = pid;
    int rc = s_read_line(fds[0], p->uri, sizeof p->uri, NULL, 10);
    close(fds[0]);
    return rc;
}

static int s_zps_io_threads = 1; // --server-io-threads

static int s_spawn_zps(proc *p, int n_clients)
{
    char bin[PATH_MAX];
    if (s_bin_path(bin, sizeof bin, "zps-server"))
        return -1;
    char nt[16], io[16];
    snprintf(nt, sizeof nt, "%d", n_clients);
    snprintf(io, sizeof io, "%d", s_zps_io_threads);
    int fds[2];
    if (pipe(fds) == -1)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        execl(bin, bin, "--bind", "tcp://127.0.0.1:0", "--mode", "async", "--num-trainers", nt,
              "--stats-every", "0", "--log-level", "warn", "--max-message-bytes", "1073741824",
              "--io-threads", io, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    p->pid = pid;
    int rc = s_read_line(fds[0], p->uri, sizeof p->uri, "zps-server listening on ", 10);
    close(fds[0]);
    return rc;
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

typedef struct run {
    int servers, clients, op, iters, warmup;
    size_t bytes;
    uint64_t msg_bytes;
    ps_dtype dtype; // push direction on the wire (--push-dtype)
    int streams;
    const ps_plan *plan;
    const char *uris[MAX_SERVERS];
    pid_t pids[MAX_SERVERS]; // the servers' processes, for their CPU time
    int raw;
    pthread_barrier_t start;
    double *lat_us;       // (clients * iters)
    double t0, t1;        // wall time of the measured part (client 0)
    double cpu0, cpu1;    // CPU time of clients and servers at t0 and t1 (s_cpu_now)
    int failed;
    char err[256];
} run;

typedef struct carg {
    run *r;
    int id;
} carg;

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
static double s_cpu_now(const run *r)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double t = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec / 1e6 + (double)ru.ru_stime.tv_sec +
               ru.ru_stime.tv_usec / 1e6;
    for (int s = 0; s < r->servers; s++)
        t += s_proc_cpu(r->pids[s]);
    return t;
}

/* A client's gradient (finite, non-zero) and value buffers of n floats, resident. */
static void s_client_buffers(uint64_t n, float **grad, float **val)
{
    *grad = zps_xaligned(64, n * 4 + 64);
    *val = zps_xaligned(64, n * 4 + 64);
    for (uint64_t i = 0; i < n; i++)
        (*grad)[i] = 1e-3f * (float)(i % 97);
    zps_prefault(*val, n * 4);
}

static void *s_zps_client(void *arg)
{
    carg *a = arg;
    run *r = a->r;
    uint64_t n = r->plan->total;
    float *grad, *val;
    s_client_buffers(n, &grad, &val);
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.heartbeat_ms = 0;
    o.msg_bytes = r->msg_bytes;
    o.streams = r->streams;
    o.push_dtype = r->dtype;
    ps_client *c = NULL;
    zps_status st = ps_client_new(r->uris, r->servers, (uint32_t)a->id, &o, &c);
    if (st == ZPS_OK)
        st = ps_client_register(c, r->plan, NULL, NULL);
    if (st == ZPS_OK && a->id == 0) {
        ps_optim_config oc;
        ps_optim_default(&oc);
        oc.lr = 0.0;
        st = ps_client_init(c, grad, &oc, NULL);
    }
    pthread_barrier_wait(&r->start);
    for (int it = 0; it < r->warmup + r->iters; it++) {
        if (it == r->warmup) {
            pthread_barrier_wait(&r->start);
            if (a->id == 0)
                r->t0 = zps_now_s(), r->cpu0 = s_cpu_now(r);
        }
        if (st != ZPS_OK)
            continue; // keep meeting the barriers so the other clients finish
        ps_ticket t;
        double t0 = zps_now_s();
        if (r->op == OP_PUSH)
            st = ps_client_push(c, 0, 1, grad, 0, &t);
        else if (r->op == OP_PULL)
            st = ps_client_pull(c, 0, 1, val, 0, &t);
        else
            st = ps_client_pushpull(c, 0, 1, grad, val, 0, &t);
        if (st == ZPS_OK)
            st = ps_client_wait(c, t);
        if (it >= r->warmup)
            r->lat_us[a->id * r->iters + it - r->warmup] = (zps_now_s() - t0) * 1e6;
    }
    if (st != ZPS_OK) {
        r->failed = 1;
        snprintf(r->err, sizeof r->err, "%s: %s", zps_status_name(st), c ? ps_client_last_error(c) : "");
    }
    pthread_barrier_wait(&r->start);
    if (a->id == 0)
        r->t1 = zps_now_s(), r->cpu1 = s_cpu_now(r);
    ps_client_destroy(&c);
    zps_aligned_free(grad);
    zps_aligned_free(val);
    return NULL;
}

/* Raw: the same frames (sizes per server from the plan) over DEALER sockets. */
static void *s_raw_client(void *arg)
{
    carg *a = arg;
    run *r = a->r;
    uint64_t n = r->plan->total;
    float *grad, *val;
    s_client_buffers(n, &grad, &val);
    size_t np = ps_plan_pieces(r->plan, 0, 1, NULL, 0);
    ps_piece *pc = zps_xmalloc(np * sizeof *pc);
    ps_plan_pieces(r->plan, 0, 1, pc, np);
    void *ctx = zmq_ctx_new();
    void *socks[MAX_SERVERS];
    int zero = 0;
    size_t *hdrbuf[MAX_SERVERS];
    size_t hdrlen[MAX_SERVERS];
    for (int s = 0; s < r->servers; s++) {
        socks[s] = zmq_socket(ctx, ZMQ_DEALER);
        zmq_setsockopt(socks[s], ZMQ_SNDHWM, &zero, sizeof zero);
        zmq_setsockopt(socks[s], ZMQ_RCVHWM, &zero, sizeof zero);
        zmq_connect(socks[s], r->uris[s]);
        int cnt = 0;
        for (size_t i = 0; i < np; i++)
            cnt += pc[i].server == (uint32_t)s;
        hdrlen[s] = sizeof(raw_hdr) + sizeof(size_t) * (size_t)cnt;
        raw_hdr *h = zps_xmalloc(hdrlen[s]);
        h->op = r->op;
        h->nframes = cnt;
        int k = 0;
        for (size_t i = 0; i < np; i++)
            if (pc[i].server == (uint32_t)s)
                h->sizes[k++] = pc[i].count * 4;
        hdrbuf[s] = (size_t *)h;
    }
    zmq_msg_t m;
    pthread_barrier_wait(&r->start);
    for (int it = 0; it < r->warmup + r->iters; it++) {
        if (it == r->warmup) {
            pthread_barrier_wait(&r->start);
            if (a->id == 0)
                r->t0 = zps_now_s(), r->cpu0 = s_cpu_now(r);
        }
        double t0 = zps_now_s();
        for (int s = 0; s < r->servers; s++) {
            raw_hdr *h = (raw_hdr *)hdrbuf[s];
            int push = r->op != OP_PULL;
            zmq_send(socks[s], h, hdrlen[s], push && h->nframes ? ZMQ_SNDMORE : 0);
            if (!push)
                continue;
            int k = 0;
            for (size_t i = 0; i < np; i++) {
                if (pc[i].server != (uint32_t)s)
                    continue;
                zmq_msg_init_data(&m, grad + pc[i].flat_offset, pc[i].count * ps_dtype_size(r->dtype),
                                  s_noop_free, NULL);
                zmq_msg_send(&m, socks[s], ++k < h->nframes ? ZMQ_SNDMORE : 0);
            }
        }
        for (int s = 0; s < r->servers; s++) {
            zmq_msg_init(&m);
            zmq_msg_recv(&m, socks[s], 0); // ack
            int more = zmq_msg_more(&m);
            zmq_msg_close(&m);
            size_t i = 0;
            while (more) {
                while (i < np && pc[i].server != (uint32_t)s)
                    i++;
                zmq_msg_init(&m);
                zmq_msg_recv(&m, socks[s], 0);
                more = zmq_msg_more(&m);
                if (i < np && zmq_msg_size(&m) == pc[i].count * 4)
                    memcpy(val + pc[i].flat_offset, zmq_msg_data(&m), pc[i].count * 4);
                i++;
                zmq_msg_close(&m);
            }
        }
        if (it >= r->warmup)
            r->lat_us[a->id * r->iters + it - r->warmup] = (zps_now_s() - t0) * 1e6;
    }
    pthread_barrier_wait(&r->start);
    if (a->id == 0)
        r->t1 = zps_now_s(), r->cpu1 = s_cpu_now(r);
    for (int s = 0; s < r->servers; s++) {
        int l = 0;
        zmq_setsockopt(socks[s], ZMQ_LINGER, &l, sizeof l);
        zmq_close(socks[s]);
        free(hdrbuf[s]);
    }
    zmq_ctx_term(ctx);
    free(pc);
    zps_aligned_free(grad);
    zps_aligned_free(val);
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

static void s_acc_init(acc *a, const run *r, int reps)
{
    memset(a, 0, sizeof *a);
    a->lat = zps_xmalloc(sizeof(double) * (size_t)(reps * r->clients * r->iters));
    a->ok = 1;
}

static void s_rep(run *r, acc *a)
{
    pthread_t th[MAX_CLIENTS];
    carg ca[MAX_CLIENTS];
    pthread_barrier_init(&r->start, NULL, (unsigned)r->clients);
    r->lat_us = zps_xcalloc((size_t)(r->clients * r->iters), sizeof(double));
    r->failed = 0;
    for (int c = 0; c < r->clients; c++) {
        ca[c] = (carg){r, c};
        pthread_create(&th[c], NULL, r->raw ? s_raw_client : s_zps_client, &ca[c]);
    }
    for (int c = 0; c < r->clients; c++)
        pthread_join(th[c], NULL);
    pthread_barrier_destroy(&r->start);
    if (r->failed) {
        fprintf(stderr, "pushpull: zps run failed: %s\n", r->err);
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

static void s_usage(FILE *f)
{
    fprintf(f, "usage: zps-bench pushpull [--quick] [--reps N] [--max-bytes B] [--bytes B]\n"
               "                          [--op push|pull|pushpull] [--shape 1x1|2x2] [--msg-bytes B]\n"
               "  --quick        4 KiB, 1 MiB and 16 MiB only, fewer iterations\n"
               "  --reps N       repetitions per cell, zps and raw alternating (1..64, default 3)\n"
               "  --max-bytes B  largest payload (default 64 MiB)\n"
               "  --bytes B      only this payload size\n"
               "  --op, --shape  only this op / shape\n"
               "  --msg-bytes B  client message size (ps_client_opts.msg_bytes, default 1 MiB)\n"
               "  --only zps|raw|raw-warm  run one side only (for profiling; ratios printed as 0)\n"
               "  --streams N    zps: TCP connections per server (ps_client_opts.streams, default 1)\n"
               "  --push-dtype f32|bf16  gradients on the wire (default f32); with bf16 both sides\n"
               "                 push half the bytes, and GB/s still counts 4 bytes per value\n"
               "  --server-io-threads N  zps-server --io-threads (default 1)\n"
               "Each cell runs three sides, their repetitions alternating: zps; raw ZeroMQ with\n"
               "glibc's allocator defaults (the issue's limit: 'ratio'); raw ZeroMQ whose server\n"
               "keeps freed memory warm as zps-server does (the stricter 'ratio_warm').\n");
}

ZPS_BENCH(pushpull, "zps push/pull/pushpull vs raw ZeroMQ DEALER/ROUTER, 1x1 and 2x2")
{
    int quick = 0, reps = 3, op_mask = 7, shape_mask = 3, sides = 7; // bits: zps, raw, raw-warm
    int raw_warm = 0;
    size_t max_bytes = 64u << 20, only_bytes = 0;
    uint64_t msg_bytes = 1u << 20;
    int streams = 1, raw_fd = -1;
    ps_dtype dtype = PS_DTYPE_F32;
    static const struct option opts[] = {{"quick", no_argument, 0, 'q'},
                                         {"reps", required_argument, 0, 'r'},
                                         {"max-bytes", required_argument, 0, 'm'},
                                         {"bytes", required_argument, 0, 'b'},
                                         {"op", required_argument, 0, 'o'},
                                         {"shape", required_argument, 0, 's'},
                                         {"msg-bytes", required_argument, 0, 'M'},
                                         {"only", required_argument, 0, 'O'},
                                         {"streams", required_argument, 0, 'S'},
                                         {"push-dtype", required_argument, 0, 'D'},
                                         {"server-io-threads", required_argument, 0, 'I'},
                                         {"raw-warm", no_argument, 0, 'W'},
                                         {"raw-server-fd", required_argument, 0, 'F'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (ch == 'q')
            quick = 1;
        else if (ch == 'r')
            reps = atoi(optarg) > 0 ? (atoi(optarg) < 64 ? atoi(optarg) : 64) : 1;
        else if (ch == 'm')
            max_bytes = (size_t)strtoull(optarg, NULL, 10);
        else if (ch == 'b')
            only_bytes = (size_t)strtoull(optarg, NULL, 10);
        else if (ch == 'o')
            op_mask = !strcmp(optarg, "push") ? 1 : !strcmp(optarg, "pull") ? 2 : 4;
        else if (ch == 's')
            shape_mask = !strcmp(optarg, "1x1") ? 1 : 2;
        else if (ch == 'M')
            msg_bytes = strtoull(optarg, NULL, 10);
        else if (ch == 'D' && ps_dtype_parse(optarg, &dtype) == 0)
            ;
        else if (ch == 'S' && atoi(optarg) >= 1 && atoi(optarg) <= 8)
            streams = atoi(optarg);
        else if (ch == 'I')
            s_zps_io_threads = atoi(optarg) > 0 ? atoi(optarg) : 1;
        else if (ch == 'W')
            raw_warm = 1;
        else if (ch == 'F')
            raw_fd = atoi(optarg);
        else if (ch == 'O' && (!strcmp(optarg, "zps") || !strcmp(optarg, "raw") ||
                               !strcmp(optarg, "raw-warm")))
            sides = !strcmp(optarg, "zps") ? 1 : !strcmp(optarg, "raw") ? 2 : 4;
        else {
            s_usage(ch == 'h' ? stdout : stderr);
            return ch == 'h' ? 0 : 2;
        }
    }
    if (raw_fd >= 0) { // internal: this process is a raw server (s_spawn_raw)
        if (raw_warm)
            zps_malloc_keep_warm();
        s_raw_server(raw_fd);
    }
    zps_malloc_keep_warm();
    signal(SIGPIPE, SIG_IGN);
    const size_t all_sizes[] = {4u << 10, 64u << 10, 1u << 20, 16u << 20, 64u << 20};
    const size_t quick_sizes[] = {4u << 10, 1u << 20, 16u << 20};
    const size_t *sizes = quick ? quick_sizes : all_sizes;
    int n_sizes = quick ? 3 : 5;
    const int shapes[2][2] = {{1, 1}, {2, 2}};

    char path[1024];
    snprintf(path, sizeof path, "%s/pushpull.json", bench_out_dir());
    FILE *js = fopen(path, "w");
    if (!js) {
        fprintf(stderr, "pushpull: cannot write %s\n", path);
        return 1;
    }
    fprintf(js, "[\n");
    int first = 1, failed = 0;
    printf("%-5s %-9s %-9s %9s %9s %6s %9s %6s %9s %9s %9s %9s %8s %8s\n", "shape", "bytes", "op",
           "zps GB/s", "raw GB/s", "ratio", "warm GB/s", "ratio", "zps p50us", "raw p50us",
           "zps p99us", "raw p99us", "zps cpu", "raw cpu");
    for (int sh = 0; sh < 2; sh++) {
        if (!(shape_mask & (1 << sh)))
            continue;
        int ns = shapes[sh][0], nc = shapes[sh][1];
        /* the raw servers are forked before any ZeroMQ context exists in this thread's
         * clients; each shape gets fresh servers */
        proc raw[MAX_SERVERS] = {{0}}, warm[MAX_SERVERS] = {{0}}, zs[MAX_SERVERS] = {{0}};
        for (int s = 0; s < ns; s++)
            if (s_spawn_raw(&raw[s], 0) || s_spawn_raw(&warm[s], 1) || s_spawn_zps(&zs[s], nc)) {
                fprintf(stderr, "pushpull: cannot start servers\n");
                return 1;
            }
        for (int si = 0; si < n_sizes; si++) {
            size_t bytes = only_bytes ? only_bytes : sizes[si];
            if (bytes > max_bytes || (only_bytes && si > 0))
                continue;
            ps_var var = {"payload", bytes / 4};
            ps_plan *plan;
            ps_plan_new(&var, 1, ns, 0, &plan);
            int iters = (int)((quick ? 64u << 20 : 256u << 20) / bytes);
            if (iters > (quick ? 300 : 2000))
                iters = quick ? 300 : 2000;
            if (iters < 8)
                iters = 8;
            for (int op = 0; op < 3; op++) {
                if (!(op_mask & (1 << op)))
                    continue;
                /* restart zps servers per size: a new plan needs a new INIT */
                for (int s = 0; s < ns; s++) {
                    s_reap(&zs[s]);
                    if (s_spawn_zps(&zs[s], nc)) {
                        fprintf(stderr, "pushpull: cannot restart zps-server\n");
                        return 1;
                    }
                }
                /* sides: 0 zps, 1 raw, 2 raw with warm memory; their repetitions alternate */
                run rs[3];
                const proc *srv[3] = {zs, raw, warm};
                acc ac[3];
                double pair[2][64];
                for (int k = 0; k < 3; k++) {
                    rs[k] = (run){.servers = ns, .clients = nc, .op = op, .iters = iters,
                                  .warmup = iters / 8 + 2, .bytes = bytes, .plan = plan,
                                  .msg_bytes = msg_bytes, .streams = streams, .raw = k > 0,
                                  .dtype = dtype};
                    for (int s = 0; s < ns; s++)
                        rs[k].uris[s] = srv[k][s].uri, rs[k].pids[s] = srv[k][s].pid;
                    s_acc_init(&ac[k], &rs[k], reps);
                }
                for (int rep = 0; rep < reps; rep++) {
                    for (int k = 0; k < 3; k++)
                        if (sides & (1 << k))
                            s_rep(&rs[k], &ac[k]);
                    for (int k = 1; k < 3; k++)
                        if ((sides & 1) && (sides & (1 << k)))
                            pair[k - 1][rep] = ac[0].gbps[rep] / ac[k].gbps[rep];
                }
                result z = s_result(&ac[0]), w = s_result(&ac[1]), m = s_result(&ac[2]);
                failed |= !z.ok;
                /* the median of the paired repetitions' ratios: a slow spell moves both
                 * halves of a pair, not the ratio */
                double ratio = (sides & 3) == 3 ? bench_median(pair[0], (size_t)reps) : 0;
                double ratio_w = (sides & 5) == 5 ? bench_median(pair[1], (size_t)reps) : 0;
                printf("%dx%-3d %-9zu %-9s %9.3f %9.3f %6.2f %9.3f %6.2f %9.1f %9.1f %9.1f %9.1f %8.3f %8.3f\n",
                       ns, nc, bytes, s_ops[op], z.gbps, w.gbps, ratio, m.gbps, ratio_w, z.p50, w.p50,
                       z.p99, w.p99, z.cpu_s_per_gb, w.cpu_s_per_gb);
                fflush(stdout);
                fprintf(js,
                        "%s  {\"servers\": %d, \"clients\": %d, \"bytes\": %zu, \"op\": \"%s\", "
                        "\"push_dtype\": \"%s\", "
                        "\"zps_gbps\": %.4f, \"raw_gbps\": %.4f, \"ratio\": %.4f, "
                        "\"raw_warm_gbps\": %.4f, \"ratio_warm\": %.4f, \"zps_p50_us\": %.1f, "
                        "\"raw_p50_us\": %.1f, \"raw_warm_p50_us\": %.1f, \"zps_p99_us\": %.1f, "
                        "\"raw_p99_us\": %.1f, \"zps_cpu_s_per_gb\": %.4f, \"raw_cpu_s_per_gb\": %.4f, "
                        "\"raw_warm_cpu_s_per_gb\": %.4f}",
                        first ? "" : ",\n", ns, nc, bytes, s_ops[op], ps_dtype_name(dtype), z.gbps, w.gbps, ratio, m.gbps,
                        ratio_w, z.p50, w.p50, m.p50, z.p99, w.p99, z.cpu_s_per_gb, w.cpu_s_per_gb,
                        m.cpu_s_per_gb);
                first = 0;
            }
            ps_plan_destroy(&plan);
        }
        for (int s = 0; s < ns; s++) {
            s_reap(&raw[s]);
            s_reap(&warm[s]);
            s_reap(&zs[s]);
        }
    }
    fprintf(js, "\n]\n");
    fclose(js);
    printf("ps-lite on this machine (issue 3), 1x1 push 2.26 / 2.37 / 1.37 GB/s and pull 1.86 / 2.10 / "
           "1.23 GB/s at 1 / 16 / 100 MiB; 2x2 push 2.82 / 2.88 / 1.85 GB/s\n");
    printf("wrote %s\n", path);
    return failed;
}
