/* staged.c — the "staged" back-end: cpu's ops behind a device's memory interface
 * (backend.h), so that the CPU suite can prove the trainer's device paths (mirrors, copies,
 * events) on machines without a GPU, bit for bit against the cpu back-end.
 *
 * What makes it a device to its callers:
 *   - host_memory is 0: its tensors are blocks of their own, filled with NaN when allocated
 *     (as device memory is garbage), so a caller that reads a tensor it never copied in, or
 *     that hands the ops a host pointer where it meant a copy, gets NaN or stale values
 *     instead of the right answer by accident;
 *   - the asynchronous copies do not happen when asked for: they wait on the copy queue until
 *     something waits for an event recorded after them (event_sync by the host, event_wait by
 *     the compute queue), and only then run, in order. The ops, like copy_in/copy_out, run at
 *     once (the compute queue never lags the host), so events on it are always complete.
 *     A caller that reads a host mirror before waiting for its copy-out, writes one before
 *     its copy-in has run, or computes with a tensor whose copy-in it did not wait for, sees
 *     the old data: the latest moment a real device could have copied, which is what the
 *     tests compare against the cpu back-end.
 * The pinned host memory is ordinary aligned memory (also NaN-filled). The queue is guarded by
 * a mutex (a staging thread waits for events while the training thread queues copies) and
 * grows but never shrinks, so a step allocates nothing once the queue has seen its longest
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
    uint64_t seq; // its place in the copy queue (1, 2, ...)
} s_copy;

struct k_event {
    int queue;    // where it was recorded
    uint64_t seq; // copy queue: the copies it follows (0: recorded on the compute queue)
};

static pthread_mutex_t s_mu = PTHREAD_MUTEX_INITIALIZER;
static s_copy *s_q;          // pending copies [s_head, s_tail), oldest first
static size_t s_head, s_tail, s_cap;
static uint64_t s_seq;       // the last copy queued

static void *s_alloc_nan(size_t bytes)
{
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0)
        return NULL;
    memset(p, 0xff, bytes); /* all ones: a quiet NaN in every float */
    return p;
}
static void s_free(void *p) { free(p); }

/* Runs the queued copies up to and including number seq (under s_mu). */
static void s_run_until(uint64_t seq)
{
    while (s_head < s_tail && s_q[s_head].seq <= seq) {
        memcpy(s_q[s_head].dst, s_q[s_head].src, s_q[s_head].bytes);
        s_head++;
    }
    if (s_head == s_tail)
        s_head = s_tail = 0;
}

static zps_status s_copy_async(void *dst, const void *src, size_t bytes)
{
    pthread_mutex_lock(&s_mu);
    if (s_tail == s_cap && s_head > 0) { /* slide the pending copies to the front */
        memmove(s_q, s_q + s_head, (s_tail - s_head) * sizeof *s_q);
        s_tail -= s_head;
        s_head = 0;
    }
    if (s_tail == s_cap) {
        size_t cap = s_cap ? 2 * s_cap : 256;
        s_copy *q = realloc(s_q, cap * sizeof *q);
        if (!q) {
            pthread_mutex_unlock(&s_mu);
            return ZPS_ERR_NOMEM;
        }
        s_q = q, s_cap = cap;
    }
    s_q[s_tail++] = (s_copy){.dst = dst, .src = src, .bytes = bytes, .seq = ++s_seq};
    pthread_mutex_unlock(&s_mu);
    return ZPS_OK;
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
    e->queue = queue;
    e->seq = queue == K_QUEUE_COPY ? s_seq : 0;
    pthread_mutex_unlock(&s_mu);
    return ZPS_OK;
}

/* The copy queue waiting for the compute queue waits for nothing (the ops ran at once); the
 * compute queue waiting for a copy, or the host waiting for one, makes it happen now. */
static zps_status s_event_sync(k_event *e)
{
    pthread_mutex_lock(&s_mu);
    s_run_until(e->seq);
    pthread_mutex_unlock(&s_mu);
    return ZPS_OK;
}
static zps_status s_event_wait(int queue, k_event *e)
{
    return queue == K_QUEUE_COMPUTE ? s_event_sync(e) : ZPS_OK;
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
    s_staged.copy_in_async = s_copy_async;
    s_staged.copy_out_async = s_copy_async;
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
