/* test_launch_ssh.c — scripts/zps-launch --launcher ssh against a real sshd on 127.0.0.1
 * (ssh_test_util.h: keys made by ssh-keygen, sshd stopped by its PID), with a cluster file
 * that names hosts: "localhost" and this machine's host name, when it resolves to a loopback
 * address (else the tests skip and say why).
 *
 * Checked: the ZPS_* variables (the launcher's, per incarnation, and the user's own) and
 * `-x VAR` / `-x VAR=VALUE` arrive in the remote processes, which sshd starts with a clean
 * environment; `-x` in local mode; a host that lacks a program (or cannot be reached) is
 * refused before anything starts, after one ssh per host; a remote process that ignores
 * SIGTERM is killed --grace seconds after the stop; a real fleet (zps-server, zps-trainer,
 * a short async run) over ssh exits 0 with every row "ok". The stand-in programs print their
 * environment to their logs; the remote pids they print are awaited, bounded, and killed by
 * PID if they outlive the launcher (which fails the test).
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "tests/launch_test_util.h"
#include "tests/soak_test_util.h" // sk_make_data
#include "tests/ssh_test_util.h"
#include "tests/testutil.h"

/* print the variables, then behave as lt_setup's stand-ins (server blocks; trainer 1 fails
 * its first incarnation, so its restart shows ZPS_RESTART=1). A trainer ends only once
 * server 0 has printed everything ("server ready" in its log, polled for 30 s at most):
 * else the launcher could stop the server, after the trainers, before it printed. */
static const char *s_server_env_sh = "#!/bin/sh\n"
                                     "echo \"server $$ args: $*\"\n"
                                     "env | grep -E '^(ZPS_|FWD_|SSH_CONNECTION=)' | sort\n"
                                     "echo 'server ready'\n"
                                     "exec tail -f /dev/null\n";
static const char *s_trainer_env_sh =
    "#!/bin/sh\n"
    "echo \"trainer $$ args: $*\"\n"
    "env | grep -E '^(ZPS_|FWD_|SSH_CONNECTION=)' | sort\n"
    "[ \"$ZPS_INDEX\" = 1 ] && [ \"$ZPS_RESTART\" = 0 ] && exit 3\n"
    "for i in $(seq 600); do\n"
    "  grep -q 'server ready' \"$ZPS_RUN_DIR/server-0.log\" 2>/dev/null && exit 0\n"
    "  sleep 0.05\n"
    "done\n"
    "echo 'server 0 never got ready'; exit 1\n";

static lt_run g_r;         // the launcher's run (its dir holds everything)
static ssht_sshd g_sshd;   // the real sshd
static char g_host[256];   // the second loopback name
static char g_cluster[300]; // cluster file written by s_cluster

/* A fresh run directory with the env-printing stand-ins. */
static void s_init_local(void)
{
    lt_setup(&g_r, 1);
    char bin[300];
    snprintf(bin, sizeof bin, "%s/bin", g_r.dir);
    lt_write_exec(bin, "zps-server", s_server_env_sh);
    lt_write_exec(bin, "zps-trainer", s_trainer_env_sh);
}

/* s_init_local and sshd; skips when this machine cannot run the test. */
static void s_init(void)
{
    char why[512], dir[300];
    if (!ssht_loopback_name(g_host, sizeof g_host, why, sizeof why))
        ZPS_TEST_SKIP("%s", why);
    s_init_local();
    snprintf(dir, sizeof dir, "%s/sshd", g_r.dir);
    cr_assert_eq(mkdir(dir, 0700), 0);
    if (!ssht_start(&g_sshd, dir, g_host, why, sizeof why))
        ZPS_TEST_SKIP("%s", why);
}

static void s_fini(void)
{
    ssht_stop(&g_sshd);
    if (g_r.dir[0])
        lt_cleanup(&g_r);
}

static void s_cluster(const char *text)
{
    snprintf(g_cluster, sizeof g_cluster, "%s/c.txt", g_r.dir);
    FILE *f = fopen(g_cluster, "w");
    cr_assert_not_null(f);
    fputs(text, f);
    fclose(f);
}

/* Waits (bounded) until pid, which is not our child, is gone; kills it by PID and fails
 * when it outlives the wait. */
static void s_assert_gone(int pid, const char *what)
{
    int fd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (fd < 0) {
        cr_assert_eq(errno, ESRCH, "pidfd_open %d: %s", pid, strerror(errno));
        return;
    }
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int gone = poll(&p, 1, 10000) == 1;
    if (!gone)
        kill(pid, SIGKILL);
    close(fd);
    cr_assert(gone, "%s (pid %d) outlived the launcher", what, pid);
}

/* The pid a stand-in printed first in log ("ROLE PID args: ..."). */
static int s_remote_pid(const char *log, const char *role)
{
    char want[32];
    int pid = 0;
    snprintf(want, sizeof want, "%s %%d args:", role);
    cr_assert(sscanf(log, want, &pid) == 1 && pid > 0, "no pid in: %s", log);
    return pid;
}

static char *s_log(const char *name, char *buf, size_t cap)
{
    char path[400];
    snprintf(path, sizeof path, "%s/run/%s", g_r.dir, name);
    return lt_read_file(path, buf, cap);
}

static void s_assert_has(const char *text, const char *what, const char *where)
{
    cr_assert(strstr(text, what), "%s lacks '%s':\n%s\nlauncher:\n%s", where, what, text,
              g_r.out);
}

/* The variables of one remote process, as its stand-in printed them. */
static void s_check_vars(const char *log, const char *name, const char *role, int index,
                         int restart)
{
    char want[512];
    snprintf(want, sizeof want, "ZPS_RUN_DIR=%s/run\n", g_r.dir);
    s_assert_has(log, want, name);
    s_assert_has(log, "ZPS_JOB=envjob\n", name);
    snprintf(want, sizeof want, "ZPS_ROLE=%s\n", role);
    s_assert_has(log, want, name);
    snprintf(want, sizeof want, "ZPS_INDEX=%d\n", index);
    s_assert_has(log, want, name);
    snprintf(want, sizeof want, "ZPS_RESTART=%d\n", restart);
    s_assert_has(log, want, name);
    s_assert_has(log, "ZPS_TEST_MINE=user's own\n", name);
    s_assert_has(log, "FWD_FROM_LAUNCHER=launcher value\n", name);
    s_assert_has(log, "FWD_SET=a b'c $HOME\n", name);
    snprintf(want, sizeof want, " 127.0.0.1 %d\n", g_sshd.port); // through our sshd
    s_assert_has(log, want, name);
}

Test(it_launch_ssh, variables_and_x_reach_remote_processes, .init = s_init, .fini = s_fini,
     .timeout = 60)
{
    char text[600];
    snprintf(text, sizeof text,
             "job = envjob\nserver = localhost:7001\ntrainer = localhost\ntrainer = %s\n",
             g_host);
    s_cluster(text);
    setenv("FWD_FROM_LAUNCHER", "launcher value", 1);
    setenv("FWD_NOT_ASKED", "stays here", 1);
    setenv("ZPS_TEST_MINE", "user's own", 1);
    const char *args[] = {"--cluster", "c.txt", "--launcher", "ssh", "--ssh", g_sshd.ssh,
                          "--run-dir", "run", "--grace", "5", "--timeout", "40",
                          "--restart-backoff", "0", "-x", "FWD_FROM_LAUNCHER", "-x",
                          "FWD_SET=a b'c $HOME", NULL};
    lt_launch(&g_r, 0, NULL, args);
    cr_assert_eq(g_r.code, 0, "%s", g_r.out);
    cr_assert_str_eq(lt_row_status(&g_r, "trainer", 0), "ok", "%s", g_r.out);
    cr_assert_str_eq(lt_row_status(&g_r, "trainer", 1), "ok", "%s", g_r.out);
    cr_assert_str_eq(lt_row_status(&g_r, "server", 0), "stopped", "%s", g_r.out);
    lt_assert_all_gone(&g_r);

    char log[8192];
    s_log("server-0.log", log, sizeof log);
    s_check_vars(log, "server-0.log", "server", 0, 0);
    cr_assert_null(strstr(log, "FWD_NOT_ASKED"), "forwarded without -x:\n%s", log);
    s_assert_gone(s_remote_pid(log, "server"), "the remote server");
    s_log("trainer-0.log", log, sizeof log);
    s_check_vars(log, "trainer-0.log", "trainer", 0, 0);
    /* trainer 1 on the second name: its first incarnation failed, the restart ran with 1 */
    s_log("trainer-1.log", log, sizeof log);
    s_check_vars(log, "trainer-1.log", "trainer", 1, 0);
    const char *second = strstr(log, "---- zps-launch: restart 1 of trainer 1");
    cr_assert_not_null(second, "%s", log);
    s_check_vars(second, "trainer-1.log (restart)", "trainer", 1, 1);
}

/* A remote process that ignores SIGTERM: the launcher SIGKILLs its local ssh after --grace,
 * and the remote watcher SIGKILLs the process --grace after its stdin closed. */
Test(it_launch_ssh, remote_process_ignoring_sigterm_killed_after_grace, .init = s_init,
     .fini = s_fini, .timeout = 60)
{
    char bin[300], text[600];
    snprintf(bin, sizeof bin, "%s/bin", g_r.dir);
    lt_write_exec(bin, "zps-server",
                  "#!/bin/sh\ntrap '' TERM\necho \"server $$ args: $*\"\n"
                  "exec sleep 3600\n"); // (tail -f would end with its output pipe)
    /* the trainer ends once the server has set its trap (its line is in its log), so the
     * launcher's SIGTERM cannot arrive before the trap does */
    lt_write_exec(bin, "zps-trainer",
                  "#!/bin/sh\nfor i in $(seq 600); do\n"
                  "  grep -q 'args:' \"$ZPS_RUN_DIR/server-0.log\" 2>/dev/null && exit 0\n"
                  "  sleep 0.05\ndone\necho 'the server never started'; exit 1\n");
    snprintf(text, sizeof text, "server = localhost:7001\ntrainer = %s\n", g_host);
    s_cluster(text);
    const char *args[] = {"--cluster", "c.txt", "--launcher", "ssh", "--ssh", g_sshd.ssh,
                          "--run-dir", "run", "--grace", "2", "--timeout", "40", NULL};
    lt_launch(&g_r, 0, NULL, args);
    cr_assert_eq(g_r.code, 0, "%s", g_r.out);
    s_assert_has(g_r.out, "server 0 ignored SIGTERM for 2 s: SIGKILL", "the launcher's output");
    cr_assert_str_eq(lt_row_status(&g_r, "server", 0), "stopped", "%s", g_r.out);
    lt_assert_all_gone(&g_r);
    char log[4096];
    s_log("server-0.log", log, sizeof log);
    s_assert_gone(s_remote_pid(log, "server"), "the remote server ignoring SIGTERM");
}

/* -x in local mode: the variable is in the process's environment; a bad -x is a usage
 * error. (slurm: srun passes the launcher's environment on, -x included.) */
Test(it_launch_ssh, x_in_local_mode, .init = s_init_local, .fini = s_fini, .timeout = 30)
{
    setenv("FWD_FROM_LAUNCHER", "launcher value", 1);
    const char *args[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run", "-x",
                          "FWD_FROM_LAUNCHER", "-x", "FWD_SET=x", "-x", "FWD_SET=a=b", NULL};
    lt_launch(&g_r, 0, NULL, args);
    cr_assert_eq(g_r.code, 0, "%s", g_r.out);
    char log[8192];
    s_log("trainer-0.log", log, sizeof log);
    s_assert_has(log, "FWD_FROM_LAUNCHER=launcher value\n", "trainer-0.log");
    s_assert_has(log, "FWD_SET=a=b\n", "trainer-0.log"); // the last -x wins
    lt_assert_all_gone(&g_r);

    unsetenv("FWD_UNSET");
    const char *unset[] = {"--servers", "1", "--trainers", "1", "-x", "FWD_UNSET", NULL};
    lt_launch(&g_r, 0, NULL, unset);
    cr_assert_eq(g_r.code, 2, "%s", g_r.out);
    cr_assert(strstr(g_r.out, "-x FWD_UNSET: FWD_UNSET is not set here"), "%s", g_r.out);
    const char *bad[] = {"--servers", "1", "--trainers", "1", "-x", "1BAD=v", NULL};
    lt_launch(&g_r, 0, NULL, bad);
    cr_assert_eq(g_r.code, 2, "%s", g_r.out);
    cr_assert(strstr(g_r.out, "'1BAD' is not a variable name"), "%s", g_r.out);
}

/* Number of logins sshd accepted so far. */
static int s_logins(void)
{
    char path[400], text[65536];
    snprintf(path, sizeof path, "%s/sshd.log", g_sshd.dir);
    lt_read_file(path, text, sizeof text);
    int n = 0;
    for (const char *p = text; (p = strstr(p, "Accepted publickey")); p++)
        n++;
    return n;
}

/* The check before anything starts: every host is asked once, every problem is named with
 * its host, and no process starts (no log, no pid). */
Test(it_launch_ssh, missing_program_refused_before_anything_starts, .init = s_init,
     .fini = s_fini, .timeout = 60)
{
    char text[600], path[400];
    snprintf(text, sizeof text,
             "job = envjob\nserver = localhost:7001\ntrainer = localhost\ntrainer = %s\n"
             "trainer = localhost\n",
             g_host);
    s_cluster(text);
    /* per-host program folders: bin/localhost/zps-trainer runs, bin/HOST/zps-trainer is
     * there but not executable */
    snprintf(path, sizeof path, "%s/bin/localhost", g_r.dir);
    cr_assert_eq(mkdir(path, 0755), 0);
    lt_write_exec(path, "zps-trainer", s_trainer_env_sh);
    snprintf(path, sizeof path, "%s/bin/%s", g_r.dir, g_host);
    cr_assert_eq(mkdir(path, 0755), 0);
    lt_write_exec(path, "zps-trainer", s_trainer_env_sh);
    snprintf(path, sizeof path, "%s/bin/%s/zps-trainer", g_r.dir, g_host);
    cr_assert_eq(chmod(path, 0644), 0);
    const char *args[] = {"--cluster", "c.txt", "--launcher", "ssh", "--ssh", g_sshd.ssh,
                          "--run-dir", "run", "--trainer-cmd",
                          "{bin}/{host}/zps-trainer --trainer-id {index}", NULL};
    int before = s_logins();
    lt_launch(&g_r, 0, NULL, args);
    cr_assert_eq(g_r.code, 1, "%s", g_r.out);
    char want[600];
    snprintf(want, sizeof want, "  %s: missing or not executable: %s\n", g_host, path);
    s_assert_has(g_r.out, want, "the launcher's output");
    s_assert_has(g_r.out, "zps-launch: nothing started", "the launcher's output");
    cr_assert_null(strstr(g_r.out, "localhost:"), "localhost has everything:\n%s", g_r.out);
    cr_assert_eq(g_r.n_pids, 0, "started something:\n%s", g_r.out);
    snprintf(path, sizeof path, "%s/run/server-0.log", g_r.dir);
    cr_assert_neq(access(path, F_OK), 0, "server-0.log exists: something started");
    snprintf(path, sizeof path, "%s/run", g_r.dir);
    cr_assert_neq(access(path, F_OK), 0, "the run folder this launch made is still there");
    cr_assert_eq(s_logins() - before, 2, "one ssh per distinct host (2 hosts, 4 processes)");

    /* every host is checked: a missing server program on localhost, the same trainer
     * problem on the other name, and a host that cannot be reached */
    snprintf(text, sizeof text,
             "server = localhost:7001\ntrainer = %s\ntrainer = no-such-host.invalid\n", g_host);
    s_cluster(text);
    const char *all[] = {"--cluster", "c.txt", "--launcher", "ssh", "--ssh", g_sshd.ssh,
                         "--run-dir", "run", "--server-cmd", "{bin}/nope/zps-server",
                         "--trainer-cmd", "{bin}/{host}/zps-trainer", NULL};
    lt_launch(&g_r, 0, NULL, all);
    cr_assert_eq(g_r.code, 1, "%s", g_r.out);
    snprintf(want, sizeof want, "  localhost: missing or not executable: %s/bin/nope/zps-server\n",
             g_r.dir);
    s_assert_has(g_r.out, want, "the launcher's output");
    snprintf(want, sizeof want, "  %s: missing or not executable: ", g_host);
    s_assert_has(g_r.out, want, "the launcher's output");
    s_assert_has(g_r.out, "  no-such-host.invalid: cannot run a command there over ssh: ",
                 "the launcher's output");
    cr_assert_eq(g_r.n_pids, 0, "started something:\n%s", g_r.out);
}

/* A real fleet over ssh: 2 servers and 2 trainers (one per host name), a short async run;
 * the servers bind the host names (common/net.c resolves them). */
Test(it_launch_ssh, real_fleet_over_ssh, .init = s_init, .fini = s_fini, .timeout = 180)
{
    const char *bin = getenv("ZPS_BIN");
    cr_assert_not_null(bin, "ZPS_BIN unset: run through make test");
    char text[600];
    sk_make_data(g_r.dir);
    /* both hosts may be 127.0.0.1: two picks of a released port 0 can be the same port */
    int p1 = ssht_free_port(), p2;
    while ((p2 = ssht_free_port()) == p1)
        ;
    snprintf(text, sizeof text,
             "job = sshfleet\nserver = localhost:%d\nserver = %s:%d\n"
             "trainer = localhost\ntrainer = %s\n",
             p1, g_host, p2, g_host);
    s_cluster(text);
    const char *args[] = {"--cluster", "c.txt", "--launcher", "ssh", "--ssh", g_sshd.ssh,
                          "--run-dir", "run", "--bin-dir", bin, "--timeout", "120",
                          "--grace", "10",
                          "--trainer-args=--data fm --mode async --model mlp --steps 3 "
                          "--batch-size 16 --no-progress --eval-batches 1 --threads 0",
                          NULL};
    lt_launch(&g_r, 0, NULL, args);
    cr_assert_eq(g_r.code, 0, "%s", g_r.out);
    for (int i = 0; i < 2; i++) {
        cr_assert_str_eq(lt_row_status(&g_r, "trainer", i), "ok", "%s", g_r.out);
        cr_assert_str_eq(lt_row_status(&g_r, "server", i), "ok", "%s", g_r.out);
    }
    lt_assert_all_gone(&g_r);
}
