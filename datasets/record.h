/* record.h — one dataset record (proto/example.proto `Example`) in plain C form: encode,
 * decode and validation.
 *
 * A ds_record never owns its memory: `image` and `boxes` point into the caller's buffers
 * (when writing) or into a zps_arena (when parsed with ds_record_parse). Packing computes the
 * record checksum (Example.crc); parsing requires and verifies it. Validation checks
 * everything a decoder or the pipeline relies on, so a record that passed it can only fail
 * later inside the image codec (a truncated or damaged JPEG/PNG payload).
 */
#ifndef ZPS_DATASETS_RECORD_H
#define ZPS_DATASETS_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "common/mem.h"
#include "common/status.h"

/* Same values as Zps__Encoding. */
typedef enum ds_encoding {
    DS_ENC_RAW = 0,  // u8, HWC, height * width * channels bytes
    DS_ENC_JPEG = 1, // baseline/progressive JPEG (libturbojpeg)
    DS_ENC_PNG = 2,  // 8-bit PNG (libpng), gray or RGB (alpha dropped)
} ds_encoding;

/* Limits enforced by validation (a record beyond them is corrupt, not merely large). */
#define DS_MAX_DIM 16384   // height and width
#define DS_MAX_BOXES 256   // boxes per record
#define DS_MAX_CLASSES 100000

/* A detection box, coordinates normalised to [0, 1]: 0 <= xmin < xmax <= 1, same for y. */
typedef struct ds_box {
    float xmin, ymin, xmax, ymax;
    int32_t label; // class, 0 <= label < num_classes
} ds_box;

typedef struct ds_record {
    const uint8_t *image; // (image_len) encoded or raw HWC u8 bytes; borrowed
    size_t image_len;
    ds_encoding encoding;
    uint32_t height, width, channels; // channels is 1 or 3
    int32_t label;                    // class; -1 when the record has only boxes
    const ds_box *boxes;              // (n_boxes); borrowed; NULL when n_boxes == 0
    int n_boxes;
    uint32_t crc;                     // as stored; 0 = absent (filled by parse, set by pack)
} ds_record;

/* Checksum of a record's content (see example.proto); never returns 0 for content whose
 * true CRC is 0 — it returns 1 instead, so 0 can mean "absent". */
uint32_t ds_record_crc(const ds_record *r);

/* Validates r. num_classes > 0 bounds labels (image label -1..num_classes-1, box labels
 * 0..num_classes-1); 0 means unknown (labels only need to be >= -1 / >= 0). On failure
 * returns ZPS_ERR_CORRUPT with a reason in why (when why != NULL). */
zps_status ds_record_validate(const ds_record *r, int num_classes, char *why, size_t why_len);

/* Packs r (after validating it with num_classes 0) as an Example with its checksum into
 * *buf, growing *buf and *cap with zps_xrealloc as needed (start with NULL/0; reuse across calls
 * and free with free()). *len receives the packed size. */
zps_status ds_record_pack(const ds_record *r, uint8_t **buf, size_t *cap, size_t *len);

/* Unpacks bytes into *out, allocating from arena a (valid until zps_arena_reset), requires
 * and verifies the checksum and validates with num_classes. ZPS_ERR_CORRUPT with a reason
 * in why when the bytes are not an Example, the checksum is absent or differs, or
 * validation fails. */
zps_status ds_record_parse(const uint8_t *bytes, size_t len, zps_arena *a, int num_classes,
                           ds_record *out, char *why, size_t why_len);

/* "raw", "jpeg", "png"; "?" otherwise. */
const char *ds_encoding_name(ds_encoding e);
/* Inverse of ds_encoding_name; ZPS_ERR_INVALID for anything else. */
zps_status ds_encoding_parse(const char *s, ds_encoding *out);

#endif
