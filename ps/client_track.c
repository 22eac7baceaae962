/* client_track.c — request tracking of the PS client (ps-lite's "customer"): slots and
 * tickets (client_int.h), replies matched to their slot by request id, resends with
 * back-off, re-registration after a server restart, and the waits of client.h.
 *
 * Invariants:
 * - A slot is free when rid is 0; a busy slot belongs to exactly one ticket (or to none:
 *   an internal heartbeat or re-REGISTER), and its ticket's open count includes it until
 *   ps_client_slot_finish completes it, exactly once.
 * - A reply completes a slot only when its request id is the slot's current rid, it came
 *   from the slot's server and the slot is not waiting for a re-REGISTER; anything else is a
 *   late duplicate and is dropped.
 * - A slot is recycled only once ZeroMQ released every zero-copy frame of it (frames_out 0).
 * - A ticket's status is its first failure; later failures do not overwrite its message.
 * - A request is sent at most max_retries + 1 times; resend k waits backoff_ms * 2^(k-1).
 * - A wait never blocks past one poll slice (<= 100 ms) after the stop flag rose or the
 *   deadline passed; what it waited for stays in flight and is dropped with the client.
 *   A server whose connection dropped and came back gets everything outstanding resent at
 *   once (ps_client_resend_server): same request ids, so the server's dedup still holds.
 * - A slot carries the rollback token known when it was made, resends included; a reply
 *   with a newer token (sync) fails every ticket slot of the old timeline, so no wait hangs
 *   on a version nobody will push (docs/ps.md "Recovery").
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "ps/client_int.h"

/* ------------------------------------------------------------------------- slots */

ps_client_slot *ps_client_slot_new(ps_client *c, int server, ps_ticket t, int op, int64_t step)
{
    if (!c->n_free)
        return NULL;
    uint32_t idx = c->free_slots[--c->n_free];
    ps_client_slot *sl = &c->slots[idx];
    c->seq++;
    sl->rid = (c->seq << PS_CLIENT_SLOT_BITS) | idx;
    sl->server = server;
    sl->ticket = t;
    sl->op = op;
    sl->step = step;
    sl->token = c->rb_token;
    sl->n_pieces = 0;
    sl->src = NULL;
    sl->src16 = NULL;
    sl->dst = NULL;
    sl->wire_ready = 0;
    sl->pack_ready = 0;
    sl->packed = 0;
    sl->attempts = 0;
    sl->await_reg = 0;
    sl->done = 0;
    sl->shm_data = 0;
    sl->no_shm = 0;
    return sl;
}

/* Frees a slot. zmq may still hold zero-copy frames of its push. After a reply the IO
 * thread has written them and lets go at once (wait for it, however loaded the machine).
 * After a failure (failed = 1) they may be parked in the pipe for a dead server: if they
 * are not released quickly, close the socket with linger 0, which drops them, and open a
 * new one; requests in flight on it time out and are resent. */
static void s_slot_release_ex(ps_client *c, ps_client_slot *sl, int failed)
{
    for (int spins = 0; atomic_load(&sl->frames_out) > 0 && (!failed || spins < 20); spins++)
        zps_sleep_ns(spins < 20 ? 50000 : 1000000);
    if (atomic_load(&sl->frames_out) > 0) {
        int srv = sl->server;
        zps_log(ZPS_WARN, "client", "dropping unsent frames to %s: reopening the socket", c->uris[srv]);
        ps_client_close_socket(c, srv);
        for (int spins = 0; atomic_load(&sl->frames_out) > 0 && spins < 10000; spins++)
            zps_sleep_ns(1000000);
        if (ps_client_open_socket(c, srv) != ZPS_OK)
            zps_log(ZPS_ERROR, "client", "cannot reopen the socket to %s", c->uris[srv]);
    }
    ps_client_shm_done(c, sl);
    sl->rid = 0;
    c->free_slots[c->n_free++] = (uint32_t)(sl - c->slots);
}

void ps_client_slot_release(ps_client *c, ps_client_slot *sl) { s_slot_release_ex(c, sl, 1); }

void ps_client_slot_pieces(ps_client_slot *sl, size_t n)
{
    if (n > sl->cap_pieces) {
        sl->cap_pieces = n;
        sl->pieces = zps_xrealloc(sl->pieces, n * sizeof *sl->pieces);
    }
    sl->n_pieces = n;
}

void ps_client_slot_finish(ps_client *c, ps_client_slot *sl, int status, const char *msg,
                           uint64_t version)
{
    if (c->answers && sl->ticket && sl->ticket == c->answers_ticket) {
        ps_client_answer *a = &c->answers[sl->server];
        a->status = status;
        a->version = version;
        snprintf(a->msg, sizeof a->msg, "%s", msg ? msg : "");
    }
    if (sl->ticket) {
        ps_client_ticket *tk = ps_client_ticket_get(c, sl->ticket);
        if (tk) {
            if (status != ZPS_OK) {
                char m[384];
                snprintf(m, sizeof m, "server %d (%s): %s", sl->server, c->uris[sl->server],
                         msg && *msg ? msg : zps_strerror(status));
                ps_client_ticket_fail(tk, status, m);
            }
            if (version < tk->version)
                tk->version = version;
            if (--tk->open == 0)
                tk->done_ns = zps_now_ns();
        }
    }
    s_slot_release_ex(c, sl, status != ZPS_OK);
}

zps_status ps_client_slot_submit(ps_client *c, ps_client_ticket *tk, ps_client_slot *sl,
                                 const ps_optim_config *opt)
{
    tk->open++;
    zps_status st = ps_client_send_slot(c, sl, opt);
    if (st != ZPS_OK)
        ps_client_slot_finish(c, sl, st, ps_client_send_err(c, sl->server, st), UINT64_MAX);
    return st;
}

/* ------------------------------------------------------------------------- tickets */

ps_client_ticket *ps_client_ticket_get(ps_client *c, ps_ticket t)
{
    ps_client_ticket *tk = &c->tickets[t % PS_CLIENT_TICKETS];
    return tk->id == t ? tk : NULL;
}

void ps_client_ticket_fail(ps_client_ticket *tk, int status, const char *msg)
{
    if (tk->status == ZPS_OK) {
        tk->status = status;
        snprintf(tk->msg, sizeof tk->msg, "%s", msg);
    }
}

zps_status ps_client_ticket_new(ps_client *c, ps_ticket *out)
{
    ps_ticket t = c->next_ticket;
    ps_client_ticket *tk = &c->tickets[t % PS_CLIENT_TICKETS];
    if (tk->id && tk->open)
        ps_client_wait_ticket(c, tk->id, NULL, 0);
    c->next_ticket++;
    memset(tk, 0, sizeof *tk);
    tk->id = t;
    tk->version = UINT64_MAX;
    *out = t;
    return ZPS_OK;
}

/* ------------------------------------------------------------------------- replies */

static void s_send_register(ps_client *c, int server)
{
    ps_client_slot *sl = ps_client_slot_new(c, server, 0, ZPS__OP__OP_REGISTER, 0);
    if (!sl)
        return;
    c->reg_inflight[server] = 1;
    if (ps_client_send_slot(c, sl, NULL) != ZPS_OK) {
        c->reg_inflight[server] = 0;
        ps_client_slot_release(c, sl);
    }
}

/* A reply to an internal re-REGISTER: resend (or fail) every slot that waited for it. */
static void s_reregistered(ps_client *c, int server, int status, const char *msg)
{
    c->reg_inflight[server] = 0;
    for (uint32_t i = 0; i < PS_CLIENT_SLOTS; i++) {
        ps_client_slot *sl = &c->slots[i];
        if (!sl->rid || sl->server != server || !sl->await_reg)
            continue;
        sl->await_reg = 0;
        zps_status st = status != ZPS_OK ? (zps_status)status : ps_client_send_slot(c, sl, NULL);
        if (st != ZPS_OK)
            ps_client_slot_finish(c, sl, st,
                                  status != ZPS_OK ? msg : ps_client_send_err(c, server, st),
                                  UINT64_MAX);
    }
}

/* The slot a reply h from server answers, or NULL (logged) when it is late or a duplicate. */
static ps_client_slot *s_reply_slot(ps_client *c, int server, const Zps__Header *h)
{
    uint32_t idx = (uint32_t)(h->request_id & (PS_CLIENT_SLOTS - 1));
    ps_client_slot *sl = &c->slots[idx];
    if (!h->request_id || sl->rid != h->request_id || sl->server != server || sl->await_reg) {
        zps_log(ZPS_DEBUG, "client", "dropping a reply to request %" PRIu64 " (late or duplicate)",
                h->request_id);
        return NULL;
    }
    return sl;
}

/* The server lost our registration (restart): register again, then resend. 1 when sl now
 * waits for that. */
static int s_lost_registration(ps_client *c, int server, ps_client_slot *sl, int status)
{
    if (status != ZPS_ERR_TRAINER || sl->op == ZPS__OP__OP_REGISTER || !sl->ticket ||
        !c->registered || sl->attempts > c->o.max_retries)
        return 0;
    sl->attempts++;
    sl->await_reg = 1;
    if (!c->reg_inflight[server])
        s_send_register(c, server);
    return 1;
}

/* sync: the fleet rolled back (or must: a server was restored). Every request of the old
 * timeline fails ZPS_ERR_STALE now (a pull could otherwise wait forever for a version
 * nobody will push), and the caller is told (ps_client_rollback_pending). */
static void s_rollback_seen(ps_client *c)
{
    if (!c->registered || c->job.mode != PS_MODE_SYNC)
        return;
    c->rb_pending = 1;
    char m[160];
    uint64_t version = c->rb_version;
    snprintf(m, sizeof m, "the fleet rolls back to version %" PRIu64 " (a server was restored)",
             version);
    zps_log(ZPS_WARN, "client", "%s", m);
    for (uint32_t i = 0; i < PS_CLIENT_SLOTS; i++) {
        ps_client_slot *sl = &c->slots[i];
        if (sl->rid && sl->ticket && sl->op != ZPS__OP__OP_ROLLBACK)
            ps_client_slot_finish(c, sl, ZPS_ERR_STALE, m, version);
    }
}

/* What any reply says about its server: a new process, a rollback we did not know. */
static void s_note_server(ps_client *c, int server, const Zps__Header *h)
{
    if (h->server_incarnation && c->incarnation[server] != h->server_incarnation) {
        if (c->incarnation[server])
            zps_log(ZPS_WARN, "client", "server %d (%s) was restarted", server, c->uris[server]);
        c->incarnation[server] = h->server_incarnation;
    }
    if (h->rollback_token > c->rb_token) { // tokens grow with time: a newer one wins
        c->rb_token = h->rollback_token;
        c->rb_version = h->rollback_version;
        s_rollback_seen(c);
    } else if (h->rollback_token < c->rb_token && h->status == ZPS_ERR_STALE) {
        /* refused by a server that has not taken the newest rollback (every server was
         * restored, each with its own; or it missed ours): it must roll back too */
        s_rollback_seen(c);
    }
}

void ps_client_resend_server(ps_client *c, int server)
{
    for (uint32_t i = 0; i < PS_CLIENT_SLOTS; i++) {
        ps_client_slot *sl = &c->slots[i];
        if (!sl->rid || sl->server != server || sl->await_reg || sl->done)
            continue;
        zps_status st = ps_client_send_slot(c, sl, NULL);
        if (st != ZPS_OK && sl->ticket)
            ps_client_slot_finish(c, sl, st, ps_client_send_err(c, server, st), UINT64_MAX);
        else if (st != ZPS_OK)
            ps_client_slot_release(c, sl);
    }
}

/* A reply the shared-memory path could not serve (the server refused the staged gradients,
 * or the values read from its segment were torn): 1 when sl was sent again, frames only. */
static int s_shm_redo(ps_client *c, ps_client_slot *sl, const Zps__Header *h, int status)
{
    int refused = sl->shm_data && status == ZPS_ERR_FRAMES;
    int torn = status == ZPS_OK && h->shm_values && sl->dst &&
               (sl->op == ZPS__OP__OP_PULL || sl->op == ZPS__OP__OP_PUSHPULL) &&
               ps_client_shm_take(c, sl, h) != 0;
    if (!refused && !torn)
        return 0;
    ps_client_shm_done(c, sl);
    sl->no_shm = 1;
    zps_status st = ps_client_send_slot(c, sl, NULL);
    if (st != ZPS_OK)
        ps_client_slot_finish(c, sl, st, ps_client_send_err(c, sl->server, st), UINT64_MAX);
    return 1;
}

void ps_client_handle_reply(ps_client *c, int server, int nframes)
{
    Zps__Header *h = zps__header__unpack(NULL, zmq_msg_size(&c->frames[0]),
                                         zmq_msg_data(&c->frames[0]));
    if (!h) {
        zps_log(ZPS_WARN, "client", "server %d sent an unreadable reply header", server);
        return;
    }
    s_note_server(c, server, h);
    ps_client_shm_offer(c, server, h);
    ps_client_slot *sl = s_reply_slot(c, server, h);
    int status = h->status;
    const char *msg = h->message ? h->message : "";
    if (!sl || s_lost_registration(c, server, sl, status)) {
        /* dropped, or resent once the server knows us again */
    } else if (s_shm_redo(c, sl, h, status)) {
        /* asked again through ZeroMQ */
    } else if (sl->op == ZPS__OP__OP_REGISTER && !sl->ticket) {
        ps_client_slot_release(c, sl);
        s_reregistered(c, server, status, msg);
    } else {
        if (status == ZPS_ERR_EXISTS && sl->op == ZPS__OP__OP_REGISTER)
            ps_client_note_holder(c, h);
        if (status == ZPS_OK)
            status = ps_client_take_reply(c, sl, h, nframes, &msg);
        ps_client_slot_finish(c, sl, status, msg, h->model_version);
    }
    zps__header__free_unpacked(h, NULL);
}

void ps_client_fail_server(ps_client *c, int server)
{
    for (uint32_t i = 0; i < PS_CLIENT_SLOTS; i++) {
        ps_client_slot *sl = &c->slots[i];
        if (!sl->rid || sl->server != server)
            continue;
        if (sl->ticket)
            ps_client_slot_finish(c, sl, ZPS_ERR_UNAUTHORIZED, c->refused[server], UINT64_MAX);
        else
            ps_client_slot_release(c, sl);
    }
    c->reg_inflight[server] = 0;
}

/* ------------------------------------------------------------------------- timers */

/* Slot sl (busy) at time now: resend it when its back-off ended, schedule a resend when its
 * deadline passed, or fail it after max_retries. */
static void s_slot_timer(ps_client *c, ps_client_slot *sl, uint64_t now)
{
    if (sl->resend_at_ns) {
        zps_status st = now >= sl->resend_at_ns ? ps_client_send_slot(c, sl, NULL) : ZPS_OK;
        if (st != ZPS_OK)
            ps_client_slot_finish(c, sl, st, ps_client_send_err(c, sl->server, st), UINT64_MAX);
        return;
    }
    if (now < sl->deadline_ns)
        return;
    if (!sl->ticket) { // internal: heartbeat or re-register
        if (sl->op == ZPS__OP__OP_REGISTER) {
            ps_client_slot_release(c, sl);
            s_reregistered(c, sl->server, ZPS_ERR_TIMEOUT, "re-register timed out");
        } else {
            ps_client_slot_release(c, sl);
        }
        return;
    }
    if (sl->attempts >= c->o.max_retries) {
        char m[128];
        snprintf(m, sizeof m, "no reply after %d attempts of %d ms", sl->attempts + 1,
                 c->o.timeout_ms);
        ps_client_slot_finish(c, sl, ZPS_ERR_TIMEOUT, m, UINT64_MAX);
        return;
    }
    sl->attempts++;
    sl->await_reg = 0;
    zps_log(ZPS_WARN, "client", "no reply from server %d to request %" PRIu64 " (attempt %d); resending",
            sl->server, sl->rid, sl->attempts);
    sl->resend_at_ns = now + (uint64_t)c->o.backoff_ms * 1000000ull * (1ull << (sl->attempts - 1));
}

void ps_client_timeouts(ps_client *c)
{
    uint64_t now = zps_now_ns();
    if (now - c->last_timeouts_ns < 2000000ull)
        return;
    c->last_timeouts_ns = now;
    ps_client_handshakes(c);
    for (uint32_t i = 0; i < PS_CLIENT_SLOTS; i++)
        if (c->slots[i].rid)
            s_slot_timer(c, &c->slots[i], now);
    if (c->o.heartbeat_ms > 0 && c->registered)
        for (int s = 0; s < c->n; s++)
            if (now - c->last_sent_ns[s] > (uint64_t)c->o.heartbeat_ms * 1000000ull) {
                ps_client_slot *sl = ps_client_slot_new(c, s, 0, ZPS__OP__OP_HEARTBEAT, 0);
                if (sl && ps_client_send_slot(c, sl, NULL) != ZPS_OK)
                    ps_client_slot_release(c, sl);
                else if (sl)
                    sl->deadline_ns = now + (uint64_t)c->o.heartbeat_ms * 4000000ull;
            }
}

/* ------------------------------------------------------------------------- waiting */

void ps_client_set_deadline(ps_client *c, int ms)
{
    c->deadline_ns = ms > 0 ? zps_now_ns() + (uint64_t)ms * 1000000ull : 0;
}

/* Why a wait must end before its ticket completed: the stop flag (ZPS_ERR_INTERRUPTED) or
 * the deadline (ZPS_ERR_TIMEOUT), with c->err saying so; ZPS_OK to go on waiting. Checked
 * before every poll slice, so a stop is noticed within one slice. */
static zps_status s_wait_cut(ps_client *c, int open)
{
    if (c->deadline_ns) {
        if (zps_now_ns() < c->deadline_ns)
            return ZPS_OK;
        snprintf(c->err, sizeof c->err, "%d request(s) unanswered at the deadline", open);
        return ZPS_ERR_TIMEOUT;
    }
    if (c->o.stop && *c->o.stop) {
        snprintf(c->err, sizeof c->err, "interrupted: stopping");
        return ZPS_ERR_INTERRUPTED;
    }
    return ZPS_OK;
}

zps_status ps_client_wait_ticket(ps_client *c, ps_ticket t, uint64_t *version, int mark_waited)
{
    ps_client_ticket *tk = ps_client_ticket_get(c, t);
    if (!tk) {
        snprintf(c->err, sizeof c->err, "ticket %" PRIu64 " is unknown or expired", t);
        return ZPS_ERR_NOT_FOUND;
    }
    while (tk->open > 0) {
        ZPS_TRY(s_wait_cut(c, tk->open));
        int ms = c->o.heartbeat_ms > 0 && c->o.heartbeat_ms < 100 ? c->o.heartbeat_ms : 100;
        ZPS_TRY(ps_client_pump(c, ms));
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
    ps_client_ticket *tk = ps_client_ticket_get(c, t);
    if (!tk)
        return ZPS_ERR_NOT_FOUND;
    uint64_t end = zps_now_ns() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000ull;
    do {
        if (tk->open <= 0)
            break;
        ZPS_TRY(s_wait_cut(c, tk->open));
        uint64_t now = zps_now_ns();
        int ms = now >= end ? 0 : (int)((end - now) / 1000000ull);
        ZPS_TRY(ps_client_pump(c, ms > 100 ? 100 : ms));
    } while (zps_now_ns() < end);
    *done = tk->open <= 0;
    return ZPS_OK;
}

zps_status ps_client_progress(ps_client *c) { return ps_client_pump(c, 0); }

uint64_t ps_client_done_ns(ps_client *c, ps_ticket t)
{
    ps_client_ticket *tk = ps_client_ticket_get(c, t);
    return tk && tk->open <= 0 ? tk->done_ns : 0;
}

zps_status ps_client_wait(ps_client *c, ps_ticket t)
{
    return ps_client_wait_ticket(c, t, NULL, 1);
}

zps_status ps_client_wait_version(ps_client *c, ps_ticket t, uint64_t *version)
{
    return ps_client_wait_ticket(c, t, version, 1);
}

zps_status ps_client_wait_all(ps_client *c)
{
    zps_status first = ZPS_OK;
    for (uint32_t i = 0; i < PS_CLIENT_TICKETS; i++) {
        ps_client_ticket *tk = &c->tickets[i];
        if (!tk->id || tk->waited)
            continue;
        zps_status st = ps_client_wait_ticket(c, tk->id, NULL, 1);
        if (st != ZPS_OK && first == ZPS_OK)
            first = st;
    }
    if (first != ZPS_OK)
        for (uint32_t i = 0; i < PS_CLIENT_TICKETS; i++)
            if (c->tickets[i].id && c->tickets[i].status == first) {
                snprintf(c->err, sizeof c->err, "%s", c->tickets[i].msg);
                break;
            }
    return first;
}
