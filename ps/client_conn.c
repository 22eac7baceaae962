/* client_conn.c — the PS client's transport (ps-lite's "van"): one DEALER per server with
 * opts.streams TCP connections, CURVE on every socket when keys are set, a slot's request
 * encoded onto the wire, replies received and handed to request tracking, handshake
 * verdicts, the optional heartbeat thread, and the poll round that drives the client.
 *
 * Invariants:
 * - With keys set, every socket the client opens is a CURVE client: the DEALERs, the ones
 *   reopened after a failure, and the heartbeat thread's own (sockets are never shared
 *   across threads).
 * - A push frame of S_ZC_MIN bytes or more points into the caller's buffer (or the slot's
 *   bf16 wire buffer) and is counted in the slot's frames_out until ZeroMQ releases it;
 *   smaller frames are copied.
 * - A monitor's reader is connected before its DEALER connects, so no handshake verdict is
 *   lost; a socket and its monitor are opened and closed together.
 * - Handshakes: each DEALER's monitor reader (mons[i]) is read without blocking by
 *   ps_client_handshakes (from the timers, at most every 2 ms while the client is driven).
 *   It only carries handshake verdicts, which happen once per connection, so plaintext
 *   traffic costs nothing more; a refusal fails every request to that server with
 *   ZPS_ERR_UNAUTHORIZED (s_refuse) instead of leaving it to the 30 s timeout, and later
 *   sends to it fail at once until a handshake succeeds.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/mem.h"
#include "common/net.h"
#include "ps/client_int.h"
#include "ps/curve.h"

/* Push frames smaller than this are copied (cheaper than a zero-copy message). */
#define S_ZC_MIN 16384
/* Handshake events the client watches on each DEALER. */
#define S_HS_EVENTS                                                                    \
    (ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |            \
     ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |           \
     ZMQ_EVENT_DISCONNECTED)
/* Fast failover (docs/ps.md "Recovery"): ZMTP heartbeats find a silent peer within
 * S_HB_TIMEOUT_MS, and a dropped connection is retried at least every S_RECONNECT_MAX_MS,
 * so a server that is back is found within about a second. */
#define S_HB_IVL_MS 500
#define S_HB_TIMEOUT_MS 1500
#define S_RECONNECT_MAX_MS 250

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

/* ------------------------------------------------------------------------- heartbeat thread */

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
        if (s_curve_sockopts(c, socks[i]) == -1 ||
            zps_net_connect(socks[i], c->uris[i], "server", 1) != ZPS_OK) {
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
            ps_client_header_ident(c, &h, ZPS__OP__OP_HEARTBEAT);
            h.request_id = rid++;
            uint8_t buf[128];
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

void ps_client_hb_start(ps_client *c)
{
    if (!c->o.heartbeat_thread || c->o.heartbeat_ms <= 0 || c->hb_running)
        return;
    atomic_store(&c->hb_stop, 0);
    if (pthread_create(&c->hb_thread, NULL, s_hb_main, c) == 0)
        c->hb_running = 1;
    else
        zps_log(ZPS_WARN, "client", "cannot start the heartbeat thread");
}

void ps_client_hb_stop(ps_client *c)
{
    if (!c->hb_running)
        return;
    atomic_store(&c->hb_stop, 1);
    pthread_join(c->hb_thread, NULL);
    c->hb_running = 0;
}

/* ------------------------------------------------------------------------- sockets */

zps_status ps_client_open_socket(ps_client *c, int i)
{
    void *s = zmq_socket(c->ctx, ZMQ_DEALER);
    ZPS_CHECK_PTR(s, ZPS_ERR_ZMQ);
    void *mon = NULL;
    char mon_ep[96];
    snprintf(mon_ep, sizeof mon_ep, "inproc://zps-client-monitor-%p-%d-%u", (void *)c, i,
             c->mon_gen++);
    int zero = 0, linger = 1000, ivl = 100, ivlmax = S_RECONNECT_MAX_MS;
    int hb_ivl = S_HB_IVL_MS, hb_timeout = S_HB_TIMEOUT_MS, hb_ttl = 2 * S_HB_TIMEOUT_MS;
    zps_status st = ZPS_OK;
    if (zmq_setsockopt(s, ZMQ_SNDHWM, &zero, sizeof zero) == -1 ||
        zmq_setsockopt(s, ZMQ_HEARTBEAT_IVL, &hb_ivl, sizeof hb_ivl) == -1 ||
        zmq_setsockopt(s, ZMQ_HEARTBEAT_TIMEOUT, &hb_timeout, sizeof hb_timeout) == -1 ||
        zmq_setsockopt(s, ZMQ_HEARTBEAT_TTL, &hb_ttl, sizeof hb_ttl) == -1 ||
        zmq_setsockopt(s, ZMQ_RCVHWM, &zero, sizeof zero) == -1 ||
        zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger) == -1 ||
        zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl) == -1 ||
        zmq_setsockopt(s, ZMQ_RECONNECT_IVL_MAX, &ivlmax, sizeof ivlmax) == -1 ||
        s_curve_sockopts(c, s) == -1 || zmq_socket_monitor(s, mon_ep, S_HS_EVENTS) == -1 ||
        !(mon = zmq_socket(c->ctx, ZMQ_PAIR)) ||
        zmq_setsockopt(mon, ZMQ_LINGER, &zero, sizeof zero) == -1 ||
        zmq_connect(mon, mon_ep) == -1) {
        zps_log(ZPS_ERROR, "client", "cannot connect to %s: %s", c->uris[i],
                zmq_strerror(zmq_errno()));
        st = ZPS_ERR_ZMQ;
    }
    /* one TCP connection per stream, to the server's resolved address (common/net.h: a
     * name, or an IPv6 address with ZMQ_IPV6); resolved at each open, not at ZeroMQ's
     * reconnects, which keep that address */
    if (st == ZPS_OK)
        st = zps_net_connect(s, c->uris[i], "server", c->o.streams);
    if (st != ZPS_OK) {
        if (mon)
            zmq_close(mon);
        zmq_close(s);
        return st;
    }
    c->socks[i] = s;
    c->mons[i] = mon;
    c->hs_silent[i] = 0;
    return ZPS_OK;
}

void ps_client_close_socket(ps_client *c, int i)
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

/* ------------------------------------------------------------------------- sending */

static void s_frame_done(void *data, void *hint)
{
    (void)data;
    ps_client_slot *sl = hint;
    atomic_fetch_sub(&sl->frames_out, 1);
}

void ps_client_header_ident(ps_client *c, Zps__Header *h, int op)
{
    h->version = ZPS_PROTOCOL_VERSION;
    h->op = (Zps__Op)op;
    h->trainer_id = c->trainer;
    h->incarnation = op == ZPS__OP__OP_REGISTER ? &c->inc : &c->inc_nonce;
    if (op == ZPS__OP__OP_REGISTER)
        h->dead_holder = c->dead_holder;
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

/* The values of the slot's pieces, all together. */
static size_t s_slot_floats(const ps_client_slot *sl)
{
    size_t total = 0;
    for (size_t i = 0; i < sl->n_pieces; i++)
        total += sl->pieces[i].count;
    return total;
}

/* The slot's gradients back to back, once per use of the slot: rounded into its wire buffer
 * (push_dtype bf16) or copied into its pack buffer (packed f32). The buffers are the slot's
 * and only grow, so the per-message path allocates nothing; zero-copy frames point into
 * them, and a slot is recycled only once ZeroMQ let go of them. */
static void s_slot_gather(ps_client_slot *sl, ps_dtype dt)
{
    size_t total = s_slot_floats(sl), off = 0;
    int bf16 = dt == PS_DTYPE_BF16;
    if (bf16 && total > sl->cap_wire) {
        sl->cap_wire = total;
        sl->wire = zps_xrealloc(sl->wire, total * sizeof *sl->wire);
    }
    if (!bf16 && total > sl->cap_pack) {
        sl->cap_pack = total;
        sl->pack = zps_xrealloc(sl->pack, total * sizeof *sl->pack);
    }
    for (size_t i = 0; i < sl->n_pieces; i++) {
        const float *src = sl->src ? sl->src + sl->pieces[i].flat_offset : NULL;
        if (bf16 && sl->src16)
            memcpy(sl->wire + off, sl->src16 + sl->pieces[i].flat_offset,
                   sl->pieces[i].count * 2);
        else if (bf16)
            ps_f32_to_bf16(sl->wire + off, src, sl->pieces[i].count);
        else
            memcpy(sl->pack + off, src, sl->pieces[i].count * 4);
        off += sl->pieces[i].count;
    }
    if (bf16)
        sl->wire_ready = 1;
    else
        sl->pack_ready = 1;
}

/* The header's ranges: one per piece of sl, lengths in bytes of dt (c's scratch, reused). */
static void s_fill_ranges(ps_client *c, const ps_client_slot *sl, ps_dtype dt, Zps__Header *h)
{
    if (!sl->n_pieces)
        return;
    if (sl->n_pieces > c->cap_kr) {
        c->cap_kr = sl->n_pieces;
        c->kr = zps_xrealloc(c->kr, c->cap_kr * sizeof *c->kr);
        c->krp = zps_xrealloc(c->krp, c->cap_kr * sizeof *c->krp);
    }
    for (size_t i = 0; i < sl->n_pieces; i++) {
        Zps__KeyRange *r = &c->kr[i];
        zps__key_range__init(r);
        r->key = sl->pieces[i].key;
        r->offset = sl->pieces[i].chunk_offset;
        r->length = sl->pieces[i].count * ps_dtype_size(dt);
        r->dtype = dt == PS_DTYPE_BF16 ? ZPS__DTYPE__DTYPE_BF16 : ZPS__DTYPE__DTYPE_F32;
        c->krp[i] = r;
    }
    h->n_ranges = sl->n_pieces;
    h->ranges = c->krp;
}

/* One frame of nb bytes at p, zero-copy from S_ZC_MIN bytes on (counted in frames_out). */
static zps_status s_send_frame(ps_client_slot *sl, void *sock, const void *p, size_t nb, int more)
{
    zmq_msg_t m;
    if (nb >= S_ZC_MIN) {
        atomic_fetch_add(&sl->frames_out, 1);
        if (zmq_msg_init_data(&m, (void *)p, nb, s_frame_done, sl) == -1) {
            atomic_fetch_sub(&sl->frames_out, 1);
            return ZPS_ERR_ZMQ;
        }
    } else if (zmq_msg_init_size(&m, nb) == -1) {
        return ZPS_ERR_ZMQ;
    } else {
        memcpy(zmq_msg_data(&m), p, nb);
    }
    if (zmq_msg_send(&m, sock, more) == -1) {
        zmq_msg_close(&m);
        return ZPS_ERR_ZMQ;
    }
    return ZPS_OK;
}

/* Packed: the whole payload in one frame, from the slot's bf16 wire or f32 pack buffer. */
static zps_status s_send_packed(ps_client_slot *sl, void *sock, ps_dtype dt)
{
    if (dt == PS_DTYPE_BF16 ? !sl->wire_ready : !sl->pack_ready)
        s_slot_gather(sl, dt);
    const void *p = dt == PS_DTYPE_BF16 ? (const void *)sl->wire : (const void *)sl->pack;
    return s_send_frame(sl, sock, p, s_slot_floats(sl) * ps_dtype_size(dt), 0);
}

/* One data frame per piece of sl after its header (or one for all, packed): dt's bytes from
 * the caller's buffer (f32, or bf16 already) or the slot's bf16 wire buffer, zero-copy from
 * S_ZC_MIN bytes on. */
static zps_status s_send_data(ps_client_slot *sl, void *sock, ps_dtype dt)
{
    if (sl->packed)
        return s_send_packed(sl, sock, dt);
    int convert = dt == PS_DTYPE_BF16 && !sl->src16;
    if (convert && !sl->wire_ready)
        s_slot_gather(sl, dt);
    size_t woff = 0; // into sl->wire
    for (size_t i = 0; i < sl->n_pieces; i++) {
        size_t cnt = sl->pieces[i].count, nb = cnt * ps_dtype_size(dt);
        size_t at = sl->pieces[i].flat_offset;
        const void *p = convert ? (const void *)(sl->wire + woff)
                        : sl->src16 ? (const void *)(sl->src16 + at)
                                    : (const void *)(sl->src + at);
        woff += cnt;
        ZPS_TRY(s_send_frame(sl, sock, p, nb, i + 1 < sl->n_pieces ? ZMQ_SNDMORE : 0));
    }
    return ZPS_OK;
}

zps_status ps_client_send_slot(ps_client *c, ps_client_slot *sl, const ps_optim_config *opt)
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
    ps_client_header_ident(c, &h, sl->op);
    h.request_id = sl->rid;
    h.step = sl->step;
    if (sl->op == ZPS__OP__OP_CHECKPOINT || sl->op == ZPS__OP__OP_SHUTDOWN) {
        /* step: the cut's version, -1 for none */
        h.cut = sl->step >= 0;
        h.cut_version = sl->step >= 0 ? (uint64_t)sl->step : 0;
    }
    h.rollback_token = sl->token;
    h.server_index = (uint32_t)sl->server;
    h.plan_hash = c->plan ? c->plan->hash : 0;
    h.packed = sl->packed;
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
    int has_data = (sl->src != NULL || sl->src16 != NULL) && sl->n_pieces > 0;
    if (!sl->no_shm)
        h.shm_nonce = ps_client_shm_nonce(c, sl->server);
    if (has_data && h.shm_nonce && ps_client_shm_stage(c, sl)) {
        h.shm_data = 1; // the gradients are in our slot of its segment: no payload frames
        h.packed = 0;
        has_data = 0;
        dt = PS_DTYPE_F32; // the segment holds f32, bf16 pushes already rounded (client_shm.c)
    }
    s_fill_ranges(c, sl, dt, &h);
    size_t hl = zps__header__get_packed_size(&h);
    zmq_msg_t m;
    if (zmq_msg_init_size(&m, hl) == -1)
        return ZPS_ERR_ZMQ;
    zps__header__pack(&h, zmq_msg_data(&m));
    if (zmq_msg_send(&m, sock, has_data ? ZMQ_SNDMORE : 0) == -1) {
        zmq_msg_close(&m);
        zps_log(ZPS_ERROR, "client", "send to %s: %s", c->uris[sl->server], zmq_strerror(zmq_errno()));
        return ZPS_ERR_ZMQ;
    }
    if (has_data)
        ZPS_TRY(s_send_data(sl, sock, dt));
    c->last_sent_ns[sl->server] = zps_now_ns();
    sl->deadline_ns = zps_now_ns() + (uint64_t)c->o.timeout_ms * 1000000ull;
    sl->resend_at_ns = 0;
    return ZPS_OK;
}

const char *ps_client_send_err(const ps_client *c, int server, zps_status st)
{
    return st == ZPS_ERR_UNAUTHORIZED ? c->refused[server] : "send failed";
}

/* ------------------------------------------------------------------------- receiving */

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
        ps_client_handle_reply(c, server, n);
        for (int i = 0; i < n; i++)
            zmq_msg_close(&c->frames[i]);
    }
}

zps_status ps_client_pump(ps_client *c, int max_ms)
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
    ps_client_timeouts(c);
    return ZPS_OK;
}

/* ------------------------------------------------------------------------- handshakes */

/* Server refused our handshake: every request to it fails now, and so will later ones
 * until a handshake succeeds (libzmq does not reconnect after a ZAP refusal). */
static void s_refuse(ps_client *c, int server, const char *why)
{
    if (!c->refused[server][0])
        zps_log(ZPS_ERROR, "client", "server %d (%s): %s", server, c->uris[server], why);
    snprintf(c->refused[server], sizeof c->refused[server], "%s", why);
    ps_client_fail_server(c, server);
}

/* Why a handshake that failed with ZMTP protocol error val was refused, into why. */
static void s_protocol_refusal(const ps_client *c, uint32_t val, char *why, size_t len)
{
    if (val == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        snprintf(why, len, "%s",
                 c->curve ? "the server does not use CURVE but this client does (security "
                            "mechanism mismatch): start the server with --curve-key, or "
                            "connect without keys"
                          : "the server requires CURVE and this client has no keys (security "
                            "mechanism mismatch): give the server's public key and a trainer "
                            "key pair (zps-trainer --curve-server-key, --curve-key)");
    else
        snprintf(why, len, "the %s handshake failed (ZMTP protocol error 0x%x)%s",
                 c->curve ? "CURVE" : "ZMTP", val,
                 c->curve ? ": is the server key given to this client (--curve-server-key) "
                            "the server's?"
                          : "");
}

/* One handshake verdict on server i's socket. */
static void s_handshake_event(ps_client *c, int i, unsigned ev, uint32_t val)
{
    char why[320];
    if (ev == ZMQ_EVENT_DISCONNECTED) {
        c->down[i] = 1;
        return;
    }
    if (ev == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
        c->hs_silent[i] = 0;
        if (c->down[i]) { /* back: what it had outstanding may be lost, send it again now */
            c->down[i] = 0;
            c->reconnect_ns = zps_now_ns();
            zps_log(ZPS_INFO, "client", "server %d (%s) is reachable again: resending", i,
                    c->uris[i]);
            ps_client_resend_server(c, i);
        }
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
    } else if (ev == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
        s_protocol_refusal(c, val, why, sizeof why);
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

void ps_client_handshakes(ps_client *c)
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
