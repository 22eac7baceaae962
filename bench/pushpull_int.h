/* pushpull_int.h — private to `zps-bench pushpull`, shared by its two files:
 * bench_pushpull.c (the zps side, the cells, the table and the JSON) and
 * bench_pushpull_raw.c (the raw ZeroMQ baseline: its server process and its client).
 *
 * Both sides' clients run the same timed loop (bench_pp_timed_loop) over the same buffers
 * (bench_pp_client_buffers), so that their figures differ only by what one request costs.
 */
#ifndef ZPS_BENCH_PUSHPULL_INT_H
#define ZPS_BENCH_PUSHPULL_INT_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "ps/dtype.h"
#include "ps/plan.h"

enum { OP_PUSH = 0, OP_PULL = 1, OP_PUSHPULL = 2 };

#define MAX_SERVERS 2
#define MAX_CLIENTS 2

/* One side's repetition of a cell: what its client threads share. */
typedef struct bench_pp_run {
    int servers, clients, op, iters, warmup; // op: OP_*; iters measured after warmup
    size_t bytes;             // payload per request
    uint64_t msg_bytes;       // zps: ps_client_opts.msg_bytes
    ps_dtype dtype;           // push direction on the wire (--push-dtype)
    int streams;              // zps: ps_client_opts.streams
    const ps_plan *plan;      // one variable of bytes / 4 floats over the servers
    const char *uris[MAX_SERVERS];
    pid_t pids[MAX_SERVERS];  // the servers' processes, for their CPU time
    int raw;                  // raw ZeroMQ clients instead of zps ones
    pthread_barrier_t start;  // the clients' barrier (bench_pp_timed_loop)
    double *lat_us;           // (clients * iters)
    double t0, t1;            // wall time of the measured part (client 0)
    double cpu0, cpu1;        // CPU time of clients and servers at t0 and t1
    int failed;               // a zps client failed; err says why
    char err[256];
} bench_pp_run;

/* A client thread's argument: the run and its client index. */
typedef struct bench_pp_arg {
    bench_pp_run *r;
    int id;
} bench_pp_arg;

/* One request of a client (send it, wait for its reply); nonzero after a failure, and the
 * client then skips its remaining requests. */
typedef int (*bench_pp_request_fn)(void *ctx);

/* Client id's warm-up and measured requests, in step with the other clients: they all meet
 * the barrier before the first request, before the first measured one (where client 0
 * starts the clocks) and after the last (where it stops them). A failed client (failed set,
 * or a request failing) keeps meeting the barriers so that the others finish. */
void bench_pp_timed_loop(bench_pp_run *r, int id, bench_pp_request_fn request, void *ctx,
                         int failed);
/* A client's gradient (finite, non-zero) and value buffers of n floats, resident. */
void bench_pp_client_buffers(uint64_t n, float **grad, float **val);

/* The raw server (this process, exec'd afresh): one ROUTER, replies as bench_pushpull.c
 * describes at the top; writes its endpoint and a NUL byte to fd. Never returns. */
_Noreturn void bench_pp_raw_server(int fd);
/* A raw client thread (arg: bench_pp_arg): the same frames as the zps client, sizes per
 * server from the plan, over DEALER sockets. */
void *bench_pp_raw_client(void *arg);

#endif
