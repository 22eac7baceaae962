/* test_metrics.c — trainer/metrics.h: the JSON Lines records (read back and checked field by
 * field against the random steps fed in), the summary totals, null for unmeasured values,
 * the progress line as plain lines on a file and in place on a pseudo-terminal, and no heap
 * growth per step. The clock is the test hook (tr_metrics_set_fake_time), so rates are exact.
 * Suite it_metrics (below) runs zps-trainer and zps-server and reads their metrics files.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <signal.h>
#include <malloc.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/version.h"
#include "ps/server.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"
#include "trainer/metrics.h"

static uint64_t s_rng;
static double s_uniform(void)
{
    s_rng ^= s_rng << 13, s_rng ^= s_rng >> 7, s_rng ^= s_rng << 17;
    return (double)(s_rng >> 11) / 9007199254740992.0;
}
static uint64_t s_seed(void)
{
    uint64_t s = (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)getpid() ^ (uint64_t)clock();
    s_rng = s | 1;
    return s;
}

/* number after "key": in line (NAN when null, -999 when the key is absent) */
static double s_field(const char *line, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    const char *p = strstr(line, pat);
    if (!p)
        return -999;
    p += strlen(pat);
    if (!strncmp(p, "null", 4))
        return NAN;
    return strtod(p, NULL);
}

static char *s_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    static char buf[1 << 20];
    *len = fread(buf, 1, sizeof buf - 1, f);
    buf[*len] = 0;
    fclose(f);
    return buf;
}

/* An empty file of its own at the mkstemp template path (rewritten in place). */
static void s_mktemp(char *path)
{
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0, "mkstemp %s", path);
    close(fd);
}

enum { N_STEPS = 40 };

/* What the test fed tr_metrics (index = step, 1..N_STEPS), and the totals the summary must
 * report. */
typedef struct fed {
    uint64_t seed;
    double t, loss[N_STEPS + 1], dt[N_STEPS + 1], acc[N_STEPS + 1], stale[N_STEPS + 1];
    uint64_t push_total, pull_total, images_total;
    double best, first_hit, wait_total, stale_sum, stale_max;
    int n_stale;
} fed;

/* Records N_STEPS random steps into m (a NaN loss at step 7, staleness unknown every third
 * step, an evaluation every fifth), keeping what a reader of the file must find in f. */
static void s_feed_steps(tr_metrics *m, fed *f)
{
    f->best = f->first_hit = f->stale_max = -1;
    for (int s = 1; s <= N_STEPS; s++) {
        tr_step_record r = tr_step_record_empty(s);
        f->dt[s] = 0.01 + s_uniform();
        f->t += f->dt[s];
        tr_metrics_set_fake_time(m, f->t);
        r.images = 16 + (int64_t)(s_uniform() * 48);
        r.loss = f->loss[s] = s == 7 ? NAN : 0.1 + 2 * s_uniform();
        r.bytes_pushed = 1000 + (uint64_t)(s_uniform() * 1e6);
        r.bytes_pulled = r.bytes_pushed / 2;
        r.net_wait_s = s_uniform() * f->dt[s];
        f->stale[s] = s % 3 ? floor(s_uniform() * 4) : -1;
        r.staleness = f->stale[s];
        f->acc[s] = s % 5 == 0 ? s_uniform() : -1;
        r.test_accuracy = f->acc[s];
        r.test_loss = f->acc[s] >= 0 ? 1 - f->acc[s] : -1;
        f->push_total += r.bytes_pushed;
        f->pull_total += r.bytes_pulled;
        f->images_total += (uint64_t)r.images;
        f->wait_total += r.net_wait_s;
        if (f->stale[s] >= 0) {
            f->stale_sum += f->stale[s];
            f->n_stale++;
            f->stale_max = f->stale[s] > f->stale_max ? f->stale[s] : f->stale_max;
        }
        if (f->acc[s] > f->best)
            f->best = f->acc[s];
        if (f->acc[s] >= 0.8 && f->first_hit < 0)
            f->first_hit = f->t;
        cr_assert_eq(tr_metrics_step(m, &r), ZPS_OK);
    }
}

static void s_check_start(const char *l)
{
    cr_assert(strstr(l, "\"type\":\"start\""), "%s", l);
    cr_assert(strstr(l, "\"mode\":\"as\\\"ync\""), "escaped mode: %s", l);
    cr_assert_eq(s_field(l, "batch"), 32.0);
    cr_assert_float_eq(s_field(l, "target_accuracy"), 0.8, 1e-12);
    cr_assert_eq(s_field(l, "seed"), 77.0);
    cr_assert_eq(s_field(l, "pid"), (double)getpid());
    cr_assert(strstr(l, ",\"config\":{\"batch-size\":32}}"), "the configuration last: %s", l);
}

static void s_check_summary(const char *l, const fed *f)
{
    double t = f->t;
    cr_assert(strstr(l, "\"type\":\"summary\""), "%s", l);
    cr_assert_eq(s_field(l, "steps"), (double)N_STEPS);
    cr_assert_eq(s_field(l, "images"), (double)f->images_total);
    cr_assert_eq(s_field(l, "bytes_pushed"), (double)f->push_total);
    cr_assert_eq(s_field(l, "bytes_pulled"), (double)f->pull_total);
    cr_assert_float_eq(s_field(l, "time"), t, 1e-5 * t);
    cr_assert_float_eq(s_field(l, "img_s"), (double)f->images_total / t, 1e-4);
    cr_assert_float_eq(s_field(l, "best_accuracy"), f->best, 1e-5, "seed %llx",
                       (unsigned long long)f->seed);
    cr_assert_float_eq(s_field(l, "net_wait"), f->wait_total, 1e-4 * f->wait_total + 1e-6);
    cr_assert_float_eq(s_field(l, "staleness_mean"), f->stale_sum / f->n_stale, 1e-5);
    cr_assert_float_eq(s_field(l, "staleness_max"), f->stale_max, 1e-9);
    if (f->first_hit >= 0)
        cr_assert_float_eq(s_field(l, "time_to_target"), f->first_hit, 1e-5 * f->first_hit);
    else
        cr_assert(isnan(s_field(l, "time_to_target")), "%s", l);
    cr_assert_eq(s_field(l, "evals"), (double)(N_STEPS / 5));
}

/* The record of step s; *tprev is the time of the record before it (updated). */
static void s_check_step(const char *l, int s, const fed *f, double *tprev)
{
    cr_assert(strstr(l, "\"type\":\"step\""), "%s", l);
    cr_assert_eq(s_field(l, "step"), (double)s);
    double tt = s_field(l, "time");
    cr_assert_float_eq(tt - *tprev, f->dt[s], 1e-5, "step %d seed %llx", s,
                       (unsigned long long)f->seed);
    cr_assert_float_eq(s_field(l, "img_s") * f->dt[s], s_field(l, "images"), 1e-3);
    *tprev = tt;
    if (isnan(f->loss[s]))
        cr_assert(isnan(s_field(l, "loss")), "NaN loss must be null: %s", l);
    else
        cr_assert_float_eq(s_field(l, "loss"), f->loss[s], 1e-5 * f->loss[s]);
    if (f->stale[s] < 0)
        cr_assert(isnan(s_field(l, "staleness")), "unknown staleness must be null: %s", l);
    else
        cr_assert_eq(s_field(l, "staleness"), f->stale[s]);
    if (f->acc[s] >= 0) {
        cr_assert_float_eq(s_field(l, "accuracy"), f->acc[s], 1e-5);
        cr_assert_float_eq(s_field(l, "test_loss"), 1 - f->acc[s], 1e-5);
    } else {
        cr_assert_eq(s_field(l, "accuracy"), -999, "no accuracy when not evaluated: %s", l);
    }
    cr_assert_eq(s_field(l, "lr"), -999);
}

Test(metrics, jsonl_records_match_the_steps, .timeout = 10)
{
    zps_log_set_level(ZPS_LOG_OFF);
    fed f = {.seed = s_seed()};
    char path[] = "/tmp/zps-metrics-XXXXXX";
    s_mktemp(path);
    FILE *prog = tmpfile();
    tr_metrics_opts o = {.jsonl_path = path, .progress = prog, .trainer_id = 1,
                         .mode_name = "as\"ync", .model = "lenet", .batch = 32,
                         .n_trainers = 2, .total_steps = 40, .target_accuracy = 0.8,
                         .seed = 77, .config_json = "{\"batch-size\":32}"};
    tr_metrics *m = NULL;
    cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK);
    s_feed_steps(m, &f);
    tr_metrics_totals tot;
    tr_metrics_get_totals(m, &tot);
    cr_assert_eq(tot.steps, N_STEPS);
    cr_assert_eq((uint64_t)tot.images, f.images_total);
    cr_assert_eq(tr_metrics_finish(m), ZPS_OK);
    tr_step_record late = tr_step_record_empty(N_STEPS + 1);
    cr_assert_eq(tr_metrics_step(m, &late), ZPS_ERR_INVALID);
    tr_metrics_destroy(&m);
    cr_assert_null(m);
    fclose(prog);

    size_t len;
    char *text = s_slurp(path, &len);
    unlink(path);
    cr_assert_eq(text[len - 1], '\n');
    int lines = 0;
    char *save = NULL;
    double tprev = 0;
    for (char *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save), lines++) {
        cr_assert_eq(l[0], '{', "line %d: %s", lines, l);
        cr_assert_eq(l[strlen(l) - 1], '}', "line %d: %s", lines, l);
        cr_assert_eq(s_field(l, "trainer"), 1.0);
        if (lines == 0)
            s_check_start(l);
        else if (lines == N_STEPS + 1)
            s_check_summary(l, &f);
        else
            s_check_step(l, lines, &f, &tprev);
    }
    cr_assert_eq(lines, N_STEPS + 2);
}

/* feeds n steps at 0.1 s, evaluating every `eval` steps (0: never) */
static void s_feed(tr_metrics *m, int n, int eval)
{
    for (int s = 1; s <= n; s++) {
        tr_metrics_set_fake_time(m, 0.1 * s);
        tr_step_record r = tr_step_record_empty(s);
        r.images = 10;
        r.loss = 1.0 / s;
        if (eval && s % eval == 0)
            r.test_accuracy = 0.5 + 0.001 * s;
        cr_assert_eq(tr_metrics_step(m, &r), ZPS_OK);
    }
}

/* An evaluation's time is its own: the evaluating step's record has eval_s and an img_s
 * over its training time only, like the progress line's rate; the summary adds the
 * evaluations up in eval_time, and its img_s (what the run delivered) includes them. Steps
 * of 0.1 s and 10 images; every 5th step also evaluates for 0.4 s. */
Test(metrics, an_evaluation_is_timed_apart_from_training, .timeout = 10)
{
    char path[] = "/tmp/zps-metrics-XXXXXX";
    s_mktemp(path);
    FILE *prog = tmpfile();
    tr_metrics_opts o = {.jsonl_path = path, .progress = prog, .progress_every_s = 1000,
                         .trainer_id = 0, .total_steps = 20};
    tr_metrics *m = NULL;
    cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK);
    double now = 0;
    for (int s = 1; s <= 20; s++) {
        tr_step_record r = tr_step_record_empty(s);
        r.images = 10;
        r.loss = 1.0;
        now += 0.1;
        if (s % 5 == 0) {
            r.test_accuracy = 0.5;
            r.eval_s = 0.4;
            now += 0.4;
        }
        tr_metrics_set_fake_time(m, now);
        cr_assert_eq(tr_metrics_step(m, &r), ZPS_OK);
    }
    tr_metrics_totals tot;
    tr_metrics_get_totals(m, &tot);
    cr_assert_float_eq(tot.eval_s, 1.6, 1e-9);
    tr_metrics_destroy(&m);
    size_t len;
    char *text = s_slurp(path, &len);
    unlink(path);
    char *save = NULL;
    int lines = 0;
    for (char *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save), lines++) {
        if (lines == 0)
            continue;
        if (lines == 21) {
            cr_assert_float_eq(s_field(l, "eval_time"), 1.6, 1e-6, "%s", l);
            cr_assert_float_eq(s_field(l, "img_s"), 200 / 3.6, 1e-3, "%s", l);
            continue;
        }
        cr_assert_float_eq(s_field(l, "img_s"), 100, 1e-3, "training's rate: %s", l);
        if (lines % 5 == 0)
            cr_assert_float_eq(s_field(l, "eval_s"), 0.4, 1e-6, "%s", l);
        else
            cr_assert_eq(s_field(l, "eval_s"), -999, "eval_s without an evaluation: %s", l);
    }
    cr_assert_eq(lines, 22);
    rewind(prog);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, prog);
    buf[n] = 0;
    fclose(prog);
    cr_assert(strstr(buf, "| 100 img/s"), "the progress line's rate leaves evaluations out: %s",
              buf);
    cr_assert_null(strstr(buf, "| 55 img/s"), "%s", buf);
}

Test(metrics, plain_progress_lines_on_a_file)
{
    FILE *prog = tmpfile();
    tr_metrics_opts o = {.progress = prog, .progress_every_s = 2.0, .trainer_id = 0,
                         .total_steps = 100};
    tr_metrics *m = NULL;
    cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK);
    s_feed(m, 100, 0); // 10 s of steps: first step + one line per 2 s (+ the last step)
    tr_metrics_destroy(&m);
    rewind(prog);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, prog);
    buf[n] = 0;
    fclose(prog);
    cr_assert_null(strchr(buf, '\r'), "no carriage returns on a file: %s", buf);
    cr_assert_null(strstr(buf, "\033["), "no escape codes on a file");
    int lines = 0;
    for (char *p = buf; *p; p++)
        lines += *p == '\n';
    cr_assert(lines >= 6 && lines <= 8, "%d lines:\n%s", lines, buf);
    cr_assert(strstr(buf, "step 100/100 (100%)"), "%s", buf);
    cr_assert(strstr(buf, "100 img/s"), "rate from the fake clock: %s", buf);
    cr_assert(strstr(buf, "done: 100 steps in 10s"), "%s", buf);
}

Test(metrics, in_place_progress_on_a_terminal, .timeout = 10)
{
    int master = posix_openpt(O_RDWR | O_NOCTTY);
    cr_assert_geq(master, 0);
    cr_assert_eq(grantpt(master), 0);
    cr_assert_eq(unlockpt(master), 0);
    int slave = open(ptsname(master), O_RDWR | O_NOCTTY);
    cr_assert_geq(slave, 0);
    FILE *tty = fdopen(slave, "w");
    tr_metrics_opts o = {.progress = tty, .trainer_id = 3, .total_steps = 50};
    tr_metrics *m = NULL;
    cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK); // AUTO: isatty decides
    s_feed(m, 50, 10);
    tr_metrics_destroy(&m);
    fclose(tty);
    char buf[16384];
    size_t n = 0;
    ssize_t k;
    fcntl(master, F_SETFL, O_NONBLOCK);
    while (n < sizeof buf - 1 && (k = read(master, buf + n, sizeof buf - 1 - n)) > 0)
        n += (size_t)k;
    buf[n] = 0;
    close(master);
    cr_assert(strstr(buf, "\rtrainer 3 | step"), "in-place updates start with CR: %s", buf);
    cr_assert(strstr(buf, "\033[K"), "erase to end of line");
    cr_assert(strstr(buf, "test acc 55.00%"), "accuracy of step 50: %s", buf);
    /* updates are throttled to 0.2 s: 50 steps of 0.1 s give ~25, not 50 */
    int crs = 0, nls = 0;
    for (char *p = buf; *p; p++) {
        crs += *p == '\r' && p[1] != '\n';
        nls += *p == '\n';
    }
    cr_assert(crs >= 20 && crs <= 35, "%d in-place updates", crs);
    cr_assert_eq(nls, 2, "only the end of the progress line and the summary end lines");
    cr_assert(strstr(buf, "done: 50 steps"), "%s", buf);
}

Test(metrics, steps_do_not_grow_the_heap)
{
    FILE *prog = tmpfile();
    char path[] = "/tmp/zps-metrics-XXXXXX";
    s_mktemp(path); /* its return checked now, as in the other tests */
    tr_metrics_opts o = {.jsonl_path = path, .progress = prog, .mode = TR_PROGRESS_PLAIN,
                         .progress_every_s = 1};
    tr_metrics *m = NULL;
    cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK);
    s_feed(m, 10, 5); // first writes allocate stdio buffers
    struct mallinfo2 before = mallinfo2();
    for (int s = 11; s <= 2000; s++) {
        tr_metrics_set_fake_time(m, 0.1 * s);
        tr_step_record r = tr_step_record_empty(s);
        r.images = 8;
        r.loss = 0.5;
        r.test_accuracy = s % 100 ? -1 : 0.9;
        cr_assert_eq(tr_metrics_step(m, &r), ZPS_OK);
    }
    struct mallinfo2 after = mallinfo2();
    cr_assert_eq(after.uordblks, before.uordblks, "heap in use changed over 1990 steps");
    tr_metrics_destroy(&m);
    fclose(prog);
    unlink(path);
}

Test(metrics, unwritable_path_is_an_error)
{
    zps_log_set_level(ZPS_LOG_OFF);
    tr_metrics_opts o = {.jsonl_path = "/nonexistent-dir/m.jsonl", .mode = TR_PROGRESS_OFF};
    tr_metrics *m = (tr_metrics *)1;
    cr_assert_eq(tr_metrics_new(&o, &m), ZPS_ERR_NOT_FOUND);
    cr_assert_null(m);
}

/* A detector run (score_map): its evaluations are "map" (not "accuracy"), its steps carry the
 * loss's parts, its start and summary name the target and results after mAP, and its
 * progress lines say "test mAP". */
Test(metrics, detector_runs_report_map_and_the_loss_parts, .timeout = 10)
{
    zps_log_set_level(ZPS_LOG_OFF);
    char path[] = "/tmp/zps-metrics-XXXXXX";
    s_mktemp(path);
    FILE *prog = tmpfile();
    tr_metrics_opts o = {.jsonl_path = path, .progress = prog, .mode = TR_PROGRESS_PLAIN,
                         .trainer_id = 0, .total_steps = 2, .target_accuracy = 0.5,
                         .score_map = 1};
    tr_metrics *m = NULL;
    cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK);
    for (int s = 1; s <= 2; s++) {
        tr_step_record r = tr_step_record_empty(s);
        r.images = 8;
        r.loss = 3.5;
        r.loss_conf = 2.25;
        r.loss_loc = 1.25;
        r.matched = 40 + s;
        if (s == 2) {
            r.test_map = 0.625;
            r.test_loss = 3.0;
        }
        cr_assert_eq(tr_metrics_step(m, &r), ZPS_OK);
    }
    tr_metrics_destroy(&m);
    size_t len;
    char *text = s_slurp(path, &len);
    unlink(path);
    cr_assert(strstr(text, "\"target_map\":0.5"), "%s", text);
    cr_assert(strstr(text, "\"loss_conf\":2.25,\"loss_loc\":1.25,\"matched\":41"), "%s", text);
    cr_assert(strstr(text, "\"matched\":42,\"map\":0.625,\"test_loss\":3"), "%s", text);
    cr_assert(strstr(text, "\"final_map\":0.625,\"best_map\":0.625"), "%s", text);
    cr_assert_null(strstr(text, "accuracy\":0.6"), "%s", text);
    cr_assert(s_field(strstr(text, "\"type\":\"summary\""), "time_to_target") >= 0);
    rewind(prog);
    char buf[4096];
    size_t n = fread(buf, 1, sizeof buf - 1, prog);
    buf[n] = 0;
    fclose(prog);
    cr_assert(strstr(buf, "test mAP 62.50%"), "%s", buf);
    cr_assert(strstr(buf, "test mAP@0.5 62.50% (best 62.50%)"), "%s", buf);
}

/* After a sync rollback the trainer runs steps again (docs/ps.md "Recovery"): the summary
 * counts distinct steps, and the repeated records as redone_steps; images count both. */
Test(metrics, redone_steps_count_once, .timeout = 10)
{
    zps_log_set_level(ZPS_LOG_OFF);
    char path[] = "/tmp/zps-metrics-XXXXXX";
    s_mktemp(path);
    tr_metrics_opts o = {.jsonl_path = path, .mode_name = "sync", .model = "mlp", .batch = 8,
                         .n_trainers = 2, .total_steps = 6};
    tr_metrics *m = NULL;
    cr_assert_eq(tr_metrics_new(&o, &m), ZPS_OK);
    const int order[] = {1, 2, 3, 4, 3, 4, 5, 6}; /* rolled back to step 3 after step 4 */
    for (int i = 0; i < 8; i++) {
        tr_step_record r = tr_step_record_empty(order[i]);
        r.images = 8;
        r.loss = 1.0;
        cr_assert_eq(tr_metrics_step(m, &r), ZPS_OK);
    }
    tr_metrics_totals tot;
    tr_metrics_get_totals(m, &tot);
    cr_assert_eq(tot.steps, 6);
    cr_assert_eq(tot.redone_steps, 2);
    cr_assert_eq(tot.images, 64);
    cr_assert_eq(tr_metrics_finish(m), ZPS_OK);
    tr_metrics_destroy(&m);
    size_t len;
    char *text = s_slurp(path, &len);
    unlink(path);
    const char *sum = strstr(text, "\"type\":\"summary\"");
    cr_assert_not_null(sum, "%s", text);
    cr_assert_eq(s_field(sum, "steps"), 6, "%s", sum);
    cr_assert_eq(s_field(sum, "redone_steps"), 2, "%s", sum);
}

/* ================================================================ it_metrics: real processes
 *
 * The metrics files zps-trainer and zps-server write, read back with Python's json module
 * (a real parser, and the one scripts/compare reads them with). The tests wait on the files'
 * content, never on the clock. */

/* Runs python3 -c script with args (NULL-terminated); its exit status (0: the checks held;
 * it prints what failed). */
static int s_python(const char *script, const char *const *args)
{
    const char *argv[16] = {"python3", "-c", script};
    int n = 3;
    for (int i = 0; args[i] && n < 15; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        execvp("python3", (char *const *)argv);
        _exit(127);
    }
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(WIFEXITED(st), "python3 died");
    return WEXITSTATUS(st);
}

/* Waits (<= timeout_s) until a line of path has want and, when key is given, the number
 * after "key": at least min. */
static void s_wait_line(const char *path, const char *want, const char *key, double min,
                        double timeout_s)
{
    double end = zps_now_s() + timeout_s;
    static char line[1 << 16];
    for (;;) {
        FILE *f = fopen(path, "r");
        int found = 0;
        while (f && !found && fgets(line, sizeof line, f))
            found = strstr(line, want) && (!key || s_field(line, key) >= min);
        if (f)
            fclose(f);
        if (found)
            return;
        cr_assert(zps_now_s() < end, "no line with %s (%s >= %g) in %s after %.0f s", want,
                  key ? key : "-", min, path, timeout_s);
        zps_sleep_ns(10 * 1000 * 1000);
    }
}

/* Runs $ZPS_BIN/<prog> with args, output into log; fails unless it exits 0 within
 * timeout_s. Returns its pid. */
static pid_t s_run_ok(const char *prog, const char *const *args, const char *log,
                      double timeout_s)
{
    pst_server p;
    cr_assert_eq(pst_start(&p, prog, log, args), 0);
    pid_t pid = p.pid;
    int st = pst_wait(&p, timeout_s);
    if (st == -1)
        pst_kill(&p, SIGKILL);
    if (st == -1 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        pst_dump(log);
        cr_assert_fail("%s failed (wait status %d)", prog, st);
    }
    return pid;
}

static const char s_check_trainer_start[] =
    "import json, socket, sys, datetime\n"
    "path, want = sys.argv[1], json.loads(sys.argv[2])\n"
    "with open(path) as f:\n"
    "    r = json.loads(f.readline())\n"
    "help_flags = {l.split()[0][2:] for l in open(sys.argv[3]) if l.startswith('  --')}\n"
    "bad = []\n"
    "def check(what, got, exp):\n"
    "    if got != exp: bad.append('%s: %r, not %r' % (what, got, exp))\n"
    "check('type', r.get('type'), 'start')\n"
    "for k, v in want['top'].items(): check(k, r.get(k), v)\n"
    "for k, v in want['config'].items(): check('config ' + k, r['config'].get(k, 'ABSENT'), v)\n"
    "check('host', r.get('host'), socket.gethostname())\n"
    "w = r.get('wall_ms', 0)\n"
    "if not want['t0'] <= w <= want['t1']: bad.append('wall_ms %r outside the run' % w)\n"
    "t = datetime.datetime.strptime(r['start_time'], '%Y-%m-%dT%H:%M:%SZ')\n"
    "t = t.replace(tzinfo=datetime.timezone.utc).timestamp()\n"
    "if abs(t - w / 1000) > 1: bad.append('start_time %s is not wall_ms' % r['start_time'])\n"
    "missing = help_flags - set(r['config']) - {'help', 'version'}\n"
    "if missing: bad.append('flags of --help not in config: %s' % sorted(missing))\n"
    "for b in bad: print('start record:', b)\n"
    "sys.exit(1 if bad else 0)\n";

/* zps-trainer's start record holds the command line's values (and the defaults of the
 * flags not given), the seed, host, pid, start time and the build's version and hash. */
Test(it_metrics, trainer_start_record_holds_the_configuration, .timeout = 120)
{
    char dir[512], data[600], log[600], path[600], help[600];
    zt_mktmp(dir, sizeof dir, "zps-metrics");
    snprintf(data, sizeof data, "%s/fm", dir);
    snprintf(log, sizeof log, "%s/run.log", dir);
    snprintf(path, sizeof path, "%s/m.jsonl", dir);
    snprintf(help, sizeof help, "%s/help.txt", dir);
    const char *conv[] = {"convert", "fashion-mnist", "--out", data, "--limit", "256", NULL};
    s_run_ok("zps-data", conv, log, 60);
    const char *hargs[] = {"--help", NULL};
    s_run_ok("zps-trainer", hargs, help, 30);
    uint64_t t0 = zps_wall_ms();
    const char *args[] = {"--data", data, "--model", "mlp", "--batch-size", "16", "--steps", "3",
                          "--optimizer", "adam", "--lr", "0.0123", "--seed", "4242", "--metrics",
                          path, "--no-progress", "--threads", "0", "--log-level", "warn", NULL};
    pid_t pid = s_run_ok("zps-trainer", args, log, 90);
    char want[4096];
    snprintf(want, sizeof want,
             "{\"t0\":%llu,\"t1\":%llu,\"top\":{\"trainer\":0,\"mode\":\"local\",\"model\":\"mlp\","
             "\"batch\":16,\"total_steps\":3,\"seed\":4242,\"pid\":%d,\"version\":\"%s\","
             "\"git_hash\":\"%s\"},\"config\":{\"data\":\"%s\",\"model\":\"mlp\","
             "\"batch-size\":16,\"steps\":3,\"optimizer\":\"adam\",\"lr\":0.0123,\"seed\":4242,"
             "\"metrics\":\"%s\",\"no-progress\":true,\"threads\":0,\"log-level\":\"warn\","
             "\"mode\":\"local\",\"epochs\":1,\"momentum\":0.9,\"augment\":false,"
             "\"push-dtype\":\"f32\",\"lr-schedule\":\"constant\",\"accumulate\":1}}",
             (unsigned long long)t0, (unsigned long long)zps_wall_ms(), (int)pid, zps_version(),
             zps_git_hash(), data, path);
    const char *py[] = {path, want, help, NULL};
    int rc = s_python(s_check_trainer_start, py);
    if (rc) {
        pst_dump(path);
        cr_assert_fail("the start record does not match the command line (python3 exit %d)", rc);
    }
    zt_rmtmp(dir);
}

static const char s_check_server_file[] =
    "import json, sys\n"
    "path, stats, spid, tpid, uri = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), "
    "int(sys.argv[4]), sys.argv[5]\n"
    "text = open(path).read()\n"
    "assert text.endswith('\\n'), 'the last record is cut'\n"
    "recs = [json.loads(l) for l in text.splitlines()]\n"
    "bad = []\n"
    "def check(what, got, exp):\n"
    "    if got != exp: bad.append('%s: %r, not %r' % (what, got, exp))\n"
    "s = recs[0]\n"
    "check('first type', s['type'], 'start')\n"
    "for k, v in [('server', 0), ('pid', spid), ('endpoint', uri)]:\n"
    "    check('start ' + k, s.get(k), v)\n"
    "for k in ['host', 'wall_ms', 'start_time', 'version', 'git_hash']:\n"
    "    if k not in s: bad.append('start record without ' + k)\n"
    "check('config metrics', s['config'].get('metrics'), path)\n"
    "check('config metrics-every', s['config'].get('metrics-every'), 0.05)\n"
    "body, end = recs[1:-1], recs[-1]\n"
    "check('middle types', {r['type'] for r in body}, {'stats'})\n"
    "check('last type', end['type'], 'end')\n"
    "check('end', end.get('end'), 'signal')\n"
    "keys = ['pushes', 'pulls', 'bytes_in', 'bytes_out', 'updates', 'version']\n"
    "for a, b in zip(recs[1:], recs[2:]):\n"
    "    if b['time'] < a['time']: bad.append('time went back')\n"
    "    for k in keys:\n"
    "        if b[k] < a[k]: bad.append('%s went down: %r then %r' % (k, a[k], b[k]))\n"
    "check('pushes of the first stats record', body[0]['pushes'], 0)\n"
    "if not end['pushes'] > 0: bad.append('the counters never grew')\n"
    "if not any((r['rates']['pushes_s'] or 0) > 0 for r in body): bad.append('no push rate')\n"
    "after = [r for r in recs[1:] if r['requests']['stats'] >= 1][0]\n"
    "for k in keys + ['trainers', 'live_trainers', 'mode', 'chunks', 'values', 'initialised',\n"
    "                 'rejected_total', 'checkpoints']:\n"
    "    check('record after STATS: ' + k, after.get(k), stats[k])\n"
    "check('end pushes', end['pushes'], stats['pushes'])\n"
    "ts = after['trainer_state']\n"
    "check('trainer_state', [(t['trainer'], t['state'], t['pid']) for t in ts],\n"
    "      [(0, 'live', tpid)])\n"
    "for b in bad: print('server metrics:', b)\n"
    "sys.exit(1 if bad else 0)\n";

/* zps-server --metrics: a start record, STATS records every --metrics-every seconds whose
 * counters grow with the traffic and agree with a STATS reply, and an end record on
 * SIGTERM. */
Test(it_metrics, server_records_agree_with_stats_and_end_on_sigterm, .timeout = 60)
{
    char dir[512], path[600];
    zt_mktmp(dir, sizeof dir, "zps-metrics");
    snprintf(path, sizeof path, "%s/server-0.metrics.jsonl", dir);
    pst_server srv;
    const char *args[] = {"--metrics", path, "--metrics-every", "0.05", "--mode", "async",
                          "--num-trainers", "1", NULL};
    cr_assert_eq(pst_spawn(&srv, NULL, args), 0);
    s_wait_line(path, "\"type\":\"stats\"", NULL, 0, 10); /* a record before any traffic */

    static const ps_var vars[] = {{"w", 5000}, {"b", 10}};
    ps_plan *plan;
    cr_assert_eq(ps_plan_new(vars, 2, 1, 0, &plan), ZPS_OK);
    ps_client *c = pst_client_init(srv.uri, plan, pst_seed(), NULL);
    float *g = zps_xcalloc(plan->total, 4);
    for (int k = 0; k < 6; k++) {
        ps_ticket t;
        cr_assert_eq(ps_client_pushpull(c, 0, 2, g, g, k, &t), ZPS_OK);
        cr_assert_eq(ps_client_wait(c, t), ZPS_OK);
    }
    s_wait_line(path, "\"type\":\"stats\"", "pushpull", 6, 10);
    char *stats = NULL;
    cr_assert_eq(ps_client_stats(c, 0, &stats), ZPS_OK);
    s_wait_line(path, "\"type\":\"stats\"", "stats", 1, 10); /* a record after STATS */
    pid_t spid = srv.pid;
    int st = pst_kill(&srv, SIGTERM);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "zps-server: wait status %d", st);

    char spid_s[32], tpid_s[32];
    snprintf(spid_s, sizeof spid_s, "%d", (int)spid);
    snprintf(tpid_s, sizeof tpid_s, "%d", (int)getpid());
    const char *py[] = {path, stats, spid_s, tpid_s, srv.uri, NULL};
    int rc = s_python(s_check_server_file, py);
    if (rc)
        pst_dump(path);
    cr_assert_eq(rc, 0, "the server's metrics file (python3 exit %d)", rc);
    free(stats);
    free(g);
    ps_client_destroy(&c);
    ps_plan_destroy(&plan);
    zt_rmtmp(dir);
}

/* The server's records reuse one buffer: after the first records, writing more changes
 * nothing on the heap (the in-process server, driven by ps_server_run_once). */
Test(metrics, server_records_do_not_grow_the_heap, .timeout = 30)
{
    zps_log_set_level(ZPS_LOG_OFF);
    char dir[512], path[600];
    zt_mktmp(dir, sizeof dir, "zps-metrics");
    snprintf(path, sizeof path, "%s/s.jsonl", dir);
    ps_server_config cfg;
    ps_server_config_default(&cfg);
    snprintf(cfg.metrics, sizeof cfg.metrics, "%s", path);
    cfg.metrics_every_s = 0.01;
    cfg.num_trainers = 3;
    ps_server *s = NULL;
    cr_assert_eq(ps_server_new(&cfg, &s), ZPS_OK);
    int handled;
    for (int i = 0; i < 10; i++)
        cr_assert_eq(ps_server_run_once(s, 15, &handled), ZPS_OK);
    struct mallinfo2 before = mallinfo2();
    for (int i = 0; i < 50; i++)
        cr_assert_eq(ps_server_run_once(s, 15, &handled), ZPS_OK);
    struct mallinfo2 after = mallinfo2();
    ps_server_destroy(&s);
    cr_assert_eq(after.uordblks, before.uordblks, "heap in use changed over 50 records");
    size_t len;
    char *text = s_slurp(path, &len);
    int stats = 0;
    for (const char *p = text; (p = strstr(p, "\"type\":\"stats\"")); p++)
        stats++;
    cr_assert_geq(stats, 40, "%d stats records", stats);
    cr_assert(strstr(text, "\"type\":\"end\",\"end\":\"closed\""), "no end record");
    zt_rmtmp(dir);
}

/* A metrics file the server cannot create, or cannot write its start record to, stops it
 * at start (exit 1) with one line naming the file, before it serves anything. */
Test(it_metrics, server_refuses_a_metrics_file_it_cannot_write, .timeout = 60)
{
    static const struct {
        const char *path, *why;
    } cases[] = {{"/nonexistent/dir/m.jsonl", "--metrics: cannot create /nonexistent/dir/m.jsonl"},
                 {"/dev/full", "cannot write /dev/full: No space left on device"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *args[] = {"--bind", "tcp://127.0.0.1:0", "--metrics", cases[i].path, NULL};
        char *out;
        cr_assert_eq(zt_run_tmp("zps-server", args, NULL, 30, &out), 1, "%s", out);
        cr_assert_eq(zt_count(out, cases[i].why), 1, "want '%s' once:\n%s", cases[i].why, out);
        cr_assert_null(strstr(out, "listening"), "it served:\n%s", out);
        free(out);
    }
}

/* A checkpoint directory the server cannot create or write stops it at start (exit 1), with
 * one line naming it, instead of at its first checkpoint (these two fail for root too). */
Test(it_metrics, server_refuses_a_checkpoint_dir_it_cannot_write, .timeout = 60)
{
    char dir[256], file[300], under[320];
    zt_mktmp(dir, sizeof dir, "zps-ckdir");
    snprintf(file, sizeof file, "%s/plain-file", dir);
    snprintf(under, sizeof under, "%s/sub", file);
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fclose(f);
    const char *paths[] = {"/proc/zps-no-such-dir", under};
    for (int i = 0; i < 2; i++) {
        const char *args[] = {"--bind", "tcp://127.0.0.1:0", "--checkpoint-dir", paths[i], NULL};
        char *out, want[400];
        cr_assert_eq(zt_run_tmp("zps-server", args, NULL, 30, &out), 1, "%s", out);
        snprintf(want, sizeof want, "--checkpoint-dir %s: cannot create or write it", paths[i]);
        cr_assert_eq(zt_count(out, want), 1, "want '%s' once:\n%s", want, out);
        cr_assert_null(strstr(out, "listening"), "it served:\n%s", out);
        free(out);
    }
    zt_rmtmp(dir);
}
