/* test_sync.c — the trainer's in-process sync back-ends (trainer/sync.h), suite tr_sync.
 *
 * local: end_step is exactly the servers' optimizer (ps_optim_apply) on the mean gradient, at
 * the step begun last, with its learning rate in the record. all-reduce: with one rank it is
 * local training bit for bit, plus the byte counts; with two ranks (threads) any rank's wish
 * to stop is everyone's, and a step reduces and applies each layer's bucket while the layers
 * below are still to come (before end_step), ending with the values of one mean and one
 * update. The PS back-end runs against real servers in it_train.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "kernels/kernels.h"
#include "ps/optim.h"
#include "tests/test_k.h"
#include "tests/testutil.h"
#include "trainer/allreduce.h"
#include "trainer/models/models.h"
#include "trainer/sync.h"

#define S_N 1000

typedef struct s_fixture {
    tr_config cfg;
    float params[S_N], grads[S_N];
    tr_sync_env env;
} s_fixture;

/* Random values and gradients (never zeros); momentum with Nesterov, weight decay and a
 * learning rate that halves every step. */
static void s_fixture_init(s_fixture *f, int id, int n_trainers)
{
    memset(f, 0, sizeof *f);
    tr_config_default(&f->cfg);
    ps_optim_default(&f->cfg.opt);
    f->cfg.opt.kind = PS_OPT_MOMENTUM;
    f->cfg.opt.lr = 0.1;
    f->cfg.opt.momentum = 0.9;
    f->cfg.opt.nesterov = 1;
    f->cfg.opt.weight_decay = 1e-3;
    f->cfg.opt.sched = PS_SCHED_EXPONENTIAL; /* so that the step number matters */
    f->cfg.opt.decay_rate = 0.5;
    f->cfg.opt.decay_steps = 1;
    snprintf(f->cfg.job, sizeof f->cfg.job, "sync%d-%u", (int)getpid(), zt_rand());
    for (int i = 0; i < S_N; i++) {
        f->params[i] = zt_unif(-1, 1);
        f->grads[i] = zt_unif(0.1f, 1);
    }
    f->env = (tr_sync_env){.cfg = &f->cfg, .id = id, .n_trainers = n_trainers,
                           .nparams = S_N, .params = f->params, .grads = f->grads};
}

/* What two steps (3 and 4) of the optimizer make of f's values, done directly. */
static void s_expected(const s_fixture *f, float *want)
{
    float slot[S_N], g[S_N];
    float *slots[2] = {slot, NULL};
    memcpy(want, f->params, sizeof f->params);
    memcpy(g, f->grads, sizeof g);
    for (int i = 0; i < S_N; i++)
        slot[i] = ps_optim_slot_init(&f->cfg.opt, 0);
    ps_optim_apply(&f->cfg.opt, 3, want, slots, g, S_N);
    ps_optim_apply(&f->cfg.opt, 4, want, slots, g, S_N);
}

/* Runs steps 3 and 4 through s; checks the calls every in-process back-end shares. */
static void s_two_steps(tr_sync *s, tr_step_record *rec)
{
    for (int64_t step = 3; step <= 4; step++) {
        int stop = 0;
        cr_assert_eq(s->begin_step(s, step, &stop), ZPS_OK);
        cr_assert_eq(stop, 0);
        cr_assert_eq(s->params_ready(s), ZPS_OK);
        cr_assert_eq(s->grads_ready(s, 0, 1), ZPS_OK);
        *rec = tr_step_record_empty(step + 1);
        cr_assert_eq(s->end_step(s, rec), ZPS_OK);
    }
    int fresh = -1;
    cr_assert_eq(s->finish(s, &fresh), ZPS_OK);
    cr_assert_eq(fresh, 0, "in-process values cannot change after the last step");
    cr_assert_eq(s->leave(s), ZPS_OK);
}

/* A fresh seed, the fixture of a single trainer in f, and in want what steps 3 and 4 must
 * make of its values. */
static void s_one_rank(s_fixture *f, float *want)
{
    zt_seed_init();
    s_fixture_init(f, 0, 1);
    s_expected(f, want);
}

TestSuite(tr_sync, .timeout = 30);

Test(tr_sync, local_step_is_the_servers_optimizer)
{
    static s_fixture f;
    static float want[S_N];
    s_one_rank(&f, want);
    tr_sync *s = NULL;
    cr_assert_eq(tr_sync_local_new(&f.env, &s), ZPS_OK);
    int stop = 1;
    cr_assert_eq(s->begin_step(s, 3, &stop), ZPS_OK);
    cr_assert_eq(stop, 1, "local: this trainer's wish is the decision");
    tr_step_record rec;
    s_two_steps(s, &rec);
    cr_assert_eq(memcmp(f.params, want, sizeof want), 0, "not ps_optim_apply's values");
    cr_assert_float_eq(rec.lr, ps_optim_lr(&f.cfg.opt, 4), 0);
    cr_assert_eq(rec.bytes_pushed, 0);
    cr_assert_eq(rec.net_wait_s, 0);
    tr_sync_destroy(&s);
    cr_assert_null(s);
    tr_sync_destroy(&s);
}

Test(tr_sync, allreduce_of_one_rank_is_local_training)
{
    zps_log_set_level(ZPS_LOG_WARN);
    static s_fixture f;
    static float want[S_N];
    s_one_rank(&f, want);
    tr_sync *s = NULL;
    cr_assert_eq(tr_sync_allreduce_new(&f.env, &s), ZPS_OK);
    tr_step_record rec;
    s_two_steps(s, &rec);
    cr_assert_eq(memcmp(f.params, want, sizeof want), 0, "the mean of one rank changed bits");
    cr_assert_eq(rec.bytes_pushed, S_N * sizeof(float));
    cr_assert_eq(rec.bytes_pulled, S_N * sizeof(float));
    cr_assert_float_eq(rec.lr, ps_optim_lr(&f.cfg.opt, 4), 0);
    tr_sync_destroy(&s);
}

/* Runs fn on a[0] and a[1] (each elem bytes apart) in two threads and joins them. */
static void s_two_ranks(void *(*fn)(void *), void *a, size_t elem)
{
    pthread_t th[2];
    for (int i = 0; i < 2; i++)
        cr_assert_eq(pthread_create(&th[i], NULL, fn, (char *)a + (size_t)i * elem), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(th[i], NULL);
}

typedef struct s_rank {
    s_fixture f;
    const char *job;
    int wish[2];     // this rank's wish to stop at steps 0 and 1
    int got[2];      // the decisions
    zps_status st;
} s_rank;

static void *s_rank_thread(void *p)
{
    s_rank *r = p;
    snprintf(r->f.cfg.job, sizeof r->f.cfg.job, "%s", r->job);
    tr_sync *s = NULL;
    r->st = tr_sync_allreduce_new(&r->f.env, &s);
    for (int step = 0; step < 2 && r->st == ZPS_OK; step++) {
        r->got[step] = r->wish[step];
        r->st = s->begin_step(s, step, &r->got[step]);
    }
    tr_sync_destroy(&s);
    return NULL;
}

Test(tr_sync, allreduce_stops_when_any_rank_says_so)
{
    zt_seed_init();
    zps_log_set_level(ZPS_LOG_WARN);
    static s_rank r[2];
    char job[64];
    snprintf(job, sizeof job, "stop%d-%u", (int)getpid(), zt_rand());
    for (int i = 0; i < 2; i++) {
        s_fixture_init(&r[i].f, i, 2);
        r[i].job = job;
    }
    /* step 0: nobody; step 1: rank 1 alone (a SIGTERM to it) stops everyone */
    r[0].wish[0] = 0, r[1].wish[0] = 0;
    r[0].wish[1] = 0, r[1].wish[1] = 1;
    s_two_ranks(s_rank_thread, r, sizeof r[0]);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(r[i].st, ZPS_OK, "rank %d: %s", i, zps_strerror(r[i].st));
        cr_assert_eq(r[i].got[0], 0, "rank %d stopped with no wish to", i);
        cr_assert_eq(r[i].got[1], 1, "rank %d went on after rank 1 wished to stop", i);
    }
    /* and rank 0 alone, as before */
    snprintf(job, sizeof job, "stop%d-%u", (int)getpid(), zt_rand());
    r[0].wish[1] = 1, r[1].wish[1] = 0;
    s_two_ranks(s_rank_thread, r, sizeof r[0]);
    for (int i = 0; i < 2; i++)
        cr_assert(r[i].st == ZPS_OK && r[i].got[0] == 0 && r[i].got[1] == 1,
                  "rank %d: %s, decisions %d %d", i, zps_strerror(r[i].st), r[i].got[0],
                  r[i].got[1]);
}

/* Overlap: four variables, one bucket each (bucket_floats 1). Each rank reports them last
 * first and, before reporting the next, waits (at most 10 s) for the reported one's values
 * to change: the reduction and the update ran while "backward" went on. */
#define S_NV 4

typedef struct s_ov_rank {
    s_fixture f;
    nn_var vars[S_NV];
    const char *job;
    int early[S_NV]; // variable v changed before end_step
    zps_status st;
} s_ov_rank;

static int s_changed(const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i])
            return 1;
    return 0;
}

/* Rank i of two: its fixture, S_NV equal variables, and a bucket per variable. */
static void s_bucket_rank(s_fixture *f, nn_var *vars, int i)
{
    s_fixture_init(f, i, 2);
    for (int v = 0; v < S_NV; v++)
        vars[v] = (nn_var){.offset = (size_t)v * (S_N / S_NV), .count = S_N / S_NV};
    f->env.vars = vars, f->env.nvars = S_NV, f->env.bucket_floats = 1;
}

static void *s_ov_thread(void *p)
{
    s_ov_rank *r = p;
    snprintf(r->f.cfg.job, sizeof r->f.cfg.job, "%s", r->job);
    tr_sync *s = NULL;
    r->st = tr_sync_allreduce_new(&r->f.env, &s);
    int stop = 0;
    if (r->st == ZPS_OK)
        r->st = s->begin_step(s, 3, &stop);
    static _Thread_local float before[S_N];
    memcpy(before, r->f.params, sizeof before);
    for (int v = S_NV - 1; v >= 0 && r->st == ZPS_OK; v--) {
        r->st = s->grads_ready(s, (size_t)v, 1);
        const nn_var *x = &r->vars[v];
        for (int k = 0; k < 10000 && !r->early[v]; k++) {
            r->early[v] = s_changed(before + x->offset, r->f.params + x->offset, x->count);
            usleep(1000);
        }
    }
    tr_step_record rec = tr_step_record_empty(4);
    if (r->st == ZPS_OK)
        r->st = s->end_step(s, &rec);
    tr_sync_destroy(&s);
    return NULL;
}

Test(tr_sync, allreduce_reduces_each_bucket_while_backward_goes_on)
{
    zt_seed_init();
    zps_log_set_level(ZPS_LOG_WARN);
    static s_ov_rank r[2];
    char job[64];
    snprintf(job, sizeof job, "ovl%d-%u", (int)getpid(), zt_rand());
    for (int i = 0; i < 2; i++) {
        s_bucket_rank(&r[i].f, r[i].vars, i);
        r[i].job = job;
    }
    /* what one mean of the two gradients and one update make of rank 0's values */
    static float want[S_N], g[S_N], slot[S_N];
    memcpy(want, r[0].f.params, sizeof want);
    for (int i = 0; i < S_N; i++)
        g[i] = (r[0].f.grads[i] + r[1].f.grads[i]) / 2.0f;
    float *slots[2] = {slot, NULL};
    ps_optim_apply(&r[0].f.cfg.opt, 3, want, slots, g, S_N);
    s_two_ranks(s_ov_thread, r, sizeof r[0]);
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(r[i].st, ZPS_OK, "rank %d: %s", i, zps_strerror(r[i].st));
        for (int v = 0; v < S_NV; v++)
            cr_expect(r[i].early[v], "rank %d: variable %d only changed in end_step", i, v);
        cr_expect_eq(memcmp(r[i].f.params, want, sizeof want), 0,
                     "rank %d: not one mean and one update", i);
    }
}

/* The all-reduce back-ends' buckets (tr_buckets): groups reported last first, of random sizes,
 * leave as buckets that cover every float exactly once, in order, each full but the last,
 * with the variables whose floats they are;
 * the same reports cut the same edges (every rank's buckets must match); a group reported out
 * of order is refused. */
static int s_cut(const tr_sync_env *env, const int *first, const int *n, int ng, size_t *edges)
{
    tr_buckets b;
    tr_buckets_init(&b, env, 4, 1000);
    size_t expect_hi = env->nparams, expect_v = env->nvars;
    tr_bucket k;
    int ne = 0;
    for (int g = 0; g < ng; g++) {
        int full = tr_buckets_report(&b, (size_t)first[g], (size_t)n[g], &k);
        cr_assert_geq(full, 0);
        if (!full)
            continue;
        cr_assert_eq(k.hi, expect_hi, "a bucket leaves a gap");
        cr_assert_geq(k.hi - k.lo, b.floats, "a bucket left before it was full");
        /* its variables: the ones below the last bucket's, starting where its floats do */
        cr_assert_eq(k.first + k.nv, expect_v, "a bucket's variables leave a gap");
        cr_assert_eq(env->vars[k.first].offset, k.lo, "a bucket's variables are not its floats");
        expect_hi = edges[ne++] = k.lo;
        expect_v = k.first;
    }
    if (tr_buckets_rest(&b, &k)) {
        cr_assert(k.hi == expect_hi && k.lo == 0);
        cr_assert(k.first == 0 && k.nv == expect_v, "the rest is not variables [0, %zu)",
                  expect_v);
        expect_hi = edges[ne++] = 0;
    }
    cr_assert_eq(expect_hi, 0u, "floats [0, %zu) never left", expect_hi);
    return ne;
}

Test(tr_sync, buckets_cover_every_float_once_and_refuse_disorder)
{
    uint64_t seed = zt_seed_init();
    enum { NV = 40 };
    nn_var vars[NV];
    size_t off = 0;
    for (int v = 0; v < NV; v++) {
        vars[v] = (nn_var){.offset = off, .count = (size_t)zt_irand(1, 5000)};
        off += vars[v].count;
    }
    s_fixture f;
    s_fixture_init(&f, 0, 1);
    f.env.vars = vars, f.env.nvars = NV, f.env.nparams = off;
    int first[NV], n[NV], ng = 0;
    for (int v = NV; v > 0; v = first[ng++]) { /* groups of 1-3 variables, last first */
        n[ng] = zt_irand(1, v < 3 ? v : 3);
        first[ng] = v - n[ng];
    }
    size_t e1[NV + 1], e2[NV + 1];
    int n1 = s_cut(&f.env, first, n, ng, e1), n2 = s_cut(&f.env, first, n, ng, e2);
    cr_assert_gt(n1, 1, "one bucket only: nothing would overlap (seed %llu)",
                 (unsigned long long)seed);
    cr_assert(n1 == n2 && !memcmp(e1, e2, (size_t)n1 * sizeof *e1),
              "the same reports cut other edges (seed %llu)", (unsigned long long)seed);
    tr_buckets b;
    tr_buckets_init(&b, &f.env, 4, 1000);
    tr_bucket k;
    zps_log_set_level(ZPS_LOG_OFF);
    cr_assert_geq(tr_buckets_report(&b, 10, 2, &k), 0);
    cr_assert_eq(tr_buckets_report(&b, 20, 1, &k), -1, "a higher group after a lower one");
}

/* ---- the device stager (trainer/stage.c) over a scripted inner back-end ---- */

/* The inner back-end: records the groups handed to it; its grads_ready fails from group
 * `fail_at` on (as sync_ps's does after a push failure), and its end_step then "recovers" as
 * sync PS does after a servers' rollback (redo_from, ZPS_ERR_STALE). */
typedef struct s_script {
    tr_sync base;
    int handed, fail_at, ends;
    zps_status pushed;    // the failure grads_ready reported
    const float *grads;   // the env's, and what each group handed must hold there (NULL:
    const float *want;    // not checked)
    const nn_var *vars;
    int wrong;            // groups handed that did not hold it
    float *params;        // the env's; with bump, end_step adds 1 to each (new values, or a
    int bump;             // rollback's: the node must spread them)
    size_t n;
} s_script;
static s_script *s_scripted; // the one made by s_script_new (a test has one)
static int s_script_calls;    // grads_ready calls of every s_script, also after it is gone

static zps_status s_sc_begin(tr_sync *b, int64_t step, int *stop)
{
    (void)step, (void)stop;
    s_script *s = (s_script *)b;
    s->pushed = ZPS_OK, s->base.redo_from = -1;
    return ZPS_OK;
}
static zps_status s_sc_ok(tr_sync *b)
{
    (void)b;
    return ZPS_OK;
}
static zps_status s_sc_grads(tr_sync *b, size_t first, size_t n)
{
    s_script *s = (s_script *)b;
    if (s->want) {
        size_t lo = s->vars[first].offset;
        size_t hi = s->vars[first + n - 1].offset + s->vars[first + n - 1].count;
        s->wrong += memcmp(s->grads + lo, s->want + lo, (hi - lo) * sizeof(float)) != 0;
    }
    __atomic_add_fetch(&s_script_calls, 1, __ATOMIC_SEQ_CST);
    if (s->pushed == ZPS_OK && __atomic_add_fetch(&s->handed, 1, __ATOMIC_SEQ_CST) == s->fail_at)
        s->pushed = ZPS_ERR_TIMEOUT;
    return s->pushed;
}
static zps_status s_sc_end(tr_sync *b, tr_step_record *rec)
{
    (void)rec;
    s_script *s = (s_script *)b;
    s->ends++;
    for (size_t i = 0; s->bump && i < s->n; i++)
        s->params[i] += 1.0f;
    if (s->pushed == ZPS_OK)
        return ZPS_OK;
    s->base.redo_from = 7;
    return ZPS_ERR_STALE;
}
static zps_status s_sc_finish(tr_sync *b, int *fresh)
{
    (void)b;
    *fresh = 0;
    return ZPS_OK;
}
static void s_sc_destroy(tr_sync *b) { free(b); }
static const float *s_script_want; // what s_script_new's back-end checks (NULL: nothing)
static int s_script_bump;          // its end_step changes the values
static zps_status s_script_new(const tr_sync_env *env, tr_sync **out)
{
    s_script *s = zps_xcalloc(1, sizeof *s);
    s->grads = env->grads, s->vars = env->vars, s->want = s_script_want;
    s->params = env->params, s->n = env->nparams, s->bump = s_script_bump;
    s->base = (tr_sync){.begin_step = s_sc_begin, .params_ready = s_sc_ok,
                        .grads_ready = s_sc_grads, .end_step = s_sc_end,
                        .finish = s_sc_finish, .leave = s_sc_ok, .destroy = s_sc_destroy,
                        .redo_from = -1};
    s->fail_at = 2;
    *out = &s->base;
    s_scripted = s;
    return ZPS_OK;
}

/* An mlp on the staged back-end, its tensors as f's env (one trainer); *nvars its variables. */
static nn_model *s_staged_mlp(s_fixture *f, size_t *nvars)
{
    zt_seed_init();
    zps_log_set_level(ZPS_LOG_OFF);
    nn_model_opts o;
    nn_model_opts_default(&o, "mlp");
    nn_model *m;
    cr_assert_eq(nn_model_create(k_backend_staged(), &o, &m), ZPS_OK);
    s_fixture_init(f, 0, 1);
    f->env.model = m;
    f->env.vars = nn_model_vars(m, nvars);
    f->env.nvars = *nvars;
    f->env.nparams = nn_model_param_count(m);
    f->env.params = nn_model_params(m);
    f->env.grads = nn_model_grads(m);
    return m;
}

/* A hand-off that fails is the inner back-end's to judge in its end_step: the stager still
 * calls it and passes on its recovery (redo_from), and the next step's hand-offs go through
 * again. */
Test(tr_sync, staged_hand_off_failure_reaches_the_inner_end_step)
{
    s_fixture f;
    size_t nvars;
    nn_model *m = s_staged_mlp(&f, &nvars);
    tr_sync *s;
    cr_assert_eq(tr_sync_staged_new(&f.env, s_script_new, 0, &s), ZPS_OK);
    for (int step = 0; step < 2; step++) {
        int stop = 0;
        cr_assert_eq(s->begin_step(s, step, &stop), ZPS_OK);
        cr_assert_eq(s->params_ready(s), ZPS_OK);
        for (size_t v = nvars; v-- > 0;) /* one group per variable, last first */
            cr_assert_eq(s->grads_ready(s, v, 1), ZPS_OK);
        tr_step_record rec = tr_step_record_empty(step + 1);
        zps_status st = s->end_step(s, &rec);
        cr_assert_eq(s_scripted->ends, step + 1, "the inner end_step was not called");
        if (step == 0) {
            cr_assert_eq(st, ZPS_ERR_STALE, "step 0: %s", zps_strerror(st));
            cr_assert_eq(s->redo_from, 7);
            s_scripted->fail_at = -1; /* the redo goes through */
        } else {
            cr_assert_eq(st, ZPS_OK, "step 1: %s", zps_strerror(st));
            cr_assert_eq(s->redo_from, -1);
        }
    }
    cr_assert_eq(s_scripted->handed, 2 + (int)nvars, "every group of the second step handed");
    tr_sync_destroy(&s);
    nn_model_destroy(&m);
}

/* A grads source (sync_node_dev.c's NCCL sums, in this test the compute queue) whose sums
 * are aborted once *ctx is set. */
static zps_status s_src_point(void *ctx, struct k_event *e)
{
    (void)ctx;
    return k_backend_staged()->event_record(e, K_QUEUE_COMPUTE);
}
static zps_status s_src_valid(void *ctx) { return *(int *)ctx ? ZPS_ERR_NCCL : ZPS_OK; }

/* A failure of the stager's own on its thread (a copy that did not land, or as here the
 * source's sums aborted) is not the inner back-end's to judge: the inner back-end never saw
 * the later groups, so the step fails with that failure before the inner end_step (which
 * would end a step on part of the gradients), and the stager stays failed. */
Test(tr_sync, staged_copy_failure_fails_the_step_before_the_inner_end_step)
{
    s_fixture f;
    size_t nvars;
    nn_model *m = s_staged_mlp(&f, &nvars);
    static int aborted;
    aborted = 0;
    tr_grads_source src = {.ctx = &aborted, .point = s_src_point, .valid = s_src_valid};
    f.env.grads_source = &src;
    tr_sync *s;
    cr_assert_eq(tr_sync_staged_new(&f.env, s_script_new, 0, &s), ZPS_OK);
    s_scripted->fail_at = -1;
    for (int step = 0; step < 2; step++) {
        int stop = 0;
        aborted = step == 1;
        cr_assert_eq(s->begin_step(s, step, &stop), ZPS_OK);
        cr_assert_eq(s->params_ready(s), ZPS_OK);
        for (size_t v = nvars; v-- > 0;)
            cr_assert_eq(s->grads_ready(s, v, 1), ZPS_OK);
        tr_step_record rec = tr_step_record_empty(step + 1);
        zps_status st = s->end_step(s, &rec);
        cr_assert_eq(st, step == 0 ? ZPS_OK : ZPS_ERR_NCCL, "step %d: %s", step,
                     zps_strerror(st));
    }
    cr_assert_eq(s_scripted->ends, 1, "the inner end_step ran on a step whose copies failed");
    cr_assert_eq(s_scripted->handed, (int)nvars, "groups handed on after the abort");
    cr_assert_eq(s->params_ready(s), ZPS_ERR_NCCL, "the stager did not stay failed");
    tr_sync_destroy(&s);
    nn_model_destroy(&m);
}

/* ---- the node back-end (trainer/sync_node.c) over a scripted leader's back-end ---- */

typedef struct s_node_rank {
    s_fixture f;
    nn_var vars[S_NV];
    const char *job;
    int early[S_NV];       // leader: variable v was handed on before the next was reported
    zps_status st[2];      // end_step of steps 0 and 1
    int64_t redo[2];
    int handed, wrong, ends; // leader: its scripted back-end's counts at the end
} s_node_rank;

static void *s_node_thread(void *p)
{
    s_node_rank *r = p;
    snprintf(r->f.cfg.job, sizeof r->f.cfg.job, "%s", r->job);
    r->f.cfg.node_trainers = 2;
    tr_sync *s = NULL;
    r->st[0] = r->st[1] = tr_sync_node_lead_new(&r->f.env, s_script_new, &s);
    for (int step = 0; step < 2 && s; step++) {
        int stop = 0;
        zps_status st = s->begin_step(s, step, &stop);
        for (int v = S_NV - 1; v >= 0 && st == ZPS_OK; v--) {
            st = s->grads_ready(s, (size_t)v, 1);
            /* step 1 on the leader: the bucket reaches the servers' side during backward */
            int wait = step == 1 && r->f.env.id == 0 && (v == S_NV - 1 || r->early[v + 1]);
            for (int k = 0; k < 5000 && wait && !r->early[v]; k++) {
                r->early[v] = __atomic_load_n(&s_scripted->handed, __ATOMIC_SEQ_CST) ==
                              2 + (S_NV - v);
                if (!r->early[v])
                    usleep(1000);
            }
        }
        tr_step_record rec = tr_step_record_empty(step + 1);
        r->st[step] = st == ZPS_OK ? s->end_step(s, &rec) : st;
        r->redo[step] = s->redo_from;
        if (step == 0 && r->f.env.id == 0)
            s_scripted->fail_at = -1; /* the redo goes through */
    }
    if (s && r->f.env.id == 0)
        r->handed = s_scripted->handed, r->wrong = s_scripted->wrong, r->ends = s_scripted->ends;
    tr_sync_destroy(&s);
    return NULL;
}

/* --node-trainers: each bucket's node mean goes to the leader's back-end while backward goes
 * on (one bucket per variable here), holding the mean of the ranks' gradients; a failed
 * hand-off stops the step's later hand-offs but not the node's sums, and is the leader's
 * back-end's to judge in its end_step, whose recovery (redo_from) reaches every rank. */
Test(tr_sync, node_hands_each_bucket_on_during_backward)
{
    zt_seed_init();
    zps_log_set_level(ZPS_LOG_OFF);
    static s_node_rank r[2];
    char job[64];
    snprintf(job, sizeof job, "nd%d-%u", (int)getpid(), zt_rand());
    for (int i = 0; i < 2; i++) {
        s_bucket_rank(&r[i].f, r[i].vars, i);
        r[i].job = job;
    }
    static float mean[S_N]; /* the same at both steps: step 0 leaves it on both ranks */
    for (int i = 0; i < S_N; i++)
        mean[i] = (r[0].f.grads[i] + r[1].f.grads[i]) / 2.0f;
    s_script_want = mean;
    s_two_ranks(s_node_thread, r, sizeof r[0]);
    s_script_want = NULL;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(r[i].st[0], ZPS_ERR_STALE, "rank %d step 0: %s", i,
                     zps_strerror(r[i].st[0]));
        cr_assert_eq(r[i].redo[0], 7, "rank %d did not hear of the rollback", i);
        cr_assert_eq(r[i].st[1], ZPS_OK, "rank %d step 1: %s", i, zps_strerror(r[i].st[1]));
        cr_assert_eq(r[i].redo[1], -1);
        cr_assert_eq(memcmp(r[i].f.grads, mean, sizeof mean), 0, "rank %d: not the mean", i);
    }
    cr_assert_eq(r[0].ends, 2, "the leader's end_step was not called at every step");
    cr_assert_eq(r[0].handed, 2 + S_NV, "step 0: 2 groups then none; step 1: all");
    cr_assert_eq(r[0].wrong, 0, "%d group(s) handed on before the node's mean was in place",
                 r[0].wrong);
    for (int v = 0; v < S_NV; v++)
        cr_expect(r[0].early[v], "variable %d reached the leader's back-end only at end_step",
                  v);
}

/* ---- the node back-end on devices (trainer/sync_node_dev.c) over the staged back-end ----
 * The node's collectives run on the host over the node's segment (staged memory is host
 * memory), and, as on NCCL's stream, a sum only queues: it runs when a point, a join, a
 * broadcast or a drain asks for it. So a leader whose copy to the host did not wait for
 * the point after a bucket's sum hands on gradients that are not the node's mean. */

typedef struct s_hcoll {
    tr_allreduce *ar;
    float *q[S_NV + 2];   // queued collectives, in order: sums, and a broadcast (qb)
    size_t qn[S_NV + 2];
    int qb[S_NV + 2];
    int nq;
    int invalid;          // as after an abort: valid() and join() fail
    k_event *copies;      // the staged copy queue's end, to run what it holds
} s_hcoll;

static zps_status s_hc_run(void *ctx)
{
    s_hcoll *c = ctx;
    zps_status st = ZPS_OK;
    for (int i = 0; i < c->nq && st == ZPS_OK; i++)
        st = c->qb[i] ? tr_allreduce_broadcast(c->ar, c->q[i], c->qn[i] * sizeof(float), 0)
                      : tr_allreduce_sum(c->ar, c->q[i], c->qn[i], 1);
    c->nq = 0;
    return st;
}
static zps_status s_hc_queue(s_hcoll *c, float *dev, size_t n, int bcast)
{
    if (c->nq == S_NV + 2)
        return ZPS_ERR_INTERNAL;
    c->q[c->nq] = dev, c->qn[c->nq] = n, c->qb[c->nq++] = bcast;
    return ZPS_OK;
}
/* A device would have run the copies queued so far by now: a copy that did not wait for
 * the point after the sums copies the gradients as backward left them. */
static zps_status s_hc_sum(void *ctx, float *dev, size_t n)
{
    s_hcoll *c = ctx;
    const k_backend *be = k_backend_staged();
    ZPS_TRY(be->event_record(c->copies, K_QUEUE_OUT));
    ZPS_TRY(be->event_sync(c->copies));
    return s_hc_queue(c, dev, n, 0);
}
static zps_status s_hc_broadcast(void *ctx, float *dev, size_t n)
{
    return s_hc_queue(ctx, dev, n, 1);
}
static zps_status s_hc_point(void *ctx, struct k_event *e)
{
    ZPS_TRY(s_hc_run(ctx));
    return k_backend_staged()->event_record(e, K_QUEUE_COMPUTE);
}
static zps_status s_hc_valid(void *ctx) { return ((s_hcoll *)ctx)->invalid ? ZPS_ERR_NCCL : 0; }
static zps_status s_hc_join(void *ctx)
{
    ZPS_TRY(s_hc_valid(ctx));
    return s_hc_run(ctx);
}
static void s_hc_destroy(void *ctx)
{
    k_backend_staged()->event_free(((s_hcoll *)ctx)->copies);
    free(ctx);
}
static s_hcoll *s_hc_last; // the one s_hc_new made last
static zps_status s_hc_new(tr_allreduce *ar, const tr_sync_env *env, tr_node_coll *out)
{
    (void)env;
    s_hcoll *c = zps_xcalloc(1, sizeof *c);
    c->ar = ar;
    s_hc_last = c;
    zps_status st = k_backend_staged()->event_new(&c->copies);
    if (st != ZPS_OK) {
        free(c);
        return st;
    }
    *out = (tr_node_coll){.ctx = c, .sum = s_hc_sum, .broadcast = s_hc_broadcast,
                          .point = s_hc_point, .valid = s_hc_valid, .join = s_hc_join,
                          .drain = s_hc_run, .destroy = s_hc_destroy};
    return ZPS_OK;
}

typedef struct s_dev_rank {
    s_fixture f;
    nn_var vars[S_NV];
    const char *job;
    const k_backend *be;       // the ranks' device back-end
    tr_node_coll_new_fn coll_new;
    float *dparams, *dgrads;   // the staged back-end's
    float start[S_N];          // the device values after set-up
    float after[2][S_N];       // ... after steps 0 and 1
    float grads[S_N];          // ... and the gradients after step 1
    zps_status st[2];          // end_step of steps 0 and 1, or the set-up's failure
    int64_t redo[2];
    int handed, wrong, ends;   // leader: its scripted back-end's counts at the end
} s_dev_rank;

static void *s_dev_thread(void *p)
{
    s_dev_rank *r = p;
    const k_backend *be = r->be;
    snprintf(r->f.cfg.job, sizeof r->f.cfg.job, "%s", r->job);
    r->f.cfg.node_trainers = r->f.env.n_trainers;
    r->dparams = be->alloc(sizeof r->f.params);
    r->dgrads = be->alloc(sizeof r->f.grads);
    cr_assert(r->dparams && r->dgrads);
    cr_assert_eq(be->copy_in(r->dparams, r->f.params, sizeof r->f.params), ZPS_OK);
    cr_assert_eq(be->copy_in(r->dgrads, r->f.grads, sizeof r->f.grads), ZPS_OK);
    r->f.env.be = be, r->f.env.params = r->dparams, r->f.env.grads = r->dgrads;
    tr_sync *s = NULL;
    r->st[0] = r->st[1] = tr_sync_node_dev_with(&r->f.env, r->coll_new, s_script_new, &s);
    if (s)
        cr_assert_eq(be->copy_out(r->start, r->dparams, sizeof r->start), ZPS_OK);
    for (int step = 0; step < 2 && s; step++) {
        int stop = 0;
        zps_status st = s->begin_step(s, step, &stop);
        if (st == ZPS_OK) /* the gradients of this step: the fixture's again */
            st = be->copy_in(r->dgrads, r->f.grads, sizeof r->f.grads);
        for (int v = S_NV - 1; v >= 0 && st == ZPS_OK; v--)
            st = s->grads_ready(s, (size_t)v, 1);
        tr_step_record rec = tr_step_record_empty(step + 1);
        r->st[step] = st == ZPS_OK ? s->end_step(s, &rec) : st;
        r->redo[step] = s->redo_from;
        if (r->st[step] == ZPS_OK || r->redo[step] >= 0)
            cr_assert_eq(s->params_ready(s), ZPS_OK);
        cr_assert_eq(be->copy_out(r->after[step], r->dparams, sizeof r->start), ZPS_OK);
        if (step == 0 && r->f.env.id == 0)
            s_scripted->fail_at = -1; /* the redo goes through */
    }
    if (s)
        cr_assert_eq(be->copy_out(r->grads, r->dgrads, sizeof r->grads), ZPS_OK);
    if (s && r->f.env.id == 0)
        r->handed = s_scripted->handed, r->wrong = s_scripted->wrong, r->ends = s_scripted->ends;
    tr_sync_destroy(&s);
    be->free(r->dparams);
    be->free(r->dgrads);
    return NULL;
}

/* --node-trainers with a GPU per trainer: every rank starts from the leader's values; each
 * bucket reaches the leader's PS back-end (through stage.c's mirror) holding the node's mean,
 * also when the sums lag; a refused hand-off stops the step's later ones and its rollback
 * (redo_from) reaches every rank with the leader's (rolled back) values; after a good step
 * every rank has the leader's new values and the mean gradient. */
/* Runs a node of n_ranks (1 or 2) on be with coll_new's collectives; checks the above. */
static void s_dev_node(int n_ranks, const k_backend *be, tr_node_coll_new_fn coll_new)
{
    zt_seed_init();
    zps_log_set_level(ZPS_LOG_OFF);
    static s_dev_rank r[2];
    char job[64];
    snprintf(job, sizeof job, "nv%d-%u", (int)getpid(), zt_rand());
    for (int i = 0; i < n_ranks; i++) {
        s_bucket_rank(&r[i].f, r[i].vars, i);
        r[i].f.env.n_trainers = n_ranks;
        r[i].job = job, r[i].be = be, r[i].coll_new = coll_new;
    }
    static float mean[S_N];
    for (int i = 0; i < S_N; i++)
        mean[i] = n_ranks == 1 ? r[0].f.grads[i] : (r[0].f.grads[i] + r[1].f.grads[i]) / 2.0f;
    s_script_want = mean;
    s_script_bump = 1;
    if (n_ranks == 1)
        s_dev_thread(&r[0]);
    else
        s_two_ranks(s_dev_thread, r, sizeof r[0]);
    s_script_want = NULL;
    s_script_bump = 0;
    for (int i = 0; i < n_ranks; i++) {
        cr_assert_eq(r[i].st[0], ZPS_ERR_STALE, "rank %d step 0: %s", i,
                     zps_strerror(r[i].st[0]));
        cr_assert_eq(r[i].redo[0], 7, "rank %d did not hear of the rollback", i);
        cr_assert_eq(r[i].st[1], ZPS_OK, "rank %d step 1: %s", i, zps_strerror(r[i].st[1]));
        cr_assert_eq(r[i].redo[1], -1);
        for (int k = 0; k < S_N; k++) {
            cr_assert_eq(r[i].start[k], r[0].f.params[k], "rank %d starts off the leader's "
                         "values at %d", i, k);
            for (int step = 0; step < 2; step++)
                cr_assert_eq(r[i].after[step][k], r[0].f.params[k] + (float)(step + 1),
                             "rank %d after step %d: not the leader's values at %d", i, step,
                             k);
        }
        cr_assert_eq(memcmp(r[i].grads, mean, sizeof mean), 0, "rank %d: not the mean", i);
    }
    cr_assert_eq(r[0].ends, 2, "the leader's end_step was not called at every step");
    cr_assert_eq(r[0].handed, 2 + S_NV, "step 0: 2 groups then none; step 1: all");
    cr_assert_eq(r[0].wrong, 0, "%d group(s) reached the leader's back-end without the node's "
                 "mean", r[0].wrong);
}

Test(tr_sync, node_on_devices_spreads_the_mean_and_the_leaders_values)
{
    s_dev_node(2, k_backend_staged(), s_hc_new);
}

/* An NCCL abort ends the sums' kernels early, and the copies after them complete: what they
 * copied is no mean and must not reach the servers. One rank whose collectives are broken
 * after their points were recorded: nothing is handed on, and the step fails. */
Test(tr_sync, node_on_devices_hands_nothing_on_after_an_abort)
{
    zt_seed_init();
    zps_log_set_level(ZPS_LOG_OFF);
    static s_fixture f;
    static nn_var vars[S_NV];
    s_bucket_rank(&f, vars, 0);
    f.env.n_trainers = 1;
    f.cfg.node_trainers = 1;
    const k_backend *be = k_backend_staged();
    float *dp = be->alloc(sizeof f.params), *dg = be->alloc(sizeof f.grads);
    cr_assert(dp && dg);
    cr_assert_eq(be->copy_in(dp, f.params, sizeof f.params), ZPS_OK);
    cr_assert_eq(be->copy_in(dg, f.grads, sizeof f.grads), ZPS_OK);
    f.env.be = be, f.env.params = dp, f.env.grads = dg;
    tr_sync *s = NULL;
    cr_assert_eq(tr_sync_node_dev_with(&f.env, s_hc_new, s_script_new, &s), ZPS_OK);
    int stop = 0;
    cr_assert_eq(s->begin_step(s, 0, &stop), ZPS_OK);
    s_hc_last->invalid = 1; /* the points of this step's buckets come, then the abort */
    for (int v = S_NV - 1; v >= 0; v--)
        (void)s->grads_ready(s, (size_t)v, 1);
    tr_step_record rec = tr_step_record_empty(1);
    zps_status st = s->end_step(s, &rec);
    cr_assert_neq(st, ZPS_OK, "a step over broken collectives succeeded");
    tr_sync_destroy(&s); /* the hand-offs still queued run first */
    cr_assert_eq(s_script_calls, 0, "%d group(s) handed on after the abort", s_script_calls);
    be->free(dp);
    be->free(dg);
}

/* The same on a real GPU with NCCL (one rank: NCCL refuses two on one GPU, and the lent
 * machines have one): the leader's copy to the host waits for the point on NCCL's stream,
 * and its new values go up and through NCCL's broadcast. */
Test(gpu_sync, node_of_one_gpu_through_nccl, .timeout = 60)
{
    const k_backend *be = ZT_CUDA_OR_SKIP();
    s_dev_node(1, be, tr_node_coll_nccl_new);
}

/* ---- the communication thread (trainer/sync_worker.c) ---- */

typedef struct s_wlog {
    size_t ran[8];          // the jobs' lo, in the order they ran
    zps_status failed[8];   // what each was told had failed before it
    int n;
    size_t fail_lo;         // the job with this lo fails (ZPS_ERR_TIMEOUT)
} s_wlog;

static zps_status s_wjob(void *ctx, const tr_job *j, zps_status failed)
{
    s_wlog *l = ctx;
    l->ran[l->n] = j->lo, l->failed[l->n] = failed;
    l->n++;
    return j->lo == l->fail_lo ? ZPS_ERR_TIMEOUT : ZPS_OK;
}

/* Jobs run in the order posted; the first failure is kept, passed to every later job and
 * returned by the wait until cleared; a step posts at most max jobs (the next one is refused
 * and kept as the failure); stop runs what is still queued. */
Test(tr_sync, worker_runs_jobs_in_order_and_keeps_the_first_failure)
{
    zps_log_set_level(ZPS_LOG_OFF);
    static s_wlog l = {.fail_lo = 2};
    tr_worker w;
    cr_assert_eq(tr_worker_start(&w, 3, s_wjob, &l, "test"), ZPS_OK);
    for (size_t lo = 1; lo <= 3; lo++)
        cr_assert_eq(tr_worker_post(&w, &(tr_job){.lo = lo}), ZPS_OK);
    cr_assert_eq(tr_worker_wait(&w), ZPS_ERR_TIMEOUT, "job 2's failure not kept");
    cr_assert_eq(l.n, 3);
    for (int k = 0; k < 3; k++)
        cr_assert_eq(l.ran[k], (size_t)k + 1, "job %d ran out of order", k + 1);
    cr_assert(l.failed[0] == ZPS_OK && l.failed[1] == ZPS_OK, "told of a failure too early");
    cr_assert_eq(l.failed[2], ZPS_ERR_TIMEOUT, "job 3 was not told job 2 failed");
    cr_assert_eq(tr_worker_err(&w), ZPS_ERR_TIMEOUT);
    tr_worker_clear(&w);
    cr_assert_eq(tr_worker_err(&w), ZPS_OK);
    /* the next step: the queue was emptied by the wait, so three fit again, a fourth not */
    for (size_t lo = 4; lo <= 6; lo++)
        cr_assert_eq(tr_worker_post(&w, &(tr_job){.lo = lo}), ZPS_OK);
    cr_assert_eq(tr_worker_post(&w, &(tr_job){.lo = 7}), ZPS_ERR_INTERNAL);
    cr_assert_eq(tr_worker_wait(&w), ZPS_ERR_INTERNAL, "the refused post is the step's failure");
    cr_assert_eq(l.n, 6, "job 7 ran although it was refused");
    tr_worker_clear(&w);
    cr_assert_eq(tr_worker_fail(&w, ZPS_ERR_INVALID), ZPS_ERR_INVALID);
    cr_assert_eq(tr_worker_fail(&w, ZPS_ERR_NOMEM), ZPS_ERR_INVALID, "a later failure won");
    tr_worker_clear(&w);
    cr_assert_eq(tr_worker_post(&w, &(tr_job){.lo = 8}), ZPS_OK);
    tr_worker_stop(&w); /* runs job 8 first */
    cr_assert_eq(l.n, 7);
    cr_assert_eq(l.ran[6], 8u);
    tr_worker_stop(&w); /* a second stop does nothing */
}
