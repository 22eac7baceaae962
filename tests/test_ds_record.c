/* test_ds_record.c — dataset records and codecs: raw and PNG round trips are exact, JPEG
 * within a stated tolerance, boxes exact; validation rejects each kind of bad record; every
 * single-byte flip of a packed record is caught; the fused crop/resize/normalise matches a
 * plain double-precision reference. Fresh random inputs every run (seed in each message). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/mem.h"
#include "datasets/image.h"
#include "datasets/record.h"

static uint64_t s_seed(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_sec;
}

static uint64_t s_next(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t x = *s;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static int s_rint(uint64_t *s, int lo, int hi) { return lo + (int)(s_next(s) % (uint64_t)(hi - lo + 1)); }

/* Random pixels with no all-zero image (never test on zeros). */
static void s_noise(uint8_t *px, size_t n, uint64_t *s)
{
    for (size_t i = 0; i < n; i++)
        px[i] = (uint8_t)(s_next(s) >> 56);
    px[0] |= 1;
}

/* Smooth content (what JPEG is for): sum of two random sinusoids plus mild noise. */
static void s_smooth(uint8_t *px, int h, int w, int c, uint64_t *s)
{
    double fx = 0.02 + (double)(s_next(s) % 100) / 2000.0, fy = 0.02 + (double)(s_next(s) % 100) / 2000.0;
    double ph = (double)(s_next(s) % 628) / 100.0;
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int k = 0; k < c; k++) {
                double v = 128 + 60 * sin(fx * x * (k + 1) + ph) + 50 * cos(fy * y + k) +
                           (double)(s_next(s) % 5);
                px[((size_t)y * w + x) * c + k] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
            }
}

static void s_random_boxes(ds_box *b, int n, uint64_t *s)
{
    for (int i = 0; i < n; i++) {
        float x0 = (float)(s_next(s) % 1000) / 2000.f, y0 = (float)(s_next(s) % 1000) / 2000.f;
        b[i] = (ds_box){.xmin = x0, .ymin = y0, .xmax = x0 + 0.01f + (float)(s_next(s) % 400) / 1000.f,
                        .ymax = y0 + 0.01f + (float)(s_next(s) % 400) / 1000.f, .label = s_rint(s, 0, 9)};
    }
}

static void s_same_record(const ds_record *a, const ds_record *b, uint64_t seed)
{
    cr_assert_eq(a->encoding, b->encoding, "seed %llu", (unsigned long long)seed);
    cr_assert_eq(a->height, b->height, "seed %llu", (unsigned long long)seed);
    cr_assert_eq(a->width, b->width, "seed %llu", (unsigned long long)seed);
    cr_assert_eq(a->channels, b->channels, "seed %llu", (unsigned long long)seed);
    cr_assert_eq(a->label, b->label, "seed %llu", (unsigned long long)seed);
    cr_assert_eq(a->image_len, b->image_len, "seed %llu", (unsigned long long)seed);
    cr_assert_eq(memcmp(a->image, b->image, a->image_len), 0, "seed %llu", (unsigned long long)seed);
    cr_assert_eq(a->n_boxes, b->n_boxes, "seed %llu", (unsigned long long)seed);
    for (int i = 0; i < a->n_boxes; i++)
        cr_assert_eq(memcmp(&a->boxes[i], &b->boxes[i], sizeof(ds_box)), 0,
                     "box %d differs, seed %llu", i, (unsigned long long)seed);
}

Test(ds_record, raw_round_trip_with_boxes_is_exact)
{
    uint64_t seed = s_seed(), s = seed;
    zps_arena *a = zps_arena_new(0);
    uint8_t *buf = NULL;
    size_t cap = 0;
    for (int it = 0; it < 50; it++) {
        int h = s_rint(&s, 1, 64), w = s_rint(&s, 1, 64), c = s_next(&s) % 2 ? 3 : 1;
        uint8_t *px = malloc((size_t)h * w * c);
        s_noise(px, (size_t)h * w * c, &s);
        ds_box boxes[8];
        int nb = s_rint(&s, 0, 8);
        s_random_boxes(boxes, nb, &s);
        ds_record r = {.image = px, .image_len = (size_t)h * w * c, .encoding = DS_ENC_RAW,
                       .height = (uint32_t)h, .width = (uint32_t)w, .channels = (uint32_t)c,
                       .label = s_rint(&s, 0, 9), .boxes = boxes, .n_boxes = nb};
        size_t len;
        cr_assert_eq(ds_record_pack(&r, &buf, &cap, &len), ZPS_OK, "seed %llu", (unsigned long long)seed);
        ds_record back;
        char why[256];
        cr_assert_eq(ds_record_parse(buf, len, a, 10, &back, why, sizeof why), ZPS_OK, "%s seed %llu",
                     why, (unsigned long long)seed);
        s_same_record(&r, &back, seed);
        zps_arena_reset(a);
        free(px);
    }
    free(buf);
    zps_arena_destroy(&a);
}

Test(ds_record, png_round_trip_is_exact_and_jpeg_within_tolerance)
{
    uint64_t seed = s_seed(), s = seed;
    ds_codec *c = ds_codec_new();
    cr_assert_not_null(c);
    zps_arena *a = zps_arena_new(0);
    uint8_t *buf = NULL;
    size_t cap = 0;
    for (int it = 0; it < 12; it++) {
        int h = s_rint(&s, 8, 120), w = s_rint(&s, 8, 120), ch = it % 2 ? 3 : 1;
        size_t n = (size_t)h * w * ch;
        uint8_t *px = malloc(n), *enc = NULL;
        ds_encoding e = it % 4 < 2 ? DS_ENC_PNG : DS_ENC_JPEG;
        if (e == DS_ENC_PNG)
            s_noise(px, n, &s);
        else
            s_smooth(px, h, w, ch, &s);
        const uint8_t *bytes;
        size_t blen;
        cr_assert_eq(ds_image_encode(c, px, h, w, ch, e, 95, &bytes, &blen), ZPS_OK);
        enc = malloc(blen);
        memcpy(enc, bytes, blen);
        ds_record r = {.image = enc, .image_len = blen, .encoding = e, .height = (uint32_t)h,
                       .width = (uint32_t)w, .channels = (uint32_t)ch, .label = 3};
        size_t len;
        cr_assert_eq(ds_record_pack(&r, &buf, &cap, &len), ZPS_OK);
        ds_record back;
        char why[256];
        cr_assert_eq(ds_record_parse(buf, len, a, 10, &back, why, sizeof why), ZPS_OK, "%s", why);
        s_same_record(&r, &back, seed);
        ds_pixels out;
        cr_assert_eq(ds_image_decode(c, &back, &out, why, sizeof why), ZPS_OK, "%s", why);
        cr_assert(out.h == h && out.w == w && out.c == ch);
        if (e == DS_ENC_PNG) {
            cr_assert_eq(memcmp(out.px, px, n), 0, "PNG pixels differ, seed %llu", (unsigned long long)seed);
        } else {
            /* Stated tolerance: JPEG quality 95 on smooth content, mean |error| <= 2.0 levels
             * and PSNR >= 35 dB. */
            double sad = 0, sse = 0;
            for (size_t i = 0; i < n; i++) {
                double d = (double)out.px[i] - px[i];
                sad += fabs(d);
                sse += d * d;
            }
            double mae = sad / (double)n, psnr = 10 * log10(255.0 * 255.0 / (sse / (double)n + 1e-12));
            cr_assert(mae <= 2.0 && psnr >= 35.0, "JPEG %dx%dx%d mae %.2f psnr %.1f, seed %llu", h, w,
                      ch, mae, psnr, (unsigned long long)seed);
        }
        zps_arena_reset(a);
        free(px);
        free(enc);
    }
    free(buf);
    zps_arena_destroy(&a);
    ds_codec_destroy(&c);
}

Test(ds_record, validation_rejects_each_bad_field)
{
    uint8_t px[4 * 5 * 3];
    for (size_t i = 0; i < sizeof px; i++)
        px[i] = (uint8_t)(i * 7 + 1);
    ds_box good = {.xmin = 0.1f, .ymin = 0.2f, .xmax = 0.5f, .ymax = 0.6f, .label = 2};
    const ds_record base = {.image = px, .image_len = sizeof px, .encoding = DS_ENC_RAW,
                            .height = 4, .width = 5, .channels = 3, .label = 1, .boxes = &good,
                            .n_boxes = 1};
    char why[256];
    cr_assert_eq(ds_record_validate(&base, 10, why, sizeof why), ZPS_OK, "%s", why);
    ds_record r;
    r = base; r.image_len--;
    cr_assert_eq(ds_record_validate(&r, 10, why, sizeof why), ZPS_ERR_CORRUPT);
    cr_assert(strstr(why, "bytes"), "%s", why);
    r = base; r.channels = 2;
    cr_assert_eq(ds_record_validate(&r, 10, why, sizeof why), ZPS_ERR_CORRUPT);
    r = base; r.height = 0;
    cr_assert_eq(ds_record_validate(&r, 10, why, sizeof why), ZPS_ERR_CORRUPT);
    r = base; r.label = 10;
    cr_assert_eq(ds_record_validate(&r, 10, why, sizeof why), ZPS_ERR_CORRUPT);
    cr_assert_eq(ds_record_validate(&r, 0, why, sizeof why), ZPS_OK, "no class bound given");
    r = base; r.label = -1; r.n_boxes = 0;
    cr_assert_eq(ds_record_validate(&r, 10, why, sizeof why), ZPS_ERR_CORRUPT);
    r = base; r.encoding = (ds_encoding)7;
    cr_assert_eq(ds_record_validate(&r, 10, why, sizeof why), ZPS_ERR_CORRUPT);
    const ds_box bad[] = {
        {.xmin = 0.5f, .ymin = 0.2f, .xmax = 0.5f, .ymax = 0.6f, .label = 1}, // xmin == xmax
        {.xmin = 0.6f, .ymin = 0.2f, .xmax = 0.5f, .ymax = 0.6f, .label = 1}, // xmin > xmax
        {.xmin = 0.1f, .ymin = 0.7f, .xmax = 0.5f, .ymax = 0.6f, .label = 1}, // ymin > ymax
        {.xmin = -0.1f, .ymin = 0.2f, .xmax = 0.5f, .ymax = 0.6f, .label = 1},
        {.xmin = 0.1f, .ymin = 0.2f, .xmax = 1.01f, .ymax = 0.6f, .label = 1},
        {.xmin = 0.1f, .ymin = 0.2f, .xmax = 0.5f, .ymax = NAN, .label = 1},
        {.xmin = 0.1f, .ymin = 0.2f, .xmax = 0.5f, .ymax = 0.6f, .label = 10},
        {.xmin = 0.1f, .ymin = 0.2f, .xmax = 0.5f, .ymax = 0.6f, .label = -1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        r = base;
        r.boxes = &bad[i];
        cr_assert_eq(ds_record_validate(&r, 10, why, sizeof why), ZPS_ERR_CORRUPT, "bad box %zu passed", i);
    }
    /* The writer refuses what validation refuses. */
    uint8_t *buf = NULL;
    size_t cap = 0, len;
    r = base; r.image_len--;
    cr_assert_eq(ds_record_pack(&r, &buf, &cap, &len), ZPS_ERR_INVALID);
    free(buf);
}

Test(ds_record, every_single_byte_flip_is_detected)
{
    uint64_t seed = s_seed(), s = seed;
    uint8_t px[6 * 7];
    s_noise(px, sizeof px, &s);
    ds_box boxes[2];
    s_random_boxes(boxes, 2, &s);
    ds_record r = {.image = px, .image_len = sizeof px, .encoding = DS_ENC_RAW, .height = 6,
                   .width = 7, .channels = 1, .label = 4, .boxes = boxes, .n_boxes = 2};
    uint8_t *buf = NULL;
    size_t cap = 0, len;
    cr_assert_eq(ds_record_pack(&r, &buf, &cap, &len), ZPS_OK);
    zps_arena *a = zps_arena_new(0);
    for (size_t i = 0; i < len; i++) {
        for (int bit = 0; bit < 8; bit++) {
            uint8_t *copy = malloc(len);
            memcpy(copy, buf, len);
            copy[i] ^= (uint8_t)(1u << bit);
            ds_record back;
            char why[256] = "";
            zps_status st = ds_record_parse(copy, len, a, 10, &back, why, sizeof why);
            cr_assert_eq(st, ZPS_ERR_CORRUPT, "flip of byte %zu bit %d of %zu not detected, seed %llu",
                         i, bit, len, (unsigned long long)seed);
            zps_arena_reset(a);
            free(copy);
        }
    }
    /* truncation anywhere is caught too */
    for (size_t cut = 0; cut < len; cut++) {
        ds_record back;
        cr_assert_eq(ds_record_parse(buf, cut, a, 10, &back, NULL, 0), ZPS_ERR_CORRUPT, "cut at %zu", cut);
        zps_arena_reset(a);
    }
    zps_arena_destroy(&a);
    free(buf);
}

Test(ds_record, truncated_and_damaged_images_fail_to_decode)
{
    uint64_t seed = s_seed(), s = seed;
    ds_codec *c = ds_codec_new();
    for (int e = DS_ENC_JPEG; e <= DS_ENC_PNG; e++) {
        int h = 40, w = 48;
        uint8_t px[40 * 48 * 3];
        s_smooth(px, h, w, 3, &s);
        const uint8_t *bytes;
        size_t blen;
        cr_assert_eq(ds_image_encode(c, px, h, w, 3, (ds_encoding)e, 90, &bytes, &blen), ZPS_OK);
        uint8_t *copy = malloc(blen);
        memcpy(copy, bytes, blen);
        char why[256];
        ds_pixels out;
        ds_record r = {.image = copy, .image_len = blen * 2 / 3, .encoding = (ds_encoding)e,
                       .height = (uint32_t)h, .width = (uint32_t)w, .channels = 3, .label = 0};
        cr_assert_eq(ds_image_decode(c, &r, &out, why, sizeof why), ZPS_ERR_DECODE,
                     "truncated %s decoded, seed %llu", ds_encoding_name((ds_encoding)e),
                     (unsigned long long)seed);
        r.image_len = blen;
        r.height = 41; /* header disagrees with the record */
        cr_assert_eq(ds_image_decode(c, &r, &out, why, sizeof why), ZPS_ERR_DECODE);
        r.height = (uint32_t)h;
        cr_assert_eq(ds_image_decode(c, &r, &out, why, sizeof why), ZPS_OK, "%s", why);
        free(copy);
    }
    ds_codec_destroy(&c);
}

/* Reference for ds_image_sample in double precision. */
static double s_ref_sample(const ds_pixels *src, const ds_crop *cr, int oh, int ow, int oc,
                           int k, int y, int x)
{
    int xo = cr->flip ? ow - 1 - x : x;
    double sx = cr->x0 + (xo + 0.5) * cr->w / ow - 0.5, sy = cr->y0 + (y + 0.5) * cr->h / oh - 0.5;
    sx = sx < 0 ? 0 : sx > src->w - 1 ? src->w - 1 : sx;
    sy = sy < 0 ? 0 : sy > src->h - 1 ? src->h - 1 : sy;
    int x0 = (int)sx, y0 = (int)sy, x1 = x0 + 1 < src->w ? x0 + 1 : x0, y1 = y0 + 1 < src->h ? y0 + 1 : y0;
    double fx = sx - x0, fy = sy - y0, v[3];
    for (int c = 0; c < src->c; c++) {
#define P(yy, xx) (double)src->px[((size_t)(yy) * src->w + (xx)) * src->c + c]
        v[c] = (1 - fy) * ((1 - fx) * P(y0, x0) + fx * P(y0, x1)) + fy * ((1 - fx) * P(y1, x0) + fx * P(y1, x1));
#undef P
    }
    if (src->c == oc)
        return v[k];
    if (src->c == 1)
        return v[0];
    return 0.299 * v[0] + 0.587 * v[1] + 0.114 * v[2];
}

Test(ds_record, fused_sample_matches_reference)
{
    uint64_t seed = s_seed(), s = seed;
    for (int it = 0; it < 20; it++) {
        int h = s_rint(&s, 5, 60), w = s_rint(&s, 5, 60), sc = it % 2 ? 3 : 1, oc = (it / 2) % 2 ? 3 : 1;
        int oh = s_rint(&s, 3, 90), ow = s_rint(&s, 3, 90);
        uint8_t *px = malloc((size_t)h * w * sc);
        s_noise(px, (size_t)h * w * sc, &s);
        ds_pixels src = {.px = px, .h = h, .w = w, .c = sc};
        float cw = (float)w * (0.4f + 0.6f * (float)(s_next(&s) % 100) / 100.f);
        float chh = (float)h * (0.4f + 0.6f * (float)(s_next(&s) % 100) / 100.f);
        ds_crop cr = {.x0 = ((float)w - cw) * 0.3f, .y0 = ((float)h - chh) * 0.6f, .w = cw, .h = chh,
                      .flip = it % 3 == 0};
        float mean[3] = {0.485f, 0.456f, 0.406f}, std[3] = {0.229f, 0.224f, 0.225f};
        float *out = malloc((size_t)oc * oh * ow * sizeof(float));
        ds_image_sample(&src, &cr, oh, ow, oc, mean, std, out);
        for (int k = 0; k < oc; k++)
            for (int y = 0; y < oh; y++)
                for (int x = 0; x < ow; x++) {
                    double ref = (s_ref_sample(&src, &cr, oh, ow, oc, k, y, x) / 255.0 - mean[k]) / std[k];
                    double got = out[((size_t)k * oh + y) * ow + x];
                    cr_assert(fabs(got - ref) <= 1e-4 + 1e-4 * fabs(ref),
                              "(%d,%d,%d) got %f want %f, %dx%dx%d -> %dx%dx%d, seed %llu", k, y, x, got, ref,
                              h, w, sc, oh, ow, oc, (unsigned long long)seed);
                }
        free(out);
        free(px);
    }
}

Test(ds_record, identity_sample_is_the_pixels)
{
    uint64_t seed = s_seed(), s = seed;
    int h = 28, w = 28;
    uint8_t px[28 * 28];
    s_noise(px, sizeof px, &s);
    ds_pixels src = {.px = px, .h = h, .w = w, .c = 1};
    ds_crop cr = {.x0 = 0, .y0 = 0, .w = (float)w, .h = (float)h, .flip = false};
    float mean[1] = {0}, std[1] = {1}, out[28 * 28];
    ds_image_sample(&src, &cr, h, w, 1, mean, std, out);
    for (int i = 0; i < h * w; i++)
        cr_assert_float_eq(out[i], px[i] / 255.f, 1e-6, "pixel %d, seed %llu", i, (unsigned long long)seed);
}
