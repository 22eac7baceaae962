/* draw.h — a dataset record as an RGB picture with boxes drawn on it, written as a PNG: what
 * `zps-data inspect --dump` shows of a record and `zps-trainer --dump-detections` of a
 * detector's predictions beside the truth.
 *
 * A ds_canvas owns its pixels and a copy of the record's boxes (malloc'd; ds_canvas_free).
 * Boxes are drawn 1 pixel wide from normalised corner coordinates, clipped to the picture.
 */
#ifndef ZPS_DATASETS_DRAW_H
#define ZPS_DATASETS_DRAW_H

#include <stdint.h>

#include "common/status.h"
#include "datasets/record.h"

typedef struct ds_canvas {
    uint8_t *rgb;   // (h, w, 3); gray records are replicated
    int h, w;
    ds_box *boxes;  // (n_boxes) the record's boxes, normalised
    int n_boxes;
} ds_canvas;

/* Colours of the pictures: the dataset's (true) boxes and a model's predictions. */
extern const uint8_t ds_draw_red[3], ds_draw_green[3];

/* Reads global record `index` of the dataset at path (ds_dataset_open's path and split) into
 * out. ZPS_ERR_INVALID (logged) past the last record; corrupt records are logged with shard
 * and key. */
zps_status ds_canvas_read(const char *path, const char *split, uint64_t index, ds_canvas *out);
void ds_canvas_free(ds_canvas *c);
/* A rectangle with corners (x0, y0), (x1, y1) in [0, 1] of the picture's sides. */
void ds_canvas_box(ds_canvas *c, float x0, float y0, float x1, float y1, const uint8_t rgb[3]);
/* The picture as an RGB PNG. ZPS_ERR_IO (logged) when path cannot be written. */
zps_status ds_canvas_write_png(const ds_canvas *c, const char *path);

#endif
