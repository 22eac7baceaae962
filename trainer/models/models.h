/* models.h — the models zps trains, built by name on the layer graph of trainer/nn.
 *
 *   "mlp"           flatten -> dense(hidden) ReLU -> dense(hidden) ReLU -> dense(classes)
 *   "convnet"       conv3x3(32)+bn+relu -> maxpool2 -> conv3x3(64)+bn+relu -> maxpool2 ->
 *                   dense(128) ReLU -> dropout -> dense(classes); ~90% on Fashion-MNIST 28x28
 *                   after an epoch or two on 2 cores
 *   "inception_v3"  torchvision's Inception3 (Conv2d_1a_3x3 ... Mixed_7c, AuxLogits on
 *                   Mixed_6e, global average pool, dropout, fc) with torchvision's variable
 *                   names and order. Convolutions have no bias and are followed by batchnorm
 *                   (eps 0.001) and ReLU. At width 1, 3 input channels and 1000 classes it has
 *                   exactly 27,161,264 trainable values (23,834,568 without the aux head).
 *                   The input is not transformed (transform_input=False). Training loss:
 *                   CE(logits) + aux_weight * CE(aux logits); evaluation: CE(logits).
 *   "ssd"           the detector (ssd.h): an Inception stack on 128x128 canvases, extra
 *                   feature layers and per-map heads, marked as outputs: no loss head, its
 *                   loss is trainer/detect's (nn_ssd_forward / nn_ssd_backward).
 */
#ifndef ZPS_TRAINER_MODELS_MODELS_H
#define ZPS_TRAINER_MODELS_MODELS_H

#include <stdint.h>

#include "trainer/nn/nn.h"

typedef struct nn_model_opts {
    const char *name;   // "mlp", "convnet", "inception_v3", "ssd"
    int classes;        // number of classes (default 10; inception_v3 1000)
    int in_channels;    // input channels (default 1; inception_v3 3)
    int in_size;        // input height = width (default 28; inception_v3 299, minimum 75;
                        // ssd 128)
    float width;        // inception_v3 and ssd channel multiplier (default 1; channels
                        // round, min 1)
    int aux;            // inception_v3 aux head: 1 on, 0 off, -1 (default) on where it fits
                        // (Mixed_6e at least 17x17, i.e. input >= 299)
    float aux_weight;   // weight of the aux loss (default 0.4)
    float dropout;      // dropout rate before the classifier (inception 0.5, convnet 0.25)
    int hidden;         // mlp hidden units (default 256)
    uint64_t seed;      // initialisation seed
} nn_model_opts;

/* Defaults for model `name` (NULL: "convnet"). */
void nn_model_opts_default(nn_model_opts *o, const char *name);

/* Builds and initialises the model; ZPS_ERR_INVALID for unknown names or impossible options
 * (logged). *out is NULL on failure. */
zps_status nn_model_create(const k_backend *be, const nn_model_opts *o, nn_model **out);

#endif
