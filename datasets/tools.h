/* tools.h — dataset inspection and verification behind `zps-data inspect|verify`.
 *
 * Both walk every shard with a cursor. inspect parses each record (no image decode) and
 * gathers statistics; verify also decodes every image and checks that keys are dense, and
 * logs every corrupt record at error level as "shard NAME key KEY: reason".
 */
#ifndef ZPS_DATASETS_TOOLS_H
#define ZPS_DATASETS_TOOLS_H

#include <stdint.h>

#include "common/status.h"

typedef struct ds_stats {
    uint64_t records;         // records parsed
    uint64_t corrupt;         // records that failed to parse or validate
    uint64_t bytes;           // value bytes
    int n_shards;
    int num_classes;          // from classes.txt (0 when absent)
    char **classes;           // (num_classes) names from classes.txt (malloc'd; ds_stats_free)
    int hist_len;             // length of class_hist: max(num_classes, largest label + 1)
    uint64_t *class_hist;     // (hist_len) records per image label (malloc'd; ds_stats_free)
    uint64_t no_label;        // records with label -1
    uint32_t min_h, max_h, min_w, max_w;
    uint64_t by_channels[4];  // index 1 and 3 used
    uint64_t by_encoding[3];  // raw, jpeg, png
    uint64_t boxes;           // total boxes
    int min_boxes, max_boxes; // per record
    uint64_t *box_hist;       // (hist_len) boxes per class
    double box_w_sum, box_h_sum; // sums of normalised box widths / heights
} ds_stats;

/* Statistics of the dataset at path (see ds_dataset_open for path and split). */
zps_status ds_inspect(const char *path, const char *split, ds_stats *out);
void ds_stats_free(ds_stats *s);

/* Decodes every record. *checked / *corrupt (may be NULL) receive the counts. Returns
 * ZPS_ERR_CORRUPT when any record is corrupt (each one logged with shard and key), or the
 * error that kept the dataset from opening. */
zps_status ds_verify(const char *path, const char *split, uint64_t *checked, uint64_t *corrupt);
/* The same for shard index `shard` only (0 <= shard < n_shards, else ZPS_ERR_INVALID).
 * zps-data runs each shard in a child process: LMDB trusts its B-tree, so a damaged page
 * header can crash the reader, and the parent then names the shard instead of dying. */
zps_status ds_verify_shard(const char *path, const char *split, int shard, uint64_t *checked,
                           uint64_t *corrupt);

/* Writes global record `index` as an RGB PNG at png_path with its boxes drawn (red, 1 px). */
zps_status ds_dump_png(const char *path, const char *split, uint64_t index, const char *png_path);

#endif
