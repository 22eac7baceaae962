/* test_ds_shard.c — LMDB shards: records spread evenly and read back identical by index and
 * by cursor, the map grows past its initial size, the trainer assignment is disjoint and
 * balanced, and missing, truncated or foreign shards give errors that name the shard.
 * Fashion-MNIST: a 3,000-record subset converts with pixels equal to the IDX files (the
 * full 60,000/10,000 check is in it_ds). */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tests/testutil.h"
#include "common/mem.h"
#include "datasets/convert.h"
#include "datasets/record.h"
#include "datasets/shard.h"

static char s_dir[64];
static void s_mktmp(void) { zt_mktmp(s_dir, sizeof s_dir, "zps-ds"); }
static void s_rmtmp(void) { zt_rmtmp(s_dir); }

/* Record g of a test dataset: h x w gray raw pixels derived from (seed, g), label g % 10. */
static void s_make(uint64_t seed, uint64_t g, uint8_t *px, int n)
{
    uint64_t s = ds_mix64(seed ^ ds_mix64(g));
    for (int i = 0; i < n; i++)
        px[i] = (uint8_t)(ds_rand(&s) >> 56);
    px[0] = (uint8_t)(g & 0xff) | 1;
}

static void s_write(const char *dir, const char *name, int shards, uint64_t count, int side,
                    uint64_t seed)
{
    ds_writer *w;
    cr_assert_eq(ds_writer_new(dir, name, shards, false, &w), ZPS_OK);
    uint8_t *px = malloc((size_t)side * side);
    for (uint64_t g = 0; g < count; g++) {
        s_make(seed, g, px, side * side);
        ds_record r = {.image = px, .image_len = (size_t)side * side, .encoding = DS_ENC_RAW,
                       .height = (uint32_t)side, .width = (uint32_t)side, .channels = 1,
                       .label = (int32_t)(g % 10)};
        cr_assert_eq(ds_writer_put(w, &r), ZPS_OK);
    }
    cr_assert_eq(ds_writer_count(w), count);
    cr_assert_eq(ds_writer_close(&w), ZPS_OK);
    cr_assert_null(w);
    free(px);
}

TestSuite(ds_shard, .init = s_mktmp, .fini = s_rmtmp, .timeout = 30);

Test(ds_shard, records_spread_evenly_and_read_back_by_index_and_cursor)
{
    uint64_t seed = zt_seed_init();
    const int side = 9, N = 3 + (int)(seed % 4);
    const uint64_t count = 500 + seed % 300;
    s_write(s_dir, "tr", N, count, side, seed);
    ds_dataset *d;
    cr_assert_eq(ds_dataset_open(s_dir, NULL, &d), ZPS_OK);
    cr_assert_eq(d->n_shards, N);
    cr_assert_str_eq(d->name, "tr");
    cr_assert_eq(d->total, count);
    zps_arena *a = zps_arena_new(0);
    uint8_t *want = malloc(side * side);
    for (int s = 0; s < N; s++) {
        uint64_t c = ds_shard_count(d->shards[s]);
        cr_assert(c == count / N || c == count / N + 1, "shard %d has %llu, seed %llu", s,
                  (unsigned long long)c, (unsigned long long)seed);
        char nm[64];
        snprintf(nm, sizeof nm, "tr-%05d-of-%05d", s, N);
        cr_assert_str_eq(ds_shard_name(d->shards[s]), nm);
        ds_reader *r;
        cr_assert_eq(ds_reader_new(d->shards[s], &r), ZPS_OK);
        /* writer order g goes to shard g % N, key g / N */
        for (uint64_t k = 0; k < c; k++) {
            const uint8_t *v;
            size_t len;
            cr_assert_eq(ds_reader_get(r, k, &v, &len), ZPS_OK);
            ds_record rec;
            char why[256];
            cr_assert_eq(ds_record_parse(v, len, a, 10, &rec, why, sizeof why), ZPS_OK, "%s", why);
            uint64_t g = k * (uint64_t)N + (uint64_t)s;
            s_make(seed, g, want, side * side);
            cr_assert_eq(rec.label, (int32_t)(g % 10));
            cr_assert_eq(memcmp(rec.image, want, side * side), 0, "record %llu differs, seed %llu",
                         (unsigned long long)g, (unsigned long long)seed);
            zps_arena_reset(a);
        }
        /* cursor: every key in order, then EOF */
        char key[DS_KEY_LEN + 1], exp[DS_KEY_LEN + 1];
        const uint8_t *v;
        size_t len;
        for (uint64_t k = 0; k < c; k++) {
            cr_assert_eq(ds_reader_next(r, key, &v, &len), ZPS_OK);
            ds_key_format(k, exp);
            cr_assert_str_eq(key, exp);
        }
        cr_assert_eq(ds_reader_next(r, key, &v, &len), ZPS_ERR_EOF);
        ds_reader_rewind(r);
        cr_assert_eq(ds_reader_next(r, key, &v, &len), ZPS_OK);
        cr_assert_str_eq(key, "0000000000");
        cr_assert_eq(ds_reader_get(r, c, &v, &len), ZPS_ERR_CORRUPT, "index past the end");
        ds_reader_destroy(&r);
    }
    /* locate inverts the global numbering */
    for (uint64_t g = 0; g < count; g += 7) {
        int s;
        uint64_t local;
        ds_dataset_locate(d, g, &s, &local);
        cr_assert(d->offsets[s] + local == g && local < ds_shard_count(d->shards[s]));
    }
    free(want);
    zps_arena_destroy(&a);
    ds_dataset_close(&d);
    cr_assert_null(d);
}

Test(ds_shard, map_grows_past_initial_size)
{
    uint64_t seed = zt_seed_init();
    /* 300 records of 96x96 = 2.7 MB in one shard, initial map 1 MiB */
    s_write(s_dir, "big", 1, 300, 96, seed);
    ds_dataset *d;
    cr_assert_eq(ds_dataset_open(s_dir, NULL, &d), ZPS_OK);
    cr_assert_eq(d->total, 300);
    ds_reader *r;
    cr_assert_eq(ds_reader_new(d->shards[0], &r), ZPS_OK);
    const uint8_t *v;
    size_t len;
    cr_assert_eq(ds_reader_get(r, 299, &v, &len), ZPS_OK);
    ds_reader_destroy(&r);
    ds_dataset_close(&d);
}

Test(ds_shard, assignment_is_disjoint_covering_and_balanced)
{
    uint64_t seed = zt_seed_init(), s = seed;
    for (int it = 0; it < 200; it++) {
        uint64_t total = ds_rand(&s) % 100000;
        int n = 1 + (int)(ds_rand(&s) % 64);
        uint64_t prev_end = 0, lo = UINT64_MAX, hi = 0;
        for (int i = 0; i < n; i++) {
            uint64_t b, e;
            ds_assign(total, i, n, &b, &e);
            cr_assert_eq(b, prev_end, "gap or overlap at trainer %d, seed %llu", i, (unsigned long long)seed);
            prev_end = e;
            lo = e - b < lo ? e - b : lo;
            hi = e - b > hi ? e - b : hi;
        }
        cr_assert_eq(prev_end, total);
        cr_assert(hi - lo <= 1, "sizes %llu..%llu", (unsigned long long)lo, (unsigned long long)hi);
    }
}

Test(ds_shard, prefix_split_and_several_datasets)
{
    uint64_t seed = zt_seed_init();
    char sub[128];
    snprintf(sub, sizeof sub, "%s/train", s_dir);
    s_write(sub, "train", 2, 40, 5, seed);
    s_write(sub, "other", 3, 30, 5, seed);
    ds_dataset *d;
    zt_capture_begin(s_dir);
    zps_status st = ds_dataset_open(sub, NULL, &d);
    char *log = zt_capture_end();
    cr_assert_eq(st, ZPS_ERR_INVALID, "two datasets in one directory need a prefix");
    cr_assert(strstr(log, "several datasets"), "%s", log);
    free(log);
    char prefix[160];
    snprintf(prefix, sizeof prefix, "%s/other", sub);
    cr_assert_eq(ds_dataset_open(prefix, NULL, &d), ZPS_OK);
    cr_assert_eq(d->total, 30);
    cr_assert_eq(d->n_shards, 3);
    ds_dataset_close(&d);
    snprintf(prefix, sizeof prefix, "%s/train/train", s_dir);
    cr_assert_eq(ds_dataset_open(prefix, NULL, &d), ZPS_OK);
    cr_assert_eq(d->total, 40);
    ds_dataset_close(&d);
    cr_assert_eq(ds_dataset_open(s_dir, "nosuch", &d), ZPS_ERR_NOT_FOUND);
    /* writing over existing shards needs overwrite */
    ds_writer *w;
    cr_assert_eq(ds_writer_new(sub, "train", 2, false, &w), ZPS_ERR_EXISTS);
    cr_assert_eq(ds_writer_new(sub, "train", 4, true, &w), ZPS_OK);
    cr_assert_eq(ds_writer_close(&w), ZPS_OK);
    snprintf(prefix, sizeof prefix, "%s/train", sub);
    cr_assert_eq(ds_dataset_open(prefix, NULL, &d), ZPS_OK);
    cr_assert_eq(d->n_shards, 4, "overwrite removed the 2-shard set");
    cr_assert_eq(d->total, 0);
    ds_dataset_close(&d);
}

/* Opening the dataset in s_dir fails with want and logs msg (and msg2 when not NULL). */
static void s_open_fails(zps_status want, const char *msg, const char *msg2)
{
    ds_dataset *d = NULL;
    zt_capture_begin(s_dir);
    zps_status st = ds_dataset_open(s_dir, NULL, &d);
    char *log = zt_capture_end();
    cr_assert_eq(st, want, "%s", log);
    cr_assert(strstr(log, msg) && (!msg2 || strstr(log, msg2)), "%s", log);
    free(log);
}

Test(ds_shard, missing_truncated_and_foreign_shards_are_named)
{
    uint64_t seed = zt_seed_init();
    s_write(s_dir, "ds", 4, 2000, 16, seed);
    char path[256], cmd[512];
    ds_dataset *d;
    /* truncated data.mdb */
    snprintf(path, sizeof path, "%s/ds-00002-of-00004/data.mdb", s_dir);
    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    cr_assert_eq(truncate(path, sb.st_size / 2), 0);
    s_open_fails(ZPS_ERR_CORRUPT, "ds-00002-of-00004", "truncated");
    /* allowed damaged: opens with its record count from the meta page; every read fails */
    cr_assert_eq(ds_dataset_open_flags(s_dir, NULL, DS_OPEN_ALLOW_DAMAGED, &d), ZPS_OK);
    cr_assert_eq(d->total, 2000);
    cr_assert_eq(ds_shard_count(d->shards[2]), 500);
    cr_assert_not_null(ds_shard_damage(d->shards[2]));
    cr_assert_null(ds_shard_damage(d->shards[1]));
    ds_reader *r;
    cr_assert_eq(ds_reader_new(d->shards[2], &r), ZPS_OK);
    const uint8_t *v;
    size_t len;
    zt_capture_begin(s_dir);
    zps_status st = ds_reader_get(r, 17, &v, &len);
    char *log = zt_capture_end();
    cr_assert_eq(st, ZPS_ERR_CORRUPT);
    cr_assert(strstr(log, "shard ds-00002-of-00004 key 0000000017: shard is truncated"), "%s", log);
    free(log);
    ds_reader_destroy(&r);
    ds_dataset_close(&d);
    /* not an LMDB file */
    FILE *f = fopen(path, "w");
    for (int i = 0; i < 10000; i++)
        fputc((int)(ds_mix64(seed + (uint64_t)i) & 0xff), f);
    fclose(f);
    s_open_fails(ZPS_ERR_CORRUPT, "ds-00002-of-00004", NULL);
    /* a missing shard */
    snprintf(cmd, sizeof cmd, "rm -rf '%s/ds-00002-of-00004'", s_dir);
    cr_assert_eq(system(cmd), 0);
    s_open_fails(ZPS_ERR_NOT_FOUND, "missing shard ds-00002-of-00004", NULL);
}

Test(ds_shard, fashion_mnist_subset_pixels_equal_idx)
{
    ds_convert_opts o = {.out = s_dir, .shards = 3, .encoding = DS_ENC_RAW, .limit = 3000};
    uint64_t ntr, nte;
    cr_assert_eq(ds_convert_fmnist(DS_FMNIST_DIR, &o, &ntr, &nte), ZPS_OK);
    cr_assert_eq(ntr, 3000);
    cr_assert_eq(nte, 3000);
    uint8_t *im, *lb;
    size_t n;
    cr_assert_eq(ds_fmnist_load(DS_FMNIST_DIR, "t10k", &im, &lb, &n), ZPS_OK);
    cr_assert_eq(n, 10000);
    ds_dataset *d;
    cr_assert_eq(ds_dataset_open(s_dir, "test", &d), ZPS_OK);
    cr_assert_eq(d->total, 3000);
    cr_assert_eq(d->num_classes, 10);
    cr_assert_str_eq(d->classes[9], "Ankle boot");
    zps_arena *a = zps_arena_new(0);
    for (int s = 0; s < 3; s++) {
        ds_reader *r;
        cr_assert_eq(ds_reader_new(d->shards[s], &r), ZPS_OK);
        for (uint64_t k = 0; k < ds_shard_count(d->shards[s]); k++) {
            const uint8_t *v;
            size_t len;
            ds_record rec;
            cr_assert_eq(ds_reader_get(r, k, &v, &len), ZPS_OK);
            cr_assert_eq(ds_record_parse(v, len, a, 10, &rec, NULL, 0), ZPS_OK);
            uint64_t g = k * 3 + (uint64_t)s;
            cr_assert(rec.height == 28 && rec.width == 28 && rec.channels == 1);
            cr_assert_eq(rec.label, lb[g]);
            cr_assert_eq(memcmp(rec.image, im + g * 784, 784), 0, "item %llu", (unsigned long long)g);
            zps_arena_reset(a);
        }
        ds_reader_destroy(&r);
    }
    zps_arena_destroy(&a);
    ds_dataset_close(&d);
    free(im);
    free(lb);
}

Test(ds_shard, unfinished_writes_never_look_like_a_dataset)
{
    uint64_t seed = zt_seed_init();
    ds_writer *w;
    cr_assert_eq(ds_writer_new(s_dir, "half", 2, false, &w), ZPS_OK);
    uint8_t px[16];
    for (int i = 0; i < 16; i++)
        px[i] = (uint8_t)(ds_mix64(seed + (uint64_t)i) | 1);
    ds_record r = {.image = px, .image_len = 16, .encoding = DS_ENC_RAW, .height = 4, .width = 4,
                   .channels = 1, .label = 3};
    for (int i = 0; i < 100; i++)
        cr_assert_eq(ds_writer_put(w, &r), ZPS_OK);
    /* while writing, readers see nothing */
    ds_dataset *d;
    cr_assert_eq(ds_dataset_open(s_dir, NULL, &d), ZPS_ERR_NOT_FOUND);
    ds_writer_destroy(&w); /* abandoned: the hidden directories go too */
    cr_assert_null(w);
    char cmd[160];
    snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s')\"", s_dir);
    cr_assert_eq(system(cmd), 0, "leftovers in %s", s_dir);
    cr_assert_eq(ds_writer_new(s_dir, "half", 2, false, &w), ZPS_OK);
    cr_assert_eq(ds_writer_put(w, &r), ZPS_OK);
    cr_assert_eq(ds_writer_close(&w), ZPS_OK);
    cr_assert_eq(ds_dataset_open(s_dir, NULL, &d), ZPS_OK);
    cr_assert_eq(d->total, 1);
    ds_dataset_close(&d);
    snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s' | grep tmp)\"", s_dir);
    cr_assert_eq(system(cmd), 0, "tmp directories left after close");
}
