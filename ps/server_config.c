/* server_config.c — zps-server's flag table and the checks across its flags (see
 * server_config.h). The flags that are not ps_server_config fields (--bind, --cluster,
 * --index, --keygen) land in s_flags first: --cluster and --bind exclude each other, and
 * --index is -1 until given, which is how the server knows REGISTER must match it. */
#include "ps/server_config.h"

#include <stdio.h>
#include <string.h>

#include "common/cluster.h"
#include "ps/apply_pool.h"

const zps_opt_name ps_mode_names[] = {
    {"sync", PS_MODE_SYNC}, {"async", PS_MODE_ASYNC}, {"ssp", PS_MODE_SSP}, {NULL, 0}};

typedef struct s_flags {
    ps_server_config cfg;
    const char *bind;    // --bind URI (NULL: the engine's default, or --cluster's)
    const char *cluster; // --cluster FILE
    const char *keygen;  // --keygen PREFIX
    int index;           // --index I; -1: not given
} s_flags;

static void s_defaults(void *p)
{
    s_flags *f = p;
    memset(f, 0, sizeof *f);
    ps_server_config_default(&f->cfg);
    f->bind = f->cfg.bind; /* for the help only: the engine's default address */
    f->index = -1;
}

#define F(field) ZPS_OPT_FIELD(s_flags, field)

static const zps_opt s_opt[] = {
    {"bind", ZPS_OPT_ARG, F(bind), .meta = "URI",
     .help = "endpoint to bind; port 0 or * = ephemeral"},
    {"cluster", ZPS_OPT_ARG, F(cluster), .meta = "FILE",
     .help = "with --index I: bind server I's HOST:PORT in the cluster file\n"
             "(docs/cluster.md); --num-trainers then defaults to its trainers"},
    {"index", ZPS_OPT_INT, F(index), 0, 65535, .meta = "I",
     .dflt = "0, not checked against REGISTER",
     .help = "server index: names the checkpoint file; REGISTER must match it"},
    {"mode", ZPS_OPT_ENUM, F(cfg.mode), .names = ps_mode_names,
     .dflt = "from the first REGISTER, else sync", .help = "consistency mode"},
    {"num-trainers", ZPS_OPT_UINT, F(cfg.num_trainers), 1, PS_MAX_TRAINERS, .meta = "N",
     .dflt = "from REGISTER", .help = "trainers in the job"},
    {"replicas-to-aggregate", ZPS_OPT_UINT, F(cfg.replicas_to_aggregate), 1, PS_MAX_TRAINERS,
     .meta = "R", .dflt = "N", .help = "sync: gradients averaged per step (the other N - R: backups)"},
    {"staleness", ZPS_OPT_INT, F(cfg.staleness), 0, 1e6, .meta = "S", .dflt = "from REGISTER",
     .help = "ssp: bound on clock difference"},
    {"trainer-timeout", ZPS_OPT_DOUBLE, F(cfg.trainer_timeout_s), 0, 1e7, .meta = "SEC",
     .help = "drop a trainer silent this long from the expected set; 0 = never"},
    {"checkpoint-dir", ZPS_OPT_STRING, F(cfg.checkpoint_dir), .meta = "DIR",
     .help = "where DIR/server-I.ckpt is written"},
    {"checkpoint-every-versions", ZPS_OPT_UINT, F(cfg.checkpoint_every_versions), 0, 1e15,
     .meta = "K", .help = "checkpoint when the version advanced by K; 0 = off"},
    {"checkpoint-every-seconds", ZPS_OPT_DOUBLE, F(cfg.checkpoint_every_seconds), 0, 1e9,
     .meta = "S", .help = "checkpoint every S seconds; 0 = off"},
    {"restore", ZPS_OPT_SET, F(cfg.restore), .help = "load DIR/server-I.ckpt at start when it exists"},
    {"allow-reinit", ZPS_OPT_SET, F(cfg.allow_reinit),
     .help = "accept a second INIT (replaces values, resets versions)"},
    {"max-message-bytes", ZPS_OPT_UINT, F(cfg.max_message_bytes), 4, 64e9, .meta = "B",
     .help = "payload limit per request"},
    {"stats-every", ZPS_OPT_DOUBLE, F(cfg.stats_every_s), 0, 1e9, .meta = "SEC",
     .help = "periodic one-line stats log; 0 = off"},
    {"metrics", ZPS_OPT_STRING, F(cfg.metrics), .meta = "FILE",
     .help = "JSON Lines: a start record, the STATS counters every\n"
             "--metrics-every seconds, an end record (docs/ps.md \"Metrics file\")"},
    {"metrics-every", ZPS_OPT_DOUBLE, F(cfg.metrics_every_s), 0.01, 1e9, .meta = "SEC",
     .help = "seconds between the --metrics records"},
    {"io-threads", ZPS_OPT_INT, F(cfg.io_threads), 1, 16, .meta = "N",
     .help = "ZeroMQ I/O threads: connections are spread over them"},
    {"apply-threads", ZPS_OPT_INT, F(cfg.apply_threads), 1, PS_APPLY_MAX_THREADS, .meta = "N",
     .help = "threads of one optimizer update: a chunk of 64 Ki floats or\n"
             "more is cut over them (requests are still handled one at a\n"
             "time); try 2-4 where cores idle, e.g. beside a GPU trainer\n"
             "(docs/ps.md \"Threads\")"},
    {"no-shm", ZPS_OPT_CLEAR, F(cfg.shm),
     .help = "never offer shared memory to trainers on this host: every\n"
             "payload goes through ZeroMQ (docs/ps.md \"Shared memory\")"},
    ZPS_OPT_LOG_LEVEL,
    {.type = ZPS_OPT_TEXT, .help = "security (CURVE authentication and encryption; docs/ps.md \"Security\"):"},
    {"curve-key", ZPS_OPT_STRING, F(cfg.curve_key), .meta = "FILE",
     .help = "this server's key pair (from --keygen): clients must use CURVE"},
    {"curve-allow", ZPS_OPT_STRING, F(cfg.curve_allow), .meta = "FILE",
     .help = "trainer public keys admitted, one Z85 key per line (# comments);\n"
             "'KEY trainer=N' lets that key speak for trainer N only;\n"
             "'KEY admin' makes it an operator's (zps-ctl checkpoint, shutdown)"},
    {"curve-allow-any", ZPS_OPT_SET, F(cfg.curve_allow_any),
     .help = "admit any trainer key instead (encrypted, not authenticated)"},
    {"keygen", ZPS_OPT_ARG, F(keygen), .meta = "PREFIX",
     .help = "write a new key pair to PREFIX.key (mode 0600) and its public\n"
             "key to PREFIX.pub, then exit; never overwrites"},
    {.type = ZPS_OPT_END},
};

#undef F

static const zps_opts s_spec = {
    .prog = "zps-server",
    .usage = "usage: zps-server (--bind tcp://HOST:PORT | --cluster FILE --index I) [options]\n",
    .opt = s_opt,
    .cfg_size = sizeof(s_flags),
    .defaults = s_defaults,
};

static zps_status s_check_curve(const ps_server_config *c, int *exit_code)
{
    if (c->curve_key[0] && !c->curve_allow[0] && !c->curve_allow_any)
        return zps_opts_fail(&s_spec, exit_code,
                             "--curve-key needs --curve-allow FILE (the trainers' public keys), "
                             "or --curve-allow-any to admit any key");
    if (c->curve_allow[0] && c->curve_allow_any)
        return zps_opts_fail(&s_spec, exit_code,
                             "give --curve-allow or --curve-allow-any, not both");
    if (!c->curve_key[0] && (c->curve_allow[0] || c->curve_allow_any))
        return zps_opts_fail(&s_spec, exit_code,
                             "--curve-allow and --curve-allow-any need --curve-key FILE");
    return ZPS_OK;
}

/* --cluster FILE --index I: server I's address, and the file's trainer count unless given. */
static zps_status s_from_cluster(s_flags *f, int *exit_code)
{
    if (f->index < 0)
        return zps_opts_fail(&s_spec, exit_code, "--cluster needs --index");
    zps_cluster *cl = NULL;
    zps_parse_error err = {0};
    zps_status st = zps_cluster_load(f->cluster, &cl, &err);
    char why[sizeof err.msg + 600];
    if (st != ZPS_OK)
        return zps_opts_fail(&s_spec, exit_code, "%s",
                             zps_cluster_error(f->cluster, &err, why, sizeof why));
    if (f->index >= cl->n_servers) {
        st = zps_opts_fail(&s_spec, exit_code, "--index %d but %s lists %d servers", f->index,
                           f->cluster, cl->n_servers);
    } else {
        zps_endpoint_uri(&cl->servers[f->index], f->cfg.bind, sizeof f->cfg.bind);
        if (f->cfg.num_trainers == 0)
            f->cfg.num_trainers = (uint32_t)cl->n_trainers;
    }
    zps_cluster_destroy(&cl);
    return st;
}

zps_status ps_server_config_parse(ps_server_config *cfg, int argc, char **argv,
                                  const char **keygen, int *exit_code)
{
    s_flags f = {.cfg = *cfg, .index = -1};
    int first;
    *keygen = NULL;
    zps_status st = zps_opts_parse(&s_spec, &f, argc, argv, &first, exit_code);
    if (st != ZPS_OK || *exit_code >= 0)
        return st;
    if (f.keygen) {
        *keygen = f.keygen;
        return ZPS_OK;
    }
    if ((st = s_check_curve(&f.cfg, exit_code)) != ZPS_OK)
        return st;
    if (f.cluster && f.bind)
        return zps_opts_fail(&s_spec, exit_code, "give --bind or --cluster, not both");
    if (f.cluster && (st = s_from_cluster(&f, exit_code)) != ZPS_OK)
        return st;
    if (f.bind && strlen(f.bind) >= sizeof f.cfg.bind)
        return zps_opts_fail(&s_spec, exit_code, "--bind value is longer than %zu characters",
                             sizeof f.cfg.bind - 1);
    if (f.bind)
        snprintf(f.cfg.bind, sizeof f.cfg.bind, "%s", f.bind);
    f.cfg.index = f.index < 0 ? 0 : f.index;
    f.cfg.check_index = f.index >= 0;
    *cfg = f.cfg;
    return ZPS_OK;
}

void ps_server_config_json(const ps_server_config *cfg, zps_json *j)
{
    s_flags f;
    memset(&f, 0, sizeof f);
    f.cfg = *cfg;
    f.bind = cfg->bind;
    f.index = cfg->index;
    zps_opts_json(&s_spec, &f, j);
}
