/* allreduce_nccl.c — the GPU variant of the in-node all-reduce: NCCL through the run-time
 * loaded CUDA library (kernels/device.h, kernels/cuda/nccl_allreduce.cu), watched.
 *
 * The ranks exchange NCCL's unique id over the CPU segment (allreduce.c), which also tells
 * who is alive. NCCL itself has no timeout: a kernel whose peer died waits for ever, and so
 * does the host at its next synchronisation; a blocking communicator would also hold the
 * caller inside NCCL (the first sum connects to the peers). So the communicator is
 * non-blocking, and whoever waits on it judges (tr_nccl_watch_judge, pure, tested on the CPU)
 * from NCCL's error state, the sums queued and finished on the device, and the peers'
 * liveness and failed flag in the segment:
 *   - the caller, while a call of its is in progress (init, the first sums) and in
 *     tr_nccl_drain (sync_nccl.c's finish: the last step's sums before the final
 *     evaluation);
 *   - a watchdog thread every S_WATCH_MS between the caller's calls, when the caller may be
 *     blocked in CUDA behind NCCL's stream.
 * Queued work with a peer gone for TR_NCCL_GONE_GRACE_MS, no sum finished for the segment's
 * timeout (300 s by default; tr_nccl_set_timeout), or an NCCL
 * error aborts the communicator: the stuck kernels return, the job is marked failed in the
 * segment (the peers stop too), and this rank's next call fails with the reason logged.
 *
 * Invariants:
 *  - Every NCCL call of a communicator is made with `mu` held, and none after `aborted`; the
 *    watchdog's abort alone runs without `mu`, after it set `aborted` under it, so no other
 *    call can be inside NCCL then.
 *  - The judgement's state is under `mu`, shared by whoever looks.
 *  - destroy stops the watchdog first. On a clean end the ranks finalize together, judged
 *    as above, so ncclCommDestroy waits for nothing; when the job failed, a peer is gone, or
 *    anything does not finish in time, the communicator is aborted instead (ncclCommDestroy
 *    would wait for ever on a dead peer). A rank that stops early (tr_nccl_abandon) marks the
 *    job failed and aborts at once, so its peers do not wait for its sums until the timeout.
 */
#include "trainer/allreduce.h"
#include "trainer/allreduce_int.h"

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/proc.h"
#include "kernels/device.h"

#define S_WATCH_MS 100     // between the watchdog's looks
#define S_SPIN_POLLS 1000  // a waiting caller's polls with sched_yield before naps
#define S_NAP_NS 20000L    // a nap past them: recent NCCL answers every collective of a
                           // non-blocking communicator "in progress" and launches it from a
                           // thread of its own, so the backward hook waits here per bucket;
                           // a 1 ms nap would cost a step 17 ms where the launch takes ~50 us

struct tr_nccl {
    void *comm;            // ncclComm_t inside the CUDA library
    const k_cuda_lib *lib; // its entry points (kernels/device.h)
    tr_allreduce *ar;      // the node's segment: the peers' liveness, the job's failed flag
    int timeout_ms;        // (mu) the judgement's: the segment's, or tr_nccl_set_timeout
    pthread_mutex_t mu;    // every NCCL call of comm; the fields marked (mu)
    pthread_cond_t wake;   // ends the watchdog's nap at destroy
    pthread_t watchdog;
    int watching;          // the thread runs
    int stop;              // (mu) destroy asks the watchdog to end
    int aborted;           // (mu) the communicator was aborted, why says why
    tr_nccl_watch w;       // (mu) the judgement's state
    char why[320];         // (mu)
};

/* ---------------------------------------------------------------- the judgement */

int tr_nccl_watch_judge(tr_nccl_watch *w, uint64_t now_ns, uint64_t queued, uint64_t finished,
                        int peer_gone, int timeout_ms, char *why, size_t why_len)
{
    if (queued == 0) { // nothing unfinished: a peer that left after the last sum is fine
        *w = (tr_nccl_watch){.finished = finished};
        return 0;
    }
    if (w->since_ns == 0 || finished != w->finished)
        w->since_ns = now_ns; // work appeared, or some finished: the clock restarts
    w->finished = finished;
    if (peer_gone < 0)
        w->gone_ns = 0;
    else if (w->gone_ns == 0)
        w->gone_ns = now_ns;
    if (peer_gone >= 0 && now_ns - w->gone_ns >= (uint64_t)TR_NCCL_GONE_GRACE_MS * 1000000ull) {
        snprintf(why, why_len, "peer rank %d died, left or gave up with %" PRIu64 " NCCL "
                 "operation(s) of this rank unfinished", peer_gone, queued);
        return 1;
    }
    if (now_ns - w->since_ns >= (uint64_t)timeout_ms * 1000000ull) {
        snprintf(why, why_len, "no NCCL operation of this rank finished for %d ms (%" PRIu64
                 " unfinished; a peer alive but stuck?)", timeout_ms, queued);
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- looking and aborting */

/* A rank other than this one that marked the job failed, died or left; -1: none. */
static int s_gone(tr_nccl *nc)
{
    tr_allreduce *ar = nc->ar;
    uint32_t failed = atomic_load(&ar->hdr->failed.v);
    if (failed && (int)failed - 1 != ar->rank)
        return (int)failed - 1;
    for (int i = 0; i < ar->n_ranks; i++)
        if (i != ar->rank && !tr_ar_peer_alive(ar->hdr, i))
            return i;
    return -1;
}

/* One look (mu held): 1 with why when the communicator must be aborted. *settled: no call
 * in progress; *ready: and every queued sum finished on the device. */
static int s_look(tr_nccl *nc, int timeout_ms, int *settled, int *ready, char *why,
                  size_t why_len)
{
    unsigned long long posted = 0, finished = 0;
    char msg[256] = "";
    int rc = nc->lib->nccl_progress(nc->comm, &posted, &finished, msg, sizeof msg);
    if (rc < 0) {
        snprintf(why, why_len, "NCCL reports an error: %s", msg);
        return 1;
    }
    uint64_t queued = (uint64_t)(posted - finished) + (rc == 1);
    *settled = rc == 0;
    *ready = queued == 0;
    return tr_nccl_watch_judge(&nc->w, zps_now_ns(), queued, finished, s_gone(nc), timeout_ms,
                               why, why_len);
}

/* Gives the communicator up (mu held): no NCCL call after this but the abort, which the
 * caller makes next (s_abort). tell: mark the job failed in the segment, so the other ranks
 * stop too. */
static void s_give_up(tr_nccl *nc, zps_log_level level, int tell, const char *why)
{
    nc->aborted = 1;
    snprintf(nc->why, sizeof nc->why, "%s", why);
    zps_log(level, "allreduce", "rank %d: %s: aborting the NCCL communicator%s", nc->ar->rank,
            why, tell ? "; the other ranks are told" : "");
    if (tell)
        tr_ar_fail_job(nc->ar->hdr, nc->ar->rank, nc->ar->n_ranks);
}

static void s_abort(tr_nccl *nc)
{
    char msg[256] = "";
    if (nc->lib->nccl_abort(nc->comm, msg, sizeof msg) != 0)
        zps_log(ZPS_ERROR, "allreduce", "rank %d: ncclCommAbort: %s", nc->ar->rank, msg);
}

static void s_nap(int polls)
{
    if (polls < S_SPIN_POLLS) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, S_NAP_NS};
    nanosleep(&ts, NULL);
}

/* The caller waits (mu held) until nothing of this rank is unfinished (all: every sum
 * done too) or only its last call settled; judging as it goes, with timeout_ms. On a
 * verdict the communicator is aborted; at_exit: with a warning, and the job is not marked
 * failed (it is over for this rank; the peers see it leave). */
static zps_status s_wait(tr_nccl *nc, int all, int timeout_ms, int at_exit, const char *what)
{
    char why[256];
    for (int polls = 0;; polls++) {
        int settled = 0, ready = 0;
        if (s_look(nc, timeout_ms, &settled, &ready, why, sizeof why)) {
            char full[320];
            snprintf(full, sizeof full, "%s%s: %s", at_exit ? "at exit, " : "", what, why);
            s_give_up(nc, at_exit ? ZPS_WARN : ZPS_ERROR, !at_exit, full);
            s_abort(nc);
            return ZPS_ERR_NCCL;
        }
        if (all ? ready : settled)
            return ZPS_OK;
        if (polls == S_SPIN_POLLS)
            zps_log(ZPS_DEBUG, "allreduce", "rank %d: waiting for NCCL (%s)", nc->ar->rank, what);
        s_nap(polls);
    }
}

/* A call's answer (mu held): done, failed, or in progress (waited for). */
static zps_status s_settle(tr_nccl *nc, int rc, const char *what, const char *msg)
{
    if (rc < 0) {
        zps_log(ZPS_ERROR, "allreduce", "rank %d: NCCL %s: %s", nc->ar->rank, what, msg);
        return ZPS_ERR_NCCL;
    }
    return rc == 1 ? s_wait(nc, 0, nc->timeout_ms, 0, what) : ZPS_OK;
}

/* ---------------------------------------------------------------- the watchdog */

static void *s_watchdog(void *arg)
{
    tr_nccl *nc = arg;
    char why[256];
    pthread_mutex_lock(&nc->mu);
    while (!nc->stop && !nc->aborted) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += S_WATCH_MS * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&nc->wake, &nc->mu, &ts);
        int settled, ready;
        if (!nc->stop && !nc->aborted &&
            s_look(nc, nc->timeout_ms, &settled, &ready, why, sizeof why)) {
            s_give_up(nc, ZPS_ERROR, 1, why);
            pthread_mutex_unlock(&nc->mu); // ncclCommAbort may take long: callers see aborted
            s_abort(nc);
            return NULL;
        }
    }
    pthread_mutex_unlock(&nc->mu);
    return NULL;
}

static zps_status s_start_watchdog(tr_nccl *nc)
{
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca) != 0)
        return ZPS_ERR_INTERNAL;
    int rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (rc == 0)
        rc = pthread_cond_init(&nc->wake, &ca);
    pthread_condattr_destroy(&ca);
    if (rc != 0) {
        zps_log(ZPS_ERROR, "allreduce", "NCCL watchdog: condition variable: %s", strerror(rc));
        return ZPS_ERR_INTERNAL;
    }
    if ((rc = zps_thread_start(&nc->watchdog, s_watchdog, nc)) != 0) {
        pthread_cond_destroy(&nc->wake);
        zps_log(ZPS_ERROR, "allreduce", "NCCL watchdog: pthread_create: %s", strerror(rc));
        return ZPS_ERR_INTERNAL;
    }
    nc->watching = 1;
    return ZPS_OK;
}

/* ---------------------------------------------------------------- the communicator */

/* *shared = 1 when two ranks of the segment hold the same GPU (by UUID). */
zps_status tr_nccl_gpus_shared(tr_allreduce *ar, int *shared)
{
    k_device_info info;
    *shared = 0;
    ZPS_TRY(k_device_select("cuda", &info));
    uint32_t h = 2166136261u; /* FNV-1a, cut to 24 bits: exact in a float */
    for (int i = 0; i < 16; i++)
        h = (h ^ info.uuid[i]) * 16777619u;
    int rank = tr_allreduce_rank(ar), n_ranks = tr_allreduce_size(ar);
    float *ids = zps_xcalloc((size_t)n_ranks, sizeof *ids);
    ids[rank] = (float)((h & 0xffffffu) | 1u);
    zps_status st = tr_allreduce_sum(ar, ids, (size_t)n_ranks, 0);
    for (int i = 0; i < n_ranks && st == ZPS_OK; i++)
        for (int j = i + 1; j < n_ranks; j++)
            *shared |= ids[i] == ids[j];
    free(ids);
    return st;
}

zps_status tr_nccl_new(tr_allreduce *ar, int device, tr_nccl **out)
{
    *out = NULL;
    k_device_info info;
    const k_cuda_lib *lib = NULL;
    if (k_device_select("cuda", &info) == ZPS_OK && device >= 0 && device < info.cuda_devices)
        lib = k_device_cuda_lib(info.reason, sizeof info.reason);
    if (!lib)
        zps_log(ZPS_WARN, "allreduce", "rank %d: no CUDA device %d with NCCL (%s)", ar->rank,
                device, info.reason);
    /* every rank must agree before anyone makes a communicator that waits for the others */
    float missing = lib ? 0.0f : 1.0f;
    ZPS_TRY(tr_allreduce_sum(ar, &missing, 1, 0));
    if (missing != 0.0f)
        return ZPS_ERR_NO_DEVICE;
    /* rank 0's id and, in its last byte, whether it could make one: a zeroed id would have
     * the peers wait in init for a rank that never comes */
    char id[K_NCCL_ID_BYTES + 1], msg[256] = "";
    memset(id, 0, sizeof id);
    if (ar->rank == 0 && lib->nccl_unique_id(id, msg, sizeof msg) != 0) {
        zps_log(ZPS_ERROR, "allreduce", "ncclGetUniqueId: %s", msg);
        id[K_NCCL_ID_BYTES] = 1;
    }
    ZPS_TRY(tr_allreduce_broadcast(ar, id, sizeof id, 0));
    if (id[K_NCCL_ID_BYTES]) {
        if (ar->rank != 0)
            zps_log(ZPS_ERROR, "allreduce", "rank %d: rank 0 could not make NCCL's id",
                    ar->rank);
        return ZPS_ERR_NCCL;
    }
    const char *env_blocking = getenv("NCCL_COMM_BLOCKING");
    if (env_blocking && strcmp(env_blocking, "0") != 0)
        zps_log(ZPS_WARN, "allreduce", "rank %d: NCCL_COMM_BLOCKING=%s makes the communicator "
                "blocking: a peer that dies may then hold this rank inside NCCL for good",
                ar->rank, env_blocking);
    void *comm = NULL;
    int rc = lib->nccl_init(&comm, ar->n_ranks, ar->rank, id, device, msg, sizeof msg);
    if (rc < 0) { /* the peers wait in init for this rank: tell them the job failed */
        zps_log(ZPS_ERROR, "allreduce", "rank %d: NCCL init on device %d: %s", ar->rank, device,
                msg);
        tr_ar_fail_job(ar->hdr, ar->rank, ar->n_ranks);
        return ZPS_ERR_NCCL;
    }
    tr_nccl *nc = zps_xcalloc(1, sizeof *nc);
    *nc = (tr_nccl){.comm = comm, .lib = lib, .ar = ar, .timeout_ms = ar->timeout_ms};
    pthread_mutex_init(&nc->mu, NULL);
    pthread_mutex_lock(&nc->mu);
    zps_status st = s_settle(nc, rc, "init", msg); // the ranks meet
    pthread_mutex_unlock(&nc->mu);
    if (st == ZPS_OK)
        st = s_start_watchdog(nc);
    if (st != ZPS_OK) {
        tr_nccl_destroy(&nc);
        return st;
    }
    int v = 0;
    if (ar->rank == 0 && lib->nccl_version(&v, msg, sizeof msg) == 0)
        zps_log(ZPS_INFO, "allreduce", "NCCL %d.%d.%d, %d ranks, non-blocking communicator",
                v / 10000, v / 100 % 100, v % 100, ar->n_ranks);
    *out = nc;
    return ZPS_OK;
}

/* The caller's side (mu held): refused once the communicator was aborted. */
static zps_status s_usable(tr_nccl *nc)
{
    if (!nc->aborted)
        return ZPS_OK;
    zps_log(ZPS_ERROR, "allreduce", "rank %d: the NCCL communicator was aborted (%s)",
            nc->ar->rank, nc->why);
    return ZPS_ERR_NCCL;
}

/* Queues one collective (sum, or broadcast from root when root >= 0) and counts it. */
static zps_status s_collective(tr_nccl *nc, float *dev_buf, size_t n, int average, int root)
{
    char msg[256] = "";
    pthread_mutex_lock(&nc->mu);
    zps_status st = s_usable(nc);
    if (st == ZPS_OK && root >= 0)
        st = s_settle(nc, nc->lib->nccl_broadcast_async(nc->comm, dev_buf, n, root, msg,
                                                        sizeof msg),
                      "broadcast", msg);
    else if (st == ZPS_OK)
        st = s_settle(nc, nc->lib->nccl_allreduce_async(nc->comm, dev_buf, n, average, msg,
                                                        sizeof msg),
                      "all-reduce", msg);
    if (st == ZPS_OK && nc->lib->nccl_mark(nc->comm, msg, sizeof msg) != 0) {
        zps_log(ZPS_ERROR, "allreduce", "rank %d: counting a queued collective: %s",
                nc->ar->rank, msg);
        st = ZPS_ERR_NCCL;
    }
    pthread_mutex_unlock(&nc->mu);
    return st;
}

zps_status tr_nccl_sum_device_async(tr_nccl *nc, float *dev_buf, size_t n, int average)
{
    return s_collective(nc, dev_buf, n, average, -1);
}

zps_status tr_nccl_broadcast_device_async(tr_nccl *nc, float *dev_buf, size_t n, int root)
{
    return s_collective(nc, dev_buf, n, 0, root);
}

zps_status tr_nccl_record(tr_nccl *nc, struct k_event *e)
{
    char msg[256] = "";
    pthread_mutex_lock(&nc->mu);
    zps_status st = s_usable(nc);
    if (st == ZPS_OK && nc->lib->nccl_record(nc->comm, e, msg, sizeof msg) != 0) {
        zps_log(ZPS_ERROR, "allreduce", "a point on NCCL's stream: %s", msg);
        st = ZPS_ERR_NCCL;
    }
    pthread_mutex_unlock(&nc->mu);
    return st;
}

zps_status tr_nccl_join(tr_nccl *nc)
{
    char msg[256] = "";
    pthread_mutex_lock(&nc->mu);
    zps_status st = s_usable(nc);
    if (st == ZPS_OK && nc->lib->nccl_join(nc->comm, msg, sizeof msg) != 0) {
        zps_log(ZPS_ERROR, "allreduce", "waiting for NCCL on the compute stream: %s", msg);
        st = ZPS_ERR_NCCL;
    }
    pthread_mutex_unlock(&nc->mu);
    return st;
}

zps_status tr_nccl_ok(tr_nccl *nc)
{
    pthread_mutex_lock(&nc->mu);
    int aborted = nc->aborted;
    pthread_mutex_unlock(&nc->mu);
    return aborted ? ZPS_ERR_NCCL : ZPS_OK;
}

zps_status tr_nccl_drain(tr_nccl *nc)
{
    pthread_mutex_lock(&nc->mu);
    zps_status st = s_usable(nc);
    if (st == ZPS_OK)
        st = s_wait(nc, 1, nc->timeout_ms, 0, "the queued all-reduces");
    pthread_mutex_unlock(&nc->mu);
    return st;
}

void tr_nccl_set_timeout(tr_nccl *nc, int timeout_ms)
{
    pthread_mutex_lock(&nc->mu);
    nc->timeout_ms = timeout_ms;
    pthread_mutex_unlock(&nc->mu);
}

void tr_nccl_abandon(tr_nccl *nc)
{
    if (!nc)
        return;
    pthread_mutex_lock(&nc->mu);
    int was = nc->aborted;
    if (!was)
        s_give_up(nc, ZPS_INFO, 1, "this rank stops early");
    pthread_mutex_unlock(&nc->mu);
    if (!was) // no call of the caller's can be inside NCCL: it is this thread
        s_abort(nc);
}

void tr_nccl_destroy(tr_nccl **pnc)
{
    if (!pnc || !*pnc)
        return;
    tr_nccl *nc = *pnc;
    if (nc->watching) {
        pthread_mutex_lock(&nc->mu);
        nc->stop = 1;
        pthread_cond_signal(&nc->wake);
        pthread_mutex_unlock(&nc->mu);
        pthread_join(nc->watchdog, NULL); // after its abort, if it made one
        pthread_cond_destroy(&nc->wake);
    }
    /* A clean end: what is still queued gets the grace, then the ranks finalize together
     * (judged with the timeout: rank 0 may still evaluate), so that ncclCommDestroy waits
     * for nothing. A broken job, or any failure on the way: abort. */
    pthread_mutex_lock(&nc->mu);
    if (!nc->aborted && (atomic_load(&nc->ar->hdr->failed.v) || s_gone(nc) >= 0)) {
        /* finalize would wait for ranks that never finalize */
        s_give_up(nc, ZPS_INFO, 0, "at exit, the job failed or a peer is gone");
        s_abort(nc);
    }
    if (!nc->aborted &&
        s_wait(nc, 1, TR_NCCL_GONE_GRACE_MS, 1, "the queued all-reduces") == ZPS_OK) {
        char msg[256] = "";
        int rc = nc->lib->nccl_finalize(nc->comm, msg, sizeof msg);
        if (rc < 0) {
            s_give_up(nc, ZPS_WARN, 0, msg);
            s_abort(nc);
        } else if (rc == 1) {
            (void)s_wait(nc, 0, nc->timeout_ms, 1, "finalizing with the other ranks");
        }
    }
    pthread_mutex_unlock(&nc->mu);
    nc->lib->nccl_destroy(nc->comm);
    pthread_mutex_destroy(&nc->mu);
    free(nc);
    *pnc = NULL;
}
