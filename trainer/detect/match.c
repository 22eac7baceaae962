/* match.c — the workspace, the stable index sort every ranking here uses, and the SSD
 * prior-to-ground-truth matching.
 *
 * Ties always go to the lower index (detect.h), which the merge sort gives by being stable. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "trainer/detect/detect_int.h"

det_ws *det_ws_new(void)
{
    det_ws *w = zps_xmalloc(sizeof *w);
    w->arena = zps_arena_new(0);
    return w;
}

void det_ws_destroy(det_ws **pw)
{
    if (!pw || !*pw)
        return;
    zps_arena_destroy(&(*pw)->arena);
    free(*pw);
    *pw = NULL;
}

size_t det_ws_grow_count(const det_ws *w)
{
    return zps_arena_grow_count(w->arena);
}

void det_argsort_desc(const float *vals, size_t n, int32_t *idx, int32_t *tmp)
{
    for (size_t i = 0; i < n; i++)
        idx[i] = (int32_t)i;
    /* bottom-up merge sort; taking from the left run on equal values keeps it stable */
    int32_t *src = idx, *dst = tmp;
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t a = lo, b = mid, o = lo;
            while (a < mid && b < hi)
                dst[o++] = vals[src[b]] > vals[src[a]] ? src[b++] : src[a++];
            while (a < mid)
                dst[o++] = src[a++];
            while (b < hi)
                dst[o++] = src[b++];
        }
        int32_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != idx)
        memcpy(idx, src, n * sizeof *idx);
}

float det_logsumexp(const float *x, int n)
{
    float m = x[0];
    for (int k = 1; k < n; k++)
        m = fmaxf(m, x[k]);
    double s = 0;
    for (int k = 0; k < n; k++)
        s += exp((double)x[k] - m);
    return m + (float)log(s);
}

void det_match(const float *priors, size_t P, const float *gt, int ngt, float thresh, float *iou,
               int32_t *match)
{
    for (size_t p = 0; p < P; p++) {
        float box[4];
        det_center_to_corner(priors + 4 * p, 1, box);
        for (int j = 0; j < ngt; j++)
            iou[(size_t)j * P + p] = det_iou(gt + 4 * j, box);
        match[p] = -1;
    }
    /* 1. forced: match[p] >= 0 here only marks priors taken by an earlier gt */
    for (int j = 0; j < ngt; j++) {
        const float *row = iou + (size_t)j * P;
        size_t best = P;
        for (size_t p = 0; p < P; p++)
            if (match[p] < 0 && row[p] > 0 && (best == P || row[p] > row[best]))
                best = p;
        if (best < P)
            match[best] = j;
    }
    /* 2. threshold on each free prior's best gt */
    for (size_t p = 0; p < P; p++) {
        if (match[p] >= 0)
            continue;
        int bj = -1;
        float bv = 0;
        for (int j = 0; j < ngt; j++)
            if (bj < 0 || iou[(size_t)j * P + p] > bv) {
                bj = j;
                bv = iou[(size_t)j * P + p];
            }
        if (bj >= 0 && bv > thresh)
            match[p] = bj;
    }
}
