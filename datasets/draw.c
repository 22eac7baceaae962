/* draw.c — see draw.h. */
#include "datasets/draw.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "datasets/image.h"
#include "datasets/shard.h"

const uint8_t ds_draw_red[3] = {255, 0, 0}, ds_draw_green[3] = {0, 255, 0};

static void s_put(ds_canvas *c, int x, int y, const uint8_t rgb[3])
{
    memcpy(c->rgb + ((size_t)y * c->w + x) * 3, rgb, 3);
}

static void s_rect(ds_canvas *c, int x0, int y0, int x1, int y1, const uint8_t rgb[3])
{
    x0 = x0 < 0 ? 0 : x0;
    y0 = y0 < 0 ? 0 : y0;
    x1 = x1 >= c->w ? c->w - 1 : x1;
    y1 = y1 >= c->h ? c->h - 1 : y1;
    for (int x = x0; x <= x1; x++) {
        s_put(c, x, y0, rgb);
        s_put(c, x, y1, rgb);
    }
    for (int y = y0; y <= y1; y++) {
        s_put(c, x0, y, rgb);
        s_put(c, x1, y, rgb);
    }
}

void ds_canvas_box(ds_canvas *c, float x0, float y0, float x1, float y1, const uint8_t rgb[3])
{
    s_rect(c, (int)(x0 * c->w), (int)(y0 * c->h), (int)(x1 * c->w) - 1, (int)(y1 * c->h) - 1,
           rgb);
}

/* The decoded record's pixels and boxes into c. */
static void s_fill(ds_canvas *c, const ds_pixels *px, const ds_record *rec)
{
    c->h = px->h;
    c->w = px->w;
    c->rgb = zps_xmalloc((size_t)px->h * px->w * 3);
    for (size_t i = 0; i < (size_t)px->h * px->w; i++)
        for (int k = 0; k < 3; k++)
            c->rgb[i * 3 + k] = px->px[i * px->c + (px->c == 3 ? k : 0)];
    c->n_boxes = rec->n_boxes;
    c->boxes = zps_xcalloc(rec->n_boxes ? (size_t)rec->n_boxes : 1, sizeof *c->boxes);
    if (rec->n_boxes)
        memcpy(c->boxes, rec->boxes, (size_t)rec->n_boxes * sizeof *c->boxes);
}

zps_status ds_canvas_read(const char *path, const char *split, uint64_t index, ds_canvas *out)
{
    memset(out, 0, sizeof *out);
    ds_dataset *d;
    ZPS_TRY(ds_dataset_open(path, split, &d));
    if (index >= d->total) {
        zps_log(ZPS_ERROR, "ds", "record %llu: the dataset has %llu", (unsigned long long)index,
                (unsigned long long)d->total);
        ds_dataset_close(&d);
        return ZPS_ERR_INVALID;
    }
    int s;
    uint64_t local;
    ds_dataset_locate(d, index, &s, &local);
    ds_reader *r = NULL;
    ds_codec *c = ds_codec_new();
    zps_arena *a = zps_arena_new(0);
    const uint8_t *v;
    size_t len;
    ds_record rec;
    ds_pixels px;
    char why[256] = "";
    zps_status st = c ? ds_reader_new(d->shards[s], &r) : ZPS_ERR_INTERNAL;
    if (st == ZPS_OK)
        st = ds_reader_get(r, local, &v, &len);
    if (st == ZPS_OK)
        st = ds_record_parse(v, len, a, d->num_classes, &rec, why, sizeof why);
    if (st == ZPS_OK)
        st = ds_image_decode(c, &rec, &px, why, sizeof why);
    if (st != ZPS_OK && why[0]) {
        char key[DS_KEY_LEN + 1];
        ds_key_format(local, key);
        zps_log(ZPS_ERROR, "ds", "corrupt record: shard %s key %s: %s", ds_shard_name(d->shards[s]),
                key, why);
    }
    if (st == ZPS_OK)
        s_fill(out, &px, &rec);
    zps_arena_destroy(&a);
    ds_codec_destroy(&c);
    ds_reader_destroy(&r);
    ds_dataset_close(&d);
    return st;
}

void ds_canvas_free(ds_canvas *c)
{
    free(c->rgb);
    free(c->boxes);
    memset(c, 0, sizeof *c);
}

zps_status ds_canvas_write_png(const ds_canvas *c, const char *path)
{
    ds_codec *codec = ds_codec_new();
    if (!codec)
        return ZPS_ERR_INTERNAL;
    const uint8_t *png;
    size_t plen;
    zps_status st = ds_image_encode(codec, c->rgb, c->h, c->w, 3, DS_ENC_PNG, 0, &png, &plen);
    if (st == ZPS_OK) {
        FILE *f = fopen(path, "wb");
        if (!f) {
            zps_log(ZPS_ERROR, "ds", "%s: cannot write: %s", path, strerror(errno));
            st = ZPS_ERR_IO;
        } else {
            if (fwrite(png, 1, plen, f) != plen)
                st = ZPS_ERR_IO;
            if (fclose(f) != 0)
                st = ZPS_ERR_IO;
            if (st != ZPS_OK)
                zps_log(ZPS_ERROR, "ds", "%s: write failed", path);
        }
    }
    ds_codec_destroy(&codec);
    return st;
}
