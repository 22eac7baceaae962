/* input.c — a trainer's training batches (see input.h).
 *
 * Invariants (device back-ends):
 *  - Pair k (host[k], dev[k]) holds at most one batch. Its host buffer is written by a read
 *    only after the copy that last read it ran: s_read waits for that copy's event (free in
 *    steady state, where the copy fed a forward whose loss the host has seen; not after a
 *    seek, which drops a read-ahead whose copy may still be queued). Its device buffer is
 *    written by a copy only after the compute queue's point `used[k]`, recorded after the backward of the
 *    batch it last held.
 *  - `ahead` says that pair `cur` already holds the next batch, copy queued.
 */
#include "trainer/input.h"

#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "common/mem.h"
#include "kernels/kernels.h"

struct tr_input {
    ds_pipeline *p;           // borrowed
    nn_model *m;              // borrowed
    const k_backend *be;      // the model's
    int dev;                  // be has queues: two pairs of buffers, copies ahead
    int offset, batch;
    size_t sample_floats;
    float *host[2];           // (read_batch, c, h, w) each; pinned on a device; one on a host
    int32_t *labels;          // (read_batch) of the last read
    float *devx[2];           // (batch, c, h, w) each, device memory
    k_event *in[2];           // pair k's copy is done
    k_event *used[2];         // pair k's device buffer was last read before this point
    int cur;                  // the pair of the current (or fetched-ahead) batch
    int ahead;                // pair cur holds the next batch already
    tr_task_batch next;       // that batch
    int64_t skip_corrupt, skipped;
};

/* A read from the pipeline into pair k; *b is this trainer's slice. */
static zps_status s_read(tr_input *in, int k, tr_task_batch *b, int64_t step)
{
    ds_batch_info info;
    if (in->dev) /* the copy that last read host[k] has left it (above) */
        ZPS_TRY(in->be->event_sync(in->in[k]));
    zps_status st = ds_pipeline_next(in->p, in->host[k], in->labels, &info);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "trainer", "reading training data: %s%s", zps_strerror(st),
                st == ZPS_ERR_CORRUPT && !in->skip_corrupt
                    ? " (--skip-corrupt N skips up to N such records)"
                    : "");
        return st;
    }
    if (info.skipped) {
        in->skipped += info.skipped;
        if (in->skipped > in->skip_corrupt) {
            zps_log(ZPS_ERROR, "trainer", "%lld corrupt training records, more than "
                    "--skip-corrupt %lld", (long long)in->skipped, (long long)in->skip_corrupt);
            return ZPS_ERR_CORRUPT;
        }
        zps_log(ZPS_WARN, "trainer", "step %lld: skipped %lld corrupt training record(s), %lld "
                "of at most %lld so far", (long long)step, (long long)info.skipped,
                (long long)in->skipped, (long long)in->skip_corrupt);
    }
    size_t off = (size_t)in->offset;
    *b = (tr_task_batch){.x = in->host[k] + off * in->sample_floats, .labels = in->labels + off,
                         .boxes = info.boxes, .box_start = info.box_start + off,
                         .n = in->batch};
    if (!in->dev)
        return ZPS_OK;
    /* its copy after the last reader of the device buffer, on the host-to-device queue
     * (never behind the gradients going down) */
    ZPS_TRY(in->be->event_wait(K_QUEUE_IN, in->used[k]));
    ZPS_TRY(in->be->copy_in_async(in->devx[k], b->x,
                                  (size_t)in->batch * in->sample_floats * sizeof(float)));
    return in->be->event_record(in->in[k], K_QUEUE_IN);
}

zps_status tr_input_next(tr_input *in, tr_task_batch *b, int64_t step)
{
    if (in->ahead) {
        *b = in->next;
        in->ahead = 0;
    } else {
        ZPS_TRY(s_read(in, in->cur, b, step));
    }
    if (!in->dev) {
        nn_model_set_input(in->m, b->x);
        return ZPS_OK;
    }
    ZPS_TRY(in->be->event_wait(K_QUEUE_COMPUTE, in->in[in->cur]));
    nn_model_set_input(in->m, in->devx[in->cur]);
    return ZPS_OK;
}

zps_status tr_input_done(tr_input *in, int last, int64_t step)
{
    if (!in->dev)
        return ZPS_OK;
    ZPS_TRY(in->be->event_record(in->used[in->cur], K_QUEUE_COMPUTE));
    in->cur ^= 1;
    if (last)
        return ZPS_OK;
    ZPS_TRY(s_read(in, in->cur, &in->next, step + 1));
    in->ahead = 1;
    return ZPS_OK;
}

void tr_input_seek(tr_input *in, int64_t batches)
{
    in->ahead = 0;
    ds_pipeline_seek(in->p, batches);
}

int64_t tr_input_skipped(const tr_input *in) { return in->skipped; }

void tr_input_destroy(tr_input **pin)
{
    tr_input *in = *pin;
    if (!in)
        return;
    for (int k = 0; k < 2 && in->dev; k++) {
        in->be->host_free(in->host[k]);
        in->be->free(in->devx[k]);
        in->be->event_free(in->in[k]);
        in->be->event_free(in->used[k]);
    }
    if (!in->dev) /* one buffer, both pairs' */
        zps_aligned_free(in->host[0]);
    free(in->labels);
    free(in);
    *pin = NULL;
}

/* Pinned host and device buffers, events; the device buffers' "last used" points at the
 * start, when nothing has used them. */
static zps_status s_device_buffers(tr_input *in, size_t host_bytes)
{
    const k_backend *be = in->be;
    size_t dev_bytes = (size_t)in->batch * in->sample_floats * sizeof(float);
    for (int k = 0; k < 2; k++) {
        in->host[k] = be->host_alloc(host_bytes);
        in->devx[k] = be->alloc(dev_bytes);
        if (!in->host[k] || !in->devx[k]) {
            zps_log(ZPS_ERROR, "trainer", "cannot allocate two batches (%zu MiB pinned, %zu MiB "
                    "on the %s back-end)", host_bytes >> 20, dev_bytes >> 20, be->name);
            return ZPS_ERR_NOMEM;
        }
        ZPS_TRY(be->event_new(&in->in[k]));
        ZPS_TRY(be->event_new(&in->used[k]));
        ZPS_TRY(be->event_record(in->used[k], K_QUEUE_COMPUTE));
    }
    return ZPS_OK;
}

zps_status tr_input_new(ds_pipeline *p, nn_model *m, int read_batch, size_t sample_floats,
                        int offset, int batch, int64_t skip_corrupt, tr_input **out)
{
    tr_input *in = zps_xcalloc(1, sizeof *in);
    *in = (tr_input){.p = p, .m = m, .be = nn_model_backend(m), .offset = offset,
                     .batch = batch, .sample_floats = sample_floats,
                     .skip_corrupt = skip_corrupt};
    in->dev = k_backend_async(in->be);
    in->labels = zps_xcalloc((size_t)read_batch, sizeof *in->labels);
    size_t host_bytes = (size_t)read_batch * sample_floats * sizeof(float);
    zps_status st = ZPS_OK;
    if (in->dev)
        st = s_device_buffers(in, host_bytes);
    else
        in->host[0] = in->host[1] = zps_xaligned(64, host_bytes);
    if (st != ZPS_OK) {
        tr_input_destroy(&in);
        return st;
    }
    *out = in;
    return ZPS_OK;
}
