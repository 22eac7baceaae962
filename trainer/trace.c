/* trace.c — the --trace timeline (trace.h): events into a preallocated array, written once
 * as Chrome trace-event JSON.
 *
 * Invariants:
 *  - A slot is taken with one atomic increment and published by its `ready` flag (release
 *    store after it is filled); the writer reads only published slots, so a span recorded
 *    by another thread while the file is written is either whole in it or absent.
 *  - Nothing is recorded outside the window: tr_trace_now returns 0 there, and a span whose
 *    start is 0, or that ends after the file was written, is dropped silently (not counted:
 *    it is outside what the file claims to show).
 *  - The file is written to PATH.tmp and renamed, so a reader never sees half a file.
 */
#include "trainer/trace.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/json.h"
#include "common/log.h"
#include "common/mem.h"
#include "common/version.h"

typedef struct s_event {
    const char *name, *cat; // cat NULL: a complete event on tid
    uint64_t t0, t1;        // zps_now_ns
    int64_t arg;            // args.n, or -1
    int tid;
    atomic_int ready;
} s_event;

struct tr_trace {
    char path[4096];
    int64_t first, count;
    int pid;
    s_event *ev;
    size_t cap;
    atomic_size_t n;        // slots taken (may pass cap: those are dropped)
    atomic_int active;      // inside the window
    atomic_int written;     // the file is out
    uint64_t base;          // ts 0
};

zps_status tr_trace_new(const char *path, int64_t first, int64_t count, int trainer,
                        size_t max_events, tr_trace **out)
{
    *out = NULL;
    FILE *f = fopen(path, "w");
    if (!f) {
        zps_log(ZPS_ERROR, "trainer", "--trace %s: cannot create: %s", path, strerror(errno));
        return ZPS_ERR_IO;
    }
    fclose(f);
    unlink(path); /* written whole at the window's end */
    tr_trace *t = zps_xcalloc(1, sizeof *t);
    snprintf(t->path, sizeof t->path, "%s", path);
    t->first = first, t->count = count, t->pid = trainer;
    t->cap = max_events ? max_events : 65536;
    t->ev = zps_xcalloc(t->cap, sizeof *t->ev);
    t->base = zps_now_ns();
    *out = t;
    return ZPS_OK;
}

static void s_record(tr_trace *t, int tid, const char *cat, const char *name, uint64_t t0,
                     uint64_t t1, int64_t arg)
{
    if (!t || !t0 || atomic_load(&t->written))
        return;
    size_t i = atomic_fetch_add(&t->n, 1);
    if (i >= t->cap)
        return;
    s_event *e = &t->ev[i];
    e->name = name, e->cat = cat, e->t0 = t0, e->t1 = t1 < t0 ? t0 : t1, e->arg = arg;
    e->tid = tid;
    atomic_store_explicit(&e->ready, 1, memory_order_release);
}

uint64_t tr_trace_now(const tr_trace *t)
{
    return t && atomic_load(&t->active) ? zps_now_ns() : 0;
}

void tr_trace_span(tr_trace *t, int tid, const char *name, uint64_t t0, int64_t arg)
{
    if (t && t0)
        s_record(t, tid, NULL, name, t0, zps_now_ns(), arg);
}

void tr_trace_async(tr_trace *t, const char *cat, const char *name, uint64_t t0, uint64_t t1,
                    int64_t arg)
{
    s_record(t, TR_TRACE_COMM, cat, name, t0, t1, arg);
}

/* One event's JSON objects (an async span is its "b" and its "e") into f. */
static int s_write_event(FILE *f, const tr_trace *t, const s_event *e, int *first)
{
    char buf[1024];
    double ts = (double)(e->t0 - t->base) * 1e-3, te = (double)(e->t1 - t->base) * 1e-3;
    for (int k = 0; k < (e->cat ? 2 : 1); k++) {
        zps_json j = zps_json_over(buf, sizeof buf);
        zps_json_raw(&j, "%s\n{\"name\":", *first ? "" : ",");
        zps_json_str(&j, e->name ? e->name : "?");
        zps_json_raw(&j, ",\"cat\":\"%s\",\"pid\":%d,\"tid\":%d,", e->cat ? e->cat : "step",
                     t->pid, e->tid);
        if (!e->cat)
            zps_json_raw(&j, "\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f", ts, te - ts);
        else
            zps_json_raw(&j, "\"ph\":\"%s\",\"ts\":%.3f,\"id\":\"0x%zx\"", k ? "e" : "b",
                         k ? te : ts, (size_t)(e - t->ev));
        if (e->arg >= 0 && k == 0)
            zps_json_raw(&j, ",\"args\":{\"n\":%lld}", (long long)e->arg);
        zps_json_raw(&j, "}");
        if (!zps_json_fits(&j) || fputs(buf, f) == EOF)
            return -1;
        *first = 0;
    }
    return 0;
}

static int s_write_meta(FILE *f, const tr_trace *t)
{
    return fprintf(f, "{\"traceEvents\":[\n"
                   "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
                   "\"args\":{\"name\":\"zps-trainer %d\"}},\n"
                   "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
                   "\"args\":{\"name\":\"training thread\"}},\n"
                   "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
                   "\"args\":{\"name\":\"transfers\"}}",
                   t->pid, TR_TRACE_MAIN, t->pid, t->pid, TR_TRACE_MAIN, t->pid,
                   TR_TRACE_COMM) < 0;
}

static zps_status s_write(tr_trace *t)
{
    atomic_store(&t->written, 1);
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", t->path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        zps_log(ZPS_ERROR, "trainer", "--trace %s: cannot create: %s", tmp, strerror(errno));
        return ZPS_ERR_IO;
    }
    size_t n = atomic_load(&t->n), kept = 0;
    int bad = s_write_meta(f, t), first = 0;
    for (size_t i = 0; i < n && i < t->cap && !bad; i++) {
        const s_event *e = &t->ev[i];
        if (!atomic_load_explicit(&e->ready, memory_order_acquire))
            continue;
        bad = s_write_event(f, t, e, &first);
        kept++;
    }
    bad = bad || fprintf(f, "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"zps "
                         "%s\",\"trainer\":%d,\"first_step\":%lld,\"steps\":%lld,"
                         "\"events\":%zu,\"dropped\":%zu}}\n", ZPS_VERSION, t->pid,
                         (long long)t->first, (long long)t->count, kept,
                         n > t->cap ? n - t->cap : 0) < 0;
    if (fclose(f) != 0)
        bad = 1;
    if (bad || rename(tmp, t->path) != 0) {
        zps_log(ZPS_ERROR, "trainer", "--trace %s: write failed: %s", t->path, strerror(errno));
        unlink(tmp);
        return ZPS_ERR_IO;
    }
    zps_log(ZPS_INFO, "trainer", "wrote the timeline of steps %lld..%lld to %s (%zu events)",
            (long long)t->first + 1, (long long)t->first + t->count, t->path, kept);
    return ZPS_OK;
}

zps_status tr_trace_step(tr_trace *t, int64_t step)
{
    if (!t || atomic_load(&t->written))
        return ZPS_OK;
    if (step >= t->first + t->count) {
        atomic_store(&t->active, 0);
        return atomic_load(&t->n) ? s_write(t) : ZPS_OK;
    }
    if (step >= t->first)
        atomic_store(&t->active, 1);
    return ZPS_OK;
}

zps_status tr_trace_finish(tr_trace **pt)
{
    tr_trace *t = *pt;
    if (!t)
        return ZPS_OK;
    atomic_store(&t->active, 0);
    zps_status st = !atomic_load(&t->written) && atomic_load(&t->n) ? s_write(t) : ZPS_OK;
    if (!atomic_load(&t->written) && st == ZPS_OK)
        zps_log(ZPS_WARN, "trainer", "--trace %s: the run ended before step %lld: no timeline",
                t->path, (long long)t->first + 1);
    free(t->ev);
    free(t);
    *pt = NULL;
    return st;
}
