/* nms.c — non-maximum suppression (torchvision.ops.nms / batched_nms semantics) and the
 * per-image inference path (softmax, decode, per-class top-k and NMS, top-k per image).
 *
 * Ordering: score descending, the lower index first on equal scores, in every list here;
 * torchvision's CPU sort gives the same order on ties, which the tests check. */
#include <assert.h>
#include <math.h>

#include "trainer/detect/detect_int.h"

/* Stable insertion sort of keep[0..n) by score descending (NMS is quadratic anyway). */
static void s_sort_keep(const float *scores, size_t n, int32_t *keep)
{
    for (size_t i = 0; i < n; i++) {
        int32_t v = (int32_t)i;
        size_t j = i;
        while (j > 0 && scores[keep[j - 1]] < scores[v]) {
            keep[j] = keep[j - 1];
            j--;
        }
        keep[j] = v;
    }
}

static size_t s_nms(const float *boxes, const float *scores, const int32_t *idxs, size_t n,
                    float iou, int32_t *keep)
{
    s_sort_keep(scores, n, keep);
    for (size_t i = 0; i < n; i++) {
        if (keep[i] < 0)
            continue;
        const float *bi = boxes + 4 * (size_t)keep[i];
        for (size_t j = i + 1; j < n; j++)
            if (keep[j] >= 0 && (!idxs || idxs[keep[j]] == idxs[keep[i]]) &&
                det_iou(bi, boxes + 4 * (size_t)keep[j]) > iou)
                keep[j] = -1;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (keep[i] >= 0)
            keep[m++] = keep[i];
    return m;
}

size_t det_nms(const float *boxes, const float *scores, size_t n, float iou, int32_t *keep)
{
    return s_nms(boxes, scores, NULL, n, iou, keep);
}

size_t det_nms_batched(const float *boxes, const float *scores, const int32_t *idxs, size_t n,
                       float iou, int32_t *keep)
{
    return s_nms(boxes, scores, idxs, n, iou, keep);
}

void det_nms_cfg_default(det_nms_cfg *c)
{
    *c = (det_nms_cfg){.score_thresh = 0.01f, .nms_iou = 0.45f, .top_k_class = 200, .top_k = 100};
}

/* Scratch of det_detect, all from the workspace. */
typedef struct {
    float *boxes;  // (P, 4) decoded, clipped
    float *lse;    // (P) logsumexp per prior
    float *prob;   // (P) probabilities of this class's candidates (above the threshold)
    int32_t *cand; // (P) their priors, ascending
    int32_t *idx, *tmp; // (P) sort scratch
    float *cbox;   // (top_k_class, 4) this class's candidates
    float *cscore; // (top_k_class)
    int32_t *keep; // (top_k_class)
    det_det *all;  // (C * top_k_class) survivors of every class
    float *ascore; // (C * top_k_class) their scores, for the final ranking
} s_det_scratch;

static void s_det_scratch_init(s_det_scratch *s, zps_arena *a, size_t P, int classes, int k)
{
    size_t kk = (size_t)k, all = (size_t)(classes - 1) * kk;
    s->boxes = zps_arena_alloc(a, 4 * P * sizeof(float));
    s->lse = zps_arena_alloc(a, P * sizeof(float));
    s->prob = zps_arena_alloc(a, P * sizeof(float));
    s->cand = zps_arena_alloc(a, P * sizeof(int32_t));
    s->idx = zps_arena_alloc(a, P * sizeof(int32_t));
    s->tmp = zps_arena_alloc(a, (P > all ? P : all) * sizeof(int32_t));
    s->cbox = zps_arena_alloc(a, 4 * kk * sizeof(float));
    s->cscore = zps_arena_alloc(a, kk * sizeof(float));
    s->keep = zps_arena_alloc(a, kk * sizeof(int32_t));
    s->all = zps_arena_alloc(a, all * sizeof(det_det));
    s->ascore = zps_arena_alloc(a, all * sizeof(float));
}

/* Class c's candidates, NMS, survivors appended to s->all; returns the new count. */
static size_t s_class(const det_nms_cfg *c, const s_det_scratch *s, size_t P, int classes,
                      const float *cls, int k, size_t na)
{
    size_t nc = 0;
    for (size_t p = 0; p < P; p++) {
        float pr = expf(cls[p * (size_t)classes + k] - s->lse[p]);
        if (pr > c->score_thresh) { /* candidates in prior order: the stable sort keeps it on ties */
            s->prob[nc] = pr;
            s->cand[nc++] = (int32_t)p;
        }
    }
    if (nc == 0)
        return na;
    det_argsort_desc(s->prob, nc, s->idx, s->tmp);
    if (nc > (size_t)c->top_k_class)
        nc = (size_t)c->top_k_class;
    for (size_t r = 0; r < nc; r++) {
        size_t p = (size_t)s->cand[s->idx[r]];
        for (int q = 0; q < 4; q++)
            s->cbox[4 * r + q] = s->boxes[4 * p + q];
        s->cscore[r] = s->prob[s->idx[r]];
    }
    size_t m = det_nms(s->cbox, s->cscore, nc, c->nms_iou, s->keep);
    for (size_t r = 0; r < m; r++, na++) {
        det_det *d = &s->all[na];
        for (int q = 0; q < 4; q++)
            d->box[q] = s->cbox[4 * (size_t)s->keep[r] + q];
        d->cls = k - 1;
        d->score = s->ascore[na] = s->cscore[s->keep[r]];
    }
    return na;
}

size_t det_detect(const det_nms_cfg *c, det_ws *ws, const float *priors, size_t P, int classes,
                  const float *cls, const float *loc, det_det *out)
{
    assert(classes >= 2 && c->top_k_class > 0 && c->top_k >= 0);
    zps_arena *a = ws->arena;
    s_det_scratch s;
    s_det_scratch_init(&s, a, P, classes, c->top_k_class);
    det_decode_all(priors, P, loc, s.boxes);
    for (size_t p = 0; p < P; p++)
        s.lse[p] = det_logsumexp(cls + p * (size_t)classes, classes);
    size_t na = 0;
    for (int k = 1; k < classes; k++)
        na = s_class(c, &s, P, classes, cls, k, na);
    /* survivors are in class order, each class in score order: a stable sort by score
     * leaves ties by class, then by prior */
    int32_t *order = zps_arena_alloc(a, (na ? na : 1) * sizeof *order);
    det_argsort_desc(s.ascore, na, order, s.tmp);
    size_t nout = na < (size_t)c->top_k ? na : (size_t)c->top_k;
    for (size_t r = 0; r < nout; r++)
        out[r] = s.all[order[r]];
    zps_arena_reset(a);
    return nout;
}
