/* test_allreduce.c — the shared-memory all-reduce (trainer/allreduce.h).
 *
 * Suite `allreduce` (in one process, so it runs under the sanitizers): argument checks,
 * two ranks played by two threads, and the fused-update callback of tr_allreduce_sum_apply
 * (each element handed over once, final, and the callback's writes kept), and a name
 * attached again at once by a fast rank while a slow one leaves the old segment. Suite `it_allreduce` forks rank processes: results are
 * bit-identical on every rank and equal to the fixed-order sum ((x0 + x1) + x2) + ...,
 * across many calls with sizes that do not fill a slice or wrap the ring; average,
 * broadcast and barrier; a peer that dies makes the others fail at once instead of hanging,
 * and one that is alive but silent makes every other rank time out;
 * a segment left by a crashed job is reused; the NCCL variant (SKIP without a GPU): device
 * buffers between two host copies, and queued between two ops of the cuda back-end's
 * compute stream (the ordering sync_nccl.c relies on); the NCCL watchdog's judgement (suite
 * `allreduce`, no GPU needed).
 * Inputs are fresh random numbers of mixed magnitude (so summation order shows in the
 * bits); the seed is printed on failure.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "tests/testutil.h"
#include "kernels/device.h"
#include "kernels/kernels.h"
#include "trainer/allreduce.h"

static uint64_t s_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Element i of rank r's input in call c: magnitudes from 2^-8 to 2^8, both signs. */
static float s_val(uint64_t seed, int c, int r, size_t i)
{
    uint64_t h = s_mix(seed ^ s_mix(((uint64_t)c << 48) ^ ((uint64_t)r << 40) ^ i));
    float m = (float)(h >> 40) / (float)(1u << 24) + 0.5f; // [0.5, 1.5)
    int e = (int)((h >> 8) % 17) - 8;
    return ((h & 1) ? -m : m) * ldexpf(1.0f, e);
}

static uint64_t s_seed(void)
{
    return s_mix((uint64_t)time(NULL) ^ ((uint64_t)getpid() << 20) ^ zps_now_ns());
}

static void s_job(char *buf, size_t len, const char *what, uint64_t seed)
{
    snprintf(buf, len, "t-%s-%d-%llx", what, (int)getpid(), (unsigned long long)(seed & 0xffffff));
}

/* Sizes of the calls in a sequence: partial slices, a single element, ring wraps. */
static const size_t s_sizes[] = {1, 17, 4096, 4097, 12345, 40000, 3, 100003, 65536, 7};
#define S_NSIZES (sizeof s_sizes / sizeof s_sizes[0])

/* Runs the sequence on one rank; returns 0 when every result is the fixed-order sum, else a
 * small code naming the call that failed (10 + call index), 1 for a setup failure. */
static int s_rank_sequence(const char *job, int rank, int n, uint64_t seed, size_t slice)
{
    tr_allreduce_opts o = {.slice_floats = slice, .ring = 3, .timeout_ms = 20000};
    tr_allreduce *ar = NULL;
    if (tr_allreduce_new(job, rank, n, 100003, &o, &ar) != ZPS_OK)
        return 1;
    float *buf = malloc(100003 * sizeof *buf);
    int rc = 0;
    for (int c = 0; c < (int)S_NSIZES && !rc; c++) {
        size_t m = s_sizes[c];
        int avg = c % 3 == 1;
        for (size_t i = 0; i < m; i++)
            buf[i] = s_val(seed, c, rank, i);
        if (tr_allreduce_sum(ar, buf, m, avg) != ZPS_OK) {
            rc = 10 + c;
            break;
        }
        for (size_t i = 0; i < m; i++) {
            float want = s_val(seed, c, 0, i);
            for (int r = 1; r < n; r++)
                want += s_val(seed, c, r, i);
            if (avg)
                want /= (float)n;
            if (memcmp(&want, &buf[i], sizeof want) != 0) {
                fprintf(stderr, "rank %d call %d (n=%zu avg=%d) elem %zu: got %.9g want %.9g\n",
                        rank, c, m, avg, i, (double)buf[i], (double)want);
                rc = 10 + c;
                break;
            }
        }
    }
    free(buf);
    tr_allreduce_destroy(&ar);
    return rc;
}

/* ---------------------------------------------------------------- in one process */

Test(allreduce, rejects_bad_arguments)
{
    zps_log_set_level(ZPS_LOG_OFF);
    tr_allreduce *ar = (tr_allreduce *)1;
    cr_assert_eq(tr_allreduce_new("a/b", 0, 2, 10, NULL, &ar), ZPS_ERR_INVALID);
    cr_assert_null(ar);
    cr_assert_eq(tr_allreduce_new("", 0, 2, 10, NULL, &ar), ZPS_ERR_INVALID);
    cr_assert_eq(tr_allreduce_new("ok", 2, 2, 10, NULL, &ar), ZPS_ERR_INVALID);
    cr_assert_eq(tr_allreduce_new("ok", 0, 0, 10, NULL, &ar), ZPS_ERR_INVALID);
    cr_assert_eq(tr_allreduce_new("ok", 0, 65, 10, NULL, &ar), ZPS_ERR_INVALID);
    cr_assert_eq(tr_allreduce_new("ok", 0, 2, 0, NULL, &ar), ZPS_ERR_INVALID);
    tr_allreduce_destroy(&ar);
    tr_allreduce_destroy(NULL);
}

Test(allreduce, one_rank_is_identity_and_checks_sizes, .timeout = 10)
{
    zps_log_set_level(ZPS_LOG_OFF);
    uint64_t seed = s_seed();
    char job[64];
    s_job(job, sizeof job, "one", seed);
    tr_allreduce *ar = NULL;
    cr_assert_eq(tr_allreduce_new(job, 0, 1, 1000, NULL, &ar), ZPS_OK);
    cr_assert_eq(tr_allreduce_size(ar), 1);
    float buf[1000], ref[1000];
    for (int i = 0; i < 1000; i++)
        ref[i] = buf[i] = s_val(seed, 0, 0, (size_t)i);
    cr_assert_eq(tr_allreduce_sum(ar, buf, 1000, 1), ZPS_OK);
    cr_assert_arr_eq(buf, ref, sizeof buf, "seed %llx", (unsigned long long)seed);
    cr_assert_eq(tr_allreduce_sum(ar, buf, 1001, 0), ZPS_ERR_INVALID);
    cr_assert_eq(tr_allreduce_broadcast(ar, buf, 4001, 0), ZPS_ERR_INVALID);
    cr_assert_eq(tr_allreduce_barrier(ar), ZPS_OK);
    tr_allreduce_destroy(&ar);
    cr_assert_null(ar);
}

typedef struct {
    const char *job;
    int rank, n;
    uint64_t seed;
    int rc;
} s_thread_arg;

static void *s_thread_rank(void *p)
{
    s_thread_arg *a = p;
    a->rc = s_rank_sequence(a->job, a->rank, a->n, a->seed, 4096);
    return NULL;
}

/* A test with ranks as threads: quiet log, a fresh seed (returned), job named after what. */
static uint64_t s_thread_job(char *job, size_t len, const char *what)
{
    zps_log_set_level(ZPS_LOG_WARN);
    uint64_t seed = s_seed();
    s_job(job, len, what, seed);
    return seed;
}

/* Runs fn on a[0] and a[1] (each elem bytes apart) in two threads and joins them. */
static void s_two_ranks(void *(*fn)(void *), void *a, size_t elem)
{
    pthread_t th[2];
    for (int r = 0; r < 2; r++)
        cr_assert_eq(pthread_create(&th[r], NULL, fn, (char *)a + (size_t)r * elem), 0);
    for (int r = 0; r < 2; r++)
        pthread_join(th[r], NULL);
}

/* Two ranks as two threads of this process: the whole data path under the sanitizers. */
Test(allreduce, two_threads_as_ranks_match_fixed_order, .timeout = 30)
{
    char job[64];
    uint64_t seed = s_thread_job(job, sizeof job, "thr");
    s_thread_arg a[2];
    for (int r = 0; r < 2; r++)
        a[r] = (s_thread_arg){.job = job, .rank = r, .n = 2, .seed = seed};
    s_two_ranks(s_thread_rank, a, sizeof a[0]);
    for (int r = 0; r < 2; r++)
        cr_assert_eq(a[r].rc, 0, "rank %d failed with %d; seed %llx", r, a[r].rc,
                     (unsigned long long)seed);
}

/* The same name attached again at once (sync_node_dev.c's fallback: the node's ranks leave
 * one segment and meet in a new one of the same name): a fast rank makes the new one while a
 * slow rank has not left the old one yet, and the slow rank's leaving must not remove the
 * new one's name, or the two wait in different segments until the timeout. */
typedef struct s_again_arg {
    const char *job;
    int rank;
    zps_status st[3]; // first attach, second attach, a barrier in the second segment
} s_again_arg;

static void *s_again_rank(void *p)
{
    s_again_arg *a = p;
    tr_allreduce_opts o = {.timeout_ms = 3000};
    tr_allreduce *ar = NULL;
    if ((a->st[0] = tr_allreduce_new(a->job, a->rank, 2, 16, &o, &ar)) != ZPS_OK)
        return NULL;
    if (a->rank == 1) { /* the slow rank: leaves only once the fast one made the new name */
        char path[128];
        snprintf(path, sizeof path, "/dev/shm/zps-ar-%s", a->job);
        for (int k = 0; k < 5000 && access(path, F_OK) != 0; k++)
            usleep(1000);
    }
    tr_allreduce_destroy(&ar);
    if ((a->st[1] = tr_allreduce_new(a->job, a->rank, 2, 16, &o, &ar)) == ZPS_OK)
        a->st[2] = tr_allreduce_barrier(ar);
    tr_allreduce_destroy(&ar);
    return NULL;
}

Test(allreduce, the_same_name_attached_again_at_once, .timeout = 30)
{
    char job[64];
    (void)s_thread_job(job, sizeof job, "again");
    s_again_arg a[2] = {{.job = job, .rank = 0}, {.job = job, .rank = 1}};
    s_two_ranks(s_again_rank, a, sizeof a[0]);
    for (int r = 0; r < 2; r++)
        for (int k = 0; k < 3; k++)
            cr_assert_eq(a[r].st[k], ZPS_OK, "rank %d, %s: %s", r,
                         k == 0 ? "first attach" : k == 1 ? "second attach" : "barrier",
                         zps_strerror(a[r].st[k]));
}

/* A rank refused at attach (its slot is held by a live rank) leaves the job's name alone:
 * the job's missing rank still finds the segment its first rank waits in. */
typedef struct s_dup_arg {
    const char *job;
    zps_status st;
} s_dup_arg;

static void *s_dup_first(void *p)
{
    s_dup_arg *a = p;
    tr_allreduce_opts o = {.timeout_ms = 5000};
    tr_allreduce *ar = NULL;
    a->st = tr_allreduce_new(a->job, 0, 2, 16, &o, &ar);
    tr_allreduce_destroy(&ar);
    return NULL;
}

Test(allreduce, a_refused_rank_leaves_the_jobs_name_alone, .timeout = 30)
{
    char job[64], path[128];
    (void)s_thread_job(job, sizeof job, "dup");
    zps_log_set_level(ZPS_LOG_OFF);
    snprintf(path, sizeof path, "/dev/shm/zps-ar-%s", job);
    s_dup_arg first = {.job = job};
    pthread_t th;
    cr_assert_eq(pthread_create(&th, NULL, s_dup_first, &first), 0);
    for (int k = 0; k < 5000 && access(path, F_OK) != 0; k++) /* rank 0 is in, waiting */
        usleep(1000);
    tr_allreduce_opts o = {.timeout_ms = 5000};
    tr_allreduce *dup = NULL, *second = NULL;
    zps_status st = tr_allreduce_new(job, 0, 2, 16, &o, &dup);
    cr_expect_eq(st, ZPS_ERR_EXISTS, "a second rank 0: %s", zps_strerror(st));
    tr_allreduce_destroy(&dup);
    st = tr_allreduce_new(job, 1, 2, 16, &o, &second);
    tr_allreduce_destroy(&second);
    pthread_join(th, NULL);
    cr_assert_eq(st, ZPS_OK, "rank 1: %s", zps_strerror(st));
    cr_assert_eq(first.st, ZPS_OK, "rank 0: %s", zps_strerror(first.st));
}

/* tr_allreduce_sum_apply: the callback sees every element once, already final (the mean),
 * and what it writes stays (the fused update's contract). */
#define S_APPLY_N 70001 // several slices (small slices below), a ragged end

typedef struct s_apply_arg {
    const char *job;
    int rank;
    uint64_t seed;
    float buf[S_APPLY_N];
    uint8_t seen[S_APPLY_N];
    int bad; // elements not final when handed over
    int rc;
} s_apply_arg;

static void s_apply_cb(void *ctx, float *part, size_t len)
{
    s_apply_arg *a = ctx;
    size_t at = (size_t)(part - a->buf);
    for (size_t i = 0; i < len; i++) {
        float want = (s_val(a->seed, 0, 0, at + i) + s_val(a->seed, 0, 1, at + i)) / 2.0f;
        a->bad += part[i] != want;
        a->seen[at + i]++;
        part[i] = -part[i]; // the update: must survive
    }
}

static void *s_apply_rank(void *p)
{
    s_apply_arg *a = p;
    tr_allreduce_opts o = {.slice_floats = 4096, .ring = 4};
    tr_allreduce *ar;
    a->rc = tr_allreduce_new(a->job, a->rank, 2, S_APPLY_N, &o, &ar);
    if (a->rc != ZPS_OK)
        return NULL;
    for (size_t i = 0; i < S_APPLY_N; i++)
        a->buf[i] = s_val(a->seed, 0, a->rank, i);
    a->rc = tr_allreduce_sum_apply(ar, a->buf, S_APPLY_N, 1, s_apply_cb, a);
    tr_allreduce_destroy(&ar);
    return NULL;
}

Test(allreduce, sum_apply_hands_every_final_element_over_once, .timeout = 30)
{
    char job[64];
    uint64_t seed = s_thread_job(job, sizeof job, "apply");
    static s_apply_arg a[2];
    for (int r = 0; r < 2; r++) {
        memset(&a[r], 0, sizeof a[r]);
        a[r].job = job, a[r].rank = r, a[r].seed = seed;
    }
    s_two_ranks(s_apply_rank, a, sizeof a[0]);
    for (int r = 0; r < 2; r++) {
        cr_assert_eq(a[r].rc, ZPS_OK, "rank %d: %s; seed %llx", r, zps_strerror(a[r].rc),
                     (unsigned long long)seed);
        cr_expect_eq(a[r].bad, 0, "rank %d: %d elements handed over before they were final", r,
                     a[r].bad);
        size_t once = 0;
        for (size_t i = 0; i < S_APPLY_N; i++)
            once += a[r].seen[i] == 1;
        cr_expect_eq(once, S_APPLY_N, "rank %d: %zu elements not handed over exactly once", r,
                     S_APPLY_N - once);
        cr_expect_eq(memcmp(a[0].buf, a[r].buf, sizeof a[r].buf), 0, "rank %d differs", r);
        float want = -(s_val(seed, 0, 0, 5) + s_val(seed, 0, 1, 5)) / 2.0f;
        cr_expect_eq(a[r].buf[5], want, "the callback's update did not stay");
    }
}

/* The NCCL watchdog's judgement on a scripted clock: work that makes progress, or a peer
 * that left after everything finished, never aborts; unfinished work with a peer gone aborts
 * after the grace, and stuck work with live peers after the timeout, each naming why. */
Test(allreduce, nccl_watchdog_aborts_stuck_work_only)
{
    const uint64_t ms = 1000000ull, grace = TR_NCCL_GONE_GRACE_MS * ms;
    const int timeout = 5000;
    char why[256] = "";
    tr_nccl_watch w = {0};
    /* nothing unfinished: fine for ever, with a gone peer too */
    cr_expect_eq(tr_nccl_watch_judge(&w, 1 * ms, 0, 0, -1, timeout, why, sizeof why), 0);
    cr_expect_eq(tr_nccl_watch_judge(&w, 100000 * ms, 0, 7, 1, timeout, why, sizeof why), 0);
    /* two sums unfinished at every look, one finishing per look, 4 s apart: never stuck */
    uint64_t t = 200000 * ms;
    for (uint64_t k = 0; k < 10; k++, t += 4000 * ms)
        cr_expect_eq(tr_nccl_watch_judge(&w, t, 2, 7 + k, -1, timeout, why, sizeof why), 0,
                     "look %d", (int)k);
    /* then stuck, peers alive: not before the timeout since the last progress, then abort */
    uint64_t last = t - 4000 * ms; // the last look saw finished = 16
    cr_expect_eq(tr_nccl_watch_judge(&w, last + (timeout - 1) * ms, 3, 16, -1, timeout, why,
                                     sizeof why), 0);
    cr_expect_eq(tr_nccl_watch_judge(&w, last + timeout * ms, 3, 16, -1, timeout, why,
                                     sizeof why), 1);
    cr_expect(strstr(why, "no NCCL operation of this rank finished for 5000 ms (3 unfinished"),
              "%s", why);
    /* unfinished work and a peer gone: abort after the grace, not before; a look without a
     * gone peer restarts the grace */
    w = (tr_nccl_watch){0};
    t = 500000 * ms;
    cr_expect_eq(tr_nccl_watch_judge(&w, t, 1, 2, 1, timeout, why, sizeof why), 0);
    cr_expect_eq(tr_nccl_watch_judge(&w, t + grace - ms, 1, 2, 1, timeout, why, sizeof why), 0);
    cr_expect_eq(tr_nccl_watch_judge(&w, t + grace, 1, 2, -1, timeout, why, sizeof why), 0);
    cr_expect_eq(tr_nccl_watch_judge(&w, t + grace + ms, 1, 2, 1, timeout, why, sizeof why), 0);
    cr_expect_eq(tr_nccl_watch_judge(&w, t + 2 * grace + ms, 1, 2, 1, timeout, why, sizeof why), 1);
    cr_expect(strstr(why, "peer rank 1 died, left or gave up with 1 NCCL operation(s)"), "%s", why);
    /* the peer's grace is independent of progress: a gone peer aborts even while sums still
     * finish (the rest cannot), and so does a timeout shorter than the grace */
    w = (tr_nccl_watch){0};
    cr_expect_eq(tr_nccl_watch_judge(&w, t, 7, 2, 0, timeout, why, sizeof why), 0);
    cr_expect_eq(tr_nccl_watch_judge(&w, t + grace, 6, 3, 0, timeout, why, sizeof why), 1);
    w = (tr_nccl_watch){0};
    cr_expect_eq(tr_nccl_watch_judge(&w, t, 1, 1, -1, 10, why, sizeof why), 0);
    cr_expect_eq(tr_nccl_watch_judge(&w, t + 10 * ms, 1, 1, -1, 10, why, sizeof why), 1);
}

/* ---------------------------------------------------------------- forked ranks */

/* Forks n children running fn(rank); waits for each by PID; returns exit codes in codes
 * (-signal when killed). */
static void s_fork_ranks(int n, int (*fn)(int rank, void *ctx), void *ctx, int *codes)
{
    pid_t pid[16];
    for (int r = 0; r < n; r++) {
        pid[r] = fork();
        cr_assert_neq(pid[r], -1, "fork");
        if (pid[r] == 0)
            _exit(fn(r, ctx));
    }
    for (int r = 0; r < n; r++) {
        int st = 0;
        cr_assert_eq(waitpid(pid[r], &st, 0), pid[r]);
        codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
    }
}

typedef struct {
    char job[64];
    int n;
    uint64_t seed;
    size_t slice;
} s_seq_ctx;

/* Forks c->n ranks running fn and asserts every one exited 0. */
static void s_ranks_ok(s_seq_ctx *c, int (*fn)(int rank, void *ctx))
{
    int codes[16];
    s_fork_ranks(c->n, fn, c, codes);
    for (int r = 0; r < c->n; r++)
        cr_assert_eq(codes[r], 0, "rank %d exit %d; seed %llx", r, codes[r],
                     (unsigned long long)c->seed);
}

static int s_seq_child(int rank, void *p)
{
    s_seq_ctx *c = p;
    zps_log_set_level(ZPS_LOG_WARN);
    return s_rank_sequence(c->job, rank, c->n, c->seed, c->slice);
}

Test(it_allreduce, three_processes_bit_identical_fixed_order, .timeout = 30)
{
    s_seq_ctx c = {.n = 3, .seed = s_seed(), .slice = 4096};
    s_job(c.job, sizeof c.job, "seq3", c.seed);
    s_ranks_ok(&c, s_seq_child);
}

Test(it_allreduce, two_processes_default_slices, .timeout = 30)
{
    s_seq_ctx c = {.n = 2, .seed = s_seed(), .slice = 0};
    s_job(c.job, sizeof c.job, "seq2", c.seed);
    s_ranks_ok(&c, s_seq_child);
}

/* broadcast of bytes from every root, with barriers between; exit 0 when all arrived */
static int s_bcast_child(int rank, void *p)
{
    s_seq_ctx *c = p;
    zps_log_set_level(ZPS_LOG_WARN);
    tr_allreduce_opts o = {.slice_floats = 1024, .timeout_ms = 20000};
    tr_allreduce *ar = NULL;
    if (tr_allreduce_new(c->job, rank, c->n, 10000, &o, &ar) != ZPS_OK)
        return 1;
    unsigned char buf[40000];
    int rc = 0;
    for (int root = 0; root < c->n && !rc; root++) {
        size_t len = 40000 - 333 * (size_t)root; // not a multiple of the slice
        for (size_t i = 0; i < len; i++)
            buf[i] = rank == root ? (unsigned char)s_mix(c->seed + root * 65536 + i) : 0;
        if (tr_allreduce_broadcast(ar, buf, len, root) != ZPS_OK)
            rc = 2;
        for (size_t i = 0; i < len && !rc; i++)
            if (buf[i] != (unsigned char)s_mix(c->seed + root * 65536 + i))
                rc = 3;
        if (!rc && tr_allreduce_barrier(ar) != ZPS_OK)
            rc = 4;
    }
    tr_allreduce_destroy(&ar);
    return rc;
}

Test(it_allreduce, broadcast_from_every_root, .timeout = 30)
{
    s_seq_ctx c = {.n = 3, .seed = s_seed()};
    s_job(c.job, sizeof c.job, "bc", c.seed);
    s_ranks_ok(&c, s_bcast_child);
}

/* rank 1 attaches and dies (SIGKILL: no clean-up); rank 0's sum must fail fast, with a long
 * timeout configured, so only death detection can end it. Exit 0 when it failed as expected
 * within 5 s. */
static int s_dead_child(int rank, void *p)
{
    s_seq_ctx *c = p;
    zps_log_set_level(ZPS_LOG_OFF);
    tr_allreduce_opts o = {.timeout_ms = 60000};
    tr_allreduce *ar = NULL;
    if (tr_allreduce_new(c->job, rank, 2, 1 << 20, &o, &ar) != ZPS_OK)
        return 1;
    if (rank == 1)
        raise(SIGKILL);
    float *buf = calloc(1 << 20, sizeof *buf);
    for (int i = 0; i < 1 << 20; i++)
        buf[i] = s_val(c->seed, 0, 0, (size_t)i);
    uint64_t t0 = zps_now_ns();
    zps_status st = tr_allreduce_sum(ar, buf, 1 << 20, 0);
    double dt = (double)(zps_now_ns() - t0) * 1e-9;
    /* the object is now broken: later calls fail at once */
    zps_status st2 = tr_allreduce_sum(ar, buf, 16, 0);
    free(buf);
    tr_allreduce_destroy(&ar);
    if (st != ZPS_ERR_TIMEOUT || st2 != ZPS_ERR_TIMEOUT)
        return 2;
    return dt < 5.0 ? 0 : 3;
}

Test(it_allreduce, dead_peer_is_an_error_not_a_hang, .timeout = 30)
{
    s_seq_ctx c = {.n = 2, .seed = s_seed()};
    s_job(c.job, sizeof c.job, "dead", c.seed);
    int codes[2];
    s_fork_ranks(2, s_dead_child, &c, codes);
    cr_assert_eq(codes[1], -SIGKILL);
    cr_assert_eq(codes[0], 0, "surviving rank exit %d (2: wrong status, 3: too slow)", codes[0]);
}

/* rank 2 attaches, then stays alive but silent (blocked reading a pipe the parent holds);
 * ranks 0 and 1 have a 500 ms timeout: both must give up (one by its own timeout, or by the
 * job-broken flag the other sets) instead of hanging. Exit 0 when that happened in time. */
static int s_silent_pipe[2];

static int s_silent_child(int rank, void *p)
{
    s_seq_ctx *c = p;
    zps_log_set_level(ZPS_LOG_OFF);
    tr_allreduce_opts o = {.timeout_ms = 500};
    tr_allreduce *ar = NULL;
    close(s_silent_pipe[1]);
    if (tr_allreduce_new(c->job, rank, 3, 4096, &o, &ar) != ZPS_OK)
        return 1;
    if (rank == 2) {
        char b;
        while (read(s_silent_pipe[0], &b, 1) > 0)
            ;
        tr_allreduce_destroy(&ar);
        return 0;
    }
    float buf[4096];
    for (int i = 0; i < 4096; i++)
        buf[i] = s_val(c->seed, 0, rank, (size_t)i);
    uint64_t t0 = zps_now_ns();
    zps_status st = tr_allreduce_sum(ar, buf, 4096, 0);
    double dt = (double)(zps_now_ns() - t0) * 1e-9;
    tr_allreduce_destroy(&ar);
    if (st != ZPS_ERR_TIMEOUT)
        return 2;
    return dt >= 0.45 && dt < 5.0 ? 0 : 3;
}

Test(it_allreduce, silent_peer_times_out_for_everyone, .timeout = 30)
{
    s_seq_ctx c = {.n = 3, .seed = s_seed()};
    s_job(c.job, sizeof c.job, "silent", c.seed);
    cr_assert_eq(pipe(s_silent_pipe), 0);
    pid_t pid[3];
    for (int r = 0; r < 3; r++) {
        pid[r] = fork();
        cr_assert_neq(pid[r], -1);
        if (pid[r] == 0)
            _exit(s_silent_child(r, &c));
    }
    close(s_silent_pipe[0]);
    int codes[3];
    for (int r = 0; r < 2; r++) {
        int st = 0;
        cr_assert_eq(waitpid(pid[r], &st, 0), pid[r]);
        codes[r] = WIFEXITED(st) ? WEXITSTATUS(st) : -WTERMSIG(st);
    }
    close(s_silent_pipe[1]); // rank 2 reads EOF and leaves
    int st = 0;
    cr_assert_eq(waitpid(pid[2], &st, 0), pid[2]);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "silent rank status %d", st);
    for (int r = 0; r < 2; r++)
        cr_assert_eq(codes[r], 0, "rank %d exit %d (2: wrong status, 3: took too long)", r,
                     codes[r]);
}

Test(it_allreduce, missing_peer_times_out_at_attach, .timeout = 10)
{
    zps_log_set_level(ZPS_LOG_OFF);
    uint64_t seed = s_seed();
    char job[64];
    s_job(job, sizeof job, "miss", seed);
    tr_allreduce_opts o = {.timeout_ms = 300};
    tr_allreduce *ar = NULL;
    uint64_t t0 = zps_now_ns();
    cr_assert_eq(tr_allreduce_new(job, 0, 2, 1000, &o, &ar), ZPS_ERR_TIMEOUT);
    double dt = (double)(zps_now_ns() - t0) * 1e-9;
    cr_assert(dt >= 0.25 && dt < 3.0, "attach timeout took %.3f s", dt);
    cr_assert_null(ar);
}

/* A job whose rank 0 attached and was killed before rank 1 came leaves its segment behind;
 * a new job with the same name must reuse it (stale) and work. */
static int s_crash_attach_child(int rank, void *p)
{
    s_seq_ctx *c = p;
    (void)rank;
    zps_log_set_level(ZPS_LOG_OFF);
    tr_allreduce_opts o = {.timeout_ms = 60000};
    tr_allreduce *ar = NULL;
    /* blocks in the attach wait (rank 1 never comes) until the parent kills us */
    tr_allreduce_new(c->job, 0, 2, 5000, &o, &ar);
    return 9;
}

Test(it_allreduce, stale_segment_from_crashed_job_is_reused, .timeout = 30)
{
    s_seq_ctx c = {.n = 2, .seed = s_seed(), .slice = 0};
    s_job(c.job, sizeof c.job, "stale", c.seed);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0)
        _exit(s_crash_attach_child(0, &c));
    /* kill the child once it is registered and waiting for its peer */
    char path[128];
    snprintf(path, sizeof path, "/dev/shm/zps-ar-%s", c.job);
    /* the child initialises and registers in one section under flock on the segment: once
     * we hold that lock and the segment has a size, the child is registered (a dead holder
     * is what the next job must recognise as stale) */
    uint64_t t0 = zps_now_ns();
    for (;;) {
        cr_assert(zps_now_ns() - t0 < 5000000000ull, "the child never registered");
        int fd = open(path, O_RDWR);
        if (fd < 0) {
            sched_yield();
            continue;
        }
        struct stat sb;
        cr_assert_eq(flock(fd, LOCK_EX), 0);
        cr_assert_eq(fstat(fd, &sb), 0);
        flock(fd, LOCK_UN);
        close(fd);
        if (sb.st_size > 0)
            break;
        sched_yield();
    }
    kill(pid, SIGKILL);
    int st;
    cr_assert_eq(waitpid(pid, &st, 0), pid);
    cr_assert(access(path, F_OK) == 0, "crashed job's segment should still exist");
    s_ranks_ok(&c, s_seq_child);
    cr_assert(access(path, F_OK) != 0, "segment name should be unlinked after the job");
}

/* The CUDA library built beside $ZPS_BIN's programs, unless ZPS_CUDA_LIB names one. */
static void s_use_built_cuda_lib(void)
{
    const char *bin = getenv("ZPS_BIN");
    if (bin) {
        char lib[4096];
        snprintf(lib, sizeof lib, "%s/../lib/libzps_cuda.so", bin);
        setenv("ZPS_CUDA_LIB", lib, 0);
    }
}

/* A forked rank's segment and communicator on GPU `rank` (the back-end's device is the
 * communicator's): 0, or the child's exit code (77: no GPU, 1 segment, 2 NCCL). */
static int s_nccl_open(const s_seq_ctx *c, int rank, tr_allreduce **ar, tr_nccl **nc)
{
    zps_log_set_level(ZPS_LOG_OFF);
    k_device_use_gpu(rank);
    if (tr_allreduce_new(c->job, rank, c->n, 1 << 16, NULL, ar) != ZPS_OK)
        return 1;
    zps_status st = tr_nccl_new(*ar, rank, nc);
    if (st == ZPS_ERR_NO_DEVICE) {
        tr_allreduce_destroy(ar);
        return 77;
    }
    return st == ZPS_OK ? 0 : 2;
}

/* NCCL across forked ranks; exit 77 when there is no GPU (or too few for n ranks). */
static int s_nccl_child(int rank, void *p)
{
    s_seq_ctx *c = p;
    tr_allreduce *ar = NULL;
    tr_nccl *nc = NULL;
    int open_rc = s_nccl_open(c, rank, &ar, &nc);
    if (open_rc)
        return open_rc;
    float buf[4096];
    for (int i = 0; i < 4096; i++)
        buf[i] = s_val(c->seed, 0, rank, (size_t)i);
    float dbl[4096];
    for (int i = 0; i < 4096; i++)
        dbl[i] = 2 * buf[i];
    /* the sum as queued between two host copies (the copy out waits for the join), then
     * ordered by the compute stream both ways: x 0.5 on the compute stream, then the sum,
     * then x 2 on the compute stream */
    const k_backend *be = k_backend_cuda(NULL, 0);
    float *d = be ? be->alloc(sizeof dbl) : NULL;
    int rc = 0;
    if (!d || be->copy_in(d, buf, sizeof buf) != ZPS_OK ||
        tr_nccl_sum_device_async(nc, d, 4096, 0) != ZPS_OK || tr_nccl_join(nc) != ZPS_OK ||
        be->copy_out(buf, d, sizeof buf) != ZPS_OK)
        rc = 3;
    if (!rc && (be->copy_in(d, dbl, sizeof dbl) != ZPS_OK ||
                k_scale(be, 4096, 0.5f, d) != ZPS_OK ||
                tr_nccl_sum_device_async(nc, d, 4096, 0) != ZPS_OK ||
                tr_nccl_join(nc) != ZPS_OK || k_scale(be, 4096, 2.0f, d) != ZPS_OK ||
                be->copy_out(dbl, d, sizeof dbl) != ZPS_OK))
        rc = 5;
    for (int i = 0; i < 4096 && !rc; i++) {
        float want = 0;
        for (int r = 0; r < c->n; r++)
            want += s_val(c->seed, 0, r, (size_t)i);
        if (fabsf(buf[i] - want) > 1e-5f + 1e-5f * fabsf(want))
            rc = 4;
        if (fabsf(dbl[i] - 2 * want) > 2e-5f + 1e-5f * fabsf(2 * want))
            rc = 6;
    }
    if (d)
        be->free(d);
    tr_nccl_destroy(&nc);
    tr_allreduce_destroy(&ar);
    return rc;
}

/* fn as one rank in a child, on the built CUDA library; its exit code (the test skips, saying
 * `what` did not run, when the child found no device: 77). */
static int s_one_gpu_rank(s_seq_ctx *c, const char *job, int (*fn)(int, void *),
                          const char *what)
{
    *c = (s_seq_ctx){.n = 1, .seed = s_seed()};
    s_use_built_cuda_lib();
    s_job(c->job, sizeof c->job, job, c->seed);
    int code;
    s_fork_ranks(1, fn, c, &code);
    if (code == 77) {
        ZPS_GPU_SKIP("no CUDA device (or no CUDA library): %s not run", what);
    }
    return code;
}

Test(it_gpu_nccl, allreduce_matches_the_sum, .timeout = 60)
{
    s_seq_ctx c;
    int rc = s_one_gpu_rank(&c, "nccl", s_nccl_child, "NCCL all-reduce"); // any single GPU
    cr_assert_eq(rc, 0, "1-rank NCCL exit %d", rc);
    int codes[2];
    c.n = 2;
    s_job(c.job, sizeof c.job, "nccl2", c.seed);
    s_fork_ranks(2, s_nccl_child, &c, codes);
    if (codes[0] == 77 || codes[1] == 77) { /* what one GPU can prove passed above */
        cr_log_info("fewer than 2 CUDA devices: the 2-rank NCCL all-reduce did not run");
        return;
    }
    cr_assert(codes[0] == 0 && codes[1] == 0, "2-rank NCCL exits %d %d", codes[0], codes[1]);
}

/* One rank whose queued sum cannot finish in time: the compute stream holds ~100 large
 * matrix products, and NCCL's sum waits for them, while the timeout is 10 ms. The
 * watchdog must abort the communicator (later calls fail with ZPS_ERR_NCCL), the compute
 * stream must drain, and destroy must return: no hang anywhere (the test's timeout). */
static int s_nccl_stuck_child(int rank, void *p)
{
    s_seq_ctx *c = p;
    zps_status st;
    tr_allreduce *ar = NULL;
    tr_nccl *nc = NULL;
    int open_rc = s_nccl_open(c, rank, &ar, &nc);
    if (open_rc)
        return open_rc;
    enum { N = 8192 };
    const k_backend *be = k_backend_cuda(NULL, 0);
    size_t bytes = (size_t)N * N * sizeof(float);
    float *x = be ? be->alloc(bytes) : NULL, *w = be ? be->alloc(bytes) : NULL;
    float *y = be ? be->alloc(bytes) : NULL, *g = be ? be->alloc(4096 * sizeof(float)) : NULL;
    k_dense d = {.n = N, .in = N, .out = N};
    int rc = !x || !w || !y || !g ? 3 : 0;
    if (!rc && (k_fill(be, (size_t)N * N, 1e-3f, x) != ZPS_OK ||
                k_fill(be, (size_t)N * N, 1e-3f, w) != ZPS_OK ||
                k_fill(be, 4096, 1.0f, g) != ZPS_OK))
        rc = 4;
    /* a first sum with the default timeout (NCCL loads its kernels then), waited for */
    float one;
    if (!rc && (tr_nccl_sum_device_async(nc, g, 4096, 0) != ZPS_OK || tr_nccl_join(nc) != ZPS_OK ||
                be->copy_out(&one, g, sizeof one) != ZPS_OK || tr_nccl_drain(nc) != ZPS_OK))
        rc = 6;
    tr_nccl_set_timeout(nc, 10);
    for (int i = 0; i < 100 && !rc; i++)
        if (k_dense_fwd(be, &d, x, w, NULL, y) != ZPS_OK)
            rc = 5;
    /* the sum behind the products: the verdict comes in its own settling (if that took
     * 10 ms) or within a few of the watchdog's 100 ms looks */
    st = rc ? ZPS_OK : tr_nccl_sum_device_async(nc, g, 4096, 0);
    if (!rc && st == ZPS_OK)
        st = tr_nccl_join(nc);
    uint64_t end = zps_now_ns() + 20000000000ull;
    while (!rc && st == ZPS_OK && zps_now_ns() < end) {
        struct timespec ts = {0, 1000000L};
        nanosleep(&ts, NULL);
        st = tr_nccl_join(nc);
    }
    if (!rc && st != ZPS_ERR_NCCL)
        rc = 7; // never aborted
    if (!rc && be->copy_out(&one, g, sizeof one) != ZPS_OK) // the compute stream drains
        rc = 8;
    k_op_release(be, &d.impl);
    if (be) {
        be->free(x);
        be->free(w);
        be->free(y);
        be->free(g);
    }
    tr_nccl_destroy(&nc);
    tr_allreduce_destroy(&ar);
    return rc;
}

Test(it_gpu_nccl, watchdog_aborts_a_step_stuck_past_the_timeout, .timeout = 60)
{
    s_seq_ctx c;
    int rc = s_one_gpu_rank(&c, "nccl-stuck", s_nccl_stuck_child, "NCCL watchdog");
    cr_assert_eq(rc, 0, "exit %d (3 alloc, 4 fill, 5 matmul, 6 first sum, 7 never aborted, "
                 "8 compute stream)", rc);
}
