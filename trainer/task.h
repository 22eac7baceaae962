/* task.h — what the training loop does that depends on the kind of model: the loss of a
 * micro-batch and its backward, what a step record says about it, and the evaluation score.
 *
 *   classify  (task_classify.c) mlp, convnet, inception_v3: nn's softmax head; the step
 *             record carries the batch's accuracy; the score is test accuracy
 *   detect    (task_detect.c) ssd: the heads' outputs read out of nn, trainer/detect's
 *             MultiBox loss, its gradient injected back (nn_ssd_backward); the step record
 *             carries the loss's parts (conf, loc, matched); the score is VOC mAP@0.5
 *
 * train.c owns the schedule (micro-batches, accumulation, hooks, evaluation times) and calls
 * a task for the model-specific work only, so every sync back-end and every flag works for
 * every kind. A task holds the model borrowed and its own buffers, sized at tr_task_new for
 * the training batch: a step allocates nothing (evaluation batches are at most that big).
 */
#ifndef ZPS_TRAINER_TASK_H
#define ZPS_TRAINER_TASK_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "datasets/record.h"
#include "trainer/config.h"
#include "trainer/metrics.h"
#include "trainer/nn/nn.h"

/* Images with what the dataset says about them: a training micro-batch or an evaluation
 * set. Image k has labels[k] (-1 for detection records) and the boxes
 * boxes[box_start[k] .. box_start[k + 1]) (indices into boxes, so a slice of a batch is
 * box_start + offset). */
typedef struct tr_task_batch {
    const float *x;        // (n, c, h, w) normalised input
    const int32_t *labels; // (n)
    const ds_box *boxes;   // normalised corner boxes of every image (may be NULL with no box)
    const int *box_start;  // (n + 1)
    int n;
} tr_task_batch;

typedef struct tr_task tr_task;
struct tr_task {
    const char *score_name; // what evaluate's score is: "accuracy" or "map"
    int eval_batch;         // images per evaluation forward
    /* Training forward of one micro-batch (n <= the training batch): *loss is its mean loss;
     * the task keeps what its backward and record need. */
    zps_status (*forward)(tr_task *t, const tr_task_batch *b, float *loss);
    /* The gradient of the last forward's loss into the model's grads (overwritten); the hook
     * as nn_model_backward's. */
    zps_status (*backward)(tr_task *t, nn_grad_hook hook, void *ctx);
    /* What the step's k micro-batches measured besides the loss into rec (the accuracy on
     * them, or the loss's parts); starts the next step's count. */
    void (*record)(tr_task *t, tr_step_record *rec, int k);
    /* Inference over set: *score (accuracy or mAP, 0..1) and *loss (mean test loss). */
    zps_status (*evaluate)(tr_task *t, const tr_task_batch *set, double *score, double *loss);
    /* Image k of set (global test record `record`) with its predicted (green) and true (red)
     * boxes as a PNG at path; NULL when the kind has no boxes. */
    zps_status (*dump)(tr_task *t, const tr_task_batch *set, int k, const char *data,
                       uint64_t record, const char *path);
    void (*destroy)(tr_task *t);
};

/* The task for cfg->model over model m (borrowed; outlives the task), classes the dataset's
 * (without background). ZPS_ERR_INVALID (logged) when the model does not fit its task. */
zps_status tr_task_new(const tr_config *cfg, nn_model *m, int classes, tr_task **out);
/* Frees it; *pt = NULL; safe on NULL. */
void tr_task_destroy(tr_task **pt);

/* The kinds (task_classify.c, task_detect.c). */
zps_status tr_task_classify_new(nn_model *m, int batch, tr_task **out);
zps_status tr_task_detect_new(nn_model *m, int batch, int classes, tr_task **out);

#endif
