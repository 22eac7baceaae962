/* boxes.c — box geometry: IoU, centre/corner conversion, SSD's variance encoding.
 *
 * Degenerate boxes (x2 <= x1 or y2 <= y1) have area 0 and IoU 0 with everything, so an IoU
 * is never NaN; encoding raises sides to DET_MIN_SIDE so a log is never -inf. */
#include <math.h>

#include "trainer/detect/detect.h"

static float s_area(const float *b)
{
    float w = b[2] - b[0], h = b[3] - b[1];
    return w > 0 && h > 0 ? w * h : 0.0f;
}

float det_iou(const float *a, const float *b)
{
    float aa = s_area(a), ab = s_area(b);
    if (aa <= 0 || ab <= 0)
        return 0.0f;
    /* plain comparisons: fminf/fmaxf are libm calls at -O2 (NaN rules), and this is the
     * inner loop of matching and NMS; the corners of a box with area > 0 are not NaN */
    float iw = (a[2] < b[2] ? a[2] : b[2]) - (a[0] > b[0] ? a[0] : b[0]);
    float ih = (a[3] < b[3] ? a[3] : b[3]) - (a[1] > b[1] ? a[1] : b[1]);
    if (iw <= 0 || ih <= 0)
        return 0.0f;
    float inter = iw * ih;
    return inter / (aa + ab - inter);
}

void det_iou_matrix(const float *a, size_t na, const float *b, size_t nb, float *out)
{
    for (size_t i = 0; i < na; i++)
        for (size_t j = 0; j < nb; j++)
            out[i * nb + j] = det_iou(a + 4 * i, b + 4 * j);
}

void det_center_to_corner(const float *in, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++, in += 4, out += 4) {
        float cx = in[0], cy = in[1], hw = in[2] / 2, hh = in[3] / 2;
        out[0] = cx - hw;
        out[1] = cy - hh;
        out[2] = cx + hw;
        out[3] = cy + hh;
    }
}

void det_corner_to_center(const float *in, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++, in += 4, out += 4) {
        float x1 = in[0], y1 = in[1], x2 = in[2], y2 = in[3];
        out[0] = (x1 + x2) / 2;
        out[1] = (y1 + y2) / 2;
        out[2] = x2 - x1;
        out[3] = y2 - y1;
    }
}

void det_encode(const float *gt, const float *priors, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++, gt += 4, priors += 4, out += 4) {
        float gw = fmaxf(gt[2] - gt[0], DET_MIN_SIDE), gh = fmaxf(gt[3] - gt[1], DET_MIN_SIDE);
        float gcx = (gt[0] + gt[2]) / 2, gcy = (gt[1] + gt[3]) / 2;
        out[0] = (gcx - priors[0]) / (DET_VAR0 * priors[2]);
        out[1] = (gcy - priors[1]) / (DET_VAR0 * priors[3]);
        out[2] = logf(gw / priors[2]) / DET_VAR1;
        out[3] = logf(gh / priors[3]) / DET_VAR1;
    }
}

void det_decode(const float *loc, const float *priors, size_t n, float *out)
{
    for (size_t i = 0; i < n; i++, loc += 4, priors += 4, out += 4) {
        float cx = priors[0] + loc[0] * DET_VAR0 * priors[2];
        float cy = priors[1] + loc[1] * DET_VAR0 * priors[3];
        float w = priors[2] * expf(loc[2] * DET_VAR1), h = priors[3] * expf(loc[3] * DET_VAR1);
        out[0] = cx - w / 2;
        out[1] = cy - h / 2;
        out[2] = cx + w / 2;
        out[3] = cy + h / 2;
    }
}

void det_decode_all(const float *priors, size_t P, const float *loc, float *out)
{
    det_decode(loc, priors, P, out);
    for (size_t i = 0; i < 4 * P; i++)
        out[i] = fminf(fmaxf(out[i], 0.0f), 1.0f);
}
