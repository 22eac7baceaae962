/* server.c — the server's lifecycle, transport and dispatch (see server.h, server_int.h for
 * the other files, docs/ps.md for the protocol).
 *
 * Invariants:
 *   - One thread: requests are handled one at a time in arrival order (what makes async
 *     mode's "applied in arrival order" and sync mode's determinism easy to state); the
 *     only other threads are zmq's and the ZAP handler's.
 *   - Every message gets a reply or waits in the pending list, which is answered by
 *     SHUTDOWN at the latest: the server never drops a request silently.
 *   - Receive memory is the reused frame array (PS_SRV_MAX_FRAMES); frames past it are
 *     dropped and the message refused whole. Reply frames of at least S_ZC_MIN bytes are
 *     sent zero-copy from the values, counted in readers[] (server_shard.c).
 *   - Every ZeroMQ failure is checked; a bad send of an error reply is logged, not fatal.
 */
#include "ps/server.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/mem.h"
#include "common/net.h"
#include "ps/server_int.h"

/* s->stop set by ps_server_stop (a signal), not by SHUTDOWN (which checkpoints itself, and
 * sets 1). */
#define S_STOP_ASKED 2

/* Reply frames at least this large are sent zero-copy from the values (ps_srv_wait_readers). */
#define S_ZC_MIN 16384

const char *const ps_srv_op_names[PS_SRV_N_OPS] = {"unknown", "register", "init", "push",
                                                   "pull", "pushpull", "barrier", "heartbeat",
                                                   "checkpoint", "stats", "shutdown", "leave",
                                                   "rollback"};
const char *const ps_srv_mode_names[4] = {"unset", "sync", "async", "ssp"};

void ps_server_config_default(ps_server_config *c)
{
    memset(c, 0, sizeof *c);
    snprintf(c->bind, sizeof c->bind, "tcp://127.0.0.1:0");
    c->staleness = -1;
    c->trainer_timeout_s = PS_DEFAULT_TRAINER_TIMEOUT_S;
    c->max_message_bytes = 1ull << 30;
    c->stats_every_s = 30;
    c->metrics_every_s = 10;
    c->io_threads = 1;
    c->apply_threads = 1;
    c->shm = 1;
}

/* ------------------------------------------------------------------------- replies */

static zps_status s_send_header(ps_server *s, const Zps__Header *h, int more)
{
    size_t n = zps__header__get_packed_size(h);
    zmq_msg_t m;
    ZPS_CHECK_ZMQ(zmq_msg_init_size(&m, n));
    zps__header__pack(h, zmq_msg_data(&m));
    if (zmq_msg_send(&m, s->sock, more ? ZMQ_SNDMORE : 0) == -1) {
        zmq_msg_close(&m);
        ZPS_CHECK_ZMQ(-1);
    }
    return ZPS_OK;
}

/* The reply's identity and header frames (more: payload frames follow; holder: the live
 * holder a refused REGISTER names, or NULL; via_shm: the values are in the shared-memory
 * segment, else the segment is offered when the asker has not mapped it). */
static zps_status s_send_head(ps_server *s, zmq_msg_t *ident, const ps_srv_reply *r, int more,
                              const ps_srv_incarnation *holder, int via_shm)
{
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__JobConfig job = ZPS__JOB_CONFIG__INIT;
    Zps__OptimizerConfig opt;
    Zps__Schedule sch;
    h.version = ZPS_PROTOCOL_VERSION;
    h.op = (Zps__Op)r->op;
    h.request_id = r->rid;
    h.is_reply = 1;
    h.status = r->status;
    h.message = (char *)(r->msg ? r->msg : "");
    h.model_version = r->version;
    h.server_index = (uint32_t)s->cfg.index;
    h.plan_hash = s->plan_hash;
    h.server_incarnation = s->incarnation;
    h.rollback_token = s->rb_token;
    h.rollback_version = s->rb_version;
    ps_shm *shm = ps_srv_shm(s);
    int offers = r->op == ZPS__OP__OP_REGISTER || r->op == ZPS__OP__OP_INIT ||
                 r->op == ZPS__OP__OP_PULL || r->op == ZPS__OP__OP_PUSHPULL;
    if (shm && via_shm) {
        h.shm_values = 1;
        h.shm_nonce = shm->hdr->nonce;
    } else if (shm && offers && r->status == ZPS_OK && r->shm_nonce != shm->hdr->nonce) {
        h.shm_nonce = shm->hdr->nonce;
        h.shm_pid = (uint32_t)getpid();
        h.shm_fd = (uint32_t)shm->fd;
        h.shm_bytes = shm->bytes;
    }
    if (r->with_job) {
        job.mode = (Zps__Mode)s->mode;
        job.num_trainers = s->n_trainers;
        job.replicas_to_aggregate = s->replicas ? s->replicas : s->n_trainers;
        job.staleness = s->staleness > 0 ? (uint32_t)s->staleness : 0;
        job.chunk_bytes = s->plan_chunk_bytes;
        job.num_servers = s->plan_servers;
        job.num_variables = s->plan_vars;
        job.total_count = s->plan_total;
        job.num_chunks = s->num_chunks;
        h.job = &job;
    }
    if (r->with_opt && s->initialised) {
        ps_optim_to_proto(&s->opt, &opt, &sch);
        h.optimizer = &opt;
    }
    Zps__Incarnation inc = ZPS__INCARNATION__INIT;
    if (holder) {
        inc.nonce = holder->nonce;
        inc.start_unix_ms = holder->start_unix_ms;
        inc.host = (char *)holder->host;
        inc.pid = holder->pid;
        h.holder = &inc;
    }
    zmq_msg_t id;
    ZPS_CHECK_ZMQ(zmq_msg_init(&id));
    ZPS_CHECK_ZMQ(zmq_msg_copy(&id, ident));
    if (zmq_msg_send(&id, s->sock, ZMQ_SNDMORE) == -1) {
        zmq_msg_close(&id);
        ZPS_CHECK_ZMQ(-1);
    }
    return s_send_header(s, &h, more);
}

/* Header.packed: the ranges' values back to back in one frame. One copy, but one frame
 * instead of dozens: each costs a send and a receive system call and I/O-thread wake-ups on
 * both ends, far more than copying its bytes (docs/ps.md "Packed payloads"). */
static zps_status s_send_packed(ps_server *s, const ps_srv_range *ranges, uint32_t n_ranges,
                                size_t total)
{
    zmq_msg_t m;
    ZPS_CHECK_ZMQ(zmq_msg_init_size(&m, total));
    char *dst = zmq_msg_data(&m);
    for (uint32_t i = 0; i < n_ranges; i++) {
        const ps_srv_range *g = &ranges[i];
        memcpy(dst, s->values + s->chunks[g->lc].off + g->off, g->n * 4);
        dst += g->n * 4;
    }
    if (zmq_msg_send(&m, s->sock, 0) == -1) {
        zmq_msg_close(&m);
        ZPS_CHECK_ZMQ(-1);
    }
    return ZPS_OK;
}

/* One payload frame per range (or one for all, packed), from the current values. */
static zps_status s_send_values(ps_server *s, const ps_srv_range *ranges, uint32_t n_ranges,
                                int packed)
{
    size_t total = 0;
    for (uint32_t i = 0; i < n_ranges; i++)
        total += ranges[i].n * 4;
    s->st.bytes_out += total;
    s->st.pulls += n_ranges;
    if (packed)
        return s_send_packed(s, ranges, n_ranges, total);
    for (uint32_t i = 0; i < n_ranges; i++) {
        const ps_srv_range *g = &ranges[i];
        const float *src = s->values + s->chunks[g->lc].off + g->off;
        size_t nb = g->n * 4;
        zmq_msg_t m;
        if (nb >= S_ZC_MIN) {
            /* Zero-copy from the values; ps_srv_wait_readers holds updates of this chunk
             * back until zmq has sent them. */
            atomic_fetch_add(&s->readers[g->lc], 1);
            if (zmq_msg_init_data(&m, (void *)src, nb, ps_srv_reader_done, &s->readers[g->lc]) == -1) {
                atomic_fetch_sub(&s->readers[g->lc], 1);
                ZPS_CHECK_ZMQ(-1);
            }
        } else {
            ZPS_CHECK_ZMQ(zmq_msg_init_size(&m, nb));
            memcpy(zmq_msg_data(&m), src, nb);
        }
        if (zmq_msg_send(&m, s->sock, i + 1 < n_ranges ? ZMQ_SNDMORE : 0) == -1) {
            zmq_msg_close(&m);
            ZPS_CHECK_ZMQ(-1);
        }
    }
    return ZPS_OK;
}

zps_status ps_srv_send(ps_server *s, zmq_msg_t *ident, const ps_srv_reply *r,
                       const ps_srv_range *ranges, uint32_t n_ranges)
{
    ps_shm *shm = ps_srv_shm(s);
    int via_shm = shm && n_ranges && r->shm_nonce == shm->hdr->nonce;
    ZPS_TRY(s_send_head(s, ident, r, n_ranges > 0 && !via_shm, NULL, via_shm));
    if (!n_ranges)
        return ZPS_OK;
    if (via_shm) { /* the asker copies them from the segment (ps_shm_read) */
        for (uint32_t i = 0; i < n_ranges; i++)
            s->st.bytes_out += ranges[i].n * 4;
        s->st.pulls += n_ranges;
        s->st.shm_pulls += n_ranges;
        return ZPS_OK;
    }
    return s_send_values(s, ranges, n_ranges, r->packed);
}

static void s_reject(ps_server *s, zmq_msg_t *ident, int op, uint64_t rid, zps_status st,
                     const char *why, const ps_srv_incarnation *holder)
{
    int idx = -(int)st;
    if (idx > 0 && idx < ZPS_STATUS_COUNT)
        s->st.rejected[idx]++;
    s->st.rejected_total++;
    zps_log(ZPS_DEBUG, "ps", "rejected %s request %" PRIu64 ": %s: %s",
            (op >= 0 && op < PS_SRV_N_OPS) ? ps_srv_op_names[op] : "?", rid, zps_status_name(st), why);
    ps_srv_reply r = {op, rid, st, why, ps_srv_min_version(s), 0, 0, 0, 0};
    if (s_send_head(s, ident, &r, 0, holder, 0) != ZPS_OK)
        zps_log(ZPS_WARN, "ps", "could not send an error reply");
}

void ps_srv_reject(ps_server *s, zmq_msg_t *ident, int op, uint64_t rid, zps_status st,
                   const char *why)
{
    s_reject(s, ident, op, rid, st, why, NULL);
}

void ps_srv_reject_held(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, const char *why)
{
    s_reject(s, ident, h->op, h->request_id, ZPS_ERR_EXISTS, why, &s->trainers[h->trainer_id].inc);
}

/* ------------------------------------------------------------------------- dispatch */

/* One received message: frames[0] identity, frames[1] header, frames[2..] payload. */
static void s_handle(ps_server *s, int nframes, int overflow, uint64_t bytes, uint64_t t0)
{
    zmq_msg_t *ident = &s->frames[0];
    Zps__Header *h;
    int op;
    char why[256];
    zps_status st = ps_srv_check_message(s, nframes, overflow, bytes, &h, &op, why, sizeof why);
    if (st != ZPS_OK) {
        ps_srv_reject(s, ident, op, h ? h->request_id : 0, st, why);
    } else {
        s->st.requests[op]++;
        s->req_packed = h->packed;
        s->req_op = op;
        s->req_shm_nonce = h->shm_nonce;
        switch (op) {
        case ZPS__OP__OP_REGISTER:
            ps_srv_op_register(s, ident, h);
            ps_srv_latency(s, op, t0);
            break;
        case ZPS__OP__OP_INIT:
            ps_srv_op_init(s, ident, h, nframes);
            ps_srv_latency(s, op, t0);
            break;
        case ZPS__OP__OP_PUSH:
        case ZPS__OP__OP_PUSHPULL:
            ps_srv_op_push(s, ident, h, nframes, t0);
            break;
        case ZPS__OP__OP_PULL:
            ps_srv_op_pull(s, ident, h, nframes, t0);
            break;
        default:
            ps_srv_op_simple(s, ident, h, t0);
        }
    }
    if (h)
        zps__header__free_unpacked(h, NULL);
}

/* ------------------------------------------------------------------------- loop */

static void s_timers(ps_server *s)
{
    double now = zps_now_s();
    if (s->retired)
        ps_srv_reap_retired(s, 0);
    if (now - s->last_liveness_s >= 0.05) {
        s->last_liveness_s = now;
        ps_srv_liveness(s);
    }
    if (s->cfg.checkpoint_every_seconds > 0 && s->initialised &&
        now - s->last_ckpt_s >= s->cfg.checkpoint_every_seconds)
        ps_srv_write_checkpoint(s, 0);
    ps_srv_admin_tick(s);
    if (s->cfg.stats_every_s > 0 && now - s->last_stats_s >= s->cfg.stats_every_s) {
        s->last_stats_s = now;
        ps_srv_stats_log(s);
    }
    ps_srv_metrics_tick(s, now);
}

/* Receives one whole message (all parts) into s->frames. */
static zps_status s_recv(ps_server *s, int *nframes, int *overflow, uint64_t *bytes)
{
    int n = 0, more = 1;
    *overflow = 0;
    *bytes = 0;
    while (more) {
        zmq_msg_t *m = &s->frames[n < PS_SRV_MAX_FRAMES ? n : PS_SRV_MAX_FRAMES - 1];
        if (n >= PS_SRV_MAX_FRAMES) {
            zmq_msg_close(m);
            *overflow = 1;
        }
        zmq_msg_init(m);
        if (zmq_msg_recv(m, s->sock, 0) == -1) {
            int e = zmq_errno();
            zmq_msg_close(m);
            for (int i = 0; i < n && i < PS_SRV_MAX_FRAMES - 1; i++)
                zmq_msg_close(&s->frames[i]);
            if (e == EINTR)
                return ZPS_ERR_INTERRUPTED;
            zps_log(ZPS_ERROR, "zmq", "zmq_msg_recv: %s", zmq_strerror(e));
            return e == ETERM ? ZPS_ERR_SHUTDOWN : ZPS_ERR_ZMQ;
        }
        *bytes += zmq_msg_size(m);
        more = zmq_msg_more(m);
        if (n < PS_SRV_MAX_FRAMES)
            n++;
    }
    *nframes = n;
    return ZPS_OK;
}

zps_status ps_server_run_once(ps_server *s, int timeout_ms, int *handled)
{
    *handled = 0;
    zmq_pollitem_t it = {s->sock, 0, ZMQ_POLLIN, 0};
    int rc = zmq_poll(&it, 1, timeout_ms);
    if (rc == -1 && zmq_errno() != EINTR)
        ZPS_CHECK_ZMQ(rc);
    if (rc > 0) {
        int nframes, overflow;
        uint64_t bytes, t0 = zps_now_ns();
        ZPS_TRY(s_recv(s, &nframes, &overflow, &bytes));
        s_handle(s, nframes, overflow, bytes, t0);
        for (int i = 0; i < nframes; i++)
            zmq_msg_close(&s->frames[i]);
        *handled = 1;
    }
    s_timers(s);
    return ZPS_OK;
}

static zps_status s_run(ps_server *s)
{
    zmq_pollitem_t it = {s->sock, 0, ZMQ_POLLIN, 0};
    while (!s->stop) {
        int rc = zmq_poll(&it, 1, 50);
        if (rc == -1) {
            if (zmq_errno() == EINTR)
                continue;
            ZPS_CHECK_ZMQ(rc);
        }
        for (int burst = 0; rc > 0 && burst < 64 && !s->stop; burst++) {
            int ev = 0;
            size_t evl = sizeof ev;
            ZPS_CHECK_ZMQ(zmq_getsockopt(s->sock, ZMQ_EVENTS, &ev, &evl));
            if (!(ev & ZMQ_POLLIN))
                break;
            int nframes, overflow;
            uint64_t bytes;
            uint64_t t0 = zps_now_ns();
            zps_status st = s_recv(s, &nframes, &overflow, &bytes);
            if (st == ZPS_ERR_INTERRUPTED)
                break;
            ZPS_TRY(st);
            s_handle(s, nframes, overflow, bytes, t0);
            for (int i = 0; i < nframes; i++)
                zmq_msg_close(&s->frames[i]);
        }
        s_timers(s);
    }
    /* Pending requests get an answer rather than a silent drop. */
    while (s->n_pending) {
        ps_srv_pending *p = &s->pending[0];
        ps_srv_reply r = {p->op, p->rid, ZPS_ERR_SHUTDOWN, "server shutting down", ps_srv_min_version(s), 0, 0, 0, 0};
        ps_srv_send(s, &p->ident, &r, NULL, 0);
        ps_srv_pending_drop(s, 0);
    }
    /* Stopped from outside (a signal): the final checkpoint SHUTDOWN would have written, so
     * a launcher's SIGTERM loses nothing (a no-op without --checkpoint-dir). */
    if (s->stop == S_STOP_ASKED) {
        zps_log(ZPS_INFO, "ps", "stopping%s", !s->cfg.checkpoint_dir[0] ? " (no --checkpoint-dir)"
                                              : s->initialised ? ": final checkpoint"
                                                               : " (no values to checkpoint)");
        return ps_srv_write_checkpoint(s, 0);
    }
    return ZPS_OK;
}

zps_status ps_server_run(ps_server *s)
{
    zps_status st = s_run(s);
    ps_srv_metrics_close(s, st != ZPS_OK                ? "error"
                            : s->stop == S_STOP_ASKED ? "signal"
                                                      : "shutdown");
    return st;
}

void ps_server_stop(ps_server *s) { s->stop = S_STOP_ASKED; }

const char *ps_server_endpoint(const ps_server *s) { return s->endpoint; }

/* ------------------------------------------------------------------------- lifecycle */

/* CURVE server mode on s->sock (before bind): the key pair, then the ZAP handler that
 * admits the allow-list's keys. Every key file problem is logged with the file's name. */
static zps_status s_setup_curve(ps_server *s)
{
    const ps_server_config *cfg = &s->cfg;
    char why[768], pub[PS_CURVE_KEY_LEN + 1], sec[PS_CURVE_KEY_LEN + 1];
    if (!zmq_has("curve")) {
        zps_log(ZPS_ERROR, "ps", "--curve-key: this libzmq has no CURVE support");
        return ZPS_ERR_UNSUPPORTED;
    }
    ps_curve_allow *allow = NULL;
    zps_status st = ZPS_OK;
    if (!cfg->curve_allow_any)
        st = ps_curve_allow_load(cfg->curve_allow, &allow, why, sizeof why);
    if (st == ZPS_OK)
        st = ps_curve_load_keypair(cfg->curve_key, pub, sec, why, sizeof why);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "ps", "%s", why);
        ps_curve_allow_destroy(&allow);
        return st;
    }
    int one = 1;
    int rc = zmq_setsockopt(s->sock, ZMQ_CURVE_SERVER, &one, sizeof one);
    if (rc != -1)
        rc = zmq_setsockopt(s->sock, ZMQ_CURVE_SECRETKEY, sec, PS_CURVE_KEY_LEN + 1);
    if (rc != -1)
        rc = zmq_setsockopt(s->sock, ZMQ_ZAP_DOMAIN, "zps", 3);
    explicit_bzero(sec, sizeof sec);
    if (rc == -1) {
        zps_log(ZPS_ERROR, "ps", "CURVE socket options: %s", zmq_strerror(zmq_errno()));
        ps_curve_allow_destroy(&allow);
        return ZPS_ERR_ZMQ;
    }
    size_t n_allow = ps_curve_allow_count(allow), n_bound = ps_curve_allow_bound(allow);
    size_t n_admin = ps_curve_allow_admins(allow);
    ZPS_TRY(ps_curve_zap_new(s->ctx, s->sock, &allow, &s->zap));
    if (cfg->curve_allow_any)
        zps_log(ZPS_WARN, "ps", "CURVE on (server key %.8s...) with --curve-allow-any: traffic is "
                "encrypted but any client key is admitted", pub);
    else
        zps_log(ZPS_INFO, "ps", "CURVE on (server key %.8s...): %zu trainer key(s) allowed from %s, "
                "%zu of them bound to one trainer id; %zu admin key(s)", pub, n_allow - n_admin,
                cfg->curve_allow, n_bound, n_admin);
    return ZPS_OK;
}

/* Flags that contradict each other (logged). */
static zps_status s_check_config(const ps_server_config *cfg)
{
    if (cfg->replicas_to_aggregate && cfg->num_trainers &&
        cfg->replicas_to_aggregate > cfg->num_trainers) {
        zps_log(ZPS_ERROR, "ps", "--replicas-to-aggregate %u exceeds --num-trainers %u",
                cfg->replicas_to_aggregate, cfg->num_trainers);
        return ZPS_ERR_INVALID;
    }
    if ((cfg->restore || cfg->checkpoint_every_seconds > 0 || cfg->checkpoint_every_versions) &&
        !cfg->checkpoint_dir[0]) {
        zps_log(ZPS_ERROR, "ps", "--restore and --checkpoint-every-* need --checkpoint-dir");
        return ZPS_ERR_INVALID;
    }
    /* a checkpoint directory that cannot be written would fail only at the first
     * checkpoint, minutes or hours into the job: find out now */
    if (cfg->checkpoint_dir[0] &&
        ((mkdir(cfg->checkpoint_dir, 0755) == -1 && errno != EEXIST) ||
         access(cfg->checkpoint_dir, W_OK | X_OK) == -1)) {
        zps_log(ZPS_ERROR, "ps", "--checkpoint-dir %s: cannot create or write it: %s",
                cfg->checkpoint_dir, strerror(errno));
        return ZPS_ERR_IO;
    }
    int allow_flags = (cfg->curve_allow[0] != 0) + (cfg->curve_allow_any != 0);
    if (cfg->curve_key[0] && allow_flags != 1) {
        zps_log(ZPS_ERROR, "ps", "--curve-key needs exactly one of --curve-allow FILE and "
                "--curve-allow-any");
        return ZPS_ERR_INVALID;
    }
    if (!cfg->curve_key[0] && allow_flags) {
        zps_log(ZPS_ERROR, "ps", "--curve-allow and --curve-allow-any need --curve-key FILE");
        return ZPS_ERR_INVALID;
    }
    return ZPS_OK;
}

/* The context and the ROUTER socket, CURVE when asked, bound; s->endpoint the address. */
static zps_status s_open_socket(ps_server *s)
{
    const ps_server_config *cfg = &s->cfg;
    s->ctx = zmq_ctx_new();
    ZPS_CHECK_PTR(s->ctx, ZPS_ERR_ZMQ);
    ZPS_CHECK_ZMQ(zmq_ctx_set(s->ctx, ZMQ_IO_THREADS, cfg->io_threads > 0 ? cfg->io_threads : 1));
    s->sock = zmq_socket(s->ctx, ZMQ_ROUTER);
    ZPS_CHECK_PTR(s->sock, ZPS_ERR_ZMQ);
    int zero = 0, linger = 2000;
    int64_t maxmsg = (int64_t)(cfg->max_message_bytes + ZPS_HEADER_MAX_BYTES);
    if (cfg->curve_key[0])
        ZPS_TRY(s_setup_curve(s));
    if (zmq_setsockopt(s->sock, ZMQ_SNDHWM, &zero, sizeof zero) == -1 ||
        zmq_setsockopt(s->sock, ZMQ_RCVHWM, &zero, sizeof zero) == -1 ||
        zmq_setsockopt(s->sock, ZMQ_LINGER, &linger, sizeof linger) == -1 ||
        zmq_setsockopt(s->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) == -1) {
        zps_log(ZPS_ERROR, "ps", "socket options: %s", zmq_strerror(zmq_errno()));
        return ZPS_ERR_ZMQ;
    }
    /* a name is resolved and its addresses tried in order (common/net.h), so the endpoint
     * below, and the loopback judgement made on it, is the numeric address bound */
    ZPS_TRY(zps_net_bind(s->sock, cfg->bind, "server"));
    size_t el = sizeof s->endpoint;
    ZPS_CHECK_ZMQ(zmq_getsockopt(s->sock, ZMQ_LAST_ENDPOINT, s->endpoint, &el));
    return ZPS_OK;
}

/* A random non-zero 64-bit number, different for every process start. */
static uint64_t s_incarnation(void)
{
    uint64_t x = 0;
    if (getrandom(&x, sizeof x, 0) != (ssize_t)sizeof x)
        x = zps_now_ns() ^ ((uint64_t)getpid() << 32);
    return x ? x : 1;
}

zps_status ps_server_new(const ps_server_config *cfg, ps_server **out)
{
    *out = NULL;
    ZPS_TRY(s_check_config(cfg));
    ps_server *s = zps_xcalloc(1, sizeof *s);
    s->cfg = *cfg;
    s->mode = cfg->mode;
    s->n_trainers = cfg->num_trainers > PS_MAX_TRAINERS ? PS_MAX_TRAINERS : cfg->num_trainers;
    s->replicas = cfg->replicas_to_aggregate;
    s->staleness = cfg->staleness;
    s->frames = zps_xcalloc(PS_SRV_MAX_FRAMES, sizeof *s->frames);
    s->ranges = zps_xcalloc(PS_MAX_RANGES, sizeof *s->ranges);
    s->incarnation = s_incarnation();
    double now = zps_now_s();
    s->last_ckpt_s = s->last_stats_s = s->last_liveness_s = now;
    zps_status st = ps_apply_pool_new(cfg->apply_threads > 0 ? cfg->apply_threads : 1,
                                      &s->apply);
    if (st == ZPS_OK)
        st = s_open_socket(s);
    if (st == ZPS_OK && cfg->restore)
        st = ps_srv_restore(s);
    if (st == ZPS_OK)
        st = ps_srv_metrics_open(s);
    if (st != ZPS_OK) {
        ps_server_destroy(&s);
        return st;
    }
    ps_srv_trainers_ensure(s);
    *out = s;
    return ZPS_OK;
}

void ps_server_destroy(ps_server **ps)
{
    if (!ps || !*ps)
        return;
    ps_server *s = *ps;
    ps_srv_metrics_close(s, "closed"); /* an end record when ps_server_run wrote none */
    while (s->n_pending)
        ps_srv_pending_drop(s, 0);
    free(s->pending);
    if (s->sock)
        zmq_close(s->sock);
    ps_curve_zap_destroy(&s->zap); // its sockets must be closed before the context ends
    zps_net_ctx_end(s->ctx, "server"); // returns once zmq released every zero-copy reply frame
    ps_srv_shard_free(s);
    ps_srv_reap_retired(s, 1); // zmq_ctx_term above released every frame
    ps_srv_shm_free_old(s);
    ps_apply_pool_destroy(&s->apply);
    free(s->trainers);
    free(s->frames);
    free(s->ranges);
    free(s);
    *ps = NULL;
}
