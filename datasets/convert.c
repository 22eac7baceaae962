/* convert.c — see convert.h. Converters hold the whole source split in memory (Fashion-MNIST
 * is 55 MB) and stream records into a ds_writer, which batches the LMDB transactions. */
#include "datasets/convert.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <zlib.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "datasets/image.h"
#include "datasets/shard.h"

const char *const ds_fmnist_classes[10] = {"T-shirt/top", "Trouser", "Pullover", "Dress",
                                           "Coat",        "Sandal",  "Shirt",    "Sneaker",
                                           "Bag",         "Ankle boot"};

/* Reads a whole gzip file into a malloc'd buffer. */
static zps_status s_gz_read(const char *path, uint8_t **out, size_t *len)
{
    gzFile f = gzopen(path, "rb");
    if (!f) {
        zps_log(ZPS_ERROR, "ds", "%s: cannot open: %s", path, strerror(errno));
        return errno == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
    }
    gzbuffer(f, 1u << 20);
    size_t cap = 1u << 20, n = 0;
    uint8_t *buf = zps_xmalloc(cap);
    for (;;) {
        if (n == cap) {
            cap *= 2;
            buf = zps_xrealloc(buf, cap);
        }
        int got = gzread(f, buf + n, (unsigned)(cap - n > (1u << 30) ? (1u << 30) : cap - n));
        if (got < 0) {
            int e;
            zps_log(ZPS_ERROR, "ds", "%s: gzread failed: %s", path, gzerror(f, &e));
            gzclose(f);
            free(buf);
            return ZPS_ERR_CORRUPT;
        }
        if (got == 0)
            break;
        n += (size_t)got;
    }
    gzclose(f);
    *out = buf;
    *len = n;
    return ZPS_OK;
}

static uint32_t s_be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

zps_status ds_fmnist_load(const char *dir, const char *split, uint8_t **images,
                          uint8_t **labels, size_t *n)
{
    char pi[4096], pl[4096];
    snprintf(pi, sizeof pi, "%s/%s-images-idx3-ubyte.gz", dir, split);
    snprintf(pl, sizeof pl, "%s/%s-labels-idx1-ubyte.gz", dir, split);
    uint8_t *bi = NULL, *bl = NULL;
    size_t li, ll;
    ZPS_TRY(s_gz_read(pi, &bi, &li));
    zps_status st = s_gz_read(pl, &bl, &ll);
    if (st != ZPS_OK) {
        free(bi);
        return st;
    }
    st = ZPS_ERR_CORRUPT;
    if (li < 16 || s_be32(bi) != 0x803 || ll < 8 || s_be32(bl) != 0x801) {
        zps_log(ZPS_ERROR, "ds", "%s or %s: not IDX image/label files", pi, pl);
        goto out;
    }
    size_t cnt = s_be32(bi + 4), rows = s_be32(bi + 8), cols = s_be32(bi + 12);
    if (rows != 28 || cols != 28 || li != 16 + cnt * 784 || s_be32(bl + 4) != cnt ||
        ll != 8 + cnt) {
        zps_log(ZPS_ERROR, "ds", "%s: %zu images of %zux%zu in %zu bytes, labels say %u in "
                "%zu bytes: sizes disagree", pi, cnt, rows, cols, li, s_be32(bl + 4), ll);
        goto out;
    }
    for (size_t i = 0; i < cnt; i++) {
        if (bl[8 + i] > 9) {
            zps_log(ZPS_ERROR, "ds", "%s: label %u of item %zu is not 0..9", pl, bl[8 + i], i);
            goto out;
        }
    }
    *images = zps_xmalloc(cnt * 784);
    *labels = zps_xmalloc(cnt);
    memcpy(*images, bi + 16, cnt * 784);
    memcpy(*labels, bl + 8, cnt);
    *n = cnt;
    st = ZPS_OK;
out:
    free(bi);
    free(bl);
    return st;
}

static void s_split_dir(const ds_convert_opts *o, const char *split, char *buf, size_t n)
{
    snprintf(buf, n, "%s/%s", o->out, split);
}

/* OUT/split into dir, its shard writer and an image codec (both the caller's). */
static zps_status s_open_split(const ds_convert_opts *o, const char *split, char *dir,
                               size_t dir_len, ds_writer **wr, ds_codec **codec)
{
    s_split_dir(o, split, dir, dir_len);
    ZPS_TRY(ds_writer_new(dir, split, o->shards, o->overwrite, wr));
    *codec = ds_codec_new();
    if (!*codec) {
        zps_log(ZPS_ERROR, "ds", "cannot create an image codec");
        ds_writer_destroy(wr);
        return ZPS_ERR_INTERNAL;
    }
    return ZPS_OK;
}

/* Writes count items (h, w, c) u8 with labels into OUT/split with o's encoding. */
static zps_status s_write_images(const ds_convert_opts *o, const char *split,
                                 const uint8_t *images, const uint8_t *labels, size_t count,
                                 int h, int w, int c, uint64_t *written)
{
    char dir[4096];
    ds_writer *wr;
    ds_codec *codec;
    ZPS_TRY(s_open_split(o, split, dir, sizeof dir, &wr, &codec));
    zps_status st = ZPS_OK;
    size_t px = (size_t)h * w * c;
    for (size_t i = 0; i < count && st == ZPS_OK; i++) {
        ds_record r = {.encoding = o->encoding, .height = (uint32_t)h, .width = (uint32_t)w,
                       .channels = (uint32_t)c, .label = labels[i]};
        st = ds_image_encode(codec, images + i * px, h, w, c, o->encoding, o->quality, &r.image,
                             &r.image_len);
        if (st == ZPS_OK)
            st = ds_writer_put(wr, &r);
    }
    ds_codec_destroy(&codec);
    if (st != ZPS_OK) {
        ds_writer_destroy(&wr);
        return st;
    }
    if (written)
        *written = ds_writer_count(wr);
    ZPS_TRY(ds_writer_close(&wr));
    return ds_classes_write(dir, (char *const *)ds_fmnist_classes, 10);
}

zps_status ds_convert_fmnist(const char *src_dir, const ds_convert_opts *o, uint64_t *n_train,
                             uint64_t *n_test)
{
    static const char *const src[2] = {"train", "t10k"}, *const dst[2] = {"train", "test"};
    for (int s = 0; s < 2; s++) {
        uint8_t *im, *lb;
        size_t n;
        ZPS_TRY(ds_fmnist_load(src_dir, src[s], &im, &lb, &n));
        if (o->limit && n > o->limit)
            n = o->limit;
        uint64_t w = 0;
        zps_status st = s_write_images(o, dst[s], im, lb, n, 28, 28, 1, &w);
        free(im);
        free(lb);
        ZPS_TRY(st);
        zps_log(ZPS_INFO, "ds", "fashion-mnist %s: %llu records in %d shards under %s/%s",
                dst[s], (unsigned long long)w, o->shards, o->out, dst[s]);
        if (s == 0 && n_train)
            *n_train = w;
        if (s == 1 && n_test)
            *n_test = w;
    }
    return ZPS_OK;
}

/* ---- image folder ---- */

static int s_cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Sorted names in dir that are directories (want_dirs) or image files. */
static zps_status s_list(const char *dir, bool want_dirs, char ***out, int *n)
{
    DIR *d = opendir(dir);
    if (!d) {
        zps_log(ZPS_ERROR, "ds", "%s: cannot open directory: %s", dir, strerror(errno));
        return errno == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
    }
    char **v = NULL;
    int cnt = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char p[8192];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        struct stat sb;
        if (stat(p, &sb) != 0)
            continue;
        if (want_dirs) {
            if (!S_ISDIR(sb.st_mode))
                continue;
        } else {
            const char *dot = strrchr(e->d_name, '.');
            if (!S_ISREG(sb.st_mode) || !dot ||
                (strcasecmp(dot, ".jpg") && strcasecmp(dot, ".jpeg") && strcasecmp(dot, ".png")))
                continue;
        }
        if (cnt == cap) {
            cap = cap ? cap * 2 : 64;
            v = zps_xrealloc(v, (size_t)cap * sizeof *v);
        }
        v[cnt++] = zps_xstrdup(e->d_name);
    }
    closedir(d);
    if (cnt)
        qsort(v, (size_t)cnt, sizeof *v, s_cmp_str);
    *out = v;
    *n = cnt;
    return ZPS_OK;
}

static void s_free_list(char **v, int n)
{
    for (int i = 0; i < n; i++)
        free(v[i]);
    free(v);
}

static zps_status s_read_file(const char *path, uint8_t **buf, size_t *cap, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        ZPS_CHECK_FILE(-1, path);
    if (fseek(f, 0, SEEK_END) != 0) {
        fclose(f);
        ZPS_CHECK_FILE(-1, path);
    }
    long sz = ftell(f);
    rewind(f);
    if (sz < 0) {
        fclose(f);
        ZPS_CHECK_FILE(-1, path);
    }
    if ((size_t)sz > *cap) {
        *cap = (size_t)sz;
        *buf = zps_xrealloc(*buf, *cap);
    }
    size_t got = fread(*buf, 1, (size_t)sz, f);
    fclose(f);
    if (got != (size_t)sz) {
        zps_log(ZPS_ERROR, "ds", "%s: short read (%zu of %ld bytes)", path, got, sz);
        return ZPS_ERR_IO;
    }
    *len = got;
    return ZPS_OK;
}

typedef struct s_item {
    int cls;
    char *path;
} s_item;

/* Every image file under src_dir/CLASS/ as {class index, path}, in class then name order. */
static zps_status s_gather_items(const char *src_dir, char **classes, int nc, s_item **out,
                                 size_t *n_out)
{
    s_item *items = NULL;
    size_t ni = 0, icap = 0;
    zps_status st = ZPS_OK;
    for (int c = 0; c < nc && st == ZPS_OK; c++) {
        char cdir[8192];
        snprintf(cdir, sizeof cdir, "%s/%s", src_dir, classes[c]);
        char **files;
        int nf;
        st = s_list(cdir, false, &files, &nf);
        for (int f = 0; st == ZPS_OK && f < nf; f++) {
            if (ni == icap) {
                icap = icap ? icap * 2 : 256;
                items = zps_xrealloc(items, icap * sizeof *items);
            }
            size_t L = strlen(cdir) + strlen(files[f]) + 2;
            items[ni].cls = c;
            items[ni].path = zps_xmalloc(L);
            snprintf(items[ni].path, L, "%s/%s", cdir, files[f]);
            ni++;
        }
        if (st == ZPS_OK)
            s_free_list(files, nf);
    }
    *out = items;
    *n_out = ni;
    return st;
}

/* Fisher-Yates with the seed, so classes mix in every shard and every trainer's range; then
 * at most o->limit items are kept. */
static void s_shuffle_items(const ds_convert_opts *o, s_item *items, size_t *ni)
{
    uint64_t rs = o->seed;
    for (size_t i = *ni; i > 1; i--) {
        size_t j = (size_t)(ds_rand(&rs) % i);
        s_item t = items[i - 1];
        items[i - 1] = items[j];
        items[j] = t;
    }
    if (o->limit && *ni > o->limit) {
        for (size_t i = o->limit; i < *ni; i++)
            free(items[i].path);
        *ni = o->limit;
    }
}

/* Scratch of one folder conversion, reused from file to file. */
typedef struct s_folder_buf {
    ds_codec *codec;
    uint8_t *file; // the file's bytes, capacity file_cap
    size_t file_cap;
    uint8_t *rs;   // resized pixels, capacity rs_cap
    size_t rs_cap;
} s_folder_buf;

/* Fills r's image from decoded px: resized and re-encoded (resize_h, resize_w > 0), raw
 * pixels, or the file's own bytes (len of them, encoding enc). */
static zps_status s_folder_image(const ds_convert_opts *o, s_folder_buf *fb, const ds_pixels *px,
                                 ds_encoding enc, size_t len, int resize_h, int resize_w,
                                 ds_record *r)
{
    if (resize_h > 0 && resize_w > 0) {
        size_t need = (size_t)resize_h * resize_w * px->c;
        if (need > fb->rs_cap) {
            fb->rs_cap = need;
            fb->rs = zps_xrealloc(fb->rs, fb->rs_cap);
        }
        ds_resize_u8(px->px, px->h, px->w, px->c, fb->rs, resize_h, resize_w);
        r->height = (uint32_t)resize_h;
        r->width = (uint32_t)resize_w;
        r->encoding = o->encoding;
        return ds_image_encode(fb->codec, fb->rs, resize_h, resize_w, px->c, o->encoding,
                               o->quality, &r->image, &r->image_len);
    }
    if (o->encoding == DS_ENC_RAW) {
        r->encoding = DS_ENC_RAW;
        r->image = px->px;
        r->image_len = (size_t)px->h * px->w * px->c;
    } else {
        r->encoding = enc; /* the file's own bytes */
        r->image = fb->file;
        r->image_len = len;
    }
    return ZPS_OK;
}

/* Writes the ni items into wr; unreadable files are counted in *skipped. */
static zps_status s_write_items(const ds_convert_opts *o, s_folder_buf *fb, const s_item *items,
                                size_t ni, int resize_h, int resize_w, ds_writer *wr,
                                uint64_t *skipped)
{
    zps_status st = ZPS_OK;
    for (size_t i = 0; i < ni && st == ZPS_OK; i++) {
        size_t len;
        ds_encoding enc;
        ds_pixels px;
        if (s_read_file(items[i].path, &fb->file, &fb->file_cap, &len) != ZPS_OK ||
            ds_image_decode_any(fb->codec, fb->file, len, &px, &enc) != ZPS_OK) {
            zps_log(ZPS_WARN, "ds", "skipping %s: not a readable JPEG or PNG", items[i].path);
            (*skipped)++;
            continue;
        }
        ds_record r = {.height = (uint32_t)px.h, .width = (uint32_t)px.w,
                       .channels = (uint32_t)px.c, .label = items[i].cls};
        st = s_folder_image(o, fb, &px, enc, len, resize_h, resize_w, &r);
        if (st == ZPS_OK)
            st = ds_writer_put(wr, &r);
    }
    return st;
}

zps_status ds_convert_folder(const char *src_dir, const char *name, const ds_convert_opts *o,
                             int resize_h, int resize_w, uint64_t *n_written,
                             uint64_t *n_skipped)
{
    char **classes;
    int nc;
    ZPS_TRY(s_list(src_dir, true, &classes, &nc));
    if (nc == 0) {
        zps_log(ZPS_ERROR, "ds", "%s has no class sub-folders", src_dir);
        free(classes);
        return ZPS_ERR_NOT_FOUND;
    }
    s_item *items;
    size_t ni;
    zps_status st = s_gather_items(src_dir, classes, nc, &items, &ni);
    s_shuffle_items(o, items, &ni);
    ds_writer *wr = NULL;
    s_folder_buf fb = {.codec = ds_codec_new()};
    uint64_t skipped = 0;
    if (st == ZPS_OK && !fb.codec)
        st = ZPS_ERR_INTERNAL;
    if (st == ZPS_OK)
        st = ds_writer_new(o->out, name, o->shards, o->overwrite, &wr);
    if (st == ZPS_OK)
        st = s_write_items(o, &fb, items, ni, resize_h, resize_w, wr, &skipped);
    uint64_t written = wr ? ds_writer_count(wr) : 0;
    if (st == ZPS_OK)
        st = ds_writer_close(&wr);
    ds_writer_destroy(&wr);
    if (st == ZPS_OK)
        st = ds_classes_write(o->out, classes, nc);
    if (st == ZPS_OK)
        zps_log(ZPS_INFO, "ds", "folder %s: %llu records of %d classes in %d shards under %s "
                "(%llu skipped)", src_dir, (unsigned long long)written, nc, o->shards, o->out,
                (unsigned long long)skipped);
    if (n_written)
        *n_written = written;
    if (n_skipped)
        *n_skipped = skipped;
    ds_codec_destroy(&fb.codec);
    free(fb.file);
    free(fb.rs);
    for (size_t i = 0; i < ni; i++)
        free(items[i].path);
    free(items);
    s_free_list(classes, nc);
    return st;
}

/* ---- detection canvases ---- */

/* Overlap of two pixel boxes (x0, y0, x1, y1): IoU, and the share of the smaller box that
 * the other covers (catches a small item hidden inside a large one, which IoU misses). */
static void s_overlap(const int *a, const int *b, float *iou, float *cover)
{
    int ix = (a[2] < b[2] ? a[2] : b[2]) - (a[0] > b[0] ? a[0] : b[0]);
    int iy = (a[3] < b[3] ? a[3] : b[3]) - (a[1] > b[1] ? a[1] : b[1]);
    *iou = *cover = 0.f;
    if (ix <= 0 || iy <= 0)
        return;
    float inter = (float)ix * (float)iy;
    float aa = (float)(a[2] - a[0]) * (float)(a[3] - a[1]);
    float ab = (float)(b[2] - b[0]) * (float)(b[3] - b[1]);
    *iou = inter / (aa + ab - inter);
    *cover = inter / (aa < ab ? aa : ab);
}

/* Tight box (x0, y0, x1, y1), inclusive, around the pixels of a side x side item brighter
 * than the background; false when the item has none. */
static bool s_item_bbox(const uint8_t *item, int side, int *bb)
{
    int bx0 = side, by0 = side, bx1 = -1, by1 = -1;
    for (int y = 0; y < side; y++)
        for (int x = 0; x < side; x++)
            if (item[y * side + x] > 16) {
                bx0 = x < bx0 ? x : bx0;
                bx1 = x > bx1 ? x : bx1;
                by0 = y < by0 ? y : by0;
                by1 = y > by1 ? y : by1;
            }
    bb[0] = bx0, bb[1] = by0, bb[2] = bx1, bb[3] = by1;
    return bx1 >= 0;
}

/* Composes one canvas (S x S, cleared here) from random Fashion-MNIST items drawn with the
 * generator *rs; item is side-sized scratch. Returns how many boxes were placed. */
static int s_compose(const ds_detection_opts *d, const uint8_t *im, const uint8_t *lb,
                     size_t n_src, uint64_t *rs, uint8_t *canvas, uint8_t *item, ds_box *boxes)
{
    const int S = d->canvas;
    memset(canvas, 0, (size_t)S * S);
    int want = d->min_items + (int)(ds_rand(rs) % (uint64_t)(d->max_items - d->min_items + 1));
    int placed[DS_MAX_BOXES][4];
    int nb = 0;
    /* up to 20 tries per item; keep trying (bounded) until min_items are placed */
    for (int attempt = 0; nb < want && (attempt < want * 20 || (nb < d->min_items && attempt < 5000));
         attempt++) {
        size_t src = (size_t)(ds_rand(rs) % n_src);
        float sc = d->min_scale + (d->max_scale - d->min_scale) * ds_randf(rs);
        int side = (int)(sc * (float)S + 0.5f);
        if (side < 8)
            side = 8;
        if (side > S)
            side = S;
        ds_resize_u8(im + src * 784, 28, 28, 1, item, side, side);
        int bb[4];
        if (!s_item_bbox(item, side, bb))
            continue;
        int px = (int)(ds_rand(rs) % (uint64_t)(S - side + 1));
        int py = (int)(ds_rand(rs) % (uint64_t)(S - side + 1));
        int b[4] = {px + bb[0], py + bb[1], px + bb[2] + 1, py + bb[3] + 1};
        bool ok = true;
        for (int j = 0; j < nb && ok; j++) {
            float iou, cover;
            s_overlap(b, placed[j], &iou, &cover);
            ok = iou <= d->max_iou && cover <= DS_DETECTION_MAX_COVER;
        }
        if (!ok)
            continue;
        for (int y = 0; y < side; y++)
            for (int x = 0; x < side; x++) {
                uint8_t v = item[y * side + x];
                uint8_t *c = &canvas[(py + y) * S + px + x];
                if (v > *c)
                    *c = v;
            }
        memcpy(placed[nb], b, sizeof b);
        boxes[nb] = (ds_box){.xmin = (float)b[0] / (float)S, .ymin = (float)b[1] / (float)S,
                             .xmax = (float)b[2] / (float)S, .ymax = (float)b[3] / (float)S,
                             .label = lb[src]};
        nb++;
    }
    return nb;
}

static zps_status s_detection_split(const ds_convert_opts *o, const ds_detection_opts *d,
                                    const char *split, const uint8_t *im, const uint8_t *lb,
                                    size_t n_src, uint64_t count, uint64_t seed)
{
    char dir[4096];
    ds_writer *wr;
    ds_codec *codec;
    ZPS_TRY(s_open_split(o, split, dir, sizeof dir, &wr, &codec));
    const int S = d->canvas;
    uint8_t *canvas = zps_xmalloc((size_t)S * S);
    uint8_t *item = zps_xmalloc((size_t)S * S);
    zps_status st = ZPS_OK;
    for (uint64_t k = 0; k < count && st == ZPS_OK; k++) {
        uint64_t rs = ds_mix64(seed ^ ds_mix64(k));
        ds_box boxes[DS_MAX_BOXES];
        int nb = s_compose(d, im, lb, n_src, &rs, canvas, item, boxes);
        ds_record r = {.encoding = o->encoding, .height = (uint32_t)S, .width = (uint32_t)S,
                       .channels = 1, .label = -1, .boxes = boxes, .n_boxes = nb};
        st = ds_image_encode(codec, canvas, S, S, 1, o->encoding, o->quality, &r.image,
                             &r.image_len);
        if (st == ZPS_OK)
            st = ds_writer_put(wr, &r);
    }
    free(canvas);
    free(item);
    ds_codec_destroy(&codec);
    if (st != ZPS_OK) {
        ds_writer_destroy(&wr);
        return st;
    }
    ZPS_TRY(ds_writer_close(&wr));
    zps_log(ZPS_INFO, "ds", "detection %s: %llu canvases %dx%d under %s", split,
            (unsigned long long)count, S, S, dir);
    return ds_classes_write(dir, (char *const *)ds_fmnist_classes, 10);
}

zps_status ds_make_detection(const char *src_dir, const ds_convert_opts *o,
                             const ds_detection_opts *d)
{
    if (d->canvas < 16 || d->canvas > DS_MAX_DIM || d->min_items < 1 ||
        d->max_items < d->min_items || d->max_items > DS_MAX_BOXES || d->min_scale <= 0.f ||
        d->max_scale > 1.f || d->min_scale > d->max_scale) {
        zps_log(ZPS_ERROR, "ds", "bad detection options (canvas %d, items %d..%d, scale "
                "%g..%g)", d->canvas, d->min_items, d->max_items, d->min_scale, d->max_scale);
        return ZPS_ERR_INVALID;
    }
    static const char *const src[2] = {"train", "t10k"}, *const dst[2] = {"train", "test"};
    const uint64_t cnt[2] = {d->n_train, d->n_test};
    for (int s = 0; s < 2; s++) {
        uint8_t *im, *lb;
        size_t n;
        ZPS_TRY(ds_fmnist_load(src_dir, src[s], &im, &lb, &n));
        zps_status st = s_detection_split(o, d, dst[s], im, lb, n, cnt[s],
                                          ds_mix64(o->seed + (uint64_t)s));
        free(im);
        free(lb);
        ZPS_TRY(st);
    }
    return ZPS_OK;
}
