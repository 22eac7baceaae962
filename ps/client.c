/* client.c — the PS client as a trainer calls it (client.h, docs/ps.md; ps-lite's "app"):
 * options and lifecycle, and every operation built from slots of one ticket. The transport
 * is client_conn.c, request tracking client_track.c; client_int.h says what they share.
 *
 * Invariants:
 * - Range operations (push, pull, pushpull) cut each server's pieces into messages of about
 *   msg_bytes and at most PS_MAX_RANGES ranges, sent round-robin over the servers; they
 *   return without waiting. Everything else waits for its ticket before returning.
 * - INIT goes to one server at a time, so each server's verdict (first writer or already
 *   initialised) is known; a server the plan gives no chunk gets no INIT.
 * - Pulled values are written into the caller's buffer only from a reply whose frames
 *   match the request's pieces one for one; a mismatch fails the slot and writes nothing.
 * - The servers' job (REGISTER) is the first reply's; their optimizers must agree.
 */
#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/mem.h"
#include "common/net.h"
#include "ps/client_int.h"
#include "ps/curve.h"

/* A message is packed (when the options allow it) only while its pieces average less than
 * this many bytes. */
#define S_PACK_MAX_PIECE (256u << 10)

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
    o->packed = 1;
    o->shm = 1;
}

const char *ps_client_last_error(const ps_client *c) { return c->err; }
int ps_client_num_servers(const ps_client *c) { return c->n; }
uint64_t ps_client_incarnation(const ps_client *c) { return c->inc.nonce; }

/* ------------------------------------------------------------------------- lifecycle */

/* The CURVE keys of o: all three valid (*curve = 1) or none (*curve = 0). */
static zps_status s_check_keys(const ps_client_opts *o, int *curve)
{
    const char *keys[3] = {o->curve_server_key, o->curve_public_key, o->curve_secret_key};
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
    *curve = given > 0;
    return ZPS_OK;
}

zps_status ps_client_opts_curve(ps_client_opts *o, const char *server_key_file,
                                const char *key_file, char *why, size_t why_len)
{
    zps_status st = ps_curve_load_public(server_key_file, o->curve_server_key, why, why_len);
    if (st == ZPS_OK)
        st = ps_curve_load_keypair(key_file, o->curve_public_key, o->curve_secret_key, why,
                                   why_len);
    return st;
}

/* The options ps_client_new refuses besides the keys. */
static zps_status s_check_opts(const ps_client_opts *o)
{
    if (o->streams < 1 || o->streams > 8) {
        zps_log(ZPS_ERROR, "client", "streams %d: want 1..8 TCP connections per server",
                o->streams);
        return ZPS_ERR_INVALID;
    }
    if (!ps_dtype_name(o->push_dtype)) {
        zps_log(ZPS_ERROR, "client", "push_dtype %d: want PS_DTYPE_F32 or PS_DTYPE_BF16",
                (int)o->push_dtype);
        return ZPS_ERR_INVALID;
    }
    return ZPS_OK;
}

/* c's incarnation: a random nonce (never 0), the wall-clock start, host name and pid. Two
 * clients never share a nonce, even in one process. */
static zps_status s_incarnation(ps_client *c)
{
    uint64_t nonce = 0;
    while (!nonce) {
        ssize_t got = getrandom(&nonce, sizeof nonce, 0);
        if (got != (ssize_t)sizeof nonce && !(got == -1 && errno == EINTR)) {
            zps_log(ZPS_ERROR, "client", "getrandom: %s", got == -1 ? strerror(errno) : "short read");
            return ZPS_ERR_SYS;
        }
    }
    struct timespec ts;
    ZPS_CHECK_SYS(clock_gettime(CLOCK_REALTIME, &ts));
    if (gethostname(c->inc_host, sizeof c->inc_host) == -1 || !c->inc_host[0])
        snprintf(c->inc_host, sizeof c->inc_host, "unknown");
    c->inc_host[sizeof c->inc_host - 1] = 0;
    for (char *p = c->inc_host; *p; p++) // the server takes printable ASCII only
        if (*p <= ' ' || *p >= 127)
            *p = '?';
    zps__incarnation__init(&c->inc);
    c->inc.nonce = nonce;
    c->inc.start_unix_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    c->inc.host = c->inc_host;
    c->inc.pid = (uint32_t)getpid();
    zps__incarnation__init(&c->inc_nonce);
    c->inc_nonce.nonce = nonce;
    return ZPS_OK;
}

/* The per-server arrays, the slot pool (every slot free) and the ticket ring of c. */
static void s_alloc(ps_client *c, int n)
{
    c->socks = zps_xcalloc((size_t)n, sizeof *c->socks);
    c->uris = zps_xcalloc((size_t)n, sizeof *c->uris);
    c->last_sent_ns = zps_xcalloc((size_t)n, sizeof *c->last_sent_ns);
    c->reg_inflight = zps_xcalloc((size_t)n, sizeof *c->reg_inflight);
    c->next_piece = zps_xcalloc((size_t)n, sizeof *c->next_piece);
    c->mons = zps_xcalloc((size_t)n, sizeof *c->mons);
    c->hs_silent = zps_xcalloc((size_t)n, sizeof *c->hs_silent);
    c->refused = zps_xcalloc((size_t)n, sizeof *c->refused);
    c->down = zps_xcalloc((size_t)n, sizeof *c->down);
    c->incarnation = zps_xcalloc((size_t)n, sizeof *c->incarnation);
    c->shm = zps_xcalloc((size_t)n, sizeof *c->shm);
    c->shm_tried = zps_xcalloc((size_t)n, sizeof *c->shm_tried);
    c->shm_busy = zps_xcalloc((size_t)n, sizeof *c->shm_busy);
    c->slots = zps_xcalloc(PS_CLIENT_SLOTS, sizeof *c->slots);
    c->free_slots = zps_xmalloc(PS_CLIENT_SLOTS * sizeof *c->free_slots);
    for (uint32_t i = 0; i < PS_CLIENT_SLOTS; i++)
        c->free_slots[i] = PS_CLIENT_SLOTS - 1 - i;
    c->n_free = PS_CLIENT_SLOTS;
    c->tickets = zps_xcalloc(PS_CLIENT_TICKETS, sizeof *c->tickets);
    c->frames = zps_xcalloc(PS_MAX_RANGES + 1, sizeof *c->frames);
    c->next_ticket = 1;
}

zps_status ps_client_new(const char *const *server_uris, int n_servers, uint32_t trainer_id,
                         const ps_client_opts *opts, ps_client **out)
{
    *out = NULL;
    if (n_servers < 1 || !server_uris)
        return ZPS_ERR_INVALID;
    ps_client_opts defaults;
    if (!opts) {
        ps_client_opts_default(&defaults);
        opts = &defaults;
    }
    int curve = 0;
    ZPS_TRY(s_check_keys(opts, &curve));
    ZPS_TRY(s_check_opts(opts));
    void *ctx = zmq_ctx_new();
    ZPS_CHECK_PTR(ctx, ZPS_ERR_ZMQ);
    if (opts->streams > 1 && zmq_ctx_set(ctx, ZMQ_IO_THREADS, opts->streams) == -1) {
        zps_log(ZPS_ERROR, "client", "zmq_ctx_set(ZMQ_IO_THREADS, %d): %s", opts->streams,
                zmq_strerror(zmq_errno()));
        zps_net_ctx_end(ctx, "client");
        return ZPS_ERR_ZMQ;
    }
    ps_client *c = zps_xcalloc(1, sizeof *c);
    c->o = *opts;
    const char *env_shm = getenv("ZPS_SHM"); // "0": no shared memory for any client (docs/ps.md)
    if (env_shm && !strcmp(env_shm, "0"))
        c->o.shm = 0;
    c->curve = curve;
    c->n = n_servers;
    c->trainer = trainer_id;
    c->ctx = ctx;
    s_alloc(c, n_servers);
    zps_status ist = s_incarnation(c);
    if (ist != ZPS_OK) {
        ps_client_destroy(&c);
        return ist;
    }
    for (int i = 0; i < n_servers; i++) {
        c->uris[i] = zps_xstrdup(server_uris[i]);
        zps_status st = ps_client_open_socket(c, i);
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
    ps_client_hb_stop(c);
    for (int i = 0; i < c->n; i++)
        ps_client_close_socket(c, i);
    zps_net_ctx_end(c->ctx, "client"); // returns once zmq released every zero-copy frame
    for (uint32_t i = 0; i < PS_CLIENT_SLOTS; i++) {
        free(c->slots[i].pieces);
        free(c->slots[i].wire);
        free(c->slots[i].pack);
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
    free(c->down);
    free(c->incarnation);
    ps_client_shm_free(c);
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

/* ------------------------------------------------------------------------- push and pull */

/* Server s's next message among c->pieces[0..np), from its cursor c->next_piece[s] on:
 * pieces *first..*last of server s, about msg_bytes and at most PS_MAX_RANGES of them.
 * Returns how many (0: server s has none left) and moves the cursor past them. */
static size_t s_next_message(ps_client *c, int s, size_t np, uint64_t msg_bytes, size_t *first,
                             size_t *last)
{
    size_t i = c->next_piece[s];
    while (i < np && c->pieces[i].server != (uint32_t)s)
        i++;
    if (i >= np) {
        c->next_piece[s] = np;
        return 0;
    }
    size_t cnt = 0, l = i;
    uint64_t bytes = 0;
    for (size_t j = i; j < np && bytes < msg_bytes && cnt < PS_MAX_RANGES; j++)
        if (c->pieces[j].server == (uint32_t)s) {
            bytes += c->pieces[j].count * 4;
            cnt++;
            l = j;
        }
    c->next_piece[s] = l + 1;
    *first = i;
    *last = l;
    return cnt;
}

/* Builds and sends the per-server slots of a range operation. */
static zps_status s_range_op(ps_client *c, int op, int first_var, int n_vars, const float *src,
                             const uint16_t *src16, float *dst, int64_t step, ps_ticket *out)
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
    ZPS_TRY(ps_client_ticket_new(c, &t));
    ps_client_ticket *tk = ps_client_ticket_get(c, t);
    zps_status st = ZPS_OK;
    /* Each server's pieces go out as messages of about msg_bytes, round-robin over the
     * servers: the server applies message k while message k + 1 is still on the wire, and
     * the client copies pulled message k while k + 1 arrives. */
    for (int s = 0; s < c->n; s++)
        c->next_piece[s] = 0;
    uint64_t msg_bytes = c->o.msg_bytes ? c->o.msg_bytes : UINT64_MAX;
    for (int busy = 1; busy && st == ZPS_OK;) {
        busy = 0;
        for (int s = 0; s < c->n && st == ZPS_OK; s++) {
            size_t i = 0, last = 0, cnt = s_next_message(c, s, np, msg_bytes, &i, &last);
            if (!cnt)
                continue;
            busy = 1;
            ps_client_slot *sl = ps_client_slot_new(c, s, t, op, step);
            if (!sl) {
                st = ZPS_ERR_BUSY;
                ps_client_ticket_fail(tk, st, "too many requests in flight (wait for some tickets)");
                break;
            }
            ps_client_slot_pieces(sl, cnt);
            size_t k = 0, floats = 0;
            for (size_t q = i; q <= last; q++)
                if (c->pieces[q].server == (uint32_t)s) {
                    sl->pieces[k++] = c->pieces[q];
                    floats += c->pieces[q].count;
                }
            /* packing saves a frame per piece and costs a copy of the bytes: it pays for
             * many small pieces (a layer's variables), not for big ones, which go zero-copy
             * from the caller's buffer (a 256 MiB tensor is 64 pieces of 4 MiB) */
            sl->packed = c->o.packed && floats * 4 < (size_t)cnt * S_PACK_MAX_PIECE;
            sl->src = src;
            sl->src16 = src16;
            sl->dst = dst;
            st = ps_client_slot_submit(c, tk, sl, NULL);
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
    return s_range_op(c, ZPS__OP__OP_PUSH, first_var, n_vars, grads, NULL, NULL, step, t);
}

zps_status ps_client_pull(ps_client *c, int first_var, int n_vars, float *values, int64_t step,
                          ps_ticket *t)
{
    return s_range_op(c, ZPS__OP__OP_PULL, first_var, n_vars, NULL, NULL, values, step, t);
}

zps_status ps_client_pushpull(ps_client *c, int first_var, int n_vars, const float *grads,
                              float *values, int64_t step, ps_ticket *t)
{
    return s_range_op(c, ZPS__OP__OP_PUSHPULL, first_var, n_vars, grads, NULL, values, step, t);
}

/* The bf16 sources: only where the wire carries bf16, or the bytes would be misread. */
static zps_status s_bf16_source(ps_client *c)
{
    if (c->o.push_dtype == PS_DTYPE_BF16)
        return ZPS_OK;
    snprintf(c->err, sizeof c->err, "gradients already in bfloat16 need push_dtype bf16");
    zps_log(ZPS_ERROR, "client", "%s", c->err);
    return ZPS_ERR_INVALID;
}

zps_status ps_client_push_bf16(ps_client *c, int first_var, int n_vars, const uint16_t *grads,
                               int64_t step, ps_ticket *t)
{
    ZPS_TRY(s_bf16_source(c));
    return s_range_op(c, ZPS__OP__OP_PUSH, first_var, n_vars, NULL, grads, NULL, step, t);
}

zps_status ps_client_pushpull_bf16(ps_client *c, int first_var, int n_vars,
                                   const uint16_t *grads, float *values, int64_t step,
                                   ps_ticket *t)
{
    ZPS_TRY(s_bf16_source(c));
    return s_range_op(c, ZPS__OP__OP_PUSHPULL, first_var, n_vars, NULL, grads, values, step, t);
}

/* ------------------------------------------------------------------------- replies */

/* A REGISTER reply: keep the first job; note optimizers that differ between servers. */
static void s_take_register(ps_client *c, const Zps__Header *h)
{
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

/* Pulled values of a packed reply: one frame, the pieces back to back. */
static int s_take_packed(ps_client *c, const ps_client_slot *sl, int nframes, const char **msg)
{
    size_t total = 0;
    for (size_t i = 0; i < sl->n_pieces; i++)
        total += sl->pieces[i].count * 4;
    if (nframes != 2 || zmq_msg_size(&c->frames[1]) != total) {
        *msg = "packed reply of the wrong shape";
        return ZPS_ERR_FRAMES;
    }
    const float *src = zmq_msg_data(&c->frames[1]);
    for (size_t i = 0; i < sl->n_pieces; i++) {
        memcpy(sl->dst + sl->pieces[i].flat_offset, src, sl->pieces[i].count * 4);
        src += sl->pieces[i].count;
    }
    return ZPS_OK;
}

/* Pulled values: one frame per piece of sl, each of the piece's length (or one for all,
 * packed), or nothing is written. */
static int s_take_values(ps_client *c, const ps_client_slot *sl, int nframes, const char **msg)
{
    if (sl->packed)
        return s_take_packed(c, sl, nframes, msg);
    if ((size_t)nframes != 1 + sl->n_pieces) {
        *msg = "reply has the wrong number of frames";
        return ZPS_ERR_FRAMES;
    }
    int status = ZPS_OK;
    for (size_t i = 0; i < sl->n_pieces; i++)
        if (zmq_msg_size(&c->frames[1 + i]) != sl->pieces[i].count * 4) {
            status = ZPS_ERR_FRAMES;
            *msg = "reply frame of the wrong length";
        }
    if (status == ZPS_OK)
        for (size_t i = 0; i < sl->n_pieces; i++)
            memcpy(sl->dst + sl->pieces[i].flat_offset, zmq_msg_data(&c->frames[1 + i]),
                   sl->pieces[i].count * 4);
    return status;
}

int ps_client_take_reply(ps_client *c, ps_client_slot *sl, const Zps__Header *h, int nframes,
                         const char **msg)
{
    if (sl->op == ZPS__OP__OP_REGISTER)
        s_take_register(c, h);
    if (sl->op == ZPS__OP__OP_STATS) {
        free(c->stats_json);
        c->stats_json = zps_xstrdup(*msg);
    }
    if (sl->dst && (sl->op == ZPS__OP__OP_PULL || sl->op == ZPS__OP__OP_PUSHPULL))
        return h->shm_values ? ZPS_OK /* copied by s_shm_redo's ps_client_shm_take */
                             : s_take_values(c, sl, nframes, msg);
    return ZPS_OK;
}

/* ------------------------------------------------------------------------- blocking ops */

/* Sends op to every server (or only_server when >= 0) as one ticket and waits; a status
 * accept() takes counts as success. */
static zps_status s_simple_at(ps_client *c, int op, int only_server, int64_t step,
                              uint64_t *version, int (*accept)(int status))
{
    ps_ticket t;
    ZPS_TRY(ps_client_ticket_new(c, &t));
    ps_client_ticket *tk = ps_client_ticket_get(c, t);
    for (int s = 0; s < c->n; s++) {
        if (only_server >= 0 && s != only_server)
            continue;
        ps_client_slot *sl = ps_client_slot_new(c, s, t, op, step);
        if (!sl)
            return ZPS_ERR_BUSY;
        ps_client_slot_submit(c, tk, sl, NULL);
    }
    zps_status st = ps_client_wait_ticket(c, t, version, 1);
    if (accept && accept(st))
        st = ZPS_OK;
    return st;
}

static zps_status s_simple(ps_client *c, int op, int only_server, uint64_t *version,
                           int (*accept)(int status))
{
    return s_simple_at(c, op, only_server, 0, version, accept);
}

/* A REGISTER some server refused because another live process holds the id: LEAVE every
 * server, so those that took this incarnation (their view of the holder's liveness can
 * differ near --trainer-timeout) hand the id back instead of refusing the holder. The
 * refusal stays the error. */
static void s_register_undo(ps_client *c)
{
    char err[sizeof c->err];
    memcpy(err, c->err, sizeof err);
    s_simple(c, ZPS__OP__OP_LEAVE, -1, NULL, NULL);
    memcpy(c->err, err, sizeof err);
}

void ps_client_note_holder(ps_client *c, const Zps__Header *h)
{
    const Zps__Incarnation *in = h->holder;
    if (!in || !in->nonce || !in->host)
        return;
    c->holder.nonce = in->nonce;
    c->holder.pid = in->pid;
    snprintf(c->holder.host, sizeof c->holder.host, "%s", in->host);
}

/* The holder a refusal named runs on this host and its pid is gone (a supervisor restarting
 * a killed trainer): nothing can still push under it. A pid that exists counts as alive,
 * whoever it belongs to now, so the worst case is the old wait for the timeout. */
static int s_holder_dead(const ps_client *c)
{
    if (!c->holder.nonce || !c->holder.pid || strcmp(c->holder.host, c->inc_host) ||
        c->holder.pid == (uint32_t)getpid())
        return 0;
    return kill((pid_t)c->holder.pid, 0) == -1 && errno == ESRCH;
}

/* One REGISTER round; refused because a holder that is dead on this host still counts as
 * live on a server, a second one saying so. */
static zps_status s_register_once(ps_client *c)
{
    c->holder.nonce = 0;
    c->dead_holder = 0;
    zps_status st = s_simple(c, ZPS__OP__OP_REGISTER, -1, NULL, NULL);
    if (st == ZPS_ERR_EXISTS && s_holder_dead(c)) {
        zps_log(ZPS_INFO, "client", "trainer %u: its holder, pid %u on this host (incarnation "
                "%016" PRIx64 "), is gone: taking the id over", c->trainer, c->holder.pid,
                c->holder.nonce);
        c->dead_holder = c->holder.nonce;
        st = s_simple(c, ZPS__OP__OP_REGISTER, -1, NULL, NULL);
        c->dead_holder = 0;
    }
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
    zps_status st = s_register_once(c);
    if (st == ZPS_ERR_EXISTS && c->n > 1)
        s_register_undo(c);
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
    if (!c->registered)
        zps_log(ZPS_INFO, "client", "trainer %u: incarnation %016" PRIx64 " (host %s pid %u)",
                c->trainer, c->inc.nonce, c->inc.host, c->inc.pid);
    c->registered = 1;
    ps_client_hb_start(c);
    if (effective)
        *effective = c->job;
    return ZPS_OK;
}

/* INIT of server s with its chunks of values; *empty = 1 (and ZPS_OK) when the plan gives
 * it none, so there is nothing to send. Waits for the reply. */
static zps_status s_init_server(ps_client *c, int s, const float *values,
                                const ps_optim_config *opt, int *empty)
{
    ps_ticket t;
    ZPS_TRY(ps_client_ticket_new(c, &t));
    ps_client_ticket *tk = ps_client_ticket_get(c, t);
    ps_client_slot *sl = ps_client_slot_new(c, s, t, ZPS__OP__OP_INIT, 0);
    if (!sl)
        return ZPS_ERR_BUSY;
    size_t cnt = c->plan->server_chunks[s];
    *empty = !cnt;
    if (!cnt) { // a server the plan gives nothing has nothing to initialise
        ps_client_slot_release(c, sl);
        tk->open = 0;
        tk->waited = 1;
        return ZPS_OK;
    }
    ps_client_slot_pieces(sl, cnt);
    size_t k = 0;
    for (uint32_t i = 0; i < c->plan->n_chunks; i++) {
        const ps_chunk *ch = &c->plan->chunks[i];
        if (ch->server == (uint32_t)s)
            sl->pieces[k++] = (ps_piece){ch->key, ch->server, 0, ch->offset, ch->count};
    }
    sl->src = values;
    ps_client_slot_submit(c, tk, sl, opt);
    return ps_client_wait_ticket(c, t, NULL, 1);
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
    int accepted = 0, refused = 0, empty = 0;
    /* One server at a time, so every reply's status is known per server. */
    for (int s = 0; s < c->n; s++) {
        int none = 0;
        zps_status st = s_init_server(c, s, values, opt, &none);
        if (st == ZPS_ERR_ALREADY_INIT)
            refused++;
        else if (st != ZPS_OK)
            return st;
        else if (none)
            empty++;
        else
            accepted++;
    }
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
    return s_simple_at(c, ZPS__OP__OP_CHECKPOINT, -1, -1, NULL, NULL); // step -1: no cut
}

zps_status ps_client_admin(ps_client *c, int shutdown, int cut, uint64_t version,
                           ps_client_answer *answers)
{
    if (answers) {
        for (int i = 0; i < c->n; i++)
            answers[i] = (ps_client_answer){ZPS_ERR_TIMEOUT, 0, "no answer"};
        c->answers = answers;
        c->answers_ticket = c->next_ticket; // the ticket s_simple_at takes
    }
    int op = shutdown ? ZPS__OP__OP_SHUTDOWN : ZPS__OP__OP_CHECKPOINT;
    zps_status st = s_simple_at(c, op, -1, cut ? (int64_t)version : -1, NULL, NULL);
    c->answers = NULL;
    return st;
}

zps_status ps_client_leave(ps_client *c)
{
    ps_client_hb_stop(c); // a heartbeat after LEAVE would not bring us back, but save the traffic
    return s_simple(c, ZPS__OP__OP_LEAVE, -1, NULL, NULL);
}

zps_status ps_client_shutdown(ps_client *c)
{
    return s_simple_at(c, ZPS__OP__OP_SHUTDOWN, -1, -1, NULL, NULL); // step -1: now
}

int ps_client_rollback_pending(const ps_client *c, uint64_t *version)
{
    if (version)
        *version = c->rb_version;
    return c->rb_pending;
}

zps_status ps_client_rollback(ps_client *c, uint64_t *version)
{
    (void)ps_client_wait_all(c); // the old timeline's requests: they failed, or are done
    zps_status st = ZPS_OK;
    /* a newer rollback seen meanwhile (a second restore) is done next, at most a few */
    for (int round = 0; c->rb_pending && round < 8; round++) {
        c->rb_pending = 0;
        uint64_t v = c->rb_version;
        st = s_simple_at(c, ZPS__OP__OP_ROLLBACK, -1, (int64_t)v, NULL, NULL);
        if (st == ZPS_OK && !c->rb_pending)
            zps_log(ZPS_INFO, "client", "every server is back at version %" PRIu64, v);
    }
    if (version)
        *version = c->rb_version;
    return c->rb_pending ? ZPS_ERR_BUSY : st;
}
