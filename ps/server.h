/* server.h — the parameter server (zps-server's engine), one per process.
 *
 * One ROUTER socket. The server owns the chunks the plan gives it: their values and the
 * optimizer slots live in one flat buffer each (in key order), allocated once at INIT (or
 * restore) and never freed until destroy. Every request is validated completely before it
 * touches state; a rejected request gets an error reply, bumps a counter and changes
 * nothing. The loop is single-threaded: requests are handled in arrival order, which is
 * what makes async mode's "applied in arrival order" and sync mode's determinism easy to
 * state. Pull replies are sent zero-copy straight from the values (an update waits until
 * zmq has sent them, or moves the values to a fresh copy if a peer stopped reading);
 * receive memory is zmq's, kept warm by zps_malloc_keep_warm() (common/mem.h).
 *
 * The wire protocol, modes, flags and STATS fields are documented in docs/ps.md.
 */
#ifndef ZPS_PS_SERVER_H
#define ZPS_PS_SERVER_H

#include <stdint.h>

#include "common/status.h"

typedef enum ps_mode {
    PS_MODE_UNSET = 0, // learn it from the first REGISTER
    PS_MODE_SYNC = 1,  // values match Zps__Mode
    PS_MODE_ASYNC = 2,
    PS_MODE_SSP = 3,
} ps_mode;

/* Most ranges one request may carry. */
#define PS_MAX_RANGES 16384
/* Most trainers one job may have. */
#define PS_MAX_TRAINERS 4096
/* --trainer-timeout's default, in seconds (docs/ps.md "Liveness" says why 30): a live
 * trainer heartbeats every second even in a long step, so this only has to outlast a
 * trainer's start-up and a network outage the fleet should ride out, while the peers of a
 * dead trainer go on after it. */
#define PS_DEFAULT_TRAINER_TIMEOUT_S 30.0

typedef struct ps_server_config {
    char bind[512];               // tcp://HOST:PORT, port 0 or * = ephemeral
    int index;                    // server index in the job (checkpoint file name)
    int check_index;              // index was given (--index/--cluster): REGISTER must match
    ps_mode mode;                 // PS_MODE_UNSET: from REGISTER
    uint32_t num_trainers;        // 0: from REGISTER
    uint32_t replicas_to_aggregate; // 0: num_trainers (or from REGISTER)
    int staleness;                // -1: from REGISTER (ssp)
    double trainer_timeout_s;     // drop a trainer silent this long (default
                                  // PS_DEFAULT_TRAINER_TIMEOUT_S); 0: never
    char checkpoint_dir[512];     // "" = no checkpoints
    uint64_t checkpoint_every_versions; // 0 = off
    double checkpoint_every_seconds;    // 0 = off
    int restore;                  // load the checkpoint at start when present
    int allow_reinit;             // accept a second INIT (replaces values, resets versions)
    uint64_t max_message_bytes;   // payload bytes per request
    double stats_every_s;         // periodic one-line log; 0 = off
    char metrics[512];            // JSON Lines file of STATS records (docs/ps.md "Metrics
                                  // file"); "" = none
    double metrics_every_s;       // seconds between its records (default 10)
    int io_threads;               // ZeroMQ I/O threads (default 1)
    int apply_threads;            // threads of one optimizer update (ps/apply_pool.h;
                                  // default 1: the request's own thread alone)
    int shm;                      // offer trainers on this host the shared-memory data
                                  // plane (docs/ps.md "Shared memory"; default 1)
    char curve_key[512];          // CURVE key pair file (ps/curve.h); "" = plaintext
    char curve_allow[512];        // trainer public keys allowed in; needed with curve_key
                                  // unless curve_allow_any
    int curve_allow_any;          // CURVE without an allow-list: any trainer key (still
                                  // encrypted, but anyone may connect)
} ps_server_config;

typedef struct ps_server ps_server;

void ps_server_config_default(ps_server_config *c);

/* Binds, and restores when asked. With curve_key, the socket is a CURVE server and a ZAP
 * handler thread admits the keys of curve_allow (docs/ps.md "Security"). On success *out is
 * the caller's. Errors: ZPS_ERR_ZMQ (bind), ZPS_ERR_CORRUPT / ZPS_ERR_IO (checkpoint),
 * ZPS_ERR_INVALID (config), ZPS_ERR_NOT_FOUND / ZPS_ERR_PARSE / ZPS_ERR_INVALID (key files:
 * the log line names the file and the reason). */
zps_status ps_server_new(const ps_server_config *cfg, ps_server **out);
/* The endpoint actually bound (ephemeral port resolved), e.g. tcp://127.0.0.1:40123. */
const char *ps_server_endpoint(const ps_server *s);
/* Serves until SHUTDOWN or ps_server_stop(); returns ZPS_OK then. After ps_server_stop()
 * it first writes a final checkpoint (with --checkpoint-dir; SHUTDOWN writes its own) and
 * returns that write's status. */
zps_status ps_server_run(ps_server *s);
/* Waits up to timeout_ms for one request and handles it (*handled = 1), then runs the
 * timers. For tests and the fuzz target, which drive the server step by step. */
zps_status ps_server_run_once(ps_server *s, int timeout_ms, int *handled);
/* Asks the loop to return (async-signal-safe: sets a flag). */
void ps_server_stop(ps_server *s);
/* Writes a checkpoint now (no-op without --checkpoint-dir). */
zps_status ps_server_checkpoint(ps_server *s);
void ps_server_destroy(ps_server **ps);


#endif
