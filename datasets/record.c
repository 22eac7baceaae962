/* record.c — see record.h. protobuf-c unpacks through an allocator backed by the caller's
 * arena, so parsing a record costs no malloc and the arena is reset per record/batch. */
#include "datasets/record.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <zlib.h>

#include "common/log.h"
#include "common/proto.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the record checksum assumes a little-endian host"
#endif

static uLong s_crc_u32(uLong crc, uint32_t v) { return crc32(crc, (const Bytef *)&v, 4); }

static uLong s_crc_f32(uLong crc, float f)
{
    uint32_t v;
    memcpy(&v, &f, 4);
    return s_crc_u32(crc, v);
}

uint32_t ds_record_crc(const ds_record *r)
{
    uLong c = crc32(0L, Z_NULL, 0);
    /* zlib's crc32 takes a uInt length: feed large images in pieces. */
    const uint8_t *p = r->image;
    size_t left = r->image_len;
    while (left > 0) {
        uInt n = left > (1u << 30) ? (1u << 30) : (uInt)left;
        c = crc32(c, p, n);
        p += n;
        left -= n;
    }
    c = s_crc_u32(c, (uint32_t)r->encoding);
    c = s_crc_u32(c, r->height);
    c = s_crc_u32(c, r->width);
    c = s_crc_u32(c, r->channels);
    c = s_crc_u32(c, (uint32_t)r->label);
    for (int i = 0; i < r->n_boxes; i++) {
        const ds_box *b = &r->boxes[i];
        c = s_crc_f32(c, b->xmin);
        c = s_crc_f32(c, b->ymin);
        c = s_crc_f32(c, b->xmax);
        c = s_crc_f32(c, b->ymax);
        c = s_crc_u32(c, (uint32_t)b->label);
    }
    return c == 0 ? 1u : (uint32_t)c;
}

#define S_FAIL(...)                                                                    \
    do {                                                                               \
        if (why)                                                                       \
            snprintf(why, why_len, __VA_ARGS__);                                       \
        return ZPS_ERR_CORRUPT;                                                        \
    } while (0)

zps_status ds_record_validate(const ds_record *r, int num_classes, char *why, size_t why_len)
{
    if (r->encoding != DS_ENC_RAW && r->encoding != DS_ENC_JPEG && r->encoding != DS_ENC_PNG)
        S_FAIL("unknown encoding %d", (int)r->encoding);
    if (r->height < 1 || r->height > DS_MAX_DIM || r->width < 1 || r->width > DS_MAX_DIM)
        S_FAIL("image size %ux%u outside 1..%d", r->width, r->height, DS_MAX_DIM);
    if (r->channels != 1 && r->channels != 3)
        S_FAIL("%u channels (1 or 3 expected)", r->channels);
    if (!r->image || r->image_len == 0)
        S_FAIL("no image bytes");
    if (r->encoding == DS_ENC_RAW) {
        size_t want = (size_t)r->height * r->width * r->channels;
        if (r->image_len != want)
            S_FAIL("raw image has %zu bytes, %ux%ux%u needs %zu", r->image_len, r->height,
                   r->width, r->channels, want);
    }
    if (r->label < -1 || (num_classes > 0 && r->label >= num_classes))
        S_FAIL("label %d outside -1..%d", r->label, num_classes > 0 ? num_classes - 1 : 0);
    if (r->n_boxes < 0 || r->n_boxes > DS_MAX_BOXES)
        S_FAIL("%d boxes (at most %d)", r->n_boxes, DS_MAX_BOXES);
    if (r->label == -1 && r->n_boxes == 0)
        S_FAIL("label -1 without boxes");
    for (int i = 0; i < r->n_boxes; i++) {
        const ds_box *b = &r->boxes[i];
        if (!isfinite(b->xmin) || !isfinite(b->ymin) || !isfinite(b->xmax) ||
            !isfinite(b->ymax))
            S_FAIL("box %d has a non-finite coordinate", i);
        if (!(b->xmin >= 0.f && b->xmin < b->xmax && b->xmax <= 1.f && b->ymin >= 0.f &&
              b->ymin < b->ymax && b->ymax <= 1.f))
            S_FAIL("box %d (%g,%g,%g,%g) not inside [0,1] with min < max", i, b->xmin,
                   b->ymin, b->xmax, b->ymax);
        if (b->label < 0 || (num_classes > 0 && b->label >= num_classes))
            S_FAIL("box %d label %d out of range", i, b->label);
    }
    return ZPS_OK;
}

zps_status ds_record_pack(const ds_record *r, uint8_t **buf, size_t *cap, size_t *len)
{
    char why[256];
    zps_status st = ds_record_validate(r, 0, why, sizeof why);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "ds", "refusing to write an invalid record: %s", why);
        return ZPS_ERR_INVALID;
    }
    Zps__Box boxes[DS_MAX_BOXES];
    Zps__Box *bp[DS_MAX_BOXES];
    Zps__Example ex = ZPS__EXAMPLE__INIT;
    ex.image.data = (uint8_t *)r->image;
    ex.image.len = r->image_len;
    ex.encoding = (Zps__Encoding)r->encoding;
    ex.height = r->height;
    ex.width = r->width;
    ex.channels = r->channels;
    ex.label = r->label;
    for (int i = 0; i < r->n_boxes; i++) {
        zps__box__init(&boxes[i]);
        boxes[i].xmin = r->boxes[i].xmin;
        boxes[i].ymin = r->boxes[i].ymin;
        boxes[i].xmax = r->boxes[i].xmax;
        boxes[i].ymax = r->boxes[i].ymax;
        boxes[i].label = r->boxes[i].label;
        bp[i] = &boxes[i];
    }
    ex.n_boxes = (size_t)r->n_boxes;
    ex.boxes = r->n_boxes ? bp : NULL;
    ex.crc = ds_record_crc(r);
    size_t n = zps__example__get_packed_size(&ex);
    if (n > *cap) {
        *cap = n + n / 4 + 64;
        *buf = zps_xrealloc(*buf, *cap);
    }
    *len = zps__example__pack(&ex, *buf);
    if (*len != n) {
        zps_log(ZPS_ERROR, "ds", "protobuf-c packed %zu bytes, expected %zu", *len, n);
        return ZPS_ERR_PROTO;
    }
    return ZPS_OK;
}

static void *s_arena_alloc(void *data, size_t size) { return zps_arena_alloc(data, size); }
static void s_arena_free(void *data, void *p)
{
    (void)data;
    (void)p; // released by zps_arena_reset
}

zps_status ds_record_parse(const uint8_t *bytes, size_t len, zps_arena *a, int num_classes,
                           ds_record *out, char *why, size_t why_len)
{
    ProtobufCAllocator al = {.alloc = s_arena_alloc, .free = s_arena_free, .allocator_data = a};
    Zps__Example *ex = zps__example__unpack(&al, len, bytes);
    if (!ex)
        S_FAIL("not a valid Example protobuf (%zu bytes)", len);
    ds_box *boxes = NULL;
    if (ex->n_boxes > DS_MAX_BOXES) {
        zps__example__free_unpacked(ex, &al);
        S_FAIL("%zu boxes (at most %d)", ex->n_boxes, DS_MAX_BOXES);
    }
    if (ex->n_boxes) {
        boxes = zps_arena_alloc(a, ex->n_boxes * sizeof *boxes);
        for (size_t i = 0; i < ex->n_boxes; i++) {
            boxes[i].xmin = ex->boxes[i]->xmin;
            boxes[i].ymin = ex->boxes[i]->ymin;
            boxes[i].xmax = ex->boxes[i]->xmax;
            boxes[i].ymax = ex->boxes[i]->ymax;
            boxes[i].label = ex->boxes[i]->label;
        }
    }
    /* The image bytes stay in the arena: free_unpacked with a no-op free releases nothing. */
    *out = (ds_record){.image = ex->image.data,
                       .image_len = ex->image.len,
                       .encoding = (ds_encoding)ex->encoding,
                       .height = ex->height,
                       .width = ex->width,
                       .channels = ex->channels,
                       .label = ex->label,
                       .boxes = boxes,
                       .n_boxes = (int)ex->n_boxes,
                       .crc = ex->crc};
    zps__example__free_unpacked(ex, &al);
    /* Required: a damaged tag could otherwise turn the checksum into an ignored field. */
    if (out->crc == 0)
        S_FAIL("no checksum (Example.crc is required)");
    uint32_t c = ds_record_crc(out);
    if (c != out->crc)
        S_FAIL("checksum mismatch (stored %08x, computed %08x)", out->crc, c);
    return ds_record_validate(out, num_classes, why, why_len);
}

const char *ds_encoding_name(ds_encoding e)
{
    switch (e) {
    case DS_ENC_RAW: return "raw";
    case DS_ENC_JPEG: return "jpeg";
    case DS_ENC_PNG: return "png";
    }
    return "?";
}

zps_status ds_encoding_parse(const char *s, ds_encoding *out)
{
    if (strcmp(s, "raw") == 0)
        *out = DS_ENC_RAW;
    else if (strcmp(s, "jpeg") == 0 || strcmp(s, "jpg") == 0)
        *out = DS_ENC_JPEG;
    else if (strcmp(s, "png") == 0)
        *out = DS_ENC_PNG;
    else
        return ZPS_ERR_INVALID;
    return ZPS_OK;
}
