/* server_consistency.c — the consistency modes (server_int.h, docs/ps.md "Modes"): sync
 * coverage and apply, async / ssp bookkeeping, ssp clocks, requests that wait (sync and ssp
 * pulls, the barrier), and liveness (which trainers are waited for).
 *
 * Invariants:
 *   - sync: recv_n[c * N + t] counts the elements trainer t pushed for chunk c at the chunk's
 *     current version; t is complete when it equals the chunk's count. When
 *     max(1, min(R, live)) trainers are complete, their gradients are summed in trainer-id
 *     order, divided by that number, applied, and every recv_n of the chunk is reset: the
 *     result does not depend on arrival order (bit-reproducible).
 *   - sync: a trainer's coverage bits say which elements it pushed at their chunk's current
 *     version; a push repeating one is refused whole and leaves the bits as they were.
 *   - async / ssp: a chunk's version counts the trainer pushes that covered it whole; a
 *     trainer's clock is its largest pushed step + 1, and an ssp pull at step s waits until
 *     the slowest live trainer's clock is at least s - staleness.
 *   - A trainer that timed out is not waited for (sync aggregation, ssp clocks, barrier)
 *     until it speaks again; one that left, until it registers again (its requests still
 *     on their way do not bring it back). The check runs whenever one drops
 *     (ps_srv_after_drop).
 *   - The per-trainer sync accumulators and held frames are allocated once and reused.
 *   - Liveness also decides who holds a trainer id (ps_srv_incarnation_live): a holder that
 *     left, was dropped, or is silent past the timeout can be replaced.
 *   - A sync rollback (ps_srv_sync_reset) leaves no trace of the abandoned timeline: no held
 *     range, coverage bit or count, and no waiting pull.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/simd.h"
#include "common/bits.h"
#include "ps/server_int.h"

/* Frames at least this large and float-aligned are held by reference (ps_srv_held). */
#define S_HOLD_MIN 4096

uint32_t ps_srv_live(const ps_server *s)
{
    uint32_t n = 0;
    for (uint32_t t = 0; t < s->n_trainers; t++)
        n += !s->trainers[t].dropped;
    return n;
}

static uint32_t s_need_replicas(const ps_server *s)
{
    uint32_t r = s->replicas ? s->replicas : s->n_trainers, live = ps_srv_live(s);
    if (live < r)
        r = live;
    return r ? r : 1;
}

static int64_t s_min_clock(const ps_server *s)
{
    int64_t m = INT64_MAX;
    for (uint32_t t = 0; t < s->n_trainers; t++)
        if (!s->trainers[t].dropped && s->trainers[t].clock < m)
            m = s->trainers[t].clock;
    return m == INT64_MAX ? 0 : m;
}

static int64_t s_max_clock(const ps_server *s)
{
    int64_t m = 0;
    for (uint32_t t = 0; t < s->n_trainers; t++)
        if (s->trainers[t].clock > m)
            m = s->trainers[t].clock;
    return m;
}

/* ------------------------------------------------------------------------- trainers */

void ps_srv_trainers_ensure(ps_server *s)
{
    if (!s->n_trainers)
        return;
    if (!s->trainers) {
        s->trainers = zps_xcalloc(s->n_trainers, sizeof *s->trainers);
        uint64_t now = zps_now_ns();
        for (uint32_t t = 0; t < s->n_trainers; t++)
            s->trainers[t].last_seen_ns = now;
    }
    if (s->initialised && !s->recv_n)
        s->recv_n = zps_xcalloc((size_t)s->n_local * s->n_trainers, sizeof *s->recv_n);
}

/* Drops the trainer's held ranges of local chunk lc (UINT32_MAX: all). */
static void s_held_release(ps_srv_trainer *tr, uint32_t lc)
{
    size_t k = 0;
    for (size_t i = 0; i < tr->n_held; i++) {
        ps_srv_held *e = &tr->held[i];
        if (lc == UINT32_MAX || e->lc == lc) {
            if (e->has_msg)
                zmq_msg_close(&e->msg);
            continue;
        }
        if (k != i) {
            tr->held[k] = *e;
            if (e->has_msg) {
                zmq_msg_init(&tr->held[k].msg);
                zmq_msg_move(&tr->held[k].msg, &e->msg);
            }
        }
        k++;
    }
    tr->n_held = k;
}

void ps_srv_trainers_release(ps_server *s)
{
    if (!s->trainers)
        return;
    for (uint32_t t = 0; t < s->n_trainers; t++) {
        ps_srv_trainer *tr = &s->trainers[t];
        s_held_release(tr, UINT32_MAX);
        zps_aligned_free(tr->accum);
        free(tr->held);
        free(tr->covered);
        tr->covered = NULL;
        tr->accum = NULL;
        tr->held = NULL;
        tr->cap_held = 0;
    }
}

void ps_srv_seen(ps_server *s, uint32_t t)
{
    ps_srv_trainer *tr = &s->trainers[t];
    tr->last_seen_ns = zps_now_ns();
    tr->left = 0;
    if (tr->dropped) {
        tr->dropped = 0;
        s->st.trainers_rejoined++;
        zps_log(ZPS_INFO, "ps", "trainer %u is back (rejoined; %u live)", t, ps_srv_live(s));
    }
}

int ps_srv_rid_seen(const ps_srv_trainer *tr, uint64_t rid, int *status)
{
    for (int i = 0; i < PS_SRV_RID_RING; i++)
        if (tr->rid[i] == rid && rid) {
            *status = tr->rid_status[i];
            return 1;
        }
    return 0;
}

void ps_srv_rid_note(ps_srv_trainer *tr, uint64_t rid, int status)
{
    tr->rid[tr->rid_pos % PS_SRV_RID_RING] = rid;
    tr->rid_status[tr->rid_pos % PS_SRV_RID_RING] = status;
    tr->rid_pos++;
}

/* ------------------------------------------------------------------------- sync */

/* Keeps the pushed range g (frame f) of trainer tr until its chunk is applied. */
static void s_held_add(ps_server *s, ps_srv_trainer *tr, const ps_srv_range *g, zmq_msg_t *f)
{
    if (tr->n_held == tr->cap_held) {
        tr->cap_held = tr->cap_held ? 2 * tr->cap_held : 64;
        /* realloc moves the zmq_msg_t bytes: safe for the frames held here, whose data is
         * never inside the zmq_msg_t (only frames of up to 33 bytes are, S_HOLD_MIN) */
        tr->held = zps_xrealloc(tr->held, tr->cap_held * sizeof *tr->held);
    }
    ps_srv_held *e = &tr->held[tr->n_held];
    e->lc = g->lc, e->off = g->off, e->n = g->n, e->has_msg = 0;
    if (g->shm && s->req_op == ZPS__OP__OP_PUSHPULL) {
        /* in the trainer's shared-memory slot, which it rewrites only after this PUSHPULL's
         * reply, and that comes after the apply: read it there (a PUSH's reply comes before
         * the apply, so its bytes are copied below) */
        e->data = g->data;
        tr->n_held++;
        return;
    }
    if (!g->shm && ps_srv_range_in_place(g) && g->n * 4 >= S_HOLD_MIN && zmq_msg_init(&e->msg) == 0) {
        if (zmq_msg_copy(&e->msg, f) == 0) { // shares the buffer: no copy
            e->has_msg = 1;
            e->data = g->data; // into that buffer (a packed frame holds several ranges)
        } else {
            zmq_msg_close(&e->msg);
        }
    }
    if (!e->has_msg) {
        if (!tr->accum)
            tr->accum = zps_xaligned(64, s->local_total * 4 + 64);
        float *dst = tr->accum + s->chunks[g->lc].off + g->off;
        ps_srv_range_to_f32(g, 0, g->n, dst);
        e->data = dst;
    }
    tr->n_held++;
}

ZPS_SIMD_CLONES
static void s_add(float *restrict d, const float *restrict a, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        d[i] += a[i];
}

ZPS_SIMD_CLONES
static void s_div(float *d, float by, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        d[i] = d[i] / by;
}

/* Where trainer t's gradient of chunk lc is whole in its shared-memory slot (every piece it
 * pushed of lc is there: the slot mirrors the chunk layout), the chunk's start in that slot;
 * else NULL. */
static float *s_slot_chunk(const ps_server *s, const ps_srv_trainer *tr, uint32_t t,
                           uint32_t lc)
{
    ps_shm *m = ps_srv_shm(s);
    if (!m)
        return NULL;
    float *base = ps_shm_slot(m, t) + s->chunks[lc].off;
    for (size_t i = 0; i < tr->n_held; i++) {
        const ps_srv_held *e = &tr->held[i];
        if (e->lc == lc && e->data != base + e->off)
            return NULL;
    }
    return base;
}

/* The complete trainers' gradients of chunk lc summed in trainer-id order (whatever the
 * arrival order: bit-reproducible) and averaged; returns where: s->scratch, or the first
 * trainer's own shared-memory slot when its gradient of lc is whole there. That trainer
 * rewrites those bytes only after this push's reply, which follows the apply (shm.h), so the
 * sum may build up in place: the copy into scratch was the largest part of a sync server's
 * work on one host (the same additions in the same order: the same bits). */
static float *s_sync_average(ps_server *s, uint32_t lc)
{
    const ps_srv_chunk *c = &s->chunks[lc];
    const uint32_t *rv = s->recv_n + (size_t)lc * s->n_trainers;
    float *g = s->scratch;
    uint32_t used = 0;
    for (uint32_t t = 0; t < s->n_trainers; t++) {
        if (rv[t] != c->count)
            continue;
        const ps_srv_trainer *tr = &s->trainers[t];
        float *in_place = used ? NULL : s_slot_chunk(s, tr, t, lc);
        if (in_place) {
            g = in_place;
            used++;
            continue;
        }
        for (size_t i = 0; i < tr->n_held; i++) {
            const ps_srv_held *e = &tr->held[i];
            if (e->lc != lc)
                continue;
            if (!used)
                memcpy(g + e->off, e->data, e->n * 4);
            else
                s_add(g + e->off, e->data, e->n);
        }
        used++;
    }
    s_div(g, (float)used, c->count);
    return g;
}

/* sync: applies chunk lc if enough trainers are complete. */
static void s_sync_try_apply(ps_server *s, uint32_t lc)
{
    ps_srv_chunk *c = &s->chunks[lc];
    if (c->n_complete == 0 || c->n_complete < s_need_replicas(s))
        return;
    const float *g = s_sync_average(s, lc);
    ps_srv_wait_readers(s, lc);
    ps_shm *shm = ps_srv_shm(s);
    float *sp[2];
    if (shm)
        ps_shm_write_begin(shm, lc);
    ps_apply_pool_run(s->apply, &s->opt, c->version, s->values + c->off,
                      ps_srv_slot_ptrs(s, c->off, sp), g, c->count);
    if (shm)
        ps_shm_write_end(shm, lc);
    c->version++;
    uint32_t *rv = s->recv_n + (size_t)lc * s->n_trainers;
    for (uint32_t t = 0; t < s->n_trainers; t++) {
        if (rv[t] && rv[t] != c->count)
            s->st.stale_dropped++;
        rv[t] = 0;
        s_held_release(&s->trainers[t], lc);
        if (s->trainers[t].covered)
            zps_bits_put(s->trainers[t].covered, c->off, c->off + c->count, 0);
    }
    c->n_complete = 0;
    s->st.updates++;
}

/* Marks the elements of the n ranges pushed at step for their chunk's current version in
 * tr's coverage bits. Returns the first range that repeats an element (UINT32_MAX: none),
 * with the bits set so far cleared again: state untouched. */
static uint32_t s_sync_cover(ps_server *s, ps_srv_trainer *tr, int64_t step, uint32_t n)
{
    if (!tr->covered)
        tr->covered = zps_xcalloc((s->local_total + 63) / 64, sizeof *tr->covered);
    uint32_t bad = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++) {
        const ps_srv_range *g = &s->ranges[i];
        const ps_srv_chunk *c = &s->chunks[g->lc];
        if (step != (int64_t)c->version)
            continue;
        uint64_t lo = c->off + g->off;
        if (zps_bits_any(tr->covered, lo, lo + g->n)) {
            bad = i;
            break;
        }
        zps_bits_put(tr->covered, lo, lo + g->n, 1);
    }
    for (uint32_t i = 0; bad != UINT32_MAX && i < bad; i++) {
        const ps_srv_range *g = &s->ranges[i];
        const ps_srv_chunk *c = &s->chunks[g->lc];
        if (step == (int64_t)c->version)
            zps_bits_put(tr->covered, c->off + g->off, c->off + g->off + g->n, 0);
    }
    return bad;
}

zps_status ps_srv_sync_push(ps_server *s, const Zps__Header *h, uint32_t *stale,
                            uint32_t *ahead, char *why, size_t why_len)
{
    uint32_t t = h->trainer_id, n = (uint32_t)h->n_ranges;
    ps_srv_trainer *tr = &s->trainers[t];
    int64_t step = h->step;
    uint32_t bad = s_sync_cover(s, tr, step, n);
    if (bad != UINT32_MAX) {
        const ps_srv_range *g = &s->ranges[bad];
        snprintf(why, why_len, "range %u: elements %" PRIu64 "..%" PRIu64 " of chunk %u pushed "
                 "more than once for step %" PRId64, bad, g->off, g->off + g->n - 1,
                 s->chunks[g->lc].key, step);
        return ZPS_ERR_INVALID;
    }
    for (uint32_t i = 0; i < n; i++) {
        const ps_srv_range *g = &s->ranges[i];
        ps_srv_chunk *c = &s->chunks[g->lc];
        s->st.pushes++;
        s->st.shm_pushes += g->shm;
        s->st.bytes_in += g->n * (g->bf16 ? 2 : 4);
        if (step < (int64_t)c->version) {
            (*stale)++;
            s->st.stale_dropped++;
            continue;
        }
        if (step > (int64_t)c->version) {
            (*ahead)++;
            continue;
        }
        uint32_t *rv = &s->recv_n[(size_t)g->lc * s->n_trainers + t];
        s_held_add(s, tr, g, &s->frames[2 + (s->req_packed ? 0 : i)]);
        *rv += (uint32_t)g->n;
        if (*rv == c->count) {
            c->n_complete++;
            s_sync_try_apply(s, g->lc);
        }
    }
    return ZPS_OK;
}

/* ------------------------------------------------------------------------- async / ssp */

void ps_srv_async_push(ps_server *s, const Zps__Header *h)
{
    uint32_t t = h->trainer_id, n = (uint32_t)h->n_ranges;
    int64_t step = h->step, maxc = s_max_clock(s);
    for (uint32_t i = 0; i < n; i++) {
        ps_srv_range *g = &s->ranges[i];
        ps_srv_chunk *c = &s->chunks[g->lc];
        g->version = c->version;
        s->st.pushes++;
        s->st.bytes_in += g->n * (g->bf16 ? 2 : 4);
        ps_srv_staleness(s, s->mode == PS_MODE_ASYNC ? (step >= 0 ? (int64_t)c->version - step : 0)
                                                     : maxc - (step + 1));
        uint32_t *rv = &s->recv_n[(size_t)g->lc * s->n_trainers + t];
        *rv += (uint32_t)g->n;
        if (*rv >= c->count) {
            *rv = 0;
            c->version++;
            s->st.updates++;
        }
    }
    ps_srv_trainer *tr = &s->trainers[t];
    if (step + 1 > tr->clock)
        tr->clock = step + 1;
}

/* An ssp pull for step c comes after the trainer pushed step c - 1 (client.h, "Steps"), so
 * its clock is at least c even where this server never saw that push: a restored server
 * starts with every clock at 0, and the pushes the dead process had acknowledged are lost.
 * Without this, two trainers whose last pushes died with it wait in their pulls for each
 * other's clocks for good. */
void ps_srv_ssp_pull_clock(ps_server *s, uint32_t t, int64_t step)
{
    ps_srv_trainer *tr = &s->trainers[t];
    if (step > tr->clock) {
        tr->clock = step;
        ps_srv_check_pending(s);
    }
}

/* ------------------------------------------------------------------------- waiting */

int ps_srv_pending_ready(ps_server *s, const ps_srv_pending *p)
{
    if (p->op == ZPS__OP__OP_BARRIER)
        return 0; // released together in ps_srv_check_barrier
    if (p->need < 0)
        return 1;
    if (s->mode == PS_MODE_SYNC) {
        for (uint32_t i = 0; i < p->n_ranges; i++)
            if ((int64_t)s->chunks[p->ranges[i].lc].version < p->need)
                return 0;
        return 1;
    }
    if (s->mode == PS_MODE_SSP)
        return s_min_clock(s) >= p->need - s->staleness;
    return 1;
}

void ps_srv_pending_drop(ps_server *s, size_t i)
{
    zmq_msg_close(&s->pending[i].ident);
    free(s->pending[i].ranges);
    s->pending[i] = s->pending[--s->n_pending];
}

void ps_srv_pending_add(ps_server *s, zmq_msg_t *ident, uint64_t rid, uint32_t trainer, int op,
                        int64_t need, const ps_srv_range *r, uint32_t n, uint64_t t0)
{
    if (s->n_pending == s->cap_pending) {
        s->cap_pending = s->cap_pending ? 2 * s->cap_pending : 16;
        s->pending = zps_xrealloc(s->pending, s->cap_pending * sizeof *s->pending);
    }
    ps_srv_pending *p = &s->pending[s->n_pending++];
    zmq_msg_init(&p->ident);
    zmq_msg_copy(&p->ident, ident);
    p->rid = rid;
    p->trainer = trainer;
    p->op = op;
    p->need = need;
    p->n_ranges = n;
    p->packed = s->req_packed;
    p->shm_nonce = s->req_shm_nonce;
    p->ranges = NULL;
    if (n) {
        p->ranges = zps_xmalloc(n * sizeof *r);
        memcpy(p->ranges, r, n * sizeof *r);
    }
    p->t0_ns = t0;
}

void ps_srv_check_barrier(ps_server *s)
{
    /* Released when every live trainer is waiting in it (trainers that left may wait too;
     * they are not waited for). */
    uint32_t arrived = 0, waiting = 0;
    for (size_t i = 0; i < s->n_pending; i++)
        if (s->pending[i].op == ZPS__OP__OP_BARRIER) {
            waiting++;
            arrived += !s->trainers[s->pending[i].trainer].dropped;
        }
    if (!waiting || arrived < ps_srv_live(s))
        return;
    for (size_t i = 0; i < s->n_pending;) {
        ps_srv_pending *p = &s->pending[i];
        if (p->op != ZPS__OP__OP_BARRIER) {
            i++;
            continue;
        }
        ps_srv_reply r = {p->op, p->rid, ZPS_OK, "", ps_srv_min_version(s), 0, 0, 0, 0};
        ps_srv_send(s, &p->ident, &r, NULL, 0);
        ps_srv_latency(s, p->op, p->t0_ns);
        ps_srv_pending_drop(s, i);
    }
}

void ps_srv_check_pending(ps_server *s)
{
    for (size_t i = 0; i < s->n_pending;) {
        ps_srv_pending *p = &s->pending[i];
        if (!ps_srv_pending_ready(s, p)) {
            i++;
            continue;
        }
        ps_srv_reply r = {p->op, p->rid, ZPS_OK, "",
                          ps_srv_ranges_version(s, p->ranges, p->n_ranges), 0, 0, p->packed,
                          p->shm_nonce};
        ps_srv_send(s, &p->ident, &r, p->ranges, p->n_ranges);
        ps_srv_latency(s, p->op, p->t0_ns);
        ps_srv_pending_drop(s, i);
    }
    ps_srv_check_barrier(s);
}

void ps_srv_pending_reinit(ps_server *s)
{
    for (size_t i = 0; i < s->n_pending;) {
        ps_srv_pending *p = &s->pending[i];
        if (!p->n_ranges) {
            i++;
            continue;
        }
        ps_srv_reply rr = {p->op, p->rid, ZPS_ERR_BUSY, "values were re-initialised; pull again",
                           0, 0, 0, 0, 0};
        ps_srv_send(s, &p->ident, &rr, NULL, 0);
        ps_srv_pending_drop(s, i);
    }
}

/* ------------------------------------------------------------------------- rollback */

void ps_srv_sync_reset(ps_server *s)
{
    for (uint32_t t = 0; s->trainers && t < s->n_trainers; t++) {
        ps_srv_trainer *tr = &s->trainers[t];
        s_held_release(tr, UINT32_MAX);
        if (tr->covered)
            memset(tr->covered, 0, (s->local_total + 63) / 64 * sizeof *tr->covered);
    }
    if (s->recv_n)
        memset(s->recv_n, 0, (size_t)s->n_local * s->n_trainers * sizeof *s->recv_n);
    for (uint32_t lc = 0; lc < s->n_local; lc++)
        s->chunks[lc].n_complete = 0;
    for (size_t i = 0; i < s->n_pending;) {
        ps_srv_pending *p = &s->pending[i];
        if (!p->n_ranges) {
            i++;
            continue;
        }
        char msg[160];
        snprintf(msg, sizeof msg, "the fleet rolled back to version %" PRIu64 ": pull again",
                 s->rb_version);
        ps_srv_reply rr = {p->op, p->rid, ZPS_ERR_STALE, msg, s->rb_version, 0, 0, 0, 0};
        ps_srv_send(s, &p->ident, &rr, NULL, 0);
        ps_srv_pending_drop(s, i);
    }
}

/* ------------------------------------------------------------------------- liveness */

void ps_srv_after_drop(ps_server *s)
{
    /* sync chunks may be complete now, ssp pulls and barriers may be free to go */
    if (s->mode == PS_MODE_SYNC && s->initialised && s->recv_n)
        for (uint32_t lc = 0; lc < s->n_local; lc++)
            s_sync_try_apply(s, lc);
    ps_srv_check_pending(s); // and barriers
}

int ps_srv_incarnation_live(const ps_server *s, uint32_t t, double *silent_s)
{
    const ps_srv_trainer *tr = &s->trainers[t];
    uint64_t now = zps_now_ns();
    *silent_s = now > tr->last_seen_ns ? (double)(now - tr->last_seen_ns) * 1e-9 : 0;
    double lim = s->cfg.trainer_timeout_s > 0 ? s->cfg.trainer_timeout_s : PS_SRV_IDENT_SILENT_S;
    return tr->registered && !tr->left && !tr->dropped && *silent_s <= lim;
}

void ps_srv_trainer_reset(ps_server *s, uint32_t t)
{
    ps_srv_trainer *tr = &s->trainers[t];
    memset(tr->rid, 0, sizeof tr->rid);
    tr->rid_pos = 0;
    s_held_release(tr, UINT32_MAX);
    if (tr->covered)
        memset(tr->covered, 0, (s->local_total + 63) / 64 * sizeof *tr->covered);
    for (uint32_t lc = 0; s->recv_n && lc < s->n_local; lc++) {
        uint32_t *rv = &s->recv_n[(size_t)lc * s->n_trainers + t];
        if (s->mode == PS_MODE_SYNC && *rv) {
            s->chunks[lc].n_complete -= *rv == s->chunks[lc].count;
            s->st.stale_dropped++;
        }
        *rv = 0;
    }
}

void ps_srv_liveness(ps_server *s)
{
    if (s->cfg.trainer_timeout_s <= 0 || !s->trainers)
        return;
    uint64_t now = zps_now_ns(), lim = (uint64_t)(s->cfg.trainer_timeout_s * 1e9);
    int changed = 0;
    for (uint32_t t = 0; t < s->n_trainers; t++) {
        ps_srv_trainer *tr = &s->trainers[t];
        if (!tr->dropped && now - tr->last_seen_ns > lim) {
            tr->dropped = 1;
            s->st.trainers_dropped++;
            changed = 1;
            zps_log(ZPS_WARN, "ps", "trainer %u silent for %.1f s: dropped from the expected set (%u live)",
                    t, (double)(now - tr->last_seen_ns) * 1e-9, ps_srv_live(s));
        }
    }
    if (changed)
        ps_srv_after_drop(s);
}
