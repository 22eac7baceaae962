/* zps/zps.h — the stable C API of libzps.so: a trainer's side of the zps parameter servers.
 *
 * This is the only header an application includes; it includes zps/status.h, the status
 * codes with zps_strerror() (a readable message) and zps_status_name() ("ZPS_ERR_PLAN").
 * It is a thin layer over the client the zps trainers use (ps/client.h in the source tree):
 * opaque handles and plain types only, so the library's internal structs can change without
 * breaking a program built against it. Build with
 *     cc app.c $(pkg-config --cflags --libs zps)
 *
 * ABI: the soname is libzps.so.<major> (libzps.so.0 for 0.x releases). Within one major the
 * functions below keep their signatures and the structs their layout; a change to either
 * bumps the major. New functions may appear in a minor release (ZPS_API_VERSION says which).
 *
 * The model is an ordered list of float32 variables {name, element count}. Every trainer of a
 * job registers the same list (the servers check its hash); the library cuts it into chunks
 * and spreads them over the servers. A push or pull names a range of variables
 * [first_var, first_var + n_vars) and a buffer holding exactly those variables back to back
 * (variable first_var's first element at data[0]): one tensor per call, or a flat buffer of
 * the whole model with first_var 0.
 *
 * Tickets: push, pull and pushpull return at once with a ticket; zps_wait(ticket) blocks
 * until every server answered and gives the ticket's first error. Many tickets may be in
 * flight. A push reads its buffer without copying it (unless push_dtype is bf16: the library
 * rounds into its own wire buffer), so the buffer must not change until its ticket is
 * waited for. A pull writes its buffer inside zps_wait / zps_poll: do not read it before.
 *
 * Steps (the `step` argument), by consistency mode:
 *   sync   push: the step the gradient belongs to (the model version it was computed from);
 *          pull: wait until every chunk has at least this version (after pushing step s,
 *          pull s + 1); -1 = no wait. The servers average the num_trainers gradients of a
 *          step before one optimizer update.
 *   async  push: the version the gradient was computed from (staleness statistics); every
 *          push is applied on arrival. pull: never waits.
 *   ssp    push and pull: the trainer's clock (steps completed); a pull at clock c waits until
 *          the slowest live trainer pushed step c - staleness - 1.
 * A push for a step the servers moved past fails with ZPS_ERR_STALE.
 *
 * Errors: every function returns a zps_status (0 = ZPS_OK, negative codes from zps/status.h;
 * their values are stable: they travel on the wire). A server's refusal comes back as its
 * status and its message, read with zps_last_error(). A request without a reply is resent
 * (timeout_ms, max_retries), then fails with ZPS_ERR_TIMEOUT.
 *
 * Logging: the library writes zps's log lines to stderr (level info; the environment variable
 * ZPS_LOG=warn|error|off, read by zps_connect, quiets it).
 *
 * Threads: one client per thread (a client is not thread-safe); clients are independent.
 */
#ifndef ZPS_ZPS_H
#define ZPS_ZPS_H

#include <stddef.h>
#include <stdint.h>

#include "zps/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define ZPS_API __attribute__((visibility("default")))
#else
#define ZPS_API
#endif

/* Version of this API: bumped on every addition (minor) or break (major). */
#define ZPS_API_VERSION_MAJOR 0
#define ZPS_API_VERSION_MINOR 3

typedef struct zps_client zps_client; // opaque: one connection to a fleet of servers
typedef uint64_t zps_ticket;          // an operation in flight; 0 is never a ticket

enum { ZPS_MODE_DEFAULT = 0, ZPS_MODE_SYNC = 1, ZPS_MODE_ASYNC = 2, ZPS_MODE_SSP = 3 };
enum { ZPS_DTYPE_F32 = 0, ZPS_DTYPE_BF16 = 1 };
enum { ZPS_OPTIM_SGD = 0, ZPS_OPTIM_MOMENTUM, ZPS_OPTIM_RMSPROP, ZPS_OPTIM_ADAM, ZPS_OPTIM_ADAGRAD };
enum { ZPS_SCHED_CONSTANT = 0, ZPS_SCHED_EXPONENTIAL, ZPS_SCHED_COSINE };

/* Connection options; start from zps_options_default(). */
typedef struct zps_options {
    int timeout_ms;       // wait this long for a reply before resending (default 30000)
    int max_retries;      // resends before ZPS_ERR_TIMEOUT (default 4)
    int backoff_ms;       // first pause before a resend, doubled each time (default 50)
    int heartbeat_ms;     // while waiting, heartbeat a server silent this long (1000; 0 off)
    int heartbeat_thread; // 1: heartbeat from a background thread from register on, so long
                          // compute between calls does not look like a dead trainer (0)
    int streams;          // TCP connections per server, 1..8 (default 1)
    uint64_t msg_bytes;   // cut requests into messages of about this size (default 1 MiB)
    int push_dtype;       // ZPS_DTYPE_F32, or ZPS_DTYPE_BF16: gradients travel as bfloat16
                          // (rounded to nearest even; values always travel as f32)
    const char *curve_server_key_file; // CURVE: the servers' public key file (NAME.pub) and
    const char *curve_key_file;        // this trainer's key pair (NAME.key); both or NULL
} zps_options;

/* What a trainer asks for at register; 0 = whatever the servers run (their flags win). */
typedef struct zps_job {
    int mode;                       // ZPS_MODE_*
    uint32_t num_trainers;          // trainers in the job
    uint32_t replicas_to_aggregate; // sync: gradients averaged per step (default all)
    uint32_t staleness;             // ssp: the bound
} zps_job;

/* The servers' optimizer, sent once by zps_init (formulas: docs/ps.md "Optimizers"). The
 * fields are those of the library's internal config, copied into a struct of its own so that
 * the internal one can change without changing this ABI. */
typedef struct zps_optimizer {
    int kind;               // ZPS_OPTIM_*
    double lr;
    double momentum;        // momentum, rmsprop
    int nesterov;           // momentum
    double decay;           // rmsprop rho
    double epsilon;         // rmsprop, adam, adagrad
    double beta1, beta2;    // adam
    double weight_decay;    // L2 added to the gradient
    double initial_accumulator; // adagrad
    int sched;              // ZPS_SCHED_*
    double decay_rate;      // exponential
    uint64_t decay_steps;   // exponential (>= 1)
    int staircase;          // exponential
    uint64_t total_steps;   // cosine (>= 1)
    double min_lr;          // cosine
    uint64_t warmup_steps;  // linear warm-up, 0 = none
} zps_optimizer;

/* "0.3.0": the library's release. */
ZPS_API const char *zps_library_version(void);

ZPS_API void zps_options_default(zps_options *o);
/* sgd, lr 0.01, constant schedule, and the usual defaults of the other fields. */
ZPS_API void zps_optimizer_default(zps_optimizer *o);

/* Connects to n_servers servers ("tcp://HOST:PORT"; server i of the job is servers[i]) as
 * trainer trainer_id (0..num_trainers-1). opts may be NULL (defaults). Connecting does not
 * wait for the servers: zps_register does. On failure *out is NULL and zps_last_error(NULL)
 * says why (for this thread). */
ZPS_API zps_status zps_connect(const char *const *servers, int n_servers, uint32_t trainer_id,
                               const zps_options *opts, zps_client **out);
/* Drops whatever is in flight and frees the client; *pc becomes NULL (NULL is fine). */
ZPS_API void zps_close(zps_client **pc);

/* REGISTER the model's variables (names and float32 element counts, in the order every
 * trainer uses) with every server; blocks. chunk_bytes: the plan's chunk size (0: 4 MiB).
 * job may be NULL; *effective (may be NULL) receives the job the servers run. Once per
 * client. ZPS_ERR_PLAN when the servers hold another model, ZPS_ERR_EXISTS when a live
 * process holds this trainer id. */
ZPS_API zps_status zps_register(zps_client *c, const char *const *names, const uint64_t *counts,
                                int n_vars, uint64_t chunk_bytes, const zps_job *job,
                                zps_job *effective);
/* Number of variables and total elements registered (0 before zps_register). */
ZPS_API int zps_num_vars(const zps_client *c);
ZPS_API uint64_t zps_num_elements(const zps_client *c);

/* INIT every server with the whole model (values: zps_num_elements floats, variables back to
 * back) and the optimizer; blocks. The first trainer to call it wins: *first (may be NULL)
 * is 1 when this call initialised the servers, 0 when they already were (not an error).
 * opt NULL: zps_optimizer_default. */
ZPS_API zps_status zps_init(zps_client *c, const float *values, const zps_optimizer *opt,
                            int *first);

/* Push gradients / pull values of variables [first_var, first_var + n_vars); data holds those
 * variables back to back. Returns at once with *t (see "Tickets" and "Steps" above). */
ZPS_API zps_status zps_push(zps_client *c, int first_var, int n_vars, const float *grads,
                            int64_t step, zps_ticket *t);
ZPS_API zps_status zps_pull(zps_client *c, int first_var, int n_vars, float *values,
                            int64_t step, zps_ticket *t);
/* Push, then receive the values after the push was applied (sync: after step `step` was
 * aggregated). grads and values may be the same buffer only if the caller does not need the
 * gradients afterwards. */
ZPS_API zps_status zps_pushpull(zps_client *c, int first_var, int n_vars, const float *grads,
                                float *values, int64_t step, zps_ticket *t);

/* Blocks until ticket t completed and returns its first error; *version (may be NULL) is the
 * smallest model version the servers reported for it. Each ticket is waited for once. */
ZPS_API zps_status zps_wait(zps_client *c, zps_ticket t, uint64_t *version);
/* Waits for every ticket in flight; the first error among those not yet waited for. */
ZPS_API zps_status zps_wait_all(zps_client *c);
/* Drives the connections for up to timeout_ms (0: once); *done = 1 when t completed (then
 * zps_wait returns at once with its status). */
ZPS_API zps_status zps_poll(zps_client *c, zps_ticket t, int timeout_ms, int *done);

/* Blocks until every live trainer of the job reached the barrier. */
ZPS_API zps_status zps_barrier(zps_client *c);
/* Server `server`'s STATS as a JSON object; *json is the caller's (zps_free). */
ZPS_API zps_status zps_stats(zps_client *c, int server, char **json);
/* LEAVE: this trainer is done; sync steps and barriers stop waiting for it at once. */
ZPS_API zps_status zps_leave(zps_client *c);

/* The message of the client's last failure ("" when none), e.g. the server's reason for a
 * refusal; with c NULL, that of this thread's last failed zps_connect. Borrowed: valid until
 * the next call on c. */
ZPS_API const char *zps_last_error(const zps_client *c);
/* Frees what the library handed over (zps_stats's JSON). */
ZPS_API void zps_free(void *p);

#ifdef __cplusplus
}
#endif

#endif
