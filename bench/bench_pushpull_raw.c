/* bench_pushpull_raw.c — the raw ZeroMQ baseline of `zps-bench pushpull` (pushpull_int.h):
 * a server process that never touches the payload (an empty ack to a push, zero-copy frames
 * of a static buffer to a pull) and a client that sends the frames the zps plan would, to
 * the same number of servers, and copies pulled frames into its values as the zps client
 * does. No zps logic runs on either side; that is the point of the comparison.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "bench/pushpull_int.h"
#include "common/mem.h"

/* The request header the raw client sends to each server. */
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

_Noreturn void bench_pp_raw_server(int fd)
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

/* ------------------------------------------------------------------ raw client */

/* Raw side of one client: a DEALER per server and the header it sends there. */
typedef struct raw_side {
    const bench_pp_run *r;
    float *grad, *val;
    ps_piece *pc; // (np) the plan's pieces, in server order per server
    size_t np;
    void *ctx;
    void *socks[MAX_SERVERS];
    raw_hdr *hdr[MAX_SERVERS];
    size_t hdrlen[MAX_SERVERS];
} raw_side;

/* Connects to every raw server; each header lists the sizes of the frames that server gets
 * (the plan's pieces on it). */
static void s_raw_connect(raw_side *w)
{
    const bench_pp_run *r = w->r;
    int zero = 0;
    w->ctx = zmq_ctx_new();
    for (int s = 0; s < r->servers; s++) {
        w->socks[s] = zmq_socket(w->ctx, ZMQ_DEALER);
        zmq_setsockopt(w->socks[s], ZMQ_SNDHWM, &zero, sizeof zero);
        zmq_setsockopt(w->socks[s], ZMQ_RCVHWM, &zero, sizeof zero);
        zmq_connect(w->socks[s], r->uris[s]);
        int cnt = 0;
        for (size_t i = 0; i < w->np; i++)
            cnt += w->pc[i].server == (uint32_t)s;
        w->hdrlen[s] = sizeof(raw_hdr) + sizeof(size_t) * (size_t)cnt;
        raw_hdr *h = zps_xmalloc(w->hdrlen[s]);
        h->op = r->op;
        h->nframes = cnt;
        int k = 0;
        for (size_t i = 0; i < w->np; i++)
            if (w->pc[i].server == (uint32_t)s)
                h->sizes[k++] = w->pc[i].count * 4;
        w->hdr[s] = h;
    }
}

/* Server s's header, then (push, pushpull) its pieces of the gradient, zero-copy. */
static void s_raw_send(raw_side *w, int s)
{
    const bench_pp_run *r = w->r;
    const raw_hdr *h = w->hdr[s];
    int push = r->op != OP_PULL;
    zmq_send(w->socks[s], h, w->hdrlen[s], push && h->nframes ? ZMQ_SNDMORE : 0);
    if (!push)
        return;
    zmq_msg_t m;
    int k = 0;
    for (size_t i = 0; i < w->np; i++) {
        if (w->pc[i].server != (uint32_t)s)
            continue;
        zmq_msg_init_data(&m, w->grad + w->pc[i].flat_offset,
                          w->pc[i].count * ps_dtype_size(r->dtype), s_noop_free, NULL);
        zmq_msg_send(&m, w->socks[s], ++k < h->nframes ? ZMQ_SNDMORE : 0);
    }
}

/* Server s's ack and (pull, pushpull) its frames, copied into the values as the zps client
 * does. */
static void s_raw_recv(raw_side *w, int s)
{
    zmq_msg_t m;
    zmq_msg_init(&m);
    zmq_msg_recv(&m, w->socks[s], 0); // ack
    int more = zmq_msg_more(&m);
    zmq_msg_close(&m);
    size_t i = 0;
    while (more) {
        while (i < w->np && w->pc[i].server != (uint32_t)s)
            i++;
        zmq_msg_init(&m);
        zmq_msg_recv(&m, w->socks[s], 0);
        more = zmq_msg_more(&m);
        if (i < w->np && zmq_msg_size(&m) == w->pc[i].count * 4)
            memcpy(w->val + w->pc[i].flat_offset, zmq_msg_data(&m), w->pc[i].count * 4);
        i++;
        zmq_msg_close(&m);
    }
}

static int s_raw_request(void *ctx)
{
    raw_side *w = ctx;
    for (int s = 0; s < w->r->servers; s++)
        s_raw_send(w, s);
    for (int s = 0; s < w->r->servers; s++)
        s_raw_recv(w, s);
    return 0;
}

void *bench_pp_raw_client(void *arg)
{
    bench_pp_arg *a = arg;
    bench_pp_run *r = a->r;
    raw_side w = {.r = r};
    bench_pp_client_buffers(r->plan->total, &w.grad, &w.val);
    w.np = ps_plan_pieces(r->plan, 0, 1, NULL, 0);
    w.pc = zps_xmalloc(w.np * sizeof *w.pc);
    ps_plan_pieces(r->plan, 0, 1, w.pc, w.np);
    s_raw_connect(&w);
    bench_pp_timed_loop(r, a->id, s_raw_request, &w, 0);
    for (int s = 0; s < r->servers; s++) {
        int l = 0;
        zmq_setsockopt(w.socks[s], ZMQ_LINGER, &l, sizeof l);
        zmq_close(w.socks[s]);
        free(w.hdr[s]);
    }
    zmq_ctx_term(w.ctx);
    free(w.pc);
    zps_aligned_free(w.grad);
    zps_aligned_free(w.val);
    return NULL;
}

