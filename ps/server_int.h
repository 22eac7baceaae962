/* server_int.h — private to the server's .c files (not part of ps/server.h).
 *
 * The server is one struct (below) and six files, each with one job:
 *   server.c              lifecycle, the poll loop, receiving, dispatch, replies
 *   server_validate.c     every check of a request (pure reads of the state)
 *   server_ops.c          one handler per op: check, note the trainer, change state, reply
 *   server_shard.c        values, slots, chunk map, zero-copy readers, async apply, checkpoints
 *   server_consistency.c  sync coverage and apply, async bookkeeping, ssp clocks, waiting
 *                         requests and the barrier, liveness
 *   server_stats.c        counters, latency and staleness histograms, STATS JSON, the log line
 *   server_admin.c        the operator's ops: STATS, CHECKPOINT (cuts), SHUTDOWN and its drain
 * Each field group of struct ps_server says which file writes it. Names shared between the
 * files start with ps_srv_; helpers private to one file are static s_*.
 */
#ifndef ZPS_PS_SERVER_INT_H
#define ZPS_PS_SERVER_INT_H

#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <zmq.h>

#include "common/proto.h"
#include "common/status.h"
#include "ps/apply_pool.h"
#include "ps/curve.h"
#include "ps/optim.h"
#include "ps/server.h"
#include "ps/shm.h"

#define PS_SRV_MAX_FRAMES (PS_MAX_RANGES + 2)
#define PS_SRV_RID_RING 64
#define PS_SRV_LAT_BUCKETS 96
#define PS_SRV_N_OPS 13
#define PS_SRV_STALE_BUCKETS 8
/* Without --trainer-timeout, an incarnation silent this long no longer holds its trainer
 * id against a new one (docs/ps.md "Trainer identity"). */
#define PS_SRV_IDENT_SILENT_S 10.0
/* CHECKPOINT cuts one server keeps waiting for their version (server_admin.c). */
#define PS_SRV_CUT_WAITS 8
/* After SHUTDOWN, the longest the server waits for its trainers to hear it and leave. */
#define PS_SRV_DRAIN_S 3.0

/* Indexed by op (Zps__Op) and by ps_mode. */
extern const char *const ps_srv_op_names[PS_SRV_N_OPS];
extern const char *const ps_srv_mode_names[4];

typedef struct ps_srv_chunk {
    uint32_t key;
    uint64_t count;      // elements
    uint64_t off;        // first element in the local flat buffers
    uint64_t version;    // updates applied
    uint32_t n_complete; // sync: trainers complete at `version`
} ps_srv_chunk;

/* sync: one pushed range kept until its chunk is applied. Large aligned frames are kept as
 * they arrived (a reference to ZeroMQ's receive buffer, no copy); small or misaligned ones
 * are copied into the trainer's accum. */
typedef struct ps_srv_held {
    uint32_t lc;        // local chunk
    uint64_t off, n;    // element offset in the chunk, count
    const float *data;  // the gradient: into msg's buffer or into accum
    int has_msg;
    zmq_msg_t msg;      // a reference to the frame (has_msg)
} ps_srv_held;

/* The process that holds a trainer id (docs/ps.md "Trainer identity"). */
typedef struct ps_srv_incarnation {
    uint64_t nonce;         // 0: none registered yet
    int64_t start_unix_ms;
    uint32_t pid;
    char host[64];          // checked printable at REGISTER
} ps_srv_incarnation;

typedef struct ps_srv_trainer {
    int registered;
    ps_srv_incarnation inc;  // the registered incarnation: requests with another nonce are refused
    int dropped;             // silent past --trainer-timeout, or left (sync/ssp: not waited for)
    int left;                // sent LEAVE: heartbeats and barriers do not bring it back
    uint64_t last_seen_ns;
    int64_t clock;           // steps completed: max pushed step + 1
    float *accum;            // sync: (local_total) small or misaligned pushed ranges
    uint64_t *covered;       // sync: (local_total bits) elements pushed at their chunk's version
    ps_srv_held *held;       // sync: ranges pushed for chunks not applied yet
    size_t n_held, cap_held;
    uint64_t rid[PS_SRV_RID_RING]; // recent push request ids (0 = empty)
    int32_t rid_status[PS_SRV_RID_RING];
    unsigned rid_pos;
} ps_srv_trainer;

/* A validated range: local chunk index, element offset and count, payload (push). */
typedef struct ps_srv_range {
    uint32_t lc;
    uint64_t off;
    uint64_t n;
    const void *data;  // push: the payload frame's bytes (NULL for a pull), any alignment
    int bf16;          // the payload is bfloat16 (ps_client_opts.push_dtype), else f32
    int shm;           // data lies in the trainer's shared-memory slot (Header.shm_data)
    uint64_t version;  // async/ssp push: the chunk's version the range is applied at
} ps_srv_range;

/* A request whose reply waits: sync/ssp pulls and barriers. */
typedef struct ps_srv_pending {
    zmq_msg_t ident;
    uint64_t rid;
    uint32_t trainer;
    int op;
    int64_t need;          // the condition's threshold (version or clock)
    uint32_t n_ranges;
    ps_srv_range *ranges;  // owned
    int packed;            // the values go back in one frame (Header.packed)
    uint64_t shm_nonce;    // the segment the asker has mapped (Header.shm_nonce)
    uint64_t t0_ns;
} ps_srv_pending;

typedef struct ps_srv_stats {
    uint64_t requests[PS_SRV_N_OPS];
    uint64_t pushes, pulls;        // ranges pushed / pulled
    uint64_t bytes_in, bytes_out;  // payload bytes
    uint64_t updates;              // chunk updates applied
    uint64_t stale_dropped;        // push ranges dropped as stale (and partial sync data)
    uint64_t rejected[ZPS_STATUS_COUNT];
    uint64_t rejected_total;
    uint64_t staleness[PS_SRV_STALE_BUCKETS]; // 0,1,2,3,4-7,8-15,16-31,32+
    uint64_t lat[PS_SRV_N_OPS][PS_SRV_LAT_BUCKETS];
    uint64_t checkpoints;
    uint64_t trainers_dropped, trainers_rejoined, trainers_left;
    uint64_t reader_waits; // updates that waited for zmq to finish sending the old values
    uint64_t values_cow;   // waits that gave up: values moved to a fresh copy (stuck peer)
    /* recovery: updates + updates_restored - updates_undone = the sum of chunk versions */
    uint64_t rollbacks;        // ROLLBACKs that loaded a checkpoint
    uint64_t updates_undone;   // chunk updates those rollbacks discarded
    uint64_t updates_restored; // chunk updates the --restore checkpoint brought
    uint64_t shm_pushes, shm_pulls; // ranges whose bytes crossed in shared memory
} ps_srv_stats;

/* A values block (and its reader counts) replaced while zmq still sent from it. */
typedef struct ps_srv_retired {
    float *values;
    int owned;           // 0: the values of a shared-memory segment (not freed here)
    atomic_int *readers; // (n)
    uint32_t n;
    struct ps_srv_retired *next;
} ps_srv_retired;

/* A CHECKPOINT or SHUTDOWN cut whose version this server has not reached yet
 * (server_admin.c). */
typedef struct ps_srv_cut_wait {
    zmq_msg_t ident;   // the asker (a copy)
    uint64_t rid;
    uint64_t version;  // done when every chunk is at this version
    int op;            // CHECKPOINT: write it; SHUTDOWN: write it and shut down
    uint32_t sender;   // the request's trainer id
} ps_srv_cut_wait;

/* The chunk table an INIT brings, once validated (ps_srv_check_init). keys and counts are
 * owned (ps_srv_init_table_free). */
typedef struct ps_srv_init_table {
    ps_optim_config opt;
    uint32_t n;        // ranges = chunks
    uint32_t *keys;    // (n) ascending
    uint64_t *counts;  // (n) elements
    uint64_t total;    // payload bytes
} ps_srv_init_table;

struct ps_server {
    ps_server_config cfg;

    /* transport (server.c) */
    void *ctx;
    void *sock;
    char endpoint[512];
    volatile sig_atomic_t stop;
    zmq_msg_t *frames;    // (PS_SRV_MAX_FRAMES), reused: [0] identity, [1] header, [2..] payload
    ps_srv_range *ranges; // (PS_MAX_RANGES), reused: the request's ranges once validated
    int req_packed;       // the request being handled has Header.packed (replies likewise)
    int req_op;           // ... its op
    uint64_t req_shm_nonce; // ... its Header.shm_nonce (the segment the client has mapped)
    ps_curve_zap *zap;    // CURVE: the ZAP handler thread (NULL: plaintext)

    /* job (server_ops.c, from the flags and the first REGISTER) */
    ps_mode mode;
    uint32_t n_trainers;  // 0 until known
    uint32_t replicas;    // 0 = n_trainers
    int staleness;

    /* plan summary, known from the first REGISTER / INIT / checkpoint (server_ops.c,
     * server_shard.c on restore) */
    int have_plan;
    uint64_t plan_hash;
    uint32_t plan_vars, plan_servers, num_chunks;
    uint64_t plan_total, plan_chunk_bytes;
    char plan_src[64];

    /* shard (server_shard.c; versions also server_consistency.c) */
    int initialised;
    ps_optim_config opt;
    int n_slots;
    uint32_t n_local;
    ps_srv_chunk *chunks;  // (n_local) in key order
    int32_t *key_to_local; // (num_chunks), -1 when not ours
    uint64_t local_total, max_chunk;
    float *values;         // (local_total)
    float *slots[2];       // (local_total) each
    float *scratch;        // (max_chunk) averaged gradient / unaligned input
    ps_apply_pool *apply;  // the optimizer's updates, over --apply-threads threads
    atomic_int *readers;   // (n_local) reply frames zmq still reads from the chunk's values
    /* the same-host data plane (ps/shm.h; server_shard.c): the segment whose values are
     * s->values while it is valid; replaced ones stay mapped until destroy (old), since zmq
     * frames or held pushes may still point into them */
    ps_shm *shm;
    ps_shm **shm_old;
    size_t n_shm_old;
    int shm_failed;        // creating one failed: not tried again
    ps_srv_retired *retired; // old values blocks zmq still sends from (server_shard.c)

    /* consistency (server_consistency.c) */
    ps_srv_trainer *trainers; // (n_trainers)
    uint32_t *recv_n;     // sync/async: (n_local * n_trainers) elements received (uint64 not needed: chunk <= 2^32)
    ps_srv_pending *pending;
    size_t n_pending, cap_pending;

    /* checkpoints and timers (server_shard.c, server.c) */
    uint64_t last_ckpt_version;
    /* sync recovery (server_shard.c, server_ops.c; docs/ps.md "Recovery"): this process's
     * random incarnation, and the last rollback it took part in (its token, 0 = none, and
     * the version it went back to). A restored server starts one (ps_srv_rollback_token). */
    uint64_t incarnation, rb_token, rb_version;
    double last_ckpt_s, last_stats_s, last_liveness_s;

    ps_srv_stats st;      // (every file counts; server_stats.c reports)

    /* admin (server_admin.c) */
    ps_srv_cut_wait cut_waits[PS_SRV_CUT_WAITS];
    uint32_t n_cut_waits;
    uint64_t stop_at;      // SHUTDOWN at version V waits: V + 1 (pushes of step V on are
                           // refused); 0: none
    double drain_until;    // 0: serving; after SHUTDOWN: stop then, or once no trainer is live
    uint32_t drain_sender; // the trainer that sent SHUTDOWN (not waited for), or none
    uint64_t cut_written;  // the last CHECKPOINT cut this server wrote, + 1 (0: none): a
                           // SHUTDOWN at that version may end at it after training went on

    /* --metrics file (server_stats.c; the timer in server.c) */
    FILE *metrics;            // NULL: none, or closed after a write failed
    char *metrics_line;       // (metrics_cap) the record buffer, reused; grows only when a
                              // record outgrows it (more trainers)
    size_t metrics_cap;
    double metrics_t0_s;      // when the start record was written (zps_now_s)
    double last_metrics_s;    // when the last record was written
    ps_srv_stats metrics_prev; // the counters at the last record, for the rates
    uint64_t metrics_prev_version;
};

/* ---- server.c: replies */

typedef struct ps_srv_reply {
    int op;
    uint64_t rid;
    int status;
    const char *msg;
    uint64_t version;
    int with_job;
    int with_opt;
    int packed;  // the values (ranges) in one frame, back to back (Header.packed)
    uint64_t shm_nonce; // the asker's Header.shm_nonce: values through the segment when it
                        // names the current one, else an offer of it (REGISTER, INIT, pulls)
} ps_srv_reply;

/* Sends one reply to ident (not consumed); ranges (may be NULL) become the payload frames,
 * sent from the current values (zero-copy when large, see ps_srv_wait_readers). */
zps_status ps_srv_send(ps_server *s, zmq_msg_t *ident, const ps_srv_reply *r,
                       const ps_srv_range *ranges, uint32_t n_ranges);
/* Error reply: counts the rejection, logs at debug (a flood must not fill the log). */
void ps_srv_reject(ps_server *s, zmq_msg_t *ident, int op, uint64_t rid, zps_status st,
                   const char *why);
/* ps_srv_reject of a REGISTER whose trainer id a live incarnation holds: the reply names the
 * holder (Header.holder), so a successor on its host can check whether it is really alive. */
void ps_srv_reject_held(ps_server *s, zmq_msg_t *ident, const Zps__Header *h,
                        const char *why);

/* ---- server_validate.c: every check; none changes the state except ps_srv_check_ranges,
 * which fills s->ranges (scratch). On rejection why says what is wrong. */

/* Frame and header checks common to every op (frames, header, protocol version, op, size,
 * CURVE key binding). On success *h is the unpacked header (the caller frees it); on
 * rejection *h is the header when it could be unpacked (else NULL) and *op the op to name
 * in the reply. */
zps_status ps_srv_check_message(ps_server *s, int nframes, int overflow, uint64_t bytes,
                                Zps__Header **h, int *op, char *why, size_t why_len);
zps_status ps_srv_check_trainer(const ps_server *s, const Zps__Header *h, char *why,
                                size_t why_len);
/* The ranges of a PUSH / PUSHPULL (has_data: one payload frame each) or a PULL (none), into
 * s->ranges. */
zps_status ps_srv_check_ranges(ps_server *s, const Zps__Header *h, int nframes, int has_data,
                               char *why, size_t why_len);
/* REGISTER: the job against the server's flags and earlier trainers; *nt the job's trainer
 * count. */
zps_status ps_srv_check_register(const ps_server *s, const Zps__Header *h, uint32_t *nt,
                                 char *why, size_t why_len);
/* INIT (after ps_srv_check_trainer): optimizer, plan, first writer, the chunk table and its
 * value frames. On success *t holds the table (ps_srv_init_table_free). */
zps_status ps_srv_check_init(const ps_server *s, const Zps__Header *h, int nframes,
                             ps_srv_init_table *t, char *why, size_t why_len);
void ps_srv_init_table_free(ps_srv_init_table *t);

/* ---- server_shard.c */

uint64_t ps_srv_min_version(const ps_server *s);
uint64_t ps_srv_max_version(const ps_server *s);
/* The smallest version among the ranges' chunks (all chunks when n is 0). */
uint64_t ps_srv_ranges_version(const ps_server *s, const ps_srv_range *r, uint32_t n);
/* Reply frames share the values: zmq calls this when it is done with one. */
void ps_srv_reader_done(void *data, void *hint);
/* Before chunk lc's values change: waits for zmq to finish sending them, or moves the
 * values to a fresh copy when a peer has stopped reading. */
void ps_srv_wait_readers(ps_server *s, uint32_t lc);
/* Frees retired values blocks zmq has let go of (all = 1: every one, zmq is gone). */
void ps_srv_reap_retired(ps_server *s, int all);
/* The per-chunk optimizer slots at element off, into buf. */
float *const *ps_srv_slot_ptrs(ps_server *s, uint64_t off, float **buf);
/* Values [b, b + k) of pushed range g as f32 into dst: widened (bf16) or copied. */
void ps_srv_range_to_f32(const ps_srv_range *g, uint64_t b, uint64_t k, float *dst);
/* The segment clients may use now (valid, holding s->values), or NULL. */
ps_shm *ps_srv_shm(const ps_server *s);
/* Creates the segment once the shard and the trainer count are known (--no-shm: never) and
 * moves the values into it. */
void ps_srv_shm_ensure(ps_server *s);
/* Unmaps the replaced segments (destroy, after zmq is gone). */
void ps_srv_shm_free_old(ps_server *s);
/* The frame of g can be read as f32 where it lies. */
int ps_srv_range_in_place(const ps_srv_range *g);
/* Replaces the shard by the INIT's table and values (payload frames s->frames[2..]). */
void ps_srv_shard_init(ps_server *s, const ps_srv_init_table *t);
void ps_srv_shard_free(ps_server *s);
/* async / ssp: applies the n validated ranges of s->ranges, each at its recorded version. */
void ps_srv_apply_ranges(ps_server *s, uint32_t n);
/* cut: every server of a sync fleet writes this version too (INIT, SHUTDOWN, the multiples
 * of --checkpoint-every-versions): it is also kept as a versioned file (docs/ps.md
 * "Recovery"). The timer's and CHECKPOINT's are not. */
zps_status ps_srv_write_checkpoint(ps_server *s, int cut);
/* After an update: a checkpoint when --checkpoint-every-versions says so. */
void ps_srv_maybe_checkpoint(ps_server *s);
zps_status ps_srv_restore(ps_server *s);
/* sync: the shard goes back to its versioned checkpoint of version v (same chunk table),
 * and versioned checkpoints after v (an abandoned timeline) are removed. ZPS_ERR_NOT_FOUND
 * or ZPS_ERR_CORRUPT with why when that checkpoint cannot be used; nothing changed then. */
zps_status ps_srv_rollback(ps_server *s, uint64_t v, char *why, size_t why_len);
/* A new rollback token: the wall clock in ms (so a later rollback has a larger token) and
 * 16 bits of the incarnation. */
uint64_t ps_srv_rollback_token(const ps_server *s);

/* ---- server_stats.c: the --metrics file (docs/ps.md "Metrics file"). A failed write is
 * logged and closes the file: the server serves on without it. */

/* Creates the file and writes the start record (nothing without --metrics). */
zps_status ps_srv_metrics_open(ps_server *s);
/* A stats record when --metrics-every has passed since the last one (the loop's timer). */
void ps_srv_metrics_tick(ps_server *s, double now);
/* The end record (end: "shutdown", "signal", "error") and closes the file; idempotent. */
void ps_srv_metrics_close(ps_server *s, const char *end);

/* ---- server_consistency.c */

uint32_t ps_srv_live(const ps_server *s);
/* Per-trainer state once both the trainer count and the shard are known. */
void ps_srv_trainers_ensure(ps_server *s);
/* Drops every sync range the trainers hold and their per-shard buffers (shard replaced). */
void ps_srv_trainers_release(ps_server *s);
/* Any word from trainer t: alive, and back when it had been dropped. */
void ps_srv_seen(ps_server *s, uint32_t t);
/* Push request ids: 1 and the status when rid was handled already; note one. */
int ps_srv_rid_seen(const ps_srv_trainer *tr, uint64_t rid, int *status);
void ps_srv_rid_note(ps_srv_trainer *tr, uint64_t rid, int status);
/* sync push of the validated s->ranges: coverage check (ZPS_ERR_INVALID and nothing changed
 * when a range repeats elements), then accumulation and apply of complete chunks. Ranges
 * for another step are counted in *stale (behind) and *ahead, and dropped. */
zps_status ps_srv_sync_push(ps_server *s, const Zps__Header *h, uint32_t *stale,
                            uint32_t *ahead, char *why, size_t why_len);
/* async / ssp push of the validated s->ranges: versions, clocks and statistics; the
 * arithmetic is ps_srv_apply_ranges, run by the caller after the reply. */
void ps_srv_async_push(ps_server *s, const Zps__Header *h);
/* An ssp pull for step raises the trainer's clock to step (it pushed step - 1). */
void ps_srv_ssp_pull_clock(ps_server *s, uint32_t t, int64_t step);
/* Whether a waiting (or about to wait) request can be answered now. */
int ps_srv_pending_ready(ps_server *s, const ps_srv_pending *p);
void ps_srv_pending_add(ps_server *s, zmq_msg_t *ident, uint64_t rid, uint32_t trainer, int op,
                        int64_t need, const ps_srv_range *r, uint32_t n, uint64_t t0);
void ps_srv_pending_drop(ps_server *s, size_t i);
/* Answers the waiting requests whose condition holds, then the barrier. */
void ps_srv_check_pending(ps_server *s);
void ps_srv_check_barrier(ps_server *s);
/* Waiting pulls refer to the old chunk table: answered ZPS_ERR_BUSY before a re-INIT. */
void ps_srv_pending_reinit(ps_server *s);
/* A trainer stopped being waited for (timed out or left). */
void ps_srv_after_drop(ps_server *s);
/* sync rollback: every pushed range, coverage bit and count is dropped, and waiting pulls
 * are answered ZPS_ERR_STALE (they wait for a version of the abandoned timeline). */
void ps_srv_sync_reset(ps_server *s);
/* Drops trainers silent past --trainer-timeout. */
void ps_srv_liveness(ps_server *s);
/* Whether trainer t's registered incarnation is live: not left, not dropped, and heard
 * from within --trainer-timeout (PS_SRV_IDENT_SILENT_S without one); *silent_s how long
 * it has been silent. */
int ps_srv_incarnation_live(const ps_server *s, uint32_t t, double *silent_s);
/* A new incarnation takes trainer t over from a dead or departed one: what the old one
 * left half done (sync partial pushes, async partial chunk counts, request ids) is
 * forgotten, so the new one starts clean. */
void ps_srv_trainer_reset(ps_server *s, uint32_t t);

/* ---- server_stats.c */

void ps_srv_latency(ps_server *s, int op, uint64_t t0);
void ps_srv_staleness(ps_server *s, int64_t stale);
/* STATS as JSON into b (cap bytes, may be 0); returns the length it needs. */
size_t ps_srv_stats_json(ps_server *s, char *b, size_t cap);
/* The periodic one-line summary (--stats-every). */
void ps_srv_stats_log(ps_server *s);

/* ---- server_ops.c: the op handlers, called by the dispatch once the message checks passed */

void ps_srv_op_register(ps_server *s, zmq_msg_t *ident, const Zps__Header *h);
void ps_srv_op_init(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes);
void ps_srv_op_push(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes,
                    uint64_t t0);
void ps_srv_op_pull(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, int nframes,
                    uint64_t t0);
/* HEARTBEAT, LEAVE, BARRIER, STATS, CHECKPOINT, SHUTDOWN, ROLLBACK. */
void ps_srv_op_simple(ps_server *s, zmq_msg_t *ident, const Zps__Header *h, uint64_t t0);

/* ---- server_admin.c */

/* STATS, CHECKPOINT, SHUTDOWN. */
void ps_srv_op_admin(ps_server *s, zmq_msg_t *ident, const Zps__Header *h);
/* After updates: answers the CHECKPOINT cuts whose version was reached (or passed). */
void ps_srv_admin_progress(ps_server *s);
/* From the timers: ends SHUTDOWN's drain (s->stop) when it is over. */
void ps_srv_admin_tick(ps_server *s);

#endif
