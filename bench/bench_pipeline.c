/* bench_pipeline.c — `zps-bench pipeline`: images per second the input pipeline delivers
 * (read + decode + random crop/flip + resize + normalise + batch) for 299x299 JPEG records
 * with 1 and 2 decode threads, and raw LMDB read MB/s. Writes pipeline.json.
 *
 * Reference: the CPU Inception-v3 training step at 299x299. When train_step.json (from
 * `zps-bench train-step`) is in bench_out_dir(), its first field named img_per_s,
 * images_per_s or img_s is used; else PyTorch's measured 4.5 img/s (batch 8) is the stated
 * reference. Target: one decode thread >= 3x the reference. The output says which was used.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench.h"
#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "datasets/convert.h"
#include "datasets/image.h"
#include "datasets/pipeline.h"
#include "datasets/shard.h"

#define S_SIDE 299
#define S_ROUNDS 5

/* A photo-like 299x299 RGB image: smooth gradients, a few shapes and mild noise, so JPEG
 * sizes (~25-40 KB at quality 90) resemble natural images rather than noise or flat fill. */
static void s_picture(uint8_t *px, uint64_t seed)
{
    uint64_t s = seed;
    float cx[4], cy[4], rr[4], col[4][3];
    for (int i = 0; i < 4; i++) {
        cx[i] = ds_randf(&s) * S_SIDE;
        cy[i] = ds_randf(&s) * S_SIDE;
        rr[i] = 20 + ds_randf(&s) * 80;
        for (int k = 0; k < 3; k++)
            col[i][k] = ds_randf(&s) * 255;
    }
    float g0 = ds_randf(&s), g1 = ds_randf(&s);
    for (int y = 0; y < S_SIDE; y++)
        for (int x = 0; x < S_SIDE; x++) {
            float v[3] = {g0 * 200 * x / S_SIDE + 20, g1 * 200 * y / S_SIDE + 20, 120};
            for (int i = 0; i < 4; i++) {
                float dx = x - cx[i], dy = y - cy[i];
                if (dx * dx + dy * dy < rr[i] * rr[i])
                    for (int k = 0; k < 3; k++)
                        v[k] = 0.3f * v[k] + 0.7f * col[i][k];
            }
            for (int k = 0; k < 3; k++) {
                float n = v[k] + (float)(ds_rand(&s) % 16) - 8.f;
                px[((size_t)y * S_SIDE + x) * 3 + k] = (uint8_t)(n < 0 ? 0 : n > 255 ? 255 : n);
            }
        }
}

static zps_status s_make_dataset(const char *dir, int records, size_t *bytes)
{
    ds_writer *w;
    ZPS_TRY(ds_writer_new(dir, "bench", 2, true, &w));
    ds_codec *c = ds_codec_new();
    uint8_t *px = zps_xmalloc((size_t)S_SIDE * S_SIDE * 3);
    zps_status st = c ? ZPS_OK : ZPS_ERR_INTERNAL;
    *bytes = 0;
    for (int i = 0; i < records && st == ZPS_OK; i++) {
        s_picture(px, ds_mix64((uint64_t)i + 99));
        ds_record r = {.encoding = DS_ENC_JPEG, .height = S_SIDE, .width = S_SIDE, .channels = 3,
                       .label = i % 1000};
        st = ds_image_encode(c, px, S_SIDE, S_SIDE, 3, DS_ENC_JPEG, 90, &r.image, &r.image_len);
        if (st == ZPS_OK)
            st = ds_writer_put(w, &r);
        *bytes += r.image_len;
    }
    free(px);
    ds_codec_destroy(&c);
    if (st != ZPS_OK) {
        ds_writer_destroy(&w);
        return st;
    }
    return ds_writer_close(&w);
}

/* Median img/s over S_ROUNDS rounds of at least `seconds` / S_ROUNDS each. */
static zps_status s_pipeline_rate(const char *dir, int threads, int batch, double seconds,
                                  double *median, double *rates)
{
    ds_pipeline_opts o;
    ds_pipeline_opts_default(&o);
    o.path = dir;
    o.batch = batch;
    o.height = o.width = S_SIDE;
    o.channels = 3;
    o.augment = true;
    o.crop_min_area = 0.08f; /* the Inception recipe */
    const float mean[3] = {0.485f, 0.456f, 0.406f}, std[3] = {0.229f, 0.224f, 0.225f};
    memcpy(o.mean, mean, sizeof mean);
    memcpy(o.std, std, sizeof std);
    o.threads = threads;
    o.prefetch = 4;
    ds_pipeline *p;
    ZPS_TRY(ds_pipeline_new(&o, &p));
    float *img = zps_xaligned(64, (size_t)batch * 3 * S_SIDE * S_SIDE * sizeof(float));
    int32_t *lab = zps_xmalloc((size_t)batch * sizeof *lab);
    zps_prefault(img, (size_t)batch * 3 * S_SIDE * S_SIDE * sizeof(float));
    zps_status st = ZPS_OK;
    for (int i = 0; i < 2 && st == ZPS_OK; i++) /* warm-up: fills the ring, faults buffers */
        st = ds_pipeline_next(p, img, lab, NULL);
    for (int r = 0; r < S_ROUNDS && st == ZPS_OK; r++) {
        double t0 = zps_now_s(), t;
        long imgs = 0;
        do {
            st = ds_pipeline_next(p, img, lab, NULL);
            imgs += batch;
            t = zps_now_s() - t0;
        } while (st == ZPS_OK && t < seconds / S_ROUNDS);
        rates[r] = (double)imgs / t;
    }
    zps_aligned_free(img);
    free(lab);
    ds_pipeline_destroy(&p);
    if (st != ZPS_OK)
        return st;
    double tmp[S_ROUNDS];
    memcpy(tmp, rates, sizeof tmp);
    *median = bench_median(tmp, S_ROUNDS);
    return ZPS_OK;
}

/* Raw LMDB read: cursor over every shard, summing the value bytes (so they are touched). */
static zps_status s_lmdb_rate(const char *dir, double seconds, double *median)
{
    ds_dataset *d;
    ZPS_TRY(ds_dataset_open(dir, NULL, &d));
    double rates[S_ROUNDS];
    volatile uint64_t sink = 0;
    zps_status st = ZPS_OK;
    for (int r = 0; r < S_ROUNDS && st == ZPS_OK; r++) {
        double t0 = zps_now_s(), t;
        double bytes = 0;
        do {
            for (int s = 0; s < d->n_shards && st == ZPS_OK; s++) {
                ds_reader *rd;
                st = ds_reader_new(d->shards[s], &rd);
                char key[DS_KEY_LEN + 1];
                const uint8_t *v;
                size_t len;
                while (st == ZPS_OK && ds_reader_next(rd, key, &v, &len) == ZPS_OK) {
                    uint64_t acc = 0;
                    for (size_t i = 0; i < len; i += 8) {
                        uint64_t x;
                        memcpy(&x, v + i, len - i >= 8 ? 8 : 1);
                        acc += x;
                    }
                    sink += acc;
                    bytes += (double)len;
                }
                ds_reader_destroy(&rd);
            }
            t = zps_now_s() - t0;
        } while (st == ZPS_OK && t < seconds / S_ROUNDS);
        rates[r] = bytes / t / 1e6;
    }
    (void)sink;
    ds_dataset_close(&d);
    if (st == ZPS_OK)
        *median = bench_median(rates, S_ROUNDS);
    return st;
}

/* Reference img/s from train_step.json when present; else 0. */
static double s_reference(char *src, size_t n)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/train_step.json", bench_out_dir());
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    static char buf[1 << 16];
    size_t got = fread(buf, 1, sizeof buf - 1, f);
    buf[got] = 0;
    fclose(f);
    /* zps-bench train-step's record for 299x299 batch 8 (its own format, bench_train_step.c) */
    char *p = strstr(buf, "\"shape\": \"3x299x299\", \"batch\": 8,");
    if (!p)
        return 0;
    char *end = strchr(p, '}');
    p = strstr(p, "\"zps_ips\":");
    if (!p || (end && p > end))
        return 0;
    double v = strtod(p + strlen("\"zps_ips\":"), NULL);
    if (v <= 0)
        return 0;
    snprintf(src, n, "%s, zps_ips of 3x299x299 batch 8", path);
    return v;
}

/* What one run measured. */
typedef struct s_figures {
    int records, batch;
    size_t jpeg_bytes;                  // all records' JPEG bytes
    double make_s;                      // seconds to write the dataset
    double m1, m2;                      // median img/s with 1 and 2 decode threads
    double r1[S_ROUNDS], r2[S_ROUNDS];  // every round's img/s
    double mbs;                         // raw LMDB read MB/s
    double ref;                         // reference img/s
    char src[1200];                     // where ref comes from
} s_figures;

/* Writes a dataset of f->records JPEGs into a temporary directory, measures it and removes
 * it; fills f (all but the reference). */
static zps_status s_measure(double seconds, s_figures *f)
{
    char dir[] = "/tmp/zps-bench-pipeline-XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return ZPS_ERR_IO;
    }
    double t0 = zps_now_s();
    zps_status st = s_make_dataset(dir, f->records, &f->jpeg_bytes);
    f->make_s = zps_now_s() - t0;
    if (st == ZPS_OK)
        st = s_pipeline_rate(dir, 1, f->batch, seconds, &f->m1, f->r1);
    if (st == ZPS_OK)
        st = s_pipeline_rate(dir, 2, f->batch, seconds, &f->m2, f->r2);
    if (st == ZPS_OK)
        st = s_lmdb_rate(dir, seconds / 2, &f->mbs);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        fprintf(stderr, "zps-bench pipeline: could not remove %s\n", dir);
    if (st != ZPS_OK)
        fprintf(stderr, "zps-bench pipeline: %s\n", zps_strerror(st));
    return st;
}

/* The figures on stdout and in pipeline.json. 0, or 1 when the file could not be written. */
static int s_report(const s_figures *f)
{
    double ratio = f->m1 / f->ref;
    printf("dataset: %d JPEG records 299x299x3, mean %.1f KB, written in %.2f s\n", f->records,
           (double)f->jpeg_bytes / f->records / 1024, f->make_s);
    printf("pipeline 1 thread : %8.1f img/s (median of %d)\n", f->m1, S_ROUNDS);
    printf("pipeline 2 threads: %8.1f img/s (median of %d), %.2fx one thread\n", f->m2, S_ROUNDS,
           f->m2 / f->m1);
    printf("LMDB raw read     : %8.1f MB/s\n", f->mbs);
    printf("reference         : %8.2f img/s from %s\n", f->ref, f->src);
    printf("ratio 1 thread / reference: %.1fx (target >= 3x: %s)\n", ratio,
           ratio >= 3 ? "met" : "NOT met");
    char esc[2 * sizeof f->src], path[1024];
    size_t e = 0;
    for (const char *c = f->src; *c && e + 2 < sizeof esc; c++) { /* JSON string escaping */
        if (*c == '"' || *c == '\\')
            esc[e++] = '\\';
        esc[e++] = (char)((unsigned char)*c < 0x20 ? ' ' : *c);
    }
    esc[e] = 0;
    FILE *js = bench_json_open("pipeline", "pipeline.json", path, sizeof path);
    if (!js)
        return 1;
    const double *r1 = f->r1, *r2 = f->r2;
    fprintf(js, "{\"bench\": \"pipeline\", \"image\": \"299x299x3 jpeg q90\", \"batch\": %d, "
                "\"records\": %d, \"mean_jpeg_bytes\": %.0f, \"augment\": true,\n"
                " \"img_per_s_1_thread\": %.2f, \"img_per_s_2_threads\": %.2f,\n"
                " \"rounds_1_thread\": [%.2f, %.2f, %.2f, %.2f, %.2f],\n"
                " \"rounds_2_threads\": [%.2f, %.2f, %.2f, %.2f, %.2f],\n"
                " \"lmdb_read_mb_per_s\": %.1f,\n"
                " \"reference_img_per_s\": %.3f, \"reference_source\": \"%s\",\n"
                " \"ratio_1_thread_vs_reference\": %.2f, \"target_ratio\": 3, \"target_met\": %s}\n",
            f->batch, f->records, (double)f->jpeg_bytes / f->records, f->m1, f->m2, r1[0], r1[1],
            r1[2], r1[3], r1[4], r2[0], r2[1], r2[2], r2[3], r2[4], f->mbs, f->ref, esc, ratio,
            ratio >= 3 ? "true" : "false");
    fclose(js);
    printf("wrote %s\n", path);
    return 0;
}

/* The command line. */
typedef struct s_cfg {
    double seconds;     // per measurement
    int records, batch; // of the generated data set
} s_cfg;

static void s_defaults(void *p)
{
    *(s_cfg *)p = (s_cfg){.seconds = 4, .records = 160, .batch = 8};
}

static const zps_opt s_opt[] = {
    {"seconds", ZPS_OPT_DOUBLE, ZPS_OPT_FIELD(s_cfg, seconds), 1e-3, 3600, .meta = "S",
     .help = "per measurement"},
    {"records", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, records), 1, 1000000, .meta = "N",
     .help = "records in the generated data set (>= --batch)"},
    {"batch", ZPS_OPT_INT, ZPS_OPT_FIELD(s_cfg, batch), 1, 4096, .meta = "B", .help = "batch size"},
    {.type = ZPS_OPT_END},
};

static const zps_opts s_spec = BENCH_OPTS("pipeline", s_cfg, s_opt, s_defaults, NULL);

ZPS_BENCH(pipeline, "input pipeline img/s for 299x299 JPEG (1 and 2 threads), LMDB read MB/s")
{
    s_cfg c;
    int rc = bench_opts_parse(&s_spec, &c, argc, argv);
    if (rc >= 0)
        return rc;
    if (c.records < c.batch) {
        int code;
        zps_opts_fail(&s_spec, &code, "--records %d is fewer than --batch %d", c.records,
                      c.batch);
        return code;
    }
    double seconds = c.seconds;
    s_figures f = {.records = c.records, .batch = c.batch};
    if (s_measure(seconds, &f) != ZPS_OK)
        return 1;
    snprintf(f.src, sizeof f.src, "PyTorch 1.13 CPU Inception-v3 training, 299x299 batch 8, "
             "measured 4.5 img/s (stated reference; no train_step.json)");
    f.ref = s_reference(f.src, sizeof f.src);
    if (f.ref <= 0)
        f.ref = 4.5;
    return s_report(&f);
}
