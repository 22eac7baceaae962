/* server_ops.c — one handler per op (server_int.h; the ops are in docs/ps.md "Ops"). Each
 * checks the request (server_validate.c), notes the trainer as alive, changes state through
 * server_shard.c / server_consistency.c, and replies (or queues the reply).
 *
 * Invariants:
 *   - A rejected request gets an error reply, bumps a counter and changes nothing but the
 *     trainer's liveness (a request from a known trainer proves it is alive).
 *   - A trainer id is held by one incarnation (docs/ps.md "Trainer identity"): a REGISTER
 *     from another one is refused while the holder is live, and takes over (with a clean
 *     slate: ps_srv_trainer_reset) when it is not; requests with another nonce are refused
 *     by ps_srv_check_trainer and are no sign of life.
 *   - A push request id is handled once per trainer: a retry gets the first status back and
 *     is never applied twice (ps_srv_rid_seen).
 *   - async / ssp: the reply of a PUSH goes out before the arithmetic (ps_srv_apply_ranges):
 *     the trainer's next request travels while the server applies this one. Nothing can
 *     observe the difference: the server handles one request at a time, so whatever comes
 *     after the push sees it applied.
 *   - sync: a PUSH / PULL / PUSHPULL with a step whose rollback token is not the server's is
 *     refused before anything changes: it belongs to a timeline the fleet abandoned.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/mem.h"
#include "ps/server_int.h"

/* ------------------------------------------------------------------------- REGISTER */

static void s_adopt_plan(ps_server *s, const Zps__Header *h)
{
    if (s->have_plan || !h->job)
        return;
    s->have_plan = 1;
    s->plan_hash = h->plan_hash;
    s->plan_vars = h->job->num_variables;
    s->plan_total = h->job->total_count;
    s->plan_servers = h->job->num_servers;
    s->plan_chunk_bytes = h->job->chunk_bytes;
    s->num_chunks = h->job->num_chunks;
    snprintf(s->plan_src, sizeof s->plan_src, "trainer %u", h->trainer_id);
}

/* A checked REGISTER: whatever the job left open is adopted from it. */
static void s_adopt_job(ps_server *s, const Zps__JobConfig *j, uint32_t nt)
{
    if (s->mode == PS_MODE_UNSET)
        s->mode = j->mode ? (ps_mode)j->mode : PS_MODE_SYNC;
    if (!s->replicas && j->replicas_to_aggregate)
        s->replicas = j->replicas_to_aggregate;
    if (s->staleness < 0)
        s->staleness = (int)j->staleness;
    if (!s->n_trainers) {
        s->n_trainers = nt;
        zps_log(ZPS_INFO, "ps", "job: %s mode, %u trainers, aggregate %u, staleness %d",
                ps_srv_mode_names[s->mode], nt, s->replicas ? s->replicas : nt, s->staleness);
    }
}

/* A checked REGISTER's incarnation holds the trainer id from now on. One that takes over
 * from another (dead, dropped or departed: ps_srv_check_register refused it otherwise)
 * starts from a clean slate and says so in the log. */
static void s_adopt_incarnation(ps_server *s, const Zps__Header *h)
{
    uint32_t t = h->trainer_id;
    ps_srv_trainer *tr = &s->trainers[t];
    const Zps__Incarnation *in = h->incarnation;
    if (!tr->registered) {
        zps_log(ZPS_INFO, "ps", "trainer %u registered: host %s pid %u (incarnation %016" PRIx64 ")",
                t, in->host, in->pid, in->nonce);
    } else if (tr->inc.nonce != in->nonce) {
        double silent;
        ps_srv_incarnation_live(s, t, &silent);
        /* taking over from one that LEFT is the normal restart; from a silent one, news */
        int reported = h->dead_holder && h->dead_holder == tr->inc.nonce;
        zps_log(tr->left || reported ? ZPS_INFO : ZPS_WARN, "ps", "trainer %u: host %s pid %u (incarnation %016" PRIx64 ") replaces "
                "host %s pid %u (incarnation %016" PRIx64 "), which %s %.1f s ago",
                t, in->host, in->pid, in->nonce, tr->inc.host, tr->inc.pid, tr->inc.nonce,
                tr->left ? "left; last heard from"
                : reported ? "its successor found dead on that host; last heard from"
                           : "was last heard from", silent);
        ps_srv_trainer_reset(s, t);
    }
    tr->registered = 1;
    tr->inc.nonce = in->nonce;
    tr->inc.start_unix_ms = in->start_unix_ms;
    tr->inc.pid = in->pid;
    snprintf(tr->inc.host, sizeof tr->inc.host, "%s", in->host);
}

void ps_srv_op_register(ps_server *s, zmq_msg_t *ident, const Zps__Header *h)
{
    char why[512];
    uint32_t nt = 0;
    zps_status st = ps_srv_check_register(s, h, &nt, why, sizeof why);
    if (st == ZPS_ERR_EXISTS) {
        ps_srv_reject_held(s, ident, h, why);
        return;
    }
    if (st != ZPS_OK) {
        ps_srv_reject(s, ident, h->op, h->request_id, st, why);
        return;
    }
    s_adopt_job(s, h->job, nt);
    s_adopt_plan(s, h);
    ps_srv_trainers_ensure(s);
    ps_srv_shm_ensure(s);
    s_adopt_incarnation(s, h);
    ps_srv_seen(s, h->trainer_id);
    ps_srv_reply r = {h->op, h->request_id, ZPS_OK,
                      s->initialised ? "initialised" : "not initialised", ps_srv_min_version(s),
                      1, 1, 0, h->shm_nonce};
    ps_srv_send(s, ident, &r, NULL, 0);
    ps_srv_check_pending(s);
}

/* ------------------------------------------------------------------------- INIT */

void ps_srv_op_init(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes)
{
    char why[512];
    int op = h->op;
    zps_status st = ps_srv_check_trainer(s, h, why, sizeof why);
    if (st != ZPS_OK) {
        ps_srv_reject(s, ident, op, h->request_id, st, why);
        return;
    }
    ps_srv_seen(s, h->trainer_id);
    ps_srv_init_table t;
    if ((st = ps_srv_check_init(s, h, nframes, &t, why, sizeof why)) != ZPS_OK) {
        ps_srv_reject(s, ident, op, h->request_id, st, why);
        return;
    }
    /* A re-INIT replaces the chunk table: requests waiting on the old one are answered. */
    ps_srv_pending_reinit(s);
    ps_srv_shard_init(s, &t);
    ps_srv_init_table_free(&t);
    s->st.bytes_in += t.total;
    zps_log(ZPS_INFO, "ps", "initialised by trainer %u: %u chunks, %" PRIu64 " values, optimizer %s",
            h->trainer_id, s->n_local, s->local_total, ps_optim_kind_name(s->opt.kind));
    s->last_ckpt_version = 0;
    if (s->cfg.checkpoint_dir[0])
        ps_srv_write_checkpoint(s, 1); // version 0 everywhere: a cut
    ps_srv_shm_ensure(s);
    ps_srv_reply r = {op, h->request_id, ZPS_OK, "initialised", 0, 0, 1, 0, h->shm_nonce};
    ps_srv_send(s, ident, &r, NULL, 0);
}

/* ------------------------------------------------------------------------- PUSH, PUSHPULL */

/* The values of the request's ranges (a PULL, or the pull half of a PUSHPULL whose push
 * went through): answered now (the usual async case) or queued until `need` holds (sync:
 * the chunks' version, ssp: the clocks; -1: now). */
static void s_reply_values(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int64_t need,
                           uint64_t t0)
{
    uint32_t n = (uint32_t)h->n_ranges;
    ps_srv_pending p = {.rid = h->request_id, .op = h->op, .need = need, .n_ranges = n,
                        .ranges = s->ranges};
    if (ps_srv_pending_ready(s, &p)) {
        ps_srv_reply r = {h->op, h->request_id, ZPS_OK, "", ps_srv_ranges_version(s, s->ranges, n),
                          0, 0, s->req_packed, s->req_shm_nonce};
        ps_srv_send(s, ident, &r, s->ranges, n);
        ps_srv_latency(s, h->op, t0);
    } else {
        ps_srv_pending_add(s, ident, h->request_id, h->trainer_id, h->op, need, s->ranges, n, t0);
    }
}

/* PUSH, PUSHPULL and PULL: the trainer and the ranges (into s->ranges) checked, else
 * rejected; 1 when the request goes on. */
static int s_check_ranged(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes,
                          int has_data)
{
    char why[512];
    zps_status st = ps_srv_check_trainer(s, h, why, sizeof why);
    if (st == ZPS_OK)
        st = ps_srv_check_ranges(s, h, nframes, has_data, why, sizeof why);
    if (st == ZPS_OK && s->mode == PS_MODE_SYNC && h->step >= 0 && h->rollback_token != s->rb_token) {
        /* sent before the trainer knew of the fleet's last rollback: its step belongs to an
         * abandoned timeline (ahead of the restored version) */
        st = ZPS_ERR_STALE;
        snprintf(why, sizeof why, "step %" PRId64 " is ahead of the fleet, which rolled back to "
                 "version %" PRIu64 " (rollback %016" PRIx64 "): roll back and redo", h->step,
                 s->rb_version, s->rb_token);
    }
    if (st != ZPS_OK) {
        ps_srv_reject(s, ident, h->op, h->request_id, st, why);
        return 0;
    }
    /* a word brings back a trainer that was dropped, but one that left comes back only by
     * REGISTER, as with heartbeats: its own requests still on their way after its LEAVE (a
     * pull its client resent through ZeroMQ when a shared-memory read raced an update, a
     * push on another stream) must not make the fleet wait for it again */
    if (!s->trainers[h->trainer_id].left)
        ps_srv_seen(s, h->trainer_id);
    return 1;
}

/* The reply step shared by the sync and async paths. st is the push's status (a retried
 * request: the first one's), msg its message; apply: async / ssp ranges still to apply
 * (after a PUSH's reply, before a PUSHPULL's values). */
static void s_push_reply(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int st,
                         const char *msg, int apply, uint64_t t0)
{
    uint32_t n = (uint32_t)h->n_ranges;
    if (h->op == ZPS__OP__OP_PUSHPULL && st == ZPS_OK) {
        if (apply)
            ps_srv_apply_ranges(s, n);
        s_reply_values(s, ident, h, s->mode == PS_MODE_ASYNC || h->step < 0 ? -1 : h->step + 1, t0);
    } else {
        ps_srv_reply r = {h->op, h->request_id, st, msg, ps_srv_ranges_version(s, s->ranges, n),
                          0, 0, 0, 0};
        ps_srv_send(s, ident, &r, NULL, 0);
        ps_srv_latency(s, h->op, t0);
        if (apply)
            ps_srv_apply_ranges(s, n);
    }
    ps_srv_check_pending(s);
    if (s->cfg.checkpoint_every_versions)
        ps_srv_maybe_checkpoint(s);
    if (s->n_cut_waits)
        ps_srv_admin_progress(s);
}

/* The sync path: on a coverage conflict the request is refused (nothing changed, no
 * request id noted); ranges for another step are dropped and make the status STALE. */
static void s_push_sync(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, uint64_t t0)
{
    char why[512], msg[160] = "";
    uint32_t stale = 0, ahead = 0, n = (uint32_t)h->n_ranges;
    zps_status st = ps_srv_sync_push(s, h, &stale, &ahead, why, sizeof why);
    if (st != ZPS_OK) {
        ps_srv_reject(s, ident, h->op, h->request_id, st, why);
        return;
    }
    if (stale || ahead) {
        st = ZPS_ERR_STALE;
        snprintf(msg, sizeof msg, "%u of %u ranges dropped: step %" PRId64 " is %s the server's version %" PRIu64,
                 stale + ahead, n, h->step, ahead ? "ahead of" : "behind",
                 ps_srv_ranges_version(s, s->ranges, n));
    }
    ps_srv_rid_note(&s->trainers[h->trainer_id], h->request_id, st);
    s_push_reply(s, ident, h, st, msg, 0, t0);
}

/* The async / ssp path: bookkeeping now, the arithmetic in the reply step. */
static void s_push_async(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, uint64_t t0)
{
    ps_srv_async_push(s, h);
    ps_srv_rid_note(&s->trainers[h->trainer_id], h->request_id, ZPS_OK);
    s_push_reply(s, ident, h, ZPS_OK, "", 1, t0);
}

void ps_srv_op_push(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes,
                    uint64_t t0)
{
    if (!s_check_ranged(s, ident, h, nframes, 1))
        return;
    int op = h->op, prev;
    if (ps_srv_rid_seen(&s->trainers[h->trainer_id], h->request_id, &prev)) {
        /* A retry of a push already handled: never apply it twice. A PUSHPULL still gets
         * its values when the first one went through. */
        if (op == ZPS__OP__OP_PUSH) {
            uint32_t n = (uint32_t)h->n_ranges;
            ps_srv_reply r = {op, h->request_id, prev, "duplicate push (retry): already handled",
                              ps_srv_ranges_version(s, s->ranges, n), 0, 0, 0, 0};
            ps_srv_send(s, ident, &r, NULL, 0);
            return;
        }
        s_push_reply(s, ident, h, prev, "", 0, t0);
    } else if (s->mode == PS_MODE_SYNC) {
        s_push_sync(s, ident, h, t0);
    } else {
        s_push_async(s, ident, h, t0);
    }
}

/* ------------------------------------------------------------------------- PULL */

void ps_srv_op_pull(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes,
                    uint64_t t0)
{
    if (!s_check_ranged(s, ident, h, nframes, 0))
        return;
    if (s->mode == PS_MODE_SSP && h->step >= 0)
        ps_srv_ssp_pull_clock(s, h->trainer_id, h->step);
    s_reply_values(s, ident, h, s->mode == PS_MODE_ASYNC ? -1 : h->step, t0);
}

/* ------------------------------------------------------------------------- the others */

static void s_op_leave(ps_server *s, zmq_msg_t *ident, const Zps__Header *h)
{
    ps_srv_trainer *tr = &s->trainers[h->trainer_id];
    if (!tr->left) {
        tr->left = 1;
        s->st.trainers_left++;
        if (!tr->dropped) {
            tr->dropped = 1;
            zps_log(ZPS_INFO, "ps", "trainer %u left (%u live)", h->trainer_id, ps_srv_live(s));
        }
    }
    ps_srv_reply r = {h->op, h->request_id, ZPS_OK, "", ps_srv_min_version(s), 0, 0, 0, 0};
    ps_srv_send(s, ident, &r, NULL, 0);
    /* after SHUTDOWN's final checkpoint nothing may change: no sync apply for the rest */
    if (s->drain_until <= 0)
        ps_srv_after_drop(s);
    else
        ps_srv_admin_tick(s);
}

static void s_op_barrier(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, uint64_t t0)
{
    for (size_t i = 0; i < s->n_pending; i++)
        if (s->pending[i].op == (int)h->op && s->pending[i].trainer == h->trainer_id) {
            /* A retried barrier replaces the earlier one. */
            ps_srv_pending_drop(s, i);
            break;
        }
    ps_srv_pending_add(s, ident, h->request_id, h->trainer_id, h->op, 0, NULL, 0, t0);
    ps_srv_check_barrier(s);
}

/* ROLLBACK (sync): go back to the checkpoint of version `step`, once per rollback token;
 * a repeat of the token we hold already is answered OK and changes nothing, an older token
 * (a rollback overtaken by a newer one) is refused. */
static void s_op_rollback(ps_server *s, zmq_msg_t *ident, const Zps__Header *h)
{
    char why[512] = "";
    zps_status st = ZPS_OK;
    uint64_t v = (uint64_t)h->step;
    if (s->mode != PS_MODE_SYNC || !h->rollback_token || h->step < 0) {
        st = ZPS_ERR_INVALID;
        snprintf(why, sizeof why, "ROLLBACK needs sync mode, a rollback token and a version");
    } else if (h->rollback_token < s->rb_token) {
        st = ZPS_ERR_STALE;
        snprintf(why, sizeof why, "a newer rollback (to version %" PRIu64 ") happened already",
                 s->rb_version);
    } else if (h->rollback_token > s->rb_token) {
        st = ps_srv_rollback(s, v, why, sizeof why);
        if (st == ZPS_OK) {
            s->rb_token = h->rollback_token;
            s->rb_version = v;
            ps_srv_sync_reset(s);
            zps_log(ZPS_WARN, "ps", "rolled back to version %" PRIu64 " (rollback %016" PRIx64
                    ", asked by trainer %u)", v, s->rb_token, h->trainer_id);
        }
    }
    if (st != ZPS_OK) {
        ps_srv_reject(s, ident, h->op, h->request_id, st, why);
        return;
    }
    ps_srv_reply r = {h->op, h->request_id, ZPS_OK, "", ps_srv_min_version(s), 0, 0, 0, 0};
    ps_srv_send(s, ident, &r, NULL, 0);
    ps_srv_check_pending(s);
}

void ps_srv_op_simple(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, uint64_t t0)
{
    int op = h->op;
    if (op == ZPS__OP__OP_HEARTBEAT || op == ZPS__OP__OP_LEAVE || op == ZPS__OP__OP_BARRIER ||
        op == ZPS__OP__OP_ROLLBACK) {
        char why[512];
        zps_status st = ps_srv_check_trainer(s, h, why, sizeof why);
        if (st != ZPS_OK) {
            ps_srv_reject(s, ident, op, h->request_id, st, why);
            return;
        }
        /* any word from a trainer counts as seen, except that heartbeats and barriers do not
         * bring back one that left */
        if (op != ZPS__OP__OP_LEAVE && !s->trainers[h->trainer_id].left)
            ps_srv_seen(s, h->trainer_id);
    }
    switch (op) {
    case ZPS__OP__OP_HEARTBEAT: {
        ps_srv_reply r = {op, h->request_id, ZPS_OK, "", ps_srv_min_version(s), 0, 0, 0, 0};
        ps_srv_send(s, ident, &r, NULL, 0);
        ps_srv_check_pending(s);
        break;
    }
    case ZPS__OP__OP_LEAVE:
        s_op_leave(s, ident, h);
        break;
    case ZPS__OP__OP_BARRIER:
        s_op_barrier(s, ident, h, t0);
        return; // its latency counts when it is released
    case ZPS__OP__OP_STATS:
    case ZPS__OP__OP_CHECKPOINT:
    case ZPS__OP__OP_SHUTDOWN:
        ps_srv_op_admin(s, ident, h);
        break;
    case ZPS__OP__OP_ROLLBACK:
        s_op_rollback(s, ident, h);
        break;
    }
    ps_srv_latency(s, op, t0);
}
