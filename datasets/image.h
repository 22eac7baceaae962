/* image.h — image codecs (raw, JPEG via libturbojpeg, PNG via libpng) and the resampling
 * used by converters and the pipeline.
 *
 * Images are u8, HWC, 1 (gray) or 3 (RGB) channels. A ds_codec holds the per-thread codec
 * state and reusable buffers: give each thread its own; nothing here allocates on the hot
 * path once the buffers have reached their high-water size.
 */
#ifndef ZPS_DATASETS_IMAGE_H
#define ZPS_DATASETS_IMAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "datasets/record.h"

typedef struct ds_codec ds_codec;

/* A decoded image; px is borrowed (record bytes or the codec's buffer) and valid until the
 * next decode with the same codec. */
typedef struct ds_pixels {
    const uint8_t *px; // (h, w, c)
    int h, w, c;
} ds_pixels;

/* NULL only when libturbojpeg cannot be initialised (logged). */
ds_codec *ds_codec_new(void);
void ds_codec_destroy(ds_codec **pc);

/* Decodes a validated record into pixels with the record's own channel count; the decoded
 * size must equal the record's height/width. ZPS_ERR_DECODE with a reason in why on damaged,
 * truncated or mismatching payloads. Raw records are returned without a copy. */
zps_status ds_image_decode(ds_codec *c, const ds_record *r, ds_pixels *out, char *why,
                           size_t why_len);

/* Reads only the header of an encoded image (JPEG or PNG, detected from the bytes): size and
 * channels (1 for gray, 3 otherwise). */
zps_status ds_image_probe(ds_codec *c, const uint8_t *bytes, size_t len, ds_encoding *enc,
                          int *h, int *w, int *ch);
/* Decodes any JPEG/PNG (detected from the bytes) into the codec's buffer, gray when the file
 * is gray, else RGB. */
zps_status ds_image_decode_any(ds_codec *c, const uint8_t *bytes, size_t len, ds_pixels *out,
                               ds_encoding *enc);

/* Encodes (h, w, c) u8 pixels as JPEG (quality 1..100, 4:4:4 for quality >= 90 else 4:2:0)
 * or PNG into the codec's output buffer; *out is valid until the next encode. */
zps_status ds_image_encode(ds_codec *c, const uint8_t *px, int h, int w, int ch,
                           ds_encoding enc, int quality, const uint8_t **out, size_t *len);

/* Bilinear resize (half-pixel centres, like torchvision without antialias) of u8 HWC. dst is
 * (dh, dw, c). */
void ds_resize_u8(const uint8_t *src, int sh, int sw, int c, uint8_t *dst, int dh, int dw);

/* Crop rectangle (in source pixels, fractional allowed) and flip for ds_image_sample. */
typedef struct ds_crop {
    float x0, y0, w, h; // crop inside the source image
    bool flip;          // mirror horizontally after cropping
} ds_crop;

/* The pipeline's fused step: bilinear-samples the crop of src to (oh, ow), converts channels
 * (gray -> replicated, RGB -> gray by ITU-R 601 luma), mirrors when asked and writes
 * (px / 255 - mean[c]) / std[c] as float (oc, oh, ow) into dst. oc is 1 or 3. */
void ds_image_sample(const ds_pixels *src, const ds_crop *crop, int oh, int ow, int oc,
                     const float *mean, const float *std, float *dst);

#endif
