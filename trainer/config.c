/* config.c — zps-trainer's flags: one table drives parsing, --help and range checks
 * (common/opts.h); tr_config_parse() then checks the flags against each other. See config.h
 * and docs/training.md. */
#include "trainer/config.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cluster.h"
#include "common/net.h"
#include "common/opts.h"
#include "ps/plan.h"
#include "ps/server_config.h"
#include "trainer/nn/nn.h"

/* The PS modes are ps_mode_names (one list for zps-server and zps-trainer), with the same
 * values; local and allreduce are the trainer's own. */
_Static_assert((int)TR_MODE_SYNC == (int)PS_MODE_SYNC && (int)TR_MODE_ASYNC == (int)PS_MODE_ASYNC &&
                   (int)TR_MODE_SSP == (int)PS_MODE_SSP,
               "tr_mode's PS modes take ps_mode's values");
static const zps_opt_name s_own_modes[] = {
    {"local", TR_MODE_LOCAL}, {"allreduce", TR_MODE_ALLREDUCE}, {NULL, 0}};

const char *tr_mode_name(tr_mode m)
{
    const char *n = zps_opt_name_of(s_own_modes, (int)m);
    if (!n)
        n = zps_opt_name_of(ps_mode_names, (int)m);
    return n ? n : "?";
}

zps_status tr_mode_parse(const char *s, tr_mode *out)
{
    int v;
    if (zps_opt_name_parse(s_own_modes, s, &v) != ZPS_OK &&
        zps_opt_name_parse(ps_mode_names, s, &v) != ZPS_OK)
        return ZPS_ERR_INVALID;
    *out = (tr_mode)v;
    return ZPS_OK;
}

void tr_config_default(tr_config *c)
{
    memset(c, 0, sizeof *c);
    snprintf(c->model, sizeof c->model, "convnet");
    c->width = 1.0f;
    c->aux = -1;
    c->dropout = -1.0f;
    c->threads = 1;
    snprintf(c->device, sizeof c->device, "auto");
    c->mode = TR_MODE_LOCAL;
    c->chunk_bytes = PS_DEFAULT_CHUNK_BYTES;
    c->timeout_ms = 30000;
    c->shm = 1;
    c->register_wait_s = 45;
    c->trace_from = 5;
    c->trace_steps = 3;
    c->batch = 64;
    c->epochs = 1.0;
    c->accumulate = 1;
    c->node_trainers = 1;
    ps_optim_default(&c->opt);
    c->opt.lr = 0.05;
    c->progress = 1;
    c->seed = 1;
    c->dump_detections = -1;
    snprintf(c->dump_out, sizeof c->dump_out, "detections.png");
    /* Under zps-launch, name the job after the run folder, so two fleets on one machine
     * never share an all-reduce segment. */
    const char *run = getenv("ZPS_RUN_DIR");
    const char *base = run ? strrchr(run, '/') : NULL;
    base = base ? base + 1 : run;
    snprintf(c->job, sizeof c->job, "%s", base && *base ? base : "zps");
    for (char *p = c->job; *p; p++)
        if (!(*p == '-' || *p == '_' || *p == '.' || (*p >= '0' && *p <= '9') ||
              (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z')))
            *p = '_';
}

/* ---- the flags ---- */

static void s_defaults(void *c) { tr_config_default(c); }

static zps_status s_mode(void *cfg, const char *arg, char *why, size_t cap)
{
    if (tr_mode_parse(arg, &((tr_config *)cfg)->mode) == ZPS_OK)
        return ZPS_OK;
    char ps[64];
    zps_opt_names_join(ps_mode_names, ", ", ", ", ps, sizeof ps);
    snprintf(why, cap, "wants local, %s or allreduce, got '%s'", ps, arg);
    return ZPS_ERR_INVALID;
}

static zps_status s_optimizer(void *cfg, const char *arg, char *why, size_t cap)
{
    if (ps_optim_kind_parse(arg, &((tr_config *)cfg)->opt.kind) == ZPS_OK)
        return ZPS_OK;
    snprintf(why, cap, "wants sgd, momentum, rmsprop, adam or adagrad, got '%s'", arg);
    return ZPS_ERR_INVALID;
}

static zps_status s_push_dtype(void *cfg, const char *arg, char *why, size_t cap)
{
    if (ps_dtype_parse(arg, &((tr_config *)cfg)->push_dtype) == 0)
        return ZPS_OK;
    snprintf(why, cap, "wants f32 or bf16, got '%s'", arg);
    return ZPS_ERR_INVALID;
}

/* The names nn_model_create builds: checked with the flags, so a misspelt model fails before
 * any data is opened. */
static const zps_opt_name s_models[] = {
    {"mlp", 0}, {"convnet", 0}, {"inception_v3", 0}, {"ssd", 0}, {NULL, 0}};

/* The FUNC flags' values, for the metrics start record (tr_config_json). */
static const char *s_mode_show(const void *cfg)
{
    return tr_mode_name(((const tr_config *)cfg)->mode);
}
static const char *s_optimizer_show(const void *cfg)
{
    return ps_optim_kind_name(((const tr_config *)cfg)->opt.kind);
}
static const char *s_push_dtype_show(const void *cfg)
{
    return ps_dtype_name(((const tr_config *)cfg)->push_dtype);
}

static const zps_opt_name s_aux[] = {{"auto", -1}, {"on", 1}, {"off", 0}, {NULL, 0}};
static const zps_opt_name s_shard[] = {
    {"records", TR_SHARD_RECORDS}, {"batch", TR_SHARD_BATCH}, {NULL, 0}};
static const zps_opt_name s_precision[] = {{"f32", 0}, {"bf16", 1}, {NULL, 0}};
static const zps_opt_name s_device[] = {{"auto", 0}, {"cpu", 0}, {"cuda", 0}, {"staged", 0},
                                        {NULL, 0}};
static const zps_opt_name s_sched[] = {{"constant", PS_SCHED_CONSTANT},
                                       {"exponential", PS_SCHED_EXPONENTIAL},
                                       {"cosine", PS_SCHED_COSINE},
                                       {NULL, 0}};

#define F(field) ZPS_OPT_FIELD(tr_config, field)
#define S_STEPS (double)(1ll << 40)

static const zps_opt s_opt[] = {
    {.type = ZPS_OPT_TEXT, .help = "model:"},
    {"model", ZPS_OPT_STRING, F(model), .names = s_models, .meta = "NAME",
     .help = "mlp | convnet | inception_v3 | ssd (the detector: zps-data\n"
             "make-detection data; scored by VOC mAP@0.5)"},
    {"width", ZPS_OPT_DOUBLE, F(width), 0.01, 4, .meta = "F",
     .help = "inception_v3 and ssd channel multiplier"},
    {"input-size", ZPS_OPT_INT, F(input_size), 8, 4096, .meta = "N",
     .dflt = "the model's: 28 mlp/convnet, 299 inception_v3, 128 ssd",
     .help = "model input height = width; images are resized"},
    {"in-channels", ZPS_OPT_INT, F(in_channels), 1, 3, .meta = "N",
     .dflt = "1 for every model (images are read as gray)", .help = "input channels, 1 or 3"},
    {"classes", ZPS_OPT_INT, F(classes), 2, 100000, .meta = "N",
     .dflt = "the dataset's classes.txt, else 10", .help = "classes of the classifier"},
    {"aux", ZPS_OPT_ENUM, F(aux), .names = s_aux,
     .help = "inception_v3 auxiliary head (auto: on at input >= 299)"},
    {"dropout", ZPS_OPT_DOUBLE, F(dropout), 0, 0.99, .meta = "P", .dflt = "the model's",
     .help = "dropout rate before the classifier"},
    {"init-weights", ZPS_OPT_STRING, F(init_weights), .meta = "FILE",
     .help = "start from a weights file instead of the seeded init"},
    {.type = ZPS_OPT_TEXT, .help = "data:"},
    {"data", ZPS_OPT_STRING, F(data), .meta = "DIR",
     .help = "dataset directory, required (zps-data convert ... --out DIR)"},
    {"threads", ZPS_OPT_INT, F(threads), 0, 64, .meta = "N",
     .help = "decode threads (0: in the training thread)"},
    {"augment", ZPS_OPT_SET, F(augment), .help = "random crop + horizontal flip"},
    {"shard", ZPS_OPT_ENUM, F(shard), .names = s_shard,
     .help = "records: each trainer reads its share;\n"
             "batch: all read the global batch, each trains on its slice"},
    {"skip-corrupt", ZPS_OPT_INT, F(skip_corrupt), 0, S_STEPS, .meta = "N", .dflt = "0",
     .help = "skip and count up to N training records that fail their\n"
             "checksum or do not decode; the N+1st is an error"},
    {.type = ZPS_OPT_TEXT, .help = "where:"},
    {"device", ZPS_OPT_STRING, F(device), .names = s_device,
     .help = "auto: a GPU when one answers, else the CPU; cuda: a GPU\n"
             "or an error; staged: the CPU behind a device's copies\n"
             "(tests the GPU paths without a GPU; docs/training.md)"},
    {"gpu", ZPS_OPT_INT, F(gpu), 0, 1023, .meta = "N",
     .help = "the visible CUDA device to use, from 0\n"
             "(after CUDA_VISIBLE_DEVICES; one device per trainer)"},
    {"mode", ZPS_OPT_FUNC, .fn = s_mode, .show = s_mode_show, .meta = "M", .dflt = "local",
     .help = "local | sync | async | ssp | allreduce"},
    {"cluster", ZPS_OPT_STRING, F(cluster), .meta = "FILE",
     .help = "servers and trainers (docs/cluster.md)"},
    {"servers", ZPS_OPT_STRING, F(servers), .meta = "URI[,URI..]",
     .help = "servers without a cluster file (tcp://127.0.0.1:7000,...)"},
    {"trainer-id", ZPS_OPT_INT, F(trainer_id), 0, 4095, .meta = "I",
     .help = "this trainer's index"},
    {"num-trainers", ZPS_OPT_INT, F(num_trainers), 1, 4096, .meta = "N",
     .dflt = "the cluster file's trainers, else 1", .help = "trainers in the job"},
    {"node-trainers", ZPS_OPT_INT, F(node_trainers), 1, 4096, .meta = "G", .dflt = "1",
     .help = "PS modes: trainers i with the same i / G are a node: they\n"
             "all-reduce their gradients, and the node's first trainer\n"
             "pushes and pulls for it (servers: --num-trainers N / G)"},
    {"replicas-to-aggregate", ZPS_OPT_UINT, F(replicas_to_aggregate), 1, 4096, .meta = "R",
     .dflt = "all trainers", .help = "sync: pushes per step"},
    {"staleness", ZPS_OPT_UINT, F(staleness), 0, 1000000, .meta = "S", .help = "ssp bound"},
    {"chunk-bytes", ZPS_OPT_UINT, F(chunk_bytes), 4, (double)(1ll << 32), .meta = "B",
     .help = "PS chunk size"},
    {"job", ZPS_OPT_STRING, F(job), .meta = "NAME",
     .dflt = "the zps-launch run folder's name, else zps",
     .help = "job name: names the all-reduce segment"},
    {"timeout-ms", ZPS_OPT_INT, F(timeout_ms), 10, 86400000, .meta = "MS",
     .help = "PS request timeout before a resend"},
    {"register-wait", ZPS_OPT_DOUBLE, F(register_wait_s), 0, 86400, .meta = "SEC",
     .help = "when an earlier process of this trainer id (killed, not yet\n"
             "timed out on the servers) still holds the id, retry REGISTER\n"
             "this long; past the servers' --trainer-timeout (30 s)"},
    {"curve-server-key", ZPS_OPT_STRING, F(curve_server_key), .meta = "FILE",
     .help = "the servers' CURVE public key (their .pub): encrypt and\n"
             "authenticate PS traffic; needs --curve-key"},
    {"curve-key", ZPS_OPT_STRING, F(curve_key), .meta = "FILE",
     .help = "this trainer's CURVE key pair (zps-server --keygen PREFIX\n"
             "writes PREFIX.key; the servers list PREFIX.pub in --curve-allow)"},
    {"push-dtype", ZPS_OPT_FUNC, .fn = s_push_dtype, .show = s_push_dtype_show,
     .meta = "f32|bf16", .dflt = "f32",
     .help = "gradients on the wire; bf16 halves the bytes\n"
             "pushed, rounding each gradient to 8 mantissa bits"},
    {"no-shm", ZPS_OPT_CLEAR, F(shm),
     .help = "with servers on this host, send every payload through ZeroMQ\n"
             "instead of their shared memory (docs/ps.md \"Shared memory\")"},
    {.type = ZPS_OPT_TEXT, .help = "work:"},
    {"batch-size", ZPS_OPT_INT, F(batch), 1, 1 << 20, .meta = "N",
     .help = "images per step per trainer"},
    {"steps", ZPS_OPT_INT, F(steps), 1, S_STEPS, .meta = "N", .dflt = "",
     .help = "steps to run (overrides --epochs)"},
    {"epochs", ZPS_OPT_DOUBLE, F(epochs), 1e-6, 1e6, .meta = "F",
     .help = "epochs of this trainer's share"},
    {"accumulate", ZPS_OPT_INT, F(accumulate), 1, 4096, .meta = "K",
     .help = "micro-batches of --batch-size per step"},
    {"precision", ZPS_OPT_ENUM, F(bf16), .names = s_precision, .dflt = "f32",
     .help = "f32; bf16: convolutions compute in bfloat16 (float master\n"
             "weights, float activations; no loss scaling)"},
    {"recompute", ZPS_OPT_SET, F(recompute),
     .help = "gradient checkpointing: keep ~sqrt(layers) activations,\n"
             "recompute the rest in backward (same gradients, less\n"
             "memory, about one more forward per step)"},
    {"time-limit", ZPS_OPT_DOUBLE, F(time_limit_s), 0, 1e9, .meta = "SEC", .dflt = "",
     .help = "stop after SEC seconds"},
    {"stop-accuracy", ZPS_OPT_DOUBLE, F(stop_accuracy), 0, 1, .meta = "A", .dflt = "",
     .help = "stop once test accuracy >= A (0..1); ssd: test mAP@0.5 >= A"},
    {.type = ZPS_OPT_TEXT, .help = "optimizer (PS modes: applied on the servers; others: here):"},
    {"optimizer", ZPS_OPT_FUNC, .fn = s_optimizer, .show = s_optimizer_show,
     .meta = "NAME", .dflt = "sgd",
     .help = "sgd | momentum | rmsprop | adam | adagrad"},
    {"lr", ZPS_OPT_DOUBLE, F(opt.lr), 0, 1e6, .meta = "F", .help = "learning rate"},
    {"momentum", ZPS_OPT_DOUBLE, F(opt.momentum), 0, 1, .meta = "F", .help = "momentum, rmsprop"},
    {"nesterov", ZPS_OPT_SET, F(opt.nesterov), .help = "momentum: Nesterov's"},
    {"rho", ZPS_OPT_DOUBLE, F(opt.decay), 0, 1, .meta = "F", .help = "rmsprop decay"},
    {"epsilon", ZPS_OPT_DOUBLE, F(opt.epsilon), 0, 1e6, .meta = "F",
     .help = "rmsprop, adam, adagrad"},
    {"beta1", ZPS_OPT_DOUBLE, F(opt.beta1), 0, 1, .meta = "F", .help = "adam"},
    {"beta2", ZPS_OPT_DOUBLE, F(opt.beta2), 0, 1, .meta = "F", .help = "adam"},
    {"weight-decay", ZPS_OPT_DOUBLE, F(opt.weight_decay), 0, 1e3, .meta = "F",
     .help = "L2 weight decay"},
    {"initial-accumulator", ZPS_OPT_DOUBLE, F(opt.initial_accumulator), 0, 1e6, .meta = "F",
     .help = "adagrad"},
    {"lr-schedule", ZPS_OPT_ENUM, F(opt.sched), .names = s_sched, .help = "learning rate schedule"},
    {"decay-rate", ZPS_OPT_DOUBLE, F(opt.decay_rate), 0, 1e6, .meta = "F", .help = "exponential"},
    {"decay-steps", ZPS_OPT_UINT, F(opt.decay_steps), 1, S_STEPS, .meta = "N",
     .help = "exponential"},
    {"staircase", ZPS_OPT_SET, F(opt.staircase), .help = "exponential: whole decay steps"},
    {"total-steps", ZPS_OPT_UINT, F(opt.total_steps), 1, S_STEPS, .meta = "N", .help = "cosine"},
    {"min-lr", ZPS_OPT_DOUBLE, F(opt.min_lr), 0, 1e6, .meta = "F", .help = "cosine"},
    {"warmup-steps", ZPS_OPT_UINT, F(opt.warmup_steps), 0, S_STEPS, .meta = "N",
     .help = "linear warmup"},
    {.type = ZPS_OPT_TEXT, .help = "output:"},
    {"eval-every", ZPS_OPT_INT, F(eval_every), 0, S_STEPS, .meta = "N", .dflt = "0, at the end only",
     .help = "evaluate on the test split every N steps"},
    {"eval-batches", ZPS_OPT_INT, F(eval_batches), 0, 1 << 30, .meta = "N",
     .dflt = "0, the whole test split", .help = "batches per evaluation"},
    {"eval-all", ZPS_OPT_SET, F(eval_all), .help = "every trainer evaluates (default: trainer 0)"},
    {"eval-only", ZPS_OPT_SET, F(eval_only),
     .help = "evaluate --init-weights on the test split and exit"},
    {"dump-detections", ZPS_OPT_INT, F(dump_detections), 0, S_STEPS, .meta = "N", .dflt = "",
     .help = "ssd: at the end, draw test record N (within the evaluation\n"
             "set) with its predicted (green) and true (red) boxes"},
    {"dump-out", ZPS_OPT_STRING, F(dump_out), .meta = "FILE.png", .dflt = "detections.png",
     .help = "where --dump-detections writes"},
    {"metrics", ZPS_OPT_STRING, F(metrics), .meta = "FILE",
     .help = "JSON Lines, one record per step and evaluation"},
    {"export", ZPS_OPT_STRING, F(export_path), .meta = "FILE",
     .help = "trainer 0 writes the final weights (pulled from the servers)"},
    {"export-format", ZPS_OPT_ENUM, F(export_format), .names = nn_weights_format_names,
     .help = "--export FILE's format: zps (zps-trainer/zps-bench read it) or\n"
             "safetensors (torchvision's names: PyTorch's load_state_dict takes it)"},
    {"resume", ZPS_OPT_SET, F(resume), .help = "local/allreduce: start from --export FILE when it exists"},
    {"trace", ZPS_OPT_STRING, F(trace), .meta = "FILE",
     .help = "a timeline of --trace-steps steps (Chrome trace JSON: Perfetto,\n"
             "chrome://tracing); {trainer} in FILE becomes the trainer id,\n"
             "without it only trainer 0 writes"},
    {"trace-from", ZPS_OPT_INT, F(trace_from), 1, S_STEPS, .meta = "STEP", .dflt = "5",
     .help = "--trace: the window's first step (1-based)"},
    {"trace-steps", ZPS_OPT_INT, F(trace_steps), 1, 10000, .meta = "N", .dflt = "3",
     .help = "--trace: steps in the window"},
    {"shutdown-servers", ZPS_OPT_SET, F(shutdown_servers),
     .help = "trainer 0 shuts the servers down at the end"},
    {"no-progress", ZPS_OPT_CLEAR, F(progress), .help = "no progress line"},
    {"seed", ZPS_OPT_UINT, F(seed), 0, (double)(1ll << 62), .meta = "N",
     .help = "init, shuffle and augmentation seed"},
    ZPS_OPT_LOG_LEVEL,
    {.type = ZPS_OPT_END},
};

#undef F

static const zps_opts s_spec = {
    .prog = "zps-trainer",
    .usage = "usage: zps-trainer --data DIR [options]\n"
             "Trains a model on LMDB shards (DIR/train, DIR/test) alone, against parameter servers\n"
             "(sync, async, ssp) or with in-node all-reduce. docs/training.md has the details.\n\n",
    .opt = s_opt,
    .cfg_size = sizeof(tr_config),
    .defaults = s_defaults,
};

/* The checks across flags, after each flag passed its own. */
static zps_status s_check(tr_config *c, int *exit_code)
{
    if (!c->data[0])
        return zps_opts_fail(&s_spec, exit_code, "--data DIR is required (zps-data convert "
                                                 "fashion-mnist --out DIR)");
    if (c->eval_only && !c->init_weights[0])
        return zps_opts_fail(&s_spec, exit_code, "--eval-only needs --init-weights FILE");
    if (c->eval_only)
        c->mode = TR_MODE_LOCAL;
    if (c->dump_detections >= 0 && strcmp(c->model, "ssd") != 0)
        return zps_opts_fail(&s_spec, exit_code, "--dump-detections draws a detector's boxes: "
                             "it needs --model ssd");
    int ps_mode = c->mode == TR_MODE_SYNC || c->mode == TR_MODE_ASYNC || c->mode == TR_MODE_SSP;
    if (c->node_trainers > 1 && c->num_trainers && c->num_trainers % c->node_trainers)
        return zps_opts_fail(&s_spec, exit_code, "--node-trainers %d does not divide the job's "
                             "%d trainers (--num-trainers)", c->node_trainers, c->num_trainers);
    if (c->node_trainers > 1 && c->num_trainers &&
        c->replicas_to_aggregate > (unsigned)(c->num_trainers / c->node_trainers))
        return zps_opts_fail(&s_spec, exit_code, "--replicas-to-aggregate %u: with "
                             "--node-trainers %d the servers see one trainer per node, %d in "
                             "all", c->replicas_to_aggregate, c->node_trainers,
                             c->num_trainers / c->node_trainers);
    if (c->node_trainers > 1 && !ps_mode)
        return zps_opts_fail(&s_spec, exit_code, "--node-trainers groups the trainers of a PS "
                             "job (--mode sync, async or ssp), not --mode %s",
                             tr_mode_name(c->mode));
    if (ps_mode && !c->cluster[0] && !c->servers[0])
        return zps_opts_fail(&s_spec, exit_code, "--mode %s needs --cluster FILE or --servers "
                             "URI,...", tr_mode_name(c->mode));
    if (!c->curve_server_key[0] != !c->curve_key[0])
        return zps_opts_fail(&s_spec, exit_code, "--curve-server-key and --curve-key go together "
                             "(the servers' public key and this trainer's key pair)");
    if (c->resume && c->export_format != NN_WEIGHTS_ZPS)
        return zps_opts_fail(&s_spec, exit_code, "--resume reads --export FILE back, which "
                             "only works in the zps format (not with --export-format %s)",
                             zps_opt_name_of(nn_weights_format_names, c->export_format));
    char why[256];
    if (ps_optim_validate(&c->opt, why, sizeof why) != ZPS_OK)
        return zps_opts_fail(&s_spec, exit_code, "optimizer settings: %s", why);
    return ZPS_OK;
}

zps_status tr_config_parse(tr_config *c, int argc, char **argv, int *exit_code)
{
    int first;
    zps_status st = zps_opts_parse(&s_spec, c, argc, argv, &first, exit_code);
    if (st != ZPS_OK || *exit_code >= 0)
        return st;
    return s_check(c, exit_code);
}

void tr_config_json(const tr_config *c, zps_json *j) { zps_opts_json(&s_spec, c, j); }

int tr_config_local_trainers(const tr_config *c)
{
    int n = c->num_trainers ? c->num_trainers : 1;
    if (c->cluster[0]) {
        zps_cluster *cl;
        zps_parse_error err;
        if (zps_cluster_load(c->cluster, &cl, &err) != ZPS_OK)
            return 1;
        int here = 0;
        for (int i = 0; i < cl->n_trainers; i++)
            here += zps_net_host_here(cl->trainers[i].host);
        int all = c->num_trainers ? c->num_trainers : cl->n_trainers;
        zps_cluster_destroy(&cl);
        if (c->mode == TR_MODE_ALLREDUCE)
            return all;
        return here > 0 ? here : 1;
    }
    if (c->mode == TR_MODE_ALLREDUCE)
        return n;
    if (!c->servers[0])
        return 1;
    char uri[512];
    for (const char *p = c->servers; *p;) {
        size_t len = strcspn(p, ",");
        snprintf(uri, sizeof uri, "%.*s", (int)len, p);
        if (!zps_net_endpoint_here(uri))
            return 1;
        p += len + (p[len] == ',');
    }
    return n;
}
