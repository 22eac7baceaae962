/* test_ds_pipeline.c — the input pipeline: a once pass returns every record in order with
 * the right pixels; n trainers see disjoint shares covering the dataset; the same seed
 * gives the same batches for 0, 1 and 2 threads and any prefetch depth; epochs are
 * permutations; corrupt records stop the pipeline naming shard and key, or are skipped and
 * counted; detection boxes follow the image. Fresh random data each run (seed in messages). */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <lmdb.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tests/testutil.h"
#include "datasets/convert.h"
#include "datasets/image.h"
#include "datasets/pipeline.h"
#include "datasets/shard.h"

static char s_dir[64];
static void s_mktmp(void) { zt_mktmp(s_dir, sizeof s_dir, "zps-dp"); }
static void s_rmtmp(void) { zt_rmtmp(s_dir); }

#define SIDE 12
/* Record g: SIDE x SIDE gray pixels from (seed, g), label g % 10, written in order g. */
static void s_make(uint64_t seed, uint64_t g, uint8_t *px)
{
    uint64_t s = ds_mix64(seed ^ ds_mix64(g));
    for (int i = 0; i < SIDE * SIDE; i++)
        px[i] = (uint8_t)(ds_rand(&s) >> 56);
    px[0] = 1 + (uint8_t)(g % 200);
}

/* Writes count records into s_dir/NAME-*; encoding alternates raw/png/jpeg when mixed. */
static void s_write(const char *name, int shards, uint64_t count, uint64_t seed, bool mixed)
{
    ds_writer *w;
    cr_assert_eq(ds_writer_new(s_dir, name, shards, false, &w), ZPS_OK);
    ds_codec *c = ds_codec_new();
    uint8_t px[SIDE * SIDE];
    for (uint64_t g = 0; g < count; g++) {
        s_make(seed, g, px);
        ds_record r = {.image = px, .image_len = sizeof px, .encoding = DS_ENC_RAW,
                       .height = SIDE, .width = SIDE, .channels = 1, .label = (int32_t)(g % 10)};
        if (mixed && g % 3)
            cr_assert_eq(ds_image_encode(c, px, SIDE, SIDE, 1, g % 3 == 1 ? DS_ENC_PNG : DS_ENC_JPEG,
                                         90, &r.image, &r.image_len), ZPS_OK);
        if (mixed)
            r.encoding = g % 3 == 0 ? DS_ENC_RAW : g % 3 == 1 ? DS_ENC_PNG : DS_ENC_JPEG;
        cr_assert_eq(ds_writer_put(w, &r), ZPS_OK);
    }
    cr_assert_eq(ds_writer_close(&w), ZPS_OK);
    ds_codec_destroy(&c);
}

/* Global index (pipeline numbering) of writer record g with N shards of a count-record set. */
static uint64_t s_global(uint64_t g, int N, uint64_t count)
{
    uint64_t s = g % (uint64_t)N, off = 0;
    for (uint64_t i = 0; i < s; i++)
        off += count / N + (i < count % N ? 1 : 0);
    return off + g / (uint64_t)N;
}

/* Inverse: writer index of global record id. */
static uint64_t s_writer_index(uint64_t id, int N, uint64_t count)
{
    uint64_t off = 0;
    for (int s = 0; s < N; s++) {
        uint64_t c = count / N + ((uint64_t)s < count % N ? 1 : 0);
        if (id < off + c)
            return (id - off) * (uint64_t)N + (uint64_t)s;
        off += c;
    }
    cr_assert_fail("id %llu out of range", (unsigned long long)id);
    return 0;
}

static void s_opts(ds_pipeline_opts *o, int batch)
{
    ds_pipeline_opts_default(o);
    o->path = s_dir;
    o->batch = batch;
    o->height = o->width = SIDE;
}

TestSuite(ds_pipeline, .init = s_mktmp, .fini = s_rmtmp, .timeout = 30);

Test(ds_pipeline, once_pass_returns_every_record_in_order_with_its_pixels)
{
    uint64_t seed = zt_seed_init();
    const int N = 3;
    const uint64_t count = 101 + seed % 50;
    s_write("ev", N, count, seed, false);
    ds_pipeline_opts o;
    s_opts(&o, 8);
    o.once = true;
    o.threads = 2;
    o.mean[0] = 0.25f;
    o.std[0] = 0.5f;
    ds_pipeline *p;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
    cr_assert_eq(ds_pipeline_records(p), count);
    cr_assert_eq(ds_pipeline_batches_per_epoch(p), (int64_t)((count + 7) / 8));
    float img[8 * SIDE * SIDE];
    int32_t lab[8];
    ds_batch_info info;
    uint64_t next = 0;
    uint8_t px[SIDE * SIDE];
    zps_status st;
    while ((st = ds_pipeline_next(p, img, lab, &info)) == ZPS_OK) {
        cr_assert_eq(info.epoch, 0);
        for (int k = 0; k < info.count; k++, next++) {
            cr_assert_eq(info.ids[k], next, "order, seed %llu", (unsigned long long)seed);
            uint64_t g = s_writer_index(next, N, count);
            cr_assert_eq(lab[k], (int32_t)(g % 10));
            s_make(seed, g, px);
            for (int i = 0; i < SIDE * SIDE; i++)
                cr_assert_float_eq(img[k * SIDE * SIDE + i], (px[i] / 255.f - 0.25f) / 0.5f, 1e-5,
                                   "record %llu pixel %d, seed %llu", (unsigned long long)g, i,
                                   (unsigned long long)seed);
        }
    }
    cr_assert_eq(st, ZPS_ERR_EOF);
    cr_assert_eq(next, count);
    cr_assert_eq(ds_pipeline_next(p, img, lab, &info), ZPS_ERR_EOF);
    ds_pipeline_destroy(&p);
    cr_assert_null(p);
}

Test(ds_pipeline, trainers_see_disjoint_shares_that_cover_the_dataset)
{
    uint64_t seed = zt_seed_init();
    const uint64_t count = 211 + seed % 100;
    s_write("sh", 4, count, seed, false);
    for (int n = 1; n <= 5; n += 2) {
        char *seen = calloc(count, 1);
        uint64_t lo = UINT64_MAX, hi = 0;
        for (int i = 0; i < n; i++) {
            ds_pipeline_opts o;
            s_opts(&o, 16);
            o.once = true;
            o.trainer_index = i;
            o.n_trainers = n;
            o.threads = i % 2;
            ds_pipeline *p;
            cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
            uint64_t r = ds_pipeline_records(p);
            lo = r < lo ? r : lo;
            hi = r > hi ? r : hi;
            float img[16 * SIDE * SIDE];
            int32_t lab[16];
            ds_batch_info info;
            uint64_t got = 0;
            while (ds_pipeline_next(p, img, lab, &info) == ZPS_OK)
                for (int k = 0; k < info.count; k++, got++) {
                    cr_assert_eq(seen[info.ids[k]], 0, "record %llu seen twice (n=%d)",
                                 (unsigned long long)info.ids[k], n);
                    seen[info.ids[k]] = 1;
                }
            cr_assert_eq(got, r);
            ds_pipeline_destroy(&p);
        }
        for (uint64_t g = 0; g < count; g++)
            cr_assert(seen[g], "record %llu unseen with %d trainers, seed %llu", (unsigned long long)g, n,
                      (unsigned long long)seed);
        cr_assert(hi - lo <= 1, "unbalanced %llu..%llu", (unsigned long long)lo, (unsigned long long)hi);
        free(seen);
    }
}

/* Runs `batches` batches and returns images+labels+ids concatenated (caller frees). */
static float *s_run(const ds_pipeline_opts *o, int batches, uint64_t *ids_out)
{
    ds_pipeline *p;
    cr_assert_eq(ds_pipeline_new(o, &p), ZPS_OK);
    size_t per = (size_t)o->batch * o->channels * o->height * o->width;
    float *all = malloc((size_t)batches * per * sizeof(float));
    int32_t *lab = malloc((size_t)o->batch * sizeof *lab);
    ds_batch_info info;
    for (int b = 0; b < batches; b++) {
        cr_assert_eq(ds_pipeline_next(p, all + (size_t)b * per, lab, &info), ZPS_OK);
        cr_assert_eq(info.count, o->batch);
        cr_assert_eq(info.epoch, b / ds_pipeline_batches_per_epoch(p));
        for (int k = 0; k < o->batch; k++) {
            ids_out[(size_t)b * o->batch + k] = info.ids[k];
            cr_assert_eq(lab[k], (int32_t)(s_writer_index(info.ids[k], 2, 90) % 10));
        }
    }
    free(lab);
    ds_pipeline_destroy(&p);
    return all;
}

Test(ds_pipeline, same_seed_same_batches_for_any_thread_count)
{
    uint64_t seed = zt_seed_init();
    s_write("det", 2, 90, seed, true); /* raw, PNG and JPEG records */
    ds_pipeline_opts o;
    s_opts(&o, 8);
    o.height = 20;
    o.width = 17;
    o.channels = 3;
    o.augment = true;
    o.seed = seed;
    const int B = 8, batches = 3 * (90 / 8); /* three epochs of 11 batches */
    size_t per = (size_t)B * 3 * 20 * 17;
    uint64_t *ids0 = malloc(sizeof(uint64_t) * batches * B), *ids = malloc(sizeof(uint64_t) * batches * B);
    o.threads = 0;
    float *ref = s_run(&o, batches, ids0);
    const int threads[] = {1, 2, 2}, prefetch[] = {1, 3, 7};
    for (int t = 0; t < 3; t++) {
        o.threads = threads[t];
        o.prefetch = prefetch[t];
        float *got = s_run(&o, batches, ids);
        cr_assert_eq(memcmp(ids, ids0, sizeof(uint64_t) * batches * B), 0, "order differs, %d threads",
                     threads[t]);
        cr_assert_eq(memcmp(got, ref, (size_t)batches * per * sizeof(float)), 0,
                     "pixels differ with %d threads, seed %llu", threads[t], (unsigned long long)seed);
        free(got);
    }
    /* Each epoch visits distinct records, and the epochs' orders differ. */
    const int E = 90 / 8 * 8;
    for (int e = 0; e < 3; e++) {
        char seen[90] = {0};
        for (int i = 0; i < E; i++) {
            uint64_t id = ids0[e * E + i];
            cr_assert_eq(seen[id], 0, "record %llu twice in epoch %d", (unsigned long long)id, e);
            seen[id] = 1;
        }
    }
    cr_assert_neq(memcmp(ids0, ids0 + E, sizeof(uint64_t) * E), 0, "epoch 0 and 1 in the same order");
    /* A different seed gives a different order; augmentation changes pixels of the same record. */
    o.seed = seed + 1;
    o.threads = 1;
    float *other = s_run(&o, 11, ids);
    cr_assert_neq(memcmp(ids, ids0, sizeof(uint64_t) * 11 * B), 0);
    free(other);
    free(ref);
    free(ids0);
    free(ids);
}

Test(ds_pipeline, gray_is_replicated_when_resizing_to_three_channels)
{
    uint64_t seed = zt_seed_init();
    s_write("up", 1, 20, seed, false);
    ds_pipeline_opts o;
    s_opts(&o, 4);
    o.height = o.width = 75;
    o.channels = 3;
    o.once = true;
    ds_pipeline *p;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
    float *img = malloc(sizeof(float) * 4 * 3 * 75 * 75);
    int32_t lab[4];
    cr_assert_eq(ds_pipeline_next(p, img, lab, NULL), ZPS_OK);
    size_t plane = 75 * 75;
    double sum = 0;
    for (int k = 0; k < 4; k++)
        for (size_t i = 0; i < plane; i++) {
            float *b = img + (size_t)k * 3 * plane;
            cr_assert(b[i] == b[plane + i] && b[i] == b[2 * plane + i]);
            cr_assert(b[i] >= 0.f && b[i] <= 1.f);
            sum += b[i];
        }
    cr_assert(sum > 0);
    free(img);
    ds_pipeline_destroy(&p);
}

Test(ds_pipeline, corrupt_records_are_named_or_skipped_and_counted)
{
    uint64_t seed = zt_seed_init();
    const uint64_t count = 120;
    s_write("cr", 2, count, seed, true);
    char shard[128];
    snprintf(shard, sizeof shard, "%s/cr-00001-of-00002", s_dir);
    /* three flipped records in shard 1 (keys 5, 17, 40), at varying byte offsets */
    const uint64_t bad[3] = {5, 17, 40};
    for (int i = 0; i < 3; i++)
        zt_shard_corrupt(shard, bad[i], (size_t)(ds_mix64(seed + (uint64_t)i) % 1000), 0x5a);
    ds_pipeline_opts o;
    s_opts(&o, 10);
    o.once = true;
    o.threads = 0; /* decode inside next(), while stderr is captured */
    ds_pipeline *p;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
    float img[10 * SIDE * SIDE];
    int32_t lab[10];
    ds_batch_info info;
    zps_status st = ZPS_OK;
    zt_capture_begin(s_dir);
    while ((st = ds_pipeline_next(p, img, lab, &info)) == ZPS_OK)
        ;
    char *log = zt_capture_end();
    cr_assert_eq(st, ZPS_ERR_CORRUPT, "seed %llu", (unsigned long long)seed);
    cr_assert(strstr(log, "shard cr-00001-of-00002 key 0000000005"), "%s", log);
    free(log);
    ds_pipeline_destroy(&p);

    /* skip_corrupt: the once pass delivers count - 3 records and counts 3 */
    o.skip_corrupt = true;
    o.threads = 2;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
    uint64_t got = 0;
    while ((st = ds_pipeline_next(p, img, lab, &info)) == ZPS_OK)
        got += (uint64_t)info.count;
    cr_assert_eq(st, ZPS_ERR_EOF);
    cr_assert_eq(got, count - 3);
    cr_assert_eq(ds_pipeline_skipped(p), 3);
    ds_pipeline_destroy(&p);

    /* training with skip_corrupt: batches stay full and never hold a corrupt record */
    o.once = false;
    o.augment = true;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
    uint64_t bad_ids[3];
    for (int i = 0; i < 3; i++)
        bad_ids[i] = s_global(bad[i] * 2 + 1, 2, count);
    for (int b = 0; b < 24; b++) {
        cr_assert_eq(ds_pipeline_next(p, img, lab, &info), ZPS_OK);
        cr_assert_eq(info.count, 10);
        for (int k = 0; k < 10; k++)
            for (int i = 0; i < 3; i++)
                cr_assert_neq(info.ids[k], bad_ids[i]);
    }
    cr_assert(ds_pipeline_skipped(p) >= 6, "two epochs pass each corrupt record at least once");
    ds_pipeline_destroy(&p);
}

Test(ds_pipeline, truncated_shard_fails_or_is_skipped_record_by_record)
{
    uint64_t seed = zt_seed_init();
    const uint64_t count = 3000;
    s_write("tr", 3, count, seed, false);
    char data[160];
    snprintf(data, sizeof data, "%s/tr-00001-of-00003/data.mdb", s_dir);
    FILE *f = fopen(data, "r+");
    cr_assert_not_null(f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fclose(f);
    cr_assert_eq(truncate(data, size - 8192), 0);
    ds_pipeline_opts o;
    s_opts(&o, 50);
    o.once = true;
    ds_pipeline *p;
    zt_capture_begin(s_dir);
    zps_status st = ds_pipeline_new(&o, &p);
    char *log = zt_capture_end();
    cr_assert_eq(st, ZPS_ERR_CORRUPT, "a truncated shard fails fast without skip_corrupt");
    cr_assert(strstr(log, "tr-00001-of-00003 is truncated"), "%s", log);
    free(log);
    o.skip_corrupt = true;
    o.threads = 2;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
    float *img = malloc(sizeof(float) * 50 * SIDE * SIDE);
    int32_t lab[50];
    ds_batch_info info;
    uint64_t got = 0;
    uint8_t px[SIDE * SIDE];
    zt_capture_begin(s_dir);
    while ((st = ds_pipeline_next(p, img, lab, &info)) == ZPS_OK) {
        for (int k = 0; k < info.count; k++, got++) {
            uint64_t g = s_writer_index(info.ids[k], 3, count);
            cr_assert_neq(g % 3, 1, "a record of the truncated shard was delivered");
            s_make(seed, g, px);
            cr_assert_float_eq(img[(size_t)k * SIDE * SIDE + 5], px[5] / 255.f, 1e-6);
        }
    }
    log = zt_capture_end();
    cr_assert_eq(st, ZPS_ERR_EOF);
    cr_assert_eq(got, 2000, "the two healthy shards, seed %llu", (unsigned long long)seed);
    cr_assert_eq(ds_pipeline_skipped(p), 1000);
    /* which keys get the first 100 warnings depends on thread timing; the form does not */
    cr_assert(strstr(log, "skipping corrupt record: shard tr-00001-of-00003 key 00000") &&
                  strstr(log, ": shard is truncated"), "%.2000s", log);
    free(log);
    free(img);
    ds_pipeline_destroy(&p);
}

Test(ds_pipeline, truncated_image_payload_is_corrupt)
{
    uint64_t seed = zt_seed_init();
    ds_writer *w;
    cr_assert_eq(ds_writer_new(s_dir, "tj", 1, false, &w), ZPS_OK);
    ds_codec *c = ds_codec_new();
    uint8_t px[SIDE * SIDE];
    for (uint64_t g = 0; g < 6; g++) {
        s_make(seed, g, px);
        ds_record r = {.encoding = DS_ENC_JPEG, .height = SIDE, .width = SIDE, .channels = 1,
                       .label = 1};
        cr_assert_eq(ds_image_encode(c, px, SIDE, SIDE, 1, DS_ENC_JPEG, 90, &r.image, &r.image_len), 0);
        if (g == 3)
            r.image_len /= 2; /* checksum is computed over the cut bytes: only decoding can tell */
        cr_assert_eq(ds_writer_put(w, &r), ZPS_OK);
    }
    cr_assert_eq(ds_writer_close(&w), ZPS_OK);
    ds_codec_destroy(&c);
    ds_pipeline_opts o;
    s_opts(&o, 6);
    o.once = true;
    o.threads = 0; /* decode inside next(), while stderr is captured */
    ds_pipeline *p;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
    float img[6 * SIDE * SIDE];
    int32_t lab[6];
    zt_capture_begin(s_dir);
    zps_status st = ds_pipeline_next(p, img, lab, NULL);
    char *log = zt_capture_end();
    cr_assert_eq(st, ZPS_ERR_CORRUPT);
    cr_assert(strstr(log, "shard tj-00000-of-00001 key 0000000003") && strstr(log, "JPEG"), "%s", log);
    free(log);
    ds_pipeline_destroy(&p);
}

Test(ds_pipeline, detection_boxes_follow_crop_and_flip)
{
    uint64_t seed = zt_seed_init();
    ds_convert_opts co = {.out = s_dir, .shards = 2, .encoding = DS_ENC_PNG, .seed = seed};
    ds_detection_opts dopt = {.canvas = 64, .min_items = 1, .max_items = 6, .n_train = 40,
                              .n_test = 8, .min_scale = 0.3f, .max_scale = 0.6f, .max_iou = 0.3f};
    cr_assert_eq(ds_make_detection(DS_FMNIST_DIR, &co, &dopt), ZPS_OK);
    /* once (no augmentation): boxes are the records' boxes, and each lies on visible pixels */
    ds_pipeline_opts o;
    ds_pipeline_opts_default(&o);
    o.path = s_dir;
    o.split = "train";
    o.batch = 8;
    o.height = o.width = 64;
    o.once = true;
    ds_pipeline *p;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
    float *img = malloc(sizeof(float) * 8 * 64 * 64);
    int32_t lab[8];
    ds_batch_info info;
    int total = 0;
    while (ds_pipeline_next(p, img, lab, &info) == ZPS_OK) {
        for (int k = 0; k < info.count; k++) {
            cr_assert_eq(lab[k], -1);
            int nb = info.box_start[k + 1] - info.box_start[k];
            cr_assert(nb >= 1 && nb <= 6, "%d boxes", nb);
            /* no item hidden under another: overlap <= half of the smaller box */
            for (int i = info.box_start[k]; i < info.box_start[k + 1]; i++)
                for (int j = i + 1; j < info.box_start[k + 1]; j++) {
                    const ds_box *p1 = &info.boxes[i], *p2 = &info.boxes[j];
                    float ix = fminf(p1->xmax, p2->xmax) - fmaxf(p1->xmin, p2->xmin);
                    float iy = fminf(p1->ymax, p2->ymax) - fmaxf(p1->ymin, p2->ymin);
                    if (ix <= 0 || iy <= 0)
                        continue;
                    float a1 = (p1->xmax - p1->xmin) * (p1->ymax - p1->ymin);
                    float a2 = (p2->xmax - p2->xmin) * (p2->ymax - p2->ymin);
                    cr_assert(ix * iy <= DS_DETECTION_MAX_COVER * fminf(a1, a2) + 1e-6f,
                              "boxes %d and %d overlap %.2f of the smaller, seed %llu", i, j,
                              ix * iy / fminf(a1, a2), (unsigned long long)seed);
                }
            for (int j = info.box_start[k]; j < info.box_start[k + 1]; j++) {
                const ds_box *b = &info.boxes[j];
                cr_assert(b->label >= 0 && b->label < 10);
                /* the box's interior holds bright pixels (the item) */
                float mx = 0;
                for (int y = (int)(b->ymin * 64); y < (int)(b->ymax * 64); y++)
                    for (int x = (int)(b->xmin * 64); x < (int)(b->xmax * 64); x++)
                        mx = fmaxf(mx, img[(size_t)k * 4096 + y * 64 + x]);
                cr_assert(mx > 0.1f, "empty box, seed %llu", (unsigned long long)seed);
                total++;
            }
        }
    }
    cr_assert(total >= 40);
    ds_pipeline_destroy(&p);
    /* augmentation: all boxes stay valid and still cover bright pixels */
    o.once = false;
    o.augment = true;
    o.crop_min_area = 0.5f;
    o.seed = seed;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
    for (int b = 0; b < 10; b++) {
        cr_assert_eq(ds_pipeline_next(p, img, lab, &info), ZPS_OK);
        for (int k = 0; k < info.count; k++)
            for (int j = info.box_start[k]; j < info.box_start[k + 1]; j++) {
                const ds_box *bx = &info.boxes[j];
                cr_assert(bx->xmin >= 0 && bx->xmin < bx->xmax && bx->xmax <= 1 && bx->ymin >= 0 &&
                          bx->ymin < bx->ymax && bx->ymax <= 1);
                float mx = 0;
                for (int y = (int)(bx->ymin * 64); y < (int)ceilf(bx->ymax * 64); y++)
                    for (int x = (int)(bx->xmin * 64); x < (int)ceilf(bx->xmax * 64); x++)
                        mx = fmaxf(mx, img[(size_t)k * 4096 + y * 64 + x]);
                cr_assert(mx > 0.05f, "augmented box over empty pixels, seed %llu", (unsigned long long)seed);
            }
    }
    ds_pipeline_destroy(&p);
    free(img);
}

Test(ds_pipeline, bad_options_are_refused)
{
    uint64_t seed = zt_seed_init();
    s_write("op", 1, 10, seed, false);
    ds_pipeline_opts o;
    ds_pipeline *p;
    s_opts(&o, 11);
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_ERR_INVALID, "a training share smaller than a batch");
    s_opts(&o, 2);
    o.channels = 2;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_ERR_INVALID);
    s_opts(&o, 2);
    o.trainer_index = 3;
    o.n_trainers = 3;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_ERR_INVALID);
    s_opts(&o, 2);
    o.std[0] = 0;
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_ERR_INVALID);
    s_opts(&o, 2);
    o.path = "/nonexistent/zps";
    cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_ERR_NOT_FOUND);
}

/* Seeking back to batch b hands out the same batches as the first time from b on (a trainer
 * redoing steps after a sync rollback), across an epoch boundary, for any thread count. */
Test(ds_pipeline, seek_replays_the_same_batches)
{
    uint64_t seed = zt_seed_init();
    s_write("det", 2, 60, seed, true);
    ds_pipeline_opts o;
    s_opts(&o, 8);
    o.augment = true;
    o.seed = seed;
    const int B = 8, N = 20; /* 7 batches per epoch: the replay crosses epochs */
    size_t per = (size_t)B * SIDE * SIDE;
    float *first = malloc(sizeof(float) * per * N), *img = malloc(sizeof(float) * per);
    int32_t lab[8];
    const int threads[] = {0, 2};
    for (int t = 0; t < 2; t++) {
        o.threads = threads[t];
        o.prefetch = 3;
        ds_pipeline *p;
        cr_assert_eq(ds_pipeline_new(&o, &p), ZPS_OK);
        for (int b = 0; b < N; b++)
            cr_assert_eq(ds_pipeline_next(p, first + (size_t)b * per, lab, NULL), ZPS_OK);
        const int back[] = {5, 13, 0};
        for (int k = 0; k < 3; k++) {
            ds_pipeline_seek(p, back[k]);
            for (int b = back[k]; b < back[k] + 4; b++) {
                ds_batch_info info;
                cr_assert_eq(ds_pipeline_next(p, img, lab, &info), ZPS_OK);
                cr_assert_eq(info.epoch * 7 + info.index, b);
                cr_assert_eq(memcmp(img, first + (size_t)b * per, per * sizeof(float)), 0,
                             "batch %d differs after a seek to %d (%d threads, seed %llu)", b,
                             back[k], threads[t], (unsigned long long)seed);
            }
        }
        ds_pipeline_destroy(&p);
    }
    free(first);
    free(img);
}
