/* tools.c — see tools.h. */
#include "datasets/tools.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "datasets/draw.h"
#include "datasets/image.h"
#include "datasets/record.h"
#include "datasets/shard.h"

/* A damaged (truncated) shard: logs its unreadable key range, adds its records to *bad. */
static bool s_damaged(const ds_shard *sh, uint64_t *bad)
{
    const char *why = ds_shard_damage(sh);
    if (!why)
        return false;
    uint64_t n = ds_shard_count(sh);
    char k0[DS_KEY_LEN + 1], k1[DS_KEY_LEN + 1];
    ds_key_format(0, k0);
    ds_key_format(n ? n - 1 : 0, k1);
    zps_log(ZPS_ERROR, "ds", "corrupt shard: shard %s keys %s..%s (%llu records) unreadable: %s",
            ds_shard_name(sh), k0, k1, (unsigned long long)n, why);
    *bad += n;
    return true;
}

static void s_hist_grow(ds_stats *s, int need)
{
    if (need <= s->hist_len)
        return;
    int n = need > 2 * s->hist_len ? need : 2 * s->hist_len;
    s->class_hist = zps_xrealloc(s->class_hist, (size_t)n * sizeof *s->class_hist);
    s->box_hist = zps_xrealloc(s->box_hist, (size_t)n * sizeof *s->box_hist);
    memset(s->class_hist + s->hist_len, 0, (size_t)(n - s->hist_len) * sizeof *s->class_hist);
    memset(s->box_hist + s->hist_len, 0, (size_t)(n - s->hist_len) * sizeof *s->box_hist);
    s->hist_len = n;
}

zps_status ds_inspect(const char *path, const char *split, ds_stats *out)
{
    memset(out, 0, sizeof *out);
    ds_dataset *d;
    ZPS_TRY(ds_dataset_open_flags(path, split, DS_OPEN_ALLOW_DAMAGED, &d));
    out->n_shards = d->n_shards;
    out->num_classes = d->num_classes;
    if (d->num_classes) {
        out->classes = zps_xcalloc((size_t)d->num_classes, sizeof *out->classes);
        for (int c = 0; c < d->num_classes; c++)
            out->classes[c] = zps_xstrdup(d->classes[c]);
    }
    out->min_h = out->min_w = UINT32_MAX;
    out->min_boxes = INT32_MAX;
    s_hist_grow(out, d->num_classes > 0 ? d->num_classes : 1);
    zps_arena *a = zps_arena_new(1u << 20);
    zps_status st = ZPS_OK;
    for (int s = 0; s < d->n_shards && st == ZPS_OK; s++) {
        if (s_damaged(d->shards[s], &out->corrupt))
            continue;
        ds_reader *r;
        st = ds_reader_new(d->shards[s], &r);
        if (st != ZPS_OK)
            break;
        char key[DS_KEY_LEN + 1];
        const uint8_t *v;
        size_t len;
        zps_status rs;
        while ((rs = ds_reader_next(r, key, &v, &len)) == ZPS_OK) {
            ds_record rec;
            char why[256];
            out->bytes += len;
            zps_arena_reset(a);
            if (ds_record_parse(v, len, a, d->num_classes, &rec, why, sizeof why) != ZPS_OK) {
                zps_log(ZPS_ERROR, "ds", "corrupt record: shard %s key %s: %s",
                        ds_shard_name(d->shards[s]), key, why);
                out->corrupt++;
                continue;
            }
            out->records++;
            if (rec.label >= 0) {
                s_hist_grow(out, rec.label + 1);
                out->class_hist[rec.label]++;
            } else {
                out->no_label++;
            }
            out->min_h = rec.height < out->min_h ? rec.height : out->min_h;
            out->max_h = rec.height > out->max_h ? rec.height : out->max_h;
            out->min_w = rec.width < out->min_w ? rec.width : out->min_w;
            out->max_w = rec.width > out->max_w ? rec.width : out->max_w;
            out->by_channels[rec.channels]++;
            out->by_encoding[rec.encoding]++;
            out->boxes += (uint64_t)rec.n_boxes;
            out->min_boxes = rec.n_boxes < out->min_boxes ? rec.n_boxes : out->min_boxes;
            out->max_boxes = rec.n_boxes > out->max_boxes ? rec.n_boxes : out->max_boxes;
            for (int i = 0; i < rec.n_boxes; i++) {
                s_hist_grow(out, rec.boxes[i].label + 1);
                out->box_hist[rec.boxes[i].label]++;
                out->box_w_sum += rec.boxes[i].xmax - rec.boxes[i].xmin;
                out->box_h_sum += rec.boxes[i].ymax - rec.boxes[i].ymin;
            }
        }
        if (rs != ZPS_ERR_EOF)
            st = rs;
        ds_reader_destroy(&r);
    }
    if (out->records == 0) {
        out->min_h = out->min_w = 0;
        out->min_boxes = 0;
    }
    zps_arena_destroy(&a);
    ds_dataset_close(&d);
    return st;
}

void ds_stats_free(ds_stats *s)
{
    for (int c = 0; c < s->num_classes && s->classes; c++)
        free(s->classes[c]);
    free(s->classes);
    s->classes = NULL;
    free(s->class_hist);
    free(s->box_hist);
    s->class_hist = s->box_hist = NULL;
    s->hist_len = 0;
}

static zps_status s_verify(const char *path, const char *split, int only, uint64_t *checked,
                           uint64_t *corrupt)
{
    ds_dataset *d;
    ZPS_TRY(ds_dataset_open_flags(path, split, DS_OPEN_ALLOW_DAMAGED, &d));
    if (only >= d->n_shards) {
        zps_log(ZPS_ERROR, "ds", "%s has %d shards, no shard %d", d->dir, d->n_shards, only);
        ds_dataset_close(&d);
        return ZPS_ERR_INVALID;
    }
    ds_codec *c = ds_codec_new();
    zps_arena *a = zps_arena_new(1u << 20);
    uint64_t n = 0, bad = 0;
    zps_status st = c ? ZPS_OK : ZPS_ERR_INTERNAL;
    for (int s = 0; s < d->n_shards && st == ZPS_OK; s++) {
        if (only >= 0 && s != only)
            continue;
        if (s_damaged(d->shards[s], &bad))
            continue;
        ds_reader *r;
        st = ds_reader_new(d->shards[s], &r);
        if (st != ZPS_OK)
            break;
        const char *sn = ds_shard_name(d->shards[s]);
        char key[DS_KEY_LEN + 1], want[DS_KEY_LEN + 1];
        const uint8_t *v;
        size_t len;
        zps_status rs;
        uint64_t idx = 0;
        while ((rs = ds_reader_next(r, key, &v, &len)) == ZPS_OK) {
            ds_key_format(idx++, want);
            if (strcmp(key, want) != 0) {
                zps_log(ZPS_ERROR, "ds", "corrupt shard: shard %s key %s: expected key %s "
                        "(keys must be dense)", sn, key, want);
                bad++;
            }
            n++;
            ds_record rec;
            ds_pixels px;
            char why[256];
            zps_arena_reset(a);
            if (ds_record_parse(v, len, a, d->num_classes, &rec, why, sizeof why) != ZPS_OK ||
                ds_image_decode(c, &rec, &px, why, sizeof why) != ZPS_OK) {
                zps_log(ZPS_ERROR, "ds", "corrupt record: shard %s key %s: %s", sn, key, why);
                bad++;
            }
        }
        if (rs != ZPS_ERR_EOF)
            st = rs;
        ds_reader_destroy(&r);
    }
    if (st == ZPS_OK && only < 0)
        zps_log(bad ? ZPS_WARN : ZPS_INFO, "ds", "verify %s: %llu records in %d shards, %llu "
                "corrupt", d->dir, (unsigned long long)n, d->n_shards, (unsigned long long)bad);
    if (checked)
        *checked = n;
    if (corrupt)
        *corrupt = bad;
    ds_codec_destroy(&c);
    zps_arena_destroy(&a);
    ds_dataset_close(&d);
    if (st == ZPS_OK && bad)
        st = ZPS_ERR_CORRUPT;
    return st;
}

zps_status ds_verify(const char *path, const char *split, uint64_t *checked, uint64_t *corrupt)
{
    return s_verify(path, split, -1, checked, corrupt);
}

zps_status ds_verify_shard(const char *path, const char *split, int shard, uint64_t *checked,
                           uint64_t *corrupt)
{
    if (shard < 0)
        return ZPS_ERR_INVALID;
    return s_verify(path, split, shard, checked, corrupt);
}

zps_status ds_dump_png(const char *path, const char *split, uint64_t index, const char *png_path)
{
    ds_canvas c;
    ZPS_TRY(ds_canvas_read(path, split, index, &c));
    for (int b = 0; b < c.n_boxes; b++)
        ds_canvas_box(&c, c.boxes[b].xmin, c.boxes[b].ymin, c.boxes[b].xmax, c.boxes[b].ymax,
                      ds_draw_red);
    zps_status st = ds_canvas_write_png(&c, png_path);
    ds_canvas_free(&c);
    return st;
}
