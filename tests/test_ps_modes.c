/* test_ps_modes.c — async and ssp end to end against zps-server processes.
 * async: the values equal the pushes applied one by one in the server's arrival order
 * (the test serialises pushes, in an order drawn from the seed, so it knows that order),
 * including stale gradients, and STATS records their staleness.
 * ssp (s = 2): a fast trainer's pull blocks when it is 3 clocks ahead of the slow one and
 * completes once the slow one pushes. */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"
#include "ps/client.h"
#include "ps/dtype.h"
#include "ps/optim.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"

static const ps_var s_vars[] = {{"w1", 3000}, {"b1", 7}, {"w2", 1500}, {"b2", 3}};
#define NV 4

/* The state of one async case: two trainers' clients and copies, and the reference. */
typedef struct acase {
    uint64_t seed, r, n, applied;
    int nv;
    ps_dtype dt;
    ps_optim_config o;
    ps_client *c[2];
    float *ref, *v[2], *g, *slots[2];
    uint64_t ver[2]; // the version of v[t]
    uint16_t *wire;
    int pushes[2];   // by each trainer so far
} acase;

/* Both trainers' clients (wire dtype a->dt) to the servers at uris, registered for plan;
 * the servers' flags make the job async. */
static void s_async_connect(acase *a, const ps_plan *plan, const char *const *uris)
{
    ps_client_opts co;
    ps_client_opts_default(&co);
    co.push_dtype = a->dt;
    for (int t = 0; t < 2; t++) {
        co.packed = t == 0; /* trainer 1: one frame per piece, zero-copy from its buffer */
        cr_assert_eq(ps_client_new(uris, 2, (uint32_t)t, &co, &a->c[t]), ZPS_OK);
        ps_job eff;
        cr_assert_eq(ps_client_register(a->c[t], plan, NULL, &eff), ZPS_OK);
        cr_assert_eq(eff.mode, PS_MODE_ASYNC);
    }
}

/* Trainer t refreshes its copy v[t] and learns its version. */
static void s_async_pull(acase *a, int t)
{
    ps_ticket tk;
    cr_assert_eq(ps_client_pull(a->c[t], 0, a->nv, a->v[t], 0, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait_version(a->c[t], tk, &a->ver[t]), ZPS_OK);
}

/* Push k: a trainer drawn from the seed pushes a gradient from its (maybe stale) copy; the
 * reference applies it as received. Every other push the trainer refreshes and compares. */
static void s_async_push(acase *a, int k)
{
    uint64_t n = a->n;
    int t = k < 2 ? k : pst_uniform(&a->r) > 0.0f; /* each trainer pushes first once */
    for (uint64_t i = 0; i < n; i++)
        a->g[i] = 0.5f * a->v[t][i] + pst_uniform(&a->r);
    ps_ticket tk;
    if (a->dt == PS_DTYPE_BF16) /* what goes on the wire */
        ps_f32_to_bf16(a->wire, a->g, n);
    if (a->dt == PS_DTYPE_BF16 && a->pushes[t]++ % 2 == 0) /* already rounded, as a GPU
                                                                 * trainer sends them */
        cr_assert_eq(ps_client_push_bf16(a->c[t], 0, a->nv, a->wire, (int64_t)a->ver[t], &tk),
                     ZPS_OK);
    else
        cr_assert_eq(ps_client_push(a->c[t], 0, a->nv, a->g, (int64_t)a->ver[t], &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait(a->c[t], tk), ZPS_OK, "%s", ps_client_last_error(a->c[t]));
    if (a->dt == PS_DTYPE_BF16)
        ps_bf16_to_f32(a->g, a->wire, n);
    else if (k == 0) /* bf16 bits where the wire carries f32 would be misread: refused */
        cr_assert_eq(ps_client_push_bf16(a->c[t], 0, a->nv, a->wire, 0, &tk), ZPS_ERR_INVALID);
    ps_optim_apply(&a->o, a->applied++, a->ref, a->slots, a->g, n);
    /* Only sometimes refresh, so later pushes are stale. */
    if (k % 2 == 0) {
        s_async_pull(a, t);
        cr_assert_eq(a->ver[t], a->applied);
        cr_assert(!memcmp(a->v[t], a->ref, n * 4), "push %d: values differ (seed %llu)", k,
                  (unsigned long long)a->seed);
    }
}

/* Two trainers push in turn (wire dtype dt); the values equal the pushes applied one by one
 * in arrival order, each gradient as the server received it (bf16: rounded, then widened;
 * every other push of each trainer through ps_client_push_bf16, rounded by the caller:
 * trainer 0's packed, trainer 1's zero-copy from its buffer). */
static void s_async_case(const ps_var *vars, int nv, uint64_t chunk_bytes, ps_dtype dt,
                         const char *apply_threads)
{
    acase a = {.seed = pst_seed(), .nv = nv, .dt = dt};
    a.r = a.seed;
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(vars, nv, 2, chunk_bytes, &plan), ZPS_OK);
    uint64_t n = a.n = plan->total;
    pst_server srv[2];
    const char *args[] = {"--mode", "async", "--num-trainers", "2", NULL, NULL, NULL};
    if (apply_threads) /* zps-server --apply-threads (ps/apply_pool.h) */
        args[4] = "--apply-threads", args[5] = apply_threads;
    const char *uris[2];
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(pst_spawn(&srv[i], NULL, args), 0);
        uris[i] = srv[i].uri;
    }
    s_async_connect(&a, plan, uris);
    a.o = pst_optim(PS_OPT_ADAM, 0.01);
    a.ref = zps_xmalloc(n * 4);
    a.g = zps_xmalloc(n * 4);
    a.slots[0] = zps_xcalloc(n, 4);
    a.slots[1] = zps_xcalloc(n, 4);
    a.wire = zps_xmalloc(n * 2);
    for (uint64_t i = 0; i < n; i++)
        a.ref[i] = pst_uniform(&a.r);
    cr_assert_eq(ps_client_init(a.c[0], a.ref, &a.o, NULL), ZPS_OK);
    int first = -1;
    cr_assert_eq(ps_client_init(a.c[1], a.ref, &a.o, &first), ZPS_OK);
    cr_assert_eq(first, 0, "second INIT must be refused (first writer wins)");
    for (int t = 0; t < 2; t++) {
        a.v[t] = zps_xmalloc(n * 4);
        s_async_pull(&a, t);
    }
    const int pushes = 12;
    for (int k = 0; k < pushes; k++)
        s_async_push(&a, k);
    ps_ticket tk;
    cr_assert_eq(ps_client_pull(a.c[0], 0, nv, a.v[0], 0, &tk), ZPS_OK);
    cr_assert_eq(ps_client_wait(a.c[0], tk), ZPS_OK);
    cr_assert(!memcmp(a.v[0], a.ref, n * 4), "final values differ (seed %llu)", (unsigned long long)a.seed);
    char *json;
    cr_assert_eq(ps_client_stats(a.c[0], 0, &json), ZPS_OK);
    cr_assert(strstr(json, "\"staleness\":{\"0\":"), "%s", json);
    cr_assert(!strstr(json, "\"1\":0,\"2\":0,\"3\":0,\"4-7\":0,"), "no stale push recorded: %s", json);
    free(json);
    for (int t = 0; t < 2; t++) {
        ps_client_destroy(&a.c[t]);
        free(a.v[t]);
    }
    for (int i = 0; i < 2; i++)
        pst_kill(&srv[i], SIGTERM);
    free(a.ref);
    free(a.g);
    free(a.wire);
    free(a.slots[0]);
    free(a.slots[1]);
    ps_plan_destroy(&plan);
}

Test(it_ps_modes, async_applies_pushes_in_arrival_order, .timeout = 30)
{
    s_async_case(s_vars, NV, 4096, PS_DTYPE_F32, NULL);
}

/* --apply-threads 3 (ps/apply_pool.h): the plan cuts chunks of 4.3 M / 64 = 67188 floats,
 * each updated in two slices on two threads; the values are the same bits. */
Test(it_ps_modes, async_with_apply_threads_applies_the_same_bits, .timeout = 60)
{
    static const ps_var vars[] = {{"w", 4300000}, {"b", 5}};
    s_async_case(vars, 2, 4u << 20, PS_DTYPE_F32, "3");
}

/* bf16 gradients. The plan cuts chunks of total / 64 values (ps/plan.h): about 9,450 here,
 * so a chunk spans two of the server's widening blocks (8192 values). */
Test(it_ps_modes, async_applies_bf16_pushes_as_received, .timeout = 30)
{
    static const ps_var vars[] = {{"w1", 3000}, {"b1", 7}, {"w2", 600000}, {"b2", 3}};
    s_async_case(vars, 4, 4u << 20, PS_DTYPE_BF16, NULL);
}

Test(it_ps_modes, ssp_blocks_fast_trainer_three_clocks_ahead, .timeout = 30)
{
    uint64_t seed = pst_seed();
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 0, &plan), ZPS_OK);
    uint64_t n = plan->total;
    pst_server srv;
    const char *args[] = {"--mode", "ssp", "--staleness", "2", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    const char *uris[1] = {srv.uri};
    ps_client *fast, *slow;
    ps_job jb = {PS_MODE_SSP, 2, 0, 2};
    cr_assert_eq(ps_client_new(uris, 1, 0, NULL, &fast), ZPS_OK);
    cr_assert_eq(ps_client_new(uris, 1, 1, NULL, &slow), ZPS_OK);
    cr_assert_eq(ps_client_register(fast, plan, &jb, NULL), ZPS_OK, "%s", ps_client_last_error(fast));
    cr_assert_eq(ps_client_register(slow, plan, &jb, NULL), ZPS_OK);
    float *v = zps_xmalloc(n * 4), *g = zps_xmalloc(n * 4);
    uint64_t r = seed;
    for (uint64_t i = 0; i < n; i++)
        v[i] = pst_uniform(&r);
    ps_optim_config o;
    ps_optim_default(&o);
    cr_assert_eq(ps_client_init(fast, v, &o, NULL), ZPS_OK);
    ps_ticket tk;
    int done = 0;
    /* clocks 0, 1, 2: the slow trainer is at clock 0, within the bound */
    for (int c = 0; c < 3; c++) {
        cr_assert_eq(ps_client_pull(fast, 0, NV, v, c, &tk), ZPS_OK);
        cr_assert_eq(ps_client_poll(fast, tk, 5000, &done), ZPS_OK);
        cr_assert(done, "pull at clock %d blocked with the slow trainer at 0 (s = 2)", c);
        cr_assert_eq(ps_client_wait(fast, tk), ZPS_OK);
        for (uint64_t i = 0; i < n; i++)
            g[i] = pst_uniform(&r);
        cr_assert_eq(ps_client_push(fast, 0, NV, g, c, &tk), ZPS_OK);
        cr_assert_eq(ps_client_wait(fast, tk), ZPS_OK);
    }
    /* clock 3 is 3 ahead of the slow trainer: must block */
    cr_assert_eq(ps_client_pull(fast, 0, NV, v, 3, &tk), ZPS_OK);
    cr_assert_eq(ps_client_poll(fast, tk, 300, &done), ZPS_OK);
    cr_assert(!done, "pull at clock 3 did not block with the slow trainer at clock 0");
    ps_ticket ts;
    cr_assert_eq(ps_client_pull(slow, 0, NV, v, 0, &ts), ZPS_OK);
    cr_assert_eq(ps_client_wait(slow, ts), ZPS_OK);
    cr_assert_eq(ps_client_poll(fast, tk, 200, &done), ZPS_OK);
    cr_assert(!done, "a pull by the slow trainer must not release the fast one");
    cr_assert_eq(ps_client_push(slow, 0, NV, g, 0, &ts), ZPS_OK);
    cr_assert_eq(ps_client_wait(slow, ts), ZPS_OK);
    cr_assert_eq(ps_client_poll(fast, tk, 5000, &done), ZPS_OK);
    cr_assert(done, "the fast trainer stayed blocked after the slow one reached clock 1");
    cr_assert_eq(ps_client_wait(fast, tk), ZPS_OK);
    ps_client_destroy(&fast);
    ps_client_destroy(&slow);
    pst_kill(&srv, SIGTERM);
    free(v);
    free(g);
    ps_plan_destroy(&plan);
}

/* A restored ssp server knows no clocks (every one 0), and the pushes the dead process had
 * acknowledged are gone: an ssp pull for step c says its trainer pushed step c - 1, so it
 * raises that trainer's clock. Two trainers pulling step 5 from such a server release each
 * other; without that rule both wait for good. */
Test(it_ps_modes, ssp_pulls_carry_the_clock_a_restored_server_lost, .timeout = 30)
{
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(s_vars, NV, 1, 0, &plan), ZPS_OK);
    pst_server srv;
    const char *args[] = {"--mode", "ssp", "--staleness", "0", "--num-trainers", "2", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    float *v0 = zps_xmalloc(plan->total * 4), *v1 = zps_xmalloc(plan->total * 4);
    ps_client *a = pst_client_init(srv.uri, plan, pst_seed(), NULL);
    ps_client *b = pst_client_connect(srv.uri, 1, NULL, plan);
    ps_ticket ta, tb;
    int done = 0;
    cr_assert_eq(ps_client_pull(a, 0, NV, v0, 5, &ta), ZPS_OK);
    cr_assert_eq(ps_client_poll(a, ta, 300, &done), ZPS_OK);
    cr_assert(!done, "trainer 0's pull at step 5 went with trainer 1 at clock 0 (s = 0)");
    cr_assert_eq(ps_client_pull(b, 0, NV, v1, 5, &tb), ZPS_OK);
    cr_assert_eq(ps_client_poll(b, tb, 10000, &done), ZPS_OK);
    cr_assert(done, "trainer 1's pull at step 5 is still waiting");
    cr_assert_eq(ps_client_wait(b, tb), ZPS_OK, "%s", ps_client_last_error(b));
    cr_assert_eq(ps_client_poll(a, ta, 10000, &done), ZPS_OK);
    cr_assert(done, "trainer 0's pull at step 5 is still waiting");
    cr_assert_eq(ps_client_wait(a, ta), ZPS_OK, "%s", ps_client_last_error(a));
    ps_client_destroy(&a);
    ps_client_destroy(&b);
    pst_kill(&srv, SIGTERM);
    free(v0), free(v1);
    ps_plan_destroy(&plan);
}
