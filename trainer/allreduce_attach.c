/* allreduce_attach.c — creating, joining and leaving the shared-memory segment of an
 * all-reduce job (see allreduce.h for the invariants, allreduce.c for the layout).
 *
 * Who may use a segment: the name /zps-ar-<job> is opened under an exclusive file lock, so
 * ranks attach one at a time. A segment of another size or geometry is refused while any
 * of its ranks lives (two jobs with one name) and reinitialised when all are dead (a crashed
 * job's leftover). A rank slot is claimed once per job: a live holder, or a dead earlier
 * holder of the same rank in a live job, is refused. The last rank to attach unlinks the
 * name before the others can see that all did.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/log.h"
#include "common/mem.h"
#include "trainer/allreduce.h"
#include "trainer/allreduce_int.h"

#define S_DEFAULT_SLICE 32768
#define S_DEFAULT_RING 8
#define S_DEFAULT_TIMEOUT_MS 300000

static int s_valid_job(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > 64)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '.' || c == '-'))
            return 0;
    }
    return 1;
}

static zps_status s_init_mutex(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    int rc = pthread_mutexattr_init(&a);
    if (!rc)
        rc = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    if (!rc)
        rc = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    if (!rc)
        rc = pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
    if (rc) {
        zps_log(ZPS_ERROR, "allreduce", "process-shared robust mutex: %s", strerror(rc));
        return ZPS_ERR_SYS;
    }
    return ZPS_OK;
}

/* A fresh header on a zero-filled segment. */
static zps_status s_init_header(tr_ar_header *h, const tr_allreduce *ar)
{
    memset(h, 0, sizeof *h);
    h->n_ranks = (uint32_t)ar->n_ranks;
    h->ring = (uint32_t)ar->ring;
    h->slice_floats = ar->slice;
    h->bytes = ar->bytes;
    for (int i = 0; i < TR_AR_MAX_RANKS; i++)
        ZPS_TRY(s_init_mutex(&h->ranks[i].alive));
    atomic_store(&h->magic, TR_AR_MAGIC);
    return ZPS_OK;
}

/* Live ranks recorded in a mapped header (0 when it is not an initialised one); *used gets the
 * ranks ever registered. */
static int s_live_ranks(tr_ar_header *h, int *used)
{
    int live = 0;
    *used = 0;
    if (atomic_load(&h->magic) != TR_AR_MAGIC)
        return 0;
    for (int i = 0; i < TR_AR_MAX_RANKS; i++)
        if (atomic_load(&h->ranks[i].pid)) {
            (*used)++;
            live += tr_ar_peer_alive(h, i);
        }
    return live;
}

/* The segment exists with another size: an error while someone still uses it, else it is
 * emptied (it is then fresh). */
static zps_status s_resize_stale(tr_allreduce *ar, int fd, off_t size)
{
    void *m = mmap(NULL, sizeof(tr_ar_header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        zps_log(ZPS_ERROR, "allreduce", "%s: mmap: %s", ar->name, strerror(errno));
        return ZPS_ERR_SYS;
    }
    int used, live = (size_t)size >= sizeof(tr_ar_header) ? s_live_ranks(m, &used) : 0;
    munmap(m, sizeof(tr_ar_header));
    if (live) {
        zps_log(ZPS_ERROR, "allreduce",
                "%s exists with another geometry (%lld bytes, we need %zu) and %d live "
                "rank(s): two jobs with one name?",
                ar->name, (long long)size, ar->bytes, live);
        return ZPS_ERR_CONFIG;
    }
    ZPS_CHECK_FILE(ftruncate(fd, 0), ar->name);
    return ZPS_OK;
}

/* An existing segment of our size: joined when its live ranks have our geometry, refused
 * when they have another, and *fresh (reinitialise) when no rank of it is alive. */
static zps_status s_check_existing(tr_allreduce *ar, tr_ar_header *h, int *fresh)
{
    int used, live = s_live_ranks(h, &used);
    if (live && (h->n_ranks != (uint32_t)ar->n_ranks || h->ring != (uint32_t)ar->ring ||
                 h->slice_floats != ar->slice)) {
        zps_log(ZPS_ERROR, "allreduce",
                "%s is in use with n_ranks %u, slice %llu, ring %u; we want %d, %zu, %d",
                ar->name, h->n_ranks, (unsigned long long)h->slice_floats, h->ring,
                ar->n_ranks, ar->slice, ar->ring);
        return ZPS_ERR_CONFIG;
    }
    if (!live) {
        if (used)
            zps_log(ZPS_WARN, "allreduce", "%s: stale segment (its %d rank(s) are gone); "
                    "reinitialising", ar->name, used);
        *fresh = 1;
    }
    return ZPS_OK;
}

/* Claims this rank's control block: its alive mutex held for life, counters at zero. */
static zps_status s_register_rank(tr_allreduce *ar, tr_ar_header *h)
{
    tr_ar_rank_ctl *me = &h->ranks[ar->rank];
    if (atomic_load(&me->pid) && !atomic_load(&me->gone) && tr_ar_peer_alive(h, ar->rank)) {
        zps_log(ZPS_ERROR, "allreduce", "%s: rank %d is already attached by live pid %d",
                ar->name, ar->rank, (int)atomic_load(&me->pid));
        return ZPS_ERR_EXISTS;
    }
    if (atomic_load(&me->pid)) {
        /* a dead earlier holder of this rank in a live job: the job cannot recover */
        zps_log(ZPS_ERROR, "allreduce", "%s: rank %d died earlier in this job", ar->name,
                ar->rank);
        return ZPS_ERR_EXISTS;
    }
    int rc = pthread_mutex_lock(&me->alive);
    if (rc == EOWNERDEAD)
        pthread_mutex_consistent(&me->alive);
    else if (rc) {
        zps_log(ZPS_ERROR, "allreduce", "lock of rank %d's alive mutex: %s", ar->rank,
                strerror(rc));
        return ZPS_ERR_SYS;
    }
    atomic_store(&me->gone, 0);
    for (int c = 0; c < TR_AR_NCOUNTERS; c++)
        atomic_store(&me->ctr[c].v, 0);
    atomic_store(&me->pid, (int32_t)getpid());
    /* The last rank drops the name before anyone can see that all attached (registrations
     * are serialised by the file lock), so a crash cannot leave it behind, and a rank that
     * returns from tr_allreduce_new may make a new segment of the same name at once. */
    if (atomic_load(&h->attached.v) + 1 == (uint32_t)ar->n_ranks && shm_unlink(ar->name) != 0 &&
        errno != ENOENT)
        zps_log(ZPS_WARN, "allreduce", "shm_unlink %s: %s", ar->name, strerror(errno));
    tr_ar_publish(h, &h->attached.v, atomic_fetch_add(&h->attached.v, 1) + 1);
    ar->registered = 1;
    return ZPS_OK;
}

/* Under the file lock: maps the segment, (re)initialises it when new or stale, and registers
 * this rank. On success ar->hdr is mapped. */
static zps_status s_attach_locked(tr_allreduce *ar, int fd)
{
    struct stat st;
    ZPS_CHECK_FILE(fstat(fd, &st), ar->name);
    int fresh = st.st_size == 0;
    if (!fresh && (size_t)st.st_size != ar->bytes) {
        ZPS_TRY(s_resize_stale(ar, fd, st.st_size));
        fresh = 1;
    }
    if (fresh)
        ZPS_CHECK_FILE(ftruncate(fd, (off_t)ar->bytes), ar->name);
    void *m = mmap(NULL, ar->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (m == MAP_FAILED) {
        zps_log(ZPS_ERROR, "allreduce", "%s: mmap of %zu bytes: %s", ar->name, ar->bytes,
                strerror(errno));
        return ZPS_ERR_SYS;
    }
    ar->hdr = m;
    if (!fresh)
        ZPS_TRY(s_check_existing(ar, ar->hdr, &fresh));
    if (fresh)
        ZPS_TRY(s_init_header(ar->hdr, ar));
    return s_register_rank(ar, ar->hdr);
}

/* Waits until every rank registered; a registered peer that dies ends the wait at once. */
static zps_status s_wait_attached(tr_allreduce *ar)
{
    tr_ar_header *h = ar->hdr;
    uint64_t deadline = zps_now_ns() + (uint64_t)ar->timeout_ms * 1000000ull;
    for (;;) {
        atomic_fetch_add(&h->sleepers.v, 1);
        uint32_t v = atomic_load(&h->attached.v);
        if (v < (uint32_t)ar->n_ranks) {
            struct timespec ts = {0, TR_AR_FUTEX_SLICE_NS};
            tr_ar_futex(&h->attached.v, FUTEX_WAIT, v, &ts);
            v = atomic_load(&h->attached.v);
        }
        atomic_fetch_sub(&h->sleepers.v, 1);
        if (v >= (uint32_t)ar->n_ranks)
            return ZPS_OK;
        for (int i = 0; i < ar->n_ranks; i++)
            if (i != ar->rank && atomic_load(&h->ranks[i].pid) && !tr_ar_peer_alive(h, i)) {
                zps_log(ZPS_ERROR, "allreduce", "%s: rank %d (pid %d) died before all %d ranks "
                        "attached", ar->name, i, (int)atomic_load(&h->ranks[i].pid),
                        ar->n_ranks);
                return ZPS_ERR_TIMEOUT;
            }
        if (zps_now_ns() > deadline) {
            zps_log(ZPS_ERROR, "allreduce", "%s: only %u of %d ranks attached within %d ms",
                    ar->name, v, ar->n_ranks, ar->timeout_ms);
            return ZPS_ERR_TIMEOUT;
        }
    }
}

zps_status tr_allreduce_new(const char *job_name, int rank, int n_ranks, size_t max_floats,
                            const tr_allreduce_opts *opts, tr_allreduce **out)
{
    *out = NULL;
    if (!job_name || !s_valid_job(job_name) || n_ranks < 1 || n_ranks > TR_AR_MAX_RANKS ||
        rank < 0 || rank >= n_ranks || max_floats == 0 || max_floats > ((size_t)1 << 40)) {
        zps_log(ZPS_ERROR, "allreduce", "bad arguments: job '%s', rank %d of %d, max %zu",
                job_name ? job_name : "(null)", rank, n_ranks, max_floats);
        return ZPS_ERR_INVALID;
    }
    tr_allreduce_opts o = {0};
    if (opts)
        o = *opts;
    tr_allreduce *ar = zps_xcalloc(1, sizeof *ar);
    snprintf(ar->name, sizeof ar->name, "/zps-ar-%s", job_name);
    ar->rank = rank;
    ar->n_ranks = n_ranks;
    ar->max_floats = max_floats;
    /* a power of two, so slot = g % ring stays continuous when the 32-bit g wraps */
    int ring = o.ring > 0 ? (o.ring < 3 ? 3 : o.ring) : S_DEFAULT_RING;
    for (ar->ring = 4; ar->ring < ring && ar->ring < 1024; ar->ring *= 2)
        ;
    size_t slice = o.slice_floats ? o.slice_floats : S_DEFAULT_SLICE;
    size_t need = (max_floats + TR_AR_ALIGN_FLOATS - 1) / TR_AR_ALIGN_FLOATS * TR_AR_ALIGN_FLOATS;
    if (slice > need)
        slice = need;
    slice = (slice + TR_AR_ALIGN_FLOATS - 1) / TR_AR_ALIGN_FLOATS * TR_AR_ALIGN_FLOATS;
    ar->slice = slice;
    ar->timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : S_DEFAULT_TIMEOUT_MS;
    size_t hdr_bytes = (sizeof(tr_ar_header) + 4095) / 4096 * 4096;
    ar->bytes = hdr_bytes + (size_t)(n_ranks + 1) * (size_t)ar->ring * slice * sizeof(float);

    zps_status st = ZPS_OK;
    int fd = shm_open(ar->name, O_RDWR | O_CREAT, 0600);
    if (fd < 0) {
        zps_log(ZPS_ERROR, "allreduce", "shm_open %s: %s", ar->name, strerror(errno));
        free(ar);
        return ZPS_ERR_SYS;
    }
    if (flock(fd, LOCK_EX) != 0) {
        zps_log(ZPS_ERROR, "allreduce", "flock %s: %s", ar->name, strerror(errno));
        st = ZPS_ERR_SYS;
    } else {
        st = s_attach_locked(ar, fd);
        flock(fd, LOCK_UN);
    }
    close(fd);
    if (st == ZPS_OK) {
        char *base = (char *)ar->hdr;
        ar->in = (float *)(base + hdr_bytes);
        ar->outr = ar->in + (size_t)n_ranks * (size_t)ar->ring * slice;
        st = s_wait_attached(ar);
    }
    if (st != ZPS_OK) {
        tr_allreduce_destroy(&ar);
        return st;
    }
    ar->unlinked = 1; /* by the last rank to attach (s_register_rank) */
    zps_log(ZPS_DEBUG, "allreduce", "rank %d of %d attached to %s (%zu bytes, slice %zu, ring %d)",
            rank, n_ranks, ar->name, ar->bytes, ar->slice, ar->ring);
    *out = ar;
    return ZPS_OK;
}

void tr_allreduce_set_timeout(tr_allreduce *ar, int timeout_ms)
{
    if (timeout_ms > 0)
        ar->timeout_ms = timeout_ms;
}

int tr_allreduce_rank(const tr_allreduce *ar) { return ar->rank; }
int tr_allreduce_size(const tr_allreduce *ar) { return ar->n_ranks; }
size_t tr_allreduce_segment_bytes(const tr_allreduce *ar) { return ar->bytes; }

void tr_allreduce_destroy(tr_allreduce **par)
{
    if (!par || !*par)
        return;
    tr_allreduce *ar = *par;
    if (ar->hdr) {
        tr_ar_rank_ctl *me = &ar->hdr->ranks[ar->rank];
        if (atomic_load(&me->pid) == (int32_t)getpid()) {
            pthread_mutex_unlock(&me->alive); // peers now see this rank as gone
            /* wake anyone sleeping on our counters so they notice at once */
            for (int c = 0; c < TR_AR_NCOUNTERS; c++)
                tr_ar_futex(&me->ctr[c].v, FUTEX_WAKE, INT_MAX, NULL);
        }
        munmap(ar->hdr, ar->bytes);
        /* a rank that registered but never saw every rank attach: the job failed, and the
         * name may be left behind. One that was refused must not touch it (it is another
         * job's, still assembling, or a newer segment's). */
        if (ar->registered && !ar->unlinked && shm_unlink(ar->name) != 0 && errno != ENOENT)
            zps_log(ZPS_WARN, "allreduce", "shm_unlink %s: %s", ar->name, strerror(errno));
    }
    free(ar);
    *par = NULL;
}
