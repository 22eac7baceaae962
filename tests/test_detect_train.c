/* test_detect_train.c — zps-trainer trains and evaluates the ssd detector end to end (suite
 * it_detect_train: real processes on 127.0.0.1, a small detection dataset of 256 training
 * and 32 test canvases, the detector at width 0.25 so each run takes seconds).
 *
 * equivalence: sync PS with 2 trainers of batch b and all-reduce with 2 trainers of batch b
 * end with the weights of one local trainer that takes the same 2b images as 2 micro-batches
 * of b (--accumulate 2), after a few SGD steps. Micro-batches, not one batch of 2b, because
 * the MultiBox loss is normalised by the matched count of the images one forward sees (and
 * batchnorm by their statistics), exactly as on each of the two trainers; the mean of the
 * two gradients is then the same sum in another order. Tolerance as it_train's.
 * A local run's loss falls and its evaluations write a finite "map"; an async and an ssp
 * fleet with bf16 pushes and accumulation run, and their checkpoints export into a file that
 * evaluates; --eval-only --dump-detections writes a PNG with the true
 * boxes in red.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "datasets/image.h"
#include "tests/ps_test_util.h"
#include "tests/testutil.h"
#include "tests/train_test_util.h"

static char s_tmp[512], s_data[600];

/* A fresh s_tmp with the small detection dataset at s_data. */
static void s_make_data(void)
{
    pst_tmpdir(s_tmp, sizeof s_tmp);
    snprintf(s_data, sizeof s_data, "%s/det", s_tmp);
    char log[700];
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    pst_server p;
    const char *args[] = {"make-detection", "--out", s_data, "--train", "256", "--test", "32",
                          "--shards", "2", NULL};
    trt_spawn(&p, "zps-data", log, args);
    trt_expect_ok(&p, log, 60);
}

static void s_cleanup(void)
{
    if (s_tmp[0]) {
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", s_tmp);
        int rc = system(cmd);
        (void)rc;
    }
}

/* The flags every run shares: the data, the small detector, one thread, no progress. */
#define S_COMMON "--data", s_data, "--model", "ssd", "--width", "0.25", "--no-progress", \
                 "--threads", "0", "--seed", "7"

TestSuite(it_detect_train, .fini = s_cleanup, .timeout = 240);

Test(it_detect_train, sync_ps_and_allreduce_equal_local_with_the_combined_batch)
{
    s_make_data();
    setenv("OMP_NUM_THREADS", "1", 1); /* one summation order per convolution (it_train) */
    const char *common[] = {S_COMMON, "--steps", "4", "--shard", "batch", "--optimizer", "sgd",
                            "--lr", "0.02", "--eval-batches", "1"};
    const int nc = sizeof common / sizeof common[0];
    char lw[700], iw[700], aw[700], pw[700], log[700], logs[2][700], job[64];
    snprintf(lw, sizeof lw, "%s/local.w", s_tmp);
    snprintf(iw, sizeof iw, "%s/init.w", s_tmp);
    snprintf(aw, sizeof aw, "%s/ar.w", s_tmp);
    snprintf(pw, sizeof pw, "%s/ps.w", s_tmp);
    snprintf(job, sizeof job, "deq%d", (int)getpid());
    const char *id[2] = {"0", "1"};
    pst_server p, t[2];

    const char *local[] = {"--batch-size", "4", "--accumulate", "2", "--export", lw, NULL};
    trt_trainer(&p, s_tmp, "local", log, sizeof log, common, nc, local);
    trt_expect_ok(&p, log, 120);
    const char *init[] = {"--batch-size", "4", "--accumulate", "2", "--lr", "0", "--steps",
                          "1", "--export", iw, NULL};
    trt_trainer(&p, s_tmp, "init", log, sizeof log, common, nc, init);
    trt_expect_ok(&p, log, 120);
    cr_assert(trt_max_diff(lw, iw) > 1e-4, "4 steps moved no weight");

    for (int r = 0; r < 2; r++) {
        const char *more[] = {"--mode", "allreduce", "--batch-size", "4", "--num-trainers", "2",
                              "--trainer-id", id[r], "--job", job, "--export", aw, NULL};
        trt_trainer(&t[r], s_tmp, r ? "ar1" : "ar0", logs[r], sizeof logs[r], common, nc, more);
    }
    for (int r = 0; r < 2; r++)
        trt_expect_ok(&t[r], logs[r], 120);

    pst_server srv[2];
    const char *sargs[] = {"--mode", "sync", "--num-trainers", "2", NULL};
    char servers[600];
    trt_servers(srv, sargs, servers, sizeof servers);
    for (int r = 0; r < 2; r++) {
        const char *more[] = {"--mode", "sync", "--batch-size", "4", "--num-trainers", "2",
                              "--trainer-id", id[r], "--servers", servers, "--export", pw,
                              NULL};
        trt_trainer(&t[r], s_tmp, r ? "ps1" : "ps0", logs[r], sizeof logs[r], common, nc, more);
    }
    for (int r = 0; r < 2; r++)
        trt_expect_ok(&t[r], logs[r], 120);
    for (int s = 0; s < 2; s++)
        pst_kill(&srv[s], SIGTERM);
    trt_compare(lw, aw, "ssd all-reduce 2 x b");
    trt_compare(lw, pw, "ssd sync PS 2 x b");
}

/* The whole file at path (malloc'd, NUL-terminated; *len its bytes). */
static char *s_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "cannot open %s", path);
    cr_assert_eq(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    cr_assert(n >= 0);
    rewind(f);
    char *b = malloc((size_t)n + 1);
    cr_assert_not_null(b);
    cr_assert_eq(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    b[n] = 0;
    *len = (size_t)n;
    return b;
}

/* The mean of "loss" over the step records [from, to] (1-based) of a metrics file. */
static double s_mean_loss(const char *path, int from, int to)
{
    size_t len;
    char *text = s_slurp(path, &len);
    double sum = 0;
    int n = 0;
    for (int s = from; s <= to; s++) {
        char pat[48];
        snprintf(pat, sizeof pat, "\"step\":%d,", s);
        const char *at = strstr(text, pat), *l = at ? strstr(at, "\"loss\":") : NULL;
        cr_assert_not_null(l, "no loss at step %d in %s", s, path);
        sum += strtod(l + 7, NULL);
        n++;
    }
    free(text);
    return sum / n;
}

Test(it_detect_train, local_loss_falls_and_eval_writes_a_finite_map_and_a_png)
{
    s_make_data();
    char m[700], w[700], png[700], log[700];
    snprintf(m, sizeof m, "%s/local.jsonl", s_tmp);
    snprintf(w, sizeof w, "%s/local.w", s_tmp);
    snprintf(png, sizeof png, "%s/det.png", s_tmp);
    const char *base[] = {S_COMMON};
    const char *more[] = {"--steps", "30", "--batch-size", "8", "--optimizer", "adam", "--lr",
                          "0.002", "--eval-every", "15", "--metrics", m, "--export", w, NULL};
    pst_server p;
    trt_trainer(&p, s_tmp, "local", log, sizeof log, base, sizeof base / sizeof *base, more);
    trt_expect_ok(&p, log, 180);
    double first = s_mean_loss(m, 1, 5), last = s_mean_loss(m, 26, 30);
    cr_log_info("ssd local: mean loss %.3f over steps 1-5, %.3f over 26-30", first, last);
    cr_assert(last < 0.8 * first, "the loss did not fall: %.3f -> %.3f", first, last);
    cr_assert(zt_file_has(m, "\"loss_conf\":") && zt_file_has(m, "\"matched\":"),
              "no loss parts in the step records");
    double map = trt_summary(m, "final_map");
    cr_assert(isfinite(map) && map >= 0 && map <= 1, "final_map %g", map);
    cr_assert(trt_summary(m, "best_map") >= map);
    cr_assert(zt_file_has(m, "\"map\":"), "no evaluation step carries \"map\"");

    /* the exported detector, evaluated alone, draws test canvas 2 */
    const char *eval[] = {"--eval-only", "--init-weights", w, "--dump-detections", "2",
                          "--dump-out", png, NULL};
    trt_trainer(&p, s_tmp, "eval", log, sizeof log, base, sizeof base / sizeof *base, eval);
    trt_expect_ok(&p, log, 120);
    cr_assert(zt_file_has(log, "test mAP@0.5 "), "no mAP line");
    size_t len;
    char *bytes = s_slurp(png, &len);
    ds_codec *c = ds_codec_new();
    ds_pixels px;
    ds_encoding enc;
    cr_assert_eq(ds_image_decode_any(c, (const uint8_t *)bytes, len, &px, &enc), ZPS_OK);
    cr_assert(enc == DS_ENC_PNG && px.c == 3 && px.h == 128 && px.w == 128);
    size_t red = 0;
    for (size_t i = 0; i < (size_t)px.h * px.w; i++)
        red += px.px[i * 3] == 255 && px.px[i * 3 + 1] == 0 && px.px[i * 3 + 2] == 0;
    cr_assert(red >= 16, "the true boxes are not drawn in red (%zu red pixels)", red);
    ds_codec_destroy(&c);
    free(bytes);
}

/* The fleet's servers checkpoint every 4 versions; zps-ctl export rebuilds the detector from
 * the checkpoints, its batchnorm statistics from the training data (they live in the
 * trainers), and zps-trainer --eval-only reads the file. */
/* A PS fleet of mode (async, or ssp with staleness 1) with bf16 pushes and accumulation
 * runs, and its checkpoints export (--bn-data) into a file that evaluates. */
static void s_ps_fleet_runs_and_exports(const char *mode)
{
    s_make_data();
    pst_server srv[2], t[2];
    char ck[700];
    snprintf(ck, sizeof ck, "%s/ck", s_tmp);
    for (int s = 0; s < 2; s++) {
        const char *sargs[] = {"--mode", mode, "--num-trainers", "2", "--index", s ? "1" : "0",
                               "--checkpoint-dir", ck, "--checkpoint-every-versions", "4",
                               "--staleness", "1", NULL};
        cr_assert_eq(pst_spawn(&srv[s], NULL, sargs), 0, "server %d did not start", s);
    }
    char servers[600], logs[2][700], m[700];
    snprintf(servers, sizeof servers, "%s,%s", srv[0].uri, srv[1].uri);
    snprintf(m, sizeof m, "%s/t0.jsonl", s_tmp);
    const char *base[] = {S_COMMON};
    const char *id[2] = {"0", "1"};
    for (int r = 0; r < 2; r++) {
        const char *more[] = {"--mode", mode, "--staleness", "1", "--servers", servers,
                              "--num-trainers", "2",
                              "--trainer-id", id[r], "--steps", "4", "--batch-size", "4",
                              "--accumulate", "2", "--push-dtype", "bf16", "--optimizer",
                              "adam", "--lr", "0.001", "--metrics", r ? "/dev/null" : m, NULL};
        trt_trainer(&t[r], s_tmp, r ? "t1" : "t0", logs[r], sizeof logs[r], base,
                    sizeof base / sizeof *base, more);
    }
    for (int r = 0; r < 2; r++)
        trt_expect_ok(&t[r], logs[r], 150);
    for (int s = 0; s < 2; s++)
        pst_kill(&srv[s], SIGTERM);
    double map = trt_summary(m, "final_map");
    cr_assert(map >= 0 && map <= 1, "final_map %g", map);
    cr_assert(trt_summary(m, "bytes_pushed") > 0);

    char w[700], log[700];
    snprintf(w, sizeof w, "%s/ctl.w", s_tmp);
    snprintf(log, sizeof log, "%s/ctl.log", s_tmp);
    const char *ex[] = {"export", "--ckpt-dir", ck, "--out", w, "--model", "ssd", "--width",
                        "0.25", "--bn-data", s_data, "--bn-batches", "2", "--batch-size", "8",
                        NULL};
    pst_server p;
    trt_spawn(&p, "zps-ctl", log, ex);
    trt_expect_ok(&p, log, 60);
    const char *eval[] = {"--eval-only", "--init-weights", w, NULL};
    trt_trainer(&p, s_tmp, "eval", log, sizeof log, base, sizeof base / sizeof *base, eval);
    trt_expect_ok(&p, log, 60);
    cr_assert(zt_file_has(log, "test mAP@0.5 "), "no mAP line");
}

Test(it_detect_train, async_fleet_with_bf16_pushes_and_accumulation_runs_and_exports)
{
    s_ps_fleet_runs_and_exports("async");
}

Test(it_detect_train, ssp_fleet_with_bf16_pushes_and_accumulation_runs_and_exports)
{
    s_ps_fleet_runs_and_exports("ssp");
}
