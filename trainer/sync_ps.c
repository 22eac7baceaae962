/* sync_ps.c — --mode sync|async|ssp: the parameter servers hold the values (see sync.h).
 *
 * A step: backward pushes each layer's gradients as soon as they are final (grads_ready,
 * last layer first). sync: each push is a PUSHPULL, so the server answers it with the
 * group's new values as soon as every trainer's gradients of that group arrived and were
 * applied, while this trainer's backward goes on with the layers before it; end_step waits
 * for nothing (docs/ps.md "How a sync step overlaps"). async, ssp: end_step issues the
 * pulls of the new values in forward order, one per layer group, and waits for the pushes.
 * Either way the next forward waits for each group's values just before the layer reads
 * them (nn's forward hook), so the first layers compute while the last ones still arrive;
 * params_ready waits for whatever is left.
 *
 * Invariants:
 *  - A group is the range of variables one backward hook call reported (a layer's, also
 *    with --accumulate > 1); the groups are learnt in the first step that ends well and
 *    fixed from then on. There are at most nvars of them.
 *  - A pushed range is read by the client until its ticket is waited for: end_step (async,
 *    ssp) or params_ready (sync: every PUSHPULL) waits for every push before the next
 *    backward overwrites the gradients.
 *  - sync: a PUSHPULL may write a group's new values into params during the rest of the
 *    backward (whenever the client reads replies): nn calls a layer's hook after its whole
 *    backward, so nothing reads those values again before the next forward (sync.h).
 *  - A bucket is a run of consecutive groups (hook order) over contiguous variables: the
 *    unit of a pull, and in sync of a PUSHPULL, sent once its last group's gradients are
 *    final. sync: buckets of about S_BUCKET_FLOATS, fixed with the groups (a model of many
 *    small layers, Inception-v3's 95, would otherwise send a message per layer and server);
 *    async, ssp and the first step: one group each. pull_t, pull_done are indexed by bucket
 *    in hook order (last layer first).
 *  - The version of the values in params is the oldest version among the pulls that brought
 *    them; the pushes of a step carry it (sync, async) or the trainer's clock (ssp), as
 *    client.h "Steps" says.
 *  - The first push failure is kept: no later push is sent, and
 *    grads_ready and end_step return it.
 *  - Once REGISTER succeeded, every way out sends LEAVE: leave() at the end, abandon() on an
 *    early stop (train.c) or a failed set-up; waits end at once when the stop flag rises.
 */
#include "trainer/sync.h"
#include "trainer/trace.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "ps/client.h"
#include "ps/curve.h"
#include "ps/optim.h"
#include "ps/plan.h"

/* A contiguous range of variables whose gradients become final together (one layer). */
typedef struct s_group {
    int first, n;
} s_group;

/* sync: a bucket closes once it holds this many floats (or at a gap in the variables, or at
 * the last group). 256 Ki floats (1 MiB): Inception-v3 w0.25's 95 groups make 6 buckets, the
 * convnet's 2 (its fc1 alone is 401 Ki floats), and the first buckets' values still come back
 * during backward. Same-host payloads cross in shared memory, so what a bucket costs is its
 * messages' trip through ZeroMQ and the kernel: with 64 Ki-float buckets (about 20 for
 * Inception, a PUSHPULL per server each) a 2-server 2-trainer sync fleet ran at 0.93-0.94 of
 * all-reduce, with 256 Ki at 0.975-0.98, 512 Ki 0.98, 128 Ki 0.96 (Inception; the convnet 0.92
 * against 0.95, with one bucket 0.90: no overlap left). docs/ps.md "How a sync step
 * overlaps". */
#define S_BUCKET_FLOATS 262144

typedef struct s_ps {
    tr_sync base;             // first: the tr_sync the loop holds
    const tr_config *cfg;
    tr_sync_env hook_env;     // model, set_forward_hook, hook_owner: where the pull hook goes
    float *params, *grads;    // (nparams) borrowed from the env
    const uint16_t *grads16;  // (nparams) the env's grads_bf16: pushes send it (NULL: grads)
    size_t nvars, nparams;
    ps_plan *plan;
    ps_client *client;
    ps_ticket *push_t;        // (nvars) tickets of this step's pushes
    int n_push;
    zps_status push_err;      // first push failure (then nothing more is pushed)
    s_group *groups;          // (nvars) groups in hook order (last layer first)
    int n_groups;
    s_group *buckets;         // (nvars) the buckets' variable ranges, hook order
    int n_buckets;
    int n_hook;               // sync: groups reported in this step
    uint64_t *var_count;      // (nvars) floats of each variable
    int *group_bucket;        // (nvars) the bucket of each group
    int groups_known;         // the first step recorded the groups
    ps_ticket *pull_t;        // (nvars) pull (sync: PUSHPULL) ticket of each bucket
    int *var_pull;            // (nvars) the bucket of each variable
    uint8_t *pull_done;       // (nvars) that pull was waited for
    int *stale_b;             // (nvars) sync: the buckets a catch-up pulls (s_catch_up)
    int pulls_pending;
    uint64_t pull_vmin;       // oldest version among the pulls waited for
    zps_status pull_err;      // first failure among them
    uint64_t version;         // model version of the values in params
    uint64_t used_version;    // the version this step computes with
    int noted;                // the step begun last has its version noted (step_version)
    int64_t step;             // the step begun last (0-based)
    int64_t push_step;        // step / clock attached to this step's pushes
    int pushpull;             // sync: every push is a PUSHPULL (its pull rides along)
    int64_t pp_step;          // sync: the step the pending PUSHPULLs carried
    const atomic_int *stop;     // the trainer's stop flag (env)
    int joined;               // REGISTER succeeded: the servers expect this trainer
    int left;                 // LEAVE answered, or abandon() tried it
    uint64_t *step_version;   // (cap_steps) sync: the version step k computed with
    int64_t cap_steps;
    struct tr_trace *trace;   // --trace (NULL: none): each push and pull is a span
    const nn_var *vars;       // (nvars) the model's, to name the spans
    uint64_t *pull_t0;        // (nvars) with trace: when bucket b's pull left
    uint64_t *push_t0;        // (nvars) with trace: when push k left
    int *push_first, *push_n; // (nvars) push k's variables (its span's name and size)
} s_ps;

/* With --trace: ticket t's span, from t0 to its last reply (the reply may have been taken
 * before now: the trace pumps the client as each bucket leaves). */
static void s_trace_transfer(s_ps *p, const char *cat, ps_ticket t, uint64_t t0, int first,
                             int n)
{
    if (!p->trace || !t0)
        return;
    uint64_t end = ps_client_done_ns(p->client, t);
    size_t floats = 0;
    for (int v = first; v < first + n; v++)
        floats += p->vars[v].count;
    tr_trace_async(p->trace, cat, p->vars[first].name, t0, end ? end : zps_now_ns(),
                   (int64_t)floats);
}

/* Logs a failed request; one interrupted by the trainer's stop flag is not a failure. */
static void s_log_fail(const s_ps *p, const char *what, zps_status st)
{
    zps_log(st == ZPS_ERR_INTERRUPTED || st == ZPS_ERR_SHUTDOWN ? ZPS_DEBUG : ZPS_ERROR, "trainer", "%s failed: %s: %s",
            what, zps_strerror(st), ps_client_last_error(p->client));
}

/* Waits for a ticket, adding the time to the step's network wait. */
static zps_status s_wait(s_ps *p, ps_ticket t, uint64_t *version)
{
    uint64_t t0 = zps_now_ns();
    zps_status st = ps_client_wait_version(p->client, t, version);
    p->base.net_wait += (double)(zps_now_ns() - t0) * 1e-9;
    return st;
}

/* ---- recovery (sync: docs/ps.md "Recovery") ---- */

/* The first step that computed with version v or later (the steps to redo start there);
 * the current step when none did: a trainer behind the version the fleet went back to (a
 * straggler of --replicas-to-aggregate) redoes the step that failed with the values of v,
 * rather than skipping its number (its record was never written: the step count fell short). */
static int64_t s_redo_step(const s_ps *p, uint64_t v)
{
    for (int64_t k = 0; k <= p->step && k < p->cap_steps; k++)
        if (p->step_version[k] >= v)
            return k;
    return p->step;
}

/* After a failed wait: when the fleet rolled back, rolls this trainer back too (the servers,
 * then the values of that version into params) and returns ZPS_ERR_STALE with redo_from
 * set, so the loop redoes the steps after it. Otherwise st, unchanged. */
static zps_status s_recover(s_ps *p, zps_status st)
{
    uint64_t v;
    if (!ps_client_rollback_pending(p->client, &v))
        return st;
    zps_status rs = ps_client_rollback(p->client, &v);
    ps_ticket t;
    if (rs == ZPS_OK)
        rs = ps_client_pull(p->client, 0, (int)p->nvars, p->params, (int64_t)v, &t);
    if (rs == ZPS_OK)
        rs = ps_client_wait_version(p->client, t, &p->version);
    if (rs != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "rollback to version %llu failed: %s: %s",
                (unsigned long long)v, zps_strerror(rs), ps_client_last_error(p->client));
        return rs;
    }
    p->used_version = p->version;
    p->pulls_pending = 0;
    p->n_push = 0;
    p->push_err = ZPS_OK;
    p->base.redo_from = s_redo_step(p, v);
    zps_log(ZPS_WARN, "trainer", "the servers rolled back to version %llu: redoing from step %lld",
            (unsigned long long)v, (long long)p->base.redo_from + 1);
    return ZPS_ERR_STALE;
}

/* Notes the version step p->step computes with (sync: where a redo starts). */
static void s_note_step_version(s_ps *p)
{
    if (p->step >= p->cap_steps) {
        int64_t cap = p->cap_steps ? 2 * p->cap_steps : 1024;
        while (cap <= p->step)
            cap *= 2;
        p->step_version = zps_xrealloc(p->step_version, (size_t)cap * sizeof *p->step_version);
        p->cap_steps = cap;
    }
    p->step_version[p->step] = p->used_version;
}

/* ---- pulls ---- */

/* The pulls of a step are under way: nothing received yet. */
static void s_pulls_begin(s_ps *p)
{
    memset(p->pull_done, 1, p->nvars); // a bucket is waited for once its pull is issued
    p->pulls_pending = 1;
    p->pull_vmin = UINT64_MAX;
    p->pull_err = ZPS_OK;
}

/* Issues the pulls of every bucket in forward order (first layers first). */
static zps_status s_issue_pulls(s_ps *p, int64_t step)
{
    s_pulls_begin(p);
    for (int b = p->n_buckets - 1; b >= 0; b--) {
        if (p->trace)
            p->pull_t0[b] = tr_trace_now(p->trace);
        ZPS_TRY(ps_client_pull(p->client, p->buckets[b].first, p->buckets[b].n, p->params, step,
                               &p->pull_t[b]));
        p->pull_done[b] = 0;
    }
    return ZPS_OK;
}

/* Bucket g's pull (sync: PUSHPULL) reply, unless taken already: its status and version. */
static zps_status s_take_pull(s_ps *p, int g, uint64_t *v)
{
    p->pull_done[g] = 1;
    uint64_t tw = tr_trace_now(p->trace);
    zps_status st = s_wait(p, p->pull_t[g], v);
    s_trace_transfer(p, p->pushpull ? "pushpull" : "pull", p->pull_t[g], p->pull_t0[g],
                     p->buckets[g].first, p->buckets[g].n);
    if (tw && zps_now_ns() - tw > 20000) /* waits that cost something: over 20 us */
        tr_trace_span(p->trace, TR_TRACE_MAIN, "wait: values", tw, g);
    return st;
}

/* Keeps what a pull brought: its failure (the first), or its version (the oldest). */
static void s_note_pull(s_ps *p, zps_status st, uint64_t v)
{
    if (st != ZPS_OK && p->pull_err == ZPS_OK)
        p->pull_err = st;
    if (st == ZPS_OK && v < p->pull_vmin)
        p->pull_vmin = v;
}

/* sync: bucket g's PUSHPULL came back stale, its values unsent: this trainer's gradients
 * were not needed (a backup worker, docs/ps.md "Backup workers"), so the step went on
 * without it, and the other buckets' replies are as good as here. Unless the fleet rolled
 * back (params_ready's recovery takes that), every stale bucket's values come by a plain
 * pull, all sent before any is waited for: one round trip, not one a bucket. */
static void s_catch_up(s_ps *p, int g)
{
    int n = 0;
    p->stale_b[n++] = g;
    for (int b = p->n_buckets - 1; b >= 0; b--) { /* the replies are on their way */
        if (p->pull_done[b])
            continue;
        uint64_t v = 0;
        zps_status st = s_take_pull(p, b, &v);
        if (st == ZPS_ERR_STALE)
            p->stale_b[n++] = b;
        else
            s_note_pull(p, st, v);
    }
    if (ps_client_rollback_pending(p->client, NULL)) {
        s_note_pull(p, ZPS_ERR_STALE, 0);
        return;
    }
    zps_log(ZPS_DEBUG, "trainer", "step %lld: %d of %d buckets came back stale: pulling them "
            "together", (long long)p->step, n, p->n_buckets);
    int sent = 0;
    for (; sent < n; sent++) {
        int b = p->stale_b[sent];
        p->pull_t0[b] = tr_trace_now(p->trace);
        zps_status st = ps_client_pull(p->client, p->buckets[b].first, p->buckets[b].n,
                                       p->params, p->pp_step + 1, &p->pull_t[b]);
        if (st != ZPS_OK) {
            s_note_pull(p, st, 0);
            break;
        }
    }
    for (int i = 0; i < sent; i++) {
        int b = p->stale_b[i];
        uint64_t v = 0;
        zps_status st = s_wait(p, p->pull_t[b], &v);
        s_trace_transfer(p, "pull", p->pull_t[b], p->pull_t0[b], p->buckets[b].first,
                         p->buckets[b].n);
        s_note_pull(p, st, v);
    }
}

/* Waits for bucket g's pull unless that was done already. */
static void s_wait_pull(s_ps *p, int g)
{
    if (p->pull_done[g])
        return;
    uint64_t v = 0;
    zps_status st = s_take_pull(p, g, &v);
    if (st == ZPS_ERR_STALE && p->pushpull && !ps_client_rollback_pending(p->client, NULL))
        s_catch_up(p, g);
    else
        s_note_pull(p, st, v);
}

/* Forward hook: a layer is about to read [first, first + n); wait for its values. A failure
 * is kept in pull_err and returned by the params_ready right after the forward. */
static void s_pull_hook(void *ctx, size_t first, size_t n)
{
    s_ps *p = ctx;
    if (p->pulls_pending)
        for (size_t v = first; v < first + n; v++)
            s_wait_pull(p, p->var_pull[v]);
}

/* The values in params are those the step begun last computes with: its version, the step
 * its pushes carry, and (once per step: a later call, an evaluation's after end_step, sees
 * the next version) the version a redo of it would start from. */
static void s_values_here(s_ps *p)
{
    p->used_version = p->version;
    p->push_step = p->cfg->mode == TR_MODE_SSP ? p->step : (int64_t)p->version;
    if (!p->noted)
        s_note_step_version(p);
    p->noted = 1;
}

/* Waits for whatever pulls the forward did not; the step computes with the oldest version
 * received, and its pushes are tagged accordingly (client.h, "Steps"). */
static zps_status s_params_ready(tr_sync *s)
{
    s_ps *p = (s_ps *)s;
    if (p->pulls_pending) {
        for (int b = p->n_buckets - 1; b >= 0; b--)
            s_wait_pull(p, b);
        p->pulls_pending = 0;
        if (p->pull_err != ZPS_OK) {
            zps_status st = s_recover(p, p->pull_err);
            if (p->base.redo_from < 0)
                s_log_fail(p, "PULL", p->pull_err);
            return st;
        }
        p->version = p->pull_vmin;
    }
    s_values_here(p);
    return ZPS_OK;
}

/* The groups into buckets (see the invariants): sync merges runs of contiguous groups up to
 * S_BUCKET_FLOATS, the other modes keep one group each. */
static void s_make_buckets(s_ps *p)
{
    p->n_buckets = 0;
    uint64_t floats = 0; // in the open bucket
    for (int g = 0; g < p->n_groups; g++) {
        const s_group *gr = &p->groups[g];
        uint64_t gf = 0;
        for (int v = gr->first; v < gr->first + gr->n; v++)
            gf += p->var_count[v];
        s_group *b = p->n_buckets ? &p->buckets[p->n_buckets - 1] : NULL;
        if (p->pushpull && b && floats < S_BUCKET_FLOATS && gr->first + gr->n == b->first) {
            b->first = gr->first; // hook order runs down the variables
            b->n += gr->n;
            floats += gf;
        } else {
            floats = gf;
            p->buckets[p->n_buckets++] = *gr;
        }
        p->group_bucket[g] = p->n_buckets - 1;
    }
}

/* The groups are known (end of the first step): the buckets, and each variable's. */
static void s_groups_known(s_ps *p)
{
    s_make_buckets(p);
    for (int b = 0; b < p->n_buckets; b++)
        for (int v = p->buckets[b].first; v < p->buckets[b].first + p->buckets[b].n; v++)
            p->var_pull[v] = b;
    p->groups_known = 1;
    tr_sync_env_forward_hook(&p->hook_env, s_pull_hook, p);
}

/* ---- pushes ---- */

static zps_status s_begin_step(tr_sync *s, int64_t step, int *stop)
{
    (void)stop;
    s_ps *p = (s_ps *)s;
    p->step = step;
    p->noted = 0;
    /* this step's values arrive during the first forward; until then, the last known */
    p->used_version = p->version;
    /* unless nothing is on its way: they are in params already (a rollback pulled them, an
     * evaluation waited for them, or --node-trainers' leader did at the last end_step) */
    if (!p->pulls_pending)
        s_values_here(p);
    s->net_wait = 0;
    s->redo_from = -1;
    p->n_hook = 0;
    if (!p->groups_known) /* a first step that failed (a rollback redoes it): learn again */
        p->n_groups = p->n_buckets = 0;
    return ZPS_OK;
}

/* sync: group [first, first + n) is final; 1 when it completes its bucket (*b), which then
 * goes out. */
static int s_bucket_ready(s_ps *p, size_t first, size_t n, int *b)
{
    int g = p->n_hook++; // the hook reports the groups in the same order every step
    assert(p->groups[g].first == (int)first && p->groups[g].n == (int)n);
    if (g == 0) {
        s_pulls_begin(p);
        p->pp_step = p->push_step;
    }
    if (!p->groups_known) { /* the first step: every group its own bucket */
        p->buckets[p->n_buckets] = (s_group){(int)first, (int)n};
        *b = p->n_buckets++;
        return 1;
    }
    *b = p->group_bucket[g];
    return g + 1 == p->n_groups || p->group_bucket[g + 1] != *b;
}

/* The gradients of [first, first + n) are final: push them now (sync: once their bucket is
 * complete). */
static zps_status s_grads_ready(tr_sync *s, size_t first, size_t n)
{
    s_ps *p = (s_ps *)s;
    if (!p->groups_known) {
        assert(p->n_groups < (int)p->nvars);
        p->groups[p->n_groups++] = (s_group){(int)first, (int)n};
    }
    if (p->push_err != ZPS_OK)
        return p->push_err;
    assert(p->n_push < (int)p->nvars);
    zps_status st;
    if (p->pushpull) {
        int b;
        if (!s_bucket_ready(p, first, n, &b))
            return ZPS_OK; // the bucket goes out with its last group
        p->pull_done[b] = 0;
        if (p->trace) { /* take the replies in so far, so their spans end when they came */
            (void)ps_client_progress(p->client);
            p->pull_t0[b] = tr_trace_now(p->trace);
        }
        const s_group *k = &p->buckets[b];
        st = p->grads16 ? ps_client_pushpull_bf16(p->client, k->first, k->n, p->grads16,
                                                  p->params, p->push_step, &p->pull_t[b])
                        : ps_client_pushpull(p->client, k->first, k->n, p->grads, p->params,
                                             p->push_step, &p->pull_t[b]);
    } else {
        if (p->trace) {
            (void)ps_client_progress(p->client);
            p->push_t0[p->n_push] = tr_trace_now(p->trace);
        }
        ps_ticket *t = &p->push_t[p->n_push];
        st = p->grads16 ? ps_client_push_bf16(p->client, (int)first, (int)n, p->grads16,
                                              p->push_step, t)
                        : ps_client_push(p->client, (int)first, (int)n, p->grads, p->push_step,
                                         t);
        p->push_first[p->n_push] = (int)first, p->push_n[p->n_push] = (int)n;
    }
    if (st != ZPS_OK) {
        p->push_err = st;
        s_log_fail(p, "PUSH", st);
        return st;
    }
    p->n_push++;
    return ZPS_OK;
}

/* Waits for this step's pushes. A stale push (sync: the step was aggregated without us,
 * e.g. we are a backup worker) is not an error: *stale is set and the next pull catches up. */
static zps_status s_wait_pushes(s_ps *p, int *stale, uint64_t *newest)
{
    *stale = 0;
    *newest = 0;
    zps_status first_err = ZPS_OK;
    for (int k = 0; k < p->n_push; k++) {
        uint64_t v = 0;
        zps_status st = s_wait(p, p->push_t[k], &v);
        s_trace_transfer(p, "push", p->push_t[k], p->push_t0[k], p->push_first[k], p->push_n[k]);
        if (st == ZPS_ERR_STALE) {
            *stale = 1;
            st = ZPS_OK;
        }
        if (st != ZPS_OK && first_err == ZPS_OK)
            first_err = st;
        if (v > *newest)
            *newest = v;
    }
    p->n_push = 0;
    if (first_err != ZPS_OK)
        s_log_fail(p, "PUSH", first_err);
    return first_err;
}

/* The step record's transfer figures. */
static void s_record(s_ps *p, tr_step_record *rec)
{
    rec->bytes_pushed = rec->bytes_pulled = p->nparams * sizeof(float);
    rec->lr = ps_optim_lr(&p->cfg->opt, p->used_version);
    rec->net_wait_s = p->base.net_wait;
}

static zps_status s_end_step(tr_sync *s, tr_step_record *rec)
{
    s_ps *p = (s_ps *)s;
    const tr_config *c = p->cfg;
    if (p->push_err != ZPS_OK)
        return s_recover(p, p->push_err);
    if (!p->groups_known && p->pushpull)
        for (int k = 0; k < p->n_buckets; k++)
            s_wait_pull(p, k); // before the buckets change shape; params_ready takes the rest
    if (!p->groups_known)
        s_groups_known(p);
    if (p->pushpull) {
        /* every group's values are on their way: the next forward waits for each */
        p->n_push = 0;
        if (ps_client_rollback_pending(p->client, NULL))
            return s_recover(p, ZPS_ERR_STALE);
        rec->staleness = 0;
        s_record(p, rec);
        return ZPS_OK;
    }
    /* The values for the next step: sync waits (server side) for version + 1. */
    int64_t pull_step = c->mode == TR_MODE_SYNC  ? (int64_t)p->used_version + 1
                        : c->mode == TR_MODE_SSP ? p->step + 1
                                                 : -1;
    ZPS_TRY(s_issue_pulls(p, pull_step));
    int stale;
    uint64_t newest;
    zps_status st = s_wait_pushes(p, &stale, &newest);
    if (st == ZPS_OK && ps_client_rollback_pending(p->client, NULL))
        st = ZPS_ERR_STALE; // the pushes landed in a timeline the fleet abandoned
    if (st != ZPS_OK)
        return s_recover(p, st);
    if (stale)
        zps_log(ZPS_DEBUG, "trainer", "step %lld: push was stale (server at %llu)",
                (long long)p->step + 1, (unsigned long long)newest);
    if (c->mode != TR_MODE_SYNC && newest > p->used_version)
        rec->staleness = (double)(newest - 1 - p->used_version);
    else
        rec->staleness = 0;
    s_record(p, rec);
    return ZPS_OK;
}

/* ---- the end of the job ---- */

/* The final values: whatever the servers hold now. */
static zps_status s_finish(tr_sync *s, int *fresh)
{
    s_ps *p = (s_ps *)s;
    *fresh = 1;
    ZPS_TRY(s_params_ready(s));
    ps_ticket t;
    ZPS_TRY(ps_client_pull(p->client, 0, (int)p->nvars, p->params, -1, &t));
    return s_wait(p, t, &p->version);
}

/* LEAVE: peers (sync, ssp) and barriers stop waiting for this trainer at once. */
static zps_status s_leave(tr_sync *s)
{
    s_ps *p = (s_ps *)s;
    ZPS_TRY(ps_client_leave(p->client));
    p->left = 1;
    if (p->cfg->shutdown_servers) {
        ZPS_TRY(ps_client_barrier(p->client));
        if (p->cfg->trainer_id == 0)
            ZPS_TRY(ps_client_shutdown(p->client));
    }
    return ZPS_OK;
}

/* How long abandon() waits for LEAVE's answers: a signal stop must end within about a
 * second; after an error there is time to let a busy server answer. */
#define S_ABANDON_SIGNAL_MS 500
#define S_ABANDON_ERROR_MS 2000

static void s_abandon(tr_sync *s)
{
    s_ps *p = (s_ps *)s;
    if (!p->client || !p->joined || p->left)
        return;
    p->left = 1;
    int stopping = p->stop && *p->stop;
    ps_client_set_deadline(p->client, stopping ? S_ABANDON_SIGNAL_MS : S_ABANDON_ERROR_MS);
    zps_status st = ps_client_leave(p->client);
    ps_client_set_deadline(p->client, 0);
    if (st == ZPS_OK)
        zps_log(ZPS_INFO, "trainer", "sent LEAVE: the servers no longer wait for this trainer");
    else
        zps_log(ZPS_WARN, "trainer", "LEAVE not answered (%s: %s): a server that did not get "
                "it drops this trainer after its --trainer-timeout", zps_strerror(st),
                ps_client_last_error(p->client));
}

static void s_destroy(tr_sync *s)
{
    s_ps *p = (s_ps *)s;
    if (p->client)
        ps_client_destroy(&p->client);
    ps_plan_destroy(&p->plan);
    free(p->push_t);
    free(p->pull_t);
    free(p->groups);
    free(p->var_pull);
    free(p->pull_done);
    free(p->stale_b);
    free(p->buckets);
    free(p->group_bucket);
    free(p->var_count);
    free(p->step_version);
    free(p->pull_t0);
    free(p->push_t0);
    free(p->push_first);
    free(p->push_n);
    free(p);
}

/* ---- joining the servers ---- */

/* The client, with CURVE keys when configured. */
static zps_status s_connect(s_ps *p, const tr_sync_env *env)
{
    const tr_config *c = p->cfg;
    ps_client_opts co;
    ps_client_opts_default(&co);
    co.timeout_ms = c->timeout_ms;
    co.heartbeat_thread = 1; /* a long step must not look like a dead trainer */
    co.push_dtype = c->push_dtype;
    co.shm = c->shm;
    co.stop = env->stop;
    if (c->curve_key[0]) {
        char why[1200];
        zps_status st = ps_client_opts_curve(&co, c->curve_server_key, c->curve_key, why,
                                             sizeof why);
        if (st != ZPS_OK) {
            zps_log(ZPS_ERROR, "trainer", "%s", why);
            return st;
        }
        zps_log(ZPS_INFO, "trainer", "CURVE on: trainer key %.8s..., server key %.8s...",
                co.curve_public_key, co.curve_server_key);
    }
    zps_status st = ps_client_new(env->uris, env->n_uris, (uint32_t)env->id, &co, &p->client);
    explicit_bzero(co.curve_secret_key, sizeof co.curve_secret_key);
    return st;
}

/* REGISTER. A trainer restarted after a kill -9 finds its id still held by the dead process
 * until the servers' --trainer-timeout passes (docs/ps.md "Trainer identity"): it retries
 * for --register-wait seconds instead of failing, stopping at once on a signal. */
static zps_status s_register(s_ps *p, const tr_sync_env *env, const ps_job *want, ps_job *got)
{
    uint64_t t0 = zps_now_ns();
    int told = 0;
    for (;;) {
        zps_status st = ps_client_register(p->client, p->plan, want, got);
        double waited = (double)(zps_now_ns() - t0) * 1e-9;
        if (st != ZPS_ERR_EXISTS || waited >= p->cfg->register_wait_s || (env->stop && *env->stop))
            return st;
        if (!told++)
            zps_log(ZPS_WARN, "trainer", "%s; waiting up to %.0f s (--register-wait) for the "
                    "servers to time that process out", ps_client_last_error(p->client),
                    p->cfg->register_wait_s);
        for (int i = 0; i < 5 && !(env->stop && *env->stop); i++)
            nanosleep(&(struct timespec){0, 200000000}, NULL);
    }
}

/* REGISTER, INIT (first writer wins), and the first pull of every value. */
static zps_status s_join(s_ps *p, const tr_sync_env *env)
{
    const tr_config *c = p->cfg;
    ps_job want = {0}, got = {0};
    want.mode = c->mode == TR_MODE_SYNC ? PS_MODE_SYNC
                : c->mode == TR_MODE_ASYNC ? PS_MODE_ASYNC
                                           : PS_MODE_SSP;
    want.num_trainers = (uint32_t)env->n_trainers;
    want.replicas_to_aggregate = c->replicas_to_aggregate;
    want.staleness = c->staleness;
    zps_status st = s_register(p, env, &want, &got);
    if (st != ZPS_OK) {
        s_log_fail(p, "REGISTER with the servers", st);
        return st;
    }
    p->joined = 1;
    if (got.mode != want.mode)
        zps_log(ZPS_WARN, "trainer", "servers run mode %d, not the requested %s", got.mode,
                tr_mode_name(c->mode));
    /* First writer wins: every trainer offers the same seeded (or loaded) values. */
    int first = 0;
    st = ps_client_init(p->client, p->params, &c->opt, &first);
    if (st != ZPS_OK) {
        s_log_fail(p, "INIT", st);
        return st;
    }
    zps_log(ZPS_INFO, "trainer", "%s %d servers (%u chunks, plan %016llx), mode %s, %s gradients",
            first ? "initialised" : "joined", env->n_uris, p->plan->n_chunks,
            (unsigned long long)p->plan->hash, tr_mode_name(c->mode), ps_dtype_name(c->push_dtype));
    /* Start from the servers' values (another trainer may have initialised them, or a
     * restored server may be far ahead). */
    ps_ticket t;
    ZPS_TRY(ps_client_pull(p->client, 0, (int)p->nvars, p->params, -1, &t));
    st = ps_client_wait_version(p->client, t, &p->version);
    if (st != ZPS_OK) {
        s_log_fail(p, "first PULL", st);
        return st;
    }
    if (c->mode == TR_MODE_SYNC && p->version > 0) {
        /* a job under way: step k of the fleet computed with version k (where a redo
         * after a rollback starts, s_redo_step) */
        p->base.start_step = (int64_t)p->version;
        for (p->step = 0; p->step < (int64_t)p->version; p->step++) {
            p->used_version = (uint64_t)p->step;
            s_note_step_version(p);
        }
        p->used_version = p->version;
    }
    return ZPS_OK;
}

static zps_status s_setup(s_ps *p, const tr_sync_env *env)
{
    ps_var *pv = zps_xcalloc(env->nvars, sizeof *pv);
    for (size_t i = 0; i < env->nvars; i++) {
        pv[i].name = env->vars[i].name;
        pv[i].count = env->vars[i].count;
    }
    zps_status st = ps_plan_new(pv, (int)env->nvars, env->n_uris, p->cfg->chunk_bytes, &p->plan);
    free(pv);
    ZPS_TRY(st);
    ZPS_TRY(s_connect(p, env));
    return s_join(p, env);
}

zps_status tr_sync_ps_new(const tr_sync_env *env, tr_sync **out)
{
    *out = NULL;
    s_ps *p = zps_xcalloc(1, sizeof *p);
    p->base = (tr_sync){.begin_step = s_begin_step, .params_ready = s_params_ready,
                        .grads_ready = s_grads_ready, .end_step = s_end_step,
                        .finish = s_finish, .leave = s_leave, .abandon = s_abandon,
                        .destroy = s_destroy, .redo_from = -1};
    p->cfg = env->cfg;
    p->pushpull = env->cfg->mode == TR_MODE_SYNC;
    p->stop = env->stop;
    p->hook_env = (tr_sync_env){.model = env->model, .set_forward_hook = env->set_forward_hook,
                                .hook_owner = env->hook_owner};
    p->params = env->params;
    p->grads = env->grads;
    p->grads16 = env->grads_bf16;
    p->nvars = env->nvars;
    p->nparams = env->nparams;
    p->push_t = zps_xcalloc(env->nvars, sizeof *p->push_t);
    p->pull_t = zps_xcalloc(env->nvars, sizeof *p->pull_t);
    p->groups = zps_xcalloc(env->nvars, sizeof *p->groups);
    p->pull_done = zps_xcalloc(env->nvars, sizeof *p->pull_done);
    p->stale_b = zps_xcalloc(env->nvars, sizeof *p->stale_b);
    p->var_pull = zps_xcalloc(env->nvars, sizeof *p->var_pull);
    p->buckets = zps_xcalloc(env->nvars, sizeof *p->buckets);
    p->group_bucket = zps_xcalloc(env->nvars, sizeof *p->group_bucket);
    p->var_count = zps_xcalloc(env->nvars, sizeof *p->var_count);
    p->trace = env->trace;
    p->vars = env->vars;
    p->pull_t0 = zps_xcalloc(env->nvars, sizeof *p->pull_t0);
    p->push_t0 = zps_xcalloc(env->nvars, sizeof *p->push_t0);
    p->push_first = zps_xcalloc(env->nvars, sizeof *p->push_first);
    p->push_n = zps_xcalloc(env->nvars, sizeof *p->push_n);
    for (size_t v = 0; v < env->nvars; v++)
        p->var_count[v] = env->vars[v].count;
    zps_status st = s_setup(p, env);
    if (st != ZPS_OK) {
        s_abandon(&p->base); /* registered, then failed: the servers must not wait for us */
        s_destroy(&p->base);
        return st;
    }
    *out = &p->base;
    return ZPS_OK;
}
