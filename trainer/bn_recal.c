/* bn_recal.c — batchnorm running statistics as the exact mean over training batches
 * (bn_recal.h says what and why).
 *
 * The cumulative average rides on the kernels' own running update, run = (1 - m) run + m b,
 * with m = 1 / (k + 1) set before batch k (nn_model_set_bn_momentum): by induction run is the
 * mean of b_0 .. b_k after batch k. Every back-end reads the descriptor's momentum at each
 * call (ref and cpu in their update loops, cuda as a kernel argument), so it may change
 * between forwards.
 */
#include <stdlib.h>

#include "common/clock.h"
#include "common/mem.h"
#include "trainer/bn_recal.h"

zps_status tr_bn_recalibrate(nn_model *m, int batches, int batch, tr_batch_fn next, void *ctx,
                             FILE *progress)
{
    if (batches < 1 || batch < 1)
        return ZPS_ERR_INVALID;
    int c, h, w;
    nn_model_input_shape(m, &c, &h, &w);
    float *x = zps_xaligned(64, (size_t)batch * c * h * w * sizeof *x);
    int32_t *labels = zps_xcalloc((size_t)batch, sizeof *labels);
    zps_status st = ZPS_OK;
    double t0 = zps_now_s();
    int every = batches >= 10 ? batches / 10 : 1;
    for (int k = 0; k < batches && st == ZPS_OK; k++) {
        float loss;
        st = next(ctx, x, labels, batch);
        nn_model_set_bn_momentum(m, 1.0f / (float)(k + 1));
        /* a detector (its loss outside nn, nn.h) has marked outputs and no head: its layers
         * alone update the statistics, and the labels (-1 for detection records) are unused */
        if (st == ZPS_OK && nn_model_outputs(m) > 0)
            st = nn_model_forward_outputs(m, x, batch, 1);
        else if (st == ZPS_OK)
            st = nn_model_forward(m, x, labels, batch, 1, &loss, NULL);
        if (st == ZPS_OK && progress && ((k + 1) % every == 0 || k + 1 == batches))
            fprintf(progress, "batchnorm statistics: batch %d/%d (%d images, %.1f s)\n", k + 1,
                    batches, (k + 1) * batch, zps_now_s() - t0);
    }
    nn_model_set_bn_momentum(m, 0.1f);
    zps_aligned_free(x);
    free(labels);
    return st;
}

void tr_input_opts(ds_pipeline_opts *o, const char *path, const char *split, int c, int h, int w)
{
    ds_pipeline_opts_default(o);
    o->path = path;
    o->split = split;
    o->channels = c;
    o->height = h;
    o->width = w;
    for (int k = 0; k < 3; k++)
        o->mean[k] = o->std[k] = 0.5f;
}
