/* test_ds_cli.c — zps-data end to end (suite it_ds: runs the binary from $ZPS_BIN):
 * the full Fashion-MNIST conversion (60,000 + 10,000 records, 6,000 and 1,000 per class,
 * pixels equal to the IDX files), verify naming corrupt records and truncated shards,
 * folder conversion with classes.txt and exact PNG bytes, and detection canvases that are
 * deterministic from the seed; `read` fails on a corrupt record or skips and counts it. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <lmdb.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/mem.h"
#include "tests/testutil.h"
#include "datasets/convert.h"
#include "datasets/image.h"
#include "datasets/shard.h"

static char s_dir[64];
static void s_mktmp(void)
{
    snprintf(s_dir, sizeof s_dir, "/tmp/zps-dc-XXXXXX");
    cr_assert_not_null(mkdtemp(s_dir));
}
static void s_rmtmp(void)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", s_dir);
    cr_assert_eq(system(cmd), 0);
}

/* Runs zps-data with args (NULL-terminated); stdout+stderr into *out (caller frees).
 * Returns the exit status. */
static int s_run(char **out, const char *const *args)
{
    char logp[128];
    snprintf(logp, sizeof logp, "%s/out.txt", s_dir);
    return zt_run("zps-data", args, NULL, logp, 300, out);
}

/* Runs zps-data with args; asserts its exit code is code and its output holds every string
 * that follows args (NULL-terminated). */
static void s_expect(int code, const char *const *args, ...)
{
    char *log;
    cr_assert_eq(s_run(&log, args), code, "%s", log);
    va_list ap;
    va_start(ap, args);
    for (const char *want; (want = va_arg(ap, const char *));)
        cr_assert(strstr(log, want), "%s", log);
    va_end(ap);
    free(log);
}

TestSuite(it_ds, .init = s_mktmp, .fini = s_rmtmp, .timeout = 60);

Test(it_ds, fashion_mnist_full_conversion_matches_idx)
{
    char out[128];
    snprintf(out, sizeof out, "%s/fm", s_dir);
    char *log;
    cr_assert_eq(s_run(&log, (const char *const[]){"convert", "fashion-mnist", "--out", out, "--shards",
                                                   "3", NULL}), 0, "%s", log);
    free(log);
    static const char *const split[2] = {"train", "test"}, *const idx[2] = {"train", "t10k"};
    const uint64_t want[2] = {60000, 10000};
    zps_arena *a = zps_arena_new(0);
    for (int sp = 0; sp < 2; sp++) {
        uint8_t *im, *lb;
        size_t n;
        cr_assert_eq(ds_fmnist_load(DS_FMNIST_DIR, idx[sp], &im, &lb, &n), ZPS_OK);
        ds_dataset *d;
        cr_assert_eq(ds_dataset_open(out, split[sp], &d), ZPS_OK);
        cr_assert_eq(d->total, want[sp]);
        cr_assert_eq(d->n_shards, 3);
        uint64_t per_class[10] = {0};
        for (int s = 0; s < 3; s++) {
            ds_reader *r;
            cr_assert_eq(ds_reader_new(d->shards[s], &r), ZPS_OK);
            char key[DS_KEY_LEN + 1];
            const uint8_t *v;
            size_t len;
            uint64_t k = 0;
            while (ds_reader_next(r, key, &v, &len) == ZPS_OK) {
                ds_record rec;
                cr_assert_eq(ds_record_parse(v, len, a, 10, &rec, NULL, 0), ZPS_OK);
                uint64_t g = k * 3 + (uint64_t)s;
                cr_assert_eq(rec.label, lb[g], "%s item %llu", split[sp], (unsigned long long)g);
                cr_assert_eq(memcmp(rec.image, im + g * 784, 784), 0, "%s item %llu pixels", split[sp],
                             (unsigned long long)g);
                per_class[rec.label]++;
                zps_arena_reset(a);
                k++;
            }
            ds_reader_destroy(&r);
        }
        for (int c = 0; c < 10; c++)
            cr_assert_eq(per_class[c], want[sp] / 10, "%s class %d", split[sp], c);
        ds_dataset_close(&d);
        free(im);
        free(lb);
    }
    zps_arena_destroy(&a);
}


Test(it_ds, verify_names_corrupt_records_and_truncated_shards)
{
    char out[128], shard[192];
    snprintf(out, sizeof out, "%s/fm", s_dir);
    char *log;
    cr_assert_eq(s_run(&log, (const char *const[]){"convert", "fashion-mnist", "--out", out, "--limit",
                                                   "2000", "--encoding", "png", NULL}), 0, "%s", log);
    free(log);
    s_expect(0, (const char *const[]){"verify", out, "--split", "test", NULL},
             "2000 records, 0 corrupt", NULL);
    snprintf(shard, sizeof shard, "%s/test/test-00001-of-00004", out);
    zt_shard_corrupt(shard, 7, 40, 0x10); /* any flipped bit fails the record CRC */
    zt_shard_corrupt(shard, 300, 40, 0x10);
    s_expect(1, (const char *const[]){"verify", out, "--split", "test", NULL},
             "shard test-00001-of-00004 key 0000000007", "shard test-00001-of-00004 key 0000000300",
             "2000 records, 2 corrupt", NULL);
    s_expect(1, (const char *const[]){"inspect", out, "--split", "test", NULL},
             "1998 in 4 shards (2 corrupt)", NULL);
    /* the pipeline: fails naming the record, or skips and counts with --skip-corrupt */
    s_expect(1, (const char *const[]){"read", out, "--split", "test", NULL},
             "shard test-00001-of-00004 key 0000000007", NULL);
    s_expect(0, (const char *const[]){"read", out, "--split", "test", "--skip-corrupt", "--threads", "2",
                                      "--size", "32x32x3", NULL},
             "1998 images in 63 batches, 2 corrupt skipped", NULL);
    /* truncated shard */
    char data[256];
    snprintf(data, sizeof data, "%s/train/train-00003-of-00004/data.mdb", out);
    struct stat sb;
    cr_assert_eq(stat(data, &sb), 0);
    cr_assert_eq(truncate(data, sb.st_size - 4096), 0);
    s_expect(1, (const char *const[]){"verify", out, "--split", "train", NULL},
             "shard train-00003-of-00004 keys 0000000000..0000000499 (500 records) "
             "unreadable: truncated", "1500 records, 500 corrupt", NULL);
    s_expect(1, (const char *const[]){"read", out, "--split", "train", NULL},
             "train-00003-of-00004 is truncated", NULL);
    s_expect(0, (const char *const[]){"read", out, "--split", "train", "--skip-corrupt", "--batch",
                                      "100", NULL},
             "1500 images in 20 batches, 500 corrupt skipped", NULL);
}

Test(it_ds, folder_conversion_keeps_bytes_and_writes_classes)
{
    uint64_t seed = zt_seed_init(), rs = seed;
    static const char *const cls[3] = {"cat", "dog", "zebra"};
    ds_codec *c = ds_codec_new();
    char path[256];
    int made = 0;
    uint8_t px[20 * 24 * 3];
    for (int k = 0; k < 3; k++) {
        snprintf(path, sizeof path, "%s/src/%s", s_dir, cls[k]);
        char cmd[300];
        snprintf(cmd, sizeof cmd, "mkdir -p '%s'", path);
        cr_assert_eq(system(cmd), 0);
        for (int i = 0; i < 4 + k; i++, made++) {
            for (size_t j = 0; j < sizeof px; j++)
                px[j] = (uint8_t)(ds_rand(&rs) >> 56) | 1;
            const uint8_t *b;
            size_t len;
            ds_encoding e = i % 2 ? DS_ENC_JPEG : DS_ENC_PNG;
            cr_assert_eq(ds_image_encode(c, px, 20, 24, 3, e, 90, &b, &len), ZPS_OK);
            snprintf(path, sizeof path, "%s/src/%s/%d.%s", s_dir, cls[k], i, e == DS_ENC_PNG ? "png" : "jpg");
            FILE *f = fopen(path, "wb");
            cr_assert_eq(fwrite(b, 1, len, f), len);
            fclose(f);
        }
    }
    snprintf(path, sizeof path, "%s/src/dog/broken.png", s_dir);
    FILE *f = fopen(path, "wb");
    fputs("not a png", f);
    fclose(f);
    ds_codec_destroy(&c);
    char src[128], out[128];
    snprintf(src, sizeof src, "%s/src", s_dir);
    snprintf(out, sizeof out, "%s/out", s_dir);
    char *log;
    s_expect(0, (const char *const[]){"convert", "folder", src, "--out", out, "--shards", "2", NULL},
             "15 records (1 files skipped)", NULL);
    ds_dataset *d;
    cr_assert_eq(ds_dataset_open(out, NULL, &d), ZPS_OK);
    cr_assert_eq(d->total, (uint64_t)made);
    cr_assert_eq(d->num_classes, 3);
    cr_assert_str_eq(d->classes[2], "zebra");
    ds_dataset_close(&d);
    cr_assert_eq(s_run(&log, (const char *const[]){"verify", out, NULL}), 0, "%s", log);
    free(log);
    /* resized copy: every record is 16x16 */
    snprintf(out, sizeof out, "%s/out16", s_dir);
    cr_assert_eq(s_run(&log, (const char *const[]){"convert", "folder", src, "--out", out, "--resize", "16x16",
                                                   "--encoding", "png", NULL}), 0, "%s", log);
    free(log);
    s_expect(0, (const char *const[]){"inspect", out, NULL},
             "h 16..16, w 16..16", NULL);
}

Test(it_ds, detection_is_deterministic_from_the_seed)
{
    char a[128], b[128];
    snprintf(a, sizeof a, "%s/a", s_dir);
    snprintf(b, sizeof b, "%s/b", s_dir);
    char *log;
    for (int i = 0; i < 2; i++) {
        cr_assert_eq(s_run(&log, (const char *const[]){"make-detection", "--out", i ? b : a, "--train", "60",
                                                       "--test", "10", "--canvas", "96", "--seed", "7",
                                                       "--shards", "2", NULL}), 0, "%s", log);
        free(log);
    }
    char png[160];
    snprintf(png, sizeof png, "%s/rec5.png", s_dir);
    cr_assert_eq(s_run(&log, (const char *const[]){"inspect", a, "--split", "train", "--dump", "5",
                                                   "--dump-out", png, NULL}), 0, "%s", log);
    cr_assert(strstr(log, "60 in 2 shards (0 corrupt)") && strstr(log, "per record"), "%s", log);
    free(log);
    /* the dump is an RGB PNG of the canvas with red box outlines */
    FILE *f = fopen(png, "rb");
    cr_assert_not_null(f);
    static uint8_t bytes[1 << 16];
    size_t n = fread(bytes, 1, sizeof bytes, f);
    fclose(f);
    ds_codec *c = ds_codec_new();
    ds_pixels px;
    ds_encoding enc;
    cr_assert_eq(ds_image_decode_any(c, bytes, n, &px, &enc), ZPS_OK);
    cr_assert(enc == DS_ENC_PNG && px.h == 96 && px.w == 96 && px.c == 3);
    int red = 0;
    for (int i = 0; i < 96 * 96; i++)
        red += px.px[3 * i] == 255 && px.px[3 * i + 1] == 0 && px.px[3 * i + 2] == 0;
    cr_assert(red >= 40, "only %d red pixels: boxes not drawn", red);
    ds_codec_destroy(&c);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "cmp -s '%s/train/train-00001-of-00002/data.mdb' '%s/train/train-00001-of-00002/data.mdb'", a, b);
    cr_assert_eq(system(cmd), 0, "same seed, different canvases");
}

/* The resize convention is PyTorch's bilinear interpolate with align_corners=False
 * (tests/ref/ds_resize.py), for up- and down-scaling, gray and RGB. */
Test(it_ds, resize_matches_pytorch_bilinear)
{
    uint64_t seed = zt_seed_init(), rs = seed;
    const char *root = getenv("ZPS_ROOT");
    const int cases[4][5] = {{23, 31, 3, 75, 50}, {28, 28, 1, 75, 75}, {120, 90, 3, 33, 47}, {9, 200, 1, 40, 17}};
    char cmd[4096];
    int len = snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s/tests/ref/ds_resize.py'", root ? root : ".");
    for (int t = 0; t < 4; t++) {
        int h = cases[t][0], w = cases[t][1], c = cases[t][2], oh = cases[t][3], ow = cases[t][4];
        uint8_t *px = malloc((size_t)h * w * c);
        for (int i = 0; i < h * w * c; i++)
            px[i] = (uint8_t)(ds_rand(&rs) >> 56) | 1;
        float *o = malloc(sizeof(float) * c * oh * ow);
        ds_pixels p = {.px = px, .h = h, .w = w, .c = c};
        ds_crop cr = {.x0 = 0, .y0 = 0, .w = (float)w, .h = (float)h, .flip = false};
        const float mean[3] = {0, 0, 0}, std[3] = {1, 1, 1};
        ds_image_sample(&p, &cr, oh, ow, c, mean, std, o);
        char in[128], out[128];
        snprintf(in, sizeof in, "%s/in%d.bin", s_dir, t);
        snprintf(out, sizeof out, "%s/out%d.bin", s_dir, t);
        FILE *f = fopen(in, "wb");
        cr_assert_eq(fwrite(px, 1, (size_t)h * w * c, f), (size_t)h * w * c);
        fclose(f);
        f = fopen(out, "wb");
        cr_assert_eq(fwrite(o, sizeof(float), (size_t)c * oh * ow, f), (size_t)c * oh * ow);
        fclose(f);
        len += snprintf(cmd + len, sizeof cmd - (size_t)len, " '%s' '%s' %d %d %d %d %d", in, out, h, w, c,
                        oh, ow);
        free(px);
        free(o);
    }
    cr_assert_eq(system(cmd), 0, "zps resize differs from PyTorch, seed %llu", (unsigned long long)seed);
}

Test(it_ds, mistakes_are_told_once_in_one_line)
{
    static const struct {
        const char *args[6];
        int code;
        const char *msg; /* the whole output */
    } cases[] = {
        {{"inspect", "/d", "--bogus", NULL}, 2, "zps-data: unknown option '--bogus' (see --help)\n"},
        {{"--shards", "x", NULL}, 2,
         "zps-data: --shards wants an integer in [1, 99999], got 'x' (see --help)\n"},
        {{"bogus", NULL}, 2, "zps-data: unknown command 'bogus'; commands: convert, "
                             "make-detection, inspect, verify, read (see --help)\n"},
        {{"inspect", NULL}, 2, "zps-data: inspect needs one dataset PATH (see --help)\n"},
        {{"make-detection", NULL}, 2, "zps-data: make-detection needs --out DIR (see --help)\n"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *log;
        cr_assert_eq(s_run(&log, cases[i].args), cases[i].code, "case %zu: %s", i, log);
        cr_assert_str_eq(log, cases[i].msg, "case %zu", i);
        free(log);
    }
    /* a missing dataset: the reader's line says why, and nothing repeats it */
    static const char *const cmds[] = {"inspect", "verify", "read"};
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char *log;
        cr_assert_eq(s_run(&log, (const char *const[]){cmds[i], "/nonexistent/zps-data", NULL}), 1);
        cr_assert_eq(zt_count(log, "\n"), 1, "%s: one line:\n%s", cmds[i], log);
        cr_assert_not_null(strstr(log, "/nonexistent"), "%s", log);
        free(log);
    }
}
