/* map.c — PASCAL VOC average precision at IoU 0.5 over a whole test set.
 *
 * det_map_add decides each detection's true/false positive at once (within its image, in
 * score order, as VOC's evaluation does after its global sort: the images are independent)
 * and stores (score, tp) per class in the order added; det_map_compute sorts each class's
 * list by score with a stable sort (ties keep image order, then detection order, as MATLAB's
 * sort in the VOC devkit) and integrates precision over recall (all-point interpolation).
 * Not on the training path: it allocates freely. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "trainer/detect/detect_int.h"

/* One class's detections over the set, in the order added. */
typedef struct {
    float *score;
    uint8_t *tp;
    size_t n, cap;
    int64_t npos; // gts of this class in the set
} s_class;

struct det_map {
    int n_classes;
    s_class *cls; // (n_classes)
};

det_map *det_map_new(int n_classes)
{
    assert(n_classes > 0);
    det_map *m = zps_xcalloc(1, sizeof *m);
    m->n_classes = n_classes;
    m->cls = zps_xcalloc((size_t)n_classes, sizeof *m->cls);
    return m;
}

void det_map_destroy(det_map **pm)
{
    if (!pm || !*pm)
        return;
    for (int k = 0; k < (*pm)->n_classes; k++) {
        free((*pm)->cls[k].score);
        free((*pm)->cls[k].tp);
    }
    free((*pm)->cls);
    free(*pm);
    *pm = NULL;
}

static void s_push(s_class *c, float score, uint8_t tp)
{
    if (c->n == c->cap) {
        c->cap = c->cap ? 2 * c->cap : 64;
        c->score = zps_xrealloc(c->score, c->cap * sizeof *c->score);
        c->tp = zps_xrealloc(c->tp, c->cap * sizeof *c->tp);
    }
    c->score[c->n] = score;
    c->tp[c->n++] = tp;
}

static zps_status s_check(const det_map *m, const det_det *dets, size_t nd, const int32_t *labels,
                          size_t ngt)
{
    for (size_t i = 0; i < nd + ngt; i++) {
        int32_t k = i < nd ? dets[i].cls : labels[i - nd];
        if (k < 0 || k >= m->n_classes) {
            zps_log(ZPS_ERROR, "detect", "mAP: %s %zu has class %d (want 0..%d)",
                    i < nd ? "detection" : "ground-truth box", i < nd ? i : i - nd, k,
                    m->n_classes - 1);
            return ZPS_ERR_INVALID;
        }
    }
    return ZPS_OK;
}

/* The gt of class k with the highest IoU with box (lower index on ties); -1 when none. */
static long s_best_gt(const float *box, int32_t k, const float *gt, const int32_t *labels,
                      size_t ngt, float *best)
{
    long bj = -1;
    *best = 0;
    for (size_t j = 0; j < ngt; j++) {
        if (labels[j] != k)
            continue;
        float v = det_iou(box, gt + 4 * j);
        if (bj < 0 || v > *best) {
            bj = (long)j;
            *best = v;
        }
    }
    return bj;
}

zps_status det_map_add(det_map *m, const det_det *dets, size_t nd, const float *gt_boxes,
                       const int32_t *gt_labels, size_t ngt)
{
    zps_status st = s_check(m, dets, nd, gt_labels, ngt);
    if (st != ZPS_OK)
        return st;
    for (size_t j = 0; j < ngt; j++)
        m->cls[gt_labels[j]].npos++;
    float *score = zps_xmalloc((nd + 1) * sizeof *score);
    int32_t *order = zps_xmalloc((nd + 1) * sizeof *order), *tmp = zps_xmalloc((nd + 1) * sizeof *tmp);
    uint8_t *tp = zps_xcalloc(nd + 1, 1), *claimed = zps_xcalloc(ngt + 1, 1);
    for (size_t i = 0; i < nd; i++)
        score[i] = dets[i].score;
    det_argsort_desc(score, nd, order, tmp);
    for (size_t r = 0; r < nd; r++) {
        const det_det *d = &dets[order[r]];
        float ov;
        long j = s_best_gt(d->box, d->cls, gt_boxes, gt_labels, ngt, &ov);
        if (j >= 0 && ov > 0.5f && !claimed[j])
            tp[order[r]] = claimed[j] = 1;
    }
    for (size_t i = 0; i < nd; i++)
        s_push(&m->cls[dets[i].cls], dets[i].score, tp[i]);
    free(score);
    free(order);
    free(tmp);
    free(tp);
    free(claimed);
    return ZPS_OK;
}

/* All-point AP: the mean over the class's gts of the best precision at or after the rank
 * where each was found (VOC2010+'s area under the monotone precision envelope). */
static double s_ap(const s_class *c)
{
    if (c->n == 0)
        return 0;
    int32_t *order = zps_xmalloc(c->n * sizeof *order), *tmp = zps_xmalloc(c->n * sizeof *tmp);
    double *prec = zps_xmalloc(c->n * sizeof *prec);
    det_argsort_desc(c->score, c->n, order, tmp);
    int64_t ntp = 0;
    for (size_t r = 0; r < c->n; r++) {
        ntp += c->tp[order[r]];
        prec[r] = (double)ntp / (double)(r + 1);
    }
    double env = 0, ap = 0;
    for (size_t r = c->n; r-- > 0;) {
        if (prec[r] > env)
            env = prec[r];
        if (c->tp[order[r]])
            ap += env;
    }
    free(order);
    free(tmp);
    free(prec);
    return ap / (double)c->npos;
}

double det_map_compute(const det_map *m, double *ap, int *counted)
{
    double sum = 0;
    int n = 0;
    for (int k = 0; k < m->n_classes; k++) {
        double v = -1;
        if (m->cls[k].npos > 0) {
            v = s_ap(&m->cls[k]);
            sum += v;
            n++;
        }
        if (ap)
            ap[k] = v;
    }
    if (counted)
        *counted = n;
    return n ? sum / n : 0;
}
