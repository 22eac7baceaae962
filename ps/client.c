/* client.c — see client.h and docs/ps.md.
 *
 * A ticket is a user-visible operation; it owns one sub-request ("slot") per server it
 * touches. A slot's request id is (sequence << S_SLOT_BITS) | slot index, so a reply finds
 * its slot in O(1) and a reply to a slot that has since been reused (a late duplicate) is
 * recognised and dropped. Push frames point into the caller's gradient buffer (zero-copy);
 * frames_out counts the frames zmq still holds, and a slot is only recycled once it is 0.
 *
 * Handshakes: each DEALER has a socket monitor whose PAIR reader (mons[i]) is read, without
 * blocking, by s_timeouts (at most every 2 ms while the client is driven). It only carries
 * handshake verdicts, which happen once per connection, so plaintext traffic costs nothing
 * more; a refusal fails every request to that server with ZPS_ERR_UNAUTHORIZED
 * (s_refuse) instead of leaving it to the 30 s timeout.
 */
#include "ps/client.h"

#include <assert.h>
#include <pthread.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/mem.h"
#include "common/proto.h"
#include "ps/curve.h"

#define S_SLOT_BITS 12
#define S_SLOTS (1u << S_SLOT_BITS)
#define S_TICKETS 4096u
/* Push frames smaller than this are copied (cheaper than a zero-copy message). */
#define S_ZC_MIN 16384
/* Handshake events the client watches on each DEALER. */
#define S_HS_EVENTS                                                                    \
    (ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |            \
     ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)

typedef struct s_slot {
    uint64_t rid;         // 0 when free
    int server;
    ps_ticket ticket;     // 0: internal (heartbeat, re-register)
    int op;
    int64_t step;
    ps_piece *pieces;     // (n_pieces) owned, reused
    size_t n_pieces, cap_pieces;
    const float *src;     // push: flat gradient buffer
    uint16_t *wire;       // push_dtype bf16: the pieces' gradients converted, back to back
    size_t cap_wire;      // (owned, reused; filled once per slot use, resends send it again)
    int wire_ready;
    float *dst;           // pull: flat value buffer
    int attempts;
    uint64_t deadline_ns; // resend when passed
    uint64_t resend_at_ns; // 0: sent; else the back-off end
    int await_reg;        // waiting for a re-REGISTER of its server
    atomic_int frames_out;
    int done;
} s_slot;

typedef struct s_ticket {
    ps_ticket id;      // 0 when free
    int open;          // slots not finished
    int status;
    int waited;
    uint64_t version;  // min model_version of the replies
    char msg[384];
} s_ticket;

struct ps_client {
    ps_client_opts o;
    int n;
    uint32_t trainer;
    void *ctx;
    void **socks;          // (n)
    char **uris;           // (n)
    uint64_t *last_sent_ns; // (n)
    int *reg_inflight;     // (n)
    const ps_plan *plan;
    ps_job req_job;        // what register asked for (re-register repeats it)
    ps_job job;
    int registered;
    s_slot *slots;         // (S_SLOTS)
    uint32_t *free_slots;  // stack
    uint32_t n_free;
    uint64_t seq;
    s_ticket *tickets;     // (S_TICKETS)
    ps_ticket next_ticket;
    ps_piece *pieces;      // scratch for plan pieces
    size_t *next_piece;    // (n) scratch: per-server cursor while cutting messages
    Zps__KeyRange *kr;     // (cap_kr) scratch header ranges, reused by every send
    Zps__KeyRange **krp;
    size_t cap_kr;
    uint64_t last_timeouts_ns; // s_timeouts runs at most every few ms
    size_t cap_pieces;
    zmq_msg_t *frames;     // (PS_MAX_RANGES + 1) receive frames
    char err[512];
    char *stats_json;      // STATS reply captured for ps_client_stats
    Zps__JobConfig *reg_job_reply; // first REGISTER reply's job (owned, unpacked copy)
    ps_optim_config reg_opt;
    int reg_opt_seen, reg_opt_conflict;
    pthread_t hb_thread;   // heartbeat_thread: own sockets, started by register
    int hb_running;
    atomic_int hb_stop;
    int curve;             // the o.curve_* keys are set: every socket is a CURVE client
    void **mons;           // (n) PAIR reading socks[i]'s handshake events; NULL with socks[i]
    unsigned mon_gen;      // keeps monitor endpoints unique across reopened sockets
    int *hs_silent;        // (n) handshakes server i closed without a reason since a success
    char (*refused)[320];  // (n) why server i refused our handshake ("": it has not)
};

/* CURVE client options on a new socket (nothing without keys). -1 on failure. */
static int s_curve_sockopts(const ps_client *c, void *s)
{
    if (!c->curve)
        return 0;
    if (zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, c->o.curve_server_key, PS_CURVE_KEY_LEN + 1) == -1 ||
        zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, c->o.curve_public_key, PS_CURVE_KEY_LEN + 1) == -1 ||
        zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, c->o.curve_secret_key, PS_CURVE_KEY_LEN + 1) == -1)
        return -1;
    return 0;
}

/* The heartbeat thread: its own DEALER per server (sockets are not shared across threads),
 * a HEARTBEAT to each every heartbeat_ms; replies are read and dropped. */
static void *s_hb_main(void *arg)
{
    ps_client *c = arg;
    void **socks = zps_xcalloc((size_t)c->n, sizeof *socks);
    int zero = 0;
    for (int i = 0; i < c->n; i++) {
        socks[i] = zmq_socket(c->ctx, ZMQ_DEALER);
        if (!socks[i])
            continue;
        zmq_setsockopt(socks[i], ZMQ_LINGER, &zero, sizeof zero);
        if (s_curve_sockopts(c, socks[i]) == -1 || zmq_connect(socks[i], c->uris[i]) == -1) {
            zmq_close(socks[i]);
            socks[i] = NULL;
        }
    }
    uint64_t rid = 1;
    while (!atomic_load(&c->hb_stop)) {
        for (int i = 0; i < c->n; i++) {
            if (!socks[i])
                continue;
            Zps__Header h = ZPS__HEADER__INIT;
            h.version = ZPS_PROTOCOL_VERSION;
            h.op = ZPS__OP__OP_HEARTBEAT;
            h.request_id = rid++;
            h.trainer_id = c->trainer;
            uint8_t buf[64];
            size_t hl = zps__header__pack(&h, buf);
            zmq_send(socks[i], buf, hl, ZMQ_DONTWAIT);
        }
        /* sleep by waiting for replies, which are dropped */
        uint64_t end = zps_now_ns() + (uint64_t)c->o.heartbeat_ms * 1000000ull;
        while (!atomic_load(&c->hb_stop) && zps_now_ns() < end) {
            zmq_pollitem_t it[64];
            int n = c->n < 64 ? c->n : 64;
            for (int i = 0; i < n; i++)
                it[i] = (zmq_pollitem_t){socks[i], -1, (short)(socks[i] ? ZMQ_POLLIN : 0), 0};
            zmq_poll(it, n, 50);
            for (int i = 0; i < n; i++)
                if (it[i].revents & ZMQ_POLLIN) {
                    zmq_msg_t m;
                    zmq_msg_init(&m);
                    while (zmq_msg_recv(&m, socks[i], ZMQ_DONTWAIT) != -1)
                        ;
                    zmq_msg_close(&m);
                }
        }
    }
    for (int i = 0; i < c->n; i++)
        if (socks[i])
            zmq_close(socks[i]);
    free(socks);
    return NULL;
}

/* Stops the heartbeat thread if it runs. */
static void s_hb_stop(ps_client *c)
{
    if (!c->hb_running)
        return;
    atomic_store(&c->hb_stop, 1);
    pthread_join(c->hb_thread, NULL);
    c->hb_running = 0;
}

void ps_client_opts_default(ps_client_opts *o)
{
    memset(o, 0, sizeof *o);
    o->timeout_ms = 30000;
    o->max_retries = 4;
    o->backoff_ms = 50;
    o->heartbeat_ms = 1000;
    o->msg_bytes = 1u << 20;
    o->streams = 1;
    o->heartbeat_thread = 0;
    o->push_dtype = PS_DTYPE_F32;
}

const char *ps_client_last_error(const ps_client *c) { return c->err; }
int ps_client_num_servers(const ps_client *c) { return c->n; }

/* Connects socket s to server i opts.streams times: one TCP connection each. */
static int s_connect_streams(ps_client *c, void *s, int i)
{
    for (int k = 0; k < c->o.streams; k++)
        if (zmq_connect(s, c->uris[i]) == -1)
            return -1;
    return 0;
}

/* Opens server i's DEALER and its handshake monitor. The monitor's reader is connected
 * before the DEALER connects, so no verdict is lost. */
static zps_status s_open_socket(ps_client *c, int i)
{
    void *s = zmq_socket(c->ctx, ZMQ_DEALER);
    ZPS_CHECK_PTR(s, ZPS_ERR_ZMQ);
    void *mon = NULL;
    char mon_ep[96];
    snprintf(mon_ep, sizeof mon_ep, "inproc://zps-client-monitor-%p-%d-%u", (void *)c, i,
             c->mon_gen++);
    int zero = 0, linger = 1000, ivl = 100, ivlmax = 2000;
    if (zmq_setsockopt(s, ZMQ_SNDHWM, &zero, sizeof zero) == -1 ||
        zmq_setsockopt(s, ZMQ_RCVHWM, &zero, sizeof zero) == -1 ||
        zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger) == -1 ||
        zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl) == -1 ||
        zmq_setsockopt(s, ZMQ_RECONNECT_IVL_MAX, &ivlmax, sizeof ivlmax) == -1 ||
        s_curve_sockopts(c, s) == -1 || zmq_socket_monitor(s, mon_ep, S_HS_EVENTS) == -1 ||
        !(mon = zmq_socket(c->ctx, ZMQ_PAIR)) ||
        zmq_setsockopt(mon, ZMQ_LINGER, &zero, sizeof zero) == -1 ||
        zmq_connect(mon, mon_ep) == -1 || s_connect_streams(c, s, i) == -1) {
        zps_log(ZPS_ERROR, "client", "cannot connect to %s: %s", c->uris[i],
                zmq_strerror(zmq_errno()));
        if (mon)
            zmq_close(mon);
        zmq_close(s);
        return ZPS_ERR_ZMQ;
    }
    c->socks[i] = s;
    c->mons[i] = mon;
    c->hs_silent[i] = 0;
    return ZPS_OK;
}

/* Closes server i's DEALER (dropping whatever it still holds) and its monitor reader. */
static void s_close_socket(ps_client *c, int i)
{
    int zero = 0;
    if (c->socks[i]) {
        zmq_setsockopt(c->socks[i], ZMQ_LINGER, &zero, sizeof zero);
        zmq_close(c->socks[i]);
    }
    if (c->mons[i])
        zmq_close(c->mons[i]);
    c->socks[i] = c->mons[i] = NULL;
}

zps_status ps_client_new(const char *const *server_uris, int n_servers, uint32_t trainer_id,
                         const ps_client_opts *opts, ps_client **out)
{
    *out = NULL;
    if (n_servers < 1 || !server_uris)
        return ZPS_ERR_INVALID;
    int curve = 0;
    if (opts) {
        const char *keys[3] = {opts->curve_server_key, opts->curve_public_key,
                               opts->curve_secret_key};
        int given = 0, valid = 0;
        for (int k = 0; k < 3; k++) {
            size_t len = strnlen(keys[k], PS_CURVE_KEY_LEN + 1);
            given += len > 0;
            valid += ps_curve_key_valid(keys[k], len);
        }
        if (given && valid != 3) {
            zps_log(ZPS_ERROR, "client", "CURVE wants the server key, the public key and the "
                    "secret key together, each 40 Z85 characters (%d of 3 valid)", valid);
            return ZPS_ERR_INVALID;
        }
        if (given && !zmq_has("curve")) {
            zps_log(ZPS_ERROR, "client", "CURVE keys given, but this libzmq has no CURVE");
            return ZPS_ERR_UNSUPPORTED;
        }
        curve = given > 0;
    }
    ps_client *c = zps_xcalloc(1, sizeof *c);
    if (opts)
        c->o = *opts;
    else
        ps_client_opts_default(&c->o);
    c->curve = curve;
    c->n = n_servers;
    c->trainer = trainer_id;
    if (c->o.streams < 1 || c->o.streams > 8) {
        zps_log(ZPS_ERROR, "client", "streams %d: want 1..8 TCP connections per server",
                c->o.streams);
        free(c);
        return ZPS_ERR_INVALID;
    }
    if (!ps_dtype_name(c->o.push_dtype)) {
        zps_log(ZPS_ERROR, "client", "push_dtype %d: want PS_DTYPE_F32 or PS_DTYPE_BF16",
                (int)c->o.push_dtype);
        free(c);
        return ZPS_ERR_INVALID;
    }
    c->ctx = zmq_ctx_new();
    if (!c->ctx) {
        free(c);
        ZPS_CHECK_PTR(NULL, ZPS_ERR_ZMQ);
    }
    if (c->o.streams > 1 && zmq_ctx_set(c->ctx, ZMQ_IO_THREADS, c->o.streams) == -1) {
        zmq_ctx_term(c->ctx);
        free(c);
        ZPS_CHECK_ZMQ(-1);
    }
    c->socks = zps_xcalloc((size_t)n_servers, sizeof *c->socks);
    c->uris = zps_xcalloc((size_t)n_servers, sizeof *c->uris);
    c->last_sent_ns = zps_xcalloc((size_t)n_servers, sizeof *c->last_sent_ns);
    c->reg_inflight = zps_xcalloc((size_t)n_servers, sizeof *c->reg_inflight);
    c->next_piece = zps_xcalloc((size_t)n_servers, sizeof *c->next_piece);
    c->mons = zps_xcalloc((size_t)n_servers, sizeof *c->mons);
    c->hs_silent = zps_xcalloc((size_t)n_servers, sizeof *c->hs_silent);
    c->refused = zps_xcalloc((size_t)n_servers, sizeof *c->refused);
    c->slots = zps_xcalloc(S_SLOTS, sizeof *c->slots);
    c->free_slots = zps_xmalloc(S_SLOTS * sizeof *c->free_slots);
    for (uint32_t i = 0; i < S_SLOTS; i++)
        c->free_slots[i] = S_SLOTS - 1 - i;
    c->n_free = S_SLOTS;
    c->tickets = zps_xcalloc(S_TICKETS, sizeof *c->tickets);
    c->frames = zps_xcalloc(PS_MAX_RANGES + 1, sizeof *c->frames);
    c->next_ticket = 1;
    for (int i = 0; i < n_servers; i++) {
        c->uris[i] = zps_xstrdup(server_uris[i]);
        zps_status st = s_open_socket(c, i);
        if (st != ZPS_OK) {
            ps_client_destroy(&c);
            return st;
        }
    }
    *out = c;
    return ZPS_OK;
}

void ps_client_destroy(ps_client **pc)
{
    if (!pc || !*pc)
        return;
    ps_client *c = *pc;
    s_hb_stop(c);
    for (int i = 0; i < c->n; i++)
        s_close_socket(c, i);
    if (c->ctx)
        zmq_ctx_term(c->ctx); // returns once zmq released every zero-copy frame
    for (uint32_t i = 0; i < S_SLOTS; i++) {
        free(c->slots[i].pieces);
        free(c->slots[i].wire);
    }
    for (int i = 0; i < c->n; i++)
        free(c->uris[i]);
    free(c->uris);
    free(c->socks);
    free(c->last_sent_ns);
    free(c->reg_inflight);
    free(c->next_piece);
    free(c->mons);
    free(c->hs_silent);
    free(c->refused);
    free(c->kr);
    free(c->krp);
    free(c->slots);
    free(c->free_slots);
    free(c->tickets);
    free(c->frames);
    free(c->pieces);
    free(c->stats_json);
    if (c->reg_job_reply)
        zps__job_config__free_unpacked(c->reg_job_reply, NULL);
    explicit_bzero(c->o.curve_secret_key, sizeof c->o.curve_secret_key);
    free(c);
    *pc = NULL;
}

/* ------------------------------------------------------------------------- sending */

static void s_frame_done(void *data, void *hint)
{
    (void)data;
    s_slot *sl = hint;
    atomic_fetch_sub(&sl->frames_out, 1);
}

static void s_fill_job(const ps_client *c, Zps__JobConfig *j)
{
    zps__job_config__init(j);
    j->mode = (Zps__Mode)c->req_job.mode;
    j->num_trainers = c->req_job.num_trainers;
    j->replicas_to_aggregate = c->req_job.replicas_to_aggregate;
    j->staleness = c->req_job.staleness;
    if (c->plan) {
        j->chunk_bytes = c->plan->chunk_bytes;
        j->num_servers = (uint32_t)c->plan->n_servers;
        j->num_variables = (uint32_t)c->plan->n_vars;
        j->total_count = c->plan->total;
        j->num_chunks = c->plan->n_chunks;
    }
}

/* Sends (or resends) slot sl. INIT's optimizer comes from opt. */
/* push_dtype bf16: the slot's gradients rounded into its wire buffer, once per use of the
 * slot. The buffer is the slot's and only grows, so the per-message path allocates nothing;
 * zero-copy frames point into it, and a slot is recycled only once ZeroMQ let go of them. */
static void s_slot_convert(s_slot *sl)
{
    size_t total = 0;
    for (size_t i = 0; i < sl->n_pieces; i++)
        total += sl->pieces[i].count;
    if (total > sl->cap_wire) {
        sl->cap_wire = total;
        sl->wire = zps_xrealloc(sl->wire, total * sizeof *sl->wire);
    }
    size_t woff = 0;
    for (size_t i = 0; i < sl->n_pieces; i++) {
        ps_f32_to_bf16(sl->wire + woff, sl->src + sl->pieces[i].flat_offset, sl->pieces[i].count);
        woff += sl->pieces[i].count;
    }
    sl->wire_ready = 1;
}

static zps_status s_send_slot(ps_client *c, s_slot *sl, const ps_optim_config *opt)
{
    void *sock = c->socks[sl->server];
    if (c->refused[sl->server][0])
        return ZPS_ERR_UNAUTHORIZED;
    if (!sock)
        return ZPS_ERR_ZMQ;
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__JobConfig job;
    Zps__OptimizerConfig om;
    Zps__Schedule sm;
    h.version = ZPS_PROTOCOL_VERSION;
    h.op = (Zps__Op)sl->op;
    h.request_id = sl->rid;
    h.trainer_id = c->trainer;
    h.step = sl->step;
    h.server_index = (uint32_t)sl->server;
    h.plan_hash = c->plan ? c->plan->hash : 0;
    if (sl->op == ZPS__OP__OP_REGISTER || sl->op == ZPS__OP__OP_INIT) {
        s_fill_job(c, &job);
        h.job = &job;
    }
    if (sl->op == ZPS__OP__OP_INIT && opt) {
        ps_optim_to_proto(opt, &om, &sm);
        h.optimizer = &om;
    }
    /* gradients may travel as bfloat16; INIT's values never do */
    ps_dtype dt = sl->op == ZPS__OP__OP_PUSH || sl->op == ZPS__OP__OP_PUSHPULL
                      ? c->o.push_dtype
                      : PS_DTYPE_F32;
    Zps__KeyRange *rs = NULL, **rp = NULL;
    if (sl->n_pieces) {
        if (sl->n_pieces > c->cap_kr) {
            c->cap_kr = sl->n_pieces;
            c->kr = zps_xrealloc(c->kr, c->cap_kr * sizeof *c->kr);
            c->krp = zps_xrealloc(c->krp, c->cap_kr * sizeof *c->krp);
        }
        rs = c->kr;
        rp = c->krp;
        for (size_t i = 0; i < sl->n_pieces; i++) {
            zps__key_range__init(&rs[i]);
            rs[i].key = sl->pieces[i].key;
            rs[i].offset = sl->pieces[i].chunk_offset;
            rs[i].length = sl->pieces[i].count * ps_dtype_size(dt);
            rs[i].dtype = dt == PS_DTYPE_BF16 ? ZPS__DTYPE__DTYPE_BF16 : ZPS__DTYPE__DTYPE_F32;
            rp[i] = &rs[i];
        }
        h.n_ranges = sl->n_pieces;
        h.ranges = rp;
    }
    int has_data = sl->src != NULL && sl->n_pieces > 0;
    size_t hl = zps__header__get_packed_size(&h);
    zmq_msg_t m;
    zps_status st = ZPS_OK;
    if (zmq_msg_init_size(&m, hl) == -1) {
        st = ZPS_ERR_ZMQ;
        goto out;
    }
    zps__header__pack(&h, zmq_msg_data(&m));
    if (zmq_msg_send(&m, sock, has_data ? ZMQ_SNDMORE : 0) == -1) {
        zmq_msg_close(&m);
        zps_log(ZPS_ERROR, "client", "send to %s: %s", c->uris[sl->server], zmq_strerror(zmq_errno()));
        st = ZPS_ERR_ZMQ;
        goto out;
    }
    if (has_data && dt == PS_DTYPE_BF16 && !sl->wire_ready)
        s_slot_convert(sl);
    if (has_data) {
        size_t woff = 0; // into sl->wire
        for (size_t i = 0; i < sl->n_pieces; i++) {
            size_t cnt = sl->pieces[i].count, nb = cnt * ps_dtype_size(dt);
            const void *p = dt == PS_DTYPE_BF16 ? (const void *)(sl->wire + woff)
                                                : (const void *)(sl->src + sl->pieces[i].flat_offset);
            woff += cnt;
            int more = i + 1 < sl->n_pieces ? ZMQ_SNDMORE : 0;
            if (nb >= S_ZC_MIN) {
                atomic_fetch_add(&sl->frames_out, 1);
                if (zmq_msg_init_data(&m, (void *)p, nb, s_frame_done, sl) == -1) {
                    atomic_fetch_sub(&sl->frames_out, 1);
                    st = ZPS_ERR_ZMQ;
                    goto out;
                }
            } else if (zmq_msg_init_size(&m, nb) == -1) {
                st = ZPS_ERR_ZMQ;
                goto out;
            } else {
                memcpy(zmq_msg_data(&m), p, nb);
            }
            if (zmq_msg_send(&m, sock, more) == -1) {
                zmq_msg_close(&m);
                st = ZPS_ERR_ZMQ;
                goto out;
            }
        }
    }
    c->last_sent_ns[sl->server] = zps_now_ns();
    sl->deadline_ns = zps_now_ns() + (uint64_t)c->o.timeout_ms * 1000000ull;
    sl->resend_at_ns = 0;
out:
    return st;
}

static s_slot *s_slot_new(ps_client *c, int server, ps_ticket t, int op, int64_t step)
{
    if (!c->n_free)
        return NULL;
    uint32_t idx = c->free_slots[--c->n_free];
    s_slot *sl = &c->slots[idx];
    c->seq++;
    sl->rid = (c->seq << S_SLOT_BITS) | idx;
    sl->server = server;
    sl->ticket = t;
    sl->op = op;
    sl->step = step;
    sl->n_pieces = 0;
    sl->src = NULL;
    sl->dst = NULL;
    sl->wire_ready = 0;
    sl->attempts = 0;
    sl->await_reg = 0;
    sl->done = 0;
    return sl;
}

/* Frees a slot. zmq may still hold zero-copy frames of its push. After a reply the IO
 * thread has written them and lets go at once (wait for it, however loaded the machine).
 * After a failure (failed = 1) they may be parked in the pipe for a dead server: if they
 * are not released quickly, close the socket with linger 0, which drops them, and open a
 * new one; requests in flight on it time out and are resent. */
static void s_slot_release_ex(ps_client *c, s_slot *sl, int failed)
{
    for (int spins = 0; atomic_load(&sl->frames_out) > 0 && (!failed || spins < 20); spins++)
        zps_sleep_ns(spins < 20 ? 50000 : 1000000);
    if (atomic_load(&sl->frames_out) > 0) {
        int srv = sl->server;
        zps_log(ZPS_WARN, "client", "dropping unsent frames to %s: reopening the socket", c->uris[srv]);
        s_close_socket(c, srv);
        for (int spins = 0; atomic_load(&sl->frames_out) > 0 && spins < 10000; spins++)
            zps_sleep_ns(1000000);
        if (s_open_socket(c, srv) != ZPS_OK)
            zps_log(ZPS_ERROR, "client", "cannot reopen the socket to %s", c->uris[srv]);
    }
    sl->rid = 0;
    c->free_slots[c->n_free++] = (uint32_t)(sl - c->slots);
}

static void s_slot_release(ps_client *c, s_slot *sl) { s_slot_release_ex(c, sl, 1); }

static void s_slot_pieces(s_slot *sl, size_t n)
{
    if (n > sl->cap_pieces) {
        sl->cap_pieces = n;
        sl->pieces = zps_xrealloc(sl->pieces, n * sizeof *sl->pieces);
    }
    sl->n_pieces = n;
}

static s_ticket *s_ticket_get(ps_client *c, ps_ticket t)
{
    s_ticket *tk = &c->tickets[t % S_TICKETS];
    return tk->id == t ? tk : NULL;
}

static void s_ticket_fail(s_ticket *tk, int status, const char *msg)
{
    if (tk->status == ZPS_OK) {
        tk->status = status;
        snprintf(tk->msg, sizeof tk->msg, "%s", msg);
    }
}

static zps_status s_wait_ticket(ps_client *c, ps_ticket t, uint64_t *version, int mark_waited);

/* A new ticket; waits for the oldest one if the ring is full. */
static zps_status s_ticket_new(ps_client *c, ps_ticket *out)
{
    ps_ticket t = c->next_ticket;
    s_ticket *tk = &c->tickets[t % S_TICKETS];
    if (tk->id && tk->open)
        s_wait_ticket(c, tk->id, NULL, 0);
    c->next_ticket++;
    memset(tk, 0, sizeof *tk);
    tk->id = t;
    tk->version = UINT64_MAX;
    *out = t;
    return ZPS_OK;
}

/* The message for a slot whose send failed with st. */
static const char *s_send_err(const ps_client *c, int server, zps_status st)
{
    return st == ZPS_ERR_UNAUTHORIZED ? c->refused[server] : "send failed";
}

/* Completes one slot of its ticket. */
static void s_slot_finish(ps_client *c, s_slot *sl, int status, const char *msg, uint64_t version)
{
    if (sl->ticket) {
        s_ticket *tk = s_ticket_get(c, sl->ticket);
        if (tk) {
            if (status != ZPS_OK) {
                char m[384];
                snprintf(m, sizeof m, "server %d (%s): %s", sl->server, c->uris[sl->server],
                         msg && *msg ? msg : zps_strerror(status));
                s_ticket_fail(tk, status, m);
            }
            if (version < tk->version)
                tk->version = version;
            tk->open--;
        }
    }
    s_slot_release_ex(c, sl, status != ZPS_OK);
}

/* Builds and sends the per-server slots of a range operation. */
static zps_status s_range_op(ps_client *c, int op, int first_var, int n_vars, const float *src,
                             float *dst, int64_t step, ps_ticket *out)
{
    assert(c->plan && "ps_client_register first");
    assert(first_var >= 0 && n_vars >= 1 && first_var + n_vars <= c->plan->n_vars);
    size_t np = ps_plan_pieces(c->plan, first_var, n_vars, NULL, 0);
    if (np > c->cap_pieces) {
        c->cap_pieces = np;
        c->pieces = zps_xrealloc(c->pieces, np * sizeof *c->pieces);
    }
    ps_plan_pieces(c->plan, first_var, n_vars, c->pieces, np);
    ps_ticket t;
    ZPS_TRY(s_ticket_new(c, &t));
    s_ticket *tk = s_ticket_get(c, t);
    zps_status st = ZPS_OK;
    /* Each server's pieces go out as messages of about msg_bytes, round-robin over the
     * servers: the server applies message k while message k + 1 is still on the wire, and
     * the client copies pulled message k while k + 1 arrives. */
    size_t *next = c->next_piece;
    for (int s = 0; s < c->n; s++)
        next[s] = 0;
    uint64_t msg_bytes = c->o.msg_bytes ? c->o.msg_bytes : UINT64_MAX;
    for (int busy = 1; busy && st == ZPS_OK;) {
        busy = 0;
        for (int s = 0; s < c->n && st == ZPS_OK; s++) {
            size_t i = next[s];
            while (i < np && c->pieces[i].server != (uint32_t)s)
                i++;
            if (i >= np) {
                next[s] = np;
                continue;
            }
            busy = 1;
            /* this message: pieces of server s from i on, until msg_bytes */
            size_t cnt = 0, j = i, last = i;
            uint64_t bytes = 0;
            for (; j < np && bytes < msg_bytes && cnt < PS_MAX_RANGES; j++)
                if (c->pieces[j].server == (uint32_t)s) {
                    bytes += c->pieces[j].count * 4;
                    cnt++;
                    last = j;
                }
            next[s] = last + 1;
            s_slot *sl = s_slot_new(c, s, t, op, step);
            if (!sl) {
                st = ZPS_ERR_BUSY;
                s_ticket_fail(tk, st, "too many requests in flight (wait for some tickets)");
                break;
            }
            s_slot_pieces(sl, cnt);
            size_t k = 0;
            for (size_t q = i; q <= last; q++)
                if (c->pieces[q].server == (uint32_t)s)
                    sl->pieces[k++] = c->pieces[q];
            sl->src = src;
            sl->dst = dst;
            tk->open++;
            st = s_send_slot(c, sl, NULL);
            if (st != ZPS_OK)
                s_slot_finish(c, sl, st, s_send_err(c, s, st), UINT64_MAX);
        }
    }
    if (st != ZPS_OK)
        snprintf(c->err, sizeof c->err, "%s", tk->msg);
    *out = t;
    return st;
}

zps_status ps_client_push(ps_client *c, int first_var, int n_vars, const float *grads,
                          int64_t step, ps_ticket *t)
{
    return s_range_op(c, ZPS__OP__OP_PUSH, first_var, n_vars, grads, NULL, step, t);
}

zps_status ps_client_pull(ps_client *c, int first_var, int n_vars, float *values, int64_t step,
                          ps_ticket *t)
{
    return s_range_op(c, ZPS__OP__OP_PULL, first_var, n_vars, NULL, values, step, t);
}

zps_status ps_client_pushpull(ps_client *c, int first_var, int n_vars, const float *grads,
                              float *values, int64_t step, ps_ticket *t)
{
    return s_range_op(c, ZPS__OP__OP_PUSHPULL, first_var, n_vars, grads, values, step, t);
}

/* ------------------------------------------------------------------------- receiving */

static void s_send_register(ps_client *c, int server)
{
    s_slot *sl = s_slot_new(c, server, 0, ZPS__OP__OP_REGISTER, 0);
    if (!sl)
        return;
    c->reg_inflight[server] = 1;
    if (s_send_slot(c, sl, NULL) != ZPS_OK) {
        c->reg_inflight[server] = 0;
        s_slot_release(c, sl);
    }
}

/* A reply to an internal re-REGISTER: resend (or fail) every slot that waited for it. */
static void s_reregistered(ps_client *c, int server, int status, const char *msg)
{
    c->reg_inflight[server] = 0;
    for (uint32_t i = 0; i < S_SLOTS; i++) {
        s_slot *sl = &c->slots[i];
        if (!sl->rid || sl->server != server || !sl->await_reg)
            continue;
        sl->await_reg = 0;
        zps_status st = status != ZPS_OK ? (zps_status)status : s_send_slot(c, sl, NULL);
        if (st != ZPS_OK)
            s_slot_finish(c, sl, st, status != ZPS_OK ? msg : s_send_err(c, server, st),
                          UINT64_MAX);
    }
}

static void s_handle_reply(ps_client *c, int server, int nframes)
{
    Zps__Header *h = zps__header__unpack(NULL, zmq_msg_size(&c->frames[0]),
                                         zmq_msg_data(&c->frames[0]));
    if (!h) {
        zps_log(ZPS_WARN, "client", "server %d sent an unreadable reply header", server);
        return;
    }
    uint32_t idx = (uint32_t)(h->request_id & (S_SLOTS - 1));
    s_slot *sl = &c->slots[idx];
    if (!h->request_id || sl->rid != h->request_id || sl->server != server || sl->await_reg) {
        zps_log(ZPS_DEBUG, "client", "dropping a reply to request %" PRIu64 " (late or duplicate)",
                h->request_id);
        zps__header__free_unpacked(h, NULL);
        return;
    }
    int status = h->status;
    const char *msg = h->message ? h->message : "";
    /* The server lost our registration (restart): register again, then resend. */
    if (status == ZPS_ERR_TRAINER && sl->op != ZPS__OP__OP_REGISTER && sl->ticket &&
        c->registered && sl->attempts <= c->o.max_retries) {
        sl->attempts++;
        sl->await_reg = 1;
        if (!c->reg_inflight[server])
            s_send_register(c, server);
        zps__header__free_unpacked(h, NULL);
        return;
    }
    if (sl->op == ZPS__OP__OP_REGISTER && !sl->ticket) {
        s_slot_release(c, sl);
        s_reregistered(c, server, status, msg);
        zps__header__free_unpacked(h, NULL);
        return;
    }
    if (sl->op == ZPS__OP__OP_REGISTER && status == ZPS_OK) {
        if (h->job && !c->reg_job_reply) {
            uint8_t buf[256];
            size_t n = zps__job_config__pack(h->job, buf);
            c->reg_job_reply = zps__job_config__unpack(NULL, n, buf);
        }
        if (h->optimizer) {
            ps_optim_config oc;
            if (ps_optim_from_proto(h->optimizer, &oc, NULL, 0) == ZPS_OK) {
                if (c->reg_opt_seen && !ps_optim_equal(&oc, &c->reg_opt))
                    c->reg_opt_conflict = 1;
                c->reg_opt = oc;
                c->reg_opt_seen = 1;
            }
        }
    }
    if (sl->op == ZPS__OP__OP_STATS && status == ZPS_OK) {
        free(c->stats_json);
        c->stats_json = zps_xstrdup(msg);
    }
    if (status == ZPS_OK && sl->dst &&
        (sl->op == ZPS__OP__OP_PULL || sl->op == ZPS__OP__OP_PUSHPULL)) {
        if ((size_t)nframes != 1 + sl->n_pieces) {
            status = ZPS_ERR_FRAMES;
            msg = "reply has the wrong number of frames";
        } else {
            for (size_t i = 0; i < sl->n_pieces; i++)
                if (zmq_msg_size(&c->frames[1 + i]) != sl->pieces[i].count * 4) {
                    status = ZPS_ERR_FRAMES;
                    msg = "reply frame of the wrong length";
                }
            if (status == ZPS_OK)
                for (size_t i = 0; i < sl->n_pieces; i++)
                    memcpy(sl->dst + sl->pieces[i].flat_offset, zmq_msg_data(&c->frames[1 + i]),
                           sl->pieces[i].count * 4);
        }
    }
    s_slot_finish(c, sl, status, msg, h->model_version);
    zps__header__free_unpacked(h, NULL);
}

/* Receives every reply waiting on server i's socket. */
static zps_status s_drain(ps_client *c, int server)
{
    for (;;) {
        int n = 0, more = 1;
        while (more) {
            zmq_msg_t *m = &c->frames[n <= PS_MAX_RANGES ? n : PS_MAX_RANGES];
            if (n > PS_MAX_RANGES)
                zmq_msg_close(m);
            zmq_msg_init(m);
            if (zmq_msg_recv(m, c->socks[server], n ? 0 : ZMQ_DONTWAIT) == -1) {
                int e = zmq_errno();
                zmq_msg_close(m);
                if (n == 0 && (e == EAGAIN || e == EINTR))
                    return ZPS_OK;
                for (int i = 0; i < n && i <= PS_MAX_RANGES; i++)
                    zmq_msg_close(&c->frames[i]);
                zps_log(ZPS_ERROR, "client", "receive from %s: %s", c->uris[server], zmq_strerror(e));
                return ZPS_ERR_ZMQ;
            }
            more = zmq_msg_more(m);
            if (n <= PS_MAX_RANGES)
                n++;
        }
        s_handle_reply(c, server, n);
        for (int i = 0; i < n; i++)
            zmq_msg_close(&c->frames[i]);
    }
}

/* Server refused our handshake: every request to it fails now, and so will later ones
 * until a handshake succeeds (libzmq does not reconnect after a ZAP refusal). */
static void s_refuse(ps_client *c, int server, const char *why)
{
    if (!c->refused[server][0])
        zps_log(ZPS_ERROR, "client", "server %d (%s): %s", server, c->uris[server], why);
    snprintf(c->refused[server], sizeof c->refused[server], "%s", why);
    for (uint32_t i = 0; i < S_SLOTS; i++) {
        s_slot *sl = &c->slots[i];
        if (!sl->rid || sl->server != server)
            continue;
        if (sl->ticket)
            s_slot_finish(c, sl, ZPS_ERR_UNAUTHORIZED, c->refused[server], UINT64_MAX);
        else
            s_slot_release(c, sl);
    }
    c->reg_inflight[server] = 0;
}

/* One handshake verdict on server i's socket. */
static void s_handshake_event(ps_client *c, int i, unsigned ev, uint32_t val)
{
    char why[320];
    if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
        c->hs_silent[i] = 0;
        if (c->refused[i][0])
            zps_log(ZPS_INFO, "client", "server %d (%s) accepts the handshake again", i,
                    c->uris[i]);
        c->refused[i][0] = 0;
        return;
    }
    if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
        if (c->curve)
            snprintf(why, sizeof why,
                     "the server refused this trainer's CURVE key %.8s... (ZAP status %u): "
                     "add its public key to the server's --curve-allow file",
                     c->o.curve_public_key, val);
        else
            snprintf(why, sizeof why, "the server refused this client (ZAP status %u)", val);
    } else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL &&
               val == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) {
        snprintf(why, sizeof why, "%s",
                 c->curve ? "the server does not use CURVE but this client does (security "
                            "mechanism mismatch): start the server with --curve-key, or "
                            "connect without keys"
                          : "the server requires CURVE and this client has no keys (security "
                            "mechanism mismatch): give the server's public key and a trainer "
                            "key pair (zps-trainer --curve-server-key, --curve-key)");
    } else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
        snprintf(why, sizeof why, "the %s handshake failed (ZMTP protocol error 0x%x)%s",
                 c->curve ? "CURVE" : "ZMTP", val,
                 c->curve ? ": is the server key given to this client (--curve-server-key) "
                            "the server's?"
                          : "");
    } else { /* no detail: the server closed the connection; once may be chance. A plaintext
              * client never takes it as a refusal: a server killed and restarted during a
              * handshake looks the same, and must not end the trainer. */
        if (!c->curve || ++c->hs_silent[i] < 2)
            return;
        snprintf(why, sizeof why, "%s",
                 c->curve ? "the server closed the connection during the CURVE handshake, "
                            "twice: either it does not use CURVE, or its public key is not the "
                            "one given to this client (--curve-server-key)"
                          : "the server closed the connection during the handshake, twice: it "
                            "probably requires CURVE (zps-trainer --curve-server-key, "
                            "--curve-key)");
    }
    s_refuse(c, i, why);
}

/* Reads every pending handshake event of every socket (never blocks). */
static void s_handshakes(ps_client *c)
{
    for (int i = 0; i < c->n; i++)
        while (c->mons[i]) {
            zmq_msg_t ev, ep;
            zmq_msg_init(&ev);
            if (zmq_msg_recv(&ev, c->mons[i], ZMQ_DONTWAIT) == -1) {
                zmq_msg_close(&ev);
                break;
            }
            int more = zmq_msg_more(&ev);
            uint16_t id = 0;
            uint32_t val = 0;
            if (zmq_msg_size(&ev) >= 6) { /* event id (16 bits), value (32 bits), native order */
                memcpy(&id, zmq_msg_data(&ev), 2);
                memcpy(&val, (const char *)zmq_msg_data(&ev) + 2, 4);
            }
            zmq_msg_close(&ev);
            zmq_msg_init(&ep); /* the endpoint frame; a multipart message arrives whole */
            if (more)
                zmq_msg_recv(&ep, c->mons[i], ZMQ_DONTWAIT);
            zmq_msg_close(&ep);
            s_handshake_event(c, i, id, val);
        }
}

/* Resends or fails slots whose deadline passed; heartbeats quiet servers. */
static void s_timeouts(ps_client *c)
{
    uint64_t now = zps_now_ns();
    if (now - c->last_timeouts_ns < 2000000ull)
        return;
    c->last_timeouts_ns = now;
    s_handshakes(c);
    for (uint32_t i = 0; i < S_SLOTS; i++) {
        s_slot *sl = &c->slots[i];
        if (!sl->rid)
            continue;
        if (sl->resend_at_ns) {
            zps_status st = now >= sl->resend_at_ns ? s_send_slot(c, sl, NULL) : ZPS_OK;
            if (st != ZPS_OK)
                s_slot_finish(c, sl, st, s_send_err(c, sl->server, st), UINT64_MAX);
            continue;
        }
        if (now < sl->deadline_ns)
            continue;
        if (!sl->ticket) { // internal: heartbeat or re-register
            if (sl->op == ZPS__OP__OP_REGISTER) {
                s_slot_release(c, sl);
                s_reregistered(c, sl->server, ZPS_ERR_TIMEOUT, "re-register timed out");
            } else {
                s_slot_release(c, sl);
            }
            continue;
        }
        if (sl->attempts >= c->o.max_retries) {
            char m[128];
            snprintf(m, sizeof m, "no reply after %d attempts of %d ms", sl->attempts + 1,
                     c->o.timeout_ms);
            s_slot_finish(c, sl, ZPS_ERR_TIMEOUT, m, UINT64_MAX);
            continue;
        }
        sl->attempts++;
        sl->await_reg = 0;
        zps_log(ZPS_WARN, "client", "no reply from server %d to request %" PRIu64 " (attempt %d); resending",
                sl->server, sl->rid, sl->attempts);
        sl->resend_at_ns = now + (uint64_t)c->o.backoff_ms * 1000000ull * (1ull << (sl->attempts - 1));
    }
    if (c->o.heartbeat_ms > 0 && c->registered)
        for (int s = 0; s < c->n; s++)
            if (now - c->last_sent_ns[s] > (uint64_t)c->o.heartbeat_ms * 1000000ull) {
                s_slot *sl = s_slot_new(c, s, 0, ZPS__OP__OP_HEARTBEAT, 0);
                if (sl && s_send_slot(c, sl, NULL) != ZPS_OK)
                    s_slot_release(c, sl);
                else if (sl)
                    sl->deadline_ns = now + (uint64_t)c->o.heartbeat_ms * 4000000ull;
            }
}

/* One round: poll every socket (up to max_ms), handle replies and timers. */
static zps_status s_pump(ps_client *c, int max_ms)
{
    zmq_pollitem_t items[64];
    int n = c->n < 64 ? c->n : 64;
    for (int i = 0; i < n; i++)
        items[i] = (zmq_pollitem_t){c->socks[i], -1, (short)(c->socks[i] ? ZMQ_POLLIN : 0), 0};
    int rc = zmq_poll(items, n, max_ms);
    if (rc == -1 && zmq_errno() != EINTR)
        ZPS_CHECK_ZMQ(rc);
    for (int i = 0; i < c->n; i++)
        if (c->socks[i] && (i >= 64 || (items[i].revents & ZMQ_POLLIN)))
            ZPS_TRY(s_drain(c, i));
    s_timeouts(c);
    return ZPS_OK;
}

static zps_status s_wait_ticket(ps_client *c, ps_ticket t, uint64_t *version, int mark_waited)
{
    s_ticket *tk = s_ticket_get(c, t);
    if (!tk) {
        snprintf(c->err, sizeof c->err, "ticket %" PRIu64 " is unknown or expired", t);
        return ZPS_ERR_NOT_FOUND;
    }
    while (tk->open > 0) {
        int ms = c->o.heartbeat_ms > 0 && c->o.heartbeat_ms < 100 ? c->o.heartbeat_ms : 100;
        ZPS_TRY(s_pump(c, ms));
    }
    if (mark_waited)
        tk->waited = 1;
    if (version)
        *version = tk->version == UINT64_MAX ? 0 : tk->version;
    if (tk->status != ZPS_OK)
        snprintf(c->err, sizeof c->err, "%s", tk->msg);
    return tk->status;
}

zps_status ps_client_poll(ps_client *c, ps_ticket t, int timeout_ms, int *done)
{
    *done = 0;
    s_ticket *tk = s_ticket_get(c, t);
    if (!tk)
        return ZPS_ERR_NOT_FOUND;
    uint64_t end = zps_now_ns() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000ull;
    do {
        if (tk->open <= 0)
            break;
        uint64_t now = zps_now_ns();
        int ms = now >= end ? 0 : (int)((end - now) / 1000000ull);
        ZPS_TRY(s_pump(c, ms > 100 ? 100 : ms));
    } while (zps_now_ns() < end);
    *done = tk->open <= 0;
    return ZPS_OK;
}

zps_status ps_client_wait(ps_client *c, ps_ticket t) { return s_wait_ticket(c, t, NULL, 1); }

zps_status ps_client_wait_version(ps_client *c, ps_ticket t, uint64_t *version)
{
    return s_wait_ticket(c, t, version, 1);
}

zps_status ps_client_wait_all(ps_client *c)
{
    zps_status first = ZPS_OK;
    for (uint32_t i = 0; i < S_TICKETS; i++) {
        s_ticket *tk = &c->tickets[i];
        if (!tk->id || tk->waited)
            continue;
        zps_status st = s_wait_ticket(c, tk->id, NULL, 1);
        if (st != ZPS_OK && first == ZPS_OK)
            first = st;
    }
    if (first != ZPS_OK)
        for (uint32_t i = 0; i < S_TICKETS; i++)
            if (c->tickets[i].id && c->tickets[i].status == first) {
                snprintf(c->err, sizeof c->err, "%s", c->tickets[i].msg);
                break;
            }
    return first;
}

/* Sends op to the given servers (mask: all when -1) as one ticket and waits. */
static zps_status s_simple(ps_client *c, int op, int only_server, uint64_t *version,
                           int (*accept)(int status))
{
    ps_ticket t;
    ZPS_TRY(s_ticket_new(c, &t));
    s_ticket *tk = s_ticket_get(c, t);
    for (int s = 0; s < c->n; s++) {
        if (only_server >= 0 && s != only_server)
            continue;
        s_slot *sl = s_slot_new(c, s, t, op, 0);
        if (!sl)
            return ZPS_ERR_BUSY;
        tk->open++;
        zps_status sst = s_send_slot(c, sl, NULL);
        if (sst != ZPS_OK)
            s_slot_finish(c, sl, sst, s_send_err(c, s, sst), UINT64_MAX);
    }
    zps_status st = s_wait_ticket(c, t, version, 1);
    if (accept && accept(st))
        st = ZPS_OK;
    return st;
}

zps_status ps_client_register(ps_client *c, const ps_plan *plan, const ps_job *job,
                              ps_job *effective)
{
    if (plan->n_servers != c->n) {
        snprintf(c->err, sizeof c->err, "plan is for %d servers, client has %d", plan->n_servers, c->n);
        return ZPS_ERR_PLAN;
    }
    c->plan = plan;
    memset(&c->req_job, 0, sizeof c->req_job);
    if (job)
        c->req_job = *job;
    if (c->reg_job_reply)
        zps__job_config__free_unpacked(c->reg_job_reply, NULL);
    c->reg_job_reply = NULL;
    c->reg_opt_seen = c->reg_opt_conflict = 0;
    zps_status st = s_simple(c, ZPS__OP__OP_REGISTER, -1, NULL, NULL);
    if (st != ZPS_OK)
        return st;
    if (c->reg_opt_conflict) {
        snprintf(c->err, sizeof c->err, "servers hold different optimizer settings");
        return ZPS_ERR_CONFIG;
    }
    if (c->reg_job_reply) {
        c->job.mode = (ps_mode)c->reg_job_reply->mode;
        c->job.num_trainers = c->reg_job_reply->num_trainers;
        c->job.replicas_to_aggregate = c->reg_job_reply->replicas_to_aggregate;
        c->job.staleness = c->reg_job_reply->staleness;
    }
    c->registered = 1;
    if (c->o.heartbeat_thread && c->o.heartbeat_ms > 0 && !c->hb_running) {
        atomic_store(&c->hb_stop, 0);
        if (pthread_create(&c->hb_thread, NULL, s_hb_main, c) == 0)
            c->hb_running = 1;
        else
            zps_log(ZPS_WARN, "client", "cannot start the heartbeat thread");
    }
    if (effective)
        *effective = c->job;
    return ZPS_OK;
}

zps_status ps_client_init(ps_client *c, const float *values, const ps_optim_config *opt,
                          int *first)
{
    assert(c->plan && "ps_client_register first");
    char why[200];
    if (ps_optim_validate(opt, why, sizeof why) != ZPS_OK) {
        snprintf(c->err, sizeof c->err, "bad optimizer: %s", why);
        return ZPS_ERR_INVALID;
    }
    ps_ticket t;
    s_ticket *tk;
    int accepted = 0, refused = 0, empty = 0;
    zps_status st = ZPS_OK;
    /* One server at a time, so every reply's status is known per server. */
    for (int s = 0; s < c->n && st == ZPS_OK; s++) {
        ZPS_TRY(s_ticket_new(c, &t));
        tk = s_ticket_get(c, t);
        s_slot *sl = s_slot_new(c, s, t, ZPS__OP__OP_INIT, 0);
        if (!sl)
            return ZPS_ERR_BUSY;
        size_t cnt = c->plan->server_chunks[s];
        if (!cnt) { // a server the plan gives nothing has nothing to initialise
            s_slot_release(c, sl);
            tk->open = 0;
            tk->waited = 1;
            empty++;
            continue;
        }
        s_slot_pieces(sl, cnt);
        size_t k = 0;
        for (uint32_t i = 0; i < c->plan->n_chunks; i++) {
            const ps_chunk *ch = &c->plan->chunks[i];
            if (ch->server == (uint32_t)s)
                sl->pieces[k++] = (ps_piece){ch->key, ch->server, 0, ch->offset, ch->count};
        }
        sl->src = values;
        tk->open++;
        zps_status sst = s_send_slot(c, sl, opt);
        if (sst != ZPS_OK)
            s_slot_finish(c, sl, sst, s_send_err(c, s, sst), UINT64_MAX);
        st = s_wait_ticket(c, t, NULL, 1);
        if (st == ZPS_OK)
            accepted++;
        else if (st == ZPS_ERR_ALREADY_INIT) {
            refused++;
            st = ZPS_OK;
        }
    }
    if (st != ZPS_OK)
        return st;
    if (first)
        *first = accepted == c->n - empty;
    if (accepted && refused)
        zps_log(ZPS_WARN, "client", "INIT: %d servers took this trainer's values, %d already had values",
                accepted, refused);
    return ZPS_OK;
}

zps_status ps_client_barrier(ps_client *c)
{
    return s_simple(c, ZPS__OP__OP_BARRIER, 0, NULL, NULL);
}

zps_status ps_client_heartbeat(ps_client *c, uint64_t *version)
{
    return s_simple(c, ZPS__OP__OP_HEARTBEAT, -1, version, NULL);
}

zps_status ps_client_stats(ps_client *c, int server, char **json)
{
    *json = NULL;
    if (server < 0 || server >= c->n)
        return ZPS_ERR_INVALID;
    free(c->stats_json);
    c->stats_json = NULL;
    ZPS_TRY(s_simple(c, ZPS__OP__OP_STATS, server, NULL, NULL));
    *json = c->stats_json ? c->stats_json : zps_xstrdup("{}");
    c->stats_json = NULL;
    return ZPS_OK;
}

zps_status ps_client_checkpoint(ps_client *c)
{
    return s_simple(c, ZPS__OP__OP_CHECKPOINT, -1, NULL, NULL);
}

zps_status ps_client_leave(ps_client *c)
{
    s_hb_stop(c); // a heartbeat after LEAVE would not bring us back, but save the traffic
    return s_simple(c, ZPS__OP__OP_LEAVE, -1, NULL, NULL);
}

zps_status ps_client_shutdown(ps_client *c)
{
    return s_simple(c, ZPS__OP__OP_SHUTDOWN, -1, NULL, NULL);
}
