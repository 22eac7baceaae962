/* client.h — the library trainers link to talk to the parameter servers.
 *
 * The trainer keeps ONE flat float buffer of values and one of gradients, laid out as the
 * plan says (variable i at plan->var_offset[i]). Push and pull work on a range of variables
 * [first_var, first_var + n_vars): the client cuts it into per-server requests along the
 * plan's chunks and sends them at once; the call returns a ticket without waiting. That is
 * what lets a trainer push the last layers' gradients while backward still runs and pull
 * the first layers first while the next forward starts. ps_client_wait(ticket) blocks until
 * every server answered (or failed); many tickets may be in flight at once.
 *
 * Buffers: a push reads the gradient buffer zero-copy, so the pushed range must not change
 * until its ticket is waited for. A pull writes the value range when its replies arrive,
 * inside ps_client_wait*(); do not read the range before its ticket completes.
 *
 * Steps (the `step` argument):
 *   sync   push: the step the gradient belongs to (= the version it was computed from);
 *          pull: wait until every chunk has at least this version (after pushing step s,
 *          pull s + 1). -1 = no wait.
 *   async  push: the version the gradient was computed from (staleness statistics);
 *          pull: ignored (never waits).
 *   ssp    push and pull: the trainer's clock (steps completed); a pull at clock c waits
 *          until the slowest live trainer has pushed step c - s - 1.
 * A push for a step the server has moved past (a backup worker's late push, or a trainer
 * behind a restored server) fails with ZPS_ERR_STALE; ps_client_wait_version() then gives
 * the server's version so the trainer can pull and continue from there.
 *
 * Failures: a server's error reply comes back as its zps_status and readable message
 * (ps_client_last_error). A request without a reply is resent after timeout_ms, with
 * back-off, up to max_retries times (the server drops a duplicate push by request id),
 * then fails with ZPS_ERR_TIMEOUT. A server that lost the trainer's registration (it was
 * restarted) is re-registered automatically and the request resent.
 *
 * Identity: each client is one incarnation of its trainer id (a random nonce, start time,
 * host, pid; ps_client_incarnation). While another live process holds the id, REGISTER
 * fails with ZPS_ERR_EXISTS and a message naming both; a client whose id was taken over
 * fails its next request the same way (docs/ps.md "Trainer identity").
 *
 * Security: with the three curve_* keys set, every socket of the client (the DEALERs, the
 * heartbeat thread's, sockets reopened after a failure) is a CURVE client (docs/ps.md
 * "Security"). Whether keys are set or not, a handshake the server refuses — a key not in
 * its allow-list, CURVE on one side only, a wrong server key — fails the requests to that
 * server with ZPS_ERR_UNAUTHORIZED and a message saying which it was, within about
 * 0.1 s of the verdict (two handshakes when the server just closes the connection), never
 * after a timeout; later requests to that server fail at once until a handshake succeeds.
 *
 * Not thread-safe: one client per thread (the optional heartbeat thread has its own
 * sockets).
 */
#ifndef ZPS_PS_CLIENT_H
#define ZPS_PS_CLIENT_H

#include <stdatomic.h>
#include <stdint.h>

#include "common/status.h"
#include "ps/dtype.h"
#include "ps/optim.h"
#include "ps/plan.h"
#include "ps/server.h"

typedef uint64_t ps_ticket;

typedef struct ps_client_opts {
    int timeout_ms;   // wait for a reply this long before resending (default 30000)
    int max_retries;  // resends before ZPS_ERR_TIMEOUT (default 4)
    int backoff_ms;   // first pause before a resend, doubled each time (default 50)
    int heartbeat_ms; // while waiting, heartbeat a server silent this long (default 1000, 0 off)
    int heartbeat_thread; // 1: a background thread heartbeats every heartbeat_ms from
                          // register on, so long compute steps do not look like a dead
                          // trainer to --trainer-timeout (default 0: only while waiting)
    uint64_t msg_bytes; // cut each server's part of a push/pull into messages of about this
                        // many bytes (default 1 MiB; 0 = one message per server)
    int streams;        // TCP connections per server (default 1, at most 8): messages go out
                        // round-robin over them, each connection on its own ZeroMQ I/O
                        // thread. With more than 1, a server may handle a trainer's requests
                        // out of order (replies are matched by id; sync and ssp waits hold,
                        // but an async pull may miss the trainer's own push just before it)
    ps_dtype push_dtype; // PS_DTYPE_F32 (default) or PS_DTYPE_BF16: the gradients of push and
                         // pushpull go on the wire as bfloat16, half the bytes (ps/dtype.h);
                         // values (INIT, pull) are always f32
    int packed;          // 1 (default): a push's or pull's ranges travel in ONE payload frame
                         // each way (Header.packed, docs/ps.md "Packed payloads") when they
                         // average under 256 KiB a range; larger ones, and all with 0, go as
                         // one frame per range, zero-copy from the caller's buffers
    int shm;             // 1 (default): with a server on this host, push (sync) and pull
                         // payloads cross in its shared-memory segment (docs/ps.md "Shared
                         // memory"), one memcpy each way; 0: always through ZeroMQ
    /* CURVE (Z85 text, ps/curve.h): all three or none ("" = plaintext, the default). */
    char curve_server_key[41]; // the servers' public key (one key pair for the fleet)
    char curve_public_key[41]; // this trainer's key pair
    char curve_secret_key[41];
    /* A flag the caller's signal handler raises to stop (NULL: none). Once *stop != 0, every
     * wait (ps_client_wait*, ps_client_poll and the blocking operations) returns
     * ZPS_ERR_INTERRUPTED within one poll slice (<= 100 ms), whatever it waits for, and
     * leaves its requests behind: the caller is stopping, not failing. An atomic, not a
     * volatile sig_atomic_t: the handler may run on another thread (a signal thread,
     * common/proc.h), where only a lock-free atomic is both signal-safe and race-free. */
    const atomic_int *stop;
} ps_client_opts;

/* What the trainer asks for at REGISTER; zeros mean "whatever the server has". */
typedef struct ps_job {
    ps_mode mode;
    uint32_t num_trainers;
    uint32_t replicas_to_aggregate;
    uint32_t staleness;
} ps_job;

typedef struct ps_client ps_client;

void ps_client_opts_default(ps_client_opts *o);
/* Reads the servers' public key (a .pub file) and this client's key pair file into o's
 * curve_* fields (ps/curve.h); on failure why names the file and what is wrong. */
zps_status ps_client_opts_curve(ps_client_opts *o, const char *server_key_file,
                                const char *key_file, char *why, size_t why_len);

/* Connects a DEALER to each server (server_uris[i] is server i of the plan). opts may be
 * NULL (defaults). *out is the caller's (ps_client_destroy). ZPS_ERR_INVALID when only some
 * curve keys are set or one is not Z85; ZPS_ERR_UNSUPPORTED when libzmq lacks CURVE. */
zps_status ps_client_new(const char *const *server_uris, int n_servers, uint32_t trainer_id,
                         const ps_client_opts *opts, ps_client **out);
/* Waits for nothing; drops whatever is in flight. */
void ps_client_destroy(ps_client **pc);

/* REGISTER with every server (blocking). plan is borrowed and must outlive the client; its
 * n_servers must equal the client's. job may be NULL. On success *effective (may be NULL)
 * holds the job the servers run (their flags win). Errors: ZPS_ERR_PLAN (with the message
 * saying which side differs), ZPS_ERR_CONFIG, ZPS_ERR_VERSION, ... */
zps_status ps_client_register(ps_client *c, const ps_plan *plan, const ps_job *job,
                              ps_job *effective);
/* INIT every server with the flat value buffer and the optimizer (blocking). First writer
 * wins: *first (may be NULL) is 1 when this call initialised every server, 0 when they were
 * already initialised (ZPS_ERR_ALREADY_INIT is then not an error). A server holding a
 * different optimizer answers ZPS_ERR_CONFIG. */
zps_status ps_client_init(ps_client *c, const float *values, const ps_optim_config *opt,
                          int *first);

zps_status ps_client_push(ps_client *c, int first_var, int n_vars, const float *grads,
                          int64_t step, ps_ticket *t);
zps_status ps_client_pull(ps_client *c, int first_var, int n_vars, float *values, int64_t step,
                          ps_ticket *t);
/* Push the gradients, then receive the values after they were applied (sync: after step
 * `step` was aggregated). */
zps_status ps_client_pushpull(ps_client *c, int first_var, int n_vars, const float *grads,
                              float *values, int64_t step, ps_ticket *t);

/* ps_client_push and ps_client_pushpull for gradients already rounded to bfloat16 (the bits
 * ps_f32_to_bf16 makes; a GPU trainer rounds them on the device, so half the bytes cross to
 * the host): grads is the flat buffer of the whole model as uint16, read at the variables'
 * offsets, sent as it is (zero-copy when large, like f32 grads), and must stay
 * unchanged until the ticket completes. Only with push_dtype bf16 (ZPS_ERR_INVALID
 * otherwise); the bytes on the wire are those of the f32 calls on the unrounded gradients. */
zps_status ps_client_push_bf16(ps_client *c, int first_var, int n_vars, const uint16_t *grads,
                               int64_t step, ps_ticket *t);
zps_status ps_client_pushpull_bf16(ps_client *c, int first_var, int n_vars,
                                   const uint16_t *grads, float *values, int64_t step,
                                   ps_ticket *t);

/* Drives the sockets for up to timeout_ms (0: once) and sets *done when ticket t has
 * completed (then call ps_client_wait for its status). */
zps_status ps_client_poll(ps_client *c, ps_ticket t, int timeout_ms, int *done);
/* Blocks until ticket t completed; returns its first error. */
zps_status ps_client_wait(ps_client *c, ps_ticket t);
/* Takes every reply already arrived, without waiting (a timeline wants each request's end
 * when it happened, not when it was next waited for). */
zps_status ps_client_progress(ps_client *c);
/* When ticket t's last reply was taken (zps_now_ns), or 0: not finished, or the ticket is
 * no longer known. */
uint64_t ps_client_done_ns(ps_client *c, ps_ticket t);
/* Same; *version is the smallest model version the servers reported for it. */
zps_status ps_client_wait_version(ps_client *c, ps_ticket t, uint64_t *version);
/* Waits for every ticket in flight; returns the first error among tickets not yet waited. */
zps_status ps_client_wait_all(ps_client *c);

/* LEAVE on every server (blocking): this trainer is done. Sync chunks, ssp pulls and
 * barriers stop waiting for it at once (no --trainer-timeout needed); it may still wait in
 * a barrier, and any push, pull or REGISTER later brings it back. Stops the heartbeat
 * thread. */
zps_status ps_client_leave(ps_client *c);

/* From now on every wait of c gives up ms milliseconds from now (ZPS_ERR_TIMEOUT, naming
 * what is still open) and the stop flag no longer interrupts it: for a stopping trainer's
 * last words (LEAVE), which must neither hang on a dead server nor be cut short by the stop
 * that caused them. ms <= 0 lifts the deadline. */
void ps_client_set_deadline(ps_client *c, int ms);

/* Returns when every live trainer reached the barrier (held by server 0). */
zps_status ps_client_barrier(ps_client *c);
/* HEARTBEAT to every server; *version (may be NULL) = smallest server version. */
zps_status ps_client_heartbeat(ps_client *c, uint64_t *version);
/* STATS JSON of server i; *json is the caller's (free). */
zps_status ps_client_stats(ps_client *c, int server, char **json);
/* CHECKPOINT on every server, now. */
zps_status ps_client_checkpoint(ps_client *c);
/* SHUTDOWN every server (each checkpoints first when configured). */
zps_status ps_client_shutdown(ps_client *c);

/* ---- the operator's ops (zps-ctl; docs/ps.md "Admin ops") */

/* The trainer id an operator's client (zps-ctl) gives ps_client_new: no trainer's, so a key
 * bound to a trainer cannot send for it. Such a client never registers. */
#define PS_CLIENT_CTL_ID 0xffffffffu

/* What one server answered. */
typedef struct ps_client_answer {
    int status;       // zps_status of its reply, or of the failure to get one
    uint64_t version; // the reply's model_version
    char msg[1024];   // the reply's message (CHECKPOINT: "version V: PATH [PATH]")
} ps_client_answer;

/* CHECKPOINT (shutdown 0) or SHUTDOWN (1) on every server: now (cut 0), or (cut 1, sync
 * mode) at the consistent cut of `version`: each server acts and answers once all its
 * chunks are at it (a SHUTDOWN refuses pushes past it meanwhile), ZPS_ERR_STALE when it is
 * past it. answers (may be NULL): one per server. The first failure is returned. */
zps_status ps_client_admin(ps_client *c, int shutdown, int cut, uint64_t version,
                           ps_client_answer *answers);

/* This client's incarnation nonce: random, never 0, fixed for the client's life. Every
 * request carries it (REGISTER also the start time, host name and pid); a server refuses
 * a second live incarnation of a trainer id (docs/ps.md "Trainer identity"). */
uint64_t ps_client_incarnation(const ps_client *c);

/* Recovery (sync mode; docs/ps.md "Recovery"). When a server was killed and restored from
 * its checkpoint of version v, the fleet goes back to v: every request of this client that
 * was in flight fails with ZPS_ERR_STALE, and so does every later push or pull until the
 * caller has called ps_client_rollback. 1 (and *version = v, may be NULL) when that is
 * pending. */
int ps_client_rollback_pending(const ps_client *c, uint64_t *version);
/* Waits for everything in flight, then has every server load its checkpoint of v (once per
 * rollback, whichever trainer asks first). Afterwards the servers hold exactly the model of
 * version v: pull it (step v) and redo the steps after it. *version (may be NULL) = v. */
zps_status ps_client_rollback(ps_client *c, uint64_t *version);
/* Message of the last failure ("" when none); borrowed, valid until the next call. */
const char *ps_client_last_error(const ps_client *c);
int ps_client_num_servers(const ps_client *c);

#endif
