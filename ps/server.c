/* server.c — see server.h and docs/ps.md.
 *
 * Invariants:
 *   - A request is checked completely (s_check_*) before anything changes; handlers that
 *     reach the "apply" part cannot fail.
 *   - Chunk c's values, slots and version change together, only in s_apply_* (one thread).
 *   - sync: recv[c * N + t] counts the elements trainer t pushed for chunk c at the chunk's
 *     current version; t is complete when it equals the chunk's count. When
 *     max(1, min(R, live)) trainers are complete, their gradients are summed in trainer-id
 *     order, divided by that number, applied, and every recv of the chunk is reset.
 *   - Memory that a request or reply needs on the hot path is allocated once and reused:
 *     the frame array, the scratch gradient, the per-trainer accumulators. Pull replies
 *     are sent zero-copy from the values; readers[c] counts frames zmq still holds, and
 *     chunk c is not updated while it is non-zero (s_wait_readers, s_cow).
 */
#include "ps/server.h"

#include <assert.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/mem.h"
#include "common/proto.h"
#include "common/simd.h"
#include "ps/ckpt.h"
#include "ps/dtype.h"
#include "ps/curve.h"
#include "ps/optim.h"

#define S_MAX_FRAMES (PS_MAX_RANGES + 2)
#define S_RID_RING 64
#define S_LAT_BUCKETS 96
#define S_N_OPS 12
#define S_STALE_BUCKETS 8
/* Reply frames at least this large are sent zero-copy from the values (s_wait_readers). */
#define S_ZC_MIN 16384

static const char *const s_op_names[S_N_OPS] = {"unknown", "register", "init", "push", "pull",
                                                 "pushpull", "barrier", "heartbeat",
                                                 "checkpoint", "stats", "shutdown", "leave"};
static const char *const s_mode_names[4] = {"unset", "sync", "async", "ssp"};

typedef struct s_lchunk {
    uint32_t key;
    uint64_t count;      // elements
    uint64_t off;        // first element in the local flat buffers
    uint64_t version;    // updates applied
    uint32_t n_complete; // sync: trainers complete at `version`
} s_lchunk;

/* sync: one pushed range kept until its chunk is applied. Large aligned frames are kept as
 * they arrived (a reference to ZeroMQ's receive buffer, no copy); small or misaligned ones
 * are copied into the trainer's accum. */
typedef struct s_held {
    uint32_t lc;        // local chunk
    uint64_t off, n;    // element offset in the chunk, count
    const float *data;  // the gradient: into msg's buffer or into accum
    int has_msg;
    zmq_msg_t msg;      // a reference to the frame (has_msg)
} s_held;

typedef struct s_trainer {
    int registered;
    int dropped;             // silent past --trainer-timeout, or left (sync/ssp: not waited for)
    int left;                // sent LEAVE: heartbeats and barriers do not bring it back
    uint64_t last_seen_ns;
    int64_t clock;           // steps completed: max pushed step + 1
    float *accum;            // sync: (local_total) small or misaligned pushed ranges
    uint64_t *covered;       // sync: (local_total bits) elements pushed at their chunk's version
    s_held *held;            // sync: ranges pushed for chunks not applied yet
    size_t n_held, cap_held;
    uint64_t rid[S_RID_RING];    // recent push request ids (0 = empty)
    int32_t rid_status[S_RID_RING];
    unsigned rid_pos;
} s_trainer;

/* A validated range: local chunk index, element offset and count, payload (push). */
typedef struct s_range {
    uint32_t lc;
    uint64_t off;
    uint64_t n;
    const void *data;  // push: the payload frame's bytes (NULL for a pull), any alignment
    int bf16;          // the payload is bfloat16 (ps_client_opts.push_dtype), else f32
    uint64_t version;  // async/ssp push: the chunk's version the range is applied at
} s_range;

/* A request whose reply waits: sync/ssp pulls and barriers. */
typedef struct s_pending {
    zmq_msg_t ident;
    uint64_t rid;
    uint32_t trainer;
    int op;
    int64_t need;       // the condition's threshold (version or clock)
    uint32_t n_ranges;
    s_range *ranges;    // owned
    uint64_t t0_ns;
} s_pending;

typedef struct s_stats {
    uint64_t requests[S_N_OPS];
    uint64_t pushes, pulls;        // ranges pushed / pulled
    uint64_t bytes_in, bytes_out;  // payload bytes
    uint64_t updates;              // chunk updates applied
    uint64_t stale_dropped;        // push ranges dropped as stale (and partial sync data)
    uint64_t rejected[ZPS_STATUS_COUNT];
    uint64_t rejected_total;
    uint64_t staleness[S_STALE_BUCKETS]; // 0,1,2,3,4-7,8-15,16-31,32+
    uint64_t lat[S_N_OPS][S_LAT_BUCKETS];
    uint64_t checkpoints;
    uint64_t trainers_dropped, trainers_rejoined, trainers_left;
    uint64_t reader_waits; // updates that waited for zmq to finish sending the old values
    uint64_t values_cow;   // waits that gave up: values moved to a fresh copy (stuck peer)
} s_stats;

struct ps_server {
    ps_server_config cfg;
    void *ctx;
    void *sock;
    char endpoint[512];
    volatile sig_atomic_t stop;

    /* job */
    ps_mode mode;
    uint32_t n_trainers;  // 0 until known
    uint32_t replicas;    // 0 = n_trainers
    int staleness;
    s_trainer *trainers;  // (n_trainers)

    /* plan summary, known from the first REGISTER / INIT / checkpoint */
    int have_plan;
    uint64_t plan_hash;
    uint32_t plan_vars, plan_servers, num_chunks;
    uint64_t plan_total, plan_chunk_bytes;
    char plan_src[64];

    /* shard */
    int initialised;
    ps_optim_config opt;
    int n_slots;
    uint32_t n_local;
    s_lchunk *chunks;     // (n_local) in key order
    int32_t *key_to_local; // (num_chunks), -1 when not ours
    uint64_t local_total, max_chunk;
    float *values;        // (local_total)
    float *slots[2];      // (local_total) each
    uint32_t *recv_n;     // sync/async: (n_local * n_trainers) elements received (uint64 not needed: chunk <= 2^32)
    float *scratch;       // (max_chunk) averaged gradient / unaligned input
    atomic_int *readers;  // (n_local) reply frames zmq still reads from the chunk's values
    struct s_retired *retired; // old values blocks zmq still sends from (see s_cow)
    uint64_t init_version_base;

    /* requests */
    zmq_msg_t *frames;    // (S_MAX_FRAMES), reused
    s_range *ranges;      // (PS_MAX_RANGES), reused
    s_pending *pending;
    size_t n_pending, cap_pending;

    /* checkpoints and timers */
    uint64_t last_ckpt_version;
    double last_ckpt_s, last_stats_s, last_liveness_s;
    s_stats st;

    ps_curve_zap *zap;    // CURVE: the ZAP handler thread (NULL: plaintext)
};

/* ------------------------------------------------------------------------- helpers */

void ps_server_config_default(ps_server_config *c)
{
    memset(c, 0, sizeof *c);
    snprintf(c->bind, sizeof c->bind, "tcp://127.0.0.1:0");
    c->staleness = -1;
    c->max_message_bytes = 1ull << 30;
    c->stats_every_s = 30;
    c->io_threads = 1;
}

static unsigned s_lat_bucket(uint64_t ns)
{
    double us = (double)ns / 1000.0;
    int b = (int)(4.0 * log2(us + 1.0));
    return b < 0 ? 0 : b >= S_LAT_BUCKETS ? S_LAT_BUCKETS - 1 : (unsigned)b;
}

/* Upper edge of bucket b in microseconds. */
static double s_lat_edge(unsigned b) { return exp2((double)(b + 1) / 4.0) - 1.0; }

static double s_lat_pct(const uint64_t *h, double p)
{
    uint64_t n = 0;
    for (int i = 0; i < S_LAT_BUCKETS; i++)
        n += h[i];
    if (!n)
        return 0;
    uint64_t want = (uint64_t)ceil(p / 100.0 * (double)n), acc = 0;
    for (unsigned i = 0; i < S_LAT_BUCKETS; i++) {
        acc += h[i];
        if (acc >= want && acc)
            return s_lat_edge(i);
    }
    return s_lat_edge(S_LAT_BUCKETS - 1);
}

static uint64_t s_min_version(const ps_server *s)
{
    if (!s->n_local)
        return 0;
    uint64_t v = UINT64_MAX;
    for (uint32_t i = 0; i < s->n_local; i++)
        if (s->chunks[i].version < v)
            v = s->chunks[i].version;
    return v;
}

static uint32_t s_live(const ps_server *s)
{
    uint32_t n = 0;
    for (uint32_t t = 0; t < s->n_trainers; t++)
        n += !s->trainers[t].dropped;
    return n;
}

static uint32_t s_need_replicas(const ps_server *s)
{
    uint32_t r = s->replicas ? s->replicas : s->n_trainers, live = s_live(s);
    if (live < r)
        r = live;
    return r ? r : 1;
}

static int64_t s_min_clock(const ps_server *s)
{
    int64_t m = INT64_MAX;
    for (uint32_t t = 0; t < s->n_trainers; t++)
        if (!s->trainers[t].dropped && s->trainers[t].clock < m)
            m = s->trainers[t].clock;
    return m == INT64_MAX ? 0 : m;
}

static int64_t s_max_clock(const ps_server *s)
{
    int64_t m = 0;
    for (uint32_t t = 0; t < s->n_trainers; t++)
        if (s->trainers[t].clock > m)
            m = s->trainers[t].clock;
    return m;
}

static void s_reader_done(void *data, void *hint)
{
    (void)data;
    atomic_fetch_sub((atomic_int *)hint, 1);
}

/* A values block (and its reader counts) replaced while zmq still sent from it. */
typedef struct s_retired {
    float *values;
    atomic_int *readers; // (n)
    uint32_t n;
    struct s_retired *next;
} s_retired;

static int s_all_zero(const atomic_int *r, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (atomic_load(&r[i]))
            return 0;
    return 1;
}

/* Frees retired blocks zmq has let go of. */
static void s_reap_retired(ps_server *s)
{
    for (s_retired **pp = &s->retired; *pp;) {
        s_retired *r = *pp;
        if (!s_all_zero(r->readers, r->n)) {
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        zps_aligned_free(r->values);
        free(r->readers);
        free(r);
    }
}

/* Copy-on-write of the whole values block: the old block stays alive (retired) for the
 * frames still in zmq, updates go to a fresh copy. Only for a peer that stopped reading. */
static void s_cow(ps_server *s)
{
    s_retired *r = zps_xcalloc(1, sizeof *r);
    r->values = s->values;
    r->readers = s->readers;
    r->n = s->n_local;
    r->next = s->retired;
    s->retired = r;
    s->values = zps_xaligned(64, s->local_total * 4 + 64);
    memcpy(s->values, r->values, s->local_total * 4);
    s->readers = zps_xcalloc(s->n_local ? s->n_local : 1, sizeof *s->readers);
    s->st.values_cow++;
    zps_log(ZPS_WARN, "ps", "a peer is not reading its pull replies: values moved to a fresh copy");
}

/* Before chunk lc's values change: zmq may still be sending them zero-copy. Normally it is
 * done long before the next push arrives; wait a little, and if a peer has stopped
 * reading, copy the values aside instead of waiting for it. */
static void s_wait_readers(ps_server *s, uint32_t lc)
{
    if (atomic_load(&s->readers[lc]) == 0)
        return;
    s->st.reader_waits++;
    for (int spins = 0; atomic_load(&s->readers[lc]) > 0; spins++) {
        if (spins == 300) {
            s_cow(s);
            return;
        }
        zps_sleep_ns(spins < 100 ? 20000 : 1000000);
    }
}

/* ------------------------------------------------------------------------- replies */

typedef struct s_reply {
    int op;
    uint64_t rid;
    int status;
    const char *msg;
    uint64_t version;
    int with_job;
    int with_opt;
} s_reply;

static zps_status s_send_header(ps_server *s, const Zps__Header *h, int more)
{
    size_t n = zps__header__get_packed_size(h);
    zmq_msg_t m;
    ZPS_CHECK_ZMQ(zmq_msg_init_size(&m, n));
    zps__header__pack(h, zmq_msg_data(&m));
    if (zmq_msg_send(&m, s->sock, more ? ZMQ_SNDMORE : 0) == -1) {
        zmq_msg_close(&m);
        ZPS_CHECK_ZMQ(-1);
    }
    return ZPS_OK;
}

/* Sends one reply to ident (not consumed); ranges (may be NULL) become the payload frames,
 * copied from the current values. */
static zps_status s_send(ps_server *s, zmq_msg_t *ident, const s_reply *r, const s_range *ranges,
                         uint32_t n_ranges)
{
    Zps__Header h = ZPS__HEADER__INIT;
    Zps__JobConfig job = ZPS__JOB_CONFIG__INIT;
    Zps__OptimizerConfig opt;
    Zps__Schedule sch;
    h.version = ZPS_PROTOCOL_VERSION;
    h.op = (Zps__Op)r->op;
    h.request_id = r->rid;
    h.is_reply = 1;
    h.status = r->status;
    h.message = (char *)(r->msg ? r->msg : "");
    h.model_version = r->version;
    h.server_index = (uint32_t)s->cfg.index;
    h.plan_hash = s->plan_hash;
    if (r->with_job) {
        job.mode = (Zps__Mode)s->mode;
        job.num_trainers = s->n_trainers;
        job.replicas_to_aggregate = s->replicas ? s->replicas : s->n_trainers;
        job.staleness = s->staleness > 0 ? (uint32_t)s->staleness : 0;
        job.chunk_bytes = s->plan_chunk_bytes;
        job.num_servers = s->plan_servers;
        job.num_variables = s->plan_vars;
        job.total_count = s->plan_total;
        job.num_chunks = s->num_chunks;
        h.job = &job;
    }
    if (r->with_opt && s->initialised) {
        ps_optim_to_proto(&s->opt, &opt, &sch);
        h.optimizer = &opt;
    }
    zmq_msg_t id;
    ZPS_CHECK_ZMQ(zmq_msg_init(&id));
    ZPS_CHECK_ZMQ(zmq_msg_copy(&id, ident));
    if (zmq_msg_send(&id, s->sock, ZMQ_SNDMORE) == -1) {
        zmq_msg_close(&id);
        ZPS_CHECK_ZMQ(-1);
    }
    ZPS_TRY(s_send_header(s, &h, n_ranges > 0));
    if (!n_ranges)
        return ZPS_OK;
    size_t total = 0;
    for (uint32_t i = 0; i < n_ranges; i++)
        total += ranges[i].n * 4;
    for (uint32_t i = 0; i < n_ranges; i++) {
        const s_range *g = &ranges[i];
        const float *src = s->values + s->chunks[g->lc].off + g->off;
        size_t nb = g->n * 4;
        zmq_msg_t m;
        if (nb >= S_ZC_MIN) {
            /* Zero-copy from the values; s_wait_readers holds updates of this chunk back
             * until zmq has sent them. */
            atomic_fetch_add(&s->readers[g->lc], 1);
            if (zmq_msg_init_data(&m, (void *)src, nb, s_reader_done, &s->readers[g->lc]) == -1) {
                atomic_fetch_sub(&s->readers[g->lc], 1);
                ZPS_CHECK_ZMQ(-1);
            }
        } else {
            ZPS_CHECK_ZMQ(zmq_msg_init_size(&m, nb));
            memcpy(zmq_msg_data(&m), src, nb);
        }
        if (zmq_msg_send(&m, s->sock, i + 1 < n_ranges ? ZMQ_SNDMORE : 0) == -1) {
            zmq_msg_close(&m);
            ZPS_CHECK_ZMQ(-1);
        }
    }
    s->st.bytes_out += total;
    s->st.pulls += n_ranges;
    return ZPS_OK;
}

static void s_latency(ps_server *s, int op, uint64_t t0)
{
    if (op < 0 || op >= S_N_OPS)
        op = 0;
    s->st.lat[op][s_lat_bucket(zps_now_ns() - t0)]++;
}

/* Error reply: counts the rejection, logs at debug (a flood must not fill the log). */
static void s_reject(ps_server *s, zmq_msg_t *ident, int op, uint64_t rid, zps_status st,
                     const char *why)
{
    int idx = -(int)st;
    if (idx > 0 && idx < ZPS_STATUS_COUNT)
        s->st.rejected[idx]++;
    s->st.rejected_total++;
    zps_log(ZPS_DEBUG, "ps", "rejected %s request %" PRIu64 ": %s: %s",
            (op >= 0 && op < S_N_OPS) ? s_op_names[op] : "?", rid, zps_status_name(st), why);
    s_reply r = {op, rid, st, why, s_min_version(s), 0, 0};
    if (s_send(s, ident, &r, NULL, 0) != ZPS_OK)
        zps_log(ZPS_WARN, "ps", "could not send an error reply");
}

/* ------------------------------------------------------------------------- state */

/* Drops the trainer's held ranges of local chunk lc (UINT32_MAX: all). */
static void s_held_release(s_trainer *tr, uint32_t lc)
{
    size_t k = 0;
    for (size_t i = 0; i < tr->n_held; i++) {
        s_held *e = &tr->held[i];
        if (lc == UINT32_MAX || e->lc == lc) {
            if (e->has_msg)
                zmq_msg_close(&e->msg);
            continue;
        }
        if (k != i) {
            tr->held[k] = *e;
            if (e->has_msg) {
                zmq_msg_init(&tr->held[k].msg);
                zmq_msg_move(&tr->held[k].msg, &e->msg);
            }
        }
        k++;
    }
    tr->n_held = k;
}

/* Bits [lo, hi) of a bitmap: any set? */
static int s_bits_any(const uint64_t *w, uint64_t lo, uint64_t hi)
{
    for (uint64_t i = lo; i < hi;) {
        if (i % 64 == 0 && hi - i >= 64) {
            if (w[i / 64])
                return 1;
            i += 64;
        } else {
            if (w[i / 64] >> (i % 64) & 1)
                return 1;
            i++;
        }
    }
    return 0;
}

/* Sets (v = 1) or clears bits [lo, hi). */
static void s_bits_put(uint64_t *w, uint64_t lo, uint64_t hi, int v)
{
    for (uint64_t i = lo; i < hi;) {
        if (i % 64 == 0 && hi - i >= 64) {
            w[i / 64] = v ? ~0ull : 0;
            i += 64;
        } else {
            if (v)
                w[i / 64] |= 1ull << (i % 64);
            else
                w[i / 64] &= ~(1ull << (i % 64));
            i++;
        }
    }
}

/* Values [b, b + k) of pushed range g as f32 into dst: widened (bf16) or copied. */
static void s_range_to_f32(const s_range *g, uint64_t b, uint64_t k, float *dst)
{
    if (g->bf16)
        ps_bf16_to_f32(dst, (const uint8_t *)g->data + 2 * b, k);
    else
        memcpy(dst, (const uint8_t *)g->data + 4 * b, k * 4);
}

/* The frame of g can be read as f32 where it lies: f32 and float-aligned (ZeroMQ keeps
 * frames of up to 33 bytes inside the message, at any address). */
static int s_range_in_place(const s_range *g)
{
    return !g->bf16 && (uintptr_t)g->data % sizeof(float) == 0;
}

/* Frames at least this large and float-aligned are held by reference (s_held). */
#define S_HOLD_MIN 4096

/* Keeps the pushed range g (frame f) of trainer tr until its chunk is applied. */
static void s_held_add(ps_server *s, s_trainer *tr, const s_range *g, zmq_msg_t *f)
{
    if (tr->n_held == tr->cap_held) {
        tr->cap_held = tr->cap_held ? 2 * tr->cap_held : 64;
        /* realloc moves the zmq_msg_t bytes: safe for the frames held here, whose data is
         * never inside the zmq_msg_t (only frames of up to 33 bytes are, S_HOLD_MIN) */
        tr->held = zps_xrealloc(tr->held, tr->cap_held * sizeof *tr->held);
    }
    s_held *e = &tr->held[tr->n_held];
    e->lc = g->lc, e->off = g->off, e->n = g->n, e->has_msg = 0;
    if (s_range_in_place(g) && g->n * 4 >= S_HOLD_MIN && zmq_msg_init(&e->msg) == 0) {
        if (zmq_msg_copy(&e->msg, f) == 0) { // shares the buffer: no copy
            e->has_msg = 1;
            e->data = zmq_msg_data(&e->msg);
        } else {
            zmq_msg_close(&e->msg);
        }
    }
    if (!e->has_msg) {
        if (!tr->accum)
            tr->accum = zps_xaligned(64, s->local_total * 4 + 64);
        float *dst = tr->accum + s->chunks[g->lc].off + g->off;
        s_range_to_f32(g, 0, g->n, dst);
        e->data = dst;
    }
    tr->n_held++;
}

static void s_free_shard(ps_server *s)
{
    if (s->readers && !s_all_zero(s->readers, s->n_local)) {
        s_cow(s); // zmq still sends from the old block: retire it
    }
    free(s->readers);
    s->readers = NULL;
    zps_aligned_free(s->values);
    zps_aligned_free(s->slots[0]);
    zps_aligned_free(s->slots[1]);
    zps_aligned_free(s->scratch);
    free(s->chunks);
    free(s->key_to_local);
    free(s->recv_n);
    s->values = s->slots[0] = s->slots[1] = s->scratch = NULL;
    s->chunks = NULL;
    s->key_to_local = NULL;
    s->recv_n = NULL;
    if (s->trainers)
        for (uint32_t t = 0; t < s->n_trainers; t++) {
            s_trainer *tr = &s->trainers[t];
            s_held_release(tr, UINT32_MAX);
            zps_aligned_free(tr->accum);
            free(tr->held);
            free(tr->covered);
            tr->covered = NULL;
            tr->accum = NULL;
            tr->held = NULL;
            tr->cap_held = 0;
        }
    s->initialised = 0;
    s->n_local = 0;
}

/* Allocates the shard for the given chunk table (keys ascending, counts), values not set. */
static void s_alloc_shard(ps_server *s, uint32_t n, const uint32_t *keys, const uint64_t *counts)
{
    s_free_shard(s);
    s->n_local = n;
    s->chunks = zps_xcalloc(n, sizeof *s->chunks);
    s->key_to_local = zps_xmalloc((size_t)s->num_chunks * sizeof *s->key_to_local);
    for (uint32_t k = 0; k < s->num_chunks; k++)
        s->key_to_local[k] = -1;
    uint64_t off = 0, mx = 0;
    for (uint32_t i = 0; i < n; i++) {
        s->chunks[i] = (s_lchunk){keys[i], counts[i], off, 0, 0};
        s->key_to_local[keys[i]] = (int32_t)i;
        off += counts[i];
        if (counts[i] > mx)
            mx = counts[i];
    }
    s->local_total = off;
    s->max_chunk = mx;
    s->readers = zps_xcalloc(n, sizeof *s->readers);
    s->values = zps_xaligned(64, off * 4 + 64);
    s->scratch = zps_xaligned(64, mx * 4 + 64);
    s->n_slots = ps_optim_slots(s->opt.kind);
    for (int i = 0; i < s->n_slots; i++) {
        s->slots[i] = zps_xaligned(64, off * 4 + 64);
        float v = ps_optim_slot_init(&s->opt, i);
        for (uint64_t j = 0; j < off; j++)
            s->slots[i][j] = v;
    }
}

/* Per-trainer state once both the trainer count and the shard are known. */
static void s_ensure_trainer_state(ps_server *s)
{
    if (!s->n_trainers)
        return;
    if (!s->trainers) {
        s->trainers = zps_xcalloc(s->n_trainers, sizeof *s->trainers);
        uint64_t now = zps_now_ns();
        for (uint32_t t = 0; t < s->n_trainers; t++)
            s->trainers[t].last_seen_ns = now;
    }
    if (s->initialised && !s->recv_n)
        s->recv_n = zps_xcalloc((size_t)s->n_local * s->n_trainers, sizeof *s->recv_n);
}

static zps_status s_write_checkpoint(ps_server *s)
{
    if (!s->cfg.checkpoint_dir[0] || !s->initialised)
        return ZPS_OK;
    ps_ckpt c = {0};
    c.server_index = (uint32_t)s->cfg.index;
    c.plan_hash = s->plan_hash;
    c.n_vars = s->plan_vars;
    c.total = s->plan_total;
    c.n_servers = s->plan_servers;
    c.chunk_bytes = s->plan_chunk_bytes;
    c.num_chunks = s->num_chunks;
    c.mode = (uint32_t)s->mode;
    c.n_local = s->n_local;
    c.chunks = zps_xcalloc(s->n_local, sizeof *c.chunks);
    for (uint32_t i = 0; i < s->n_local; i++)
        c.chunks[i] = (ps_ckpt_chunk){s->chunks[i].key, s->chunks[i].count, s->chunks[i].version};
    c.local_total = s->local_total;
    c.n_slots = (uint32_t)s->n_slots;
    c.values = s->values;
    float *slots = NULL;
    if (s->n_slots) {
        /* The format stores slots contiguously; slot arrays are separate blocks here. */
        slots = zps_xaligned(64, (size_t)s->n_slots * s->local_total * 4 + 64);
        for (int i = 0; i < s->n_slots; i++)
            memcpy(slots + (size_t)i * s->local_total, s->slots[i], s->local_total * 4);
    }
    c.slots = slots;
    Zps__OptimizerConfig om;
    Zps__Schedule sm;
    ps_optim_to_proto(&s->opt, &om, &sm);
    c.opt_len = (uint32_t)zps__optimizer_config__get_packed_size(&om);
    c.opt = zps_xmalloc(c.opt_len + 1);
    zps__optimizer_config__pack(&om, c.opt);
    double t0 = zps_now_s();
    zps_status st = ps_ckpt_write(s->cfg.checkpoint_dir, s->cfg.index, &c);
    free(c.chunks);
    free(c.opt);
    zps_aligned_free(slots);
    uint64_t v = s_min_version(s);
    if (st == ZPS_OK) {
        s->st.checkpoints++;
        s->last_ckpt_version = v;
        zps_log(ZPS_INFO, "ps", "checkpoint at version %" PRIu64 " written in %.3f s", v,
                zps_now_s() - t0);
    } else {
        zps_log(ZPS_ERROR, "ps", "checkpoint at version %" PRIu64 " failed: %s", v,
                zps_strerror(st));
    }
    s->last_ckpt_s = zps_now_s();
    return st;
}

zps_status ps_server_checkpoint(ps_server *s) { return s_write_checkpoint(s); }

static zps_status s_restore(ps_server *s)
{
    char path[1100], why[256];
    ps_ckpt_path(s->cfg.checkpoint_dir, s->cfg.index, path, sizeof path);
    ps_ckpt c;
    zps_status st = ps_ckpt_read(path, &c, why, sizeof why);
    if (st == ZPS_ERR_NOT_FOUND) {
        zps_log(ZPS_WARN, "ps", "--restore: no checkpoint at %s, starting empty", path);
        return ZPS_OK;
    }
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "ps", "--restore: cannot use %s: %s", path, why);
        return st;
    }
    Zps__OptimizerConfig *om = zps__optimizer_config__unpack(NULL, c.opt_len, c.opt);
    ps_optim_config oc;
    char owhy[200];
    if (!om || ps_optim_from_proto(om, &oc, owhy, sizeof owhy) != ZPS_OK ||
        (uint32_t)ps_optim_slots(oc.kind) != c.n_slots || c.server_index != (uint32_t)s->cfg.index) {
        zps_log(ZPS_ERROR, "ps", "--restore: %s: bad optimizer record or server index %u (want %d)",
                path, c.server_index, s->cfg.index);
        if (om)
            zps__optimizer_config__free_unpacked(om, NULL);
        ps_ckpt_free(&c);
        return ZPS_ERR_CORRUPT;
    }
    zps__optimizer_config__free_unpacked(om, NULL);
    if (s->mode != PS_MODE_UNSET && c.mode != (uint32_t)s->mode)
        zps_log(ZPS_WARN, "ps", "--restore: checkpoint was written in %s mode, running %s",
                c.mode < 4 ? s_mode_names[c.mode] : "?", s_mode_names[s->mode]);
    s->have_plan = 1;
    s->plan_hash = c.plan_hash;
    s->plan_vars = c.n_vars;
    s->plan_total = c.total;
    s->plan_servers = c.n_servers;
    s->plan_chunk_bytes = c.chunk_bytes;
    s->num_chunks = c.num_chunks;
    snprintf(s->plan_src, sizeof s->plan_src, "the checkpoint");
    s->opt = oc;
    uint32_t *keys = zps_xmalloc((c.n_local + 1) * sizeof *keys);
    uint64_t *counts = zps_xmalloc((c.n_local + 1) * sizeof *counts);
    for (uint32_t i = 0; i < c.n_local; i++) {
        keys[i] = c.chunks[i].key;
        counts[i] = c.chunks[i].count;
    }
    s_alloc_shard(s, c.n_local, keys, counts);
    free(keys);
    free(counts);
    memcpy(s->values, c.values, c.local_total * 4);
    for (uint32_t i = 0; i < c.n_slots; i++)
        memcpy(s->slots[i], c.slots + (size_t)i * c.local_total, c.local_total * 4);
    for (uint32_t i = 0; i < c.n_local; i++)
        s->chunks[i].version = c.chunks[i].version;
    s->initialised = 1;
    s->last_ckpt_version = s_min_version(s);
    ps_ckpt_free(&c);
    s_ensure_trainer_state(s);
    zps_log(ZPS_INFO, "ps", "restored %s: %u chunks, %" PRIu64 " values, version %" PRIu64
            ", plan %016" PRIx64, path, s->n_local, s->local_total, s_min_version(s), s->plan_hash);
    return ZPS_OK;
}

/* ------------------------------------------------------------------------- applying */

static void s_maybe_checkpoint(ps_server *s)
{
    if (s->cfg.checkpoint_every_versions &&
        s_min_version(s) >= s->last_ckpt_version + s->cfg.checkpoint_every_versions)
        s_write_checkpoint(s);
}

static float *const *s_slot_ptrs(ps_server *s, uint64_t off, float **buf)
{
    for (int i = 0; i < s->n_slots; i++)
        buf[i] = s->slots[i] + off;
    return buf;
}

ZPS_SIMD_CLONES
static void s_add(float *restrict d, const float *restrict a, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        d[i] += a[i];
}

ZPS_SIMD_CLONES
static void s_div(float *d, float by, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        d[i] = d[i] / by;
}

/* sync: applies chunk lc if enough trainers are complete. */
static void s_sync_try_apply(ps_server *s, uint32_t lc)
{
    s_lchunk *c = &s->chunks[lc];
    if (c->n_complete == 0 || c->n_complete < s_need_replicas(s))
        return;
    uint32_t *rv = s->recv_n + (size_t)lc * s->n_trainers;
    float *g = s->scratch;
    uint32_t used = 0;
    /* sum in trainer-id order, whatever the arrival order: bit-reproducible */
    for (uint32_t t = 0; t < s->n_trainers; t++) {
        if (rv[t] != c->count)
            continue;
        const s_trainer *tr = &s->trainers[t];
        for (size_t i = 0; i < tr->n_held; i++) {
            const s_held *e = &tr->held[i];
            if (e->lc != lc)
                continue;
            if (!used)
                memcpy(g + e->off, e->data, e->n * 4);
            else
                s_add(g + e->off, e->data, e->n);
        }
        used++;
    }
    s_div(g, (float)used, c->count);
    s_wait_readers(s, lc);
    float *sp[2];
    ps_optim_apply(&s->opt, c->version, s->values + c->off, s_slot_ptrs(s, c->off, sp), g,
                   c->count);
    c->version++;
    for (uint32_t t = 0; t < s->n_trainers; t++) {
        if (rv[t] && rv[t] != c->count)
            s->st.stale_dropped++;
        rv[t] = 0;
        s_held_release(&s->trainers[t], lc);
        if (s->trainers[t].covered)
            s_bits_put(s->trainers[t].covered, c->off, c->off + c->count, 0);
    }
    c->n_complete = 0;
    s->st.updates++;
}

static void s_stale_hist(ps_server *s, int64_t st)
{
    unsigned b = st <= 0 ? 0 : st < 4 ? (unsigned)st : st < 8 ? 4 : st < 16 ? 5 : st < 32 ? 6 : 7;
    s->st.staleness[b]++;
}

/* ------------------------------------------------------------------------- pending */

static int s_pending_ready(ps_server *s, const s_pending *p)
{
    if (p->op == ZPS__OP__OP_BARRIER)
        return 0; // released together in s_check_barrier
    if (p->need < 0)
        return 1;
    if (s->mode == PS_MODE_SYNC) {
        for (uint32_t i = 0; i < p->n_ranges; i++)
            if ((int64_t)s->chunks[p->ranges[i].lc].version < p->need)
                return 0;
        return 1;
    }
    if (s->mode == PS_MODE_SSP)
        return s_min_clock(s) >= p->need - s->staleness;
    return 1;
}

static uint64_t s_ranges_version(const ps_server *s, const s_range *r, uint32_t n)
{
    uint64_t v = UINT64_MAX;
    for (uint32_t i = 0; i < n; i++)
        if (s->chunks[r[i].lc].version < v)
            v = s->chunks[r[i].lc].version;
    return n ? v : s_min_version(s);
}

static void s_pending_drop(ps_server *s, size_t i)
{
    zmq_msg_close(&s->pending[i].ident);
    free(s->pending[i].ranges);
    s->pending[i] = s->pending[--s->n_pending];
}

static void s_pending_add(ps_server *s, zmq_msg_t *ident, uint64_t rid, uint32_t trainer, int op,
                          int64_t need, const s_range *r, uint32_t n, uint64_t t0)
{
    if (s->n_pending == s->cap_pending) {
        s->cap_pending = s->cap_pending ? 2 * s->cap_pending : 16;
        s->pending = zps_xrealloc(s->pending, s->cap_pending * sizeof *s->pending);
    }
    s_pending *p = &s->pending[s->n_pending++];
    zmq_msg_init(&p->ident);
    zmq_msg_copy(&p->ident, ident);
    p->rid = rid;
    p->trainer = trainer;
    p->op = op;
    p->need = need;
    p->n_ranges = n;
    p->ranges = NULL;
    if (n) {
        p->ranges = zps_xmalloc(n * sizeof *r);
        memcpy(p->ranges, r, n * sizeof *r);
    }
    p->t0_ns = t0;
}

static void s_check_barrier(ps_server *s)
{
    /* Released when every live trainer is waiting in it (trainers that left may wait too;
     * they are not waited for). */
    uint32_t arrived = 0, waiting = 0;
    for (size_t i = 0; i < s->n_pending; i++)
        if (s->pending[i].op == ZPS__OP__OP_BARRIER) {
            waiting++;
            arrived += !s->trainers[s->pending[i].trainer].dropped;
        }
    if (!waiting || arrived < s_live(s))
        return;
    for (size_t i = 0; i < s->n_pending;) {
        s_pending *p = &s->pending[i];
        if (p->op != ZPS__OP__OP_BARRIER) {
            i++;
            continue;
        }
        s_reply r = {p->op, p->rid, ZPS_OK, "", s_min_version(s), 0, 0};
        s_send(s, &p->ident, &r, NULL, 0);
        s_latency(s, p->op, p->t0_ns);
        s_pending_drop(s, i);
    }
}

static void s_check_pending(ps_server *s)
{
    for (size_t i = 0; i < s->n_pending;) {
        s_pending *p = &s->pending[i];
        if (!s_pending_ready(s, p)) {
            i++;
            continue;
        }
        s_reply r = {p->op, p->rid, ZPS_OK, "", s_ranges_version(s, p->ranges, p->n_ranges), 0, 0};
        s_send(s, &p->ident, &r, p->ranges, p->n_ranges);
        s_latency(s, p->op, p->t0_ns);
        s_pending_drop(s, i);
    }
    s_check_barrier(s);
}

/* ------------------------------------------------------------------------- checks */

#define S_WHY(...) snprintf(why, why_len, __VA_ARGS__)

/* Validates ranges of a PUSH / PULL / PUSHPULL into s->ranges. Payload frames start at
 * frames[2]; push: one per range; pull: none. */
static zps_status s_check_ranges(ps_server *s, const Zps__Header *h, int nframes, int has_data,
                                 char *why, size_t why_len)
{
    if (!s->initialised) {
        S_WHY("no INIT yet: variables have no values");
        return ZPS_ERR_NOT_INIT;
    }
    if (h->n_ranges == 0 || h->n_ranges > PS_MAX_RANGES) {
        S_WHY("%zu ranges (want 1..%d)", h->n_ranges, PS_MAX_RANGES);
        return ZPS_ERR_FRAMES;
    }
    int want = 2 + (has_data ? (int)h->n_ranges : 0);
    if (nframes != want) {
        S_WHY("%d payload frames for %zu ranges (want %d)", nframes - 2, h->n_ranges, want - 2);
        return ZPS_ERR_FRAMES;
    }
    uint64_t total = 0;
    for (size_t i = 0; i < h->n_ranges; i++) {
        const Zps__KeyRange *r = h->ranges[i];
        int bf16 = r->dtype == ZPS__DTYPE__DTYPE_BF16;
        if (r->dtype != ZPS__DTYPE__DTYPE_F32 && !(bf16 && has_data)) {
            S_WHY("range %zu: dtype %d (served: f32, and bf16 for pushed gradients)", i,
                  (int)r->dtype);
            return ZPS_ERR_DTYPE;
        }
        uint64_t es = bf16 ? 2 : 4;
        if (r->key >= s->num_chunks || s->key_to_local[r->key] < 0) {
            S_WHY("range %zu: key %u is not held by server %d", i, r->key, s->cfg.index);
            return ZPS_ERR_KEY;
        }
        const s_lchunk *c = &s->chunks[s->key_to_local[r->key]];
        if (r->length == 0 || r->length % es || r->offset > c->count ||
            r->length / es > c->count - r->offset) {
            S_WHY("range %zu: key %u offset %" PRIu64 " length %" PRIu64
                  " B is outside the chunk of %" PRIu64 " values",
                  i, r->key, r->offset, r->length, c->count);
            return ZPS_ERR_RANGE;
        }
        total += r->length;
        if (total > s->cfg.max_message_bytes) {
            S_WHY("request of more than %" PRIu64 " bytes (limit --max-message-bytes %" PRIu64 ")",
                  total, s->cfg.max_message_bytes);
            return ZPS_ERR_TOO_LARGE;
        }
        s_range *g = &s->ranges[i];
        g->lc = (uint32_t)s->key_to_local[r->key];
        g->off = r->offset;
        g->n = r->length / es;
        g->data = NULL;
        g->bf16 = bf16;
        if (has_data) {
            zmq_msg_t *f = &s->frames[2 + i];
            if (zmq_msg_size(f) != r->length) {
                S_WHY("range %zu: frame of %zu bytes, header says %" PRIu64, i, zmq_msg_size(f),
                      r->length);
                return ZPS_ERR_FRAMES;
            }
            g->data = zmq_msg_data(f);
        }
    }
    for (size_t i = 0; has_data && i < h->n_ranges; i++) {
        const s_range *g = &s->ranges[i];
        if (!(g->bf16 ? ps_bf16_all_finite(g->data, g->n) : ps_f32_all_finite(g->data, g->n))) {
            S_WHY("range %zu (key %u): NaN or Inf in the payload", i, h->ranges[i]->key);
            return ZPS_ERR_NONFINITE;
        }
    }
    return ZPS_OK;
}

static zps_status s_check_trainer(ps_server *s, const Zps__Header *h, char *why, size_t why_len)
{
    if (!s->n_trainers || h->trainer_id >= s->n_trainers) {
        S_WHY("trainer %u is not in this job (%u trainers)", h->trainer_id, s->n_trainers);
        return ZPS_ERR_TRAINER;
    }
    if (!s->trainers[h->trainer_id].registered) {
        S_WHY("trainer %u has not registered with this server (REGISTER first)", h->trainer_id);
        return ZPS_ERR_TRAINER;
    }
    return ZPS_OK;
}

static void s_seen(ps_server *s, uint32_t t)
{
    s_trainer *tr = &s->trainers[t];
    tr->last_seen_ns = zps_now_ns();
    tr->left = 0;
    if (tr->dropped) {
        tr->dropped = 0;
        s->st.trainers_rejoined++;
        zps_log(ZPS_INFO, "ps", "trainer %u is back (rejoined; %u live)", t, s_live(s));
    }
}

/* ------------------------------------------------------------------------- ops */

static void s_plan_summary(char *buf, size_t len, uint64_t hash, uint32_t vars, uint64_t total,
                           uint32_t servers, uint64_t chunk)
{
    snprintf(buf, len, "%016" PRIx64 " (%u variables, %" PRIu64 " values, %u servers, chunk %" PRIu64
             " B)", hash, vars, total, servers, chunk);
}

static zps_status s_check_plan(ps_server *s, const Zps__Header *h, char *why, size_t why_len)
{
    const Zps__JobConfig *j = h->job;
    if (!s->have_plan || h->plan_hash == s->plan_hash)
        return ZPS_OK;
    char mine[160], theirs[160];
    s_plan_summary(mine, sizeof mine, s->plan_hash, s->plan_vars, s->plan_total, s->plan_servers,
                   s->plan_chunk_bytes);
    s_plan_summary(theirs, sizeof theirs, h->plan_hash, j ? j->num_variables : 0,
                   j ? j->total_count : 0, j ? j->num_servers : 0, j ? j->chunk_bytes : 0);
    S_WHY("plan mismatch: trainer %u has plan %s, server %d holds %s from %s", h->trainer_id,
          theirs, s->cfg.index, mine, s->plan_src);
    return ZPS_ERR_PLAN;
}

static void s_adopt_plan(ps_server *s, const Zps__Header *h)
{
    if (s->have_plan || !h->job)
        return;
    s->have_plan = 1;
    s->plan_hash = h->plan_hash;
    s->plan_vars = h->job->num_variables;
    s->plan_total = h->job->total_count;
    s->plan_servers = h->job->num_servers;
    s->plan_chunk_bytes = h->job->chunk_bytes;
    s->num_chunks = h->job->num_chunks;
    snprintf(s->plan_src, sizeof s->plan_src, "trainer %u", h->trainer_id);
}

static void s_op_register(ps_server *s, zmq_msg_t *ident, const Zps__Header *h)
{
    char why[512];
    const Zps__JobConfig *j = h->job;
    int op = h->op;
    if (!j || h->plan_hash == 0 || j->num_chunks == 0 || j->num_chunks > (1u << 24)) {
        s_reject(s, ident, op, h->request_id, ZPS_ERR_INVALID,
                 "REGISTER needs a job config, a plan hash and 1..2^24 chunks");
        return;
    }
    if (s->cfg.check_index && h->server_index != (uint32_t)s->cfg.index) {
        snprintf(why, sizeof why, "this is server %d, the trainer addressed server %u",
                 s->cfg.index, h->server_index);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_CONFIG, why);
        return;
    }
    /* Job settings: the server's own flags win; a conflict is an error. */
    if (s->mode != PS_MODE_UNSET && j->mode != ZPS__MODE__MODE_UNKNOWN && (int)j->mode != (int)s->mode) {
        snprintf(why, sizeof why, "server runs %s mode, trainer %u asked for %s", s_mode_names[s->mode],
                 h->trainer_id, (unsigned)j->mode < 4 ? s_mode_names[j->mode] : "?");
        s_reject(s, ident, op, h->request_id, ZPS_ERR_CONFIG, why);
        return;
    }
    if ((unsigned)j->mode > 3) {
        s_reject(s, ident, op, h->request_id, ZPS_ERR_INVALID, "unknown mode");
        return;
    }
    if (s->n_trainers && j->num_trainers && j->num_trainers != s->n_trainers) {
        snprintf(why, sizeof why, "server has %u trainers, trainer %u says %u", s->n_trainers,
                 h->trainer_id, j->num_trainers);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_CONFIG, why);
        return;
    }
    uint32_t nt = s->n_trainers ? s->n_trainers : j->num_trainers;
    if (!nt || nt > PS_MAX_TRAINERS) {
        s_reject(s, ident, op, h->request_id, ZPS_ERR_CONFIG,
                 "number of trainers unknown (give --num-trainers or job.num_trainers 1..4096)");
        return;
    }
    if (h->trainer_id >= nt) {
        snprintf(why, sizeof why, "trainer %u is not in this job (%u trainers)", h->trainer_id, nt);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_TRAINER, why);
        return;
    }
    uint32_t want_r = s->replicas ? s->replicas : 0;
    if (want_r && j->replicas_to_aggregate && j->replicas_to_aggregate != want_r) {
        snprintf(why, sizeof why, "server aggregates %u replicas, trainer %u says %u", want_r,
                 h->trainer_id, j->replicas_to_aggregate);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_CONFIG, why);
        return;
    }
    if (j->replicas_to_aggregate > nt) {
        s_reject(s, ident, op, h->request_id, ZPS_ERR_CONFIG,
                 "replicas_to_aggregate exceeds the number of trainers");
        return;
    }
    if (s->staleness >= 0 && j->staleness && (int)j->staleness != s->staleness) {
        snprintf(why, sizeof why, "server staleness is %d, trainer %u says %u", s->staleness,
                 h->trainer_id, j->staleness);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_CONFIG, why);
        return;
    }
    zps_status st = s_check_plan(s, h, why, sizeof why);
    if (st != ZPS_OK) {
        s_reject(s, ident, op, h->request_id, st, why);
        return;
    }
    if (s->have_plan && s->num_chunks != j->num_chunks) {
        snprintf(why, sizeof why, "plan has %u chunks on the server, %u on trainer %u",
                 s->num_chunks, j->num_chunks, h->trainer_id);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_PLAN, why);
        return;
    }
    /* Accepted: adopt whatever was still open. */
    if (s->mode == PS_MODE_UNSET)
        s->mode = j->mode ? (ps_mode)j->mode : PS_MODE_SYNC;
    if (!s->replicas && j->replicas_to_aggregate)
        s->replicas = j->replicas_to_aggregate;
    if (s->staleness < 0)
        s->staleness = (int)j->staleness;
    if (!s->n_trainers) {
        s->n_trainers = nt;
        zps_log(ZPS_INFO, "ps", "job: %s mode, %u trainers, aggregate %u, staleness %d",
                s_mode_names[s->mode], nt, s->replicas ? s->replicas : nt, s->staleness);
    }
    s_adopt_plan(s, h);
    s_ensure_trainer_state(s);
    s_trainer *tr = &s->trainers[h->trainer_id];
    if (!tr->registered)
        zps_log(ZPS_INFO, "ps", "trainer %u registered", h->trainer_id);
    tr->registered = 1;
    s_seen(s, h->trainer_id);
    s_reply r = {op, h->request_id, ZPS_OK, s->initialised ? "initialised" : "not initialised",
                 s_min_version(s), 1, 1};
    s_send(s, ident, &r, NULL, 0);
    s_check_pending(s);
}

static void s_op_init(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes)
{
    char why[512];
    int op = h->op;
    zps_status st = s_check_trainer(s, h, why, sizeof why);
    if (st != ZPS_OK) {
        s_reject(s, ident, op, h->request_id, st, why);
        return;
    }
    s_seen(s, h->trainer_id);
    ps_optim_config oc;
    char owhy[256];
    if (ps_optim_from_proto(h->optimizer, &oc, owhy, sizeof owhy) != ZPS_OK) {
        snprintf(why, sizeof why, "bad optimizer: %s", owhy);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_INVALID, why);
        return;
    }
    if ((st = s_check_plan(s, h, why, sizeof why)) != ZPS_OK) {
        s_reject(s, ident, op, h->request_id, st, why);
        return;
    }
    if (s->initialised && !s->cfg.allow_reinit) {
        if (!ps_optim_equal(&oc, &s->opt)) {
            snprintf(why, sizeof why, "server %d holds optimizer %s lr %g; this INIT asks for %s lr %g",
                     s->cfg.index, ps_optim_kind_name(s->opt.kind), s->opt.lr,
                     ps_optim_kind_name(oc.kind), oc.lr);
            s_reject(s, ident, op, h->request_id, ZPS_ERR_CONFIG, why);
        } else {
            snprintf(why, sizeof why, "already initialised (version %" PRIu64 "); first writer wins",
                     s_min_version(s));
            s_reject(s, ident, op, h->request_id, ZPS_ERR_ALREADY_INIT, why);
        }
        return;
    }
    size_t n = h->n_ranges;
    if (n == 0 || n > PS_MAX_RANGES || nframes != 2 + (int)n) {
        snprintf(why, sizeof why, "INIT with %zu ranges and %d payload frames", n, nframes - 2);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_FRAMES, why);
        return;
    }
    if (!s->have_plan || s->num_chunks == 0) {
        s_reject(s, ident, op, h->request_id, ZPS_ERR_PLAN, "no plan known (REGISTER first)");
        return;
    }
    uint32_t *keys = zps_xmalloc(n * sizeof *keys);
    uint64_t *counts = zps_xmalloc(n * sizeof *counts), total = 0;
    uint8_t *seen = zps_xcalloc(s->num_chunks, 1);
    st = ZPS_OK;
    for (size_t i = 0; i < n && st == ZPS_OK; i++) {
        const Zps__KeyRange *r = h->ranges[i];
        if (r->dtype != ZPS__DTYPE__DTYPE_F32) {
            st = ZPS_ERR_DTYPE;
            snprintf(why, sizeof why, "range %zu: dtype %d (only f32)", i, (int)r->dtype);
        } else if (r->key >= s->num_chunks || seen[r->key] || (i && r->key <= keys[i - 1])) {
            st = ZPS_ERR_KEY;
            snprintf(why, sizeof why, "range %zu: key %u unknown, repeated or out of order", i, r->key);
        } else if (r->offset != 0 || r->length == 0 || r->length % 4) {
            st = ZPS_ERR_RANGE;
            snprintf(why, sizeof why, "range %zu: INIT needs whole chunks (offset 0, length 4k)", i);
        } else if (zmq_msg_size(&s->frames[2 + i]) != r->length) {
            st = ZPS_ERR_FRAMES;
            snprintf(why, sizeof why, "range %zu: frame of %zu bytes, header says %" PRIu64, i,
                     zmq_msg_size(&s->frames[2 + i]), r->length);
        } else if ((total += r->length) > s->cfg.max_message_bytes) {
            st = ZPS_ERR_TOO_LARGE;
            snprintf(why, sizeof why, "INIT larger than --max-message-bytes %" PRIu64,
                     s->cfg.max_message_bytes);
        } else {
            if (!ps_f32_all_finite(zmq_msg_data(&s->frames[2 + i]), r->length / 4)) {
                st = ZPS_ERR_NONFINITE;
                snprintf(why, sizeof why, "range %zu: NaN or Inf in initial values", i);
            }
            seen[r->key] = 1;
            keys[i] = r->key;
            counts[i] = r->length / 4;
        }
    }
    free(seen);
    if (st != ZPS_OK) {
        free(keys);
        free(counts);
        s_reject(s, ident, op, h->request_id, st, why);
        return;
    }
    /* A re-INIT replaces the chunk table: requests waiting on the old one are answered. */
    for (size_t i = 0; i < s->n_pending;) {
        s_pending *p = &s->pending[i];
        if (!p->n_ranges) {
            i++;
            continue;
        }
        s_reply rr = {p->op, p->rid, ZPS_ERR_BUSY, "values were re-initialised; pull again", 0, 0, 0};
        s_send(s, &p->ident, &rr, NULL, 0);
        s_pending_drop(s, i);
    }
    s->opt = oc;
    s_alloc_shard(s, (uint32_t)n, keys, counts);
    for (size_t i = 0; i < n; i++)
        memcpy(s->values + s->chunks[i].off, zmq_msg_data(&s->frames[2 + i]), counts[i] * 4);
    free(keys);
    free(counts);
    s->initialised = 1;
    s_ensure_trainer_state(s);
    s->st.bytes_in += total;
    zps_log(ZPS_INFO, "ps", "initialised by trainer %u: %u chunks, %" PRIu64 " values, optimizer %s",
            h->trainer_id, s->n_local, s->local_total, ps_optim_kind_name(s->opt.kind));
    s->last_ckpt_version = 0;
    if (s->cfg.checkpoint_dir[0])
        s_write_checkpoint(s);
    s_reply r = {op, h->request_id, ZPS_OK, "initialised", 0, 0, 1};
    s_send(s, ident, &r, NULL, 0);
}

/* Remembers the status of push request rid; returns 1 and the status if it was seen. */
static int s_rid_seen(s_trainer *tr, uint64_t rid, int *status)
{
    for (int i = 0; i < S_RID_RING; i++)
        if (tr->rid[i] == rid && rid) {
            *status = tr->rid_status[i];
            return 1;
        }
    return 0;
}

static void s_rid_note(s_trainer *tr, uint64_t rid, int status)
{
    tr->rid[tr->rid_pos % S_RID_RING] = rid;
    tr->rid_status[tr->rid_pos % S_RID_RING] = status;
    tr->rid_pos++;
}

/* A pushed range that cannot be read as f32 in place is converted and applied in blocks of
 * this many values (32 KiB of f32), so the converted copy is read back from L1/L2. */
#define S_CONVERT_BLOCK 8192

/* async / ssp: applies the n validated ranges of s->ranges, each at its recorded version. */
static void s_async_apply(ps_server *s, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        const s_range *g = &s->ranges[i];
        const s_lchunk *c = &s->chunks[g->lc];
        float *sp[2];
        s_wait_readers(s, g->lc);
        int in_place = s_range_in_place(g);
        uint64_t blk = in_place ? g->n : S_CONVERT_BLOCK;
        for (uint64_t b = 0; b < g->n; b += blk) {
            uint64_t k = g->n - b < blk ? g->n - b : blk;
            const float *d = (const float *)g->data + b;
            if (!in_place) {
                s_range_to_f32(g, b, k, s->scratch);
                d = s->scratch;
            }
            uint64_t at = c->off + g->off + b;
            ps_optim_apply(&s->opt, g->version, s->values + at, s_slot_ptrs(s, at, sp), d, k);
        }
    }
}

/* PUSH and PUSHPULL (the pull half is deferred or answered here). */
static void s_op_push(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes,
                      uint64_t t0)
{
    char why[512];
    int op = h->op;
    zps_status st = s_check_trainer(s, h, why, sizeof why);
    if (st == ZPS_OK)
        st = s_check_ranges(s, h, nframes, 1, why, sizeof why);
    if (st != ZPS_OK) {
        s_reject(s, ident, op, h->request_id, st, why);
        return;
    }
    uint32_t t = h->trainer_id, n = (uint32_t)h->n_ranges;
    s_trainer *tr = &s->trainers[t];
    s_seen(s, t);
    int prev;
    if (s_rid_seen(tr, h->request_id, &prev)) {
        /* A retry of a push already handled: never apply it twice. */
        if (op == ZPS__OP__OP_PUSH) {
            s_reply r = {op, h->request_id, prev, "duplicate push (retry): already handled",
                         s_ranges_version(s, s->ranges, n), 0, 0};
            s_send(s, ident, &r, NULL, 0);
            return;
        }
    }
    int64_t step = h->step;
    uint32_t stale = 0, ahead = 0;
    int apply = 0; // async / ssp: ranges to apply (s_async_apply)
    int dup_req = s_rid_seen(tr, h->request_id, &prev);
    if (!dup_req && s->mode == PS_MODE_SYNC) {
        /* Pre-pass: no range may cover elements this trainer already pushed for the
         * chunk's current version (in an earlier request or earlier in this one). State is
         * untouched if one does: the coverage bits set so far are cleared again. */
        if (!tr->covered)
            tr->covered = zps_xcalloc((s->local_total + 63) / 64, sizeof *tr->covered);
        uint32_t bad = UINT32_MAX;
        for (uint32_t i = 0; i < n; i++) {
            s_range *g = &s->ranges[i];
            s_lchunk *c = &s->chunks[g->lc];
            if (step != (int64_t)c->version)
                continue;
            uint64_t lo = c->off + g->off;
            if (s_bits_any(tr->covered, lo, lo + g->n)) {
                bad = i;
                break;
            }
            s_bits_put(tr->covered, lo, lo + g->n, 1);
        }
        if (bad != UINT32_MAX) {
            for (uint32_t i = 0; i < bad; i++) {
                s_range *g = &s->ranges[i];
                s_lchunk *c = &s->chunks[g->lc];
                if (step == (int64_t)c->version)
                    s_bits_put(tr->covered, c->off + g->off, c->off + g->off + g->n, 0);
            }
            snprintf(why, sizeof why,
                     "range %u: elements %" PRIu64 "..%" PRIu64 " of chunk %u pushed more than once "
                     "for step %" PRId64, bad, s->ranges[bad].off, s->ranges[bad].off + s->ranges[bad].n - 1,
                     s->chunks[s->ranges[bad].lc].key, step);
            s_reject(s, ident, op, h->request_id, ZPS_ERR_INVALID, why);
            return;
        }
        for (uint32_t i = 0; i < n; i++) {
            s_range *g = &s->ranges[i];
            s_lchunk *c = &s->chunks[g->lc];
            s->st.pushes++;
            s->st.bytes_in += g->n * (g->bf16 ? 2 : 4);
            if (step < (int64_t)c->version) {
                stale++;
                s->st.stale_dropped++;
                continue;
            }
            if (step > (int64_t)c->version) {
                ahead++;
                continue;
            }
            uint32_t *rv = &s->recv_n[(size_t)g->lc * s->n_trainers + t];
            s_held_add(s, tr, g, &s->frames[2 + i]);
            *rv += (uint32_t)g->n;
            if (*rv == c->count) {
                c->n_complete++;
                s_sync_try_apply(s, g->lc);
            }
        }
    } else if (!dup_req) {
        /* async / ssp: each range is applied on arrival. The chunk's version counts the
         * trainer pushes that covered it whole. The bookkeeping (versions, clocks,
         * statistics) is done here; the arithmetic in s_async_apply, after the reply of a
         * PUSH has gone out (below). */
        int64_t maxc = s_max_clock(s);
        for (uint32_t i = 0; i < n; i++) {
            s_range *g = &s->ranges[i];
            s_lchunk *c = &s->chunks[g->lc];
            g->version = c->version;
            s->st.pushes++;
            s->st.bytes_in += g->n * (g->bf16 ? 2 : 4);
            s_stale_hist(s, s->mode == PS_MODE_ASYNC ? (step >= 0 ? (int64_t)c->version - step : 0)
                                                     : maxc - (step + 1));
            uint32_t *rv = &s->recv_n[(size_t)g->lc * s->n_trainers + t];
            *rv += (uint32_t)g->n;
            if (*rv >= c->count) {
                *rv = 0;
                c->version++;
                s->st.updates++;
            }
        }
        if (step + 1 > tr->clock)
            tr->clock = step + 1;
        apply = 1;
    }
    int rst = ZPS_OK;
    char msg[160] = "";
    if (dup_req) {
        rst = prev;
    } else if (stale || ahead) {
        rst = ZPS_ERR_STALE;
        snprintf(msg, sizeof msg, "%u of %u ranges dropped: step %" PRId64 " is %s the server's version %" PRIu64,
                 stale + ahead, n, step, ahead ? "ahead of" : "behind", s_ranges_version(s, s->ranges, n));
    }
    if (!dup_req)
        s_rid_note(tr, h->request_id, rst);
    if (op == ZPS__OP__OP_PUSHPULL && rst == ZPS_OK) {
        if (apply)
            s_async_apply(s, n);
        int64_t need = s->mode == PS_MODE_ASYNC || step < 0 ? -1 : step + 1;
        s_pending p = {.rid = h->request_id, .op = op, .need = need, .n_ranges = n,
                       .ranges = s->ranges};
        if (s_pending_ready(s, &p)) { // the usual async case: answer without queueing
            s_reply r = {op, h->request_id, ZPS_OK, "", s_ranges_version(s, s->ranges, n), 0, 0};
            s_send(s, ident, &r, s->ranges, n);
            s_latency(s, op, t0);
        } else {
            s_pending_add(s, ident, h->request_id, t, op, need, s->ranges, n, t0);
        }
        s_check_pending(s);
        if (s->cfg.checkpoint_every_versions)
            s_maybe_checkpoint(s);
        return;
    }
    /* The reply goes out before the arithmetic: the trainer's next request travels while
     * the server applies this one. Nothing can observe the difference: the server handles
     * one request at a time, so whatever comes after this push sees it applied. */
    s_reply r = {op, h->request_id, rst, msg, s_ranges_version(s, s->ranges, n), 0, 0};
    s_send(s, ident, &r, NULL, 0);
    s_latency(s, op, t0);
    if (apply)
        s_async_apply(s, n);
    s_check_pending(s);
    if (s->cfg.checkpoint_every_versions)
        s_maybe_checkpoint(s);
}

static void s_op_pull(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes, uint64_t t0)
{
    char why[512];
    int op = h->op;
    zps_status st = s_check_trainer(s, h, why, sizeof why);
    if (st == ZPS_OK)
        st = s_check_ranges(s, h, nframes, 0, why, sizeof why);
    if (st != ZPS_OK) {
        s_reject(s, ident, op, h->request_id, st, why);
        return;
    }
    s_seen(s, h->trainer_id);
    int64_t need = s->mode == PS_MODE_ASYNC ? -1 : h->step;
    s_pending p = {.rid = h->request_id, .op = op, .need = need, .n_ranges = (uint32_t)h->n_ranges,
                   .ranges = s->ranges};
    if (s_pending_ready(s, &p)) {
        s_reply r = {op, h->request_id, ZPS_OK, "", s_ranges_version(s, s->ranges, p.n_ranges), 0, 0};
        s_send(s, ident, &r, s->ranges, p.n_ranges);
        s_latency(s, op, t0);
        return;
    }
    s_pending_add(s, ident, h->request_id, h->trainer_id, op, need, s->ranges, p.n_ranges, t0);
}

static size_t s_stats_json(ps_server *s, char *b, size_t cap)
{
    size_t n = 0;
#define S_J(...) n += (size_t)snprintf(b + n, n < cap ? cap - n : 0, __VA_ARGS__)
    S_J("{\"server\":%d,\"mode\":\"%s\",\"trainers\":%u,\"live_trainers\":%u,\"initialised\":%s,"
        "\"version\":%" PRIu64 ",\"chunks\":%u,\"values\":%" PRIu64 ",\"pushes\":%" PRIu64
        ",\"pulls\":%" PRIu64 ",\"bytes_in\":%" PRIu64 ",\"bytes_out\":%" PRIu64
        ",\"updates\":%" PRIu64 ",\"stale_dropped\":%" PRIu64 ",\"checkpoints\":%" PRIu64
        ",\"trainers_dropped\":%" PRIu64 ",\"trainers_rejoined\":%" PRIu64
        ",\"trainers_left\":%" PRIu64 ",\"pending\":%zu"
        ",\"reader_waits\":%" PRIu64 ",\"values_cow\":%" PRIu64,
        s->cfg.index, s_mode_names[s->mode], s->n_trainers, s->trainers ? s_live(s) : 0,
        s->initialised ? "true" : "false", s_min_version(s), s->n_local, s->local_total,
        s->st.pushes, s->st.pulls, s->st.bytes_in, s->st.bytes_out, s->st.updates,
        s->st.stale_dropped, s->st.checkpoints, s->st.trainers_dropped, s->st.trainers_rejoined,
        s->st.trainers_left,
        s->n_pending, s->st.reader_waits, s->st.values_cow);
    ps_curve_counts cc = {0, 0, 0};
    if (s->zap)
        ps_curve_zap_counts(s->zap, &cc);
    S_J(",\"curve\":%s,\"auth_accepted\":%" PRIu64 ",\"auth_rejected\":%" PRIu64
        ",\"handshake_failed\":%" PRIu64,
        s->zap ? "true" : "false", cc.accepted, cc.rejected, cc.handshake_failed);
    S_J(",\"requests\":{");
    for (int i = 1; i < S_N_OPS; i++)
        S_J("%s\"%s\":%" PRIu64, i > 1 ? "," : "", s_op_names[i], s->st.requests[i]);
    S_J("},\"rejected_total\":%" PRIu64 ",\"rejected\":{", s->st.rejected_total);
    int first = 1;
    for (int i = 1; i < ZPS_STATUS_COUNT; i++)
        if (s->st.rejected[i]) {
            S_J("%s\"%s\":%" PRIu64, first ? "" : ",", zps_status_name(-i), s->st.rejected[i]);
            first = 0;
        }
    static const char *const sb[S_STALE_BUCKETS] = {"0", "1", "2", "3", "4-7", "8-15", "16-31", "32+"};
    S_J("},\"staleness\":{");
    for (int i = 0; i < S_STALE_BUCKETS; i++)
        S_J("%s\"%s\":%" PRIu64, i ? "," : "", sb[i], s->st.staleness[i]);
    S_J("},\"latency_us\":{");
    first = 1;
    for (int i = 1; i < S_N_OPS; i++) {
        uint64_t cnt = 0;
        for (int k = 0; k < S_LAT_BUCKETS; k++)
            cnt += s->st.lat[i][k];
        if (!cnt)
            continue;
        S_J("%s\"%s\":{\"n\":%" PRIu64 ",\"p50\":%.1f,\"p90\":%.1f,\"p99\":%.1f}", first ? "" : ",",
            s_op_names[i], cnt, s_lat_pct(s->st.lat[i], 50), s_lat_pct(s->st.lat[i], 90),
            s_lat_pct(s->st.lat[i], 99));
        first = 0;
    }
    S_J("}}");
#undef S_J
    return n;
}

/* A trainer stopped being waited for (timed out or left): sync chunks may be complete now,
 * ssp pulls and barriers may be free to go. */
static void s_after_drop(ps_server *s)
{
    if (s->mode == PS_MODE_SYNC && s->initialised && s->recv_n)
        for (uint32_t lc = 0; lc < s->n_local; lc++)
            s_sync_try_apply(s, lc);
    s_check_pending(s); // and barriers
}

static void s_op_simple(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, uint64_t t0)
{
    int op = h->op;
    if (op == ZPS__OP__OP_HEARTBEAT || op == ZPS__OP__OP_LEAVE || op == ZPS__OP__OP_BARRIER) {
        char why[512];
        zps_status st = s_check_trainer(s, h, why, sizeof why);
        if (st != ZPS_OK) {
            s_reject(s, ident, op, h->request_id, st, why);
            return;
        }
        /* any word from a trainer counts as seen, except that heartbeats and barriers do not
         * bring back one that left */
        if (op != ZPS__OP__OP_LEAVE && !s->trainers[h->trainer_id].left)
            s_seen(s, h->trainer_id);
    }
    switch (op) {
    case ZPS__OP__OP_HEARTBEAT: {
        s_reply r = {op, h->request_id, ZPS_OK, "", s_min_version(s), 0, 0};
        s_send(s, ident, &r, NULL, 0);
        s_check_pending(s);
        break;
    }
    case ZPS__OP__OP_LEAVE: {
        s_trainer *tr = &s->trainers[h->trainer_id];
        if (!tr->left) {
            tr->left = 1;
            s->st.trainers_left++;
            if (!tr->dropped) {
                tr->dropped = 1;
                zps_log(ZPS_INFO, "ps", "trainer %u left (%u live)", h->trainer_id, s_live(s));
            }
        }
        s_reply r = {op, h->request_id, ZPS_OK, "", s_min_version(s), 0, 0};
        s_send(s, ident, &r, NULL, 0);
        s_after_drop(s);
        break;
    }
    case ZPS__OP__OP_BARRIER: {
        for (size_t i = 0; i < s->n_pending; i++)
            if (s->pending[i].op == op && s->pending[i].trainer == h->trainer_id) {
                /* A retried barrier replaces the earlier one. */
                s_pending_drop(s, i);
                break;
            }
        s_pending_add(s, ident, h->request_id, h->trainer_id, op, 0, NULL, 0, t0);
        s_check_barrier(s);
        return;
    }
    case ZPS__OP__OP_STATS: {
        size_t need = s_stats_json(s, NULL, 0) + 1;
        char *json = zps_xmalloc(need);
        s_stats_json(s, json, need);
        s_reply r = {op, h->request_id, ZPS_OK, json, s_min_version(s), 1, 1};
        s_send(s, ident, &r, NULL, 0);
        free(json);
        break;
    }
    case ZPS__OP__OP_CHECKPOINT: {
        zps_status st = s->cfg.checkpoint_dir[0] ? s_write_checkpoint(s) : ZPS_ERR_UNSUPPORTED;
        s_reply r = {op, h->request_id, st,
                     st == ZPS_OK ? "checkpoint written"
                     : st == ZPS_ERR_UNSUPPORTED ? "no --checkpoint-dir" : "checkpoint failed (see the server log)",
                     s_min_version(s), 0, 0};
        s_send(s, ident, &r, NULL, 0);
        break;
    }
    case ZPS__OP__OP_SHUTDOWN: {
        zps_status st = s_write_checkpoint(s);
        s_reply r = {op, h->request_id, st, st == ZPS_OK ? "shutting down" : "shutting down; checkpoint failed",
                     s_min_version(s), 0, 0};
        s_send(s, ident, &r, NULL, 0);
        zps_log(ZPS_INFO, "ps", "SHUTDOWN from trainer %u", h->trainer_id);
        s->stop = 1;
        break;
    }
    }
    s_latency(s, op, t0);
}

/* CURVE with trainer-bound keys (--curve-allow "KEY trainer=N"): 1 (and why) when the
 * request says another trainer id than its connection's key is bound to, or is a SHUTDOWN
 * from another trainer than 0 (the chief, who alone sends it: zps-trainer
 * --shutdown-servers). */
static int s_key_mismatch(ps_server *s, const Zps__Header *h, char *why, size_t len)
{
    const ps_curve_allow *a = ps_curve_zap_allow(s->zap);
    if (!ps_curve_allow_bound(a))
        return 0;
    const char *uid = zmq_msg_gets(&s->frames[1], "User-Id"); // the key, set by ZAP
    uint8_t key[32];
    if (!uid || strlen(uid) != PS_CURVE_KEY_LEN || !zmq_z85_decode(key, uid)) {
        snprintf(why, len, "no authenticated CURVE key on this connection");
        return 1;
    }
    int32_t id = ps_curve_allow_trainer(a, key);
    if (id >= 0 && (uint32_t)id != h->trainer_id) {
        snprintf(why, len, "key %.8s... is bound to trainer %d in --curve-allow; this request "
                 "says trainer %u", uid, (int)id, h->trainer_id);
        return 1;
    }
    if (h->op == ZPS__OP__OP_SHUTDOWN && h->trainer_id != 0) {
        snprintf(why, len, "SHUTDOWN from trainer %u: with trainer-bound keys only trainer 0 "
                 "(the chief) may shut the servers down", h->trainer_id);
        return 1;
    }
    return 0;
}

/* One received message: frames[0] identity, frames[1] header, frames[2..] payload. */
static void s_handle(ps_server *s, int nframes, int overflow, uint64_t bytes, uint64_t t0)
{
    zmq_msg_t *ident = &s->frames[0];
    if (nframes < 2) {
        s_reject(s, ident, 0, 0, ZPS_ERR_FRAMES, "no header frame");
        return;
    }
    if (overflow) {
        s_reject(s, ident, 0, 0, ZPS_ERR_FRAMES, "too many frames in one message");
        return;
    }
    size_t hl = zmq_msg_size(&s->frames[1]);
    if (hl > ZPS_HEADER_MAX_BYTES) {
        s_reject(s, ident, 0, 0, ZPS_ERR_TOO_LARGE, "header frame larger than 1 MiB");
        return;
    }
    Zps__Header *h = zps__header__unpack(NULL, hl, zmq_msg_data(&s->frames[1]));
    if (!h) {
        s_reject(s, ident, 0, 0, ZPS_ERR_PROTO, "header frame is not a valid Header protobuf");
        return;
    }
    int op = (int)h->op;
    char why[256];
    if (h->version != ZPS_PROTOCOL_VERSION) {
        snprintf(why, sizeof why, "protocol version %u, server speaks %u", h->version,
                 ZPS_PROTOCOL_VERSION);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_VERSION, why);
    } else if (op <= 0 || op >= S_N_OPS || h->is_reply) {
        s_reject(s, ident, op < 0 || op >= S_N_OPS ? 0 : op, h->request_id, ZPS_ERR_OP,
                 h->is_reply ? "a reply sent to the server" : "unknown op");
    } else if (bytes > s->cfg.max_message_bytes + ZPS_HEADER_MAX_BYTES) {
        snprintf(why, sizeof why, "message of %" PRIu64 " bytes (limit --max-message-bytes %" PRIu64 ")",
                 bytes, s->cfg.max_message_bytes);
        s_reject(s, ident, op, h->request_id, ZPS_ERR_TOO_LARGE, why);
    } else if (op != ZPS__OP__OP_PUSH && op != ZPS__OP__OP_PUSHPULL && op != ZPS__OP__OP_INIT &&
               nframes != 2) {
        s_reject(s, ident, op, h->request_id, ZPS_ERR_FRAMES,
                 "payload frames on an op that carries none");
    } else if (s_key_mismatch(s, h, why, sizeof why)) {
        s_reject(s, ident, op, h->request_id, ZPS_ERR_UNAUTHORIZED, why);
    } else {
        s->st.requests[op]++;
        switch (op) {
        case ZPS__OP__OP_REGISTER:
            s_op_register(s, ident, h);
            s_latency(s, op, t0);
            break;
        case ZPS__OP__OP_INIT:
            s_op_init(s, ident, h, nframes);
            s_latency(s, op, t0);
            break;
        case ZPS__OP__OP_PUSH:
        case ZPS__OP__OP_PUSHPULL:
            s_op_push(s, ident, h, nframes, t0);
            break;
        case ZPS__OP__OP_PULL:
            s_op_pull(s, ident, h, nframes, t0);
            break;
        default:
            s_op_simple(s, ident, h, t0);
        }
    }
    zps__header__free_unpacked(h, NULL);
}

/* ------------------------------------------------------------------------- loop */

static void s_liveness(ps_server *s)
{
    if (s->cfg.trainer_timeout_s <= 0 || !s->trainers)
        return;
    uint64_t now = zps_now_ns(), lim = (uint64_t)(s->cfg.trainer_timeout_s * 1e9);
    int changed = 0;
    for (uint32_t t = 0; t < s->n_trainers; t++) {
        s_trainer *tr = &s->trainers[t];
        if (!tr->dropped && now - tr->last_seen_ns > lim) {
            tr->dropped = 1;
            s->st.trainers_dropped++;
            changed = 1;
            zps_log(ZPS_WARN, "ps", "trainer %u silent for %.1f s: dropped from the expected set (%u live)",
                    t, (double)(now - tr->last_seen_ns) * 1e-9, s_live(s));
        }
    }
    if (changed)
        s_after_drop(s);
}

static void s_timers(ps_server *s)
{
    double now = zps_now_s();
    if (s->retired)
        s_reap_retired(s);
    if (now - s->last_liveness_s >= 0.05) {
        s->last_liveness_s = now;
        s_liveness(s);
    }
    if (s->cfg.checkpoint_every_seconds > 0 && s->initialised &&
        now - s->last_ckpt_s >= s->cfg.checkpoint_every_seconds)
        s_write_checkpoint(s);
    if (s->cfg.stats_every_s > 0 && now - s->last_stats_s >= s->cfg.stats_every_s) {
        s->last_stats_s = now;
        zps_log(ZPS_INFO, "ps",
                "version %" PRIu64 " | pushes %" PRIu64 " pulls %" PRIu64 " | in %.1f MB out %.1f MB"
                " | updates %" PRIu64 " stale %" PRIu64 " rejected %" PRIu64 " | live %u/%u",
                s_min_version(s), s->st.pushes, s->st.pulls, (double)s->st.bytes_in / 1e6,
                (double)s->st.bytes_out / 1e6, s->st.updates, s->st.stale_dropped,
                s->st.rejected_total, s->trainers ? s_live(s) : 0, s->n_trainers);
    }
}

/* Receives one whole message (all parts) into s->frames. */
static zps_status s_recv(ps_server *s, int *nframes, int *overflow, uint64_t *bytes)
{
    int n = 0, more = 1;
    *overflow = 0;
    *bytes = 0;
    while (more) {
        zmq_msg_t *m = &s->frames[n < S_MAX_FRAMES ? n : S_MAX_FRAMES - 1];
        if (n >= S_MAX_FRAMES) {
            zmq_msg_close(m);
            *overflow = 1;
        }
        zmq_msg_init(m);
        if (zmq_msg_recv(m, s->sock, 0) == -1) {
            int e = zmq_errno();
            zmq_msg_close(m);
            for (int i = 0; i < n && i < S_MAX_FRAMES - 1; i++)
                zmq_msg_close(&s->frames[i]);
            if (e == EINTR)
                return ZPS_ERR_INTERRUPTED;
            zps_log(ZPS_ERROR, "zmq", "zmq_msg_recv: %s", zmq_strerror(e));
            return e == ETERM ? ZPS_ERR_SHUTDOWN : ZPS_ERR_ZMQ;
        }
        *bytes += zmq_msg_size(m);
        more = zmq_msg_more(m);
        if (n < S_MAX_FRAMES)
            n++;
    }
    *nframes = n;
    return ZPS_OK;
}

zps_status ps_server_run_once(ps_server *s, int timeout_ms, int *handled)
{
    *handled = 0;
    zmq_pollitem_t it = {s->sock, 0, ZMQ_POLLIN, 0};
    int rc = zmq_poll(&it, 1, timeout_ms);
    if (rc == -1 && zmq_errno() != EINTR)
        ZPS_CHECK_ZMQ(rc);
    if (rc > 0) {
        int nframes, overflow;
        uint64_t bytes, t0 = zps_now_ns();
        ZPS_TRY(s_recv(s, &nframes, &overflow, &bytes));
        s_handle(s, nframes, overflow, bytes, t0);
        for (int i = 0; i < nframes; i++)
            zmq_msg_close(&s->frames[i]);
        *handled = 1;
    }
    s_timers(s);
    return ZPS_OK;
}

zps_status ps_server_run(ps_server *s)
{
    zmq_pollitem_t it = {s->sock, 0, ZMQ_POLLIN, 0};
    while (!s->stop) {
        int rc = zmq_poll(&it, 1, 50);
        if (rc == -1) {
            if (zmq_errno() == EINTR)
                continue;
            ZPS_CHECK_ZMQ(rc);
        }
        for (int burst = 0; rc > 0 && burst < 64 && !s->stop; burst++) {
            int ev = 0;
            size_t evl = sizeof ev;
            ZPS_CHECK_ZMQ(zmq_getsockopt(s->sock, ZMQ_EVENTS, &ev, &evl));
            if (!(ev & ZMQ_POLLIN))
                break;
            int nframes, overflow;
            uint64_t bytes;
            uint64_t t0 = zps_now_ns();
            zps_status st = s_recv(s, &nframes, &overflow, &bytes);
            if (st == ZPS_ERR_INTERRUPTED)
                break;
            ZPS_TRY(st);
            s_handle(s, nframes, overflow, bytes, t0);
            for (int i = 0; i < nframes; i++)
                zmq_msg_close(&s->frames[i]);
        }
        s_timers(s);
    }
    /* Pending requests get an answer rather than a silent drop. */
    while (s->n_pending) {
        s_pending *p = &s->pending[0];
        s_reply r = {p->op, p->rid, ZPS_ERR_SHUTDOWN, "server shutting down", s_min_version(s), 0, 0};
        s_send(s, &p->ident, &r, NULL, 0);
        s_pending_drop(s, 0);
    }
    return ZPS_OK;
}

void ps_server_stop(ps_server *s) { s->stop = 1; }

const char *ps_server_endpoint(const ps_server *s) { return s->endpoint; }

/* CURVE server mode on s->sock (before bind): the key pair, then the ZAP handler that
 * admits the allow-list's keys. Every key file problem is logged with the file's name. */
static zps_status s_setup_curve(ps_server *s)
{
    const ps_server_config *cfg = &s->cfg;
    char why[768], pub[PS_CURVE_KEY_LEN + 1], sec[PS_CURVE_KEY_LEN + 1];
    if (!zmq_has("curve")) {
        zps_log(ZPS_ERROR, "ps", "--curve-key: this libzmq has no CURVE support");
        return ZPS_ERR_UNSUPPORTED;
    }
    ps_curve_allow *allow = NULL;
    zps_status st = ZPS_OK;
    if (!cfg->curve_allow_any)
        st = ps_curve_allow_load(cfg->curve_allow, &allow, why, sizeof why);
    if (st == ZPS_OK)
        st = ps_curve_load_keypair(cfg->curve_key, pub, sec, why, sizeof why);
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "ps", "%s", why);
        ps_curve_allow_destroy(&allow);
        return st;
    }
    int one = 1;
    int rc = zmq_setsockopt(s->sock, ZMQ_CURVE_SERVER, &one, sizeof one);
    if (rc != -1)
        rc = zmq_setsockopt(s->sock, ZMQ_CURVE_SECRETKEY, sec, PS_CURVE_KEY_LEN + 1);
    if (rc != -1)
        rc = zmq_setsockopt(s->sock, ZMQ_ZAP_DOMAIN, "zps", 3);
    explicit_bzero(sec, sizeof sec);
    if (rc == -1) {
        zps_log(ZPS_ERROR, "ps", "CURVE socket options: %s", zmq_strerror(zmq_errno()));
        ps_curve_allow_destroy(&allow);
        return ZPS_ERR_ZMQ;
    }
    size_t n_allow = ps_curve_allow_count(allow), n_bound = ps_curve_allow_bound(allow);
    ZPS_TRY(ps_curve_zap_new(s->ctx, s->sock, &allow, &s->zap));
    if (cfg->curve_allow_any)
        zps_log(ZPS_WARN, "ps", "CURVE on (server key %.8s...) with --curve-allow-any: traffic is "
                "encrypted but any client key is admitted", pub);
    else
        zps_log(ZPS_INFO, "ps", "CURVE on (server key %.8s...): %zu trainer key(s) allowed from %s, "
                "%zu of them bound to one trainer id", pub, n_allow, cfg->curve_allow, n_bound);
    return ZPS_OK;
}

zps_status ps_server_new(const ps_server_config *cfg, ps_server **out)
{
    *out = NULL;
    if (cfg->replicas_to_aggregate && cfg->num_trainers &&
        cfg->replicas_to_aggregate > cfg->num_trainers) {
        zps_log(ZPS_ERROR, "ps", "--replicas-to-aggregate %u exceeds --num-trainers %u",
                cfg->replicas_to_aggregate, cfg->num_trainers);
        return ZPS_ERR_INVALID;
    }
    if ((cfg->restore || cfg->checkpoint_every_seconds > 0 || cfg->checkpoint_every_versions) &&
        !cfg->checkpoint_dir[0]) {
        zps_log(ZPS_ERROR, "ps", "--restore and --checkpoint-every-* need --checkpoint-dir");
        return ZPS_ERR_INVALID;
    }
    int allow_flags = (cfg->curve_allow[0] != 0) + (cfg->curve_allow_any != 0);
    if (cfg->curve_key[0] && allow_flags != 1) {
        zps_log(ZPS_ERROR, "ps", "--curve-key needs exactly one of --curve-allow FILE and "
                "--curve-allow-any");
        return ZPS_ERR_INVALID;
    }
    if (!cfg->curve_key[0] && allow_flags) {
        zps_log(ZPS_ERROR, "ps", "--curve-allow and --curve-allow-any need --curve-key FILE");
        return ZPS_ERR_INVALID;
    }
    ps_server *s = zps_xcalloc(1, sizeof *s);
    s->cfg = *cfg;
    s->mode = cfg->mode;
    s->n_trainers = cfg->num_trainers > PS_MAX_TRAINERS ? PS_MAX_TRAINERS : cfg->num_trainers;
    s->replicas = cfg->replicas_to_aggregate;
    s->staleness = cfg->staleness;
    s->frames = zps_xcalloc(S_MAX_FRAMES, sizeof *s->frames);
    s->ranges = zps_xcalloc(PS_MAX_RANGES, sizeof *s->ranges);
    double now = zps_now_s();
    s->last_ckpt_s = s->last_stats_s = s->last_liveness_s = now;
    zps_status st = ZPS_OK;
    s->ctx = zmq_ctx_new();
    if (!s->ctx) {
        ps_server_destroy(&s);
        ZPS_CHECK_PTR(NULL, ZPS_ERR_ZMQ);
    }
    if (zmq_ctx_set(s->ctx, ZMQ_IO_THREADS, cfg->io_threads > 0 ? cfg->io_threads : 1) == -1) {
        ps_server_destroy(&s);
        ZPS_CHECK_ZMQ(-1);
    }
    s->sock = zmq_socket(s->ctx, ZMQ_ROUTER);
    if (!s->sock) {
        ps_server_destroy(&s);
        ZPS_CHECK_PTR(NULL, ZPS_ERR_ZMQ);
    }
    int zero = 0, linger = 2000;
    int64_t maxmsg = (int64_t)(cfg->max_message_bytes + ZPS_HEADER_MAX_BYTES);
    char bind[600];
    snprintf(bind, sizeof bind, "%s", cfg->bind);
    size_t bl = strlen(bind);
    if (bl > 2 && !strcmp(bind + bl - 2, ":0"))
        snprintf(bind + bl - 1, sizeof bind - (bl - 1), "*");
    if (cfg->curve_key[0] && (st = s_setup_curve(s)) != ZPS_OK) {
        ps_server_destroy(&s);
        return st;
    }
    if (zmq_setsockopt(s->sock, ZMQ_SNDHWM, &zero, sizeof zero) == -1 ||
        zmq_setsockopt(s->sock, ZMQ_RCVHWM, &zero, sizeof zero) == -1 ||
        zmq_setsockopt(s->sock, ZMQ_LINGER, &linger, sizeof linger) == -1 ||
        zmq_setsockopt(s->sock, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) == -1 ||
        zmq_bind(s->sock, bind) == -1) {
        zps_log(ZPS_ERROR, "ps", "cannot bind %s: %s", cfg->bind, zmq_strerror(zmq_errno()));
        ps_server_destroy(&s);
        return ZPS_ERR_ZMQ;
    }
    size_t el = sizeof s->endpoint;
    if (zmq_getsockopt(s->sock, ZMQ_LAST_ENDPOINT, s->endpoint, &el) == -1) {
        ps_server_destroy(&s);
        ZPS_CHECK_ZMQ(-1);
    }
    if (cfg->restore) {
        st = s_restore(s);
        if (st != ZPS_OK) {
            ps_server_destroy(&s);
            return st;
        }
    }
    s_ensure_trainer_state(s);
    *out = s;
    return ZPS_OK;
}

void ps_server_destroy(ps_server **ps)
{
    if (!ps || !*ps)
        return;
    ps_server *s = *ps;
    while (s->n_pending)
        s_pending_drop(s, 0);
    free(s->pending);
    if (s->sock)
        zmq_close(s->sock);
    ps_curve_zap_destroy(&s->zap); // its sockets must be closed before the context ends
    if (s->ctx)
        zmq_ctx_term(s->ctx); // returns once zmq released every zero-copy reply frame
    s_free_shard(s);
    while (s->retired) { // zmq_ctx_term above released every frame
        s_retired *r = s->retired;
        s->retired = r->next;
        zps_aligned_free(r->values);
        free(r->readers);
        free(r);
    }
    free(s->trainers);
    free(s->frames);
    free(s->ranges);
    free(s);
    *ps = NULL;
}
