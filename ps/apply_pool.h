/* apply_pool.h — a server's optimizer update over several threads (--apply-threads).
 *
 * A zps-server handles one request at a time on one thread (server.h); what one request
 * costs on a host whose trainer waits for it is mostly the update of a chunk's values
 * (ps_optim_apply over up to a million floats: a pass over the values, the gradient and the
 * optimizer's slots, bound by memory bandwidth). The pool cuts such an update into slices,
 * one per thread, and returns when every slice is done: the request is still handled whole
 * before the next one, so nothing of the server's ordering changes.
 *
 * Invariants:
 *  - The update is elementwise (every optimizer of ps/optim.h): any cut gives the same bits
 *    as one call. Slices are whole multiples of 16 floats (a cache line) except the last.
 *  - An update of fewer than 2 x PS_APPLY_MIN floats runs on the calling thread alone; a
 *    longer one on at most n / PS_APPLY_MIN threads.
 *  - The workers are made once (ps_apply_pool_new) and wait between updates; nothing is
 *    allocated per update. One caller at a time (the server's thread).
 */
#ifndef ZPS_PS_APPLY_POOL_H
#define ZPS_PS_APPLY_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "ps/optim.h"

/* Floats per slice at the least: below this a thread's hand-off costs what it saves. */
#define PS_APPLY_MIN 32768

typedef struct ps_apply_pool ps_apply_pool;

/* A pool for `threads` slices (the caller's thread and threads - 1 workers); 1 makes no
 * worker. ZPS_ERR_INVALID outside 1..PS_APPLY_MAX_THREADS, ZPS_ERR_INTERNAL when a thread
 * cannot start (logged). */
#define PS_APPLY_MAX_THREADS 64
zps_status ps_apply_pool_new(int threads, ps_apply_pool **out);
void ps_apply_pool_destroy(ps_apply_pool **p);
int ps_apply_pool_threads(const ps_apply_pool *p);

/* ps_optim_apply(c, step, w, slots, g, n), cut over the pool's threads. p NULL: one call. */
void ps_apply_pool_run(ps_apply_pool *p, const ps_optim_config *c, uint64_t step, float *w,
                       float *const *slots, const float *g, size_t n);

#endif
