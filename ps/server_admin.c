/* server_admin.c — the operator's ops (server_int.h; docs/ps.md "Admin ops"): STATS,
 * CHECKPOINT (now, or as a consistent cut of one version in sync mode) and SHUTDOWN with
 * its drain. zps-ctl sends them; zps-trainer --shutdown-servers sends SHUTDOWN too.
 *
 * Invariants:
 *   - A cut of version V is written only when every chunk of this server is at V exactly;
 *     in sync mode no chunk can pass V before every chunk of every server reached it (that
 *     needs every trainer to have pulled the whole model at V), so the files of V on all
 *     servers form one model. A server already past V answers ZPS_ERR_STALE (the caller
 *     asks again with a later version); one not there yet keeps the request (at most
 *     PS_SRV_CUT_WAITS) and answers when it gets there, or ZPS_ERR_STALE if it went past.
 *   - SHUTDOWN at a version (sync, zps-ctl) is a cut too: until every chunk is there, pushes
 *     for that step or later are refused (ZPS_ERR_SHUTDOWN), so no chunk passes it; then the
 *     final checkpoint is that cut on every server.
 *   - SHUTDOWN writes the final checkpoint and replies first; then the server drains: every
 *     trainer request but LEAVE is answered ZPS_ERR_SHUTDOWN, so trainers end with a clear
 *     reason instead of waiting out their timeouts; nothing changes the values any more.
 *     The loop stops once no registered trainer is live (they LEAVE when told) or after
 *     PS_SRV_DRAIN_S.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "ps/ckpt.h"
#include "ps/server_int.h"

static void s_op_stats(ps_server *s, zmq_msg_t *ident, const Zps__Header *h)
{
    size_t need = ps_srv_stats_json(s, NULL, 0) + 1;
    char *json = zps_xmalloc(need);
    ps_srv_stats_json(s, json, need);
    ps_srv_reply r = {h->op, h->request_id, ZPS_OK, json, ps_srv_min_version(s), 1, 1, 0, 0};
    ps_srv_send(s, ident, &r, NULL, 0);
    free(json);
}

/* Writes a checkpoint (cut: also the versioned file, where the fleet keeps them) and
 * answers rid with "version V: PATH [VERSIONED PATH]", or the failure. */
static void s_checkpoint_reply(ps_server *s, zmq_msg_t *ident, int op, uint64_t rid, int cut)
{
    uint64_t v = ps_srv_min_version(s);
    zps_status st = ps_srv_write_checkpoint(s, cut);
    if (st != ZPS_OK) {
        ps_srv_reject(s, ident, op, rid, st, "checkpoint failed (see the server log)");
        return;
    }
    char path[1100], vpath[1100], msg[2300];
    ps_ckpt_path(s->cfg.checkpoint_dir, s->cfg.index, path, sizeof path);
    ps_ckpt_version_path(s->cfg.checkpoint_dir, s->cfg.index, v, vpath, sizeof vpath);
    /* the versioned link exists when the fleet keeps them (--checkpoint-every-versions) */
    int linked = cut && access(vpath, F_OK) == 0;
    snprintf(msg, sizeof msg, "version %" PRIu64 ": %s%s%s", v, path, linked ? " " : "",
             linked ? vpath : "");
    ps_srv_reply r = {op, rid, ZPS_OK, msg, v, 0, 0, 0, 0};
    ps_srv_send(s, ident, &r, NULL, 0);
}

/* The final checkpoint of a SHUTDOWN at cut version `at` that this server has gone past:
 * the file of the cut it wrote at that version (the versioned copy, or the latest file if no
 * checkpoint came after it) becomes server-I.ckpt. ZPS_ERR_STALE when it has neither. */
static zps_status s_final_from_cut(ps_server *s, uint64_t at)
{
    char path[1100], vpath[1100], tmp[1200];
    ps_ckpt_path(s->cfg.checkpoint_dir, s->cfg.index, path, sizeof path);
    ps_ckpt_version_path(s->cfg.checkpoint_dir, s->cfg.index, at, vpath, sizeof vpath);
    if (s->cut_written != at + 1)
        return ZPS_ERR_STALE;
    if (s->last_ckpt_version == at)
        return ZPS_OK; /* server-I.ckpt is that cut already */
    snprintf(tmp, sizeof tmp, "%s.final", vpath);
    if (access(vpath, F_OK) != 0)
        return ZPS_ERR_STALE;
    if (link(vpath, tmp) != 0 || rename(tmp, path) != 0) {
        zps_log(ZPS_ERROR, "ps", "%s -> %s: %s", vpath, path, strerror(errno));
        unlink(tmp);
        return ZPS_ERR_IO;
    }
    return ZPS_OK;
}

/* SHUTDOWN's work: the final checkpoint (a cut when every chunk is at one version; with
 * from_cut, the cut of that version this server wrote before training went on), the reply,
 * everyone waiting told, and the drain (ps_srv_admin_tick ends it). */
static void s_shutdown_now(ps_server *s, zmq_msg_t *ident, uint64_t rid, uint32_t sender,
                           const uint64_t *from_cut)
{
    zps_status st = from_cut ? s_final_from_cut(s, *from_cut)
                             : ps_srv_write_checkpoint(s, 1); // every server at its end
    char msg[200];
    if (from_cut)
        snprintf(msg, sizeof msg, "shutting down at the cut of version %" PRIu64 " (this server "
                 "had gone on to %" PRIu64 "; its final checkpoint is the cut's)", *from_cut,
                 ps_srv_max_version(s));
    ps_srv_reply r = {ZPS__OP__OP_SHUTDOWN, rid, st,
                      from_cut ? msg
                      : st == ZPS_OK ? "shutting down" : "shutting down; checkpoint failed",
                      from_cut ? *from_cut : ps_srv_min_version(s), 0, 0, 0, 0};
    ps_srv_send(s, ident, &r, NULL, 0);
    if (sender < s->n_trainers)
        zps_log(ZPS_INFO, "ps", "SHUTDOWN from trainer %u", sender);
    else
        zps_log(ZPS_INFO, "ps", "SHUTDOWN from zps-ctl at version %" PRIu64 "%s", r.version,
                from_cut ? " (the cut it wrote; it had trained on)" : "");
    /* whoever waits hears it now; the rest when they next ask (ps_srv_check_message) */
    while (s->n_pending) {
        ps_srv_pending *p = &s->pending[0];
        ps_srv_reply pr = {p->op, p->rid, ZPS_ERR_SHUTDOWN, "server shutting down",
                           ps_srv_min_version(s), 0, 0, 0, 0};
        ps_srv_send(s, &p->ident, &pr, NULL, 0);
        ps_srv_pending_drop(s, 0);
    }
    s->drain_sender = sender;
    s->drain_until = zps_now_s() + PS_SRV_DRAIN_S;
    while (s->n_cut_waits) {
        ps_srv_cut_wait *w = &s->cut_waits[0];
        ps_srv_reject(s, &w->ident, w->op, w->rid, ZPS_ERR_SHUTDOWN,
                      "server shutting down before that version");
        zmq_msg_close(&w->ident);
        s->cut_waits[0] = s->cut_waits[--s->n_cut_waits];
    }
    ps_srv_admin_tick(s);
}

/* A cut's version reached (st ZPS_OK: write it, or shut down at it) or missed (st, why):
 * wait i is answered and leaves the list. */
static void s_cut_done(ps_server *s, uint32_t i, zps_status st, const char *why)
{
    ps_srv_cut_wait w = s->cut_waits[i];
    s->cut_waits[i] = s->cut_waits[--s->n_cut_waits];
    if (w.op == ZPS__OP__OP_SHUTDOWN) {
        s->stop_at = 0;
        for (uint32_t k = 0; k < s->n_cut_waits; k++) // another SHUTDOWN still stops there
            if (s->cut_waits[k].op == ZPS__OP__OP_SHUTDOWN)
                s->stop_at = s->cut_waits[k].version + 1;
    }
    if (st != ZPS_OK)
        ps_srv_reject(s, &w.ident, w.op, w.rid, st, why);
    else if (w.op == ZPS__OP__OP_SHUTDOWN)
        s_shutdown_now(s, &w.ident, w.rid, w.sender, NULL);
    else
        s_checkpoint_reply(s, &w.ident, w.op, w.rid, 1);
    if (st == ZPS_OK && w.op == ZPS__OP__OP_CHECKPOINT)
        s->cut_written = w.version + 1;
    zmq_msg_close(&w.ident);
}

/* A cut of h->cut_version (CHECKPOINT, or SHUTDOWN at that version): done now when every
 * chunk is there, refused when one is past it, else kept until it is reached. A SHUTDOWN
 * waiting for its version stops pushes that would take a chunk past it (s->stop_at). */
static void s_op_cut(ps_server *s, zmq_msg_t *ident, const Zps__Header *h)
{
    char why[200];
    zps_status st = ZPS_OK;
    uint64_t v = ps_srv_min_version(s), top = ps_srv_max_version(s), want = h->cut_version;
    if (top > want && h->op == ZPS__OP__OP_SHUTDOWN && s->cut_written == want + 1) {
        /* zps-ctl's second phase: the fleet agreed on the cut of `want`, written by every
         * server, and this one trained on while the others were being told */
        s_shutdown_now(s, ident, h->request_id, h->trainer_id, &want);
        return;
    }
    if (top > want) {
        st = ZPS_ERR_STALE;
        snprintf(why, sizeof why, "server %d is past version %" PRIu64 " (chunks at %" PRIu64
                 "..%" PRIu64 "): ask for a later one", s->cfg.index, want, v, top);
    } else if (v < want && s->n_cut_waits == PS_SRV_CUT_WAITS) {
        st = ZPS_ERR_BUSY;
        snprintf(why, sizeof why, "%d requests already wait for their version", PS_SRV_CUT_WAITS);
    }
    if (st != ZPS_OK) {
        ps_srv_reject(s, ident, h->op, h->request_id, st, why);
        return;
    }
    ps_srv_cut_wait *w = &s->cut_waits[s->n_cut_waits++];
    zmq_msg_init(&w->ident);
    zmq_msg_copy(&w->ident, ident);
    w->rid = h->request_id;
    w->version = want;
    w->op = h->op;
    w->sender = h->trainer_id;
    if (h->op == ZPS__OP__OP_SHUTDOWN && (!s->stop_at || want + 1 < s->stop_at)) {
        s->stop_at = want + 1;
        if (v < want)
            zps_log(ZPS_INFO, "ps", "SHUTDOWN at version %" PRIu64 " (now %" PRIu64 "): pushes "
                    "for later steps are refused from now on", want, v);
    }
    ps_srv_admin_progress(s); // done at once when the version is there
}

static void s_op_checkpoint(ps_server *s, zmq_msg_t *ident, const Zps__Header *h)
{
    char why[200];
    zps_status st = ZPS_OK;
    if (!s->cfg.checkpoint_dir[0]) {
        st = ZPS_ERR_UNSUPPORTED;
        snprintf(why, sizeof why, "no --checkpoint-dir");
    } else if (!s->initialised) {
        st = ZPS_ERR_NOT_INIT;
        snprintf(why, sizeof why, "no INIT yet: nothing to checkpoint");
    }
    if (st != ZPS_OK)
        ps_srv_reject(s, ident, h->op, h->request_id, st, why);
    else if (h->cut)
        s_op_cut(s, ident, h);
    else
        s_checkpoint_reply(s, ident, h->op, h->request_id, 0);
}

void ps_srv_admin_progress(ps_server *s)
{
    uint64_t v = ps_srv_min_version(s), top = ps_srv_max_version(s);
    for (uint32_t i = 0; i < s->n_cut_waits && s->drain_until <= 0;) {
        uint64_t want = s->cut_waits[i].version;
        if (v == want && top == want) {
            s_cut_done(s, i, ZPS_OK, NULL);
        } else if (top > want) {
            char why[160];
            snprintf(why, sizeof why, "server %d went past version %" PRIu64 " (to %" PRIu64
                     ") before all its chunks were there: ask for a later one", s->cfg.index,
                     want, top);
            s_cut_done(s, i, ZPS_ERR_STALE, why);
        } else {
            i++;
        }
    }
}

static void s_op_shutdown(ps_server *s, zmq_msg_t *ident, const Zps__Header *h)
{
    if (s->drain_until > 0) {
        ps_srv_reply r = {h->op, h->request_id, ZPS_OK, "already shutting down",
                          ps_srv_min_version(s), 0, 0, 0, 0};
        ps_srv_send(s, ident, &r, NULL, 0);
    } else if (h->cut && s->initialised) {
        s_op_cut(s, ident, h);
    } else {
        s_shutdown_now(s, ident, h->request_id, h->trainer_id, NULL);
    }
}

void ps_srv_admin_tick(ps_server *s)
{
    if (s->n_cut_waits) // versions also move outside pushes (a dropped trainer's sync apply)
        ps_srv_admin_progress(s);
    if (s->drain_until <= 0)
        return;
    uint32_t live = 0;
    for (uint32_t t = 0; t < s->n_trainers; t++)
        live += s->trainers && s->trainers[t].registered && !s->trainers[t].dropped &&
                t != s->drain_sender;
    if (!live || zps_now_s() >= s->drain_until) {
        if (live)
            zps_log(ZPS_INFO, "ps", "%u trainer(s) did not leave within %.0f s of SHUTDOWN",
                    live, PS_SRV_DRAIN_S);
        s->stop = 1;
    }
}

void ps_srv_op_admin(ps_server *s, zmq_msg_t *ident, const Zps__Header *h)
{
    switch (h->op) {
    case ZPS__OP__OP_STATS:
        s_op_stats(s, ident, h);
        break;
    case ZPS__OP__OP_CHECKPOINT:
        s_op_checkpoint(s, ident, h);
        break;
    case ZPS__OP__OP_SHUTDOWN:
        s_op_shutdown(s, ident, h);
        break;
    default:
        break;
    }
}
