/* test_trace.c — zps-trainer --trace (trainer/trace.c), suite it_trace: real trainers write
 * their timelines, and tests/ref/trace_check.py validates each file against the Chrome
 * trace-event format (fields, phases, matched async pairs, properly nested complete events)
 * and checks what it must show:
 *  - local: the "step" spans of exactly the window --trace-from/--trace-steps names, each
 *    with input, forward, backward inside;
 *  - all-reduce (2 trainers under zps-launch, "{trainer}" in the path): each trainer's
 *    file, with the bucket reductions as async spans overlapping backward;
 *  - a PS fleet (sync, 2 servers, 2 trainers): pushes overlapping backward, also with
 *    --accumulate 2 (the last micro-batch's backward);
 *  - an unwritable path is refused before training (exit 1, one line); a run that ends
 *    before the window says so and writes nothing.
 * The checker needs nothing but Debian's python3.
 */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/testutil.h"

static char s_tmp[512], s_data[600];

static void s_init(void)
{
    zt_mktmp(s_tmp, sizeof s_tmp, "zps-trace");
    char log[600];
    snprintf(s_data, sizeof s_data, "%s/fm", s_tmp);
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    zt_make_fashion(s_data, 512, 2, log);
}

static void s_fini(void)
{
    if (s_tmp[0])
        zt_rmtmp(s_tmp);
    s_tmp[0] = 0;
}

/* trace_check.py over files with extra checks (NULL-terminated lists); asserts it passed. */
static void s_check(const char *const *files, const char *const *extra)
{
    const char *root = getenv("ZPS_ROOT");
    char script[4096];
    snprintf(script, sizeof script, "%s/tests/ref/trace_check.py", root ? root : ".");
    const char *argv[24] = {script};
    int n = 1;
    for (int i = 0; files[i] && n < 12; i++)
        argv[n++] = files[i];
    for (int i = 0; extra[i] && n < 23; i++)
        argv[n++] = extra[i];
    argv[n] = NULL;
    char *out;
    int rc = zt_run_tmp("/usr/bin/python3", argv, NULL, 120, &out);
    cr_assert_eq(rc, 0, "the timeline is not valid or misses what it must show:\n%s", out);
    free(out);
}

Test(it_trace, local_window_has_exactly_its_steps, .init = s_init, .fini = s_fini,
     .timeout = 300)
{
    char trace[700];
    snprintf(trace, sizeof trace, "%s/local.json", s_tmp);
    const char *args[] = {"--data", s_data, "--model", "convnet", "--steps", "10",
                          "--no-progress", "--trace", trace, "--trace-from", "3",
                          "--trace-steps", "4", NULL};
    char *out;
    cr_assert_eq(zt_run_tmp("zps-trainer", args, NULL, 120, &out), 0, "%s", out);
    cr_assert(strstr(out, "wrote the timeline of steps 3..6"), "%s", out);
    free(out);
    const char *files[] = {trace, NULL}, *extra[] = {"--steps", "3,4,5,6", NULL};
    s_check(files, extra);
    cr_assert(zt_file_has(trace, "\"name\":\"backward\""), "no backward span");
    cr_assert(zt_file_has(trace, "\"name\":\"forward\""), "no forward span");
}

/* zps-launch with --trainer-args: 2 trainers, "{trainer}" in the trace path; extra
 * flags (servers, mode, more trainer flags) and the checks after. */
static void s_fleet_traces(const char *servers, const char *mode, const char *more,
                           const char *overlap)
{
    const char *root = getenv("ZPS_ROOT"), *bin = getenv("ZPS_BIN");
    char launch[4096], targs[1600], run[700], t0[700], t1[700];
    snprintf(launch, sizeof launch, "%s/scripts/zps-launch", root ? root : ".");
    snprintf(run, sizeof run, "%s/run", s_tmp);
    snprintf(targs, sizeof targs, "--mode %s --data %s --model convnet --steps 10 "
             "--no-progress --trace %s/t-{trainer}.json %s", mode, s_data, s_tmp, more);
    snprintf(t0, sizeof t0, "%s/t-0.json", s_tmp);
    snprintf(t1, sizeof t1, "%s/t-1.json", s_tmp);
    const char *args[] = {"--bin-dir", bin ? bin : "build/bin", "--trainers", "2", "--servers",
                          servers, "--run-dir", run, "--timeout", "200", "--trainer-args", targs,
                          NULL};
    char *out;
    cr_assert_eq(zt_run_tmp(launch, args, NULL, 240, &out), 0, "%s", out);
    free(out);
    const char *files[] = {t0, t1, NULL};
    const char *extra[] = {"--steps", "5,6,7", "--overlap", overlap, NULL};
    s_check(files, extra);
}

Test(it_trace, allreduce_buckets_overlap_backward, .init = s_init, .fini = s_fini,
     .timeout = 300)
{
    s_fleet_traces("0", "allreduce", "", "allreduce");
}

/* A sync PS fleet (2 servers, 2 trainers): each bucket's PUSHPULL is a span from the moment
 * it leaves during backward to its reply, overlapping backward. */
Test(it_trace, sync_pushes_overlap_backward, .init = s_init, .fini = s_fini, .timeout = 300)
{
    s_fleet_traces("2", "sync", "", "pushpull");
}

/* The same with --accumulate 2: the last micro-batch's backward averages each layer and
 * hands it on at once, so the pushes still overlap backward (they used to leave only after
 * it, one variable at a time). */
Test(it_trace, accumulated_pushes_overlap_the_last_backward, .init = s_init, .fini = s_fini,
     .timeout = 300)
{
    s_fleet_traces("2", "sync", "--accumulate 2", "pushpull");
}

Test(it_trace, unwritable_path_is_refused_and_a_short_run_writes_nothing, .init = s_init,
     .fini = s_fini, .timeout = 120)
{
    char trace[700];
    snprintf(trace, sizeof trace, "%s/no/such/dir/t.json", s_tmp);
    const char *bad[] = {"--data", s_data, "--model", "mlp", "--steps", "3", "--no-progress",
                         "--trace", trace, NULL};
    char *out;
    int rc = zt_run_tmp("zps-trainer", bad, NULL, 60, &out);
    cr_assert_eq(rc, 1, "exit %d\n%s", rc, out);
    cr_assert(strstr(out, "--trace") && strstr(out, "cannot create"), "%s", out);
    free(out);
    snprintf(trace, sizeof trace, "%s/short.json", s_tmp);
    const char *shortrun[] = {"--data", s_data, "--model", "mlp", "--steps", "3",
                              "--no-progress", "--trace", trace, NULL};
    rc = zt_run_tmp("zps-trainer", shortrun, NULL, 60, &out);
    cr_assert_eq(rc, 0, "exit %d\n%s", rc, out);
    cr_assert(strstr(out, "the run ended before step 5: no timeline"), "%s", out);
    cr_assert(access(trace, F_OK) != 0, "%s written by a run that never reached the window",
              trace);
    free(out);
}
