/* trace.h — zps-trainer --trace FILE: a timeline of a window of steps in the Chrome
 * trace-event format (JSON), which chrome://tracing and Perfetto (ui.perfetto.dev) open.
 *
 * What is recorded (docs/training.md "Timeline"):
 *  - on the training thread (tid 1), as complete events ("ph":"X") nested in a "step"
 *    span: input, forward, backward, and the waits of the sync back-end (a pull's values
 *    before a layer reads them, the step's pushes at its end, the all-reduce's buckets);
 *  - each push and pull (PS modes) and each all-reduce bucket as an async span ("ph":"b"
 *    / "e", one id each) from when it was issued to when it completed, named after its
 *    first variable, so overlapping transfers show as parallel lanes beside backward.
 * Times are microseconds since the trace was made (CLOCK_MONOTONIC); "pid" is the trainer
 * id, so the files of several trainers can be loaded together.
 *
 * The window is steps [first, first + count) (0-based, the loop's step numbers); the file
 * is written when the window closes (or at tr_trace_finish if the run ends inside it), so a
 * long job has its timeline after a few steps. Events go into an array sized at
 * tr_trace_new (no allocation while recording); when it is full later events are dropped
 * and counted in the file's "otherData".
 *
 * Recording is thread-safe (a back-end's communication thread records its own spans);
 * tr_trace_step and tr_trace_finish belong to the training thread. Every function accepts
 * a NULL trace and then does nothing, so call sites need no checks.
 */
#ifndef ZPS_TRAINER_TRACE_H
#define ZPS_TRAINER_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

typedef struct tr_trace tr_trace;

/* Tracks (Chrome's "tid"): the training thread and the communication lanes. */
enum { TR_TRACE_MAIN = 1, TR_TRACE_COMM = 2 };

/* A trace of steps [first, first + count) of trainer `trainer` into path, with room for
 * max_events events (0: 65536). The file is checked for writing now (ZPS_ERR_IO, logged). */
zps_status tr_trace_new(const char *path, int64_t first, int64_t count, int trainer,
                        size_t max_events, tr_trace **out);
/* Step `step` begins (the training thread): opens or closes the window; closing it writes
 * the file. */
zps_status tr_trace_step(tr_trace *t, int64_t step);
/* The current time for a span's start, or 0 outside the window (then tr_trace_span and
 * tr_trace_async record nothing). */
uint64_t tr_trace_now(const tr_trace *t);
/* A complete event [t0, now] on track tid; name must outlive the trace (a literal or a
 * model's variable name). arg (>= 0) is shown as args.n (e.g. a variable count), -1: none. */
void tr_trace_span(tr_trace *t, int tid, const char *name, uint64_t t0, int64_t arg);
/* An async span [t0, t1] in category cat ("push", "pull", "allreduce"). */
void tr_trace_async(tr_trace *t, const char *cat, const char *name, uint64_t t0, uint64_t t1,
                    int64_t arg);
/* Writes the file if the window opened and it was not written yet; frees t. */
zps_status tr_trace_finish(tr_trace **pt);

#endif
