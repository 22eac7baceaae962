/* train.c — the training loop (see train.h).
 *
 * Set-up (servers, device, model, data, evaluation cache, the mode's sync back-end, metrics),
 * then s_train: one step per iteration, the same in every mode, reading top to bottom:
 *
 *     stop check -> begin_step -> forward/backward (micro-batches) -> end_step
 *       -> maybe evaluate -> metrics record
 *
 * What differs between local, PS and all-reduce training lives behind tr_sync (sync.h);
 * what differs between a classifier and the detector (the loss, what a step record says, the
 * evaluation's score: accuracy or mAP@0.5) behind tr_task (task.h); gradient accumulation
 * (--accumulate) is handled here, in s_forward_backward, and nowhere else.
 *
 * Exits: every way out of a run whose back-end exists tells the peers (the back-end's
 * leave() at the end, abandon() on an error or a signal: s_stop_early) and writes the
 * summary record; a signal stop cuts the back-end's network waits short (ZPS_ERR_INTERRUPTED)
 * and is not a failure.
 *
 * Ownership: tr_run owns everything it creates and frees it on every exit path through
 * s_job_free. Per-step work allocates nothing: batch buffers, the gradient accumulator and
 * the evaluation cache here, and each back-end's slots and tickets, are sized once at start.
 */
#include "trainer/train.h"

#include <assert.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/cluster.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/proc.h"
#include "datasets/pipeline.h"
#include "kernels/device.h"
#include "kernels/kernels.h"
#include "trainer/bn_recal.h"
#include "trainer/input.h"
#include "trainer/metrics.h"
#include "trainer/models/models.h"
#include "trainer/sync.h"
#include "trainer/task.h"
#include "trainer/trace.h"

/* The signal that asked to stop (0: none). The loop checks it before each step and the PS
 * client before each poll slice of a wait, so a trainer blocked on the network stops within
 * 0.1 s. A second signal S_REPEAT_NS or more after the first ends the process the default
 * way; one sooner is the same stop delivered twice and changes nothing (timeout(1) signals
 * its child, then its whole process group, so the child gets its SIGTERM twice: until
 * 2026-12-07 the second one killed it before its LEAVE, make tsan's stop fleet 1 run in 8).
 * The handler runs on tr_run's signal thread (zps_sigthread), never on a thread inside a
 * kernel: so the flags are lock-free atomics, which a handler may write and another thread
 * read (a volatile sig_atomic_t is only that for the handler's own thread; make tsan
 * reported it). */
static_assert(ATOMIC_INT_LOCK_FREE == 2 && ATOMIC_LLONG_LOCK_FREE == 2,
              "the stop flags must be lock-free to be signal-safe");
#define S_REPEAT_NS 1000000000LL
static atomic_int s_stop;
static atomic_llong s_stop_ns; // CLOCK_MONOTONIC of the first signal
static void s_on_signal(int sig)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* async-signal-safe, as are raise and signal */
    long long now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    int none = 0;
    if (atomic_compare_exchange_strong(&s_stop, &none, sig)) {
        atomic_store(&s_stop_ns, now);
        return;
    }
    long long first = atomic_load(&s_stop_ns); /* 0: the first is being recorded now */
    if (first == 0 || now - first < S_REPEAT_NS)
        return;
    signal(sig, SIG_DFL); /* pending until this handler returns: then the default action */
    raise(sig);
}

typedef struct s_job {
    const tr_config *cfg;
    int n_trainers, id;
    const k_backend *be;
    nn_model *model;
    tr_task *task;               // the model kind's loss and score (task.h)
    int score_map;               // its score is mAP@0.5 (the detector), not accuracy
    size_t nvars, nparams;
    const nn_var *vars;
    float *params, *grads;       // the model's flat buffers
    float *acc;                  // (nparams) mean gradient of the micro-batches (--accumulate > 1)
    zps_status acc_err;          // s_acc_hook's first failure in this backward
    ds_pipeline *train;
    int in_c, in_h, in_w, classes;
    size_t sample_floats;
    tr_input *input;             // the training batches (input.h)
    float *eval_x;               // cached test split (eval_n, c, h, w)
    int32_t *eval_y;
    int eval_n;
    ds_box *eval_boxes;          // (eval_box_cap) their boxes (detection datasets)
    int *eval_box_start;         // (eval_n + 1) image k: eval_boxes[start[k] .. start[k + 1])
    int eval_box_cap;
    char **uris;                 // (n_uris) PS servers
    int n_uris;
    tr_sync *sync;               // the mode's back-end (sync.h)
    tr_metrics *metrics;
    tr_trace *trace;             // --trace (NULL: none, or not this trainer's)
    int64_t total;               // steps to run
    /* the run so far */
    int64_t step;                // steps done
    double last_acc, last_loss;  // last evaluation's score (accuracy or mAP; < 0: none yet)
    int64_t last_eval_step;      // steps done when it was measured (-1: none)
    int reached;                 // last_acc reached --stop-accuracy (a target mAP: detector)
    size_t act_bytes;            // the training batch's planned activation block (nn.h)
} s_job;

static void s_job_free(s_job *j)
{
    tr_sync_destroy(&j->sync);
    zps_uris_free(&j->uris, &j->n_uris);
    tr_metrics_destroy(&j->metrics);
    (void)tr_trace_finish(&j->trace); /* a failed run's partial window is still worth a look */
    ds_pipeline_destroy(&j->train);
    tr_task_destroy(&j->task);
    tr_input_destroy(&j->input);
    if (j->be)
        j->be->free(j->acc);
    nn_model_destroy(&j->model);
    zps_aligned_free(j->eval_x);
    free(j->eval_y);
    free(j->eval_boxes);
    free(j->eval_box_start);
}

/* ---- set-up ---- */

/* The PS servers' URIs (--cluster or --servers) and, from a cluster file, the number of
 * trainers. */
static zps_status s_servers(s_job *j)
{
    const tr_config *c = j->cfg;
    if (!c->cluster[0] && !c->servers[0])
        return ZPS_OK;
    zps_parse_error err;
    int n_trainers;
    zps_status st = zps_cluster_server_uris(c->cluster, c->servers, &j->uris, &j->n_uris,
                                            &n_trainers, &err);
    if (st != ZPS_OK) {
        char why[sizeof err.msg + 600];
        if (c->cluster[0])
            zps_log(ZPS_ERROR, "trainer", "%s",
                    zps_cluster_error(c->cluster, &err, why, sizeof why));
        else
            zps_log(ZPS_ERROR, "trainer", "--servers %s", err.msg);
        return st;
    }
    if (c->cluster[0] && !j->n_uris && c->mode != TR_MODE_LOCAL && c->mode != TR_MODE_ALLREDUCE) {
        zps_log(ZPS_ERROR, "trainer", "cluster file %s lists no server: --mode %s needs at "
                "least one (only local and allreduce run without)", c->cluster,
                tr_mode_name(c->mode));
        return ZPS_ERR_CONFIG;
    }
    if (c->cluster[0] && !c->num_trainers)
        j->n_trainers = n_trainers;
    return ZPS_OK;
}

/* Where the model computes (--device, --gpu): the cpu back-end, or the cuda one when a GPU
 * answers (auto) or is required (cuda), or "staged" (the CPU behind a device's copies, for
 * tests of the device paths without a GPU). k_device_select logs the choice. */
static zps_status s_backend(s_job *j)
{
    const tr_config *c = j->cfg;
    if (strcmp(c->device, "staged") == 0) {
        j->be = k_backend_staged();
        zps_log(ZPS_INFO, "trainer", "--device staged: the cpu back-end's ops, with every "
                "tensor behind a device's copies");
        return ZPS_OK;
    }
    k_device_use_gpu(c->gpu);
    k_device_info info;
    ZPS_TRY(k_device_select(c->device, &info));
    j->be = k_backend_cpu();
    if (info.kind != K_DEVICE_CUDA)
        return ZPS_OK;
    char why[320] = "";
    const k_backend *cuda = k_backend_cuda(why, sizeof why);
    if (cuda)
        j->be = cuda;
    else if (strcmp(c->device, "auto") == 0) /* auto never fails for lack of a GPU */
        zps_log(ZPS_WARN, "trainer", "--device auto: a GPU answers, but %s: training on the "
                "CPU", why);
    else {
        zps_log(ZPS_ERROR, "trainer", "--device %s: %s", c->device, why);
        return ZPS_ERR_NO_DEVICE;
    }
    return ZPS_OK;
}

/* Opens a split with the model's input geometry. */
static void s_pipe_opts(const s_job *j, ds_pipeline_opts *o, const char *split)
{
    const tr_config *c = j->cfg;
    tr_input_opts(o, c->data, split, j->in_c, j->in_h, j->in_w);
    o->threads = c->threads;
    o->seed = c->seed;
}

/* The model (seeded weights) and this trainer's training data; the accumulator when
 * --accumulate > 1. */
static zps_status s_model_and_data(s_job *j)
{
    const tr_config *c = j->cfg;
    nn_model_opts mo;
    nn_model_opts_default(&mo, c->model);
    if (c->input_size)
        mo.in_size = c->input_size;
    if (c->in_channels)
        mo.in_channels = c->in_channels;
    else if (strcmp(c->model, "inception_v3") == 0)
        mo.in_channels = 1; /* Fashion-MNIST: gray */
    mo.width = c->width;
    mo.aux = c->aux;
    if (c->dropout >= 0)
        mo.dropout = c->dropout;
    mo.seed = c->seed;
    j->in_c = mo.in_channels;
    j->in_h = j->in_w = mo.in_size;

    /* Training data: this trainer's share, or the global batch stream (--shard batch). */
    ds_pipeline_opts po;
    s_pipe_opts(j, &po, "train");
    int by_batch = c->shard == TR_SHARD_BATCH;
    po.trainer_index = by_batch ? 0 : j->id;
    po.n_trainers = by_batch ? 1 : j->n_trainers;
    int read_batch = c->batch * (by_batch ? j->n_trainers : 1);
    po.batch = read_batch;
    po.augment = c->augment;
    po.skip_corrupt = c->skip_corrupt > 0;
    zps_status st = ds_pipeline_new(&po, &j->train);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "cannot open the training split of %s: %s", c->data,
                zps_strerror(st));
        return st;
    }
    j->classes = c->classes ? c->classes : ds_pipeline_num_classes(j->train);
    if (j->classes <= 0)
        j->classes = 10;
    mo.classes = j->classes;
    ZPS_TRY(nn_model_create(j->be, &mo, &j->model));
    nn_model_set_recompute(j->model, c->recompute);
    nn_model_set_bf16(j->model, c->bf16);
    ZPS_TRY(tr_task_new(c, j->model, j->classes, &j->task));
    j->score_map = strcmp(j->task->score_name, "map") == 0;
    j->vars = nn_model_vars(j->model, &j->nvars);
    j->nparams = nn_model_param_count(j->model);
    j->params = nn_model_params(j->model);
    j->grads = nn_model_grads(j->model);
    j->sample_floats = (size_t)j->in_c * (size_t)j->in_h * (size_t)j->in_w;
    ZPS_TRY(tr_input_new(j->train, j->model, read_batch, j->sample_floats,
                         by_batch ? j->id * c->batch : 0, c->batch, c->skip_corrupt,
                         &j->input));
    if (c->accumulate > 1 && !(j->acc = j->be->alloc(j->nparams * sizeof(float)))) {
        zps_log(ZPS_ERROR, "trainer", "cannot allocate the gradient accumulator (%zu MiB on "
                "the %s back-end)", (j->nparams * sizeof(float)) >> 20, j->be->name);
        return ZPS_ERR_NOMEM;
    }
    zps_log(ZPS_INFO, "trainer",
            "model %s: %zu variables, %zu parameters, input %dx%dx%d, %d classes; data %s: "
            "%llu records for this trainer",
            c->model, j->nvars, j->nparams, j->in_c, j->in_h, j->in_w, j->classes, c->data,
            (unsigned long long)ds_pipeline_records(j->train));
    return ZPS_OK;
}

/* Appends an evaluation batch's boxes to the cache (none for a classification dataset). */
static void s_eval_cache_boxes(s_job *j, const ds_batch_info *info)
{
    int have = j->eval_box_start[j->eval_n], more = info->box_start[info->count];
    if (have + more > j->eval_box_cap) {
        j->eval_box_cap = 2 * (have + more);
        j->eval_boxes = zps_xrealloc(j->eval_boxes, (size_t)j->eval_box_cap * sizeof(ds_box));
    }
    if (more)
        memcpy(j->eval_boxes + have, info->boxes, (size_t)more * sizeof(ds_box));
    for (int k = 1; k <= info->count; k++)
        j->eval_box_start[j->eval_n + k] = have + info->box_start[k];
}

/* Decodes the evaluation set once (first eval_batches batches of the test split). */
static zps_status s_eval_cache(s_job *j)
{
    const tr_config *c = j->cfg;
    ds_pipeline_opts po;
    s_pipe_opts(j, &po, "test");
    po.once = true;
    po.shuffle = false;
    po.batch = 256;
    ds_pipeline *p = NULL;
    zps_status st = ds_pipeline_new(&po, &p);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "cannot open the test split of %s: %s", c->data,
                zps_strerror(st));
        return st;
    }
    int64_t nb = ds_pipeline_batches_per_epoch(p);
    if (c->eval_batches > 0 && c->eval_batches < nb)
        nb = c->eval_batches;
    size_t cap = (size_t)nb * (size_t)po.batch;
    j->eval_x = zps_xaligned(64, cap * j->sample_floats * sizeof(float));
    j->eval_y = zps_xcalloc(cap, sizeof *j->eval_y);
    j->eval_box_start = zps_xcalloc(cap + 1, sizeof *j->eval_box_start);
    j->eval_n = 0;
    for (int64_t b = 0; b < nb; b++) {
        ds_batch_info info;
        st = ds_pipeline_next(p, j->eval_x + (size_t)j->eval_n * j->sample_floats,
                              j->eval_y + j->eval_n, &info);
        if (st == ZPS_ERR_EOF)
            break;
        if (st != ZPS_OK) {
            ds_pipeline_destroy(&p);
            return st;
        }
        s_eval_cache_boxes(j, &info);
        j->eval_n += info.count;
    }
    ds_pipeline_destroy(&p);
    zps_log(ZPS_INFO, "trainer", "evaluation set: %d test images", j->eval_n);
    return ZPS_OK;
}

/* The cached test images as the task's evaluation set. */
static tr_task_batch s_eval_set(const s_job *j)
{
    return (tr_task_batch){.x = j->eval_x, .labels = j->eval_y, .boxes = j->eval_boxes,
                           .box_start = j->eval_box_start, .n = j->eval_n};
}

/* The score (accuracy, or mAP@0.5 for the detector) and mean loss on the cached test images,
 * in inference mode. */
static zps_status s_evaluate(s_job *j, double *score, double *loss)
{
    tr_task_batch set = s_eval_set(j);
    return j->task->evaluate(j->task, &set, score, loss);
}

/* --dump-detections N on the trainer that draws (0): N must be among the evaluated test
 * images; checked at set-up, so that a bad N does not cost a training run. */
static zps_status s_dump_check(const s_job *j)
{
    const tr_config *c = j->cfg;
    if (c->dump_detections < 0 || j->id != 0)
        return ZPS_OK;
    if (!j->task->dump) {
        zps_log(ZPS_ERROR, "trainer", "--dump-detections: model %s predicts no boxes", c->model);
        return ZPS_ERR_INVALID;
    }
    if (c->dump_detections >= j->eval_n) {
        zps_log(ZPS_ERROR, "trainer", "--dump-detections %lld: the evaluation set has %d test "
                "images (raise --eval-batches)", (long long)c->dump_detections, j->eval_n);
        return ZPS_ERR_INVALID;
    }
    return ZPS_OK;
}

/* --dump-detections N: test record N with its predicted and true boxes as --dump-out. */
static zps_status s_dump(s_job *j)
{
    const tr_config *c = j->cfg;
    if (c->dump_detections < 0 || j->id != 0)
        return ZPS_OK;
    tr_task_batch set = s_eval_set(j);
    return j->task->dump(j->task, &set, (int)c->dump_detections, c->data,
                         (uint64_t)c->dump_detections, c->dump_out);
}

/* Trainer 0 evaluates (every trainer with --eval-all); in sync mode with --stop-accuracy
 * every trainer does, because they
 * all hold the same values each step and so reach the same decision at the same step. */
static int s_is_evaluator(const s_job *j)
{
    return j->id == 0 || j->cfg->eval_all ||
           (j->cfg->mode == TR_MODE_SYNC && j->cfg->stop_accuracy > 0);
}

/* The mode's back-end, over the model's values and the step's mean gradient. The PS and
 * shared-memory all-reduce back-ends read host memory: a model on a device reaches them
 * through pinned mirrors (stage.c); local training applies its optimizer where the model is,
 * all-reduce on a GPU is NCCL's (sync_nccl.c), and so are a node's sums when its trainers
 * have a GPU each (sync_node_dev.c). */
static zps_status s_sync_new(s_job *j)
{
    tr_sync_env env = {.cfg = j->cfg, .id = j->id, .n_trainers = j->n_trainers,
                       .model = j->model, .vars = j->vars, .nvars = j->nvars,
                       .nparams = j->nparams, .params = j->params,
                       .grads = j->acc ? j->acc : j->grads, .be = j->be,
                       .uris = (const char *const *)j->uris, .n_uris = j->n_uris,
                       .stop = &s_stop, .trace = j->trace};
    tr_sync_new_fn host_new = tr_sync_allreduce_new;
    int bf16_out = 0; // the host back-end pushes the gradients as they are, in bfloat16
    switch (j->cfg->mode) {
    case TR_MODE_LOCAL:
        return tr_sync_local_new(&env, &j->sync);
    case TR_MODE_SYNC:
    case TR_MODE_ASYNC:
    case TR_MODE_SSP:
        host_new = j->cfg->node_trainers > 1 ? tr_sync_node_new : tr_sync_ps_new;
        /* a node sums f32 gradients first: its leader rounds them as it pushes */
        bf16_out = j->cfg->node_trainers <= 1 && j->cfg->push_dtype == PS_DTYPE_BF16;
        break;
    case TR_MODE_ALLREDUCE:
        /* device gradients: NCCL on the GPU (by name: asking k_backend_cuda would open a
         * GPU for a --device cpu run) */
        if (strcmp(j->be->name, "cuda") == 0) {
            ZPS_TRY(tr_sync_nccl_new(&env, &j->sync));
            if (j->sync) /* else trainers share a GPU: the mirrors below */
                return ZPS_OK;
        }
        break;
    }
    if (j->be->host_memory)
        return host_new(&env, &j->sync);
    if (host_new == tr_sync_node_new && strcmp(j->be->name, "cuda") == 0) {
        /* a GPU per trainer: the node's sums between the GPUs; trainers that share one sum
         * through the host (the mirrors below) */
        ZPS_TRY(tr_sync_node_dev_new(&env, &j->sync));
        if (j->sync)
            return ZPS_OK;
    }
    return tr_sync_staged_new(&env, host_new, bf16_out, &j->sync);
}

/* A sync job already under way (sync.h, start_step): go on from the fleet's step. */
static zps_status s_join_under_way(s_job *j)
{
    int64_t at = j->sync->start_step;
    if (at <= 0)
        return ZPS_OK;
    if (at > j->total)
        at = j->total;
    zps_log(ZPS_INFO, "trainer", "the job is at step %lld of %lld (the servers' version): "
            "going on from there", (long long)at, (long long)j->total);
    tr_input_seek(j->input, at * j->cfg->accumulate);
    j->step = at;
    return ZPS_OK;
}

/* --trace FILE: "{trainer}" in it becomes the id; without it only trainer 0 traces. */
static zps_status s_trace_new(s_job *j)
{
    const tr_config *c = j->cfg;
    const char *mark = strstr(c->trace, "{trainer}");
    if (!c->trace[0] || (!mark && j->id != 0))
        return ZPS_OK;
    char path[600];
    if (mark)
        snprintf(path, sizeof path, "%.*s%d%s", (int)(mark - c->trace), c->trace, j->id,
                 mark + strlen("{trainer}"));
    else
        snprintf(path, sizeof path, "%s", c->trace);
    return tr_trace_new(path, c->trace_from - 1, c->trace_steps, j->id, 0, &j->trace);
}

/* The number of steps, the metrics file and the progress line. */
static zps_status s_metrics_new(s_job *j)
{
    const tr_config *c = j->cfg;
    int64_t per_epoch = ds_pipeline_batches_per_epoch(j->train);
    j->total = c->steps;
    if (!j->total) {
        j->total = (int64_t)ceil(c->epochs * (double)per_epoch / c->accumulate);
        if (j->total < 1)
            j->total = 1;
    }
    tr_metrics_opts mo = {0};
    mo.jsonl_path = c->metrics[0] ? c->metrics : NULL;
    mo.mode = c->progress ? TR_PROGRESS_AUTO : TR_PROGRESS_OFF;
    mo.trainer_id = j->id;
    mo.mode_name = tr_mode_name(c->mode);
    mo.model = c->model;
    mo.batch = c->batch * c->accumulate;
    mo.n_trainers = j->n_trainers;
    /* with a time limit the step count is not the end: no percentage or ETA to mislead */
    mo.total_steps = c->time_limit_s > 0 ? 0 : j->total;
    mo.target_accuracy = c->stop_accuracy;
    mo.score_map = j->score_map;
    mo.seed = c->seed;
    /* the whole configuration in the start record: measured, then written */
    zps_json cj = zps_json_over(NULL, 0);
    tr_config_json(c, &cj);
    char *config = zps_xmalloc(cj.len + 1);
    cj = zps_json_over(config, cj.len + 1);
    tr_config_json(c, &cj);
    mo.config_json = config;
    zps_status st = tr_metrics_new(&mo, &j->metrics);
    free(config);
    ZPS_TRY(st);
    zps_log(ZPS_INFO, "trainer", "%lld steps of %d x %d images (%lld batches per epoch)",
            (long long)j->total, c->accumulate, c->batch, (long long)per_epoch);
    return ZPS_OK;
}

/* Everything before the first step. *done = 1 when the job ends here (--eval-only). */
static zps_status s_setup(s_job *j, tr_result *res, int *done)
{
    const tr_config *c = j->cfg;
    *done = 0;
    ZPS_TRY(s_servers(j));
    if (j->id >= j->n_trainers) {
        zps_log(ZPS_ERROR, "trainer", "--trainer-id %d but the job has %d trainers", j->id,
                j->n_trainers);
        return ZPS_ERR_INVALID;
    }
    ZPS_TRY(s_backend(j));
    ZPS_TRY(s_model_and_data(j));
    if (c->init_weights[0])
        ZPS_TRY(nn_model_load(j->model, c->init_weights));
    /* PS modes resume from the servers' values instead (docs/training.md) */
    int here = c->mode == TR_MODE_LOCAL || c->mode == TR_MODE_ALLREDUCE;
    if (c->resume && here && c->export_path[0] && access(c->export_path, R_OK) == 0) {
        ZPS_TRY(nn_model_load(j->model, c->export_path));
        zps_log(ZPS_INFO, "trainer", "resumed from %s", c->export_path);
    }
    if (s_is_evaluator(j) || c->eval_only)
        ZPS_TRY(s_eval_cache(j));
    ZPS_TRY(s_dump_check(j));
    res->score_name = j->task->score_name;
    if (c->eval_only) {
        ZPS_TRY(s_evaluate(j, &res->accuracy, &res->test_loss));
        res->eval_images = j->eval_n;
        *done = 1;
        return s_dump(j);
    }
    ZPS_TRY(s_trace_new(j)); /* the back-end records its transfers in it */
    ZPS_TRY(s_sync_new(j));
    ZPS_TRY(s_metrics_new(j));
    return s_join_under_way(j);
}

/* ---- the loop ---- */

/* This trainer's wish to stop before the next step: a signal, the accuracy target reached,
 * the time limit. */
static int s_want_stop(const s_job *j, uint64_t t_start)
{
    if (s_stop || j->reached)
        return 1;
    double limit = j->cfg->time_limit_s;
    if (limit > 0 && (double)(zps_now_ns() - t_start) * 1e-9 > limit) {
        zps_log(ZPS_INFO, "trainer", "time limit of %.0f s reached at step %lld", limit,
                (long long)j->step);
        return 1;
    }
    return 0;
}

/* nn's backward hook returns nothing: the back-end keeps its first failure and end_step
 * returns it (sync.h). */
static void s_grads_hook(void *ctx, size_t first, size_t n)
{
    tr_sync *s = ctx;
    (void)s->grads_ready(s, first, n);
}

/* --accumulate K > 1, in the last micro-batch's backward: a layer's gradients are final, so
 * its range of the accumulator is too (acc += grads, acc *= 1 / K: the operations the whole
 * buffer would get, element for element), and it goes to the back-end at once, in the layer
 * groups of K = 1, while backward computes the layers below. */
static void s_acc_hook(void *ctx, size_t first, size_t n)
{
    s_job *j = ctx;
    if (j->acc_err != ZPS_OK)
        return;
    const nn_var *top = &j->vars[first + n - 1];
    size_t lo = j->vars[first].offset, len = top->offset + top->count - lo;
    zps_status st = k_axpy(j->be, len, 1.0f, j->grads + lo, j->acc + lo);
    if (st == ZPS_OK)
        st = k_scale(j->be, len, 1.0f / (float)j->cfg->accumulate, j->acc + lo);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "averaging the micro-batches' gradients: %s",
                zps_strerror(st));
        j->acc_err = st;
        return;
    }
    (void)j->sync->grads_ready(j->sync, first, n);
}

/* Forward and backward over the step's K = --accumulate micro-batches. K = 1: backward hands
 * each layer's gradients to the back-end as soon as they are final. K > 1: the gradients are
 * summed into j->acc, and the last micro-batch's backward averages and hands them over the
 * same way, layer by layer (s_acc_hook). */
static zps_status s_forward_backward(s_job *j, tr_step_record *rec)
{
    const tr_config *c = j->cfg;
    const int K = c->accumulate;
    double loss_sum = 0;
    for (int m = 0; m < K; m++) {
        tr_task_batch b;
        uint64_t t0 = tr_trace_now(j->trace);
        ZPS_TRY(tr_input_next(j->input, &b, j->step + 1));
        tr_trace_span(j->trace, TR_TRACE_MAIN, "input", t0, -1);
        float loss;
        t0 = tr_trace_now(j->trace);
        ZPS_TRY(j->task->forward(j->task, &b, &loss));
        tr_trace_span(j->trace, TR_TRACE_MAIN, "forward", t0, -1);
        if (!isfinite(loss)) {
            zps_log(ZPS_ERROR, "trainer", "loss is %f at step %lld: lower --lr?", (double)loss,
                    (long long)j->step + 1);
            return ZPS_ERR_NONFINITE;
        }
        if (m == 0) {
            t0 = tr_trace_now(j->trace);
            ZPS_TRY(j->sync->params_ready(j->sync));
            tr_trace_span(j->trace, TR_TRACE_MAIN, "wait: values", t0, -1);
        }
        loss_sum += loss;
        t0 = tr_trace_now(j->trace);
        j->acc_err = ZPS_OK;
        if (K == 1)
            ZPS_TRY(j->task->backward(j->task, s_grads_hook, j->sync));
        else
            ZPS_TRY(j->task->backward(j->task, m == K - 1 ? s_acc_hook : NULL, j));
        ZPS_TRY(j->acc_err);
        tr_trace_span(j->trace, TR_TRACE_MAIN, "backward", t0, -1);
        ZPS_TRY(tr_input_done(j->input, j->step + 1 == j->total && m == K - 1, j->step + 1));
        if (K > 1 && m == 0) /* acc = 0 + 1 * grads: the copy, exactly, on any back-end */
            ZPS_TRY(k_fill(j->be, j->nparams, 0.0f, j->acc));
        if (K > 1 && m < K - 1)
            ZPS_TRY(k_axpy(j->be, j->nparams, 1.0f, j->grads, j->acc));
    }
    rec->images = (int64_t)c->batch * K;
    rec->loss = loss_sum / K;
    j->task->record(j->task, rec, K);
    return ZPS_OK;
}

/* Evaluates after the last step and every --eval-every steps, on the evaluating trainers. */
static zps_status s_maybe_evaluate(s_job *j, tr_step_record *rec)
{
    int64_t done = j->step + 1;
    int64_t every = j->cfg->eval_every;
    if (!s_is_evaluator(j) || (done != j->total && !(every && done % every == 0)))
        return ZPS_OK;
    uint64_t t0 = tr_trace_now(j->trace);
    ZPS_TRY(j->sync->params_ready(j->sync)); /* evaluate the newest values */
    double e0 = zps_now_s();
    ZPS_TRY(s_evaluate(j, &j->last_acc, &j->last_loss));
    rec->eval_s = zps_now_s() - e0;
    tr_trace_span(j->trace, TR_TRACE_MAIN, "evaluate", t0, -1);
    if (j->score_map)
        rec->test_map = j->last_acc;
    else
        rec->test_accuracy = j->last_acc;
    rec->test_loss = j->last_loss;
    j->last_eval_step = done;
    return ZPS_OK;
}

/* The training loop: every mode runs this step; the back-end does what differs. */
static zps_status s_train(s_job *j)
{
    const tr_config *c = j->cfg;
    uint64_t t_start = zps_now_ns();
    for (; j->step < j->total; j->step++) {
        int stop = s_want_stop(j, t_start);
        ZPS_TRY(tr_trace_step(j->trace, j->step));
        uint64_t t_step = tr_trace_now(j->trace);
        ZPS_TRY(j->sync->begin_step(j->sync, j->step, &stop));
        if (stop)
            break;
        tr_step_record rec = tr_step_record_empty(j->step + 1);
        zps_status st = s_forward_backward(j, &rec);
        if (!j->act_bytes) /* before an evaluation re-plans for its batch */
            j->act_bytes = nn_model_activation_bytes(j->model);
        uint64_t t_end = tr_trace_now(j->trace);
        if (st == ZPS_OK)
            st = j->sync->end_step(j->sync, &rec);
        tr_trace_span(j->trace, TR_TRACE_MAIN, "end of step", t_end, -1);
        if (st == ZPS_OK) /* its wait for the values may be where a rollback shows */
            st = s_maybe_evaluate(j, &rec);
        if (st != ZPS_OK && j->sync->redo_from >= 0) { /* sync rollback: redo, same input */
            tr_input_seek(j->input, j->sync->redo_from * c->accumulate);
            j->step = j->sync->redo_from - 1;
            continue;
        }
        ZPS_TRY(st);
        tr_trace_span(j->trace, TR_TRACE_MAIN, "step", t_step, j->step + 1);
        ZPS_TRY(tr_metrics_step(j->metrics, &rec));
        if (c->stop_accuracy > 0 && j->last_acc >= c->stop_accuracy && !j->reached) {
            zps_log(ZPS_INFO, "trainer", "test %s %.4f reached the target %.4f at step %lld",
                    j->task->score_name, j->last_acc, c->stop_accuracy, (long long)j->step + 1);
            j->reached = 1;
        }
    }
    return ZPS_OK;
}

/* After the loop: the final values and their accuracy, the export, then goodbye. */
static zps_status s_wrap_up(s_job *j, tr_result *res)
{
    const tr_config *c = j->cfg;
    int fresh;
    ZPS_TRY(j->sync->finish(j->sync, &fresh));
    /* The final model's accuracy, unless the last step measured exactly these values; not
     * after a signal, which wants the trainer gone within a second. */
    if (s_is_evaluator(j) && !s_stop && (fresh || j->last_eval_step != j->step)) {
        ZPS_TRY(s_evaluate(j, &j->last_acc, &j->last_loss));
        j->last_eval_step = j->step;
    }
    if (j->act_bytes)
        zps_log(ZPS_INFO, "trainer", "activations and their gradients: %.1f MiB for a batch "
                "of %d%s", (double)j->act_bytes / (1 << 20), c->batch,
                c->recompute ? " (--recompute)" : "");
    res->steps = j->step;
    res->accuracy = j->last_acc;
    res->test_loss = j->last_loss;
    res->eval_images = j->last_acc >= 0 ? j->eval_n : 0;
    if (c->export_path[0] && j->id == 0) {
        ZPS_TRY(nn_model_save_as(j->model, (nn_weights_format)c->export_format, c->export_path));
        zps_log(ZPS_INFO, "trainer", "wrote %s", c->export_path);
    }
    if (!s_stop)
        ZPS_TRY(s_dump(j));
    ZPS_TRY(tr_trace_finish(&j->trace));
    ZPS_TRY(j->sync->leave(j->sync));
    tr_metrics_set_end(j->metrics, s_stop ? TR_END_SIGNAL : TR_END_DONE,
                       tr_input_skipped(j->input));
    ZPS_TRY(tr_metrics_finish(j->metrics));
    tr_metrics_totals tot;
    tr_metrics_get_totals(j->metrics, &tot);
    zps_log(ZPS_INFO, "trainer",
            "done: %lld steps, %.1f img/s, final training loss %.4f, network wait %.1f%% of "
            "%.1f s",
            (long long)tot.steps, tot.img_per_s, tot.last_loss,
            tot.time_s > 0 ? 100.0 * tot.net_wait_s / tot.time_s : 0, tot.time_s);
    return ZPS_OK;
}

/* Every way out of a run that did not reach s_wrap_up's end: LEAVE (so sync and ssp peers
 * do not wait for a trainer that is gone) and the summary record. A stop asked for by a
 * signal (the network waits it cut short return ZPS_ERR_INTERRUPTED) is not a failure, nor
 * is the servers' SHUTDOWN (ZPS_ERR_SHUTDOWN): ZPS_OK then, else st. */
static zps_status s_stop_early(s_job *j, zps_status st)
{
    int by_signal = s_stop && st == ZPS_ERR_INTERRUPTED;
    int by_shutdown = st == ZPS_ERR_SHUTDOWN; // the servers were shut down (zps-ctl shutdown)
    if (j->sync && j->sync->abandon)
        j->sync->abandon(j->sync);
    if (j->metrics) {
        tr_metrics_set_end(j->metrics, by_signal || by_shutdown ? TR_END_SIGNAL : TR_END_ERROR,
                           j->input ? tr_input_skipped(j->input) : 0);
        tr_metrics_finish(j->metrics);
    }
    if (by_shutdown) {
        zps_log(ZPS_WARN, "trainer", "trainer %d: the servers were shut down (zps-ctl shutdown) "
                "after %lld steps: stopping", j->id, (long long)j->step);
        return ZPS_OK;
    }
    if (!by_signal) {
        /* before the first step the failure's own line is the whole story */
        if (j->step > 0 || !zps_log_errors())
            zps_log(ZPS_ERROR, "trainer", "trainer %d failed after %lld steps: %s", j->id,
                    (long long)j->step, zps_strerror(st));
        return st;
    }
    return ZPS_OK;
}

zps_status tr_run(const tr_config *cfg, tr_result *res)
{
    s_job j = {.cfg = cfg, .id = cfg->trainer_id, .last_acc = -1, .last_loss = -1,
               .last_eval_step = -1};
    j.n_trainers = cfg->num_trainers ? cfg->num_trainers : 1;
    tr_result local_res;
    if (!res)
        res = &local_res;
    *res = (tr_result){.steps = 0, .accuracy = -1, .test_loss = -1, .eval_images = 0,
                       .score_name = "accuracy"};
    signal(SIGINT, s_on_signal);
    signal(SIGTERM, s_on_signal);
    /* before any compute thread starts: the handler must never run on one (common/proc.h) */
    zps_sigthread sigs;
    (void)zps_sigthread_start(&sigs, (const int[]){SIGINT, SIGTERM}, 2);

    int eval_only_done;
    zps_status st = s_setup(&j, res, &eval_only_done);
    if (st == ZPS_OK && !eval_only_done)
        st = s_train(&j);
    if (st == ZPS_OK && !eval_only_done)
        st = s_wrap_up(&j, res);
    if (st != ZPS_OK)
        st = s_stop_early(&j, st);
    if (s_stop) {
        res->steps = j.step;
        zps_log(ZPS_WARN, "trainer", "stopped by %s after %lld steps", strsignal((int)s_stop),
                (long long)j.step);
    }
    s_job_free(&j);
    zps_sigthread_stop(&sigs);
    return st;
}
