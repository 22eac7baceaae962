/* train.c — the training loop (see train.h).
 *
 * Ownership: tr_run owns everything it creates and frees it on every exit path through
 * s_job_free. Per-step work allocates nothing: batch buffers, the gradient accumulator,
 * optimizer slots, ticket arrays and the evaluation cache are sized once at start.
 */
#include "trainer/train.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/cluster.h"
#include "common/log.h"
#include "common/mem.h"
#include "datasets/pipeline.h"
#include "kernels/device.h"
#include "kernels/kernels.h"
#include "ps/client.h"
#include "ps/curve.h"
#include "ps/optim.h"
#include "ps/plan.h"
#include "trainer/allreduce.h"
#include "trainer/metrics.h"
#include "trainer/models/models.h"

#define S_MAX_GROUPS 4096

static volatile sig_atomic_t s_stop;
static void s_on_signal(int sig)
{
    (void)sig;
    s_stop = 1;
}

/* A contiguous range of variables whose gradients become final together (one layer). */
typedef struct s_group {
    int first, n;
} s_group;

typedef struct s_job {
    const tr_config *cfg;
    int n_trainers, id;
    int ps_mode;                 // sync, async or ssp
    const k_backend *be;
    nn_model *model;
    size_t nvars, nparams;
    const nn_var *vars;
    float *params, *grads;       // the model's flat buffers
    float *acc;                  // (nparams) gradient accumulator for --accumulate > 1
    float *step_grads;           // the step's mean gradient: grads, or acc when accumulating
    float *slots[2];             // local optimizer slots (local, allreduce)
    ds_pipeline *train;
    int in_c, in_h, in_w, classes;
    size_t sample_floats;
    int read_batch;              // images per ds_pipeline_next (batch, or batch * n)
    float *images;               // (read_batch, c, h, w)
    int32_t *labels;             // (read_batch)
    float *eval_x;               // cached test split (eval_n, c, h, w)
    int32_t *eval_y;
    int eval_n;
    /* PS */
    ps_plan *plan;
    ps_client *client;
    char **uris;
    int n_uris;
    ps_ticket *push_t;           // (S_MAX_GROUPS) tickets of this step's pushes
    int n_push;
    ps_ticket *pull_t;           // (groups) pull ticket of each group, forward order
    s_group *groups;             // (S_MAX_GROUPS) groups in hook order (last layer first)
    int n_groups;
    int groups_known;            // the first backward recorded the groups
    int pulls_pending;
    int *var_pull;               // (nvars) forward-order pull index of each variable's group
    uint8_t *pull_done;          // (S_MAX_GROUPS) that pull was waited for
    uint64_t pull_vmin;          // oldest version among the pulls waited this step
    zps_status pull_err;         // first failure among them
    int64_t push_step;           // step / clock attached to this step's pushes
    uint64_t version;            // model version of the values in params
    zps_status hook_err;
    /* all-reduce */
    tr_allreduce *ar;
    tr_metrics *metrics;
    double net_wait;             // seconds blocked this step
} s_job;

static void s_job_free(s_job *j)
{
    if (j->client)
        ps_client_destroy(&j->client);
    ps_plan_destroy(&j->plan);
    for (int i = 0; i < j->n_uris; i++)
        free(j->uris[i]);
    free(j->uris);
    free(j->push_t);
    free(j->pull_t);
    free(j->groups);
    free(j->var_pull);
    free(j->pull_done);
    tr_allreduce_destroy(&j->ar);
    tr_metrics_destroy(&j->metrics);
    ds_pipeline_destroy(&j->train);
    nn_model_destroy(&j->model);
    zps_aligned_free(j->acc);
    zps_aligned_free(j->slots[0]);
    zps_aligned_free(j->slots[1]);
    zps_aligned_free(j->images);
    free(j->labels);
    zps_aligned_free(j->eval_x);
    free(j->eval_y);
}

/* ---- set-up ---- */

static zps_status s_servers(s_job *j)
{
    const tr_config *c = j->cfg;
    if (c->cluster[0]) {
        zps_cluster *cl;
        zps_parse_error err;
        zps_status st = zps_cluster_load(c->cluster, &cl, &err);
        if (st != ZPS_OK) {
            zps_log(ZPS_ERROR, "trainer", "cluster file %s: line %d: %s", c->cluster, err.line,
                    err.msg);
            return st;
        }
        if (!cl->n_servers && c->mode != TR_MODE_LOCAL && c->mode != TR_MODE_ALLREDUCE) {
            zps_log(ZPS_ERROR, "trainer", "cluster file %s lists no server: --mode %s needs at "
                    "least one (only local and allreduce run without)", c->cluster,
                    tr_mode_name(c->mode));
            zps_cluster_destroy(&cl);
            return ZPS_ERR_CONFIG;
        }
        j->n_uris = cl->n_servers;
        j->uris = zps_xcalloc((size_t)cl->n_servers, sizeof *j->uris);
        for (int i = 0; i < cl->n_servers; i++) {
            char buf[ZPS_HOST_MAX + 32];
            j->uris[i] = zps_xstrdup(zps_endpoint_uri(&cl->servers[i], buf, sizeof buf));
        }
        if (!c->num_trainers)
            j->n_trainers = cl->n_trainers;
        zps_cluster_destroy(&cl);
        return ZPS_OK;
    }
    if (!c->servers[0])
        return ZPS_OK;
    char *copy = zps_xstrdup(c->servers), *save = NULL;
    for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        j->uris = zps_xrealloc(j->uris, (size_t)(j->n_uris + 1) * sizeof *j->uris);
        j->uris[j->n_uris++] = zps_xstrdup(t);
    }
    free(copy);
    if (!j->n_uris) {
        zps_log(ZPS_ERROR, "trainer", "--servers '%s' names no server", c->servers);
        return ZPS_ERR_INVALID;
    }
    return ZPS_OK;
}

/* The trainer's loop, the PS client and the all-reduce read parameters and gradients as host
 * memory, so a back-end whose tensors live on a device is not usable here yet: --device
 * auto then trains on the CPU (and says so); --device cuda is an error. */
static zps_status s_backend(s_job *j)
{
    k_device_info info;
    ZPS_TRY(k_device_select(j->cfg->device, &info));
    j->be = k_backend_cpu();
    if (info.kind != K_DEVICE_CUDA)
        return ZPS_OK;
    char why[256] = "";
    const k_backend *cuda = k_backend_cuda(why, sizeof why);
    if (cuda && cuda->host_memory) {
        j->be = cuda;
        return ZPS_OK;
    }
    const char *reason = cuda ? "the trainer does not yet move device tensors to the servers"
                              : why;
    if (strcmp(j->cfg->device, "cuda") == 0) {
        zps_log(ZPS_ERROR, "trainer", "--device cuda: %s", reason);
        return ZPS_ERR_UNSUPPORTED;
    }
    zps_log(ZPS_WARN, "trainer", "a CUDA device answered, but %s; training on the CPU", reason);
    return ZPS_OK;
}

/* Opens a split with the model's input geometry. */
static void s_pipe_opts(const s_job *j, ds_pipeline_opts *o, const char *split)
{
    const tr_config *c = j->cfg;
    ds_pipeline_opts_default(o);
    o->path = c->data;
    o->split = split;
    o->height = j->in_h;
    o->width = j->in_w;
    o->channels = j->in_c;
    for (int k = 0; k < 3; k++) {
        o->mean[k] = 0.5f;
        o->std[k] = 0.5f;
    }
    o->threads = c->threads;
    o->seed = c->seed;
}

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
    j->read_batch = c->batch * (by_batch ? j->n_trainers : 1);
    po.batch = j->read_batch;
    po.augment = c->augment;
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
    j->vars = nn_model_vars(j->model, &j->nvars);
    j->nparams = nn_model_param_count(j->model);
    j->params = nn_model_params(j->model);
    j->grads = nn_model_grads(j->model);
    j->sample_floats = (size_t)j->in_c * (size_t)j->in_h * (size_t)j->in_w;
    j->images = zps_xaligned(64, (size_t)j->read_batch * j->sample_floats * sizeof(float));
    j->labels = zps_xcalloc((size_t)j->read_batch, sizeof *j->labels);
    j->step_grads = j->grads;
    if (c->accumulate > 1)
        j->step_grads = j->acc = zps_xaligned(64, j->nparams * sizeof(float));
    zps_log(ZPS_INFO, "trainer",
            "model %s: %zu variables, %zu parameters, input %dx%dx%d, %d classes; data %s: "
            "%llu records for this trainer",
            c->model, j->nvars, j->nparams, j->in_c, j->in_h, j->in_w, j->classes, c->data,
            (unsigned long long)ds_pipeline_records(j->train));
    return ZPS_OK;
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
        j->eval_n += info.count;
    }
    ds_pipeline_destroy(&p);
    zps_log(ZPS_INFO, "trainer", "evaluation set: %d test images", j->eval_n);
    return ZPS_OK;
}

/* Accuracy and mean loss on the cached test images, in inference mode. */
static zps_status s_evaluate(s_job *j, double *acc, double *loss)
{
    const int eb = 256;
    int64_t correct = 0;
    double lsum = 0;
    for (int off = 0; off < j->eval_n; off += eb) {
        int n = j->eval_n - off < eb ? j->eval_n - off : eb;
        float l;
        int cor;
        ZPS_TRY(nn_model_eval(j->model, j->eval_x + (size_t)off * j->sample_floats,
                              j->eval_y + off, n, &l, &cor));
        correct += cor;
        lsum += (double)l * n;
    }
    *acc = j->eval_n ? (double)correct / j->eval_n : 0;
    *loss = j->eval_n ? lsum / j->eval_n : 0;
    return ZPS_OK;
}

/* ---- synchronisation back-ends ---- */

static zps_status s_ps_setup(s_job *j)
{
    const tr_config *c = j->cfg;
    ps_var *pv = zps_xcalloc(j->nvars, sizeof *pv);
    for (size_t i = 0; i < j->nvars; i++) {
        pv[i].name = j->vars[i].name;
        pv[i].count = j->vars[i].count;
    }
    zps_status st = ps_plan_new(pv, (int)j->nvars, j->n_uris, c->chunk_bytes, &j->plan);
    free(pv);
    ZPS_TRY(st);
    ps_client_opts co;
    ps_client_opts_default(&co);
    co.timeout_ms = c->timeout_ms;
    co.heartbeat_thread = 1; /* a long step must not look like a dead trainer */
    co.push_dtype = c->push_dtype;
    if (c->curve_key[0]) {
        char why[1200];
        st = ps_curve_load_public(c->curve_server_key, co.curve_server_key, why, sizeof why);
        if (st == ZPS_OK)
            st = ps_curve_load_keypair(c->curve_key, co.curve_public_key, co.curve_secret_key,
                                       why, sizeof why);
        if (st != ZPS_OK) {
            zps_log(ZPS_ERROR, "trainer", "%s", why);
            return st;
        }
        zps_log(ZPS_INFO, "trainer", "CURVE on: trainer key %.8s..., server key %.8s...",
                co.curve_public_key, co.curve_server_key);
    }
    st = ps_client_new((const char *const *)j->uris, j->n_uris, (uint32_t)j->id, &co,
                       &j->client);
    explicit_bzero(co.curve_secret_key, sizeof co.curve_secret_key);
    ZPS_TRY(st);
    ps_job want = {0}, got = {0};
    want.mode = c->mode == TR_MODE_SYNC ? PS_MODE_SYNC
                : c->mode == TR_MODE_ASYNC ? PS_MODE_ASYNC
                                           : PS_MODE_SSP;
    want.num_trainers = (uint32_t)j->n_trainers;
    want.replicas_to_aggregate = c->replicas_to_aggregate;
    want.staleness = c->staleness;
    st = ps_client_register(j->client, j->plan, &want, &got);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "REGISTER with the servers failed: %s: %s",
                zps_strerror(st), ps_client_last_error(j->client));
        return st;
    }
    if (got.mode != want.mode)
        zps_log(ZPS_WARN, "trainer", "servers run mode %d, not the requested %s", got.mode,
                tr_mode_name(c->mode));
    /* First writer wins: every trainer offers the same seeded (or loaded) values. */
    int first = 0;
    st = ps_client_init(j->client, j->params, &c->opt, &first);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "INIT failed: %s: %s", zps_strerror(st),
                ps_client_last_error(j->client));
        return st;
    }
    zps_log(ZPS_INFO, "trainer", "%s %d servers (%u chunks, plan %016llx), mode %s, %s gradients",
            first ? "initialised" : "joined", j->n_uris, j->plan->n_chunks,
            (unsigned long long)j->plan->hash, tr_mode_name(c->mode), ps_dtype_name(c->push_dtype));
    /* Start from the servers' values (another trainer may have initialised them, or a
     * restored server may be far ahead). */
    ps_ticket t;
    ZPS_TRY(ps_client_pull(j->client, 0, (int)j->nvars, j->params, -1, &t));
    st = ps_client_wait_version(j->client, t, &j->version);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "first PULL failed: %s: %s", zps_strerror(st),
                ps_client_last_error(j->client));
        return st;
    }
    j->push_t = zps_xcalloc(S_MAX_GROUPS, sizeof *j->push_t);
    j->pull_t = zps_xcalloc(S_MAX_GROUPS, sizeof *j->pull_t);
    j->groups = zps_xcalloc(S_MAX_GROUPS, sizeof *j->groups);
    j->pull_done = zps_xcalloc(S_MAX_GROUPS, sizeof *j->pull_done);
    j->var_pull = zps_xcalloc(j->nvars, sizeof *j->var_pull);
    return ZPS_OK;
}

/* Backward hook: the gradients of [first, first + n) are final; push them now. */
static void s_push_hook(void *ctx, size_t first, size_t n)
{
    s_job *j = ctx;
    if (!j->groups_known && j->n_groups < S_MAX_GROUPS) {
        j->groups[j->n_groups].first = (int)first;
        j->groups[j->n_groups].n = (int)n;
        j->n_groups++;
    }
    if (j->hook_err != ZPS_OK || j->n_push >= S_MAX_GROUPS)
        return;
    zps_status st = ps_client_push(j->client, (int)first, (int)n, j->step_grads, j->push_step,
                                   &j->push_t[j->n_push]);
    if (st != ZPS_OK)
        j->hook_err = st;
    else
        j->n_push++;
}

/* Waits for a ticket, adding the time to the step's network wait. */
static zps_status s_wait(s_job *j, ps_ticket t, uint64_t *version)
{
    uint64_t t0 = zps_now_ns();
    zps_status st = ps_client_wait_version(j->client, t, version);
    j->net_wait += (double)(zps_now_ns() - t0) * 1e-9;
    return st;
}

/* Issues the pulls of every group in forward order (first layers first). */
static zps_status s_issue_pulls(s_job *j, int64_t step)
{
    for (int g = j->n_groups - 1, k = 0; g >= 0; g--, k++) {
        ZPS_TRY(ps_client_pull(j->client, j->groups[g].first, j->groups[g].n, j->params, step,
                               &j->pull_t[k]));
        j->pull_done[k] = 0;
    }
    j->pulls_pending = 1;
    j->pull_vmin = UINT64_MAX;
    j->pull_err = ZPS_OK;
    return ZPS_OK;
}

/* Waits for pull k (forward order) unless that was done already. */
static void s_wait_pull(s_job *j, int k)
{
    if (j->pull_done[k])
        return;
    j->pull_done[k] = 1;
    uint64_t v = 0;
    zps_status st = s_wait(j, j->pull_t[k], &v);
    if (st != ZPS_OK && j->pull_err == ZPS_OK)
        j->pull_err = st;
    if (st == ZPS_OK && v < j->pull_vmin)
        j->pull_vmin = v;
}

/* Forward hook: a layer is about to read [first, first + n); wait for its values. */
static void s_pull_hook(void *ctx, size_t first, size_t n)
{
    s_job *j = ctx;
    if (j->pulls_pending)
        for (size_t v = first; v < first + n; v++)
            s_wait_pull(j, j->var_pull[v]);
}

/* Waits for whatever pulls the forward did not; j->version = the oldest version received. */
static zps_status s_wait_pulls(s_job *j)
{
    if (!j->pulls_pending)
        return ZPS_OK;
    for (int k = 0; k < j->n_groups; k++)
        s_wait_pull(j, k);
    j->pulls_pending = 0;
    if (j->pull_err != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "PULL failed: %s: %s", zps_strerror(j->pull_err),
                ps_client_last_error(j->client));
        return j->pull_err;
    }
    j->version = j->pull_vmin;
    return ZPS_OK;
}

/* The groups are known (first backward): map each variable to its group's pull. */
static void s_groups_known(s_job *j)
{
    for (int g = 0; g < j->n_groups; g++) {
        int k = j->n_groups - 1 - g;
        for (int v = j->groups[g].first; v < j->groups[g].first + j->groups[g].n; v++)
            j->var_pull[v] = k;
    }
    j->groups_known = 1;
    nn_model_set_forward_hook(j->model, s_pull_hook, j);
}

/* Waits for this step's pushes. A stale push (sync: the step was aggregated without us,
 * e.g. we are a backup worker) is not an error: *stale is set and the next pull catches up. */
static zps_status s_wait_pushes(s_job *j, int *stale, uint64_t *newest)
{
    *stale = 0;
    *newest = 0;
    zps_status first_err = ZPS_OK;
    for (int k = 0; k < j->n_push; k++) {
        uint64_t v = 0;
        zps_status st = s_wait(j, j->push_t[k], &v);
        if (st == ZPS_ERR_STALE) {
            *stale = 1;
            st = ZPS_OK;
        }
        if (st != ZPS_OK && first_err == ZPS_OK)
            first_err = st;
        if (v > *newest)
            *newest = v;
    }
    j->n_push = 0;
    if (first_err != ZPS_OK)
        zps_log(ZPS_ERROR, "trainer", "PUSH failed: %s: %s", zps_strerror(first_err),
                ps_client_last_error(j->client));
    return first_err;
}

/* Local optimizer for local and all-reduce modes: the servers' own update code. */
static void s_local_apply(s_job *j, uint64_t step)
{
    ps_optim_apply(&j->cfg->opt, step, j->params, j->slots, j->step_grads, j->nparams);
}

static void s_local_slots(s_job *j)
{
    int ns = ps_optim_slots(j->cfg->opt.kind);
    for (int s = 0; s < ns; s++) {
        j->slots[s] = zps_xaligned(64, j->nparams * sizeof(float));
        float v = ps_optim_slot_init(&j->cfg->opt, s);
        for (size_t i = 0; i < j->nparams; i++)
            j->slots[s][i] = v;
    }
}

/* ---- the loop ---- */

/* Reads the next batch; x/y point at this trainer's slice of it. */
static zps_status s_next_batch(s_job *j, const float **x, const int32_t **y, int64_t *epoch)
{
    ds_batch_info info;
    zps_status st = ds_pipeline_next(j->train, j->images, j->labels, &info);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "reading training data: %s", zps_strerror(st));
        return st;
    }
    *epoch = info.epoch;
    size_t off = j->cfg->shard == TR_SHARD_BATCH ? (size_t)j->id * (size_t)j->cfg->batch : 0;
    *x = j->images + off * j->sample_floats;
    *y = j->labels + off;
    return ZPS_OK;
}

/* Trainer 0 evaluates; in sync mode with --stop-accuracy every trainer does, because they
 * all hold the same values each step and so reach the same decision at the same step. */
static int s_is_evaluator(const s_job *j)
{
    return j->id == 0 || j->cfg->eval_all ||
           (j->cfg->mode == TR_MODE_SYNC && j->cfg->stop_accuracy > 0);
}

zps_status tr_run(const tr_config *cfg, tr_result *res)
{
    s_job job = {0}, *j = &job;
    j->cfg = cfg;
    j->id = cfg->trainer_id;
    j->n_trainers = cfg->num_trainers ? cfg->num_trainers : 1;
    j->ps_mode = cfg->mode == TR_MODE_SYNC || cfg->mode == TR_MODE_ASYNC ||
                 cfg->mode == TR_MODE_SSP;
    j->hook_err = ZPS_OK;
    zps_status st = ZPS_OK;
    tr_result local_res;
    if (!res)
        res = &local_res;
    res->steps = 0;
    res->accuracy = res->test_loss = -1;
    res->eval_images = 0;
    signal(SIGINT, s_on_signal);
    signal(SIGTERM, s_on_signal);

#define S_STEP(call)                                                                   \
    do {                                                                               \
        st = (call);                                                                   \
        if (st != ZPS_OK)                                                              \
            goto done;                                                                 \
    } while (0)

    S_STEP(s_servers(j));
    if (j->id >= j->n_trainers) {
        zps_log(ZPS_ERROR, "trainer", "--trainer-id %d but the job has %d trainers", j->id,
                j->n_trainers);
        st = ZPS_ERR_INVALID;
        goto done;
    }
    S_STEP(s_backend(j));
    S_STEP(s_model_and_data(j));
    if (cfg->init_weights[0])
        S_STEP(nn_model_load(j->model, cfg->init_weights));
    if (cfg->resume && !j->ps_mode && cfg->export_path[0] && access(cfg->export_path, R_OK) == 0) {
        S_STEP(nn_model_load(j->model, cfg->export_path));
        zps_log(ZPS_INFO, "trainer", "resumed from %s", cfg->export_path);
    }
    if (s_is_evaluator(j) || cfg->eval_only)
        S_STEP(s_eval_cache(j));
    if (cfg->eval_only) {
        double acc, tl;
        S_STEP(s_evaluate(j, &acc, &tl));
        res->accuracy = acc;
        res->test_loss = tl;
        res->eval_images = j->eval_n;
        goto done;
    }

    if (j->ps_mode) {
        S_STEP(s_ps_setup(j));
    } else {
        s_local_slots(j);
        if (cfg->mode == TR_MODE_ALLREDUCE) {
            S_STEP(tr_allreduce_new(cfg->job, j->id, j->n_trainers, j->nparams, NULL, &j->ar));
            /* Everyone starts from rank 0's values (they are equal when seeded alike). */
            S_STEP(tr_allreduce_broadcast(j->ar, j->params, j->nparams * sizeof(float), 0));
            zps_log(ZPS_INFO, "trainer", "all-reduce rank %d of %d (%zu MiB shared segment)",
                    j->id, j->n_trainers, tr_allreduce_segment_bytes(j->ar) >> 20);
        }
    }

    int64_t per_epoch = ds_pipeline_batches_per_epoch(j->train);
    int64_t total = cfg->steps;
    if (!total) {
        total = (int64_t)ceil(cfg->epochs * (double)per_epoch / cfg->accumulate);
        if (total < 1)
            total = 1;
    }
    tr_metrics_opts mo = {0};
    mo.jsonl_path = cfg->metrics[0] ? cfg->metrics : NULL;
    mo.mode = cfg->progress ? TR_PROGRESS_AUTO : TR_PROGRESS_OFF;
    mo.trainer_id = j->id;
    mo.mode_name = tr_mode_name(cfg->mode);
    mo.model = cfg->model;
    mo.batch = cfg->batch * cfg->accumulate;
    mo.n_trainers = j->n_trainers;
    /* with a time limit the step count is not the end: no percentage or ETA to mislead */
    mo.total_steps = cfg->time_limit_s > 0 ? 0 : total;
    mo.target_accuracy = cfg->stop_accuracy;
    S_STEP(tr_metrics_new(&mo, &j->metrics));
    zps_log(ZPS_INFO, "trainer", "%lld steps of %d x %d images (%lld batches per epoch)",
            (long long)total, cfg->accumulate, cfg->batch, (long long)per_epoch);

    const size_t pbytes = j->nparams * sizeof(float);
    uint64_t t_start = zps_now_ns();
    double last_acc = -1;
    int64_t step = 0;
    int reached = 0;            /* test accuracy reached --stop-accuracy */
    int64_t last_eval_step = -1; /* step after which last_acc was measured */
    double last_loss = -1;
    for (; step < total; step++) {
        int stop = s_stop || reached;
        if (!stop && cfg->time_limit_s > 0 &&
            (double)(zps_now_ns() - t_start) * 1e-9 > cfg->time_limit_s) {
            zps_log(ZPS_INFO, "trainer", "time limit of %.0f s reached at step %lld",
                    cfg->time_limit_s, (long long)step);
            stop = 1;
        }
        if (j->ar) {
            /* Stopping is collective: rank 0 decides for everyone, or the others would wait
             * for it in the next all-reduce. */
            int32_t flag = stop;
            S_STEP(tr_allreduce_broadcast(j->ar, &flag, sizeof flag, 0));
            stop = flag;
        }
        if (stop)
            break;
        j->net_wait = 0;
        tr_step_record rec = tr_step_record_empty(step + 1);
        /* PS: this step's values arrive layer by layer during the first forward
         * (s_pull_hook); used_version is known once it is done. */
        uint64_t used_version = j->version;

        double loss_sum = 0;
        int64_t correct = 0;
        for (int m = 0; m < cfg->accumulate; m++) {
            const float *x;
            const int32_t *y;
            int64_t epoch;
            S_STEP(s_next_batch(j, &x, &y, &epoch));
            float loss;
            int cor;
            S_STEP(nn_model_forward(j->model, x, y, cfg->batch, 1, &loss, &cor));
            if (!isfinite(loss)) {
                zps_log(ZPS_ERROR, "trainer", "loss is %f at step %lld: lower --lr?",
                        (double)loss, (long long)step + 1);
                st = ZPS_ERR_NONFINITE;
                goto done;
            }
            if (m == 0 && j->ps_mode) {
                S_STEP(s_wait_pulls(j));
                used_version = j->version;
                /* What the pushes of this step are tagged with (client.h, "Steps"). */
                j->push_step = cfg->mode == TR_MODE_SSP ? step : (int64_t)j->version;
            }
            loss_sum += loss;
            correct += cor;
            int direct = j->ps_mode && cfg->accumulate == 1;
            S_STEP(nn_model_backward(j->model, direct ? s_push_hook : NULL, j));
            if (j->hook_err != ZPS_OK) {
                st = j->hook_err;
                zps_log(ZPS_ERROR, "trainer", "PUSH failed: %s: %s", zps_strerror(st),
                        ps_client_last_error(j->client));
                goto done;
            }
            if (cfg->accumulate > 1) {
                if (m == 0)
                    memcpy(j->acc, j->grads, pbytes);
                else
                    S_STEP(k_axpy(j->be, j->nparams, 1.0f, j->grads, j->acc));
            }
        }
        if (cfg->accumulate > 1)
            S_STEP(k_scale(j->be, j->nparams, 1.0f / (float)cfg->accumulate, j->acc));

        if (j->ps_mode) {
            if (cfg->accumulate > 1 || !j->groups_known) {
                if (!j->groups_known && cfg->accumulate > 1) {
                    /* one group per variable, last first, like the hook would */
                    for (size_t v = j->nvars; v-- > 0 && j->n_groups < S_MAX_GROUPS;) {
                        j->groups[j->n_groups].first = (int)v;
                        j->groups[j->n_groups].n = 1;
                        j->n_groups++;
                    }
                }
                s_groups_known(j);
                if (cfg->accumulate > 1)
                    for (int g = 0; g < j->n_groups; g++)
                        s_push_hook(j, (size_t)j->groups[g].first, (size_t)j->groups[g].n);
            }
            /* The values for the next step: sync waits (server side) for version + 1. */
            int64_t pull_step = cfg->mode == TR_MODE_SYNC  ? (int64_t)used_version + 1
                                : cfg->mode == TR_MODE_SSP ? step + 1
                                                           : -1;
            S_STEP(s_issue_pulls(j, pull_step));
            int stale;
            uint64_t newest;
            S_STEP(s_wait_pushes(j, &stale, &newest));
            if (stale)
                zps_log(ZPS_DEBUG, "trainer", "step %lld: push was stale (server at %llu)",
                        (long long)step + 1, (unsigned long long)newest);
            if (cfg->mode != TR_MODE_SYNC && newest > used_version)
                rec.staleness = (double)(newest - 1 - used_version);
            else
                rec.staleness = 0;
            rec.bytes_pushed = pbytes;
            rec.bytes_pulled = pbytes;
            rec.lr = ps_optim_lr(&cfg->opt, used_version);
        } else {
            if (j->ar) {
                uint64_t t0 = zps_now_ns();
                S_STEP(tr_allreduce_sum(j->ar, j->step_grads, j->nparams, 1));
                j->net_wait += (double)(zps_now_ns() - t0) * 1e-9;
                rec.bytes_pushed = pbytes;
                rec.bytes_pulled = pbytes;
            }
            rec.lr = ps_optim_lr(&cfg->opt, (uint64_t)step);
            s_local_apply(j, (uint64_t)step);
        }

        rec.images = (int64_t)cfg->batch * cfg->accumulate;
        rec.loss = loss_sum / cfg->accumulate;
        rec.train_accuracy = (double)correct / (double)rec.images;
        rec.net_wait_s = j->net_wait;
        int last = step + 1 == total;
        if (s_is_evaluator(j) && (last || (cfg->eval_every && (step + 1) % cfg->eval_every == 0))) {
            if (j->ps_mode)
                S_STEP(s_wait_pulls(j)); /* evaluate the newest values */
            double acc, tl;
            S_STEP(s_evaluate(j, &acc, &tl));
            rec.test_accuracy = acc;
            rec.test_loss = tl;
            last_acc = acc;
            last_loss = tl;
            last_eval_step = step + 1;
        }
        S_STEP(tr_metrics_step(j->metrics, &rec));
        if (cfg->stop_accuracy > 0 && last_acc >= cfg->stop_accuracy && !reached) {
            zps_log(ZPS_INFO, "trainer", "test accuracy %.4f reached the target %.4f at step %lld",
                    last_acc, cfg->stop_accuracy, (long long)step + 1);
            reached = 1;
        }
    }
    if (s_stop)
        zps_log(ZPS_WARN, "trainer", "stopped by a signal at step %lld", (long long)step);

    if (j->ps_mode) {
        S_STEP(s_wait_pulls(j));
        /* The final values: whatever the servers hold now. */
        ps_ticket t;
        S_STEP(ps_client_pull(j->client, 0, (int)j->nvars, j->params, -1, &t));
        S_STEP(s_wait(j, t, &j->version));
    }
    /* The final model's accuracy, unless the last step measured exactly these values. */
    if (s_is_evaluator(j) && (j->ps_mode || last_eval_step != step)) {
        S_STEP(s_evaluate(j, &last_acc, &last_loss));
        last_eval_step = step;
    }
    res->steps = step;
    res->accuracy = last_acc;
    res->test_loss = last_loss;
    res->eval_images = last_acc >= 0 ? j->eval_n : 0;
    if (cfg->export_path[0] && j->id == 0) {
        S_STEP(nn_model_save(j->model, cfg->export_path));
        zps_log(ZPS_INFO, "trainer", "wrote %s", cfg->export_path);
    }
    /* LEAVE: peers (sync, ssp) and barriers stop waiting for this trainer at once */
    if (j->ps_mode)
        S_STEP(ps_client_leave(j->client));
    if (j->ps_mode && cfg->shutdown_servers) {
        S_STEP(ps_client_barrier(j->client));
        if (j->id == 0)
            S_STEP(ps_client_shutdown(j->client));
    }
    S_STEP(tr_metrics_finish(j->metrics));
    {
        tr_metrics_totals tot;
        tr_metrics_get_totals(j->metrics, &tot);
        zps_log(ZPS_INFO, "trainer",
                "done: %lld steps, %.1f img/s, final training loss %.4f, network wait %.1f%% "
                "of %.1f s",
                (long long)tot.steps, tot.img_per_s, tot.last_loss,
                tot.time_s > 0 ? 100.0 * tot.net_wait_s / tot.time_s : 0, tot.time_s);
    }
done:
#undef S_STEP
    if (st != ZPS_OK)
        zps_log(ZPS_ERROR, "trainer", "trainer %d failed: %s", j->id, zps_strerror(st));
    s_job_free(j);
    return st;
}
