/* test_launch_sup.c — zps-launch's supervision (suite it_launch), with stand-in binaries that
 * die on cue: a dead server restarted with --restore and the checkpoint flags, restarts
 * running out with a doubling back-off, a server ending early counted as a failure, the
 * --on-trainer-exit policies, SIGTERM then SIGKILL after --grace, --before-stop. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/launch_test_util.h"

/* A stand-in server for the supervision tests: prints its arguments; the first incarnation
 * (ZPS_RESTART=0, set by the launcher) of the server named by $ZPS_TEST_DIE does what
 * $ZPS_TEST_HOW says ("kill": SIGKILL itself after 0.3 s, "exit0": exit 0 at once,
 * "always": SIGKILL itself in every incarnation); SIGTERM is handled as the real server
 * does (exit 0), unless $ZPS_TEST_DEAF is set (then it is ignored). */
static const char *s_sup_server_sh =
    "#!/bin/sh\n"
    "echo \"server $$ restart $ZPS_RESTART args: $*\"\n"
    "if [ \"$ZPS_INDEX\" = \"$ZPS_TEST_DIE\" ]; then\n"
    "  case \"$ZPS_TEST_HOW/$ZPS_RESTART\" in\n"
    "    kill/0|always/*) sleep 0.3; kill -9 $$;;\n"
    "    exit0/0) exit 0;;\n"
    "  esac\n"
    "fi\n"
    "if [ -n \"$ZPS_TEST_DEAF\" ]; then trap '' TERM; else trap 'exit 0' TERM; fi\n"
    "while :; do sleep 0.05; done\n";

/* A stand-in trainer: runs for $ZPS_TEST_RUN seconds (default 2) and exits 0; the first
 * incarnation of the trainer named by $ZPS_TEST_TDIE SIGKILLs itself after 0.3 s. */
static const char *s_sup_trainer_sh =
    "#!/bin/sh\n"
    "echo \"trainer $$ restart $ZPS_RESTART args: $*\"\n"
    "if [ \"$ZPS_INDEX\" = \"$ZPS_TEST_TDIE\" ] && [ \"$ZPS_RESTART\" = 0 ]; then\n"
    "  sleep 0.3; kill -9 $$\n"
    "fi\n"
    "sleep ${ZPS_TEST_RUN:-2}\n";

/* lt_setup with the supervision stand-ins and env (NULL-terminated "NAME=value") set for
 * the launcher and its children. */
static void s_sup_setup(lt_run *r, const char *const *env)
{
    lt_setup(r, 0);
    char bin[192];
    snprintf(bin, sizeof bin, "%s/bin", r->dir);
    lt_write_exec(bin, "zps-server", s_sup_server_sh);
    lt_write_exec(bin, "zps-trainer", s_sup_trainer_sh);
    static const char *names[] = {"ZPS_TEST_DIE", "ZPS_TEST_HOW", "ZPS_TEST_DEAF",
                                  "ZPS_TEST_TDIE", "ZPS_TEST_RUN"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        unsetenv(names[i]);
    for (; env && *env; env++)
        cr_assert_eq(putenv((char *)*env), 0);
}

/* summary.json of the run folder "run" into buf. */
static char *s_summary(const lt_run *r, char *buf, size_t cap)
{
    char path[256];
    snprintf(path, sizeof path, "%s/run/summary.json", r->dir);
    return lt_read_file(path, buf, cap);
}

/* The "t_s" of the n-th event (0-based) in summary.json text (-1 when absent). */
static double s_event_time(const char *json, int n)
{
    const char *p = json;
    for (int i = 0; i <= n; i++) {
        p = strstr(p, "\"t_s\": ");
        if (!p)
            return -1;
        p += 7;
    }
    return strtod(p, NULL);
}

/* A server killed by SIGKILL while the trainers run is restarted with --restore from the
 * checkpoint directory the launcher gave it, and the job ends well (exit 0). */
Test(it_launch, dead_server_is_restarted_with_restore, .timeout = 30)
{
    lt_run r;
    const char *env[] = {"ZPS_TEST_DIE=1", "ZPS_TEST_HOW=kill", NULL};
    s_sup_setup(&r, env);
    const char *args[] = {"--servers", "2", "--trainers", "2", "--run-dir", "run", NULL};
    lt_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_eq(r.n_pids, 5, "four processes and one restart:\n%s", r.out);
    cr_assert(strstr(r.out, "server 1 failed: killed by SIGKILL at "), "%s", r.out);
    cr_assert(strstr(r.out, "restart 1 of 3 in 0.5 s with --restore"), "%s", r.out);
    cr_assert(strstr(r.out, "started server 1 pid "), "%s", r.out);
    cr_assert(strstr(r.out, "(restart 1, --restore)"), "%s", r.out);
    cr_assert(strstr(r.out, "events:\n"), "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "server", 1), "ok", "%s", r.out);
    for (int i = 0; i < 2; i++)
        cr_assert_str_eq(lt_row_status(&r, "trainer", i), "ok", "%s", r.out);
    char path[256], text[8192], want[512];
    snprintf(path, sizeof path, "%s/run/server-1.log", r.dir);
    lt_read_file(path, text, sizeof text);
    snprintf(want, sizeof want,
             "--checkpoint-dir %s/run/checkpoints --checkpoint-every-versions 50",
             r.dir);
    cr_assert(strstr(text, want), "server-1.log: %s\nwant %s", text, want);
    const char *second = strstr(text, "restart 1 args:");
    cr_assert(second && strstr(second, "--restore"), "server-1.log: %s", text);
    /* the server metrics file: a restart writes its own, so the dead one's records stay */
    snprintf(want, sizeof want, "--metrics %s/run/server-1.metrics.jsonl", r.dir);
    const char *first = strstr(text, want);
    cr_assert(first && first < second, "server-1.log: %s\nwant %s", text, want);
    snprintf(want, sizeof want, "--metrics %s/run/server-1.metrics.restart-1.jsonl", r.dir);
    cr_assert(strstr(second, want), "server-1.log: %s\nwant %s", text, want);
    cr_assert_null(strstr(text, "restart 0 args: --restore"), "%s", text);
    cr_assert(strstr(text, "---- zps-launch: restart 1 of server 1 at "), "%s", text);
    s_summary(&r, text, sizeof text);
    cr_assert(strstr(text, "\"restarts\": 1"), "%s", text);
    cr_assert(strstr(text, "\"how\": \"killed by SIGKILL\""), "%s", text);
    double t = s_event_time(text, 0);
    cr_assert(t >= 0.2 && t < 2.0, "event at %g s:\n%s", t, text);
    lt_assert_all_gone(&r);
    lt_cleanup(&r);
}

/* A server that keeps dying uses up --restart-servers, with the back-off doubling between
 * restarts, and then ends the job. */
Test(it_launch, restarts_back_off_and_run_out, .timeout = 30)
{
    lt_run r;
    const char *env[] = {"ZPS_TEST_DIE=0", "ZPS_TEST_HOW=always", "ZPS_TEST_RUN=30", NULL};
    s_sup_setup(&r, env);
    const char *args[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run",
                          "--restart-servers", "2", "--restart-backoff", "0.4", NULL};
    lt_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "restart 1 of 2 in 0.4 s"), "%s", r.out);
    cr_assert(strstr(r.out, "restart 2 of 2 in 0.8 s"), "%s", r.out);
    cr_assert(strstr(r.out, "stopping the job (no restart left)"), "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "server", 0), "killed by SIGKILL (early)", "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 0), "stopped", "%s", r.out);
    char text[8192];
    s_summary(&r, text, sizeof text);
    double t0 = s_event_time(text, 0), t1 = s_event_time(text, 1), t2 = s_event_time(text, 2);
    /* each incarnation lives 0.3 s, then waits out its back-off */
    cr_assert(t1 - t0 >= 0.4 + 0.3 - 0.05, "events at %g %g:\n%s", t0, t1, text);
    cr_assert(t2 - t1 >= 0.8 + 0.3 - 0.05, "events at %g %g:\n%s", t1, t2, text);
    cr_assert(s_event_time(text, 3) < 0, "a fourth death:\n%s", text);
    lt_assert_all_gone(&r);
    lt_cleanup(&r);
}

/* A server that exits (status 0) while the trainers still run is a failure, not "ok". */
Test(it_launch, server_exiting_early_is_a_failure, .timeout = 30)
{
    lt_run r;
    const char *env[] = {"ZPS_TEST_DIE=1", "ZPS_TEST_HOW=exit0", "ZPS_TEST_RUN=30", NULL};
    s_sup_setup(&r, env);
    const char *args[] = {"--servers", "2", "--trainers", "1", "--run-dir", "run",
                          "--restart-servers", "0", "--timeout", "15", NULL};
    lt_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "server 1 failed: exit 0 (early)"), "%s", r.out);
    cr_assert(strstr(r.out, "stopping the job (restarts off)"), "%s", r.out);
    cr_assert_null(strstr(r.out, "server 1 finished"), "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "server", 1), "exit 0 (early)", "%s", r.out);
    lt_assert_all_gone(&r);
    lt_cleanup(&r);
}

/* --on-trainer-exit: restart (the default) brings a killed trainer back and the job ends
 * well; continue goes on without it; stop ends the job. */
Test(it_launch, trainer_exit_policies, .timeout = 40)
{
    lt_run r;
    const char *env[] = {"ZPS_TEST_TDIE=1", NULL};
    s_sup_setup(&r, env);
    const char *restart[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run", NULL};
    lt_launch(&r, 0, NULL, restart);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "trainer 1 failed: killed by SIGKILL at "), "%s", r.out);
    cr_assert(strstr(r.out, "restart 1 of 3 in 0.5 s\n"), "%s", r.out);
    cr_assert(strstr(r.out, "started trainer 1 pid "), "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 1), "ok", "%s", r.out);
    lt_assert_all_gone(&r);

    const char *cont[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run",
                          "--on-trainer-exit", "continue", NULL};
    lt_launch(&r, 0, NULL, cont);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert(strstr(r.out, "job goes on without it"), "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 1), "killed by SIGKILL (job went on)", "%s",
                     r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 0), "ok", "%s", r.out);
    cr_assert_eq(r.n_pids, 3, "%s", r.out);

    const char *stop[] = {"--servers", "1", "--trainers", "2", "--run-dir", "run",
                          "--on-trainer-exit", "stop", NULL};
    lt_launch(&r, 0, NULL, stop);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "stopping the job (restarts off)"), "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "trainer", 0), "stopped", "%s", r.out);
    lt_assert_all_gone(&r);

    const char *bad[] = {"--servers", "1", "--trainers", "1", "--on-trainer-exit", "maybe",
                         NULL};
    lt_launch(&r, 0, NULL, bad);
    cr_assert_eq(r.code, 2, "%s", r.out);
    const char *neg[] = {"--servers", "1", "--trainers", "1", "--restart-servers", "-1", NULL};
    lt_launch(&r, 0, NULL, neg);
    cr_assert_eq(r.code, 2, "%s", r.out);
    lt_cleanup(&r);
}

/* Stopping: servers get SIGTERM once the trainers are done (the real server exits 0 on it:
 * row "ok"); one that ignores SIGTERM gets SIGKILL after --grace. --before-stop runs
 * between the two, while the servers are still up. */
Test(it_launch, graceful_stop_then_sigkill, .timeout = 30)
{
    lt_run r;
    const char *env[] = {"ZPS_TEST_RUN=0.3", NULL};
    s_sup_setup(&r, env);
    const char *args[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run",
                          "--before-stop", "echo hook {n_servers} > {run_dir}/hook.txt", NULL};
    lt_launch(&r, 0, NULL, args);
    cr_assert_eq(r.code, 0, "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "server", 0), "ok", "%s", r.out);
    char path[256], text[256];
    snprintf(path, sizeof path, "%s/run/hook.txt", r.dir);
    cr_assert_str_eq(lt_read_file(path, text, sizeof text), "hook 1\n");
    const char *fail_hook[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run",
                               "--before-stop", "exit 3", NULL};
    lt_launch(&r, 0, NULL, fail_hook);
    cr_assert_eq(r.code, 1, "%s", r.out);
    cr_assert(strstr(r.out, "before-stop failed: exit 3"), "%s", r.out);

    const char *deaf_env[] = {"ZPS_TEST_RUN=0.3", "ZPS_TEST_DEAF=1", NULL};
    lt_cleanup(&r); // a fresh directory for the second fleet: the first one's goes
    s_sup_setup(&r, deaf_env);
    const char *deaf[] = {"--servers", "1", "--trainers", "1", "--run-dir", "run", "--grace",
                          "1", NULL};
    lt_launch(&r, 0, NULL, deaf);
    cr_assert(strstr(r.out, "server 0 ignored SIGTERM for 1 s: SIGKILL"), "%s", r.out);
    cr_assert_str_eq(lt_row_status(&r, "server", 0), "stopped", "%s", r.out);
    cr_assert_eq(r.code, 0, "%s", r.out);
    lt_assert_all_gone(&r);
    lt_cleanup(&r);
}
