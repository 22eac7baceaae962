/* pipeline.h — the trainer's input pipeline: read the records of one trainer's share of a
 * dataset, shuffle them per epoch, decode (raw, JPEG, PNG), augment, resize, normalise and
 * hand out batches as NCHW float tensors in caller-provided buffers.
 *
 * Assignment: the dataset's records are numbered globally in shard order (shard 0's keys in
 * order, then shard 1's, ...). Trainer i of n owns the contiguous range
 * [floor(i * T / n), floor((i + 1) * T / n)) (ds_assign): disjoint, covering, balanced to
 * one record whatever the shard count. Because writers spread records round-robin over the
 * shards, each range mixes classes.
 *
 * Epochs: with shuffle, epoch e visits the trainer's records in a permutation drawn from
 * (seed, e); without, in order. Batches never straddle epochs: a training epoch has
 * floor(R / batch) batches and the last R mod batch records of its order wait for the next
 * epoch's permutation. In `once` mode (evaluation) the records are read once, in order,
 * without augmentation; the last batch may be short (info.count) and the call after it
 * returns ZPS_ERR_EOF.
 *
 * Determinism: every random choice (permutation, crop, flip) is a function of the seed,
 * the epoch and the record's position in the epoch, never of which thread decoded it, so
 * the same options give the same batches for any thread count and prefetch depth.
 *
 * Corruption: a record that fails to parse, has the wrong checksum, fails validation or
 * whose image does not decode stops the pipeline: ds_pipeline_next returns ZPS_ERR_CORRUPT
 * and the log names the shard and key. With skip_corrupt the record is skipped and counted;
 * in training the slot is filled with the next good record of the epoch's order (a batch is
 * always full), in `once` mode the batch is one image shorter. A truncated shard fails
 * ds_pipeline_new, or with skip_corrupt opens damaged and each of its records is skipped and
 * counted (shard.h: DS_OPEN_ALLOW_DAMAGED).
 *
 * Threads: `threads` decode threads each build whole batches into a ring of `prefetch` batch
 * slots (bounded: a thread waits while the ring is full); ds_pipeline_next copies the next
 * batch out in order. threads = 0 decodes in the caller's thread. All buffers are allocated
 * at creation or grow to a high-water mark; the steady state allocates nothing.
 */
#ifndef ZPS_DATASETS_PIPELINE_H
#define ZPS_DATASETS_PIPELINE_H

#include <stdbool.h>
#include <stdint.h>

#include "common/status.h"
#include "datasets/record.h"

typedef struct ds_pipeline_opts {
    const char *path;    // dataset directory or shard prefix (shard.h: ds_dataset_open)
    const char *split;   // "train"/"test": use path/split when it exists; NULL: path itself
    int trainer_index;   // i, 0 <= i < n_trainers
    int n_trainers;      // n >= 1
    int batch;           // images per batch (>= 1)
    int height, width;   // output size in pixels (1..4096)
    int channels;        // output channels: 1 or 3 (gray is replicated, RGB becomes luma)
    float mean[3];       // per output channel, on the [0, 1] scale
    float std[3];        // per output channel, > 0; output is (px / 255 - mean) / std
    bool augment;        // random crop (then resize) and horizontal flip
    float crop_min_area; // random crop area as a fraction of the image, lower bound (0, 1]
    float aspect_min;    // crop aspect ratio (w / h) range, log-uniform
    float aspect_max;
    bool flip;           // with augment: mirror half of the images
    int threads;         // decode threads; 0 = decode inside ds_pipeline_next
    int prefetch;        // batches decoded ahead (ring slots), >= 1
    uint64_t seed;       // permutation and augmentation seed
    bool shuffle;        // permute every epoch
    bool skip_corrupt;   // skip and count corrupt records instead of failing
    bool once;           // evaluation: one in-order pass, no shuffle, no augmentation
    int num_classes;     // label bound for validation; 0 = from classes.txt (or unchecked)
} ds_pipeline_opts;

/* Defaults: trainer 0 of 1, batch 32, 28x28x1, mean 0, std 1 (output in [0, 1]), no
 * augmentation (crop_min_area 0.35, aspect 3/4..4/3, flip when augmenting), 1 thread,
 * prefetch 4, seed 1, shuffle on, skip_corrupt off, once off. path must still be set. */
void ds_pipeline_opts_default(ds_pipeline_opts *o);

/* What came with a batch; pointers are owned by the pipeline and valid until the next call
 * to ds_pipeline_next or ds_pipeline_destroy. */
typedef struct ds_batch_info {
    int64_t epoch;        // 0-based epoch of this batch
    int64_t index;        // batch index within its epoch
    int count;            // images filled (== batch except the last batch of a once pass)
    int64_t skipped;      // corrupt records skipped while building this batch
    const uint64_t *ids;  // (count) global record index of each image
    const ds_box *boxes;  // boxes of all images in order, cropped/flipped with their image
    const int *box_start; // (count + 1): image k has boxes[box_start[k] .. box_start[k + 1])
} ds_batch_info;

typedef struct ds_pipeline ds_pipeline;

/* Opens the dataset, takes trainer i's share, starts the threads. ZPS_ERR_INVALID on bad
 * options (logged) or when a training share has fewer records than a batch; dataset errors
 * as ds_dataset_open. */
zps_status ds_pipeline_new(const ds_pipeline_opts *opts, ds_pipeline **out);

/* Fills images (batch, channels, height, width) floats and labels (batch) — caller-owned,
 * at least that large — with the next batch; info may be NULL. Records without a class
 * (detection) have label -1. Returns ZPS_ERR_EOF after a once pass, ZPS_ERR_CORRUPT (see
 * above) or a read error; the pipeline moves on to the next batch after an error. */
zps_status ds_pipeline_next(ds_pipeline *p, float *images, int32_t *labels,
                            ds_batch_info *info);

/* Training: the next ds_pipeline_next hands out batch number b again (b counts batches
 * from the start, across epochs: epoch b / batches_per_epoch, index b mod it), exactly the
 * batch it handed out (or would have) as the b-th: the output is a function of (seed,
 * epoch, index). A trainer redoing steps after a sync rollback seeks back with it.
 * Batches decoded ahead are thrown away. */
void ds_pipeline_seek(ds_pipeline *p, int64_t b);

/* Stops the threads and frees everything; *pp = NULL. Safe on NULL. */
void ds_pipeline_destroy(ds_pipeline **pp);

/* Records in this trainer's share. */
uint64_t ds_pipeline_records(const ds_pipeline *p);
/* Batches per epoch (once: per pass). */
int64_t ds_pipeline_batches_per_epoch(const ds_pipeline *p);
/* Corrupt records skipped so far, over all batches handed out. */
int64_t ds_pipeline_skipped(const ds_pipeline *p);
/* The dataset's class count (classes.txt), 0 when unknown. */
int ds_pipeline_num_classes(const ds_pipeline *p);

#endif
