/* test_launch.c — scripts/zps-launch driven with stand-in binaries (small shell scripts put in
 * a temporary --bin-dir): normal completion and the summary table, the first failure stopping
 * every other process (their PIDs verified gone), exit codes (failure, death by signal,
 * missing binary, usage, timeout, Ctrl-C), and the ssh launcher through a stand-in ssh that
 * runs the "remote" command in another session, as a real remote host would.
 *
 * The runner is in test_launch_util.c; the supervision tests in test_launch_sup.c. Processes
 * that are not our children (the stand-in ssh's "remote" side) are awaited with pidfd +
 * poll, bounded.
 *
 * scripts/compare is tested here too: its table, JSON and plot on metrics files written by
 * trainer/metrics.c itself (so the two agree on the format), and a run of fleets through
 * zps-launch with a stand-in trainer that writes metrics where --metrics says.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/version.h"
#include "tests/launch_test_util.h"
#include "tests/testutil.h"
#include "trainer/metrics.h"

Test(it_launch, normal_completion_and_summary, .timeout = 30)
{
    lt_run r;
    lt_setup(&r, 1);
    const char *args[] = {"--servers", "2", "--trainers", "3", "--job", "ok-job", "--run-dir",
                          "run", "--trainer-args", "--extra {index} --n {n_trainers}", NULL};
    lt_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_eq(r.n_pids, 5, "%s", r.out);
    cr_assert(strstr(r.out, "role     index  host       pid"), "summary header:\n%s", r.out);
    for (int i = 0; i < 3; i++)
        cr_assert_str_eq(lt_row_status(&r, "trainer", i), "ok", "%s", r.out);
    for (int i = 0; i < 2; i++)
        cr_assert_str_eq(lt_row_status(&r, "server", i), "stopped", "%s", r.out);
    lt_assert_all_gone(&r);

    /* the cluster file: two distinct loopback ports, three trainers */
    char path[256], text[4096];
    snprintf(path, sizeof path, "%s/run/cluster.txt", r.dir);
    lt_read_file(path, text, sizeof text);
    int p0 = 0, p1 = 0, trainers = 0;
    const char *s1 = strstr(text, "server = 127.0.0.1:");
    cr_assert_not_null(s1, "%s", text);
    sscanf(s1, "server = 127.0.0.1:%d", &p0);
    const char *s2 = strstr(s1 + 1, "server = 127.0.0.1:");
    cr_assert_not_null(s2, "%s", text);
    sscanf(s2, "server = 127.0.0.1:%d", &p1);
    cr_assert(p0 > 0 && p1 > 0 && p0 != p1, "ports %d %d", p0, p1);
    for (const char *t = text; (t = strstr(t, "trainer = 127.0.0.1")); t++)
        trainers++;
    cr_assert_eq(trainers, 3);
    cr_assert(strstr(text, "job = ok-job"));

    /* the command line of trainer 2: cluster file, id and the pass-through arguments */
    snprintf(path, sizeof path, "%s/run/trainer-2.log", r.dir);
    lt_read_file(path, text, sizeof text);
    char want[512];
    snprintf(want, sizeof want, "--cluster %s/run/cluster.txt --trainer-id 2 --extra 2 --n 3",
             r.dir);
    cr_assert(strstr(text, want), "trainer-2.log: %s\nwant: %s", text, want);
    snprintf(path, sizeof path, "%s/run/summary.json", r.dir);
    cr_assert_eq(access(path, R_OK), 0, "summary.json");
    lt_cleanup(&r);
}

/* What the two tests below share: zpslaunch on the path (argv[1]), its port helpers, and
 * taken(port), 1 when a bind of 127.0.0.1:port is refused as in use. */
static const char s_py_prelude[] =
    "import errno, os, socket, sys, types\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from zpslaunch.cluster import hold_free_ports\n"
    "from zpslaunch.proc import Proc\n"
    "from zpslaunch.process import start\n"
    "from zpslaunch.supervise import Supervisor\n"
    "def taken(port):\n"
    "    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
    "    try:\n"
    "        t.bind(('127.0.0.1', port))\n"
    "        return False\n"
    "    except OSError as e:\n"
    "        assert e.errno == errno.EADDRINUSE, e\n"
    "        return True\n"
    "    finally:\n"
    "        t.close()\n";

/* Runs s_py_prelude then body in a python3, in r->dir; output in r->out, asserted exit 0. */
static void s_run_zpslaunch_py(lt_run *r, const char *body)
{
    char scripts[4096], *script = malloc(sizeof s_py_prelude + strlen(body));
    cr_assert_not_null(script);
    strcpy(script, s_py_prelude);
    strcat(script, body);
    const char *root = getenv("ZPS_ROOT");
    snprintf(scripts, sizeof scripts, "%s/scripts", root && *root ? root : ".");
    const char *argv[] = {"/usr/bin/python3", "-c", script, scripts, NULL};
    lt_exec(r, argv, 0, NULL);
    free(script);
    cr_assert_eq(r->code, 0, "%s", r->out);
}

/* The ports the launcher picks stay bound by it until their own server starts: no other
 * bind (and no connect()'s ephemeral port) can take one meanwhile, and starting the server
 * frees exactly its own. Driven through zpslaunch's own functions in a python3. */
Test(it_launch, picked_ports_are_held_until_their_server_starts, .timeout = 30)
{
    lt_run r;
    lt_setup(&r, 0);
    s_run_zpslaunch_py(&r,
        "held = hold_free_ports(3)\n"
        "ports = [s.getsockname()[1] for s in held]\n"
        "assert len(set(ports)) == 3, ports\n"
        "print('held', [taken(p) for p in ports])\n"
        "p = Proc('server', 1, '127.0.0.1', ports[1], ['true'], 'server-1.log')\n"
        "p.held = held[1]\n"
        "start(p, dict(os.environ))\n"
        "_, status = os.waitpid(p.pid, 0)\n"
        "print('started', [taken(q) for q in ports], p.held, status)\n");
    cr_assert(strstr(r.out, "held [True, True, True]"), "%s", r.out);
    cr_assert(strstr(r.out, "started [True, False, True] None 0"), "%s", r.out);
    lt_cleanup(&r);
}

/* A server the launcher will restart gets its picked port held again while the restart is
 * due (the backoff can be seconds), and the restart frees it: the supervisor's own on_death
 * and process.start, on a stand-in server ("false") that dies at once. */
Test(it_launch, a_dead_servers_port_is_held_until_its_restart, .timeout = 30)
{
    lt_run r;
    lt_setup(&r, 0);
    s_run_zpslaunch_py(&r,
        "def run(p):\n"
        "    start(p, dict(os.environ))\n"
        "    _, p.status = os.waitpid(p.pid, 0)\n"
        "    p.end = p.start\n"
        "held = hold_free_ports(1)\n"
        "port = held[0].getsockname()[1]\n"
        "p = Proc('server', 0, '127.0.0.1', port, ['false'], 'server-0.log')\n"
        "p.held, p.own_port = held[0], True\n"
        "args = types.SimpleNamespace(timeout=0, restart_servers=2, restart_trainers=0,\n"
        "                             on_trainer_exit='stop', restart_backoff=5.0)\n"
        "sup = Supervisor([p], args, dict(os.environ), print)\n"
        "run(p)\n"
        "print('ran', taken(port))\n"
        "sup.on_death(p)\n"
        "print('down', taken(port), p.restart_at is not None)\n"
        "p.reset()\n"
        "run(p)\n"
        "print('restarted', taken(port), p.held)\n");
    cr_assert(strstr(r.out, "ran False"), "%s", r.out);
    cr_assert(strstr(r.out, "down True True"), "%s", r.out);
    cr_assert(strstr(r.out, "restarted False None"), "%s", r.out);
    cr_assert(strstr(r.out, "server 0 failed: exit 1"), "%s", r.out);
    lt_cleanup(&r);
}

/* --servers 0: an all-reduce fleet, trainers only; the real zps-trainer refuses such a
 * cluster file in a PS mode, naming the file. */
Test(it_launch, fleet_without_servers, .timeout = 30)
{
    lt_run r;
    lt_setup(&r, 1);
    const char *args[] = {"--servers", "0", "--trainers", "2", "--run-dir", "run", NULL};
    lt_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_eq(r.n_pids, 2, "%s", r.out);
    for (int i = 0; i < 2; i++)
        cr_assert_str_eq(lt_row_status(&r, "trainer", i), "ok", "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "server", 0), "", "a server row:\n%s", r.out);
    cr_assert(strstr(r.out, "0 server(s), 2 trainer(s)"), "%s", r.out);
    lt_assert_all_gone(&r);
    char path[256], text[4096];
    snprintf(path, sizeof path, "%s/run/cluster.txt", r.dir);
    lt_read_file(path, text, sizeof text);
    cr_assert_null(strstr(text, "server ="), "%s", text);

    const char *neg[] = {"--servers", "-1", "--trainers", "2", NULL};
    lt_launch(&r, 0, NULL, neg);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "--servers must be >= 0"), "%s", r.out);

    /* the real trainer with that cluster file */
    char *out, logp[300];
    snprintf(logp, sizeof logp, "%s/trainer.txt", r.dir);
    const char *targs[] = {"--mode", "async", "--cluster", path, "--trainer-id", "0", "--data",
                           "/nonexistent-zps-data", NULL}; // the servers are looked up first
    int code = zt_run("zps-trainer", targs, NULL, logp, 20, &out);
    cr_assert_neq(code, 0, "a PS trainer ran without servers:\n%s", out);
    cr_assert(strstr(out, "lists no server: --mode async needs at least one"), "%s", out);
    free(out);
    lt_cleanup(&r);
}

Test(it_launch, first_failure_stops_the_others, .timeout = 30)
{
    lt_run r;
    lt_setup(&r, 1);
    const char *args[] = {"--servers", "2", "--trainers", "3", "--run-dir", "run", "--grace",
                          "5", "--on-trainer-exit", "stop", "--trainer-args",
                          "--fail 1 --code 5 --hang", NULL};
    lt_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert_eq(r.n_pids, 5, "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 1), "exit 5", "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 0), "stopped", "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 2), "stopped", "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "server", 0), "stopped", "%s", r.out);
    cr_assert(strstr(r.out, "trainer 1 failed: exit 5"), "%s", r.out);
    lt_assert_all_gone(&r);
    lt_cleanup(&r);
}

Test(it_launch, exit_codes, .timeout = 40)
{
    lt_run r;
    /* death by a signal is a failure */
    lt_setup(&r, 1);
    const char *killed[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run1",
                            "--trainer-args", "--fail 0 --code kill --hang", NULL};
    lt_launch(&r, 0, NULL, killed);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 0), "killed by SIGKILL", "%s", r.out);
    lt_assert_all_gone(&r);
    lt_cleanup(&r);

    /* a binary that does not exist */
    lt_setup(&r, 0);
    const char *missing[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run2", NULL};
    lt_launch(&r, 0, NULL, missing);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 0), "exit 127", "%s", r.out);
    lt_assert_all_gone(&r);

    /* usage errors */
    const char *usage[] = {"--servers", "1", NULL};
    lt_launch(&r, 0, NULL, usage);
    cr_assert_eq(r.code, 2, "%s", r.out);
    const char *both[] = {"--servers", "1", "--trainers", "1", "--cluster", "x", NULL};
    lt_launch(&r, 0, NULL, both);
    cr_assert_eq(r.code, 2, "%s", r.out);
    lt_cleanup(&r);

    /* --timeout with everything hanging */
    lt_setup(&r, 1);
    const char *timeout[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run3",
                             "--timeout", "1", "--trainer-args=--hang", NULL};
    lt_launch(&r, 0, NULL, timeout);
    cr_assert_eq(r.code, 124, "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 1), "stopped", "%s", r.out);
    lt_assert_all_gone(&r);
    lt_cleanup(&r);
}

Test(it_launch, ctrl_c_stops_everything, .timeout = 30)
{
    lt_run r;
    lt_setup(&r, 1);
    const char *args[] = {"--servers", "2", "--trainers", "2", "--run-dir", "run",
                          "--trainer-args=--hang", NULL};
    lt_launch(&r, SIGINT, "started trainer 1 pid", args);
    cr_assert_eq(r.code, 130, "%s", r.out);
    cr_assert_eq(r.n_pids, 4, "%s", r.out);
    cr_assert(strstr(r.out, "interrupted by SIGINT"), "%s", r.out);
    for (int i = 0; i < 2; i++)
        cr_assert_str_eq(lt_row_status(&r, "trainer", i), "stopped", "%s", r.out);
    lt_assert_all_gone(&r);
    lt_cleanup(&r);
}

/* ---------------------------------------------------------------- supervision */

/* Waits (bounded) until pid is gone; pid need not be our child. */
static int s_wait_gone(int pid, int timeout_ms)
{
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (fd < 0)
        return errno == ESRCH;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int rc = poll(&p, 1, timeout_ms);
    close(fd);
    return rc == 1;
}

Test(it_launch, ssh_launcher_ends_remote_processes, .timeout = 30)
{
    lt_run r;
    lt_setup(&r, 1);
    char cluster[256], ssh[256];
    snprintf(cluster, sizeof cluster, "%s/c.txt", r.dir);
    FILE *f = fopen(cluster, "w");
    fputs("job = sshjob\nserver = 127.0.0.1:7001\ntrainer = host-a\ntrainer = host-b\n", f);
    fclose(f);
    snprintf(ssh, sizeof ssh, "%s/fake-ssh -o BatchMode=yes", r.dir);
    /* everything hangs; once trainer 0's "remote" side has printed its pid (copied to our
     * pipe by --follow), Ctrl-C the launcher */
    const char *args[] = {"--cluster", "c.txt", "--launcher", "ssh", "--ssh", ssh, "--run-dir",
                          "run", "--follow", "trainer:0", "--trainer-args=--hang", NULL};
    lt_launch(&r, SIGINT, "--trainer-id 0 --hang", args);
    cr_assert_eq(r.code, 130, "%s", r.out);
    lt_assert_all_gone(&r); // the local ssh processes
    /* the "remote" process of trainer 0, in another session: its pid is in its log */
    const char *line = strstr(r.out, "\ntrainer ");
    int pid = 0;
    cr_assert(line && sscanf(line, "\ntrainer %d args:", &pid) == 1 && pid > 0, "%s", r.out);
    cr_assert(s_wait_gone(pid, 5000), "remote-side pid %d survived the launcher", pid);
    lt_cleanup(&r);
}

Test(it_launch, slurm_and_ssh_command_lines, .timeout = 10)
{
    lt_run r;
    lt_setup(&r, 1);
    char cluster[256];
    snprintf(cluster, sizeof cluster, "%s/c.txt", r.dir);
    FILE *f = fopen(cluster, "w");
    fputs("server = node1:7000\ntrainer = node2\n", f);
    fclose(f);
    const char *slurm[] = {"--cluster", "c.txt", "--launcher", "slurm", "--dry-run",
                           "--run-dir", "run", "--job", "sj", NULL};
    lt_launch(&r, 0, NULL, slurm);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "server 0 on node1: srun --overlap --nodes=1 --ntasks=1 "
                            "--nodelist=node1 --job-name=sj-server-0 "),
              "%s", r.out);
    cr_assert(strstr(r.out, "zps-trainer --cluster "), "%s", r.out);
    const char *ssh[] = {"--cluster", "c.txt", "--launcher", "ssh", "--dry-run", "--run-dir",
                         "run", NULL};
    lt_launch(&r, 0, NULL, ssh);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "trainer 0 on node2: ssh -o BatchMode=yes node2 'sh -c "), "%s",
              r.out);
    lt_cleanup(&r);
}

/* --gpus G: the k-th trainer of a host runs with the GPU k mod G of that host
 * (CUDA_VISIBLE_DEVICES through the wrapper the Slurm placement uses), servers untouched. */
Test(it_launch, gpus_place_trainers_round_robin, .timeout = 10)
{
    lt_run r;
    lt_setup(&r, 1);
    const char *args[] = {"--servers", "1", "--trainers", "3", "--gpus", "2", "--dry-run",
                          "--run-dir", "run", NULL};
    lt_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    const char *want[3] = {"zps-gpu 0 ", "zps-gpu 1 ", "zps-gpu 0 "};
    for (int t = 0; t < 3; t++) {
        char head[64];
        snprintf(head, sizeof head, "trainer %d on 127.0.0.1: /bin/sh -c ", t);
        const char *line = strstr(r.out, head);
        cr_assert(line, "%s", r.out);
        const char *end = strchr(line, '\n');
        const char *at = strstr(line, want[t]);
        cr_assert(at && (!end || at < end), "trainer %d: want '%s' in\n%s", t, want[t], r.out);
        const char *cvd = strstr(line, "CUDA_VISIBLE_DEVICES");
        cr_assert(cvd && (!end || cvd < end), "trainer %d's line sets no CUDA_VISIBLE_DEVICES:\n%s",
                  t, r.out);
    }
    const char *srv = strstr(r.out, "server 0 on");
    cr_assert(srv, "%s", r.out);
    const char *srv_end = strchr(srv, '\n'), *gpu = strstr(srv, "zps-gpu");
    cr_assert(!gpu || (srv_end && gpu > srv_end), "a server was placed on a GPU:\n%s", r.out);
    const char *bad[] = {"--servers", "1", "--trainers", "1", "--gpus", "-1", "--dry-run",
                         "--run-dir", "run2", NULL};
    lt_launch(&r, 0, NULL, bad);
    cr_assert_neq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "--gpus must be >= 0"), "%s", r.out);
    lt_cleanup(&r);
}

/* --node-trainers G in the trainers' arguments: the servers are told N / G trainers (unless
 * the server arguments name a count), and a G that does not divide N is a usage error. */
Test(it_launch, node_trainers_tell_the_servers, .timeout = 10)
{
    lt_run r;
    lt_setup(&r, 1);
    const char *args[] = {"--servers", "2", "--trainers", "4", "--trainer-args",
                          "--node-trainers 2 --mode sync", "--dry-run", "--run-dir", "run",
                          NULL};
    lt_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    for (int s = 0; s < 2; s++) {
        char head[32];
        snprintf(head, sizeof head, "server %d on", s);
        const char *line = strstr(r.out, head), *end = line ? strchr(line, '\n') : NULL;
        const char *nt = line ? strstr(line, "--num-trainers 2") : NULL;
        cr_assert(nt && (!end || nt < end), "server %d is not told 2 trainers:\n%s", s, r.out);
    }
    /* a value that is one option, no space: still the trainers' argument, not the launcher's */
    const char *one[] = {"--servers", "1", "--trainers", "2", "--trainer-args",
                         "--node-trainers=2", "--dry-run", "--run-dir", "run1", NULL};
    lt_launch(&r, 0, NULL, one);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "--num-trainers 1"), "server not told 1 trainer:\n%s", r.out);
    const char *bad[] = {"--servers", "1", "--trainers", "3", "--trainer-args=--node-trainers=2",
                         "--dry-run", "--run-dir", "run2", NULL};
    lt_launch(&r, 0, NULL, bad);
    cr_assert_eq(r.code, 2, "%s", r.out);
    cr_assert(strstr(r.out, "--node-trainers 2 does not divide the fleet's 3 trainers"), "%s",
              r.out);
    lt_cleanup(&r);
}

/* r exited 0 printing PROG's version line: "PROG VERSION (git HASH)". */
static void s_assert_version(const lt_run *r, const char *prog)
{
    cr_assert_eq(r->code, 0, "%s", r->out);
    char want[128];
    snprintf(want, sizeof want, "%s " ZPS_VERSION " (git ", prog);
    cr_assert(!strncmp(r->out, want, strlen(want)), "%s\nwant %s...", r->out, want);
    const char *hash = r->out + strlen(want);
    size_t n = strspn(hash, "0123456789abcdef");
    cr_assert(n == 12 || !strncmp(hash, "unknown)", 8), "%s", r->out);
    cr_assert(!strcmp(hash + n, ")\n") || !strcmp(hash + n, "-dirty)\n") ||
                  !strcmp(hash, "unknown)\n"),
              "%s", r->out);
}

/* --version: the C binaries' format (zps_version_line), the version from common/version.h
 * and the source tree's commit. */
Test(it_launch, version_line, .timeout = 20)
{
    lt_run r;
    lt_setup(&r, 0);
    const char *args[] = {"--version", NULL};
    lt_launch(&r, 0, NULL, args);
    s_assert_version(&r, "zps-launch");
    lt_cleanup(&r);
}

/* ---------------------------------------------------------------- scripts/compare */

static const char *s_compare(void)
{
    static char path[4096];
    const char *root = getenv("ZPS_ROOT");
    snprintf(path, sizeof path, "%s/scripts/compare", root && *root ? root : ".");
    return path;
}

/* Runs scripts/compare in r->dir with args; output into r->out. */
static void s_run_compare(lt_run *r, const char *const *args)
{
    const char *argv[40];
    int n = 0;
    argv[n++] = "/usr/bin/python3";
    argv[n++] = s_compare();
    while (*args && n < 38)
        argv[n++] = *args++;
    argv[n] = NULL;
    lt_exec(r, argv, 0, NULL);
}

Test(it_launch, compare_version_line, .timeout = 20)
{
    lt_run r;
    lt_setup(&r, 0);
    const char *args[] = {"--version", NULL};
    s_run_compare(&r, args);
    s_assert_version(&r, "compare");
    lt_cleanup(&r);
}

/* number after "key": inside the compare.json entry of mode (NAN for null / absent) */
static double s_entry(const char *json, const char *mode, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"mode\": \"%s\"", mode);
    const char *e = strstr(json, pat);
    if (!e)
        return NAN;
    const char *end = strchr(e, '}');
    snprintf(pat, sizeof pat, "\"%s\": ", key);
    const char *p = strstr(e, pat);
    if (!p || (end && p > end) || !strncmp(p + strlen(pat), "null", 4))
        return NAN;
    return strtod(p + strlen(pat), NULL);
}

/* What the fake runs fed scripts/compare, per mode: the sum of both trainers' img/s, the
 * time trainer 0 reached 85% (NAN: never), and its last accuracy. */
typedef struct s_fed {
    double img_s_sum[4], hit[4], final_acc[4];
} s_fed;

static const char *const s_modes[] = {"sync", "async", "ssp", "allreduce"};

/* dir/metrics-{0,1}.jsonl of mode mi: 80 steps of 0.25 s; mode mi reaches 85% at
 * evaluation 3 + mi (never for allreduce); trainer 0 evaluates every 10 steps, trainer 1
 * never does. */
static void s_fake_mode_run(const char *dir, int mi, s_fed *fd)
{
    fd->hit[mi] = mi < 3 ? 0.25 * 10 * (3 + mi) : NAN;
    for (int t = 0; t < 2; t++) {
        char path[300];
        snprintf(path, sizeof path, "%s/metrics-%d.jsonl", dir, t);
        tr_metrics_opts o = {.jsonl_path = path, .mode = TR_PROGRESS_OFF, .trainer_id = t,
                             .mode_name = s_modes[mi], .batch = 32, .n_trainers = 2,
                             .target_accuracy = 0.85};
        tr_metrics *m = NULL;
        cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK);
        int64_t images = 0;
        double acc = 0;
        for (int s = 1; s <= 80; s++) {
            tr_metrics_set_fake_time(m, 0.25 * s);
            tr_step_record rec = tr_step_record_empty(s);
            rec.images = 16 + rand() % 32;
            rec.loss = 2.0 / s;
            images += rec.images;
            if (t == 0 && s % 10 == 0) {
                int ev = s / 10;
                acc = ev < 3 + mi || mi == 3 ? 0.5 + 0.3 * rand() / RAND_MAX
                                             : 0.85 + 0.1 * rand() / RAND_MAX;
                rec.test_accuracy = acc;
            }
            cr_assert_eq(tr_metrics_step(m, &rec), ZPS_OK);
        }
        if (t == 0)
            fd->final_acc[mi] = acc;
        fd->img_s_sum[mi] += (double)images / 20.0;
        tr_metrics_destroy(&m);
    }
}

/* compare.json against what was fed, and compare.png a PNG. */
static void s_check_compare_out(const lt_run *r, const s_fed *fd, uint64_t seed)
{
    char path[300], json[16384];
    snprintf(path, sizeof path, "%s/out/compare.json", r->dir);
    lt_read_file(path, json, sizeof json);
    for (int mi = 0; mi < 4; mi++) {
        double v = s_entry(json, s_modes[mi], "img_s");
        cr_assert(fabs(v - fd->img_s_sum[mi]) < 1e-3 * fd->img_s_sum[mi],
                  "%s img_s %g want %g (seed %llx)", s_modes[mi], v, fd->img_s_sum[mi],
                  (unsigned long long)seed);
        double t = s_entry(json, s_modes[mi], "time_to_target");
        if (isnan(fd->hit[mi]))
            cr_assert(isnan(t), "%s never reached 85%% but time_to_target %g", s_modes[mi], t);
        else /* trainers' start records differ by the ms they were created apart */
            cr_assert(fabs(t - fd->hit[mi]) < 0.5, "%s time_to_target %g want %g", s_modes[mi],
                      t, fd->hit[mi]);
        cr_assert(fabs(s_entry(json, s_modes[mi], "final_accuracy") - fd->final_acc[mi]) < 1e-5,
                  "%s final accuracy", s_modes[mi]);
        cr_assert_eq(s_entry(json, s_modes[mi], "trainers"), 2.0);
    }
    unsigned char magic[8] = {0};
    snprintf(path, sizeof path, "%s/out/compare.png", r->dir);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "no plot: %s", r->out);
    cr_assert_eq(fread(magic, 1, 8, f), 8u);
    fclose(f);
    cr_assert(!memcmp(magic, "\x89PNG\r\n\x1a\n", 8), "compare.png is not a PNG");
}

Test(it_launch, compare_table_json_and_plot_from_metrics_files, .timeout = 60)
{
    lt_run r;
    lt_setup(&r, 1);
    uint64_t seed = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 16);
    srand((unsigned)seed);
    s_fed fd;
    memset(&fd, 0, sizeof fd);
    const char *cargs[16];
    int nc = 0;
    char specs[4][256];
    cargs[nc++] = "--from-runs";
    for (int mi = 0; mi < 4; mi++) {
        char dir[256];
        snprintf(dir, sizeof dir, "%s/%s", r.dir, s_modes[mi]);
        cr_assert_eq(mkdir(dir, 0755), 0);
        snprintf(specs[mi], sizeof specs[mi], "%s=%s", s_modes[mi], s_modes[mi]);
        cargs[nc++] = specs[mi];
        s_fake_mode_run(dir, mi, &fd);
    }
    cargs[nc++] = "--out-dir";
    cargs[nc++] = "out";
    cargs[nc] = NULL;
    s_run_compare(&r, cargs);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "time to 85%"), "table header: %s", r.out);
    cr_assert(strstr(r.out, "allreduce"), "%s", r.out);
    s_check_compare_out(&r, &fd, seed);
    lt_cleanup(&r);
}

/* Detector runs (their evaluations are "map"): the table, JSON and plot are in mAP. */
Test(it_launch, compare_scores_detector_runs_by_map, .timeout = 60)
{
    lt_run r;
    lt_setup(&r, 1);
    char dir[256], path[300];
    snprintf(dir, sizeof dir, "%s/async", r.dir);
    cr_assert_eq(mkdir(dir, 0755), 0);
    snprintf(path, sizeof path, "%s/metrics-0.jsonl", dir);
    tr_metrics_opts o = {.jsonl_path = path, .mode = TR_PROGRESS_OFF, .trainer_id = 0,
                         .mode_name = "async", .batch = 16, .n_trainers = 1,
                         .target_accuracy = 0.6, .score_map = 1};
    tr_metrics *m = NULL;
    cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK);
    for (int s = 1; s <= 20; s++) {
        tr_metrics_set_fake_time(m, 0.25 * s);
        tr_step_record rec = tr_step_record_empty(s);
        rec.images = 16;
        rec.loss = 5.0 / s;
        rec.matched = 30;
        rec.loss_conf = rec.loss_loc = 0;
        if (s % 10 == 0)
            rec.test_map = s == 10 ? 0.4 : 0.7;
        cr_assert_eq(tr_metrics_step(m, &rec), ZPS_OK);
    }
    tr_metrics_destroy(&m);
    const char *args[] = {"--from-runs", "async=async", "--target", "0.6", "--out-dir", "out",
                          NULL};
    s_run_compare(&r, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "final mAP") && strstr(r.out, "70.00%"), "table: %s", r.out);
    char json[16384];
    snprintf(path, sizeof path, "%s/out/compare.json", r.dir);
    lt_read_file(path, json, sizeof json);
    cr_assert(fabs(s_entry(json, "async", "final_map") - 0.7) < 1e-6, "%s", json);
    cr_assert(fabs(s_entry(json, "async", "best_map") - 0.7) < 1e-6, "%s", json);
    cr_assert(fabs(s_entry(json, "async", "time_to_target") - 5.0) < 0.5, "%s", json);
    snprintf(path, sizeof path, "%s/out/compare-data/compare.gp", r.dir);
    char gp[4096];
    lt_read_file(path, gp, sizeof gp);
    cr_assert(strstr(gp, "test mAP at IoU 0.5 against time"), "%s", gp);
    lt_cleanup(&r);
}

/* A stand-in trainer that writes a small metrics file where --metrics says. */
static const char *s_metrics_trainer_sh =
    "#!/bin/sh\n"
    "id=''; mode=''; out=''\n"
    "while [ $# -gt 0 ]; do case \"$1\" in\n"
    "  --trainer-id) id=$2; shift;; --mode) mode=$2; shift;; --metrics) out=$2; shift;;\n"
    "esac; shift; done\n"
    "[ -n \"$out\" ] || exit 9\n"
    "{ echo \"{\\\"type\\\":\\\"start\\\",\\\"trainer\\\":$id,\\\"mode\\\":\\\"$mode\\\","
    "\\\"wall_ms\\\":1000}\"\n"
    "  echo \"{\\\"type\\\":\\\"step\\\",\\\"trainer\\\":$id,\\\"step\\\":1,\\\"time\\\":1.0,"
    "\\\"images\\\":50,\\\"loss\\\":0.5,\\\"accuracy\\\":0.9}\"\n"
    "  echo \"{\\\"type\\\":\\\"summary\\\",\\\"trainer\\\":$id,\\\"steps\\\":1,"
    "\\\"img_s\\\":50}\"\n"
    "} > \"$out\"\n";

Test(it_launch, compare_runs_fleets_through_the_launcher, .timeout = 60)
{
    lt_run r;
    lt_setup(&r, 0);
    char bin[256];
    snprintf(bin, sizeof bin, "%s/bin", r.dir);
    lt_write_exec(bin, "zps-trainer", s_metrics_trainer_sh);
    const char *args[] = {"--modes", "sync,allreduce", "--trainers", "2", "--servers", "1",
                          "--bin-dir", bin, "--runs-root", "runs", "--out-dir", "out",
                          "--no-plot", "--timeout", "20", NULL};
    s_run_compare(&r, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    char path[300], json[16384];
    snprintf(path, sizeof path, "%s/out/compare.json", r.dir);
    lt_read_file(path, json, sizeof json);
    cr_assert_eq(s_entry(json, "sync", "img_s"), 100.0, "%s", json);
    cr_assert_eq(s_entry(json, "allreduce", "img_s"), 100.0, "%s", json);
    cr_assert(fabs(s_entry(json, "sync", "time_to_target") - 1.0) < 1e-9, "%s", json);
    snprintf(path, sizeof path, "%s/runs/sync/metrics-1.jsonl", r.dir);
    char text[2048];
    lt_read_file(path, text, sizeof text);
    cr_assert(strstr(text, "\"mode\":\"sync\""), "%s", text);
    lt_cleanup(&r);
}
