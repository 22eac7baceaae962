/* loss.c — the SSD MultiBox loss (softmax cross-entropy with hard-negative mining plus
 * smooth-L1 on the matched offsets) and its gradient w.r.t. the head outputs.
 *
 * Two passes: the first matches every image (the normaliser N is the batch's matched count,
 * known only after all images), the second computes each image's terms and gradient. The
 * mined set is treated as fixed (a piecewise-constant choice), so the gradient is that of
 * the loss on the chosen priors, which finite differences see away from ties. Sums are
 * accumulated in double. All scratch comes from the workspace (none on the hot path once it
 * has grown). */
#include <assert.h>
#include <math.h>
#include <string.h>

#include "common/log.h"
#include "trainer/detect/detect_int.h"

void det_loss_cfg_default(det_loss_cfg *c)
{
    *c = (det_loss_cfg){.match_iou = 0.5f, .neg_pos = 3.0f, .loc_weight = 1.0f, .ws = NULL};
}

/* Per-image state between the passes and the scratch of the second. */
typedef struct {
    int32_t *match; // (n, P) matched gt (image-local) or -1
    int64_t *npos;  // (n) positives per image
    float *lse;     // (P) logsumexp of each prior's logits
    float *bg;      // (P) background loss; -inf on positives (never mined)
    int32_t *idx, *tmp; // (P) sort scratch
    float *iou;     // (max gts, P) matching scratch
} s_scratch;

static zps_status s_check_labels(const int32_t *labels, const int *gt_start, int n, int classes)
{
    for (int k = gt_start[0]; k < gt_start[n]; k++)
        if (labels[k] < 0 || labels[k] > classes - 2) {
            zps_log(ZPS_ERROR, "detect", "ground-truth box %d has label %d; the head has %d "
                    "classes (want 0..%d)", k, labels[k], classes - 1, classes - 2);
            return ZPS_ERR_INVALID;
        }
    return ZPS_OK;
}

/* Cross-entropy of prior p against target t; its gradient (scaled by inv_n) into g if set. */
static double s_ce(const float *x, int classes, float lse, int t, float inv_n, float *g)
{
    if (g)
        for (int k = 0; k < classes; k++)
            g[k] = (expf(x[k] - lse) - (k == t)) * inv_n;
    return (double)lse - x[t];
}

/* Smooth-L1 (beta 1) of loc against the encoded gt; gradient (scaled by w) into g if set. */
static double s_smooth_l1(const float *loc, const float *t, float w, float *g)
{
    double sum = 0;
    for (int k = 0; k < 4; k++) {
        float d = loc[k] - t[k], ad = fabsf(d);
        sum += ad < 1 ? 0.5 * (double)d * d : (double)ad - 0.5;
        if (g)
            g[k] = w * (ad < 1 ? d : (d > 0 ? 1.0f : -1.0f));
    }
    return sum;
}

/* Image i's conf and loc sums; gradient rows of d_cls / d_loc (already zero) when set. */
static void s_image(const det_loss_cfg *c, const s_scratch *s, const float *priors, size_t P,
                    int classes, const float *cls, const float *loc, const float *gt,
                    const int32_t *labels, const int32_t *match, int64_t npos, float inv_n,
                    float *d_cls, float *d_loc, double *conf, double *lsum)
{
    for (size_t p = 0; p < P; p++) {
        const float *x = cls + p * (size_t)classes;
        s->lse[p] = det_logsumexp(x, classes);
        s->bg[p] = match[p] >= 0 ? -INFINITY : s->lse[p] - x[0];
    }
    for (size_t p = 0; p < P; p++) {
        int32_t j = match[p];
        if (j < 0)
            continue;
        const float *x = cls + p * (size_t)classes;
        *conf += s_ce(x, classes, s->lse[p], labels[j] + 1, inv_n, d_cls ? d_cls + p * (size_t)classes : NULL);
        float t[4];
        det_encode(gt + 4 * (size_t)j, priors + 4 * p, 1, t);
        *lsum += s_smooth_l1(loc + 4 * p, t, c->loc_weight * inv_n, d_loc ? d_loc + 4 * p : NULL);
    }
    int64_t nneg = (int64_t)floor((double)c->neg_pos * (double)npos);
    if (nneg > (int64_t)P - npos)
        nneg = (int64_t)P - npos;
    if (nneg <= 0)
        return;
    det_argsort_desc(s->bg, P, s->idx, s->tmp);
    for (int64_t r = 0; r < nneg; r++) {
        size_t p = (size_t)s->idx[r];
        *conf += s_ce(cls + p * (size_t)classes, classes, s->lse[p], 0, inv_n,
                      d_cls ? d_cls + p * (size_t)classes : NULL);
    }
}

static void s_scratch_init(s_scratch *s, zps_arena *a, size_t P, int n, const int *gt_start)
{
    int maxg = 0;
    for (int i = 0; i < n; i++)
        if (gt_start[i + 1] - gt_start[i] > maxg)
            maxg = gt_start[i + 1] - gt_start[i];
    s->match = zps_arena_alloc(a, (size_t)n * P * sizeof *s->match);
    s->npos = zps_arena_alloc(a, (size_t)n * sizeof *s->npos);
    s->lse = zps_arena_alloc(a, P * sizeof *s->lse);
    s->bg = zps_arena_alloc(a, P * sizeof *s->bg);
    s->idx = zps_arena_alloc(a, P * sizeof *s->idx);
    s->tmp = zps_arena_alloc(a, P * sizeof *s->tmp);
    s->iou = zps_arena_alloc(a, (size_t)maxg * P * sizeof *s->iou);
}

zps_status det_loss(const det_loss_cfg *c, const float *priors, size_t P, int classes,
                    const float *cls, const float *loc, int n, const float *gt_boxes,
                    const int32_t *gt_labels, const int *gt_start, float *loss, float *d_cls,
                    float *d_loc, det_loss_parts *parts)
{
    assert(classes >= 2 && n >= 0 && c->neg_pos >= 0);
    zps_status st = s_check_labels(gt_labels, gt_start, n, classes);
    if (st != ZPS_OK)
        return st;
    det_ws *own = c->ws ? NULL : det_ws_new();
    zps_arena *a = (c->ws ? c->ws : own)->arena;
    s_scratch s;
    s_scratch_init(&s, a, P, n, gt_start);
    int64_t N = 0;
    for (int i = 0; i < n; i++) {
        int32_t *m = s.match + (size_t)i * P;
        det_match(priors, P, gt_boxes + 4 * (size_t)gt_start[i], gt_start[i + 1] - gt_start[i],
                  c->match_iou, s.iou, m);
        s.npos[i] = 0;
        for (size_t p = 0; p < P; p++)
            s.npos[i] += m[p] >= 0;
        N += s.npos[i];
    }
    size_t ncls = (size_t)n * P * (size_t)classes, nloc = (size_t)n * P * 4;
    if (d_cls)
        memset(d_cls, 0, ncls * sizeof *d_cls);
    if (d_loc)
        memset(d_loc, 0, nloc * sizeof *d_loc);
    double conf = 0, lsum = 0;
    float inv_n = N > 0 ? 1.0f / (float)N : 0.0f;
    for (int i = 0; i < n && N > 0; i++) {
        size_t off = (size_t)i * P;
        s_image(c, &s, priors, P, classes, cls + off * (size_t)classes, loc + off * 4,
                gt_boxes + 4 * (size_t)gt_start[i], gt_labels + gt_start[i], s.match + off,
                s.npos[i], inv_n, d_cls ? d_cls + off * (size_t)classes : NULL,
                d_loc ? d_loc + off * 4 : NULL, &conf, &lsum);
    }
    double pc = N > 0 ? conf / (double)N : 0, pl = N > 0 ? lsum / (double)N : 0;
    *loss = (float)(pc + (double)c->loc_weight * pl);
    if (parts)
        *parts = (det_loss_parts){.conf = (float)pc, .loc = (float)pl, .matched = N};
    zps_arena_reset(a);
    det_ws_destroy(&own);
    return ZPS_OK;
}
