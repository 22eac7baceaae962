/* config.c — zps-trainer's flags (see config.h and docs/training.md). */
#include "trainer/config.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

static const char *const s_mode_names[] = {"local", "sync", "async", "ssp", "allreduce"};

const char *tr_mode_name(tr_mode m)
{
    return (unsigned)m < sizeof s_mode_names / sizeof s_mode_names[0] ? s_mode_names[m] : "?";
}

zps_status tr_mode_parse(const char *s, tr_mode *out)
{
    for (unsigned i = 0; i < sizeof s_mode_names / sizeof s_mode_names[0]; i++)
        if (strcmp(s, s_mode_names[i]) == 0) {
            *out = (tr_mode)i;
            return ZPS_OK;
        }
    return ZPS_ERR_INVALID;
}

void tr_config_default(tr_config *c)
{
    memset(c, 0, sizeof *c);
    snprintf(c->model, sizeof c->model, "convnet");
    c->width = 1.0f;
    c->aux = -1;
    c->dropout = -1.0f;
    c->batchnorm = 1;
    c->threads = 1;
    snprintf(c->device, sizeof c->device, "auto");
    c->mode = TR_MODE_LOCAL;
    c->timeout_ms = 30000;
    c->batch = 64;
    c->epochs = 1.0;
    c->accumulate = 1;
    ps_optim_default(&c->opt);
    c->opt.lr = 0.05;
    c->progress = 1;
    c->seed = 1;
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

static void s_usage(FILE *f)
{
    fprintf(f,
        "usage: zps-trainer --data DIR [options]\n"
        "Trains a model on LMDB shards (DIR/train, DIR/test) alone, against parameter servers\n"
        "(sync, async, ssp) or with in-node all-reduce. docs/training.md has the details.\n\n"
        "model:\n"
        "  --model NAME            mlp | convnet | inception_v3 (default convnet)\n"
        "  --width F               inception_v3 channel multiplier (default 1)\n"
        "  --input-size N          model input height = width; images are resized (default:\n"
        "                          the model's: 28 mlp/convnet, 299 inception_v3)\n"
        "  --in-channels N         1 or 3 (default: 1 for mlp/convnet, 3 for inception_v3)\n"
        "  --classes N             default: the dataset's classes.txt, else 10\n"
        "  --aux auto|on|off       inception_v3 auxiliary head (default auto: on at >= 299)\n"
        "  --dropout P             override the model's dropout rate\n"
        "  --no-batchnorm          convnet: convolutions with bias instead of batchnorm\n"
        "  --init-weights FILE     start from a weights file instead of the seeded init\n"
        "data:\n"
        "  --data DIR              dataset directory (zps-data convert ... --out DIR)\n"
        "  --threads N             decode threads (default 1)\n"
        "  --augment               random crop + horizontal flip\n"
        "  --shard records|batch   records: each trainer reads its share (default);\n"
        "                          batch: all read the global batch, each trains on its slice\n"
        "where:\n"
        "  --device auto|cpu|cuda  default auto (CUDA when a GPU answers, else CPU)\n"
        "  --mode M                local | sync | async | ssp | allreduce (default local)\n"
        "  --cluster FILE          servers and trainers (docs/cluster.md)\n"
        "  --servers URI[,URI..]   servers without a cluster file (tcp://127.0.0.1:7000,...)\n"
        "  --trainer-id I          this trainer's index (default 0)\n"
        "  --num-trainers N        default: the cluster file's trainers, else 1\n"
        "  --replicas-to-aggregate R   sync: pushes per step (default all trainers)\n"
        "  --staleness S           ssp bound (default 0)\n"
        "  --chunk-bytes B         PS chunk size (default 4194304)\n"
        "  --job NAME              job name: all-reduce segment (default: the zps-launch run\n"
        "                          folder's name, else zps)\n"
        "  --timeout-ms MS         PS request timeout before a resend (default 30000)\n"
        "  --curve-server-key FILE the servers' CURVE public key (their .pub): encrypt and\n"
        "                          authenticate PS traffic; needs --curve-key\n"
        "  --curve-key FILE        this trainer's CURVE key pair (zps-server --keygen PREFIX\n"
        "                          writes PREFIX.key; the servers list PREFIX.pub in --curve-allow)\n"
        "  --push-dtype f32|bf16   gradients on the wire (default f32); bf16 halves the bytes\n"
        "                          pushed, rounding each gradient to 8 mantissa bits\n"
        "work:\n"
        "  --batch-size N          images per step per trainer (default 64)\n"
        "  --steps N               steps to run (overrides --epochs)\n"
        "  --epochs F              epochs of this trainer's share (default 1)\n"
        "  --accumulate K          micro-batches of --batch-size per step (default 1)\n"
        "  --time-limit SEC        stop after SEC seconds\n"
        "  --stop-accuracy A       stop once test accuracy >= A (0..1)\n"
        "optimizer (PS modes: applied on the servers; others: here):\n"
        "  --optimizer NAME        sgd | momentum | rmsprop | adam | adagrad (default sgd)\n"
        "  --lr F (0.05)  --momentum F  --nesterov  --rho F (rmsprop decay)  --epsilon F\n"
        "  --beta1 F  --beta2 F  --weight-decay F  --initial-accumulator F\n"
        "  --lr-schedule constant|exponential|cosine  --decay-rate F  --decay-steps N\n"
        "  --staircase  --total-steps N (cosine)  --min-lr F  --warmup-steps N\n"
        "output:\n"
        "  --eval-every N          evaluate on the test split every N steps (default: at end)\n"
        "  --eval-batches N        batches per evaluation (default: the whole test split)\n"
        "  --eval-all              every trainer evaluates (default: trainer 0)\n"
        "  --eval-only             evaluate --init-weights on the test split and exit\n"
        "  --metrics FILE          JSON Lines, one record per step and evaluation\n"
        "  --export FILE           trainer 0 writes the final weights (pulled from the servers)\n"
        "  --resume                local/allreduce: start from --export FILE when it exists\n"
        "  --shutdown-servers      trainer 0 shuts the servers down at the end\n"
        "  --no-progress           no progress line\n"
        "  --seed N                init, shuffle and augmentation seed (default 1)\n"
        "  --log-level L           trace | debug | info | warn | error (or ZPS_LOG)\n"
        "  --help\n");
}

/* Number parsing with the flag named in the error. */
static int s_int(const char *flag, const char *v, long long lo, long long hi, long long *out)
{
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "zps-trainer: %s wants an integer in [%lld, %lld], got '%s'\n", flag,
                lo, hi, v);
        return 0;
    }
    *out = x;
    return 1;
}

static int s_dbl(const char *flag, const char *v, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno || !isfinite(x) || x < lo || x > hi) {
        fprintf(stderr, "zps-trainer: %s wants a number in [%g, %g], got '%s'\n", flag, lo, hi,
                v);
        return 0;
    }
    *out = x;
    return 1;
}

static int s_str(const char *flag, const char *v, char *dst, size_t cap)
{
    if (strlen(v) >= cap) {
        fprintf(stderr, "zps-trainer: %s value is longer than %zu characters\n", flag, cap - 1);
        return 0;
    }
    memcpy(dst, v, strlen(v) + 1);
    return 1;
}

enum {
    O_MODEL = 256, O_WIDTH, O_INPUT, O_INCH, O_CLASSES, O_AUX, O_DROPOUT, O_NOBN, O_INITW,
    O_DATA, O_THREADS, O_AUGMENT, O_SHARD, O_DEVICE, O_MODE, O_CLUSTER, O_SERVERS, O_TID,
    O_NTR, O_R2A, O_STALE, O_CHUNK, O_JOB, O_TIMEOUT, O_BATCH, O_STEPS, O_EPOCHS, O_ACC,
    O_TLIMIT, O_STOPACC, O_OPT, O_LR, O_MOM, O_NEST, O_RHO, O_EPS, O_B1, O_B2, O_WD, O_IACC,
    O_SCHED, O_DRATE, O_DSTEPS, O_STAIR, O_TSTEPS, O_MINLR, O_WARM, O_EVERY, O_EBATCH,
    O_EALL, O_METRICS, O_EXPORT, O_RESUME, O_SHUT, O_NOPROG, O_SEED, O_LOG, O_HELP, O_EVALONLY,
    O_CSKEY, O_CKEY, O_PDTYPE,
};

static const struct option s_opts[] = {
    {"model", 1, 0, O_MODEL}, {"width", 1, 0, O_WIDTH}, {"input-size", 1, 0, O_INPUT},
    {"in-channels", 1, 0, O_INCH}, {"classes", 1, 0, O_CLASSES}, {"aux", 1, 0, O_AUX},
    {"dropout", 1, 0, O_DROPOUT}, {"no-batchnorm", 0, 0, O_NOBN},
    {"init-weights", 1, 0, O_INITW}, {"data", 1, 0, O_DATA}, {"threads", 1, 0, O_THREADS},
    {"augment", 0, 0, O_AUGMENT}, {"shard", 1, 0, O_SHARD}, {"device", 1, 0, O_DEVICE},
    {"mode", 1, 0, O_MODE}, {"cluster", 1, 0, O_CLUSTER}, {"servers", 1, 0, O_SERVERS},
    {"trainer-id", 1, 0, O_TID}, {"num-trainers", 1, 0, O_NTR},
    {"replicas-to-aggregate", 1, 0, O_R2A}, {"staleness", 1, 0, O_STALE},
    {"chunk-bytes", 1, 0, O_CHUNK}, {"job", 1, 0, O_JOB}, {"timeout-ms", 1, 0, O_TIMEOUT},
    {"curve-server-key", 1, 0, O_CSKEY}, {"curve-key", 1, 0, O_CKEY},
    {"push-dtype", 1, 0, O_PDTYPE},
    {"batch-size", 1, 0, O_BATCH}, {"steps", 1, 0, O_STEPS}, {"epochs", 1, 0, O_EPOCHS},
    {"accumulate", 1, 0, O_ACC}, {"time-limit", 1, 0, O_TLIMIT},
    {"stop-accuracy", 1, 0, O_STOPACC}, {"optimizer", 1, 0, O_OPT}, {"lr", 1, 0, O_LR},
    {"momentum", 1, 0, O_MOM}, {"nesterov", 0, 0, O_NEST}, {"rho", 1, 0, O_RHO},
    {"epsilon", 1, 0, O_EPS}, {"beta1", 1, 0, O_B1}, {"beta2", 1, 0, O_B2},
    {"weight-decay", 1, 0, O_WD}, {"initial-accumulator", 1, 0, O_IACC},
    {"lr-schedule", 1, 0, O_SCHED}, {"decay-rate", 1, 0, O_DRATE},
    {"decay-steps", 1, 0, O_DSTEPS}, {"staircase", 0, 0, O_STAIR},
    {"total-steps", 1, 0, O_TSTEPS}, {"min-lr", 1, 0, O_MINLR},
    {"warmup-steps", 1, 0, O_WARM}, {"eval-every", 1, 0, O_EVERY},
    {"eval-batches", 1, 0, O_EBATCH}, {"eval-all", 0, 0, O_EALL},
    {"metrics", 1, 0, O_METRICS}, {"export", 1, 0, O_EXPORT}, {"resume", 0, 0, O_RESUME},
    {"shutdown-servers", 0, 0, O_SHUT}, {"no-progress", 0, 0, O_NOPROG},
    {"seed", 1, 0, O_SEED}, {"eval-only", 0, 0, O_EVALONLY}, {"log-level", 1, 0, O_LOG}, {"help", 0, 0, O_HELP},
    {0, 0, 0, 0},
};

zps_status tr_config_parse(tr_config *c, int argc, char **argv, int *exit_code)
{
    *exit_code = -1;
    int momentum_set = 0;
    long long i;
    double d;
    int ok = 1, o;
    optind = 1;
    opterr = 1;
    while (ok && (o = getopt_long(argc, argv, "h", s_opts, NULL)) != -1) {
        switch (o) {
        case O_MODEL: ok = s_str("--model", optarg, c->model, sizeof c->model); break;
        case O_WIDTH: ok = s_dbl("--width", optarg, 0.01, 4, &d); c->width = (float)d; break;
        case O_INPUT: ok = s_int("--input-size", optarg, 8, 4096, &i); c->input_size = (int)i; break;
        case O_INCH: ok = s_int("--in-channels", optarg, 1, 3, &i); c->in_channels = (int)i; break;
        case O_CLASSES: ok = s_int("--classes", optarg, 2, 100000, &i); c->classes = (int)i; break;
        case O_AUX:
            if (!strcmp(optarg, "auto")) c->aux = -1;
            else if (!strcmp(optarg, "on")) c->aux = 1;
            else if (!strcmp(optarg, "off")) c->aux = 0;
            else { fprintf(stderr, "zps-trainer: --aux wants auto, on or off\n"); ok = 0; }
            break;
        case O_DROPOUT: ok = s_dbl("--dropout", optarg, 0, 0.99, &d); c->dropout = (float)d; break;
        case O_NOBN: c->batchnorm = 0; break;
        case O_INITW: ok = s_str("--init-weights", optarg, c->init_weights, sizeof c->init_weights); break;
        case O_DATA: ok = s_str("--data", optarg, c->data, sizeof c->data); break;
        case O_THREADS: ok = s_int("--threads", optarg, 0, 64, &i); c->threads = (int)i; break;
        case O_AUGMENT: c->augment = 1; break;
        case O_SHARD:
            if (!strcmp(optarg, "records")) c->shard = TR_SHARD_RECORDS;
            else if (!strcmp(optarg, "batch")) c->shard = TR_SHARD_BATCH;
            else { fprintf(stderr, "zps-trainer: --shard wants records or batch\n"); ok = 0; }
            break;
        case O_DEVICE: ok = s_str("--device", optarg, c->device, sizeof c->device); break;
        case O_MODE:
            if (tr_mode_parse(optarg, &c->mode) != ZPS_OK) {
                fprintf(stderr, "zps-trainer: --mode wants local, sync, async, ssp or allreduce, got '%s'\n", optarg);
                ok = 0;
            }
            break;
        case O_CLUSTER: ok = s_str("--cluster", optarg, c->cluster, sizeof c->cluster); break;
        case O_SERVERS: ok = s_str("--servers", optarg, c->servers, sizeof c->servers); break;
        case O_TID: ok = s_int("--trainer-id", optarg, 0, 4095, &i); c->trainer_id = (int)i; break;
        case O_NTR: ok = s_int("--num-trainers", optarg, 1, 4096, &i); c->num_trainers = (int)i; break;
        case O_R2A: ok = s_int("--replicas-to-aggregate", optarg, 1, 4096, &i); c->replicas_to_aggregate = (uint32_t)i; break;
        case O_STALE: ok = s_int("--staleness", optarg, 0, 1000000, &i); c->staleness = (uint32_t)i; break;
        case O_CHUNK: ok = s_int("--chunk-bytes", optarg, 4, 1ll << 32, &i); c->chunk_bytes = (uint64_t)i; break;
        case O_JOB: ok = s_str("--job", optarg, c->job, sizeof c->job); break;
        case O_TIMEOUT: ok = s_int("--timeout-ms", optarg, 10, 86400000, &i); c->timeout_ms = (int)i; break;
        case O_CSKEY: ok = s_str("--curve-server-key", optarg, c->curve_server_key, sizeof c->curve_server_key); break;
        case O_CKEY: ok = s_str("--curve-key", optarg, c->curve_key, sizeof c->curve_key); break;
        case O_PDTYPE:
            if (ps_dtype_parse(optarg, &c->push_dtype)) {
                fprintf(stderr, "zps-trainer: --push-dtype wants f32 or bf16, got '%s'\n", optarg);
                ok = 0;
            }
            break;
        case O_BATCH: ok = s_int("--batch-size", optarg, 1, 1 << 20, &i); c->batch = (int)i; break;
        case O_STEPS: ok = s_int("--steps", optarg, 1, 1ll << 40, &i); c->steps = i; break;
        case O_EPOCHS: ok = s_dbl("--epochs", optarg, 1e-6, 1e6, &c->epochs); break;
        case O_ACC: ok = s_int("--accumulate", optarg, 1, 4096, &i); c->accumulate = (int)i; break;
        case O_TLIMIT: ok = s_dbl("--time-limit", optarg, 0, 1e9, &c->time_limit_s); break;
        case O_STOPACC: ok = s_dbl("--stop-accuracy", optarg, 0, 1, &c->stop_accuracy); break;
        case O_OPT:
            if (ps_optim_kind_parse(optarg, &c->opt.kind) != ZPS_OK) {
                fprintf(stderr, "zps-trainer: --optimizer wants sgd, momentum, rmsprop, adam or adagrad, got '%s'\n", optarg);
                ok = 0;
            }
            break;
        case O_LR: ok = s_dbl("--lr", optarg, 0, 1e6, &c->opt.lr); break;
        case O_MOM: ok = s_dbl("--momentum", optarg, 0, 1, &c->opt.momentum); momentum_set = 1; break;
        case O_NEST: c->opt.nesterov = 1; break;
        case O_RHO: ok = s_dbl("--rho", optarg, 0, 1, &c->opt.decay); break;
        case O_EPS: ok = s_dbl("--epsilon", optarg, 0, 1e6, &c->opt.epsilon); break;
        case O_B1: ok = s_dbl("--beta1", optarg, 0, 1, &c->opt.beta1); break;
        case O_B2: ok = s_dbl("--beta2", optarg, 0, 1, &c->opt.beta2); break;
        case O_WD: ok = s_dbl("--weight-decay", optarg, 0, 1e3, &c->opt.weight_decay); break;
        case O_IACC: ok = s_dbl("--initial-accumulator", optarg, 0, 1e6, &c->opt.initial_accumulator); break;
        case O_SCHED:
            if (!strcmp(optarg, "constant")) c->opt.sched = PS_SCHED_CONSTANT;
            else if (!strcmp(optarg, "exponential")) c->opt.sched = PS_SCHED_EXPONENTIAL;
            else if (!strcmp(optarg, "cosine")) c->opt.sched = PS_SCHED_COSINE;
            else { fprintf(stderr, "zps-trainer: --lr-schedule wants constant, exponential or cosine\n"); ok = 0; }
            break;
        case O_DRATE: ok = s_dbl("--decay-rate", optarg, 0, 1e6, &c->opt.decay_rate); break;
        case O_DSTEPS: ok = s_int("--decay-steps", optarg, 1, 1ll << 40, &i); c->opt.decay_steps = (uint64_t)i; break;
        case O_STAIR: c->opt.staircase = 1; break;
        case O_TSTEPS: ok = s_int("--total-steps", optarg, 1, 1ll << 40, &i); c->opt.total_steps = (uint64_t)i; break;
        case O_MINLR: ok = s_dbl("--min-lr", optarg, 0, 1e6, &c->opt.min_lr); break;
        case O_WARM: ok = s_int("--warmup-steps", optarg, 0, 1ll << 40, &i); c->opt.warmup_steps = (uint64_t)i; break;
        case O_EVERY: ok = s_int("--eval-every", optarg, 0, 1ll << 40, &i); c->eval_every = i; break;
        case O_EBATCH: ok = s_int("--eval-batches", optarg, 0, 1 << 30, &i); c->eval_batches = (int)i; break;
        case O_EALL: c->eval_all = 1; break;
        case O_METRICS: ok = s_str("--metrics", optarg, c->metrics, sizeof c->metrics); break;
        case O_EXPORT: ok = s_str("--export", optarg, c->export_path, sizeof c->export_path); break;
        case O_RESUME: c->resume = 1; break;
        case O_SHUT: c->shutdown_servers = 1; break;
        case O_NOPROG: c->progress = 0; break;
        case O_EVALONLY: c->eval_only = 1; break;
        case O_SEED: ok = s_int("--seed", optarg, 0, (1ll << 62), &i); c->seed = (uint64_t)i; break;
        case O_LOG:
            if (zps_log_set_level_str(optarg) != ZPS_OK) {
                fprintf(stderr, "zps-trainer: --log-level wants trace, debug, info, warn or error\n");
                ok = 0;
            }
            break;
        case 'h':
        case O_HELP: s_usage(stdout); *exit_code = 0; return ZPS_OK;
        default: ok = 0; break; /* getopt printed the reason */
        }
    }
    if (ok && optind < argc) {
        fprintf(stderr, "zps-trainer: unexpected argument '%s'\n", argv[optind]);
        ok = 0;
    }
    if (ok && !c->data[0]) {
        fprintf(stderr, "zps-trainer: --data DIR is required (zps-data convert fashion-mnist --out DIR)\n");
        ok = 0;
    }
    if (ok && c->eval_only && !c->init_weights[0]) {
        fprintf(stderr, "zps-trainer: --eval-only needs --init-weights FILE\n");
        ok = 0;
    }
    if (ok && c->eval_only)
        c->mode = TR_MODE_LOCAL;
    if (ok && strcmp(c->device, "auto") && strcmp(c->device, "cpu") && strcmp(c->device, "cuda")) {
        fprintf(stderr, "zps-trainer: --device wants auto, cpu or cuda\n");
        ok = 0;
    }
    int ps_mode = c->mode == TR_MODE_SYNC || c->mode == TR_MODE_ASYNC || c->mode == TR_MODE_SSP;
    if (ok && ps_mode && !c->cluster[0] && !c->servers[0]) {
        fprintf(stderr, "zps-trainer: --mode %s needs --cluster FILE or --servers URI,...\n",
                tr_mode_name(c->mode));
        ok = 0;
    }
    if (ok && !c->curve_server_key[0] != !c->curve_key[0]) {
        fprintf(stderr, "zps-trainer: --curve-server-key and --curve-key go together (the "
                        "servers' public key and this trainer's key pair)\n");
        ok = 0;
    }
    if (ok && c->opt.kind == PS_OPT_MOMENTUM && !momentum_set)
        c->opt.momentum = 0.9;
    char why[256];
    if (ok && ps_optim_validate(&c->opt, why, sizeof why) != ZPS_OK) {
        fprintf(stderr, "zps-trainer: optimizer settings: %s\n", why);
        ok = 0;
    }
    if (!ok) {
        fprintf(stderr, "zps-trainer --help lists the flags\n");
        *exit_code = 2;
        return ZPS_ERR_INVALID;
    }
    return ZPS_OK;
}
