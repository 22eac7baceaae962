/* sync.h — the trainer's gradient synchronisation back-ends (private to trainer/).
 *
 * The training loop (train.c) runs the same step in every mode and leaves what differs to a
 * tr_sync: where the mean gradient goes and where the next values come from. One file per
 * back-end:
 *
 *   sync_local.c      --mode local: the optimizer runs here (ps/optim.c, the servers' code)
 *   sync_ps.c         --mode sync|async|ssp: pushes each layer's gradients from the backward
 *                     hook (sync: per bucket of layers, as PUSHPULLs whose replies bring
 *                     the new values), and the next forward waits for each layer's values
 *                     just before it reads them
 *   sync_allreduce.c  --mode allreduce: shared-memory mean over the node's trainers
 *                     (trainer/allreduce.h) per bucket of layers on a communication thread
 *                     while backward goes on, the local optimizer fused into each bucket's
 *                     reduction; rank 0 decides when every rank stops
 *   sync_node.c       --node-trainers G (PS modes): a node's G trainers all-reduce their
 *                     gradients and one of them runs sync_ps.c for the node (on a device:
 *                     per bucket while backward goes on)
 *   stage.c           a model on a device back-end (backend.h's queues) under any of the
 *                     last three: pinned host mirrors of the values and the gradients,
 *                     moved one layer group at a time on the copy queues (tr_sync_staged_new)
 *   sync_nccl.c       --mode allreduce with the model on a GPU: NCCL sums the device
 *                     gradients per bucket on its own stream, ordered by events, and the
 *                     optimizer runs on the device
 *   sync_node_dev.c   --node-trainers G with a GPU per trainer: the node's sums and values
 *                     over NCCL between the GPUs, and only the leader stages through the host
 *   sync_buckets.c, sync_worker.c  what they share: the buckets, the communication thread
 *
 * A step, as train.c calls it:
 *
 *   begin_step(step, &stop)      every step, before anything else; may overrule *stop
 *   forward (first micro-batch)
 *   params_ready()               the values this step computes with are in params
 *   backward -> grads_ready(first, n) for each layer, last layer first
 *   end_step(&rec)               the step's mean gradient is complete: apply or send it
 *   [params_ready(), evaluate]
 *
 * and at the end of the job: finish() (the final values into params), the final evaluation
 * and export, leave(), destroy(). A job that stops early (an error, a signal) calls
 * abandon() instead of whatever of that did not happen, then destroy().
 *
 * Invariants:
 *  - sync_ps, sync_allreduce and sync_node read and write host memory only (env.params,
 *    env.grads); with a model on a device, stage.c gives them host mirrors and moves the
 *    data. sync_local and sync_nccl work on env.be's memory, wherever that is (k_optim_apply,
 *    NCCL on device buffers); they move nothing between the host and a device. When
 *    trainers share a GPU (NCCL refuses that), sync_nccl.c and sync_node_dev.c decline and
 *    train.c puts their host-memory counterparts under stage.c instead.
 *  - Gradient accumulation is the loop's business: with --accumulate K > 1 the loop sums the
 *    K micro-batches into env.grads, and the last one's backward averages each layer there
 *    and reports it; with K = 1 the model's backward reports its own gradients. Either way
 *    grads_ready comes per layer group, in backward's order, every variable once per step,
 *    after its gradient is final and before end_step.
 *  - Once grads_ready(first, n) returned, the back-end may change those variables' values
 *    before end_step (all-reduce: the fused update on its communication thread): backward
 *    must not read them again in this step (nn calls a layer's hook after its whole
 *    backward), and nothing but the back-end touches params until end_step returns.
 *  - grads_ready may run inside nn's backward, which cannot return a status: a back-end keeps
 *    its first failure, refuses further work, and returns that failure from every later
 *    grads_ready and from end_step. A failure is logged once, where it happens.
 *  - The interface allocates nothing per step.
 */
#ifndef ZPS_TRAINER_SYNC_H
#define ZPS_TRAINER_SYNC_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "trainer/config.h"
#include "trainer/metrics.h"
#include "trainer/nn/nn.h"

/* Installs a forward hook for a back-end (nn_model_set_forward_hook's arguments). */
typedef void (*tr_set_forward_hook_fn)(void *owner, nn_grad_hook hook, void *ctx);

/* What a back-end is built from; everything is borrowed and outlives the back-end. */
typedef struct tr_sync_env {
    const tr_config *cfg;
    int id, n_trainers;       // this trainer, and the trainers of the job
    nn_model *model;          // PS: its forward hook waits for the pulls
    const nn_var *vars;       // (nvars) the model's variables, in order
    size_t nvars;
    size_t nparams;
    float *params;            // (nparams) the model's values
    float *grads;             // (nparams) the step's mean gradient (the model's own, or the
                              // loop's accumulator with --accumulate > 1)
    const uint16_t *grads_bf16; // (nparams) PS with --push-dtype bf16 on a device (stage.c):
                              // the same gradient already rounded to bfloat16, in pinned host
                              // memory; pushes send it, and grads is NULL (NULL: grads)
    const k_backend *be;      // whose memory params and grads are in (NULL: the model's,
                              // or cpu without a model)
    tr_set_forward_hook_fn set_forward_hook; // NULL: nn_model_set_forward_hook on model;
    void *hook_owner;         // else this is called with hook_owner instead (stage.c)
    const char *const *uris;  // (n_uris) PS servers
    int n_uris;
    const atomic_int *stop; // raised by SIGTERM/SIGINT: network waits end at once
    size_t bucket_floats;     // all-reduce: gradients reduced together (0: the default)
    const struct tr_grads_source *grads_source; // stage.c: where reported gradients become
                              // final (NULL: on the compute queue, after their backward)
    struct tr_trace *trace;   // --trace (trace.h; NULL: none): transfers and waits go in it
} tr_sync_env;

typedef struct tr_sync tr_sync;

struct tr_sync {
    /* Starts step `step` (0-based). *stop: in, this trainer wants to stop; out, the job
     * stops now (all-reduce: rank 0 decides for every rank, which would otherwise wait for
     * it in the next sum). */
    zps_status (*begin_step)(tr_sync *s, int64_t step, int *stop);
    /* The values to compute with are in params (PS: waits for the outstanding pulls). */
    zps_status (*params_ready)(tr_sync *s);
    /* The backward hook: the gradients of variables [first, first + n) are final. */
    zps_status (*grads_ready)(tr_sync *s, size_t first, size_t n);
    /* The step's gradient is complete. Fills bytes_pushed, bytes_pulled, net_wait_s,
     * staleness and lr of rec; returns the first failure of the step, grads_ready's too. */
    zps_status (*end_step)(tr_sync *s, tr_step_record *rec);
    /* After the last step: the job's final values into params. *fresh = 1 when they may
     * differ from those the last step ended with (PS: other trainers went on). */
    zps_status (*finish)(tr_sync *s, int *fresh);
    /* After the final evaluation and export: this trainer is done (PS: LEAVE, and with
     * --shutdown-servers the barrier and trainer 0's SHUTDOWN). */
    zps_status (*leave)(tr_sync *s);
    /* The job stops early (an error, a signal, also during set-up): tell the peers now,
     * waiting a fraction of a second at most (a dead server cannot answer; it drops this
     * trainer after its --trainer-timeout). Nothing after a successful leave(). NULL: there
     * is nobody to tell. */
    void (*abandon)(tr_sync *s);
    /* Frees everything; no network traffic. */
    void (*destroy)(tr_sync *s);
    double net_wait;          // seconds blocked on the network or the peers this step
    /* Sync recovery (PS sync mode, docs/ps.md "Recovery"): when params_ready or end_step
     * fails with redo_from >= 0, the servers rolled back to an older version and the
     * values of that version are in params; the loop goes back to step redo_from (its
     * input too) and runs on. -1 otherwise; begin_step resets it. */
    int64_t redo_from;
    /* Sync PS: the servers' version at join (0 for a new job). A trainer that joins a job
     * under way (restarted by zps-launch after a crash, or resuming restored servers)
     * starts at that step of its --steps, its input there too, so the job ends at its
     * target version instead of running this trainer's steps again from 0. */
    int64_t start_step;
};

/* Where a device trainer's reported gradients become final when that is not the compute
 * queue after their backward (sync_node_dev.c: after the node's sums on NCCL's stream), as
 * stage.c sees it. */
typedef struct tr_grads_source {
    void *ctx;
    /* Records e after the gradients reported so far are final, for the device-to-host copy
     * queue to wait for. */
    zps_status (*point)(void *ctx, struct k_event *e);
    /* Once such a point was reached: ZPS_OK when the gradients are what it promised (NCCL:
     * the communicator was not aborted, which ends its kernels early); else they must not be
     * handed on. */
    zps_status (*valid)(void *ctx);
} tr_grads_source;

/* The back-ends. Each logs what failed; *out is the caller's (tr_sync_destroy). */
typedef zps_status (*tr_sync_new_fn)(const tr_sync_env *env, tr_sync **out);
zps_status tr_sync_local_new(const tr_sync_env *env, tr_sync **out);
zps_status tr_sync_ps_new(const tr_sync_env *env, tr_sync **out);
zps_status tr_sync_allreduce_new(const tr_sync_env *env, tr_sync **out);
/* ZPS_OK with *out NULL (and a warning) when trainers of the node share a GPU: then
 * sync_allreduce.c under stage.c instead. */
zps_status tr_sync_nccl_new(const tr_sync_env *env, tr_sync **out);
zps_status tr_sync_node_new(const tr_sync_env *env, tr_sync **out);
/* tr_sync_node_new with the leader's back-end made by lead_new instead of tr_sync_ps_new
 * (tests script it). */
zps_status tr_sync_node_lead_new(const tr_sync_env *env, tr_sync_new_fn lead_new,
                                 tr_sync **out);
/* --node-trainers with each trainer of the node on a GPU of its own (sync_node_dev.c): the
 * node's sums and values cross between the GPUs over NCCL, and the leader's PS back-end runs
 * under stage.c. ZPS_OK with *out NULL (said at INFO) when trainers of the node share a GPU:
 * then sync_node.c under stage.c instead. */
zps_status tr_sync_node_dev_new(const tr_sync_env *env, tr_sync **out);
struct tr_allreduce;
/* A node's collectives on device memory (NCCL's in sync_node_dev.c; a test's on the host). */
typedef struct tr_node_coll {
    void *ctx;
    /* In place on n floats of device memory, queued after the compute queue's work so far
     * (the host does not wait): the node's mean; local rank 0's values on every rank. */
    zps_status (*sum)(void *ctx, float *dev, size_t n);
    zps_status (*broadcast)(void *ctx, float *dev, size_t n);
    /* e: a point after every collective queued so far, and whether what it reached is whole
     * (tr_grads_source's) */
    zps_status (*point)(void *ctx, struct k_event *e);
    zps_status (*valid)(void *ctx);
    zps_status (*join)(void *ctx);  // the compute queue's later work waits for them
    zps_status (*drain)(void *ctx); // the host waits for them
    void (*abandon)(void *ctx);     // this rank stops early (NULL: nothing to tell)
    void (*destroy)(void *ctx);     // NULL: nothing to free
} tr_node_coll;
typedef zps_status (*tr_node_coll_new_fn)(struct tr_allreduce *ar, const tr_sync_env *env,
                                          tr_node_coll *out);
/* NCCL over the node's GPUs (each rank's k_device_gpu). When two ranks use one GPU it makes
 * nothing (out->sum NULL; said at INFO), and tr_sync_node_dev_with then neither. */
zps_status tr_node_coll_nccl_new(struct tr_allreduce *ar, const tr_sync_env *env,
                                 tr_node_coll *out);
/* tr_sync_node_dev_new with the node's collectives made by coll_new over the node's segment,
 * and the leader's back-end under stage.c made by lead_new (tests script both). */
zps_status tr_sync_node_dev_with(const tr_sync_env *env, tr_node_coll_new_fn coll_new,
                                 tr_sync_new_fn lead_new, tr_sync **out);
/* The all-reduce back-ends' start of a step (sync_allreduce.c, sync_nccl.c), and the node
 * back-ends' before the leader's (sync_node.c, sync_node_dev.c): *stop in, this rank's wish
 * (a signal, --time-limit, the target reached); out, whether any rank wished to stop, the
 * same on every rank (one sum over the segment). A rank that stopped alone would leave the
 * others waiting in the next sum; one whose wish was overruled would ignore its SIGTERM. */
zps_status tr_sync_any_stop(struct tr_allreduce *ar, int *stop);
/* What they share with sync_node.c: what the leader tells its node at set-up and after each
 * step, over the node's segment ... */
typedef struct tr_node_word {
    int32_t status;           // zps_status of the leader's step
    int32_t stop;             // begin_step: the node stops now
    int64_t redo_from;        // the PS back-end's (sync rollback), -1 otherwise
    int64_t start_step;       // at set-up: the job's step (a job under way)
    int32_t fresh;            // finish: the final values may differ from the last step's
    int32_t pad;
} tr_node_word;
zps_status tr_node_share(struct tr_allreduce *ar, tr_node_word *w);
/* ... the node's segment "<job>-node<k>" (ZPS_ERR_CONFIG when --node-trainers does not
 * divide the trainers) ... */
zps_status tr_node_open(const tr_sync_env *env, struct tr_allreduce **ar);
/* ... and the leader's set-up result, as every rank logs it; returns st. */
zps_status tr_node_lead_result(const tr_sync_env *env, int group, zps_status st);
/* The NCCL back-ends' buckets (sync_nccl.c, sync_node_dev.c): about TR_NCCL_BUCKETS a step,
 * none under TR_NCCL_BUCKET_MIN floats. NCCL's launch costs a few microseconds, small against
 * a GPU layer's backward, so more and earlier buckets than the shared-memory back-end's
 * overlap more. */
#define TR_NCCL_BUCKETS 16
#define TR_NCCL_BUCKET_MIN 262144
/* inner_new (ps or allreduce) over pinned host mirrors of env's params and grads, which are
 * in the memory of env->model's device back-end (one with k_backend_async; without a model,
 * env->be's, and no forward hook: tests drive the calls): the mirrors
 * start as copies of the model's values, and the data moves as stage.c says. bf16_out: the
 * inner back-end pushes gradients as they are, in bfloat16 (a PS client with push_dtype
 * bf16): they are rounded on the device and only the bf16 copies cross (env.grads_bf16). */
zps_status tr_sync_staged_new(const tr_sync_env *env, tr_sync_new_fn inner_new, int bf16_out,
                              tr_sync **out);
/* A staged back-end's (tr_sync_staged_new) values that the device does not hold yet go up
 * now, from the mirror as it is (whatever the inner back-end left there: the next values, or
 * a rollback's), and the compute queue's later work waits for them (sync_node_dev.c: before
 * the node's broadcast). */
zps_status tr_sync_staged_upload(tr_sync *staged);

/* The buckets of the all-reduce back-ends (sync_buckets.c; sync_allreduce.c, sync_nccl.c,
 * sync_node.c, sync_node_dev.c): backward reports variables last first, the floats reported
 * since the last bucket left are [lo, hi), and a bucket leaves once it holds `floats`; the
 * rest at end_step. */
typedef struct tr_buckets {
    const nn_var *vars;       // (nvars) the model's (NULL: everything leaves at the end)
    size_t nvars, n;          // variables, floats
    size_t floats;            // a full bucket
    size_t lo, hi;            // reported, not yet sent
    size_t vlo, vhi;          // their variables [vlo, vhi)
} tr_buckets;
/* A bucket that leaves: floats [lo, hi) and the variables [first, first + nv) (and any floats
 * between them that no variable covers). */
typedef struct tr_bucket {
    size_t lo, hi;
    size_t first, nv;
} tr_bucket;
/* The shared-memory back-ends' buckets (sync_allreduce.c, sync_node.c): about
 * TR_SHM_BUCKETS a step, none under TR_SHM_BUCKET_MIN floats (256 KiB, two slices of the
 * segment). The first leaves early in backward, and each round costs the processes a few
 * thread wake-ups, which on a machine where they share the cores with the computing threads
 * cost more than the overlap brings (Inception-v3 at width 0.25 was slower with twenty
 * buckets than with four). */
#define TR_SHM_BUCKETS 4
#define TR_SHM_BUCKET_MIN 65536
/* About per_step buckets a step, none under min floats; env->bucket_floats overrides. */
void tr_buckets_init(tr_buckets *b, const tr_sync_env *env, size_t per_step, size_t min);
/* A step begins: no variable reported yet. */
void tr_buckets_reset(tr_buckets *b);
/* Variables [first, first + n) are final: 1 with the full bucket *out to send now, 0 when
 * none is full, -1 (logged) when they came out of order. */
int tr_buckets_report(tr_buckets *b, size_t first, size_t n, tr_bucket *out);
/* end_step: 1 with what is left in *out (its lo is 0); 0 when nothing is. */
int tr_buckets_rest(tr_buckets *b, tr_bucket *out);

/* The communication thread of sync_allreduce.c, sync_node.c and stage.c (sync_worker.c):
 * backward's hooks post jobs, which run one at a time in order on the thread while backward
 * goes on. A job is whatever its owner's fn makes of these fields. */
typedef struct tr_job {
    size_t lo, hi;            // floats [lo, hi)
    size_t first, n;          // variables [first, first + n)
    uint64_t t0;              // --trace: when it was posted (0: not traced)
} tr_job;
/* Runs one job; failed is the first failure of an earlier job (ZPS_OK: none), after which
 * the job does only what must still happen (the node's sums: the peers wait for them). */
typedef zps_status (*tr_worker_fn)(void *ctx, const tr_job *job, zps_status failed);
typedef struct tr_worker {
    tr_worker_fn fn;
    void *ctx;
    const char *who;          // its log lines' module (tr_worker_start)
    tr_job *q;                // (max) this step's jobs
    size_t max, posted, done; // under mu
    zps_status err;           // the first failure a job returned, under mu
    int quit, up, inited;
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    pthread_t thread;
} tr_worker;
/* Starts the thread (signals blocked in it); at most max_jobs jobs a step. Logs as `who`.
 * On failure tr_worker_stop still frees what was made. */
zps_status tr_worker_start(tr_worker *w, size_t max_jobs, tr_worker_fn fn, void *ctx,
                           const char *who);
/* Queues a job; ZPS_ERR_INTERNAL (logged, kept) past max_jobs in a step. */
zps_status tr_worker_post(tr_worker *w, const tr_job *job);
/* The first failure kept so far (from a hook: refuse more work). */
zps_status tr_worker_err(tr_worker *w);
/* Keeps st (a hook's own failure) unless a failure is kept already; returns the kept one. */
zps_status tr_worker_fail(tr_worker *w, zps_status st);
/* Waits until every job posted ran, empties the queue for the next step; the kept failure. */
zps_status tr_worker_wait(tr_worker *w);
/* Forgets the kept failure (stage.c: the inner back-end judged it). The thread is idle. */
void tr_worker_clear(tr_worker *w);
/* Runs what is queued, joins the thread, frees the queue; a no-op after the first call. */
void tr_worker_stop(tr_worker *w);

/* The forward hook as env says (set_forward_hook, or the model's own). */
static inline void tr_sync_env_forward_hook(const tr_sync_env *env, nn_grad_hook hook,
                                            void *ctx)
{
    if (env->set_forward_hook)
        env->set_forward_hook(env->hook_owner, hook, ctx);
    else
        nn_model_set_forward_hook(env->model, hook, ctx);
}

static inline void tr_sync_destroy(tr_sync **ps)
{
    if (ps && *ps) {
        (*ps)->destroy(*ps);
        *ps = NULL;
    }
}

/* The local back-end, which the all-reduce back-end embeds (first) and extends: the optimizer
 * applied in the trainer through k_optim_apply on the model's back-end (the servers' own
 * update, common/optim_math.h, so the bits are ps_optim_apply's), on slots it owns in that
 * back-end's memory. Set up once; a step allocates nothing. */
typedef struct tr_sync_local {
    tr_sync base;             // first: the tr_sync the loop holds
    const ps_optim_config *opt;
    const k_backend *be;      // where params, grads and the slots live (the model's)
    float *params, *grads;    // (n) borrowed from the env
    size_t n;
    float *slots[2];          // (n) each, as many as the optimizer needs
    int64_t step;             // the step begun last (0-based)
    zps_optim_step st;        // its constants (tr_sync_local_begin)
} tr_sync_local;

/* Makes *l a local back-end (its calls in l->base), its optimizer slots allocated; a
 * back-end that extends it then replaces some of them. On failure nothing is left to free. */
zps_status tr_sync_local_init(tr_sync_local *l, const tr_sync_env *env);
/* tr_sync_local_init for a back-end that extends the local one: then its own begin_step,
 * grads_ready, end_step and destroy (those of `own`) replace the local ones, and its
 * params_ready, finish and abandon where it has them. */
zps_status tr_sync_local_extend(tr_sync_local *l, const tr_sync_env *env, const tr_sync *own);
/* Step `step` begins: its optimizer constants into l->st. */
void tr_sync_local_begin(tr_sync_local *l, int64_t step);
/* Applies step l->step of the mean gradient in grads; rec->lr = its learning rate. */
zps_status tr_sync_local_apply(tr_sync_local *l, tr_step_record *rec);
/* Frees what init allocated, not l itself. */
void tr_sync_local_free(tr_sync_local *l);

#endif
