/* convert.h — converters that write LMDB shard datasets (shard.h): Fashion-MNIST from
 * Debian's gzipped IDX files, an image folder with one sub-folder per class, and synthetic
 * detection canvases composed from Fashion-MNIST items.
 *
 * Output layout (docs/datasets.md): OUT/train/train-SSSSS-of-NNNNN and
 * OUT/test/test-SSSSS-of-NNNNN, each split directory with its classes.txt. All converters are
 * deterministic: the same inputs (and seed) give byte-identical records in the same order.
 */
#ifndef ZPS_DATASETS_CONVERT_H
#define ZPS_DATASETS_CONVERT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "datasets/record.h"

/* Where Debian's dataset-fashion-mnist puts the files. */
#define DS_FMNIST_DIR "/usr/share/datasets/fashion-mnist"

extern const char *const ds_fmnist_classes[10];

/* Loads one Fashion-MNIST split ("train" or "t10k") from dir: *images (n, 28, 28) u8 and
 * *labels (n) u8, both the caller's to free. Checks IDX magic numbers, sizes and labels. */
zps_status ds_fmnist_load(const char *dir, const char *split, uint8_t **images,
                          uint8_t **labels, size_t *n);

typedef struct ds_convert_opts {
    const char *out;      // output directory
    int shards;           // shards per split (>= 1)
    bool overwrite;       // replace existing shards of the same name
    ds_encoding encoding; // how images are stored
    int quality;          // JPEG quality when encoding is JPEG
    uint64_t limit;       // at most this many records per split; 0 = all
    uint64_t seed;        // order shuffle (folder) and composition (detection)
} ds_convert_opts;

/* OUT/train (60,000 records) and OUT/test (10,000) from src_dir (DS_FMNIST_DIR). Records are
 * 28x28x1 in IDX order. Counts written go to n_train / n_test (may be NULL). */
zps_status ds_convert_fmnist(const char *src_dir, const ds_convert_opts *o, uint64_t *n_train,
                             uint64_t *n_test);

/* OUT/NAME-SSSSS-of-NNNNN + OUT/classes.txt from src_dir/CLASS/ *.{jpg,jpeg,png}. Classes
 * are the sub-folders in byte order; files are shuffled with o->seed so every shard and every
 * trainer's range mixes classes. resize_h/resize_w > 0 resizes (then re-encodes with
 * o->encoding); otherwise JPEG/PNG bytes are stored as they are (raw when o->encoding is raw).
 * Unreadable files are skipped with a warning and counted in *n_skipped. */
zps_status ds_convert_folder(const char *src_dir, const char *name, const ds_convert_opts *o,
                             int resize_h, int resize_w, uint64_t *n_written,
                             uint64_t *n_skipped);

typedef struct ds_detection_opts {
    int canvas;         // canvas side in pixels (e.g. 128)
    int min_items;      // items per canvas, at least 1
    int max_items;      // at most 6 by default
    uint64_t n_train;   // canvases in OUT/train
    uint64_t n_test;    // canvases in OUT/test
    float min_scale;    // item side as a fraction of the canvas, lower bound
    float max_scale;    // upper bound
    float max_iou;      // placements overlapping an earlier box more than this are retried
} ds_detection_opts;

/* A placement is also retried when an earlier box covers more than this share of the
 * smaller of the two boxes (or vice versa), so no item is hidden inside another. */
#define DS_DETECTION_MAX_COVER 0.5f

/* Detection canvases (gray, label -1, boxes tight around each item's visible pixels) from
 * the Fashion-MNIST train (for OUT/train) and test (OUT/test) items. */
zps_status ds_make_detection(const char *src_dir, const ds_convert_opts *o,
                             const ds_detection_opts *d);

/* splitmix64: the project's small deterministic generator for data work. */
static inline uint64_t ds_mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
/* Next value of a generator state, in [0, 2^64). */
static inline uint64_t ds_rand(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    return ds_mix64(*s);
}
/* Uniform float in [0, 1). */
static inline float ds_randf(uint64_t *s) { return (float)(ds_rand(s) >> 40) * (1.0f / 16777216.0f); }

#endif
