/* train.h — the training loop of zps-trainer.
 *
 * One function runs a whole job for one trainer: it builds the model, opens the data, joins
 * the job's synchronisation back-end (trainer/sync.h, one file per mode) and steps until the
 * configured work is done:
 *
 *   local      forward, backward, optimizer here (ps/optim.h, the servers' own code)
 *   sync/async/ssp  forward; backward pushes each layer's gradients to the servers as soon
 *              as they exist (last layers first; with --accumulate > 1, in the last
 *              micro-batch's backward, each layer once averaged); then pulls of the
 *              fresh values are issued in forward order and the next forward waits for
 *              each layer's values just before it needs them, so computation and
 *              communication overlap
 *   allreduce  forward, backward, gradient mean over the node's trainers (shared memory),
 *              optimizer here; every trainer holds the same model bit for bit
 *
 * Because every mode applies the same optimizer code to the mean gradient, sync PS with N
 * trainers of batch b, all-reduce with N trainers of batch b and one local trainer of batch
 * N*b (with --shard batch and no batchnorm or dropout) compute the same model up to float
 * rounding; tests/test_train.c checks it.
 */
#ifndef ZPS_TRAINER_TRAIN_H
#define ZPS_TRAINER_TRAIN_H

#include <stdint.h>

#include "common/status.h"
#include "trainer/config.h"

/* What a run ended with (for main's last line and for tests). */
typedef struct tr_result {
    int64_t steps;         // steps this trainer ran
    double accuracy;       // last test score, 0..1 (< 0: never evaluated): accuracy, or the
                           // detector's mAP@0.5 (score_name)
    const char *score_name; // "accuracy" or "map" (task.h)
    double test_loss;      // its loss
    int eval_images;       // test images it was measured on
} tr_result;

/* Runs the job described by cfg for this trainer; res (may be NULL) gets the outcome.
 * Everything it logs names what failed. SIGTERM and SIGINT stop the run (within a poll
 * slice when it waits on the network): ZPS_OK then, like a finished run; a second signal
 * is not caught. Every way out sends LEAVE and writes the metrics summary (docs/training.md,
 * "Stopping and failing"). */
zps_status tr_run(const tr_config *cfg, tr_result *res);

#endif
