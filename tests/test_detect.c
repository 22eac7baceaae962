/* test_detect.c — trainer/detect against independent oracles (suite detect).
 *
 * tests/ref/detect_ref.py is the oracle: torchvision.ops (box_iou, nms; batched NMS as nms per
 * class, merged by score) and a
 * float64 reimplementation of the SSD paper's priors, encoding, matching, loss (gradient by
 * autograd), detection and the VOC devkit's mAP. Inputs are random every run (seed printed
 * on failure) with ties and degenerate boxes on purpose: duplicated boxes and logit rows,
 * scores on a coarse grid, zero-width boxes and points. The loss gradient is also checked
 * against central finite differences of det_loss itself.
 *
 * Where two float orders could legitimately rank differently (the loss's mined negatives,
 * the detector's candidates), the logits come from a small pool of rows whose values are
 * checked to be apart by far more than float rounding: equal values are exact ties (broken
 * by index on both sides), unequal ones rank the same in float32 and float64.
 *
 * Tolerances: |zps - ref| <= atol + rtol |ref|, stated per check. The tests that need the
 * Python oracle skip with a message when /usr/bin/python3 lacks torch or torchvision.
 *
 * prior_coverage measures the default priors on zps-data's detection canvases (and prints
 * the alternatives docs/kernels.md compares). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "datasets/convert.h"
#include "datasets/pipeline.h"
#include "tests/testutil.h"
#include "trainer/detect/detect.h"

static uint64_t s_seed;
static char s_dir[256];

static void s_init(void)
{
    s_seed = zt_seed_init();
    zps_log_set_level(ZPS_LOG_WARN);
    zt_mktmp(s_dir, sizeof s_dir, "zps-detect");
}

static void s_fini(void)
{
    if (s_dir[0])
        zt_rmtmp(s_dir);
    s_dir[0] = 0;
}

TestSuite(detect, .init = s_init, .fini = s_fini, .timeout = 120);

#define SEED (unsigned long long)s_seed

static void s_need_torch(void)
{
    if (!zt_have_torch())
        ZPS_TEST_SKIP("/usr/bin/python3 cannot import torch and torchvision (Debian's "
                      "python3-torch, python3-torchvision): the oracle of this test");
}

static void s_put(const char *name, const void *p, size_t n)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", s_dir, name);
    zt_write_file(path, p, n);
}

static double *s_get(const char *name, size_t n)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", s_dir, name);
    return zt_read_f64(path, n);
}

/* detect_ref.py CMD DIR ARGS... (ARGS: a NULL-terminated list of strings). */
static void s_ref(const char *cmd, const char *const *args)
{
    const char *argv[16] = {cmd, s_dir};
    int n = 2;
    for (; args && args[n - 2]; n++)
        argv[n] = args[n - 2];
    argv[n] = NULL;
    zt_python("tests/ref/detect_ref.py", argv, "Debian's python3-torch and python3-torchvision");
}

static char *s_num(char *buf, double v)
{
    snprintf(buf, 32, "%.9g", v);
    return buf;
}

static void s_close(double got, double want, double atol, double rtol, const char *what, size_t i)
{
    cr_assert(fabs(got - want) <= atol + rtol * fabs(want), "%s[%zu]: zps %.9g, reference %.9g, "
              "seed %llu", what, i, got, want, SEED);
}

/* n corner-form boxes in [0, 1]: mostly proper, with duplicates (ties), zero-width boxes and
 * points (degenerate) mixed in. */
static void s_boxes(float *b, size_t n)
{
    for (size_t i = 0; i < n; i++, b += 4) {
        int kind = zt_irand(0, 9);
        if (kind == 0 && i > 0) {
            memcpy(b, b - 4 * zt_irand(1, (int)(i < 4 ? i : 4)), 4 * sizeof *b);
            continue;
        }
        float x = zt_unif(0, 0.9f), y = zt_unif(0, 0.9f);
        float w = zt_unif(0.01f, 1 - x), h = zt_unif(0.01f, 1 - y);
        if (kind == 1)
            w = 0; /* zero width */
        if (kind == 2)
            w = h = 0; /* a point */
        b[0] = x, b[1] = y, b[2] = x + w, b[3] = y + h;
    }
}

static float *s_default_priors(size_t *P)
{
    det_prior_cfg c;
    det_prior_cfg_default(&c);
    *P = det_prior_count(&c);
    float *p = malloc(*P * 4 * sizeof *p);
    cr_assert_eq(det_priors(&c, p), ZPS_OK);
    return p;
}

/* A small prior set (maps 4, 2, 1; ratios 2 and 1/2: 84 priors) for finite differences. */
static float *s_small_priors(size_t *P)
{
    det_prior_cfg c = {.canvas = 32, .n_maps = 3, .map_size = {4, 2, 1}, .n_ratios = {2, 2, 2},
                       .ratios = {{2, 0.5f}, {2, 0.5f}, {2, 0.5f}}, .s_min = 0.2f, .s_max = 0.9f};
    *P = det_prior_count(&c);
    float *p = malloc(*P * 4 * sizeof *p);
    cr_assert_eq(det_priors(&c, p), ZPS_OK);
    return p;
}

Test(detect, priors_follow_the_paper)
{
    det_prior_cfg c;
    det_prior_cfg_default(&c);
    cr_assert_eq(det_prior_count(&c), 1524u);
    const int per[5] = {4, 6, 6, 4, 4};
    for (int k = 0; k < 5; k++)
        cr_assert_eq(det_prior_per_cell(&c, k), per[k], "map %d", k);
    size_t P;
    float *p = s_default_priors(&P);
    /* the first cell of the 16x16 map: s 0.2, then sqrt(0.2 * 0.375), then 2 and 1/2 */
    cr_assert_float_eq(p[0], 1 / 32.0f, 1e-7);
    cr_assert_float_eq(p[2], 0.2f, 1e-7);
    cr_assert_float_eq(p[6], sqrtf(0.075f), 1e-6);
    cr_assert_float_eq(p[10], 0.2f * sqrtf(2), 1e-6);
    cr_assert_float_eq(p[15], 0.2f * sqrtf(2), 1e-6);
    /* the second cell is x + 1 in the same row */
    cr_assert_float_eq(p[16], 3 / 32.0f, 1e-7);
    cr_assert_float_eq(p[17], 1 / 32.0f, 1e-7);
    det_prior_cfg bad = c;
    bad.ratios[1][0] = 0;
    cr_assert_eq(det_priors(&bad, p), ZPS_ERR_INVALID);
    s_need_torch();
    s_ref("priors", NULL);
    double *ref = s_get("priors.f64", P * 4);
    for (size_t i = 0; i < P * 4; i++)
        s_close(p[i], ref[i], 1e-6, 1e-6, "prior", i);
    free(ref);
    free(p);
}

Test(detect, iou_matches_torchvision)
{
    enum { NA = 70, NB = 90 };
    float a[NA * 4], b[NB * 4], out[NA * NB];
    s_boxes(a, NA);
    s_boxes(b, NB);
    memcpy(b, a, 8 * sizeof *a); /* identical pairs: IoU 1 (or 0 when degenerate) */
    det_iou_matrix(a, NA, b, NB, out);
    for (size_t i = 0; i < NA * NB; i++)
        cr_assert(out[i] >= 0 && out[i] <= 1, "IoU %g", out[i]);
    /* inverted corners are degenerate too: 0, never negative or NaN */
    const float inv[4] = {0.6f, 0.6f, 0.2f, 0.2f}, full[4] = {0, 0, 1, 1};
    cr_assert_eq(det_iou(inv, full), 0.0f);
    cr_assert_eq(det_iou(inv, inv), 0.0f);
    s_need_torch();
    s_put("a.f32", a, sizeof a);
    s_put("b.f32", b, sizeof b);
    char na[32], nb[32];
    s_ref("iou", (const char *const[]){s_num(na, NA), s_num(nb, NB), NULL});
    double *ref = s_get("iou.f64", NA * NB);
    for (size_t i = 0; i < NA * NB; i++)
        s_close(out[i], ref[i], 1e-6, 1e-5, "iou", i);
    free(ref);
}

Test(detect, encode_decode_match_the_formulas)
{
    enum { N = 300 };
    float g[N * 4], p[N * 4], loc[N * 4], enc[N * 4], dec[N * 4], back[N * 4];
    s_boxes(g, N);
    for (size_t i = 0; i < N; i++) {
        float *q = p + 4 * i;
        q[0] = zt_unif(0, 1), q[1] = zt_unif(0, 1), q[2] = zt_unif(0.02f, 1), q[3] = zt_unif(0.02f, 1);
        for (int k = 0; k < 4; k++)
            loc[4 * i + k] = zt_unif(-3, 3);
    }
    det_encode(g, p, N, enc);
    det_decode(loc, p, N, dec);
    det_decode(enc, p, N, back);
    for (size_t i = 0; i < N * 4; i++) {
        cr_assert(isfinite(enc[i]), "encoding of a degenerate box is not finite");
        if (g[4 * (i / 4) + 2] > g[4 * (i / 4)] && g[4 * (i / 4) + 3] > g[4 * (i / 4) + 1])
            s_close(back[i], g[i], 2e-6, 1e-5, "decode(encode(g))", i);
    }
    s_need_torch();
    s_put("gt.f32", g, sizeof g);
    s_put("priors.f32", p, sizeof p);
    s_put("loc.f32", loc, sizeof loc);
    char n[32];
    s_ref("encode", (const char *const[]){s_num(n, N), NULL});
    double *re = s_get("enc.f64", N * 4), *rd = s_get("dec.f64", N * 4);
    det_decode_all(p, N, loc, back);
    for (size_t i = 0; i < N * 4; i++) {
        s_close(enc[i], re[i], 1e-4, 1e-5, "encode", i);
        s_close(dec[i], rd[i], 1e-6, 1e-5, "decode", i);
        s_close(back[i], fmin(fmax(rd[i], 0), 1), 1e-6, 1e-5, "decode_all", i);
    }
    free(re);
    free(rd);
}

Test(detect, nms_matches_torchvision)
{
    enum { N = 160 };
    float boxes[N * 4], scores[N];
    int32_t idxs[N], keep[N];
    /* clustered boxes so that many overlap; scores on a grid of 1/16: many ties */
    for (size_t i = 0; i < N; i++) {
        float cx = 0.2f + 0.2f * (float)zt_irand(0, 3), cy = 0.3f + 0.3f * (float)zt_irand(0, 1);
        float w = zt_unif(0.05f, 0.3f), h = zt_unif(0.05f, 0.3f);
        cx += zt_unif(-0.05f, 0.05f), cy += zt_unif(-0.05f, 0.05f);
        float *b = boxes + 4 * i;
        b[0] = cx - w / 2, b[1] = cy - h / 2, b[2] = cx + w / 2, b[3] = cy + h / 2;
        if (i % 17 == 5)
            b[2] = b[0]; /* degenerate */
        if (i % 13 == 7)
            memcpy(b, b - 4, 4 * sizeof *b); /* duplicate */
        scores[i] = (float)zt_irand(1, 16) / 16;
        idxs[i] = zt_irand(0, 3);
    }
    s_need_torch();
    s_put("boxes.f32", boxes, sizeof boxes);
    s_put("scores.f32", scores, sizeof scores);
    s_put("idxs.i32", idxs, sizeof idxs);
    const float thr[3] = {0.3f, 0.45f, 0.7f};
    for (int t = 0; t < 3; t++) {
        char n[32], th[32];
        s_ref("nms", (const char *const[]){s_num(n, N), s_num(th, thr[t]), NULL});
        for (int batched = 0; batched < 2; batched++) {
            double *ref = s_get(batched ? "bkeep.f64" : "keep.f64", N + 1);
            size_t m = batched ? det_nms_batched(boxes, scores, idxs, N, thr[t], keep)
                               : det_nms(boxes, scores, N, thr[t], keep);
            cr_assert_eq((double)m, ref[0], "%s at %g: %zu kept, torchvision %g, seed %llu",
                         batched ? "batched_nms" : "nms", thr[t], m, ref[0], SEED);
            for (size_t i = 0; i < m; i++)
                cr_assert_eq((double)keep[i], ref[1 + i], "%s at %g: keep[%zu] %d, torchvision "
                             "%g, seed %llu", batched ? "batched_nms" : "nms", thr[t], i, keep[i],
                             ref[1 + i], SEED);
            free(ref);
        }
    }
}

/* ngt ground-truth boxes for one image over priors p: random items, some equal to a prior
 * (IoU 1), some halfway between two neighbouring priors (an IoU tie), a duplicate and a
 * degenerate one. */
static void s_gts(float *g, int ngt, const float *p, size_t P)
{
    s_boxes(g, (size_t)ngt);
    for (int j = 0; j < ngt; j++) {
        float *b = g + 4 * j;
        int kind = zt_irand(0, 5);
        const float *q = p + 4 * (size_t)zt_irand(0, (int)P - 2);
        if (kind == 0)
            det_center_to_corner(q, 1, b);
        else if (kind == 1) { /* centred between q and the cell to its right, same size */
            float c[4] = {q[0] + 0.5f / 16, q[1], q[2], q[3]};
            det_center_to_corner(c, 1, b);
        } else if (kind == 2 || b[2] <= b[0] || b[3] <= b[1]) {
            float x = zt_unif(0, 0.7f), y = zt_unif(0, 0.7f);
            b[0] = x, b[1] = y, b[2] = x + zt_unif(0.05f, 0.3f), b[3] = y + zt_unif(0.05f, 0.3f);
        }
    }
    if (ngt >= 3) {
        memcpy(g + 4, g, 4 * sizeof *g);
        g[8 + 2] = g[8]; /* zero width */
    }
}

Test(detect, matching_matches_reference)
{
    size_t P;
    float *p = s_default_priors(&P);
    s_need_torch();
    s_put("priors.f32", p, P * 4 * sizeof *p);
    int32_t *m = malloc(P * sizeof *m);
    float *iou = malloc(8 * P * sizeof *iou);
    for (int round = 0; round < 4; round++) {
        int ngt = round == 0 ? 1 : zt_irand(2, 8);
        float g[8 * 4];
        s_gts(g, ngt, p, P);
        det_match(p, P, g, ngt, 0.5f, iou, m);
        s_put("gt.f32", g, (size_t)ngt * 4 * sizeof *g);
        char a[32], b[32];
        s_ref("match", (const char *const[]){s_num(a, (double)P), s_num(b, ngt), "0.5", NULL});
        double *ref = s_get("match.f64", P);
        for (size_t i = 0; i < P; i++)
            cr_assert_eq((double)m[i], ref[i], "round %d, %d gts: prior %zu matched %d, reference "
                         "%g, seed %llu", round, ngt, i, m[i], ref[i], SEED);
        free(ref);
    }
    free(iou);
    free(m);
    free(p);
}

/* A batch for the loss: n images' gts (image 1 with none) and logits whose rows come from a
 * pool of `pool` rows (see the file comment) when pool > 0, else random. */
typedef struct {
    int n, classes, ngt;
    size_t ncls, nloc; // n x P x classes, n x P x 4
    float *cls, *loc, gtb[64 * 4];
    float *dc, *dl;   // gradients (ncls, nloc)
    float *dc2, *dl2; // a second pair, for s_support_moved
    int32_t gtl[64];
    int gts[9];
} s_batch;

/* Smallest gap between distinct background losses of the pool's rows (float64). */
static double s_pool_gap(const float *rows, int pool, int classes, double *bg)
{
    for (int r = 0; r < pool; r++) {
        const float *x = rows + (size_t)r * classes;
        double s = 0;
        for (int k = 0; k < classes; k++)
            s += exp((double)x[k]);
        bg[r] = log(s) - x[0];
    }
    double gap = INFINITY;
    for (int a = 0; a < pool; a++)
        for (int b = a + 1; b < pool; b++)
            gap = fmin(gap, fabs(bg[a] - bg[b]));
    return gap;
}

static void s_batch_fill(s_batch *bt, const float *p, size_t P, int n, int classes, int pool)
{
    bt->n = n, bt->classes = classes, bt->ngt = 0;
    bt->ncls = (size_t)n * P * classes, bt->nloc = (size_t)n * P * 4;
    bt->cls = malloc(bt->ncls * sizeof(float));
    bt->loc = malloc(bt->nloc * sizeof(float));
    bt->dc = malloc(bt->ncls * sizeof(float));
    bt->dl = malloc(bt->nloc * sizeof(float));
    bt->dc2 = malloc(bt->ncls * sizeof(float));
    bt->dl2 = malloc(bt->nloc * sizeof(float));
    cr_assert(bt->cls && bt->loc && bt->dc && bt->dl && bt->dc2 && bt->dl2);
    float rows[64 * 16];
    double bg[64];
    do
        for (int i = 0; i < pool * classes; i++)
            rows[i] = zt_unif(-3, 3);
    while (pool > 0 && s_pool_gap(rows, pool, classes, bg) < 1e-4);
    for (size_t i = 0; i < (size_t)n * P; i++) {
        const float *r = rows + (size_t)zt_irand(0, pool > 0 ? pool - 1 : 0) * classes;
        for (int k = 0; k < classes; k++)
            bt->cls[i * classes + k] = pool > 0 ? r[k] : zt_unif(-3, 3);
        for (int k = 0; k < 4; k++)
            bt->loc[i * 4 + k] = zt_unif(-2, 2);
    }
    bt->gts[0] = 0;
    for (int i = 0; i < n; i++) {
        int k = i == 1 ? 0 : zt_irand(1, 6);
        s_gts(bt->gtb + 4 * bt->ngt, k, p, P);
        for (int j = 0; j < k; j++)
            bt->gtl[bt->ngt + j] = zt_irand(0, classes - 2);
        bt->ngt += k;
        bt->gts[i + 1] = bt->ngt;
    }
}

static void s_batch_free(s_batch *bt)
{
    free(bt->cls);
    free(bt->loc);
    free(bt->dc);
    free(bt->dl);
    free(bt->dc2);
    free(bt->dl2);
}

/* det_loss on bt, gradients into bt->dc, bt->dl unless grads is 0. */
static zps_status s_batch_loss(const det_loss_cfg *c, const float *p, size_t P, s_batch *bt,
                               int grads, float *loss, det_loss_parts *parts)
{
    return det_loss(c, p, P, bt->classes, bt->cls, bt->loc, bt->n, bt->gtb, bt->gtl, bt->gts,
                    loss, grads ? bt->dc : NULL, grads ? bt->dl : NULL, parts);
}

Test(detect, loss_and_gradient_match_float64_reference)
{
    size_t P;
    float *p = s_default_priors(&P);
    s_need_torch();
    s_batch bt;
    s_batch_fill(&bt, p, P, 4, 11, 48);
    size_t ncls = bt.ncls, nloc = bt.nloc;
    float loss, *dc = bt.dc, *dl = bt.dl;
    det_loss_cfg c;
    det_loss_cfg_default(&c);
    det_loss_parts parts;
    cr_assert_eq(s_batch_loss(&c, p, P, &bt, 1, &loss, &parts), ZPS_OK);
    s_put("priors.f32", p, P * 4 * sizeof *p);
    s_put("cls.f32", bt.cls, ncls * sizeof *bt.cls);
    s_put("loc.f32", bt.loc, nloc * sizeof *bt.loc);
    s_put("gtb.f32", bt.gtb, (size_t)bt.ngt * 4 * sizeof(float));
    s_put("gtl.i32", bt.gtl, (size_t)bt.ngt * sizeof(int32_t));
    s_put("gts.i32", bt.gts, (size_t)(bt.n + 1) * sizeof(int32_t));
    char a[32], b[32], d[32], e[32];
    s_ref("loss", (const char *const[]){s_num(a, (double)P), s_num(b, bt.classes), s_num(d, bt.n),
                                        s_num(e, bt.ngt), "0.5", "3", "1", NULL});
    double *ref = s_get("loss.f64", 4 + ncls + nloc);
    cr_assert_eq((double)parts.matched, ref[3], "matched %lld, reference %g, seed %llu",
                 (long long)parts.matched, ref[3], SEED);
    cr_assert(parts.matched > 0);
    s_close(loss, ref[0], 1e-6, 1e-5, "loss", 0);
    s_close(parts.conf, ref[1], 1e-6, 1e-5, "conf", 0);
    s_close(parts.loc, ref[2], 1e-6, 1e-5, "loc", 0);
    for (size_t i = 0; i < ncls; i++)
        s_close(dc[i], ref[4 + i], 1e-7, 1e-4, "d_cls", i);
    for (size_t i = 0; i < nloc; i++)
        s_close(dl[i], ref[4 + ncls + i], 1e-7, 1e-4, "d_loc", i);
    free(ref);
    s_batch_free(&bt);
    free(p);
}

static float s_loss_at(const det_loss_cfg *c, const float *p, size_t P, s_batch *bt)
{
    float loss;
    cr_assert_eq(s_batch_loss(c, p, P, bt, 0, &loss, NULL), ZPS_OK);
    return loss;
}

/* Whether det_loss's gradient at the batch as it stands is zero in other places than
 * (dc, dl): the mined negatives changed, so a step to here crossed a kink. */
static int s_support_moved(const det_loss_cfg *c, const float *p, size_t P, s_batch *bt,
                           const float *dc, const float *dl)
{
    float *dc0 = bt->dc, *dl0 = bt->dl, loss;
    bt->dc = bt->dc2, bt->dl = bt->dl2;
    cr_assert_eq(s_batch_loss(c, p, P, bt, 1, &loss, NULL), ZPS_OK);
    bt->dc = dc0, bt->dl = dl0;
    for (size_t i = 0; i < bt->ncls; i++)
        if ((bt->dc2[i] != 0) != (dc[i] != 0))
            return 1;
    for (size_t i = 0; i < bt->nloc; i++)
        if ((bt->dl2[i] != 0) != (dl[i] != 0))
            return 1;
    return 0;
}

/* Central differences of det_loss itself (float; step 1e-2 on values of order 1, the loss
 * summed in double) at 60 logits and 60 offsets of matched priors, mined ones included.
 * Hard-negative mining ranks the background losses: where a step of h changes the mined set
 * (the gradient's zeros move at v +- h) a kink lies within h and the entry is not used. */
Test(detect, loss_gradient_matches_finite_differences)
{
    size_t P;
    float *p = s_small_priors(&P);
    s_batch bt;
    s_batch_fill(&bt, p, P, 3, 4, 0);
    size_t ncls = bt.ncls, nloc = bt.nloc;
    float loss, *dc = bt.dc, *dl = bt.dl;
    det_loss_cfg c;
    det_loss_cfg_default(&c);
    c.ws = det_ws_new();
    cr_assert_eq(s_batch_loss(&c, p, P, &bt, 1, &loss, NULL), ZPS_OK);
    const float h = 1e-2f;
    int checked = 0, kinks = 0;
    for (int t = 0; t < 4000 && checked < 120; t++) {
        int is_loc = checked >= 60;
        size_t i = (size_t)zt_irand(0, (int)(is_loc ? nloc : ncls) - 1);
        float *v = is_loc ? &bt.loc[i] : &bt.cls[i], g = is_loc ? dl[i] : dc[i];
        if (g == 0 && zt_irand(0, 9) > 0)
            continue; /* mostly where the gradient lives, sometimes where it is 0 */
        float v0 = *v;
        *v = v0 + h;
        float lp = s_loss_at(&c, p, P, &bt);
        int moved = s_support_moved(&c, p, P, &bt, dc, dl);
        *v = v0 - h;
        float lm = s_loss_at(&c, p, P, &bt);
        moved |= s_support_moved(&c, p, P, &bt, dc, dl);
        *v = v0;
        if (moved) {
            kinks++;
            continue;
        }
        double fd = ((double)lp - lm) / (2.0 * h);
        cr_assert(fabs(fd - g) <= 2e-4 + 2e-2 * fabs(g), "%s[%zu]: gradient %.6g, finite "
                  "difference %.6g, seed %llu", is_loc ? "d_loc" : "d_cls", i, g, fd, SEED);
        checked++;
    }
    cr_assert_eq(checked, 120, "%d entries checked, %d near a kink (seed %llu)", checked, kinks,
                 SEED);
    det_ws_destroy(&c.ws);
    s_batch_free(&bt);
    free(p);
}

Test(detect, no_match_gives_zero_loss_and_gradient)
{
    size_t P;
    float *p = s_small_priors(&P);
    s_batch bt;
    s_batch_fill(&bt, p, P, 2, 4, 0);
    /* image 0: one zero-area box (matches nothing); image 1: none */
    bt.gtb[0] = bt.gtb[2] = 0.5f, bt.gtb[1] = 0.1f, bt.gtb[3] = 0.9f;
    bt.gts[1] = bt.gts[2] = 1, bt.ngt = 1;
    float loss = 7;
    for (size_t i = 0; i < bt.ncls; i++)
        bt.dc[i] = bt.dl[i] = 7; /* classes 4: ncls == nloc */
    det_loss_cfg c;
    det_loss_cfg_default(&c);
    det_loss_parts parts;
    cr_assert_eq(s_batch_loss(&c, p, P, &bt, 1, &loss, &parts), ZPS_OK);
    cr_assert_eq(loss, 0.0f);
    cr_assert(parts.matched == 0 && parts.conf == 0 && parts.loc == 0);
    for (size_t i = 0; i < bt.ncls; i++)
        cr_assert(bt.dc[i] == 0 && bt.dl[i] == 0, "gradient %zu not zero", i);
    /* a label outside 0..C-1 is the caller's data error, not a crash */
    bt.gtl[0] = 3;
    cr_assert_eq(s_batch_loss(&c, p, P, &bt, 1, &loss, NULL), ZPS_ERR_INVALID);
    bt.gtl[0] = -1;
    cr_assert_eq(s_batch_loss(&c, p, P, &bt, 1, &loss, NULL), ZPS_ERR_INVALID);
    s_batch_free(&bt);
    free(p);
}

/* The training path allocates nothing once the workspace has grown (the first call). */
Test(detect, workspace_stops_growing_after_the_first_call)
{
    size_t P;
    float *p = s_default_priors(&P);
    s_batch bt;
    s_batch_fill(&bt, p, P, 8, 11, 0);
    float loss;
    det_loss_cfg c;
    det_loss_cfg_default(&c);
    c.ws = det_ws_new();
    det_nms_cfg nc;
    det_nms_cfg_default(&nc);
    det_det *out = malloc((size_t)nc.top_k * sizeof *out);
    size_t grown = 0;
    for (int it = 0; it < 4; it++) {
        cr_assert_eq(s_batch_loss(&c, p, P, &bt, 1, &loss, NULL), ZPS_OK);
        det_detect(&nc, c.ws, p, P, bt.classes, bt.cls, bt.loc, out);
        if (it == 0)
            grown = det_ws_grow_count(c.ws);
    }
    cr_assert_eq(det_ws_grow_count(c.ws), grown, "the workspace grew after the first step");
    det_ws_destroy(&c.ws);
    cr_assert_null(c.ws);
    free(out);
    s_batch_free(&bt);
    free(p);
}

static void s_detect_case(const float *p, size_t P, int classes, int pool, const det_nms_cfg *nc)
{
    s_batch bt;
    s_batch_fill(&bt, p, P, 1, classes, pool);
    det_ws *ws = det_ws_new();
    det_det *out = malloc((size_t)nc->top_k * sizeof *out);
    size_t m = det_detect(nc, ws, p, P, classes, bt.cls, bt.loc, out);
    float *boxes = malloc(P * 4 * sizeof *boxes);
    det_decode_all(p, P, bt.loc, boxes);
    s_put("boxes.f32", boxes, P * 4 * sizeof *boxes);
    free(boxes);
    s_put("cls.f32", bt.cls, P * classes * sizeof(float));
    s_put("loc.f32", bt.loc, P * 4 * sizeof(float));
    char a[32], b[32], d[32], e[32], f[32], g[32];
    s_ref("detect", (const char *const[]){s_num(a, (double)P), s_num(b, classes),
                                          s_num(d, nc->score_thresh), s_num(e, nc->nms_iou),
                                          s_num(f, nc->top_k_class), s_num(g, nc->top_k), NULL});
    double *ref = s_get("det.f64", 1 + 6 * (size_t)nc->top_k);
    cr_assert_eq((double)m, ref[0], "%zu detections, reference %g, seed %llu", m, ref[0], SEED);
    for (size_t r = 0; r < m; r++) {
        const double *q = ref + 1 + 6 * r;
        cr_assert_eq((double)out[r].cls, q[4], "detection %zu: class %d, reference %g, seed %llu",
                     r, out[r].cls, q[4], SEED);
        s_close(out[r].score, q[5], 1e-7, 1e-5, "score", r);
        for (int k = 0; k < 4; k++)
            s_close(out[r].box[k], q[k], 1e-6, 1e-5, "box", r);
    }
    free(ref);
    free(out);
    det_ws_destroy(&ws);
    s_batch_free(&bt);
}

Test(detect, detection_matches_reference)
{
    s_need_torch();
    size_t P;
    float *p = s_default_priors(&P);
    det_nms_cfg nc;
    det_nms_cfg_default(&nc);
    s_detect_case(p, P, 5, 12, &nc); /* candidates past top_k_class, ties among them */
    nc.top_k = 7, nc.score_thresh = 0.3f;
    s_detect_case(p, P, 3, 12, &nc);
    free(p);
    p = s_small_priors(&P);
    det_nms_cfg_default(&nc);
    s_detect_case(p, P, 4, 0, &nc);
    free(p);
}

Test(detect, map_known_cases)
{
    const float g0[8] = {0.1f, 0.1f, 0.4f, 0.4f, 0.5f, 0.5f, 0.9f, 0.9f};
    const int32_t l0[2] = {0, 1};
    det_det d[3] = {{{0.1f, 0.1f, 0.4f, 0.4f}, 0, 0.9f}, {{0.5f, 0.5f, 0.9f, 0.9f}, 1, 0.8f},
                    {{0.1f, 0.1f, 0.4f, 0.4f}, 0, 0.7f}};
    det_map *m = det_map_new(3);
    double ap[3];
    int counted;
    cr_assert_eq(det_map_compute(m, ap, &counted), 0.0);
    cr_assert_eq(counted, 0);
    cr_assert_eq(det_map_add(m, d, 2, g0, l0, 2), ZPS_OK);
    cr_assert_eq(det_map_compute(m, ap, &counted), 1.0);
    cr_assert(counted == 2 && ap[2] == -1);
    /* a duplicate of a found box is a false positive ranked last: AP stays 1 */
    det_map_destroy(&m);
    m = det_map_new(3);
    cr_assert_eq(det_map_add(m, d, 3, g0, l0, 2), ZPS_OK);
    cr_assert_eq(det_map_compute(m, NULL, NULL), 1.0);
    /* a second image whose class-1 box is missed: class 1 recall 1/2, AP 0.5 */
    cr_assert_eq(det_map_add(m, NULL, 0, g0 + 4, l0 + 1, 1), ZPS_OK);
    cr_assert_eq(det_map_compute(m, ap, NULL), 0.75);
    cr_assert_eq(ap[1], 0.5);
    det_det bad = {{0, 0, 1, 1}, 3, 0.5f};
    cr_assert_eq(det_map_add(m, &bad, 1, NULL, NULL, 0), ZPS_ERR_INVALID);
    det_map_destroy(&m);
    cr_assert_null(m);
}

Test(detect, map_matches_voc_devkit_reference)
{
    enum { IMG = 40, C = 5, MAXD = 12, MAXG = 5 };
    s_need_torch();
    det_map *m = det_map_new(C);
    static float dets[IMG * MAXD * 7], gts[IMG * MAXG * 6];
    size_t nd = 0, ng = 0;
    for (int i = 0; i < IMG; i++) {
        int k = zt_irand(0, MAXG);
        float gb[MAXG * 4];
        int32_t gl[MAXG];
        s_boxes(gb, (size_t)k);
        for (int j = 0; j < k; j++) {
            gl[j] = zt_irand(0, C - 3); /* class C-2: dets only; C-1: nothing */
            float *r = gts + 6 * ng++;
            r[0] = (float)i, r[1] = (float)gl[j];
            memcpy(r + 2, gb + 4 * j, 4 * sizeof *r);
        }
        int n = zt_irand(0, MAXD);
        det_det d[MAXD];
        for (int r = 0; r < n; r++) {
            d[r].cls = zt_irand(0, C - 2);
            if (d[r].cls == C - 2)
                d[r].cls = zt_irand(0, 3) ? 0 : C - 2;
            d[r].score = (float)zt_irand(1, 10) / 10; /* ties */
            s_boxes(d[r].box, 1);
            if (k > 0 && zt_irand(0, 2) > 0) { /* near a gt: IoU anywhere around 0.5 */
                memcpy(d[r].box, gb + 4 * zt_irand(0, k - 1), 4 * sizeof(float));
                for (int q = 0; q < 4; q++)
                    d[r].box[q] += zt_unif(-0.08f, 0.08f);
            }
            float *row = dets + 7 * nd++;
            row[0] = (float)i, row[1] = (float)d[r].cls, row[2] = d[r].score;
            memcpy(row + 3, d[r].box, 4 * sizeof(float));
        }
        cr_assert_eq(det_map_add(m, d, (size_t)n, gb, gl, (size_t)k), ZPS_OK);
    }
    double ap[C];
    int counted;
    double map = det_map_compute(m, ap, &counted);
    s_put("dets.f32", dets, nd * 7 * sizeof(float));
    s_put("gts.f32", gts, ng * 6 * sizeof(float));
    char a[32], b[32], c[32];
    s_ref("map", (const char *const[]){s_num(a, (double)nd), s_num(b, (double)ng), s_num(c, C), NULL});
    double *ref = s_get("map.f64", 2 + C);
    cr_assert_eq((double)counted, ref[1], "seed %llu", SEED);
    s_close(map, ref[0], 1e-9, 1e-9, "mAP", 0);
    for (size_t k = 0; k < C; k++)
        s_close(ap[k], ref[2 + k], 1e-9, 1e-9, "AP", k);
    free(ref);
    det_map_destroy(&m);
}

/* ---- prior coverage on zps-data's detection canvases ------------------------------------ */

/* Share of the boxes whose best prior has IoU >= 0.5. */
static double s_coverage(const det_prior_cfg *c, const float *gt, size_t n)
{
    size_t P = det_prior_count(c);
    float *p = malloc(P * 4 * sizeof *p);
    cr_assert_eq(det_priors(c, p), ZPS_OK);
    det_center_to_corner(p, P, p);
    size_t hit = 0;
    for (size_t j = 0; j < n; j++) {
        float best = 0;
        for (size_t q = 0; q < P; q++)
            best = fmaxf(best, det_iou(gt + 4 * j, p + 4 * q));
        hit += best >= 0.5f;
    }
    free(p);
    return (double)hit / (double)n;
}

/* The boxes of the train split of a fresh `zps-data make-detection` (its defaults: 128x128,
 * 1-6 items of 0.2-0.5 of the canvas, overlap <= 0.3) of n canvases; *nb boxes. */
static float *s_canvas_boxes(uint64_t n, size_t *nb)
{
    ds_convert_opts co = {.out = s_dir, .shards = 1, .encoding = DS_ENC_PNG, .seed = s_seed};
    ds_detection_opts dopt = {.canvas = 128, .min_items = 1, .max_items = 6, .n_train = n,
                              .n_test = 1, .min_scale = 0.2f, .max_scale = 0.5f, .max_iou = 0.3f};
    cr_assert_eq(ds_make_detection(DS_FMNIST_DIR, &co, &dopt), ZPS_OK);
    ds_pipeline_opts o;
    ds_pipeline_opts_default(&o);
    o.path = s_dir, o.split = "train", o.batch = 50, o.height = o.width = 8, o.once = true;
    ds_pipeline *pl;
    cr_assert_eq(ds_pipeline_new(&o, &pl), ZPS_OK);
    float *img = malloc(sizeof(float) * 50 * 64), *gt = malloc(n * 6 * 4 * sizeof *gt);
    int32_t lab[50];
    ds_batch_info info;
    *nb = 0;
    while (ds_pipeline_next(pl, img, lab, &info) == ZPS_OK)
        for (int k = info.box_start[0]; k < info.box_start[info.count]; k++, (*nb)++) {
            const ds_box *b = &info.boxes[k];
            float *g = gt + 4 * *nb;
            g[0] = b->xmin, g[1] = b->ymin, g[2] = b->xmax, g[3] = b->ymax;
        }
    ds_pipeline_destroy(&pl);
    free(img);
    return gt;
}

/* The default priors give at least 95% of the boxes a prior of IoU >= 0.5, more than the
 * issue's first proposal (scales 0.1..0.9); the alternatives docs/kernels.md compares are
 * printed beside them. */
Test(detect, prior_coverage)
{
    size_t nb;
    float *gt = s_canvas_boxes(2000, &nb);
    cr_assert(nb > 2000);
    det_prior_cfg c;
    det_prior_cfg_default(&c);
    double cov = s_coverage(&c, gt, nb);
    fprintf(stderr, "prior coverage: default, scales 0.2-0.9 (%zu priors) %.2f%% of %zu boxes\n",
            det_prior_count(&c), 100 * cov, nb);
    static const struct {
        const char *name;
        float s_min, s_max;
        int all_wide; /* ratios {2, 3, 1/2, 1/3} on every map */
    } alt[] = {{"scales 0.1-0.9 (the issue's)", 0.1f, 0.9f, 0},
               {"scales 0.1-0.9, wide ratios everywhere", 0.1f, 0.9f, 1},
               {"scales 0.15-0.9", 0.15f, 0.9f, 0},
               {"scales 0.18-0.7", 0.18f, 0.7f, 0},
               {"scales 0.25-0.9", 0.25f, 0.9f, 0},
               {"scales 0.2-0.9, wide ratios everywhere", 0.2f, 0.9f, 1}};
    double issue = 0;
    for (size_t a = 0; a < sizeof alt / sizeof alt[0]; a++) {
        det_prior_cfg v = c;
        v.s_min = alt[a].s_min, v.s_max = alt[a].s_max;
        for (int k = 0; k < v.n_maps && alt[a].all_wide; k++) {
            v.n_ratios[k] = 4;
            const float r[4] = {2, 3, 0.5f, 1.0f / 3};
            memcpy(v.ratios[k], r, sizeof r);
        }
        double cv = s_coverage(&v, gt, nb);
        issue = a == 0 ? cv : issue;
        fprintf(stderr, "prior coverage: %s (%zu priors) %.2f%%\n", alt[a].name,
                det_prior_count(&v), 100 * cv);
    }
    cr_assert(cov >= 0.95, "default priors cover %.3f of the boxes, seed %llu", cov, SEED);
    cr_assert(cov > issue, "default %.3f, scales 0.1-0.9 %.3f, seed %llu", cov, issue, SEED);
    free(gt);
}
