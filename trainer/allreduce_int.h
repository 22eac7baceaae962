/* allreduce_int.h — the shared-memory segment of trainer/allreduce.c, private to the files
 * that use it: allreduce.c (waiting, liveness and the data path), allreduce_attach.c
 * (creating, joining and leaving the segment) and allreduce_nccl.c (NCCL's watchdog reads
 * the peers' liveness and marks the job failed). See allreduce.c for the layout and the phases
 * of a slice, allreduce.h for the invariants.
 */
#ifndef ZPS_TRAINER_ALLREDUCE_INT_H
#define ZPS_TRAINER_ALLREDUCE_INT_H

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "trainer/allreduce.h"

#define TR_AR_MAGIC 0x7a70732d61723031ull // "zps-ar01"
#define TR_AR_MAX_RANKS 64
#define TR_AR_ALIGN_FLOATS 16         // parts start on 64-byte lines (no false sharing)
#define TR_AR_FUTEX_SLICE_NS 20000000 // futex naps between liveness checks: 20 ms

/* The progress counters of a rank: slices copied in, reduced, gathered. */
enum { TR_AR_COPIED = 0, TR_AR_REDUCED = 1, TR_AR_GATHERED = 2, TR_AR_NCOUNTERS = 3 };

/* One futex word alone on its cache line. */
typedef struct tr_ar_word {
    _Atomic uint32_t v;
    char pad[60];
} tr_ar_word;

/* One rank's control block. */
typedef struct tr_ar_rank_ctl {
    tr_ar_word ctr[TR_AR_NCOUNTERS]; // progress counters (slices done), written only by this rank
    pthread_mutex_t alive;           // robust, process-shared; held by the rank while attached
    _Atomic int32_t pid;             // 0: slot never used
    _Atomic int32_t gone;            // set by whoever found the holder dead or detached
} __attribute__((aligned(64))) tr_ar_rank_ctl;

/* The start of the segment; the rings follow it (allreduce.c, "Segment layout"). */
typedef struct tr_ar_header {
    _Atomic uint64_t magic; // TR_AR_MAGIC once initialised (stored last)
    uint32_t n_ranks;       // geometry: all must agree
    uint32_t ring;          // slots in each ring
    uint64_t slice_floats;  // floats per slot
    uint64_t bytes;         // whole segment
    tr_ar_word attached;    // ranks that registered (futex word)
    tr_ar_word sleepers;    // waiters inside FUTEX_WAIT; wakers skip the syscall when 0
    tr_ar_word failed;      // 1 + rank that found the job broken (0: fine); all waits end
    tr_ar_rank_ctl ranks[TR_AR_MAX_RANKS];
} tr_ar_header;

/* One rank's handle (allreduce.h's opaque type). */
struct tr_allreduce {
    char name[96];       // "/zps-ar-<job>"
    int rank;            // this process
    int n_ranks;         // ranks in the job
    int ring;            // slots per ring
    size_t slice;        // floats per slot
    size_t max_floats;   // bound on n
    int timeout_ms;      // per wait
    int broken;          // a peer failed: every later call fails
    int registered;      // this rank holds a slot of the segment under the name
    int unlinked;        // all attached, so the name is gone: destroy must not unlink it
                         // (a new segment of the same name may have taken it since)
    uint32_t seq;        // next slice number (identical on every rank)
    tr_ar_header *hdr;   // the mapping
    size_t bytes;        // its length
    float *in;           // input ring: (n_ranks, ring, slice)
    float *outr;         // output ring: (ring, slice)
    tr_allreduce_apply_fn apply; // during tr_allreduce_sum_apply: the callback, else NULL
    void *apply_ctx;
};

static inline long tr_ar_futex(_Atomic uint32_t *addr, int op, uint32_t val,
                               const struct timespec *ts)
{
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

/* Publishes a counter and wakes whoever sleeps on it. The seq_cst store followed by the
 * seq_cst load of sleepers pairs with the waiter's increment-then-recheck: either the waker
 * sees the sleeper or the sleeper sees the new value. */
static inline void tr_ar_publish(tr_ar_header *h, _Atomic uint32_t *word, uint32_t value)
{
    atomic_store(word, value);
    if (atomic_load(&h->sleepers.v) != 0)
        tr_ar_futex(word, FUTEX_WAKE, INT_MAX, NULL);
}

/* 1 when rank i holds its alive mutex, 0 when it died or detached (then marked gone). */
int tr_ar_peer_alive(tr_ar_header *h, int i);
/* Marks the job broken in the segment on behalf of `rank` (the first to do so is kept) and
 * wakes every sleeper, so all ranks' waits end. Touches only the segment: any thread. */
void tr_ar_fail_job(tr_ar_header *h, int rank, int n_ranks);

#endif
