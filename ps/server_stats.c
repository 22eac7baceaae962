/* server_stats.c — what the server reports about itself (server_int.h): latency and
 * staleness histograms, the STATS reply's JSON (fields in docs/ps.md "STATS"), the
 * periodic one-line log (--stats-every) and the --metrics JSON Lines file (docs/ps.md
 * "Metrics file").
 *
 * Invariants:
 *   - Counting is a few additions on the hot path, never an allocation or a lock; the
 *     percentiles and the JSON are computed only when STATS or a metrics record asks.
 *   - A metrics record is the STATS JSON's fields, so a record and a STATS reply of the same
 *     moment agree; it is formatted into one reused buffer (grown only when a record no
 *     longer fits, i.e. when the trainer count grows) and written with one fwrite + fflush
 *     from the poll loop's thread. A write that fails closes the file, once, with an error
 *     line: the fleet's training matters more than its metrics.
 *   - Latency buckets are quarter powers of two of microseconds, so a percentile is exact
 *     to within 19% whatever the scale.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/json.h"
#include "common/log.h"
#include "common/mem.h"
#include "ps/server_config.h"
#include "ps/server_int.h"

static unsigned s_lat_bucket(uint64_t ns)
{
    double us = (double)ns / 1000.0;
    int b = (int)(4.0 * log2(us + 1.0));
    return b < 0 ? 0 : b >= PS_SRV_LAT_BUCKETS ? PS_SRV_LAT_BUCKETS - 1 : (unsigned)b;
}

/* Upper edge of bucket b in microseconds. */
static double s_lat_edge(unsigned b) { return exp2((double)(b + 1) / 4.0) - 1.0; }

static double s_lat_pct(const uint64_t *h, double p)
{
    uint64_t n = 0;
    for (int i = 0; i < PS_SRV_LAT_BUCKETS; i++)
        n += h[i];
    if (!n)
        return 0;
    uint64_t want = (uint64_t)ceil(p / 100.0 * (double)n), acc = 0;
    for (unsigned i = 0; i < PS_SRV_LAT_BUCKETS; i++) {
        acc += h[i];
        if (acc >= want && acc)
            return s_lat_edge(i);
    }
    return s_lat_edge(PS_SRV_LAT_BUCKETS - 1);
}

void ps_srv_latency(ps_server *s, int op, uint64_t t0)
{
    if (op < 0 || op >= PS_SRV_N_OPS)
        op = 0;
    s->st.lat[op][s_lat_bucket(zps_now_ns() - t0)]++;
}

void ps_srv_staleness(ps_server *s, int64_t st)
{
    unsigned b = st <= 0 ? 0 : st < 4 ? (unsigned)st : st < 8 ? 4 : st < 16 ? 5 : st < 32 ? 6 : 7;
    s->st.staleness[b]++;
}

#define S_J(...) n += (size_t)snprintf(b ? b + n : NULL, b && n < cap ? cap - n : 0, __VA_ARGS__)

/* The counters, job and CURVE fields; returns the new length. */
static size_t s_json_counters(ps_server *s, char *b, size_t cap, size_t n)
{
    S_J("{\"server\":%d,\"mode\":\"%s\",\"trainers\":%u,\"live_trainers\":%u,\"initialised\":%s,"
        "\"version\":%" PRIu64 ",\"chunks\":%u,\"values\":%" PRIu64 ",\"pushes\":%" PRIu64
        ",\"pulls\":%" PRIu64 ",\"bytes_in\":%" PRIu64 ",\"bytes_out\":%" PRIu64
        ",\"updates\":%" PRIu64 ",\"stale_dropped\":%" PRIu64 ",\"checkpoints\":%" PRIu64
        ",\"trainers_dropped\":%" PRIu64 ",\"trainers_rejoined\":%" PRIu64
        ",\"trainers_left\":%" PRIu64 ",\"pending\":%zu"
        ",\"reader_waits\":%" PRIu64 ",\"values_cow\":%" PRIu64,
        s->cfg.index, ps_srv_mode_names[s->mode], s->n_trainers, s->trainers ? ps_srv_live(s) : 0,
        s->initialised ? "true" : "false", ps_srv_min_version(s), s->n_local, s->local_total,
        s->st.pushes, s->st.pulls, s->st.bytes_in, s->st.bytes_out, s->st.updates,
        s->st.stale_dropped, s->st.checkpoints, s->st.trainers_dropped, s->st.trainers_rejoined,
        s->st.trainers_left,
        s->n_pending, s->st.reader_waits, s->st.values_cow);
    S_J(",\"rollbacks\":%" PRIu64 ",\"updates_undone\":%" PRIu64 ",\"updates_restored\":%" PRIu64
        ",\"rollback_version\":%" PRIu64, s->st.rollbacks, s->st.updates_undone,
        s->st.updates_restored, s->rb_version);
    S_J(",\"shm\":%s,\"shm_pushes\":%" PRIu64 ",\"shm_pulls\":%" PRIu64,
        ps_srv_shm(s) ? "true" : "false", s->st.shm_pushes, s->st.shm_pulls);
    ps_curve_counts cc = {0, 0, 0};
    if (s->zap)
        ps_curve_zap_counts(s->zap, &cc);
    S_J(",\"curve\":%s,\"auth_accepted\":%" PRIu64 ",\"auth_rejected\":%" PRIu64
        ",\"handshake_failed\":%" PRIu64,
        s->zap ? "true" : "false", cc.accepted, cc.rejected, cc.handshake_failed);
    return n;
}

/* Requests, rejections, staleness and latency; returns the new length. */
static size_t s_json_histograms(ps_server *s, char *b, size_t cap, size_t n)
{
    S_J(",\"requests\":{");
    for (int i = 1; i < PS_SRV_N_OPS; i++)
        S_J("%s\"%s\":%" PRIu64, i > 1 ? "," : "", ps_srv_op_names[i], s->st.requests[i]);
    S_J("},\"rejected_total\":%" PRIu64 ",\"rejected\":{", s->st.rejected_total);
    int first = 1;
    for (int i = 1; i < ZPS_STATUS_COUNT; i++)
        if (s->st.rejected[i]) {
            S_J("%s\"%s\":%" PRIu64, first ? "" : ",", zps_status_name(-i), s->st.rejected[i]);
            first = 0;
        }
    static const char *const sb[PS_SRV_STALE_BUCKETS] = {"0", "1", "2", "3", "4-7", "8-15",
                                                         "16-31", "32+"};
    S_J("},\"staleness\":{");
    for (int i = 0; i < PS_SRV_STALE_BUCKETS; i++)
        S_J("%s\"%s\":%" PRIu64, i ? "," : "", sb[i], s->st.staleness[i]);
    S_J("},\"latency_us\":{");
    first = 1;
    for (int i = 1; i < PS_SRV_N_OPS; i++) {
        uint64_t cnt = 0;
        for (int k = 0; k < PS_SRV_LAT_BUCKETS; k++)
            cnt += s->st.lat[i][k];
        if (!cnt)
            continue;
        S_J("%s\"%s\":{\"n\":%" PRIu64 ",\"p50\":%.1f,\"p90\":%.1f,\"p99\":%.1f}", first ? "" : ",",
            ps_srv_op_names[i], cnt, s_lat_pct(s->st.lat[i], 50), s_lat_pct(s->st.lat[i], 90),
            s_lat_pct(s->st.lat[i], 99));
        first = 0;
    }
    S_J("}}");
    return n;
}

#undef S_J

size_t ps_srv_stats_json(ps_server *s, char *b, size_t cap)
{
    size_t n = s_json_counters(s, b, cap, 0);
    return s_json_histograms(s, b, cap, n);
}

void ps_srv_stats_log(ps_server *s)
{
    zps_log(ZPS_INFO, "ps",
            "version %" PRIu64 " | pushes %" PRIu64 " pulls %" PRIu64 " | in %.1f MB out %.1f MB"
            " | updates %" PRIu64 " stale %" PRIu64 " rejected %" PRIu64 " | live %u/%u",
            ps_srv_min_version(s), s->st.pushes, s->st.pulls, (double)s->st.bytes_in / 1e6,
            (double)s->st.bytes_out / 1e6, s->st.updates, s->st.stale_dropped,
            s->st.rejected_total, s->trainers ? ps_srv_live(s) : 0, s->n_trainers);
}

/* ------------------------------------------------------------------ --metrics file */

/* The first size of the record buffer; a record with many trainers grows it. */
#define S_METRICS_LINE 16384

/* Writes j's text as one line; a failure closes the file. */
static void s_metrics_write(ps_server *s, zps_json *j)
{
    zps_json_raw(j, "\n");
    if (fwrite(j->buf, 1, j->len, s->metrics) == j->len && fflush(s->metrics) == 0)
        return;
    zps_log(ZPS_ERROR, "ps", "cannot write %s: %s; no more metrics records", s->cfg.metrics,
            strerror(errno));
    fclose(s->metrics);
    s->metrics = NULL;
}

/* SEP"KEY":growth per second of a counter since the last record (dt seconds ago). */
static void s_rate(zps_json *j, const char *sep, const char *key, uint64_t now, uint64_t before,
                   double dt)
{
    zps_json_raw(j, "%s\"%s\":", sep, key);
    zps_json_num(j, dt > 0 ? (double)(now - before) / dt : NAN, 6);
}

/* ,"rates":{...},"trainer_state":[...] of a stats or end record. */
static void s_metrics_tail(ps_server *s, zps_json *j, double now, uint64_t version)
{
    const ps_srv_stats *a = &s->st, *b = &s->metrics_prev;
    double dt = now - s->last_metrics_s;
    uint64_t req = 0, req0 = 0;
    for (int i = 0; i < PS_SRV_N_OPS; i++)
        req += a->requests[i], req0 += b->requests[i];
    zps_json_raw(j, ",\"rates\":{");
    s_rate(j, "", "pushes_s", a->pushes, b->pushes, dt);
    s_rate(j, ",", "pulls_s", a->pulls, b->pulls, dt);
    s_rate(j, ",", "bytes_in_s", a->bytes_in, b->bytes_in, dt);
    s_rate(j, ",", "bytes_out_s", a->bytes_out, b->bytes_out, dt);
    s_rate(j, ",", "updates_s", a->updates, b->updates, dt);
    s_rate(j, ",", "versions_s", version, s->metrics_prev_version, dt);
    s_rate(j, ",", "requests_s", req, req0, dt);
    zps_json_raw(j, "},\"trainer_state\":[");
    uint64_t now_ns = zps_now_ns();
    for (uint32_t t = 0; s->trainers && t < s->n_trainers; t++) {
        const ps_srv_trainer *tr = &s->trainers[t];
        const char *state = !tr->registered ? "waiting" : tr->left ? "left"
                            : tr->dropped   ? "dropped" : "live";
        zps_json_raw(j, "%s{\"trainer\":%u,\"state\":\"%s\",\"clock\":%" PRId64 ",\"silent_s\":",
                     t ? "," : "", t, state, tr->clock);
        zps_json_num(j, tr->registered ? (double)(now_ns - tr->last_seen_ns) * 1e-9 : NAN, 4);
        zps_json_raw(j, ",\"host\":");
        zps_json_str(j, tr->registered ? tr->inc.host : NULL);
        zps_json_raw(j, ",\"pid\":%" PRIu32 "}", tr->inc.pid);
    }
    zps_json_raw(j, "]}");
}

/* The STATS object's fields, without its braces, appended to j. */
static void s_stats_fields(ps_server *s, zps_json *j)
{
    size_t room = zps_json_fits(j) ? j->cap - j->len : 0;
    char *at = room ? j->buf + j->len : NULL;
    size_t n = ps_srv_stats_json(s, at, room); /* "{...}" */
    if (n < room) {
        memmove(at, at + 1, n - 2);
        at[n - 2] = 0;
        j->len += n - 2;
    } else {
        j->len += n; /* cut: len past cap says so, and how much more is needed */
    }
}

/* {"type":TYPE,"time":..,"wall_ms":..,<STATS fields>,"rates":..,"trainer_state":..} into the
 * record buffer (end: ,"end":END after the type); grows the buffer when it did not fit. */
static void s_metrics_record(ps_server *s, zps_json *j, const char *type, const char *end,
                             double now)
{
    uint64_t version = ps_srv_min_version(s);
    for (;;) {
        *j = zps_json_over(s->metrics_line, s->metrics_cap);
        zps_json_raw(j, "{\"type\":\"%s\"", type);
        if (end)
            zps_json_raw(j, ",\"end\":\"%s\"", end);
        zps_json_raw(j, ",\"time\":");
        zps_json_num(j, now - s->metrics_t0_s, 6);
        zps_json_raw(j, ",\"wall_ms\":%" PRIu64 ",", zps_wall_ms());
        s_stats_fields(s, j);
        s_metrics_tail(s, j, now, version);
        if (zps_json_fits(j) && j->len + 2 < j->cap)
            break;
        s->metrics_cap = 2 * (j->len + 2);
        s->metrics_line = zps_xrealloc(s->metrics_line, s->metrics_cap);
    }
    s->metrics_prev = s->st;
    s->metrics_prev_version = version;
    s->last_metrics_s = now;
}

/* The start record: who, which build, the configuration. */
static void s_metrics_start(ps_server *s, zps_json *j)
{
    zps_json_raw(j, "{\"type\":\"start\",\"server\":%d,\"endpoint\":", s->cfg.index);
    zps_json_str(j, s->endpoint);
    zps_json_run_info(j);
    zps_json_raw(j, ",\"metrics_every\":");
    zps_json_num(j, s->cfg.metrics_every_s, 6);
    zps_json_raw(j, ",\"config\":");
    ps_server_config_json(&s->cfg, j);
    zps_json_raw(j, "}");
}

zps_status ps_srv_metrics_open(ps_server *s)
{
    if (!s->cfg.metrics[0])
        return ZPS_OK;
    s->metrics = fopen(s->cfg.metrics, "w");
    if (!s->metrics) {
        int e = errno;
        zps_log(ZPS_ERROR, "ps", "--metrics: cannot create %s: %s", s->cfg.metrics, strerror(e));
        return e == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
    }
    zps_json j = zps_json_over(NULL, 0);
    s_metrics_start(s, &j);
    s->metrics_cap = j.len + S_METRICS_LINE;
    s->metrics_line = zps_xmalloc(s->metrics_cap);
    j = zps_json_over(s->metrics_line, s->metrics_cap);
    s_metrics_start(s, &j);
    s->metrics_t0_s = s->last_metrics_s = zps_now_s();
    s->metrics_prev = s->st;
    s->metrics_prev_version = ps_srv_min_version(s);
    s_metrics_write(s, &j);
    return s->metrics ? ZPS_OK : ZPS_ERR_IO;
}

void ps_srv_metrics_tick(ps_server *s, double now)
{
    if (!s->metrics || now - s->last_metrics_s < s->cfg.metrics_every_s)
        return;
    zps_json j;
    s_metrics_record(s, &j, "stats", NULL, now);
    s_metrics_write(s, &j);
}

void ps_srv_metrics_close(ps_server *s, const char *end)
{
    if (s->metrics) {
        zps_json j;
        s_metrics_record(s, &j, "end", end, zps_now_s());
        s_metrics_write(s, &j);
    }
    if (s->metrics && fclose(s->metrics) != 0)
        zps_log(ZPS_ERROR, "ps", "closing %s: %s", s->cfg.metrics, strerror(errno));
    s->metrics = NULL;
    free(s->metrics_line);
    s->metrics_line = NULL;
}
