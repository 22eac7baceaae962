/* server_stats.c — what the server reports about itself (server_int.h): latency and
 * staleness histograms, the STATS reply's JSON (fields in docs/ps.md "STATS") and the
 * periodic one-line log (--stats-every).
 *
 * Invariants:
 *   - Counting is a few additions on the hot path, never an allocation or a lock; the
 *     percentiles and the JSON are computed only when STATS asks.
 *   - Latency buckets are quarter powers of two of microseconds, so a percentile is exact
 *     to within 19% whatever the scale.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>

#include "common/clock.h"
#include "common/log.h"
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
