/* ssd.h — the "ssd" detector model (built by nn_model_create) and its host-side glue: the
 * per-map head outputs gathered into the prior order of trainer/detect, and the loss's
 * gradients scattered back into the heads for nn_model_backward_outputs.
 *
 * Architecture (1 x 128 x 128 canvases, width 1; channels scale with nn_model_opts.width):
 *   stem       Conv2d_1a_3x3 (16, s2) 64x64, Conv2d_2a_3x3 (24), maxpool1 32x32,
 *              Conv2d_3b_1x1 (32), Conv2d_4a_3x3 (64), maxpool2 16x16
 *   Mixed_5b, Mixed_5c   InceptionA blocks (1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1),
 *              128 and 144 channels at 16x16                           -> map 0 (16x16, 144)
 *   Mixed_6a   InceptionB reduction (3x3 s2 | 1x1-3x3-3x3 s2 | maxpool s2), 288 at 8x8
 *   Mixed_6b   InceptionA, 256 channels                                -> map 1 (8x8, 256)
 *   extra.K    1x1 then 3x3 s2 BasicConv2d pairs                       -> map 2 (4x4, 128),
 *                                                     map 3 (2x2, 64), map 4 (1x1, 64)
 *   heads      per map a 3x3 conv with bias for class scores (A x (C+1) channels,
 *              head.classification_head.module_list.K) and one for offsets (A x 4,
 *              head.regression_head.module_list.K); A = 4, 6, 6, 4, 4 priors per cell.
 * Every convolution but the heads is BasicConv2d (no bias, batchnorm eps 0.001, ReLU).
 * 1,180,068 trainable values at width 1 with 10 classes (+ background).
 *
 * Outputs (nn_model_output, in this order): the five class heads, then the five offset
 * heads. Prior order (trainer/detect's): maps 16, 8, 4, 2, 1; within a map cells row-major
 * (y, then x); within a cell the A priors. Head channel a * D + j is value j of the cell's
 * prior a (D = C + 1 or 4), torchvision's SSDHead convention.
 */
#ifndef ZPS_TRAINER_MODELS_SSD_H
#define ZPS_TRAINER_MODELS_SSD_H

#include "trainer/models/models.h"

/* Builds the ssd model (models.c calls it for "ssd"); *out is NULL on failure. */
zps_status nn_ssd_create(const k_backend *be, const nn_model_opts *o, nn_model **out);

/* Priors of the model (1,524 for 128x128) and values per prior of the class head (C + 1). */
int nn_ssd_priors(const nn_model *m, int *classes_bg);

/* Forward (train as in nn_model_forward_outputs) of n canvases x (n, 1, h, w), host; cls
 * receives (n, P, C + 1) scores (background = class 0), loc (n, P, 4) offsets, host. */
zps_status nn_ssd_forward(nn_model *m, const float *x, int n, int train, float *cls, float *loc);

/* Backward of the last training forward from dcls (n, P, C + 1) and dloc (n, P, 4), host:
 * the loss's gradients w.r.t. nn_ssd_forward's outputs. hook as in nn_model_backward. */
zps_status nn_ssd_backward(nn_model *m, const float *dcls, const float *dloc, nn_grad_hook hook,
                           void *ctx);

#endif
