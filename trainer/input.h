/* input.h — a trainer's training batches: read from its pipeline and handed to the model
 * without a copy of its own (private to trainer/).
 *
 * On a host back-end the model reads the pipeline's batch buffer in place (nn_model_set_input).
 * On a device back-end (one with queues, backend.h) there are two pinned host buffers and two
 * device buffers: batch t runs from one pair while batch t + 1 is read into the other and
 * copied in on the host-to-device copy queue (K_QUEUE_IN), so the copy overlaps step t's
 * compute and never waits behind step t's gradients going down (K_QUEUE_OUT):
 *
 *   tr_input_next(b)    the next micro-batch: the one fetched ahead, or one read now; the
 *                       compute queue waits for its copy, and the model's next forward reads
 *                       it in place
 *   forward, backward
 *   tr_input_done(last) its backward is queued: the compute queue's point after it is the
 *                       last use of its device buffer; unless `last` (the job's last
 *                       micro-batch), the next batch is read and its copy queued now, into the
 *                       other pair, after the point at which that pair was last used
 *
 * A batch's labels and boxes are the pipeline's until the next read: the tasks use them in
 * their forward, before tr_input_done reads ahead. Corrupt records are skipped and counted up
 * to --skip-corrupt (the pipeline logs each). Nothing is allocated per step.
 */
#ifndef ZPS_TRAINER_INPUT_H
#define ZPS_TRAINER_INPUT_H

#include <stdint.h>

#include "common/status.h"
#include "datasets/pipeline.h"
#include "trainer/nn/nn.h"
#include "trainer/task.h"

typedef struct tr_input tr_input;

/* Batches from p (read_batch images of sample_floats each per read), the trainer's slice at
 * image `offset`, `batch` images, for model m (whose back-end decides the buffers). All
 * borrowed. skip_corrupt: corrupt records allowed. */
zps_status tr_input_new(ds_pipeline *p, nn_model *m, int read_batch, size_t sample_floats,
                        int offset, int batch, int64_t skip_corrupt, tr_input **out);
/* The next micro-batch into *b (the model's next forward reads it); `step` (1-based) names
 * it in the log. */
zps_status tr_input_next(tr_input *in, tr_task_batch *b, int64_t step);
/* Its backward is queued; reads the next one ahead unless last. */
zps_status tr_input_done(tr_input *in, int last, int64_t step);
/* Back to batch `batches` of the pipeline (a sync rollback): a batch read ahead is dropped. */
void tr_input_seek(tr_input *in, int64_t batches);
/* Corrupt training records skipped so far. */
int64_t tr_input_skipped(const tr_input *in);
void tr_input_destroy(tr_input **pin);

#endif
