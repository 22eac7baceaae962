/* allreduce_nccl.c — the GPU variant of the in-node all-reduce: NCCL through the run-time
 * loaded CUDA library (kernels/device.h, kernels/cuda/nccl_allreduce.cu), with a watchdog.
 *
 * The ranks exchange NCCL's unique id over the CPU segment (allreduce.c), which also tells
 * who is alive. NCCL itself has no timeout: a kernel whose peer died waits forever, and the
 * host waits for it at its next synchronisation. So each communicator has a watchdog thread
 * that looks every S_WATCH_MS at
 *   - NCCL's asynchronous error (a failed connection or kernel),
 *   - the joins queued and finished (nccl_allreduce.cu counts them on the device's side),
 *   - the peers' liveness in the segment, and whether a peer marked the job failed,
 * and judges (tr_nccl_watch_judge, pure, tested on the CPU): queued work with a peer gone
 * for TR_NCCL_GONE_GRACE_MS, or no join finished for the segment's timeout (300 s by
 * default, tr_allreduce_set_timeout), aborts the communicator. The stuck kernels then
 * return, the job is marked failed in the segment (the peers stop too), and this rank's
 * next NCCL call or step fails with the watchdog's reason in the log.
 *
 * Invariants:
 *  - `mu` serialises the caller's NCCL calls with the watchdog's look and abort: nothing
 *    is queued on a communicator being aborted, and nothing after.
 *  - The watchdog only reads the segment's atomics and robust mutexes, and only marks the
 *    job failed; the caller's tr_allreduce stays the caller's.
 *  - destroy stops the watchdog first; queued work that does not finish within the grace is
 *    aborted rather than waited for (ncclCommDestroy would wait forever on a dead peer).
 */
#include "trainer/allreduce.h"
#include "trainer/allreduce_int.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "kernels/device.h"

#define S_WATCH_MS 100 // between the watchdog's looks

struct tr_nccl {
    void *comm;            // ncclComm_t inside the CUDA library
    const k_cuda_lib *lib; // its entry points (kernels/device.h)
    tr_allreduce *ar;      // the node's segment: the peers' liveness, the job's failed flag
    pthread_mutex_t mu;    // the caller's library calls, the watchdog's look and abort
    pthread_cond_t wake;   // ends the watchdog's nap at destroy
    pthread_t watchdog;
    int watching;          // the thread runs
    int stop;              // (mu) destroy asks the watchdog to end
    int aborted;           // (mu) the communicator was aborted: why says why
    tr_nccl_watch w;       // the watchdog's state (its thread only)
    char why[320];
};

/* ---------------------------------------------------------------- the judgement */

int tr_nccl_watch_judge(tr_nccl_watch *w, uint64_t now_ns, uint64_t posted, uint64_t finished,
                        int peer_gone, int timeout_ms, char *why, size_t why_len)
{
    if (finished >= posted) { // nothing queued: a peer that left after the last sum is fine
        *w = (tr_nccl_watch){.finished = finished};
        return 0;
    }
    if (w->since_ns == 0 || finished != w->finished)
        w->since_ns = now_ns; // queued work started, or some finished: the clock restarts
    w->finished = finished;
    if (peer_gone < 0)
        w->gone_ns = 0;
    else if (w->gone_ns == 0)
        w->gone_ns = now_ns;
    if (peer_gone >= 0 && now_ns - w->gone_ns >= (uint64_t)TR_NCCL_GONE_GRACE_MS * 1000000ull) {
        snprintf(why, why_len, "peer rank %d died, left or gave up with %" PRIu64 " all-reduce "
                 "step(s) of this rank still queued", peer_gone, posted - finished);
        return 1;
    }
    if (now_ns - w->since_ns >= (uint64_t)timeout_ms * 1000000ull) {
        snprintf(why, why_len, "no queued all-reduce step finished for %d ms (%" PRIu64
                 " queued; a peer alive but stuck?)", timeout_ms, posted - finished);
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the watchdog */

/* One look (mu held): 1 with why when the communicator must be aborted. */
static int s_look(tr_nccl *nc, char *why, size_t why_len)
{
    unsigned long long posted = 0, finished = 0;
    char msg[256] = "";
    if (nc->lib->nccl_progress(nc->comm, &posted, &finished, msg, sizeof msg) != 0) {
        snprintf(why, why_len, "NCCL reports an error: %s", msg);
        return 1;
    }
    tr_allreduce *ar = nc->ar;
    int gone = -1;
    uint32_t failed = atomic_load(&ar->hdr->failed.v);
    if (failed && (int)failed - 1 != ar->rank)
        gone = (int)failed - 1;
    for (int i = 0; i < ar->n_ranks && gone < 0; i++)
        if (i != ar->rank && !tr_ar_peer_alive(ar->hdr, i))
            gone = i;
    return tr_nccl_watch_judge(&nc->w, zps_now_ns(), posted, finished, gone, ar->timeout_ms, why,
                               why_len);
}

/* Aborts the communicator (mu held): the stuck kernels return, the job is marked failed. */
static void s_abort(tr_nccl *nc, const char *why)
{
    char msg[256] = "";
    snprintf(nc->why, sizeof nc->why, "%s", why);
    zps_log(ZPS_ERROR, "allreduce", "rank %d: NCCL: %s: aborting the communicator; this rank "
            "fails at its next step", nc->ar->rank, why);
    tr_ar_fail_job(nc->ar->hdr, nc->ar->rank, nc->ar->n_ranks);
    if (nc->lib->nccl_abort(nc->comm, msg, sizeof msg) != 0)
        zps_log(ZPS_ERROR, "allreduce", "rank %d: ncclCommAbort: %s", nc->ar->rank, msg);
    nc->aborted = 1;
}

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
        if (!nc->stop && s_look(nc, why, sizeof why))
            s_abort(nc, why);
    }
    pthread_mutex_unlock(&nc->mu);
    return NULL;
}

/* ---------------------------------------------------------------- the communicator */

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
    if ((rc = pthread_create(&nc->watchdog, NULL, s_watchdog, nc)) != 0) {
        pthread_cond_destroy(&nc->wake);
        zps_log(ZPS_ERROR, "allreduce", "NCCL watchdog: pthread_create: %s", strerror(rc));
        return ZPS_ERR_INTERNAL;
    }
    nc->watching = 1;
    return ZPS_OK;
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
    /* every rank must agree before anyone enters ncclCommInitRank, which would wait
     * forever for a rank that cannot join */
    float missing = lib ? 0.0f : 1.0f;
    ZPS_TRY(tr_allreduce_sum(ar, &missing, 1, 0));
    if (missing != 0.0f)
        return ZPS_ERR_NO_DEVICE;
    char id[K_NCCL_ID_BYTES], msg[256] = "";
    memset(id, 0, sizeof id);
    if (ar->rank == 0 && lib->nccl_unique_id(id, msg, sizeof msg) != 0)
        zps_log(ZPS_ERROR, "allreduce", "ncclGetUniqueId: %s", msg); // peers fail in init
    ZPS_TRY(tr_allreduce_broadcast(ar, id, sizeof id, 0));
    void *comm = NULL;
    if (lib->nccl_init(&comm, ar->n_ranks, ar->rank, id, device, msg, sizeof msg) != 0) {
        zps_log(ZPS_ERROR, "allreduce", "rank %d: NCCL init on device %d: %s", ar->rank, device,
                msg);
        return ZPS_ERR_NCCL;
    }
    tr_nccl *nc = zps_xcalloc(1, sizeof *nc);
    *nc = (tr_nccl){.comm = comm, .lib = lib, .ar = ar};
    pthread_mutex_init(&nc->mu, NULL);
    zps_status st = s_start_watchdog(nc);
    if (st != ZPS_OK) {
        tr_nccl_destroy(&nc);
        return st;
    }
    *out = nc;
    return ZPS_OK;
}

/* The caller's side of a library call: refused once the watchdog aborted (mu held). */
static zps_status s_usable(tr_nccl *nc)
{
    if (!nc->aborted)
        return ZPS_OK;
    zps_log(ZPS_ERROR, "allreduce", "rank %d: the NCCL communicator was aborted (%s)",
            nc->ar->rank, nc->why);
    return ZPS_ERR_NCCL;
}

zps_status tr_nccl_sum_device_async(tr_nccl *nc, float *dev_buf, size_t n, int average)
{
    char msg[256] = "";
    pthread_mutex_lock(&nc->mu);
    zps_status st = s_usable(nc);
    if (st == ZPS_OK &&
        nc->lib->nccl_allreduce_async(nc->comm, dev_buf, n, average, msg, sizeof msg) != 0) {
        zps_log(ZPS_ERROR, "allreduce", "NCCL all-reduce of %zu queued floats: %s", n, msg);
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

/* Destroy's wait for queued work: 1 when it all finished within the grace. */
static int s_drained(tr_nccl *nc)
{
    uint64_t end = zps_now_ns() + (uint64_t)TR_NCCL_GONE_GRACE_MS * 1000000ull;
    for (;;) {
        unsigned long long posted = 0, finished = 0;
        char msg[256];
        if (nc->lib->nccl_progress(nc->comm, &posted, &finished, msg, sizeof msg) != 0)
            return 0;
        if (finished >= posted)
            return 1;
        if (zps_now_ns() > end) {
            zps_log(ZPS_WARN, "allreduce", "rank %d: %llu NCCL all-reduce step(s) still queued "
                    "at exit: aborting them", nc->ar->rank, posted - finished);
            return 0;
        }
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
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
        pthread_join(nc->watchdog, NULL);
        pthread_cond_destroy(&nc->wake);
    }
    if (!nc->aborted && !s_drained(nc)) {
        char msg[256] = "";
        if (nc->lib->nccl_abort(nc->comm, msg, sizeof msg) != 0)
            zps_log(ZPS_ERROR, "allreduce", "rank %d: ncclCommAbort: %s", nc->ar->rank, msg);
    }
    nc->lib->nccl_destroy(nc->comm);
    pthread_mutex_destroy(&nc->mu);
    free(nc);
    *pnc = NULL;
}
