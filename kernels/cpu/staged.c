/* staged.c — the "staged" back-end: cpu's ops behind a device's memory interface
 * (backend.h), so that the CPU suite can prove the trainer's device paths (mirrors, copies,
 * events) on machines without a GPU, bit for bit against the cpu back-end.
 *
 * What makes it a device to its callers:
 *   - host_memory is 0: its tensors are blocks of their own, filled with NaN when allocated
 *     (as device memory is garbage), so a caller that reads a tensor it never copied in, or
 *     that hands the ops a host pointer where it meant a copy, gets NaN or stale values
 *     instead of the right answer by accident;
 *   - the asynchronous copies do not happen when asked for: they wait on their copy queue
 *     (K_QUEUE_IN for copy_in_async, K_QUEUE_OUT for copy_out_async) until something waits
 *     for an event recorded on that queue after them (event_sync by the host, event_wait by
 *     the compute queue or the other copy queue), and only then run, in order. The two copy
 *     queues are independent, as a device's are: a copy-out does not wait for a copy-in
 *     queued before it. The ops, like copy_in/copy_out, run at once (the compute queue never
 *     lags the host), so events on it are always complete.
 *     A caller that reads a host mirror before waiting for its copy-out, writes one before
 *     its copy-in has run, or computes with a tensor whose copy-in it did not wait for, sees
 *     the old data: the latest moment a real device could have copied, which is what the
 *     tests compare against the cpu back-end.
 * The pinned host memory is ordinary aligned memory (also NaN-filled). The queues are guarded
 * by one mutex (a staging thread waits for events while the training thread queues copies)
 * and grow but never shrink, so a step allocates nothing once they have seen their longest
 * backlog.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

/* One held-back copy. */
typedef struct s_copy {
    void *dst;
    const void *src;
    size_t bytes;
    uint64_t seq; // its place in its copy queue (1, 2, ...)
} s_copy;

/* A copy queue: its pending copies [head, tail), oldest first. */
typedef struct s_queue {
    s_copy *q;
    size_t head, tail, cap;
    uint64_t seq; // the last copy queued
} s_queue;

struct k_event {
    int queue;    // where it was recorded
    uint64_t seq; // a copy queue's: the copies it follows (0 on the compute queue)
};

static pthread_mutex_t s_mu = PTHREAD_MUTEX_INITIALIZER;
static s_queue s_in, s_out; // K_QUEUE_IN, K_QUEUE_OUT

static s_queue *s_copies(int queue)
{
    return queue == K_QUEUE_IN ? &s_in : queue == K_QUEUE_OUT ? &s_out : NULL;
}

static void *s_alloc_nan(size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return NULL;
    memset(p, 0xff, bytes); /* all ones: a quiet NaN in every float */
    return p;
}
static void s_free(void *p) { free(p); }

/* Runs q's queued copies up to and including number seq (under s_mu). */
static void s_run_until(s_queue *q, uint64_t seq)
{
    while (q->head < q->tail && q->q[q->head].seq <= seq) {
        memcpy(q->q[q->head].dst, q->q[q->head].src, q->q[q->head].bytes);
        q->head++;
    }
    if (q->head == q->tail)
        q->head = q->tail = 0;
}

static zps_status s_queue_copy(s_queue *q, void *dst, const void *src, size_t bytes)
{
    pthread_mutex_lock(&s_mu);
    if (q->tail == q->cap && q->head > 0) { /* slide the pending copies to the front */
        memmove(q->q, q->q + q->head, (q->tail - q->head) * sizeof *q->q);
        q->tail -= q->head;
        q->head = 0;
    }
    if (q->tail == q->cap) {
        size_t cap = q->cap ? 2 * q->cap : 256;
        s_copy *grown = realloc(q->q, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&s_mu);
            return ZPS_ERR_NOMEM;
        }
        q->q = grown, q->cap = cap;
    }
    q->q[q->tail++] = (s_copy){.dst = dst, .src = src, .bytes = bytes, .seq = ++q->seq};
    pthread_mutex_unlock(&s_mu);
    return ZPS_OK;
}
static zps_status s_copy_in_async(void *dst, const void *src, size_t bytes)
{
    return s_queue_copy(&s_in, dst, src, bytes);
}
static zps_status s_copy_out_async(void *dst, const void *src, size_t bytes)
{
    return s_queue_copy(&s_out, dst, src, bytes);
}

static zps_status s_event_new(k_event **out)
{
    *out = calloc(1, sizeof **out);
    return *out ? ZPS_OK : ZPS_ERR_NOMEM;
}
static void s_event_free(k_event *e) { free(e); }

static zps_status s_event_record(k_event *e, int queue)
{
    pthread_mutex_lock(&s_mu);
    s_queue *q = s_copies(queue);
    e->queue = queue;
    e->seq = q ? q->seq : 0;
    pthread_mutex_unlock(&s_mu);
    return ZPS_OK;
}

/* The host waiting for a copy queue's point makes its copies up to there happen now; a point
 * of the compute queue is complete already (the ops ran at once). */
static zps_status s_event_sync(k_event *e)
{
    pthread_mutex_lock(&s_mu);
    s_queue *q = s_copies(e->queue);
    if (q)
        s_run_until(q, e->seq);
    pthread_mutex_unlock(&s_mu);
    return ZPS_OK;
}
/* A queue waiting for a copy queue's point makes that point happen now too: the compute
 * queue runs at once, and a copy queue's later copies, which run no sooner than this, then
 * follow it as on a device. Waiting for the compute queue waits for nothing. */
static zps_status s_event_wait(int queue, k_event *e)
{
    (void)queue;
    return s_event_sync(e);
}

static k_backend s_staged;
static void s_init(void)
{
    s_staged = *k_backend_cpu();
    s_staged.name = "staged";
    s_staged.host_memory = 0;
    s_staged.alloc = s_alloc_nan;
    s_staged.free = s_free;
    /* copy_in/copy_out stay cpu's (ref's memmove): copies on the compute queue, at once */
    s_staged.host_alloc = s_alloc_nan;
    s_staged.host_free = s_free;
    s_staged.copy_in_async = s_copy_in_async;
    s_staged.copy_out_async = s_copy_out_async;
    s_staged.event_new = s_event_new;
    s_staged.event_free = s_event_free;
    s_staged.event_record = s_event_record;
    s_staged.event_wait = s_event_wait;
    s_staged.event_sync = s_event_sync;
}

const k_backend *k_backend_staged(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, s_init);
    return &s_staged;
}
