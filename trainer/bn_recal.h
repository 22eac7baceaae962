/* bn_recal.h — recompute a model's batchnorm running statistics from training batches, the
 * way torch.optim.swa_utils.update_bn does: forward in training mode over `batches` batches
 * with momentum 1 / (k + 1) at batch k (0-based), so that each running mean ends as the plain
 * mean of the batches' means and each running variance as the mean of their unbiased
 * variances (the kernels' running update), not as a momentum trace that mostly remembers the
 * last batches. Batch 0's momentum 1 replaces whatever the statistics held.
 *
 * Used where a model's values came without its statistics: zps-ctl export (the servers hold
 * the trainable variables; the running statistics live in the trainers). The parameters are
 * not changed; the model's batchnorm momentum is 0.1 again afterwards.
 */
#ifndef ZPS_TRAINER_BN_RECAL_H
#define ZPS_TRAINER_BN_RECAL_H

#include <stdint.h>
#include <stdio.h>

#include "common/status.h"
#include "datasets/pipeline.h"
#include "trainer/nn/nn.h"

/* A pipeline's options for feeding a model of input c x h x w from split of the data set at
 * path, the way every zps model is fed: (px / 255 - 0.5) / 0.5 per channel, the pipeline's
 * defaults otherwise (zps-trainer, and zps-ctl's recalibration, which must match it). */
void tr_input_opts(ds_pipeline_opts *o, const char *path, const char *split, int c, int h,
                   int w);

/* Fills x (n, c, h, w) in host memory and n labels in [0, classes) with the next batch. */
typedef zps_status (*tr_batch_fn)(void *ctx, float *x, int32_t *labels, int n);

/* Runs the sweep over `batches` batches of `batch` images from next (m's input shape).
 * progress (may be NULL) gets a line about every tenth of the sweep. Errors of next or of
 * the forward end the sweep and are returned (the statistics are then partial). */
zps_status tr_bn_recalibrate(nn_model *m, int batches, int batch, tr_batch_fn next, void *ctx,
                             FILE *progress);

#endif
