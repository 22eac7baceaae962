/* server_main.c — zps-server: parses flags, binds, serves until SHUTDOWN or a signal.
 * SIGTERM and SIGINT (what zps-launch sends) stop it gracefully: pending requests are
 * answered, a final checkpoint is written when --checkpoint-dir is set, and it exits 0 (1
 * when that checkpoint fails). A second signal changes nothing; SIGKILL is the hard stop.
 * The flags are parsed by ps/server_config.c (documented in docs/ps.md and by --help). Prints
 *     zps-server listening on tcp://HOST:PORT
 * on stdout (flushed) once bound, so scripts and tests can learn an ephemeral port.
 * `zps-server --keygen PREFIX` only writes a CURVE key pair (ps/curve.h) and exits. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"
#include "common/log.h"
#include "common/net.h"
#include "ps/curve.h"
#include "ps/server.h"
#include "ps/server_config.h"

static ps_server *s_srv;

static void s_on_signal(int sig)
{
    (void)sig;
    if (s_srv)
        ps_server_stop(s_srv);
}

static int s_keygen(const char *prefix)
{
    char why[4200];
    if (ps_curve_keygen(prefix, why, sizeof why) != ZPS_OK) {
        fprintf(stderr, "zps-server: --keygen: %s\n", why);
        return 1;
    }
    printf("zps-server: wrote %s.key (key pair, mode 0600: keep it secret) and %s.pub "
           "(public key)\n", prefix, prefix);
    return 0;
}

int main(int argc, char **argv)
{
    /* before the flags: what parsing logs is the server's, and --log-level beats $ZPS_LOG */
    zps_log_init("server", -1);
    ps_server_config cfg;
    ps_server_config_default(&cfg);
    const char *keygen;
    int code;
    if (ps_server_config_parse(&cfg, argc, argv, &keygen, &code) != ZPS_OK || code >= 0)
        return code;
    if (keygen)
        return s_keygen(keygen);
    zps_log_set_role("server", cfg.index);
    zps_malloc_keep_warm();

    zps_status st = ps_server_new(&cfg, &s_srv);
    if (st != ZPS_OK) {
        zps_log_failure("zps-server", st, "cannot start");
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
    if (!cfg.curve_key[0] && !zps_net_endpoint_loopback(ps_server_endpoint(s_srv)))
        zps_log(ZPS_WARN, "ps", "listening beyond this machine without CURVE: anyone who can "
                "reach %s can read and change the model (see --curve-key)",
                ps_server_endpoint(s_srv));
    st = ps_server_run(s_srv);
    ps_server_destroy(&s_srv);
    if (st != ZPS_OK) {
        zps_log_failure("zps-server", st, "stopped");
        return 1;
    }
    return 0;
}
