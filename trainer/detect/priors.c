/* priors.c — the SSD prior (anchor) boxes of a det_prior_cfg, in the order detect.h fixes.
 *
 * Invariant: det_prior_count() and det_priors() walk the same maps and cells, so the count
 * and the layout cannot disagree; the model's heads emit det_prior_per_cell() predictions per
 * cell in the same order. */
#include <math.h>

#include "common/log.h"
#include "trainer/detect/detect.h"

void det_prior_cfg_default(det_prior_cfg *c)
{
    static const int sizes[5] = {16, 8, 4, 2, 1};
    *c = (det_prior_cfg){.canvas = 128, .n_maps = 5, .s_min = 0.2f, .s_max = 0.9f};
    for (int k = 0; k < 5; k++) {
        c->map_size[k] = sizes[k];
        int wide = sizes[k] == 8 || sizes[k] == 4;
        c->n_ratios[k] = wide ? 4 : 2;
        c->ratios[k][0] = 2.0f;
        c->ratios[k][1] = wide ? 3.0f : 0.5f;
        c->ratios[k][2] = 0.5f;
        c->ratios[k][3] = 1.0f / 3.0f;
    }
}

int det_prior_per_cell(const det_prior_cfg *c, int map)
{
    return c->n_ratios[map] + 2;
}

size_t det_prior_count(const det_prior_cfg *c)
{
    size_t n = 0;
    for (int k = 0; k < c->n_maps; k++)
        n += (size_t)c->map_size[k] * (size_t)c->map_size[k] * (size_t)det_prior_per_cell(c, k);
    return n;
}

static zps_status s_check(const det_prior_cfg *c)
{
    if (c->n_maps < 1 || c->n_maps > DET_MAX_MAPS || !(c->s_min > 0) || !(c->s_max <= 1) ||
        !(c->s_min <= c->s_max)) {
        zps_log(ZPS_ERROR, "detect", "prior config: %d maps, scales %g..%g (want 1..%d maps, 0 < "
                "s_min <= s_max <= 1)", c->n_maps, c->s_min, c->s_max, DET_MAX_MAPS);
        return ZPS_ERR_INVALID;
    }
    for (int k = 0; k < c->n_maps; k++) {
        int bad = c->map_size[k] < 1 || c->n_ratios[k] < 0 || c->n_ratios[k] > DET_MAX_RATIOS;
        for (int r = 0; !bad && r < c->n_ratios[k]; r++)
            bad = !(c->ratios[k][r] > 0) || !isfinite(c->ratios[k][r]);
        if (bad) {
            zps_log(ZPS_ERROR, "detect", "prior config: map %d (size %d, %d ratios) is out of "
                    "range", k, c->map_size[k], c->n_ratios[k]);
            return ZPS_ERR_INVALID;
        }
    }
    return ZPS_OK;
}

static float s_clip01(double v)
{
    return (float)(v < 0 ? 0 : v > 1 ? 1 : v);
}

/* Scale of map k; k == n_maps is the one past the last, for the extra square prior. */
static double s_scale(const det_prior_cfg *c, int k)
{
    double step = c->n_maps > 1 ? ((double)c->s_max - c->s_min) / (c->n_maps - 1) : 0;
    double s = c->s_min + step * k;
    return s > 1 ? 1 : s;
}

zps_status det_priors(const det_prior_cfg *c, float *out)
{
    zps_status st = s_check(c);
    if (st != ZPS_OK)
        return st;
    float *o = out;
    for (int k = 0; k < c->n_maps; k++) {
        int f = c->map_size[k];
        double s = s_scale(c, k), s2 = sqrt(s * s_scale(c, k + 1));
        double w[DET_MAX_RATIOS + 2], h[DET_MAX_RATIOS + 2];
        w[0] = h[0] = s;
        w[1] = h[1] = s2;
        for (int r = 0; r < c->n_ratios[k]; r++) {
            double a = sqrt((double)c->ratios[k][r]);
            w[r + 2] = s * a;
            h[r + 2] = s / a;
        }
        int per = det_prior_per_cell(c, k);
        for (int y = 0; y < f; y++)
            for (int x = 0; x < f; x++)
                for (int j = 0; j < per; j++, o += 4) {
                    o[0] = s_clip01((x + 0.5) / f);
                    o[1] = s_clip01((y + 0.5) / f);
                    o[2] = s_clip01(w[j]);
                    o[3] = s_clip01(h[j]);
                }
    }
    return ZPS_OK;
}
