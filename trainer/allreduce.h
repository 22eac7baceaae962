/* allreduce.h — in-node CPU all-reduce over POSIX shared memory (the all-reduce baseline).
 *
 * N processes on one machine that call tr_allreduce_new with the same job name and n_ranks
 * share one segment /dev/shm/zps-ar-<job>. tr_allreduce_sum(ar, buf, n, average) replaces buf
 * on every rank with the element-wise sum (or mean) of the N ranks' buf.
 *
 * Algorithm: reduce-scatter + all-gather through a ring of slices in the segment. The buffer
 * is cut into slices of `slice_floats`; for each slice every rank copies its part into its
 * own input slot, rank r sums part r of the slice over the N input slots and writes it to the
 * shared output slot (and into its own buf), then every rank copies the other parts back from
 * the output slot. A rank does whatever phase of whatever slice is ready (up to a ring of
 * slices ahead) and blocks only when nothing is, so copies, reductions and gathers of
 * consecutive slices overlap across ranks, the slices stay in cache (user buffers cross DRAM
 * once each way), and ranks that share a core move a ring of slices per scheduling quantum.
 * Waiting is a short spin, then spin with sched_yield, then a futex sleep.
 *
 * Invariants:
 *  - Summation order is fixed: ((x_0 + x_1) + x_2) + ... + x_{N-1}, whatever the slicing, and
 *    each element is computed once (by its owner) and copied to the others, so every rank gets
 *    bit-identical results and repeated runs on the same inputs give the same bits. With
 *    average, the sum is divided by N (IEEE division, exact scaling when N is a power of 2).
 *  - The segment (ring of slots, counters) is allocated and pre-faulted once in
 *    tr_allreduce_new; calls allocate nothing.
 *  - tr_allreduce_sum_apply hands each stretch to its callback once, after the stretch is
 *    final on this rank; the callback may change buf there (it is not read again).
 *  - Synchronisation is by per-rank progress counters in the segment: short spin, then futex
 *    wait (no sleeps). Every rank holds a robust process-shared mutex for its lifetime, so a
 *    peer that dies is noticed at once; a peer that is alive but silent past the timeout
 *    (default 300 s, tr_allreduce_set_timeout) ends the wait too. Either way the call returns
 *    ZPS_ERR_TIMEOUT, the log names the peer and why, and the object is broken: every later
 *    call fails at once. The rank that notices marks the whole job broken in the segment,
 *    so the other ranks stop waiting too (within 20 ms).
 *  - The last rank to attach unlinks the name before any rank can see that all attached, so
 *    a crash never leaves a segment behind, and a rank that returns from tr_allreduce_new
 *    may at once attach a new segment of the same name (sync_node_dev.c's fallback does);
 *    a rank's destroy unlinks only when it registered and not all ranks attached (a rank
 *    refused at attach, or a slow rank leaving, would otherwise remove a live job's or a
 *    newer segment's name). A stale segment left by ranks that died before
 *    all attached is detected (all holders dead) and reinitialised.
 *  - Every rank must make the same sequence of calls with the same n (collective calls). One
 *    object per process per job; not thread-safe; destroy it from the thread that created it
 *    (that thread holds the liveness mutex, and a thread that exits drops it).
 */
#ifndef ZPS_TRAINER_ALLREDUCE_H
#define ZPS_TRAINER_ALLREDUCE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct tr_allreduce tr_allreduce;

typedef struct tr_allreduce_opts {
    size_t slice_floats; // floats per slice (0: default 32768 = 128 KiB)
    int ring;            // slots per ring (0: default 8), rounded up to a power of 2 >= 4
    int timeout_ms;      // attach and per-wait timeout (0: default 300000)
} tr_allreduce_opts;

/* Attaches rank `rank` of `n_ranks` (1..64) to the job's segment, creating it when first,
 * and waits until all ranks have attached (bounded by the timeout). job_name:
 * [A-Za-z0-9_.-]{1,64}. max_floats bounds n in later calls (and shrinks the slices for small
 * jobs). opts may be NULL. On success *out is the caller's (tr_allreduce_destroy).
 * Errors: ZPS_ERR_INVALID (arguments), ZPS_ERR_CONFIG (the segment exists with another
 * geometry and live holders), ZPS_ERR_EXISTS (this rank is already attached by a live
 * process), ZPS_ERR_TIMEOUT (a peer did not attach in time, or died), ZPS_ERR_SYS / IO. */
zps_status tr_allreduce_new(const char *job_name, int rank, int n_ranks, size_t max_floats,
                            const tr_allreduce_opts *opts, tr_allreduce **out);

/* Collective: buf[0..n) becomes the sum over ranks (average != 0: the mean). n <= max_floats,
 * the same n on every rank. ZPS_ERR_TIMEOUT when a peer died or stayed silent too long. */
zps_status tr_allreduce_sum(tr_allreduce *ar, float *buf, size_t n, int average);

/* Called by tr_allreduce_sum_apply on each stretch part[0..len) of buf as soon as it holds
 * its final sum (mean), while it is still in cache: the caller's update fused into the
 * reduction (the trainer's optimizer step). The stretches cover buf exactly once, in no
 * particular order; part points into buf. */
typedef void (*tr_allreduce_apply_fn)(void *ctx, float *part, size_t len);

/* tr_allreduce_sum, then fn on every stretch of the result (fn NULL: tr_allreduce_sum). */
zps_status tr_allreduce_sum_apply(tr_allreduce *ar, float *buf, size_t n, int average,
                                  tr_allreduce_apply_fn fn, void *ctx);

/* Collective: buf[0..bytes) of rank `root` is copied into buf on every other rank (initial
 * weights, an NCCL unique id). bytes <= 4 * max_floats. */
zps_status tr_allreduce_broadcast(tr_allreduce *ar, void *buf, size_t bytes, int root);

/* Collective barrier (an empty broadcast). */
zps_status tr_allreduce_barrier(tr_allreduce *ar);

/* Wait timeout in milliseconds (> 0) for later calls. */
void tr_allreduce_set_timeout(tr_allreduce *ar, int timeout_ms);

int tr_allreduce_rank(const tr_allreduce *ar);
int tr_allreduce_size(const tr_allreduce *ar);
/* Bytes of the shared segment (for logs). */
size_t tr_allreduce_segment_bytes(const tr_allreduce *ar);

/* Detaches, unmaps and unlinks the name (ENOENT ignored); *par becomes NULL. Safe on NULL. */
void tr_allreduce_destroy(tr_allreduce **par);

/* ---- GPU variant: NCCL through the run-time-loaded CUDA library (kernels/device.h;
 * allreduce_nccl.c) ----
 * The ranks exchange NCCL's unique id with tr_allreduce_broadcast over the CPU segment, so
 * a GPU job creates the tr_allreduce first (and destroys it after the tr_nccl). Each rank
 * uses CUDA device `device`. The communicator is watched (allreduce_nccl.c): a peer that died
 * with work of this rank queued, nothing finished for the segment's timeout, or an NCCL
 * error aborts it, marks the job failed, and every later call fails with ZPS_ERR_NCCL. */
typedef struct tr_nccl tr_nccl;

/* Collective over the segment: *shared = 1 when two of its ranks use the same GPU (by UUID),
 * which NCCL refuses (they must sum through the host). */
zps_status tr_nccl_gpus_shared(tr_allreduce *ar, int *shared);
/* ZPS_ERR_NO_DEVICE when the CUDA library is missing or no device answers (a clear log line);
 * ZPS_ERR_NCCL when NCCL fails or a peer dies while the ranks meet. */
zps_status tr_nccl_new(tr_allreduce *ar, int device, tr_nccl **out);
/* dev_buf: n floats in device memory; sum, or mean when average, over the ranks, queued on the
 * communicator's stream after the work the cuda back-end's compute stream holds so far (an
 * event; the host does not wait for the device). tr_nccl_join makes the compute stream's
 * later work wait for every sum queued so far. What sync_nccl.c builds a step from. */
zps_status tr_nccl_sum_device_async(tr_nccl *nc, float *dev_buf, size_t n, int average);
/* dev_buf: n floats in device memory; rank root's values on every rank, queued and ordered
 * like a sum (sync_node_dev.c: the node leader's new values). */
zps_status tr_nccl_broadcast_device_async(tr_nccl *nc, float *dev_buf, size_t n, int root);
/* Records e (an event of the cuda back-end, backend.h) on the communicator's stream: a point
 * after every collective queued so far, which the back-end's queues can wait for. */
struct k_event;
zps_status tr_nccl_record(tr_nccl *nc, struct k_event *e);
zps_status tr_nccl_join(tr_nccl *nc);
/* Waits until every sum queued so far finished on the device (judging the peers as it
 * waits): a job's last step, before its final evaluation reads the values. */
zps_status tr_nccl_drain(tr_nccl *nc);
/* ZPS_OK while the communicator stands; ZPS_ERR_NCCL once it was aborted (the reason was
 * logged then): what its finished kernels wrote may be partial. Logs nothing. */
zps_status tr_nccl_ok(tr_nccl *nc);
/* The judgement's timeout from now on (made with the segment's). */
void tr_nccl_set_timeout(tr_nccl *nc, int timeout_ms);
/* This rank stops early (an error, a signal): marks the job failed in the segment and aborts
 * the communicator now, so the peers stop waiting for its sums. Later calls fail. Safe on
 * NULL. */
void tr_nccl_abandon(tr_nccl *nc);
/* Stops the watchdog. A clean end: queued work gets TR_NCCL_GONE_GRACE_MS, then the ranks
 * finalize together (judged like any wait); a failed job, a gone peer or anything not
 * finishing in time: aborted, not waited for. Safe on NULL. */
void tr_nccl_destroy(tr_nccl **pnc);

/* The watchdog's judgement, one look at a time (pure; the caller brings the clock). */
#define TR_NCCL_GONE_GRACE_MS 1000 // unfinished work with a peer gone this long: abort
typedef struct tr_nccl_watch {
    uint64_t finished; // sums finished at the last look
    uint64_t since_ns; // unfinished work: when first seen or when some last finished (0: none)
    uint64_t gone_ns;  // unfinished work with a peer gone: since when (0: not so)
} tr_nccl_watch;
/* queued: this rank's NCCL operations not finished (sums on the device, a call in
 * progress); finished: how many sums ever finished (progress); peer_gone: a rank that died,
 * detached or marked the job failed, else -1. Returns 1 with why when the communicator must
 * be aborted: unfinished work and a peer gone for TR_NCCL_GONE_GRACE_MS, or unfinished work
 * and nothing finished for timeout_ms; else 0. A zeroed tr_nccl_watch starts it. */
int tr_nccl_watch_judge(tr_nccl_watch *w, uint64_t now_ns, uint64_t queued, uint64_t finished,
                        int peer_gone, int timeout_ms, char *why, size_t why_len);

#endif
