/* pipeline.c — see pipeline.h.
 *
 * Batch numbers b = 0, 1, 2, ... run across epochs (epoch = b / batches_per_epoch). Worker
 * threads claim batch numbers in order; batch b is built in ring slot b % prefetch, which is
 * free once the consumer has taken batch b - prefetch (the invariant next_claim <
 * consumed + prefetch bounds the work in flight). The consumer takes batches strictly in
 * order, so the output order never depends on thread timing.
 */
#include "datasets/pipeline.h"

#include <assert.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "datasets/convert.h"
#include "datasets/image.h"
#include "datasets/shard.h"

/* Training: how many following records are tried to replace a corrupt one before failing. */
#define S_MAX_REPLACE 64
/* Skipped records logged as warnings before the rest go to debug level. */
#define S_MAX_SKIP_LOGS 100

typedef struct s_slot {
    int64_t batch;      // batch number held when ready
    bool ready;         // built and not yet consumed
    zps_status st;      // outcome of building it
    float *images;      // (batch, C, H, W)
    int32_t *labels;    // (batch)
    uint64_t *ids;      // (batch)
    int *box_start;     // (batch + 1)
    ds_box *boxes;      // (box_cap)
    int box_cap;
    int count;
    int64_t skipped;
} s_slot;

typedef struct s_worker {
    ds_pipeline *p;
    pthread_t th;
    bool started;
    ds_codec *codec;
    zps_arena *arena;   // protobuf unpacking, reset per record
    ds_reader **readers; // (n_shards) opened on first use
    uint32_t *perm;     // (n) record order of perm_epoch
    int64_t perm_epoch; // -1: none yet
} s_worker;

struct ds_pipeline {
    ds_pipeline_opts o;
    ds_dataset *d;
    int num_classes;
    uint64_t begin, n;  // this trainer's global records [begin, begin + n)
    int64_t bpe;        // batches per epoch
    size_t img_floats;  // C * H * W
    int depth;          // ring slots
    s_slot *slots;      // (depth)
    int n_workers;      // threads, or 1 (inline) when threads == 0
    s_worker *workers;  // (n_workers)
    pthread_mutex_t mu;
    pthread_cond_t space; // a slot became free / stop
    pthread_cond_t ready; // a slot became ready
    int64_t next_claim; // next batch a worker will build
    int64_t consumed;   // batches handed to the caller
    bool stop;
    int64_t skipped_total;
    int64_t skip_logs;  // skipped-record messages so far (atomic)
    /* the batch last handed out (info pointers) */
    uint64_t *cur_ids;
    int *cur_start;
    ds_box *cur_boxes;
    int cur_box_cap;
};

void ds_pipeline_opts_default(ds_pipeline_opts *o)
{
    memset(o, 0, sizeof *o);
    o->n_trainers = 1;
    o->batch = 32;
    o->height = o->width = 28;
    o->channels = 1;
    for (int c = 0; c < 3; c++)
        o->std[c] = 1.f;
    o->crop_min_area = 0.35f;
    o->aspect_min = 0.75f;
    o->aspect_max = 4.f / 3.f;
    o->flip = true;
    o->threads = 1;
    o->prefetch = 4;
    o->seed = 1;
    o->shuffle = true;
}

static zps_status s_check_opts(const ds_pipeline_opts *o)
{
    const char *bad = NULL;
    if (!o->path)
        bad = "no dataset path";
    else if (o->n_trainers < 1 || o->trainer_index < 0 || o->trainer_index >= o->n_trainers)
        bad = "trainer index must satisfy 0 <= i < n";
    else if (o->batch < 1)
        bad = "batch must be >= 1";
    else if (o->height < 1 || o->height > 4096 || o->width < 1 || o->width > 4096)
        bad = "output height/width must be 1..4096";
    else if (o->channels != 1 && o->channels != 3)
        bad = "output channels must be 1 or 3";
    else if (o->threads < 0 || o->threads > 64)
        bad = "threads must be 0..64";
    else if (o->prefetch < 1 || o->prefetch > 1024)
        bad = "prefetch must be 1..1024";
    else if (o->augment && !(o->crop_min_area > 0.f && o->crop_min_area <= 1.f &&
                             o->aspect_min > 0.f && o->aspect_min <= o->aspect_max))
        bad = "crop_min_area must be in (0, 1] and 0 < aspect_min <= aspect_max";
    for (int c = 0; !bad && c < o->channels; c++)
        if (!(o->std[c] > 0.f) || !isfinite(o->mean[c]))
            bad = "std must be > 0 and mean finite";
    if (bad) {
        zps_log(ZPS_ERROR, "ds", "pipeline options: %s", bad);
        return ZPS_ERR_INVALID;
    }
    return ZPS_OK;
}

/* ---- building one batch ---- */

static void s_perm(s_worker *w, int64_t epoch)
{
    ds_pipeline *p = w->p;
    if (w->perm_epoch == epoch)
        return;
    for (uint64_t i = 0; i < p->n; i++)
        w->perm[i] = (uint32_t)i;
    if (p->o.shuffle && !p->o.once) {
        uint64_t rs = ds_mix64(p->o.seed ^ ds_mix64((uint64_t)epoch * 2 + 1));
        for (uint64_t i = p->n; i > 1; i--) {
            uint64_t j = ds_rand(&rs) % i;
            uint32_t t = w->perm[i - 1];
            w->perm[i - 1] = w->perm[j];
            w->perm[j] = t;
        }
    }
    w->perm_epoch = epoch;
}

/* Reads, parses, validates and decodes global record g. ZPS_ERR_CORRUPT (reason logged with
 * shard and key, as a warning when skipping) for bad data; other codes for read failures. */
static zps_status s_load(s_worker *w, uint64_t g, ds_record *rec, ds_pixels *px)
{
    ds_pipeline *p = w->p;
    int s;
    uint64_t local;
    ds_dataset_locate(p->d, g, &s, &local);
    if (!w->readers[s]) {
        zps_status st = ds_reader_new(p->d->shards[s], &w->readers[s]);
        if (st != ZPS_OK)
            return st;
    }
    const uint8_t *val;
    size_t len;
    char why[256] = "";
    zps_status st = ZPS_OK;
    const char *damage = ds_shard_damage(p->d->shards[s]);
    if (damage) {
        snprintf(why, sizeof why, "shard is %s", damage);
        st = ZPS_ERR_CORRUPT;
    } else {
        st = ds_reader_get(w->readers[s], local, &val, &len);
    }
    if (st == ZPS_OK)
        st = ds_record_parse(val, len, w->arena, p->num_classes, rec, why, sizeof why);
    if (st == ZPS_OK) {
        st = ds_image_decode(w->codec, rec, px, why, sizeof why);
        if (st == ZPS_ERR_DECODE)
            st = ZPS_ERR_CORRUPT;
    }
    if (st == ZPS_ERR_CORRUPT && why[0]) {
        char key[DS_KEY_LEN + 1];
        ds_key_format(local, key);
        /* Skipping: the first S_MAX_SKIP_LOGS records are warnings, the rest debug lines (a
         * truncated shard would otherwise log every one of its records every epoch). */
        int level = ZPS_ERROR;
        if (p->o.skip_corrupt) {
            int64_t n = __atomic_add_fetch(&p->skip_logs, 1, __ATOMIC_RELAXED);
            level = n <= S_MAX_SKIP_LOGS ? ZPS_WARN : ZPS_DEBUG;
            if (n == S_MAX_SKIP_LOGS)
                zps_log(ZPS_WARN, "ds", "further skipped records are logged at debug level");
        }
        zps_log(level, "ds", "%s record: shard %s key %s: %s",
                p->o.skip_corrupt ? "skipping corrupt" : "corrupt", ds_shard_name(p->d->shards[s]),
                key, why);
    }
    return st;
}

/* Crop and flip for the record at position pos of epoch (training with augment). */
static void s_aug(const ds_pipeline *p, int64_t epoch, uint64_t pos, int h, int w, ds_crop *c)
{
    *c = (ds_crop){.x0 = 0.f, .y0 = 0.f, .w = (float)w, .h = (float)h, .flip = false};
    if (!p->o.augment || p->o.once)
        return;
    uint64_t rs = ds_mix64(p->o.seed ^ ds_mix64((uint64_t)epoch * 2 + 2) ^ ds_mix64(~pos));
    const float area = (float)h * (float)w;
    const float la = logf(p->o.aspect_min), lb = logf(p->o.aspect_max);
    for (int t = 0; t < 10; t++) {
        float a = area * (p->o.crop_min_area + (1.f - p->o.crop_min_area) * ds_randf(&rs));
        float ar = expf(la + (lb - la) * ds_randf(&rs));
        float cw = sqrtf(a * ar), ch = sqrtf(a / ar);
        if (cw <= (float)w && ch <= (float)h && cw >= 1.f && ch >= 1.f) {
            c->x0 = ((float)w - cw) * ds_randf(&rs);
            c->y0 = ((float)h - ch) * ds_randf(&rs);
            c->w = cw;
            c->h = ch;
            break;
        }
    }
    if (p->o.flip)
        c->flip = ds_randf(&rs) < 0.5f;
}

static void s_push_box(s_slot *sl, int *nb, const ds_box *b)
{
    if (*nb == sl->box_cap) {
        sl->box_cap = sl->box_cap ? sl->box_cap * 2 : 64;
        sl->boxes = zps_xrealloc(sl->boxes, (size_t)sl->box_cap * sizeof *sl->boxes);
    }
    sl->boxes[(*nb)++] = *b;
}

/* Boxes of rec in the coordinates of the crop c of an (h, w) image: kept when their centre
 * lies inside the crop, clipped to it, mirrored with the image. */
static void s_boxes(s_slot *sl, int *nb, const ds_record *rec, const ds_crop *c, int h, int w)
{
    for (int i = 0; i < rec->n_boxes; i++) {
        const ds_box *b = &rec->boxes[i];
        float x0 = b->xmin * (float)w, x1 = b->xmax * (float)w;
        float y0 = b->ymin * (float)h, y1 = b->ymax * (float)h;
        float cx = 0.5f * (x0 + x1), cy = 0.5f * (y0 + y1);
        if (cx < c->x0 || cx > c->x0 + c->w || cy < c->y0 || cy > c->y0 + c->h)
            continue;
        ds_box o = {.label = b->label};
        o.xmin = fmaxf(0.f, (x0 - c->x0) / c->w);
        o.xmax = fminf(1.f, (x1 - c->x0) / c->w);
        o.ymin = fmaxf(0.f, (y0 - c->y0) / c->h);
        o.ymax = fminf(1.f, (y1 - c->y0) / c->h);
        if (!(o.xmin < o.xmax && o.ymin < o.ymax))
            continue;
        if (c->flip) {
            float a = 1.f - o.xmax, bb = 1.f - o.xmin;
            o.xmin = a;
            o.xmax = bb;
        }
        s_push_box(sl, nb, &o);
    }
}

static void s_build(s_worker *w, int64_t b, s_slot *sl)
{
    ds_pipeline *p = w->p;
    const int64_t epoch = b / p->bpe, j = b % p->bpe;
    s_perm(w, epoch);
    const uint64_t start = (uint64_t)j * (uint64_t)p->o.batch;
    uint64_t end = start + (uint64_t)p->o.batch;
    if (end > p->n)
        end = p->n;
    sl->st = ZPS_OK;
    sl->skipped = 0;
    int k = 0, nb = 0;
    sl->box_start[0] = 0;
    for (uint64_t pos = start; pos < end && sl->st == ZPS_OK; pos++) {
        ds_record rec;
        ds_pixels px;
        uint64_t rid = w->perm[pos];
        zps_arena_reset(w->arena);
        zps_status st = s_load(w, p->begin + rid, &rec, &px);
        if (st == ZPS_ERR_CORRUPT && p->o.skip_corrupt) {
            sl->skipped++;
            if (p->o.once)
                continue;
            /* training: the next good record of this epoch's order takes the slot */
            for (uint64_t t = 1; st == ZPS_ERR_CORRUPT && t <= S_MAX_REPLACE && t < p->n; t++) {
                rid = w->perm[(pos + t) % p->n];
                zps_arena_reset(w->arena);
                st = s_load(w, p->begin + rid, &rec, &px);
                if (st == ZPS_ERR_CORRUPT)
                    sl->skipped++;
            }
            if (st == ZPS_ERR_CORRUPT)
                zps_log(ZPS_ERROR, "ds", "more than %d corrupt records in a row: giving up",
                        S_MAX_REPLACE);
        }
        if (st != ZPS_OK) {
            sl->st = st;
            break;
        }
        ds_crop crop;
        s_aug(p, epoch, pos, px.h, px.w, &crop);
        ds_image_sample(&px, &crop, p->o.height, p->o.width, p->o.channels, p->o.mean,
                        p->o.std, sl->images + (size_t)k * p->img_floats);
        sl->labels[k] = rec.label;
        sl->ids[k] = p->begin + rid;
        s_boxes(sl, &nb, &rec, &crop, px.h, px.w);
        sl->box_start[++k] = nb;
    }
    sl->count = k;
    sl->batch = b;
}

static void *s_worker_main(void *arg)
{
    s_worker *w = arg;
    ds_pipeline *p = w->p;
    const int64_t limit = p->o.once ? p->bpe : INT64_MAX;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && !(p->next_claim < limit && p->next_claim < p->consumed + p->depth))
            pthread_cond_wait(&p->space, &p->mu);
        if (p->stop)
            break;
        int64_t b = p->next_claim++;
        s_slot *sl = &p->slots[b % p->depth];
        pthread_mutex_unlock(&p->mu);
        s_build(w, b, sl);
        pthread_mutex_lock(&p->mu);
        sl->ready = true;
        pthread_cond_broadcast(&p->ready);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* ---- lifecycle ---- */

static void s_worker_free(s_worker *w, int n_shards)
{
    ds_codec_destroy(&w->codec);
    zps_arena_destroy(&w->arena);
    if (w->readers)
        for (int s = 0; s < n_shards; s++)
            ds_reader_destroy(&w->readers[s]);
    free(w->readers);
    free(w->perm);
}

/* This trainer's record range and batches per epoch; fails when the range cannot hold one
 * batch (training) or does not fit the 32-bit permutation. */
static zps_status s_partition(ds_pipeline *p, uint64_t *end)
{
    const ds_pipeline_opts *opts = &p->o;
    ds_assign(p->d->total, opts->trainer_index, opts->n_trainers, &p->begin, end);
    p->n = *end - p->begin;
    if (p->n > UINT32_MAX) {
        zps_log(ZPS_ERROR, "ds", "%llu records for one trainer: at most 2^32 supported",
                (unsigned long long)p->n);
        return ZPS_ERR_UNSUPPORTED;
    }
    if (opts->once) {
        p->bpe = (int64_t)((p->n + (uint64_t)opts->batch - 1) / (uint64_t)opts->batch);
        return ZPS_OK;
    }
    p->bpe = (int64_t)(p->n / (uint64_t)opts->batch);
    if (p->bpe == 0) {
        zps_log(ZPS_ERROR, "ds", "%s: trainer %d of %d has %llu records, fewer than a "
                "batch of %d", p->d->dir, opts->trainer_index, opts->n_trainers,
                (unsigned long long)p->n, opts->batch);
        return ZPS_ERR_INVALID;
    }
    return ZPS_OK;
}

/* The ring of p->depth batch slots (images pre-faulted) and the consumer's copies. */
static void s_alloc_slots(ds_pipeline *p)
{
    const size_t batch = (size_t)p->o.batch;
    p->img_floats = (size_t)p->o.channels * p->o.height * p->o.width;
    p->depth = p->o.threads == 0 ? 1 : p->o.prefetch;
    p->slots = zps_xcalloc((size_t)p->depth, sizeof *p->slots);
    for (int i = 0; i < p->depth; i++) {
        s_slot *sl = &p->slots[i];
        sl->images = zps_xaligned(64, batch * p->img_floats * sizeof(float));
        zps_prefault(sl->images, batch * p->img_floats * sizeof(float));
        sl->labels = zps_xmalloc(batch * sizeof *sl->labels);
        sl->ids = zps_xmalloc(batch * sizeof *sl->ids);
        sl->box_start = zps_xmalloc((batch + 1) * sizeof *sl->box_start);
        sl->batch = -1;
    }
    p->cur_ids = zps_xmalloc(batch * sizeof *p->cur_ids);
    p->cur_start = zps_xmalloc((batch + 1) * sizeof *p->cur_start);
}

/* Every worker's state, then (threads > 0) their threads. All workers get their state even
 * when one fails, so ds_pipeline_destroy frees them alike. */
static zps_status s_start_workers(ds_pipeline *p)
{
    zps_status st = ZPS_OK;
    p->n_workers = p->o.threads == 0 ? 1 : p->o.threads;
    p->workers = zps_xcalloc((size_t)p->n_workers, sizeof *p->workers);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->space, NULL);
    pthread_cond_init(&p->ready, NULL);
    for (int i = 0; i < p->n_workers; i++) {
        s_worker *w = &p->workers[i];
        w->p = p;
        w->codec = ds_codec_new();
        w->arena = zps_arena_new(1u << 20);
        w->readers = zps_xcalloc((size_t)p->d->n_shards, sizeof *w->readers);
        w->perm = zps_xmalloc((p->n ? p->n : 1) * sizeof *w->perm);
        w->perm_epoch = -1;
        if (!w->codec)
            st = ZPS_ERR_INTERNAL;
    }
    for (int i = 0; st == ZPS_OK && p->o.threads > 0 && i < p->n_workers; i++) {
        int rc = pthread_create(&p->workers[i].th, NULL, s_worker_main, &p->workers[i]);
        if (rc != 0) {
            zps_log(ZPS_ERROR, "ds", "pthread_create failed: %s", strerror(rc));
            st = ZPS_ERR_SYS;
        } else {
            p->workers[i].started = true;
        }
    }
    return st;
}

zps_status ds_pipeline_new(const ds_pipeline_opts *opts, ds_pipeline **out)
{
    *out = NULL;
    ZPS_TRY(s_check_opts(opts));
    ds_dataset *d;
    ZPS_TRY(ds_dataset_open_flags(opts->path, opts->split,
                                  opts->skip_corrupt ? DS_OPEN_ALLOW_DAMAGED : 0, &d));
    ds_pipeline *p = zps_xcalloc(1, sizeof *p);
    p->o = *opts;
    p->d = d;
    p->num_classes = opts->num_classes > 0 ? opts->num_classes : d->num_classes;
    uint64_t end;
    zps_status st = s_partition(p, &end);
    if (st != ZPS_OK) {
        ds_dataset_close(&p->d);
        free(p);
        return st;
    }
    s_alloc_slots(p);
    st = s_start_workers(p);
    if (st != ZPS_OK) {
        ds_pipeline_destroy(&p);
        return st;
    }
    zps_log(ZPS_DEBUG, "ds", "pipeline %s: trainer %d/%d records [%llu, %llu), %lld batches "
            "of %d per epoch, %d threads", d->dir, opts->trainer_index, opts->n_trainers,
            (unsigned long long)p->begin, (unsigned long long)end, (long long)p->bpe,
            opts->batch, opts->threads);
    *out = p;
    return ZPS_OK;
}

zps_status ds_pipeline_next(ds_pipeline *p, float *images, int32_t *labels,
                            ds_batch_info *info)
{
    assert(p && images && labels); /* API misuse, not an environment failure */
    const int64_t b = p->consumed;
    if (p->o.once && b >= p->bpe)
        return ZPS_ERR_EOF;
    s_slot *sl = &p->slots[b % p->depth];
    if (p->o.threads == 0) {
        s_build(&p->workers[0], b, sl);
    } else {
        pthread_mutex_lock(&p->mu);
        while (!(sl->ready && sl->batch == b))
            pthread_cond_wait(&p->ready, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
    /* Copy out while the slot is still ours. */
    memcpy(images, sl->images, (size_t)sl->count * p->img_floats * sizeof(float));
    memcpy(labels, sl->labels, (size_t)sl->count * sizeof *labels);
    memcpy(p->cur_ids, sl->ids, (size_t)sl->count * sizeof *p->cur_ids);
    memcpy(p->cur_start, sl->box_start, ((size_t)sl->count + 1) * sizeof *p->cur_start);
    int nb = sl->box_start[sl->count];
    if (nb > p->cur_box_cap) {
        p->cur_box_cap = nb * 2;
        p->cur_boxes = zps_xrealloc(p->cur_boxes, (size_t)p->cur_box_cap * sizeof *p->cur_boxes);
    }
    if (nb)
        memcpy(p->cur_boxes, sl->boxes, (size_t)nb * sizeof *p->cur_boxes);
    zps_status st = sl->st;
    if (info) {
        *info = (ds_batch_info){.epoch = b / p->bpe,
                                .index = b % p->bpe,
                                .count = sl->count,
                                .skipped = sl->skipped,
                                .ids = p->cur_ids,
                                .boxes = p->cur_boxes,
                                .box_start = p->cur_start};
    }
    p->skipped_total += sl->skipped;
    if (p->o.threads == 0) {
        p->consumed++;
    } else {
        pthread_mutex_lock(&p->mu);
        sl->ready = false;
        p->consumed++;
        pthread_cond_broadcast(&p->space);
        pthread_mutex_unlock(&p->mu);
    }
    return st;
}

void ds_pipeline_seek(ds_pipeline *p, int64_t b)
{
    assert(p && b >= 0 && !p->o.once);
    if (p->o.threads == 0) {
        p->consumed = b;
        return;
    }
    pthread_mutex_lock(&p->mu);
    /* let the batches claimed so far finish (a worker builds without the lock), then drop
     * them: nobody touches a slot after that until the claims restart at b */
    for (int64_t k = p->consumed; k < p->next_claim; k++) {
        s_slot *sl = &p->slots[k % p->depth];
        while (!(sl->ready && sl->batch == k))
            pthread_cond_wait(&p->ready, &p->mu);
    }
    for (int i = 0; i < p->depth; i++)
        p->slots[i].ready = false;
    p->consumed = p->next_claim = b;
    pthread_cond_broadcast(&p->space);
    pthread_mutex_unlock(&p->mu);
}

void ds_pipeline_destroy(ds_pipeline **pp)
{
    if (!pp || !*pp)
        return;
    ds_pipeline *p = *pp;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->space);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_workers; i++)
        if (p->workers[i].started)
            pthread_join(p->workers[i].th, NULL);
    for (int i = 0; i < p->n_workers; i++)
        s_worker_free(&p->workers[i], p->d->n_shards);
    for (int i = 0; i < p->depth; i++) {
        zps_aligned_free(p->slots[i].images);
        free(p->slots[i].labels);
        free(p->slots[i].ids);
        free(p->slots[i].box_start);
        free(p->slots[i].boxes);
    }
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->space);
    pthread_cond_destroy(&p->ready);
    free(p->slots);
    free(p->workers);
    free(p->cur_ids);
    free(p->cur_start);
    free(p->cur_boxes);
    ds_dataset_close(&p->d);
    free(p);
    *pp = NULL;
}

uint64_t ds_pipeline_records(const ds_pipeline *p) { return p->n; }
int64_t ds_pipeline_batches_per_epoch(const ds_pipeline *p) { return p->bpe; }
int64_t ds_pipeline_skipped(const ds_pipeline *p) { return p->skipped_total; }
int ds_pipeline_num_classes(const ds_pipeline *p) { return p->num_classes; }
