/* server_main.c — zps-server: parses flags, binds, serves until SHUTDOWN or a signal.
 * Flags are documented in docs/ps.md and by --help. Prints
 *     zps-server listening on tcp://HOST:PORT
 * on stdout (flushed) once bound, so scripts and tests can learn an ephemeral port.
 * `zps-server --keygen PREFIX` only writes a CURVE key pair (ps/curve.h) and exits. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"
#include "common/cluster.h"
#include "common/log.h"
#include "ps/curve.h"
#include "ps/server.h"

static ps_server *s_srv;

static void s_on_signal(int sig)
{
    (void)sig;
    if (s_srv)
        ps_server_stop(s_srv);
}

static void s_usage(FILE *f)
{
    fprintf(f,
            "usage: zps-server (--bind tcp://HOST:PORT | --cluster FILE --index I) [options]\n"
            "  --bind URI                 endpoint to bind; port 0 or * = ephemeral (default tcp://127.0.0.1:0)\n"
            "  --cluster FILE --index I   bind the HOST:PORT of server I in the cluster file\n"
            "  --index I                  server index (with --bind: names the checkpoint file; default 0)\n"
            "  --mode sync|async|ssp      consistency mode (default: from the first REGISTER, else sync)\n"
            "  --num-trainers N           trainers in the job (default: from REGISTER)\n"
            "  --replicas-to-aggregate R  sync: gradients averaged per step (default N; extra = backup)\n"
            "  --staleness S              ssp: bound on clock difference (default: from REGISTER)\n"
            "  --trainer-timeout SEC      drop a trainer silent this long from the expected set (0 = never)\n"
            "  --checkpoint-dir DIR       where DIR/server-I.ckpt is written\n"
            "  --checkpoint-every-versions K   checkpoint when the version advanced by K\n"
            "  --checkpoint-every-seconds S    checkpoint every S seconds\n"
            "  --restore                  load DIR/server-I.ckpt at start when it exists\n"
            "  --allow-reinit             accept a second INIT (replaces values, resets versions)\n"
            "  --max-message-bytes B      payload limit per request (default 1073741824)\n"
            "  --stats-every SEC          periodic one-line stats log (default 30, 0 = off)\n"
            "  --io-threads N             ZeroMQ I/O threads: connections are spread over them (default 1)\n"
            "  --log-level trace|debug|info|warn|error|off\n"
            "security (CURVE authentication and encryption; docs/ps.md \"Security\"):\n"
            "  --curve-key FILE           this server's key pair (from --keygen): clients must use CURVE\n"
            "  --curve-allow FILE         trainer public keys admitted, one Z85 key per line (# comments);\n"
            "                             'KEY trainer=N' lets that key speak for trainer N only\n"
            "  --curve-allow-any          admit any trainer key instead (encrypted, not authenticated)\n"
            "  --keygen PREFIX            write a new key pair to PREFIX.key (mode 0600) and its public\n"
            "                             key to PREFIX.pub, then exit; never overwrites\n"
            "  --help\n");
}

/* 1 for tcp://127.x.x.x:P, tcp://[::1]:P, tcp://localhost:P and non-tcp endpoints. */
static int s_loopback(const char *ep)
{
    if (strncmp(ep, "tcp://", 6) != 0)
        return 1;
    ep += 6;
    return !strncmp(ep, "127.", 4) || !strncmp(ep, "[::1]:", 6) || !strncmp(ep, "localhost:", 10);
}

static int s_num(const char *flag, const char *v, double lo, double hi, double *out)
{
    char *end;
    double d = strtod(v, &end);
    if (!*v || *end || !(d >= lo && d <= hi)) {
        fprintf(stderr, "zps-server: bad value '%s' for %s (want %g..%g)\n", v, flag, lo, hi);
        return 0;
    }
    *out = d;
    return 1;
}

int main(int argc, char **argv)
{
    ps_server_config cfg;
    ps_server_config_default(&cfg);
    const char *cluster = NULL, *bind = NULL;
    int index = -1;
    enum { O_BIND = 256, O_CLUSTER, O_INDEX, O_MODE, O_NT, O_R, O_S, O_TO, O_CD, O_CEV, O_CES,
           O_RESTORE, O_REINIT, O_MAX, O_STATS, O_LOG, O_IO, O_HELP, O_CKEY, O_CALLOW, O_CANY,
           O_KEYGEN };
    static const struct option opts[] = {
        {"bind", required_argument, 0, O_BIND},
        {"cluster", required_argument, 0, O_CLUSTER},
        {"index", required_argument, 0, O_INDEX},
        {"mode", required_argument, 0, O_MODE},
        {"num-trainers", required_argument, 0, O_NT},
        {"replicas-to-aggregate", required_argument, 0, O_R},
        {"staleness", required_argument, 0, O_S},
        {"trainer-timeout", required_argument, 0, O_TO},
        {"checkpoint-dir", required_argument, 0, O_CD},
        {"checkpoint-every-versions", required_argument, 0, O_CEV},
        {"checkpoint-every-seconds", required_argument, 0, O_CES},
        {"restore", no_argument, 0, O_RESTORE},
        {"allow-reinit", no_argument, 0, O_REINIT},
        {"max-message-bytes", required_argument, 0, O_MAX},
        {"stats-every", required_argument, 0, O_STATS},
        {"io-threads", required_argument, 0, O_IO},
        {"log-level", required_argument, 0, O_LOG},
        {"help", no_argument, 0, O_HELP},
        {"curve-key", required_argument, 0, O_CKEY},
        {"curve-allow", required_argument, 0, O_CALLOW},
        {"curve-allow-any", no_argument, 0, O_CANY},
        {"keygen", required_argument, 0, O_KEYGEN},
        {0, 0, 0, 0}};
    const char *keygen = NULL;
    int c;
    double d;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case O_BIND:
            bind = optarg;
            break;
        case O_CLUSTER:
            cluster = optarg;
            break;
        case O_INDEX:
            if (!s_num("--index", optarg, 0, 65535, &d))
                return 2;
            index = (int)d;
            break;
        case O_MODE:
            if (!strcmp(optarg, "sync"))
                cfg.mode = PS_MODE_SYNC;
            else if (!strcmp(optarg, "async"))
                cfg.mode = PS_MODE_ASYNC;
            else if (!strcmp(optarg, "ssp"))
                cfg.mode = PS_MODE_SSP;
            else {
                fprintf(stderr, "zps-server: --mode must be sync, async or ssp\n");
                return 2;
            }
            break;
        case O_NT:
            if (!s_num("--num-trainers", optarg, 1, PS_MAX_TRAINERS, &d))
                return 2;
            cfg.num_trainers = (uint32_t)d;
            break;
        case O_R:
            if (!s_num("--replicas-to-aggregate", optarg, 1, PS_MAX_TRAINERS, &d))
                return 2;
            cfg.replicas_to_aggregate = (uint32_t)d;
            break;
        case O_S:
            if (!s_num("--staleness", optarg, 0, 1e6, &d))
                return 2;
            cfg.staleness = (int)d;
            break;
        case O_TO:
            if (!s_num("--trainer-timeout", optarg, 0, 1e7, &cfg.trainer_timeout_s))
                return 2;
            break;
        case O_CD:
            snprintf(cfg.checkpoint_dir, sizeof cfg.checkpoint_dir, "%s", optarg);
            break;
        case O_CEV:
            if (!s_num("--checkpoint-every-versions", optarg, 0, 1e15, &d))
                return 2;
            cfg.checkpoint_every_versions = (uint64_t)d;
            break;
        case O_CES:
            if (!s_num("--checkpoint-every-seconds", optarg, 0, 1e9, &cfg.checkpoint_every_seconds))
                return 2;
            break;
        case O_RESTORE:
            cfg.restore = 1;
            break;
        case O_REINIT:
            cfg.allow_reinit = 1;
            break;
        case O_MAX:
            if (!s_num("--max-message-bytes", optarg, 4, 64e9, &d))
                return 2;
            cfg.max_message_bytes = (uint64_t)d;
            break;
        case O_STATS:
            if (!s_num("--stats-every", optarg, 0, 1e9, &cfg.stats_every_s))
                return 2;
            break;
        case O_IO:
            if (!s_num("--io-threads", optarg, 1, 16, &d))
                return 2;
            cfg.io_threads = (int)d;
            break;
        case O_LOG:
            if (zps_log_set_level_str(optarg) != ZPS_OK) {
                fprintf(stderr, "zps-server: bad --log-level '%s'\n", optarg);
                return 2;
            }
            break;
        case O_CKEY:
        case O_CALLOW:
            if (strlen(optarg) >= sizeof cfg.curve_key) {
                fprintf(stderr, "zps-server: %s path is too long\n", c == O_CKEY ? "--curve-key" : "--curve-allow");
                return 2;
            }
            snprintf(c == O_CKEY ? cfg.curve_key : cfg.curve_allow, sizeof cfg.curve_key, "%s", optarg);
            break;
        case O_CANY:
            cfg.curve_allow_any = 1;
            break;
        case O_KEYGEN:
            keygen = optarg;
            break;
        case O_HELP:
        case 'h':
            s_usage(stdout);
            return 0;
        default:
            s_usage(stderr);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "zps-server: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (keygen) {
        char why[4200];
        zps_status st = ps_curve_keygen(keygen, why, sizeof why);
        if (st != ZPS_OK) {
            fprintf(stderr, "zps-server: --keygen: %s\n", why);
            return 1;
        }
        printf("zps-server: wrote %s.key (key pair, mode 0600: keep it secret) and %s.pub "
               "(public key)\n", keygen, keygen);
        return 0;
    }
    if (cfg.curve_key[0] && !cfg.curve_allow[0] && !cfg.curve_allow_any) {
        fprintf(stderr, "zps-server: --curve-key needs --curve-allow FILE (the trainers' public "
                        "keys), or --curve-allow-any to admit any key\n");
        return 2;
    }
    if (cfg.curve_allow[0] && cfg.curve_allow_any) {
        fprintf(stderr, "zps-server: give --curve-allow or --curve-allow-any, not both\n");
        return 2;
    }
    if (!cfg.curve_key[0] && (cfg.curve_allow[0] || cfg.curve_allow_any)) {
        fprintf(stderr, "zps-server: --curve-allow and --curve-allow-any need --curve-key FILE\n");
        return 2;
    }
    if (cluster && bind) {
        fprintf(stderr, "zps-server: give --bind or --cluster, not both\n");
        return 2;
    }
    if (cluster) {
        if (index < 0) {
            fprintf(stderr, "zps-server: --cluster needs --index\n");
            return 2;
        }
        zps_cluster *cl = NULL;
        zps_parse_error err = {0};
        zps_status st = zps_cluster_load(cluster, &cl, &err);
        if (st != ZPS_OK) {
            fprintf(stderr, "zps-server: %s:%d: %s\n", cluster, err.line,
                    err.msg[0] ? err.msg : zps_strerror(st));
            return 2;
        }
        if (index >= cl->n_servers) {
            fprintf(stderr, "zps-server: --index %d but %s lists %d servers\n", index, cluster,
                    cl->n_servers);
            zps_cluster_destroy(&cl);
            return 2;
        }
        zps_endpoint_uri(&cl->servers[index], cfg.bind, sizeof cfg.bind);
        if (cfg.num_trainers == 0)
            cfg.num_trainers = (uint32_t)cl->n_trainers;
        zps_cluster_destroy(&cl);
    } else if (bind) {
        snprintf(cfg.bind, sizeof cfg.bind, "%s", bind);
    }
    cfg.index = index < 0 ? 0 : index;
    cfg.check_index = index >= 0;
    zps_log_init("server", cfg.index);
    zps_malloc_keep_warm();

    zps_status st = ps_server_new(&cfg, &s_srv);
    if (st != ZPS_OK) {
        fprintf(stderr, "zps-server: cannot start: %s\n", zps_strerror(st));
        return 1;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = s_on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    printf("zps-server listening on %s\n", ps_server_endpoint(s_srv));
    fflush(stdout);
    zps_log(ZPS_INFO, "ps", "listening on %s%s", ps_server_endpoint(s_srv),
            cfg.curve_key[0] ? " (CURVE)" : "");
    if (!cfg.curve_key[0] && !s_loopback(ps_server_endpoint(s_srv)))
        zps_log(ZPS_WARN, "ps", "listening beyond this machine without CURVE: anyone who can "
                "reach %s can read and change the model (see --curve-key)",
                ps_server_endpoint(s_srv));
    st = ps_server_run(s_srv);
    ps_server_destroy(&s_srv);
    if (st != ZPS_OK) {
        fprintf(stderr, "zps-server: %s\n", zps_strerror(st));
        return 1;
    }
    return 0;
}
