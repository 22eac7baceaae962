/* allreduce.c — shared-memory reduce-scatter + all-gather between the processes of one node
 * (see allreduce.h for the algorithm and its invariants). The NCCL wrapper for GPUs is
 * allreduce_nccl.c.
 *
 * Segment layout (one shm object per job, mapped by every rank):
 *     tr_ar_header (geometry, attach counter, per-rank control block with progress counters;
 *                  allreduce_int.h)
 *     input ring:  n_ranks x ring slots of slice_floats  (slot (r, k): written only by rank r)
 *     output ring: ring slots of slice_floats            (part p of a slot: written by rank p)
 * Slices are numbered by a 32-bit sequence shared by all ranks (every call is collective, so
 * every rank counts the same); slice g uses slot g % ring. Counters compare with wrap-around
 * arithmetic, so the sequence may overflow. Creating, joining and leaving the segment is
 * allreduce_attach.c's job; this file waits, watches liveness and moves the data.
 *
 * Per slice g, rank r does three phases (s_run interleaves them over slices as they become
 * ready):
 *   copy:   wait until every rank has gathered slice g - ring (slots free); copy its part of
 *           buf into input slot (r, g % ring); copied[r] = g + 1
 *   reduce: wait until copied[*] >= g + 1; output[part r] = in[0] + in[1] + ... (rank order);
 *           also into buf; reduced[r] = g + 1
 *   gather: wait until reduced[*] >= g + 1; copy the other parts of the output slot into buf;
 *           gathered[r] = g + 1
 * Output slot k is reused for slice g only after every rank gathered slice g - ring: a
 * reducer of slice g waited for every copy of slice g, and each copy waited for that.
 * With an apply callback (tr_allreduce_sum_apply) the reducer hands its part to it right
 * after writing it into buf, and the gatherer each part it copied, so the caller's update
 * reads the result from cache instead of making another pass over buf.
 */
#include "trainer/allreduce.h"
#include "trainer/allreduce_int.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"

#define S_SPIN_NS 100000          // busy-wait (with yields) before sleeping in the kernel
#define S_PURE_SPIN_NS 5000       // pure spin before the first yield

/* ---------------------------------------------------------------- futex and liveness */

static int s_after_or_eq(uint32_t a, uint32_t b) { return (int32_t)(a - b) >= 0; }

int tr_ar_peer_alive(tr_ar_header *h, int i)
{
    tr_ar_rank_ctl *c = &h->ranks[i];
    if (atomic_load(&c->gone))
        return 0;
    int rc = pthread_mutex_trylock(&c->alive);
    if (rc == EBUSY)
        return 1;
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(&c->alive);
        pthread_mutex_unlock(&c->alive);
    } else if (rc == 0) {
        pthread_mutex_unlock(&c->alive); // not held: the rank detached
    }
    atomic_store(&c->gone, 1);
    return 0;
}

/* Marks this object and the whole job broken, and wakes every sleeper so all ranks stop. */
void tr_ar_fail_job(tr_ar_header *h, int rank, int n_ranks)
{
    uint32_t zero = 0;
    atomic_compare_exchange_strong(&h->failed.v, &zero, (uint32_t)rank + 1);
    for (int i = 0; i < n_ranks; i++)
        for (int c = 0; c < TR_AR_NCOUNTERS; c++)
            tr_ar_futex(&h->ranks[i].ctr[c].v, FUTEX_WAKE, INT_MAX, NULL);
}

static void s_fail(tr_allreduce *ar)
{
    ar->broken = 1;
    tr_ar_fail_job(ar->hdr, ar->rank, ar->n_ranks);
}

/* Waits until *word >= target (wrap-around order); the word belongs to rank `peer`. */
static zps_status s_wait_word(tr_allreduce *ar, _Atomic uint32_t *word, uint32_t target,
                              int peer, const char *what)
{
    uint32_t v = atomic_load_explicit(word, memory_order_acquire);
    if (s_after_or_eq(v, target))
        return ZPS_OK;
    /* Busy-wait first: the peer usually runs on the other core and finishes within
     * microseconds, and waking a sleeping (possibly halted, virtual) CPU costs far more. After
     * a short pure spin, yield between checks, so a peer queued on this very core runs at
     * once. Only then sleep in the kernel. */
    uint64_t t0 = zps_now_ns(), spin_end = t0 + S_SPIN_NS, pure_end = t0 + S_PURE_SPIN_NS;
    for (unsigned k = 1;; k++) {
        if (k < 64 || (k & 15) || zps_now_ns() < pure_end)
            __builtin_ia32_pause();
        else
            sched_yield();
        v = atomic_load_explicit(word, memory_order_acquire);
        if (s_after_or_eq(v, target))
            return ZPS_OK;
        if ((k & 63) == 0 && zps_now_ns() > spin_end)
            break;
    }
    tr_ar_header *h = ar->hdr;
    uint64_t deadline = t0 + (uint64_t)ar->timeout_ms * 1000000ull;
    for (;;) {
        atomic_fetch_add(&h->sleepers.v, 1);
        v = atomic_load(word);
        if (!s_after_or_eq(v, target)) {
            struct timespec ts = {0, TR_AR_FUTEX_SLICE_NS};
            tr_ar_futex(word, FUTEX_WAIT, v, &ts); // EAGAIN/ETIMEDOUT/EINTR: all recheck
            v = atomic_load(word);
        }
        atomic_fetch_sub(&h->sleepers.v, 1);
        if (s_after_or_eq(v, target))
            return ZPS_OK;
        uint32_t failed = atomic_load(&h->failed.v);
        if (failed) {
            zps_log(ZPS_ERROR, "allreduce", "rank %d: rank %u found the job broken; giving up",
                    ar->rank, failed - 1);
            ar->broken = 1;
            return ZPS_ERR_TIMEOUT;
        }
        /* every peer, not only the awaited one: with 3+ ranks the awaited one may itself be
         * stuck behind the dead one */
        for (int i = 0; i < ar->n_ranks; i++) {
            if (i == ar->rank || tr_ar_peer_alive(h, i))
                continue;
            if (i == peer && s_after_or_eq(atomic_load(word), target))
                return ZPS_OK;
            zps_log(ZPS_ERROR, "allreduce",
                    "rank %d: peer rank %d (pid %d) died or left while we waited for the %s "
                    "of rank %d (slice %u)",
                    ar->rank, i, (int)atomic_load(&h->ranks[i].pid), what, peer, target - 1);
            s_fail(ar);
            return ZPS_ERR_TIMEOUT;
        }
        if (zps_now_ns() > deadline) {
            zps_log(ZPS_ERROR, "allreduce",
                    "rank %d: peer rank %d (pid %d) alive but silent for %d ms (waiting for "
                    "its %s of slice %u)",
                    ar->rank, peer, (int)atomic_load(&h->ranks[peer].pid), ar->timeout_ms, what,
                    target - 1);
            s_fail(ar);
            return ZPS_ERR_TIMEOUT;
        }
    }
}

static const char *s_counter_name[TR_AR_NCOUNTERS] = {"copy", "reduction", "gather"};

/* Waits until counter `which` of every rank is >= target. */
static zps_status s_wait_all(tr_allreduce *ar, int which, uint32_t target)
{
    for (int i = 0; i < ar->n_ranks; i++)
        ZPS_TRY(s_wait_word(ar, &ar->hdr->ranks[i].ctr[which].v, target, i,
                            s_counter_name[which]));
    return ZPS_OK;
}
/* ---------------------------------------------------------------- the data path */

static float *s_in_slot(tr_allreduce *ar, int r, uint32_t g)
{
    return ar->in + ((size_t)r * (size_t)ar->ring + g % (uint32_t)ar->ring) * ar->slice;
}

static float *s_out_slot(tr_allreduce *ar, uint32_t g)
{
    return ar->outr + (size_t)(g % (uint32_t)ar->ring) * ar->slice;
}

/* Part p of a slice of len floats: [*lo, *hi), 64-byte aligned starts, possibly empty. */
static void s_part(size_t len, int n_ranks, int p, size_t *lo, size_t *hi)
{
    size_t q = (len + (size_t)n_ranks - 1) / (size_t)n_ranks;
    q = (q + TR_AR_ALIGN_FLOATS - 1) / TR_AR_ALIGN_FLOATS * TR_AR_ALIGN_FLOATS;
    size_t a = (size_t)p * q, b = a + q;
    *lo = a < len ? a : len;
    *hi = b < len ? b : len;
}

/* 16 floats, one cache line; parts and slots are 64-byte aligned, so whole-line loads are
 * aligned. GCC lowers the vector type to whatever the target has (SSE without -march). */
typedef float s_v16 __attribute__((vector_size(64), aligned(64)));

/* dst = src[0] + src[1] + ... + src[n-1] in that order (then / n when average). All pointers
 * 64-byte aligned. The per-element order is the same as the scalar loop's, so vector and
 * tail elements round identically. */
static void s_reduce(float *restrict dst, float *const *src, int n, size_t len, int average)
{
    size_t nv = len / 16, j;
    s_v16 *d = (s_v16 *)dst;
    const s_v16 *a = (const s_v16 *)src[0];
    if (n == 1) {
        memcpy(dst, src[0], len * sizeof *dst);
    } else {
        const s_v16 *b = (const s_v16 *)src[1];
        for (j = 0; j < nv; j++)
            d[j] = a[j] + b[j];
        for (j = nv * 16; j < len; j++)
            dst[j] = src[0][j] + src[1][j];
        for (int i = 2; i < n; i++) {
            const s_v16 *c = (const s_v16 *)src[i];
            for (j = 0; j < nv; j++)
                d[j] += c[j];
            for (j = nv * 16; j < len; j++)
                dst[j] += src[i][j];
        }
    }
    if (average) {
        float fn = (float)n;
        s_v16 dv = {fn, fn, fn, fn, fn, fn, fn, fn, fn, fn, fn, fn, fn, fn, fn, fn};
        for (j = 0; j < nv; j++)
            d[j] /= dv;
        for (j = nv * 16; j < len; j++)
            dst[j] /= fn;
    }
}

static size_t s_slice_len(tr_allreduce *ar, size_t n, uint32_t t)
{
    size_t off = (size_t)t * ar->slice;
    return n - off < ar->slice ? n - off : ar->slice;
}

/* First rank whose counter `which` is below target, or -1 when all reached it. */
static int s_lagging(tr_allreduce *ar, int which, uint32_t target)
{
    for (int i = 0; i < ar->n_ranks; i++)
        if (!s_after_or_eq(atomic_load_explicit(&ar->hdr->ranks[i].ctr[which].v,
                                                memory_order_acquire),
                           target))
            return i;
    return -1;
}

static void s_copy_in(tr_allreduce *ar, const float *buf, size_t n, uint32_t base, uint32_t t)
{
    uint32_t g = base + t;
    size_t len = s_slice_len(ar, n, t);
    if (len)
        memcpy(s_in_slot(ar, ar->rank, g), buf + (size_t)t * ar->slice, len * sizeof(float));
    tr_ar_publish(ar->hdr, &ar->hdr->ranks[ar->rank].ctr[TR_AR_COPIED].v, g + 1);
}

static void s_reduce_part(tr_allreduce *ar, float *buf, size_t n, uint32_t base, uint32_t t,
                          int average)
{
    uint32_t g = base + t;
    size_t len = s_slice_len(ar, n, t), lo, hi;
    s_part(len, ar->n_ranks, ar->rank, &lo, &hi);
    float *part = buf + (size_t)t * ar->slice + lo;
    if (hi > lo) {
        float *src[TR_AR_MAX_RANKS] = {0};
        for (int i = 0; i < ar->n_ranks; i++)
            src[i] = s_in_slot(ar, i, g) + lo;
        float *out = s_out_slot(ar, g) + lo;
        s_reduce(out, src, ar->n_ranks, hi - lo, average);
        memcpy(part, out, (hi - lo) * sizeof(float));
    }
    tr_ar_publish(ar->hdr, &ar->hdr->ranks[ar->rank].ctr[TR_AR_REDUCED].v, g + 1);
    /* after the publication: the peers gather while this rank applies its own copy */
    if (ar->apply && hi > lo)
        ar->apply(ar->apply_ctx, part, hi - lo);
}

static void s_gather(tr_allreduce *ar, float *buf, size_t n, uint32_t base, uint32_t t)
{
    uint32_t g = base + t;
    size_t len = s_slice_len(ar, n, t), lo, hi;
    float *out = s_out_slot(ar, g), *dst = buf + (size_t)t * ar->slice;
    for (int p = 0; p < ar->n_ranks; p++) {
        if (p == ar->rank)
            continue;
        s_part(len, ar->n_ranks, p, &lo, &hi);
        if (hi > lo)
            memcpy(dst + lo, out + lo, (hi - lo) * sizeof(float));
    }
    tr_ar_publish(ar->hdr, &ar->hdr->ranks[ar->rank].ctr[TR_AR_GATHERED].v, g + 1);
    /* after the publication (the slot is free again): the parts are in buf, and in cache */
    for (int p = 0; ar->apply && p < ar->n_ranks; p++) {
        s_part(len, ar->n_ranks, p, &lo, &hi);
        if (p != ar->rank && hi > lo)
            ar->apply(ar->apply_ctx, dst + lo, hi - lo);
    }
}

/* Runs ns slices (ns >= 1). Each pass does every phase whose inputs are ready — gathers
 * first (they free slots), then reductions, then copies up to a ring ahead — and blocks only
 * when nothing is ready, on the oldest unmet condition. When the ranks share a core, one
 * scheduling quantum thus moves up to a ring of slices instead of one. No deadlock: a peer's
 * reduction of slice g needs only copies we made before reducing g ourselves, and its copy
 * of slice g needs our gather of g - ring, which precedes any wait of ours on slice g. */
static zps_status s_run(tr_allreduce *ar, float *buf, size_t n, uint32_t ns, int average)
{
    uint32_t base = ar->seq, nc = 0, nr = 0, ng = 0, ring = (uint32_t)ar->ring;
    while (ng < ns) {
        int progress = 0, lag;
        while (ng < nr && s_lagging(ar, TR_AR_REDUCED, base + ng + 1) < 0) {
            s_gather(ar, buf, n, base, ng++);
            progress = 1;
        }
        while (nr < nc && s_lagging(ar, TR_AR_COPIED, base + nr + 1) < 0) {
            s_reduce_part(ar, buf, n, base, nr++, average);
            progress = 1;
        }
        while (nc < ns && nc < ng + ring &&
               s_lagging(ar, TR_AR_GATHERED, base + nc + 1u - ring) < 0) {
            s_copy_in(ar, buf, n, base, nc++);
            progress = 1;
        }
        if (progress)
            continue;
        if (ng < nr) {
            uint32_t tg = base + ng + 1;
            if ((lag = s_lagging(ar, TR_AR_REDUCED, tg)) >= 0)
                ZPS_TRY(s_wait_word(ar, &ar->hdr->ranks[lag].ctr[TR_AR_REDUCED].v, tg, lag,
                                    "reduction"));
        } else if (nr < nc) {
            uint32_t tg = base + nr + 1;
            if ((lag = s_lagging(ar, TR_AR_COPIED, tg)) >= 0)
                ZPS_TRY(s_wait_word(ar, &ar->hdr->ranks[lag].ctr[TR_AR_COPIED].v, tg, lag, "copy"));
        } else {
            uint32_t tg = base + nc + 1u - ring;
            if ((lag = s_lagging(ar, TR_AR_GATHERED, tg)) >= 0)
                ZPS_TRY(s_wait_word(ar, &ar->hdr->ranks[lag].ctr[TR_AR_GATHERED].v, tg, lag,
                                    "gather"));
        }
    }
    ar->seq = base + ns;
    return ZPS_OK;
}

static zps_status s_usable(tr_allreduce *ar)
{
    if (ar->broken) {
        zps_log(ZPS_ERROR, "allreduce", "rank %d: an earlier call failed; the job is broken",
                ar->rank);
        return ZPS_ERR_TIMEOUT;
    }
    return ZPS_OK;
}

zps_status tr_allreduce_sum(tr_allreduce *ar, float *buf, size_t n, int average)
{
    return tr_allreduce_sum_apply(ar, buf, n, average, NULL, NULL);
}

zps_status tr_allreduce_sum_apply(tr_allreduce *ar, float *buf, size_t n, int average,
                                  tr_allreduce_apply_fn fn, void *ctx)
{
    ZPS_TRY(s_usable(ar));
    if (n > ar->max_floats || (n && !buf)) {
        zps_log(ZPS_ERROR, "allreduce", "sum of %zu floats, max_floats is %zu", n,
                ar->max_floats);
        return ZPS_ERR_INVALID;
    }
    if (n == 0)
        return ZPS_OK;
    ar->apply = fn, ar->apply_ctx = ctx;
    zps_status st = s_run(ar, buf, n, (uint32_t)((n + ar->slice - 1) / ar->slice), average);
    ar->apply = NULL, ar->apply_ctx = NULL;
    return st;
}

zps_status tr_allreduce_barrier(tr_allreduce *ar)
{
    ZPS_TRY(s_usable(ar));
    return s_run(ar, NULL, 0, 1, 0); // one empty slice: every phase waits for every rank
}

zps_status tr_allreduce_broadcast(tr_allreduce *ar, void *buf, size_t bytes, int root)
{
    ZPS_TRY(s_usable(ar));
    if (root < 0 || root >= ar->n_ranks || bytes > ar->max_floats * sizeof(float) ||
        (bytes && !buf)) {
        zps_log(ZPS_ERROR, "allreduce", "broadcast of %zu bytes from rank %d: invalid", bytes,
                root);
        return ZPS_ERR_INVALID;
    }
    size_t sb = ar->slice * sizeof(float);
    uint32_t ns = (uint32_t)((bytes + sb - 1) / sb);
    tr_ar_header *h = ar->hdr;
    tr_ar_rank_ctl *me = &h->ranks[ar->rank];
    for (uint32_t t = 0; t < ns; t++) {
        uint32_t g = ar->seq + t;
        size_t off = (size_t)t * sb, len = bytes - off < sb ? bytes - off : sb;
        char *slot = (char *)s_in_slot(ar, root, g);
        if (ar->rank == root) {
            ZPS_TRY(s_wait_all(ar, TR_AR_GATHERED, g + 1u - (uint32_t)ar->ring));
            memcpy(slot, (char *)buf + off, len);
        } else {
            ZPS_TRY(s_wait_word(ar, &h->ranks[root].ctr[TR_AR_COPIED].v, g + 1, root, "copy"));
            memcpy((char *)buf + off, slot, len);
        }
        tr_ar_publish(h, &me->ctr[TR_AR_COPIED].v, g + 1);
        tr_ar_publish(h, &me->ctr[TR_AR_REDUCED].v, g + 1);
        tr_ar_publish(h, &me->ctr[TR_AR_GATHERED].v, g + 1);
    }
    ar->seq += ns;
    return ZPS_OK;
}
