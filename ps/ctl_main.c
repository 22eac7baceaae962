/* ctl_main.c — zps-ctl: the operator's command for a running fleet, and an offline merge of
 * its checkpoints (docs/training.md "Controlling a running fleet", docs/ps.md "Admin ops").
 *
 *   zps-ctl stats [--server I]   (--cluster FILE | --servers HOST:PORT,...)
 *   zps-ctl checkpoint           (--cluster FILE | --servers HOST:PORT,...)
 *   zps-ctl shutdown             (--cluster FILE | --servers HOST:PORT,...)
 *   zps-ctl export --ckpt-dir DIR [--ckpt-version V] --out FILE --model NAME [model flags]
 *                  [--bn-data DIR [--bn-batches N] [--batch-size B]]
 *
 * The fleet commands speak through the PS client library (ps/client.h) as no trainer
 * (PS_CLIENT_CTL_ID): its connections, CURVE (--curve-server-key, --curve-key) and one
 * deadline (--timeout) for the whole command. stats prints JSON on stdout: one server's
 * object with --server, else an array of every server's. checkpoint prints the version and
 * the files each server wrote; in sync mode checkpoint and shutdown ask for a consistent
 * cut (ps_client_admin), moving the version on while training overtakes it. export rebuilds the model's variable
 * table from --model and its flags (the checkpoints hold values, not names), checks it
 * against the shards' plan and writes a weights file for zps-trainer --init-weights.
 * Batchnorm running statistics live in the trainers, not in the shards: with --bn-data
 * export recomputes them from training batches (trainer/bn_recal.h), fed as zps-trainer
 * feeds its model; without it a model with batchnorm gets a warning naming --bn-data.
 *
 * Exit status: 0 success; 1 the fleet or the files said no (a refused or missing answer,
 * a missing, mixed or foreign shard); 2 usage.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/cluster.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/opts.h"
#include "ps/ckpt.h"
#include "ps/client.h"
#include "ps/plan.h"
#include "datasets/pipeline.h"
#include "trainer/bn_recal.h"
#include "trainer/models/models.h"

#define S_PROG "zps-ctl"
/* checkpoint in sync mode: how many times a cut may be overtaken by training. */
#define S_CUT_ROUNDS 10
/* export --bn-data: 100 batches of 32 (docs/training.md "Controlling a running fleet").
 * The result does not lean on the batch size: the mean of batch means is the data's mean and
 * the mean of unbiased batch variances its variance whatever the size, so the size is set
 * for memory (a training forward of Inception-v3 at 299x299 keeps every activation: 32
 * images take half of the trainer's default 64). 3200 images put each channel's recomputed
 * mean within ~1/sqrt(3200) (< 2%) of its std even where a channel has one value per image,
 * and cost one forward per image: seconds for convnet, minutes for inception_v3 at 299x299
 * on a few cores. */
#define S_BN_BATCHES 100
#define S_BN_BATCH 32

typedef struct args {
    char cluster[4096];    // --cluster FILE
    char servers[8192];    // --servers HOST:PORT,... (or tcp:// URIs)
    int server;            // --server I (stats); -1: every server
    char server_key[4096]; // --curve-server-key FILE
    char key[4096];        // --curve-key FILE
    double timeout_s;      // --timeout: the whole command
    bool now;              // --now: checkpoint / shutdown at once, not at a cut
    char ckpt_dir[4096];   // export: --ckpt-dir
    int64_t ckpt_version;  // export: --ckpt-version; -1: the latest files
    char out[4096];        // export: --out FILE
    int format;            // export: --format, an nn_weights_format
    char model[32];        // export: --model and the flags that shape its variables
    int classes, in_channels, input_size, aux;
    double width;
    char bn_data[4096];    // export: --bn-data DIR (training data for the statistics)
    int bn_batches;        // --bn-batches N
    int bn_batch;          // --batch-size B
} args;

static void s_defaults(void *p)
{
    *(args *)p = (args){.server = -1, .timeout_s = 60, .ckpt_version = -1, .model = "convnet",
                        .classes = 10, .aux = -1, .width = 1, .bn_batches = S_BN_BATCHES,
                        .bn_batch = S_BN_BATCH};
}

static const zps_opt_name s_aux[] = {{"auto", -1}, {"on", 1}, {"off", 0}, {NULL, 0}};

#define F(f) ZPS_OPT_FIELD(args, f)
static const zps_opt s_table[] = {
    {.type = ZPS_OPT_TEXT, .help = "Fleet (stats, checkpoint, shutdown):"},
    {"cluster", ZPS_OPT_STRING, F(cluster), .meta = "FILE", .help = "the fleet's cluster file"},
    {"servers", ZPS_OPT_STRING, F(servers), .meta = "HOST:PORT,...",
     .help = "the servers in index order (or tcp:// URIs), instead of --cluster"},
    {"server", ZPS_OPT_INT, F(server), 0, 4095, .meta = "I", .dflt = "every server",
     .help = "stats: this server only"},
    {"curve-server-key", ZPS_OPT_STRING, F(server_key), .meta = "FILE",
     .help = "the servers' public key (.pub), with --curve-key"},
    {"curve-key", ZPS_OPT_STRING, F(key), .meta = "FILE",
     .help = "this operator's key pair; checkpoint and shutdown need an admin\n"
             "key ('KEY admin' in the servers' --curve-allow)"},
    {"now", ZPS_OPT_SET, F(now),
     .help = "checkpoint, shutdown: at once, as each server stands (sync: maybe\n"
             "not one cut); without it a sync fleet acts at one version"},
    {"timeout", ZPS_OPT_DOUBLE, F(timeout_s), 0.1, 86400, .meta = "SEC",
     .help = "give up after this long (a cut waits for training to reach it)"},
    {.type = ZPS_OPT_TEXT, .help = "Export (offline):"},
    {"ckpt-dir", ZPS_OPT_STRING, F(ckpt_dir), .meta = "DIR", .help = "the servers' --checkpoint-dir"},
    {"ckpt-version", ZPS_OPT_INT, F(ckpt_version), 0, 9.2e18, .meta = "V",
     .dflt = "the latest server-I.ckpt", .help = "use the versioned files server-I.vV.ckpt"},
    {"out", ZPS_OPT_STRING, F(out), .meta = "FILE", .help = "the weights file to write"},
    {"format", ZPS_OPT_ENUM, F(format), .names = nn_weights_format_names,
     .help = "--out's format: zps (zps-trainer/zps-bench read it) or safetensors\n"
             "(torchvision's names: PyTorch's load_state_dict takes it)"},
    {"model", ZPS_OPT_STRING, F(model), .meta = "NAME",
     .help = "mlp | convnet | inception_v3 | ssd: what the fleet trained, with the\n"
             "same flags as zps-trainer's below (they shape the variables)"},
    {"classes", ZPS_OPT_INT, F(classes), 2, 100000, .meta = "N", .help = "classes"},
    {"in-channels", ZPS_OPT_INT, F(in_channels), 0, 3, .meta = "N", .dflt = "the trainer's",
     .help = "input channels"},
    {"input-size", ZPS_OPT_INT, F(input_size), 0, 4096, .meta = "N", .dflt = "the model's",
     .help = "input height = width"},
    {"width", ZPS_OPT_DOUBLE, F(width), 0.01, 4, .meta = "F", .help = "inception_v3 and ssd width"},
    {"aux", ZPS_OPT_ENUM, F(aux), .names = s_aux, .help = "inception_v3 aux head"},
    {"bn-data", ZPS_OPT_STRING, F(bn_data), .meta = "DIR",
     .help = "recompute the batchnorm statistics from this training data\n"
             "(zps-trainer's --data; its train split), as the trainer feeds it"},
    {"bn-batches", ZPS_OPT_INT, F(bn_batches), 1, 1000000, .meta = "N",
     .help = "--bn-data: batches in training mode (their mean statistics)"},
    {"batch-size", ZPS_OPT_INT, F(bn_batch), 1, 65536, .meta = "B",
     .help = "--bn-data: images per batch"},
    ZPS_OPT_LOG_LEVEL,
    {.type = ZPS_OPT_END},
};
#undef F

static const zps_opts s_spec = {
    .prog = S_PROG,
    .usage = "usage: zps-ctl COMMAND [flags]\n"
             "  stats [--server I]    every server's STATS as JSON (one server's with --server)\n"
             "  checkpoint [--now]    every server writes a checkpoint (sync: at one version)\n"
             "  shutdown [--now]      every server writes its final checkpoint (sync: at one\n"
             "                        version) and exits 0; the trainers then end\n"
             "  export                merge the checkpoint shards of --ckpt-dir into --out\n"
             "Exit status: 0 done, 1 the fleet or the files said no, 2 usage.\n",
    .opt = s_table,
    .cfg_size = sizeof(args),
    .defaults = s_defaults,
    .max_args = 1,
};

/* ------------------------------------------------------------------------- the fleet */

typedef struct fleet {
    ps_client *c;
    int n;
    char **uris; // (n)
} fleet;

static void s_fleet_free(fleet *f)
{
    ps_client_destroy(&f->c);
    zps_uris_free(&f->uris, &f->n);
}

/* The servers' URIs from --cluster or --servers (HOST:PORT gets tcp://). */
static int s_uris(const args *a, fleet *f)
{
    zps_parse_error err;
    int n_trainers;
    if (zps_cluster_server_uris(a->cluster, a->servers, &f->uris, &f->n, &n_trainers, &err) !=
        ZPS_OK) {
        char why[sizeof err.msg + 600];
        if (a->cluster[0])
            fprintf(stderr, S_PROG ": %s\n",
                    zps_cluster_error(a->cluster, &err, why, sizeof why));
        else
            fprintf(stderr, S_PROG ": --servers %s\n", err.msg);
        return 1;
    }
    if (!f->n) {
        fprintf(stderr, S_PROG ": %s names no server\n", a->cluster);
        return 1;
    }
    return 0;
}

/* The client every fleet command talks through: no trainer, no heartbeats, no resends
 * (a resent CHECKPOINT would be a second one), one deadline for everything. */
static int s_connect(const args *a, fleet *f)
{
    if (s_uris(a, f))
        return 1;
    ps_client_opts o;
    ps_client_opts_default(&o);
    o.timeout_ms = (int)(a->timeout_s * 1000);
    o.max_retries = 0;
    o.heartbeat_ms = 0;
    char why[1200];
    if (a->key[0] && ps_client_opts_curve(&o, a->server_key, a->key, why, sizeof why) != ZPS_OK) {
        fprintf(stderr, S_PROG ": %s\n", why);
        return 1;
    }
    zps_status st = ps_client_new((const char *const *)f->uris, f->n, PS_CLIENT_CTL_ID, &o, &f->c);
    explicit_bzero(o.curve_secret_key, sizeof o.curve_secret_key);
    if (st != ZPS_OK) {
        fprintf(stderr, S_PROG ": cannot connect to the servers: %s\n", zps_strerror(st));
        return 1;
    }
    ps_client_set_deadline(f->c, (int)(a->timeout_s * 1000));
    return 0;
}

static int s_fail(const fleet *f, const char *what, zps_status st)
{
    const char *m = ps_client_last_error(f->c);
    fprintf(stderr, S_PROG ": %s: %s%s%s\n", what, zps_strerror(st), *m ? ": " : "", m);
    return 1;
}

static int s_stats(const args *a, fleet *f)
{
    if (a->server >= f->n) {
        fprintf(stderr, S_PROG ": --server %d, but the fleet has %d servers\n", a->server, f->n);
        return 2;
    }
    int one = a->server >= 0;
    for (int i = one ? a->server : 0; i < (one ? a->server + 1 : f->n); i++) {
        char *json;
        zps_status st = ps_client_stats(f->c, i, &json);
        if (st != ZPS_OK)
            return s_fail(f, "STATS", st);
        printf("%s%s%s", one ? "" : i ? ",\n" : "[\n", json, one ? "\n" : "");
        free(json);
    }
    if (!one)
        printf("\n]\n");
    return 0;
}

/* One number or word of server i's STATS: the value after "key": (JSON from
 * ps_srv_stats_json: no spaces, no nesting before these keys). 1 (reported) on failure. */
static int s_stats_field(fleet *f, int i, const char *key, char *val, size_t len)
{
    char *json, pat[64];
    zps_status st = ps_client_stats(f->c, i, &json);
    if (st != ZPS_OK)
        return s_fail(f, "STATS", st);
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(json, pat);
    if (p) {
        p += strlen(pat) + (p[strlen(pat)] == '"');
        size_t k = strcspn(p, "\",}");
        snprintf(val, len, "%.*s", (int)k, p);
    } else {
        fprintf(stderr, S_PROG ": server %d's STATS has no \"%s\"\n", i, key);
    }
    free(json);
    return p ? 0 : 1;
}

/* sync: the cut every server can still reach, for CHECKPOINT or SHUTDOWN. Round 0 asks
 * for the newest version any server has; a server already past it (training moved on)
 * answers ZPS_ERR_STALE, and the next round asks for a later one: ahead of the newest by
 * twice what training did since the last ask, so that a fleet whose steps are shorter than
 * a round of asking (a small model on a loaded machine: it overtook 10 rounds in a row) is
 * met where it will be. A server keeps a cut it has not reached and answers on reaching it;
 * only an overtaken round, proof that training moves, asks ahead. */
static int s_cut(fleet *f, int shutdown, ps_client_answer *ans, uint64_t *at)
{
    const char *what = shutdown ? "SHUTDOWN" : "CHECKPOINT";
    uint64_t want = 0;
    for (int round = 0; round < S_CUT_ROUNDS; round++) {
        uint64_t top = 0;
        for (int i = 0; i < f->n; i++) {
            char v[32];
            if (s_stats_field(f, i, "version", v, sizeof v))
                return 1;
            uint64_t x = strtoull(v, NULL, 10);
            top = x > top ? x : top;
        }
        if (round) { /* overtaken: where training will be once this ask arrives */
            uint64_t from = top > want ? top : want;
            top = from + 2 * (top > want ? top - want : 1);
        }
        want = top;
        zps_status st = ps_client_admin(f->c, shutdown, 1, want, ans);
        if (st == ZPS_OK) {
            *at = want;
            return 0;
        }
        if (st != ZPS_ERR_STALE)
            return s_fail(f, what, st);
        zps_log(ZPS_INFO, "ctl", "training overtook version %" PRIu64 ": asking for a later one", want);
    }
    fprintf(stderr, S_PROG ": %s: training overtook %d cuts in a row; try again\n", what,
            S_CUT_ROUNDS);
    return 1;
}

/* CHECKPOINT or SHUTDOWN: a cut in sync mode (unless --now), else at once everywhere. */
static int s_admin(const args *a, fleet *f, int shutdown)
{
    char mode[16];
    if (s_stats_field(f, 0, "mode", mode, sizeof mode))
        return 1;
    ps_client_answer *ans = zps_xcalloc((size_t)f->n, sizeof *ans);
    int cut = !strcmp(mode, "sync") && !a->now, rc;
    uint64_t at = 0;
    if (cut && shutdown) {
        /* Two phases, so that no server can end at another version than the rest: a
         * CHECKPOINT cut (harmless to retry while training overtakes it) fixes a version
         * every server has written, then SHUTDOWN at it; a server that trained on in
         * between ends with that cut's file (docs/ps.md "Admin ops"). */
        rc = s_cut(f, 0, ans, &at);
        if (!rc) {
            zps_status st = ps_client_admin(f->c, 1, 1, at, ans);
            rc = st != ZPS_OK ? s_fail(f, "SHUTDOWN", st) : 0;
        }
    } else if (cut) {
        rc = s_cut(f, 0, ans, &at);
    } else {
        zps_status st = ps_client_admin(f->c, shutdown, 0, 0, ans);
        rc = st != ZPS_OK ? s_fail(f, shutdown ? "SHUTDOWN" : "CHECKPOINT", st) : 0;
    }
    if (!rc && cut)
        printf("%s: version %" PRIu64 " on every server (sync: one consistent cut)\n",
               shutdown ? "shutdown" : "checkpoint", at);
    else if (!rc)
        printf("%s: %s\n", shutdown ? "shutdown" : "checkpoint",
               strcmp(mode, "sync") ? "each server at its own version (no common cut outside sync mode)"
                                    : "each server at its own version (--now: maybe not one cut)");
    for (int i = 0; !rc && i < f->n; i++)
        if (shutdown)
            printf("server %d: %s at version %" PRIu64 "\n", i, ans[i].msg, ans[i].version);
        else
            printf("server %d: %s\n", i, ans[i].msg);
    free(ans);
    return rc;
}

/* ------------------------------------------------------------------------- export */

/* The model the fleet trained, as zps-trainer builds it (trainer/train.c), for its tables;
 * on the cpu back-end when it will run (--bn-data). */
static int s_model(const args *a, nn_model **m)
{
    nn_model_opts mo;
    nn_model_opts_default(&mo, a->model);
    if (a->input_size)
        mo.in_size = a->input_size;
    if (a->in_channels)
        mo.in_channels = a->in_channels;
    else if (!strcmp(a->model, "inception_v3"))
        mo.in_channels = 1; /* zps-trainer's default: Fashion-MNIST is gray */
    mo.width = (float)a->width;
    mo.aux = a->aux;
    mo.classes = a->classes;
    const k_backend *be = a->bn_data[0] ? k_backend_cpu() : k_backend_ref();
    if (nn_model_create(be, &mo, m) != ZPS_OK) {
        fprintf(stderr, S_PROG ": cannot build model '%s' (see the log)\n", a->model);
        return 1;
    }
    return 0;
}

/* The shards' values laid out as the model's flat buffer, into *flat (the caller's). */
static int s_merge(const args *a, const ps_ckpt_set *set, nn_model *m, float **flat)
{
    size_t nv;
    const nn_var *vars = nn_model_vars(m, &nv);
    ps_var *pv = zps_xcalloc(nv, sizeof *pv);
    for (size_t i = 0; i < nv; i++)
        pv[i] = (ps_var){vars[i].name, vars[i].count};
    ps_plan *plan = NULL;
    char why[1200];
    zps_status st = ps_plan_new(pv, (int)nv, (int)set->n, set->shards[0].chunk_bytes, &plan);
    free(pv);
    if (st != ZPS_OK) {
        fprintf(stderr, S_PROG ": cannot plan model '%s': %s\n", a->model, zps_strerror(st));
        return 1;
    }
    *flat = zps_xcalloc(plan->total, sizeof **flat);
    st = ps_ckpt_set_merge(set, plan, *flat, why, sizeof why);
    ps_plan_destroy(&plan);
    if (st != ZPS_OK) {
        fprintf(stderr, S_PROG ": %s: %s (is --model %s, with the trainer's model flags, what "
                "the fleet trained?)\n", a->ckpt_dir, why, a->model);
        return 1;
    }
    return 0;
}

static zps_status s_bn_next(void *ctx, float *x, int32_t *labels, int n)
{
    (void)n; /* the pipeline's batch */
    return ds_pipeline_next(ctx, x, labels, NULL);
}

/* --bn-data: the merged values into m, then the statistics from training batches fed as
 * zps-trainer feeds them (tr_input_opts: its train split, shuffled with seed 1, at the
 * model's input size and channels, no augmentation). */
static int s_bn_recal(const args *a, nn_model *m, const float *flat)
{
    memcpy(nn_model_params(m), flat, nn_model_param_count(m) * sizeof *flat);
    ds_pipeline_opts po;
    int c, h, w;
    nn_model_input_shape(m, &c, &h, &w);
    tr_input_opts(&po, a->bn_data, "train", c, h, w);
    po.batch = a->bn_batch;
    po.num_classes = nn_model_classes(m);
    ds_pipeline *p = NULL;
    zps_status st = ds_pipeline_new(&po, &p);
    if (st != ZPS_OK) {
        fprintf(stderr, S_PROG ": --bn-data %s: %s (see the log)\n", a->bn_data, zps_strerror(st));
        return 1;
    }
    fprintf(stderr, S_PROG ": recomputing the batchnorm statistics from %d batches of %d of %s\n",
            a->bn_batches, a->bn_batch, a->bn_data);
    st = tr_bn_recalibrate(m, a->bn_batches, a->bn_batch, s_bn_next, p, stderr);
    ds_pipeline_destroy(&p);
    if (st != ZPS_OK) {
        fprintf(stderr, S_PROG ": batchnorm statistics from %s: %s\n", a->bn_data,
                zps_strerror(st));
        return 1;
    }
    return 0;
}

static int s_export(const args *a)
{
    ps_ckpt_set set;
    char why[1200];
    zps_status st = ps_ckpt_set_read(a->ckpt_dir, a->ckpt_version, &set, why, sizeof why);
    if (st != ZPS_OK) {
        fprintf(stderr, S_PROG ": export: %s\n", why);
        return 1;
    }
    nn_model *m = NULL;
    float *flat = NULL;
    int rc = s_model(a, &m) || s_merge(a, &set, m, &flat);
    size_t nv, ns;
    const nn_var *vars = m ? nn_model_vars(m, &nv) : NULL;
    const nn_var *stats = m ? nn_model_stats(m, &ns) : NULL;
    if (!rc && a->bn_data[0] && ns)
        rc = s_bn_recal(a, m, flat);
    else if (!rc && a->bn_data[0])
        zps_log(ZPS_WARN, "ctl", "model %s has no batchnorm: --bn-data %s not read", a->model,
                a->bn_data);
    if (!rc && nn_weights_write_as((nn_weights_format)a->format, a->out, vars, nv, flat, stats,
                                   ns, nn_model_statbuf(m)) != ZPS_OK) {
        fprintf(stderr, S_PROG ": cannot write %s (see the log)\n", a->out);
        rc = 1;
    }
    if (!rc) {
        printf("wrote %s: model %s, %zu variables, %zu values, version %" PRIu64 "%s, from %u "
               "shards in %s\n", a->out, a->model, nv, nn_model_param_count(m), set.version_max,
               set.version_min != set.version_max ? " (async/ssp: chunks from older versions too)" : "",
               set.n, a->ckpt_dir);
        if (ns && a->bn_data[0])
            printf("batchnorm statistics (%zu) recomputed from %d batches of %d of %s\n", ns,
                   a->bn_batches, a->bn_batch, a->bn_data);
        else if (ns)
            zps_log(ZPS_WARN, "ctl", "model %s has %zu batchnorm statistics; they live in the "
                    "trainers, not on the servers, so %s holds their initial values and will not "
                    "evaluate as trained: recompute them with --bn-data DIR (the training data)",
                    a->model, ns, a->out);
    }
    free(flat);
    nn_model_destroy(&m);
    ps_ckpt_set_free(&set);
    return rc;
}

/* ------------------------------------------------------------------------- main */

static int s_usage_check(const args *a, const char *cmd, int *code)
{
    int fleet_cmd = strcmp(cmd, "export") != 0;
    if (strcmp(cmd, "stats") && strcmp(cmd, "checkpoint") && strcmp(cmd, "shutdown") && fleet_cmd)
        return zps_opts_fail(&s_spec, code, "unknown command '%s' (stats, checkpoint, shutdown, "
                             "export)", cmd) != ZPS_OK;
    if (fleet_cmd && !a->cluster[0] == !a->servers[0])
        return zps_opts_fail(&s_spec, code, "%s needs --cluster FILE or --servers HOST:PORT,... "
                             "(one of them)", cmd) != ZPS_OK;
    if (fleet_cmd && !a->key[0] != !a->server_key[0])
        return zps_opts_fail(&s_spec, code, "--curve-key and --curve-server-key go together") != ZPS_OK;
    if (!fleet_cmd && (!a->ckpt_dir[0] || !a->out[0]))
        return zps_opts_fail(&s_spec, code, "export needs --ckpt-dir DIR and --out FILE") != ZPS_OK;
    if (fleet_cmd && a->bn_data[0])
        return zps_opts_fail(&s_spec, code, "--bn-data is for export") != ZPS_OK;
    if (a->server >= 0 && strcmp(cmd, "stats"))
        return zps_opts_fail(&s_spec, code, "--server is for stats") != ZPS_OK;
    if (a->now && (!fleet_cmd || !strcmp(cmd, "stats")))
        return zps_opts_fail(&s_spec, code, "--now is for checkpoint and shutdown") != ZPS_OK;
    return 0;
}

int main(int argc, char **argv)
{
    args a;
    s_defaults(&a);
    zps_log_init("ctl", -1);
    int first, code;
    if (zps_opts_parse(&s_spec, &a, argc, argv, &first, &code) != ZPS_OK || code >= 0)
        return code;
    if (first >= argc) {
        zps_opts_fail(&s_spec, &code, "no command (stats, checkpoint, shutdown or export)");
        return code;
    }
    const char *cmd = argv[first];
    if (s_usage_check(&a, cmd, &code))
        return code;
    if (!strcmp(cmd, "export"))
        return s_export(&a);
    fleet f = {0};
    int rc = s_connect(&a, &f);
    if (!rc && !strcmp(cmd, "stats"))
        rc = s_stats(&a, &f);
    else if (!rc)
        rc = s_admin(&a, &f, !strcmp(cmd, "shutdown"));
    s_fleet_free(&f);
    return rc;
}
