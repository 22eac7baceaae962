/* server_validate.c — every check of a request, before anything changes (server_int.h).
 *
 * Invariants:
 *   - A request is checked completely here before anything changes; handlers that reach
 *     their "apply" part cannot fail. The one exception is the sync coverage check (a range
 *     repeating elements already pushed for the step), which needs the trainer's coverage
 *     bits and lives with them in server_consistency.c; it too leaves the state unchanged.
 *   - These functions only read the server, except that ps_srv_check_ranges fills the
 *     reused s->ranges; tests/fuzz/fuzz_server.c calls them directly.
 *   - A rejection names what is wrong in `why`, which goes back in the reply.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"
#include "ps/dtype.h"
#include "ps/server_int.h"

#define S_WHY(...) snprintf(why, why_len, __VA_ARGS__)

/* An admin key (--curve-allow "KEY admin") sends STATS, CHECKPOINT and SHUTDOWN only; once
 * the allow-list has one, CHECKPOINT needs one and SHUTDOWN one or trainer 0 (the chief:
 * zps-trainer --shutdown-servers). 1 (and why) when the request is refused. */
static int s_admin_refused(const ps_curve_allow *a, int32_t id, const char *uid,
                           const Zps__Header *h, char *why, size_t why_len)
{
    int op = (int)h->op, admin_op = op == ZPS__OP__OP_CHECKPOINT || op == ZPS__OP__OP_SHUTDOWN;
    if (id == PS_CURVE_ADMIN) {
        if (admin_op || op == ZPS__OP__OP_STATS)
            return 0;
        S_WHY("key %.8s... is an admin key (zps-ctl): it sends STATS, CHECKPOINT and SHUTDOWN "
              "only, not %s", uid, ps_srv_op_names[op]);
        return 1;
    }
    if (!ps_curve_allow_admins(a) || !admin_op ||
        (op == ZPS__OP__OP_SHUTDOWN && h->trainer_id == 0))
        return 0;
    S_WHY("%s needs an admin key ('KEY admin' in --curve-allow)%s; key %.8s... is not one",
          op == ZPS__OP__OP_SHUTDOWN ? "SHUTDOWN" : "CHECKPOINT",
          op == ZPS__OP__OP_SHUTDOWN ? " or trainer 0's" : "", uid);
    return 1;
}

/* CURVE with roles (--curve-allow "KEY trainer=N", "KEY admin"): 1 (and why) when the
 * request says another trainer id than its connection's key is bound to, is an op its key
 * may not send (s_admin_refused), or, with trainer-bound keys, is a SHUTDOWN from another
 * trainer than 0 without an admin key. */
static int s_key_mismatch(const ps_server *s, const Zps__Header *h, char *why, size_t why_len)
{
    const ps_curve_allow *a = ps_curve_zap_allow(s->zap);
    if (!ps_curve_allow_bound(a) && !ps_curve_allow_admins(a))
        return 0;
    const char *uid = zmq_msg_gets(&s->frames[1], "User-Id"); // the key, set by ZAP
    uint8_t key[32];
    if (!uid || strlen(uid) != PS_CURVE_KEY_LEN || !zmq_z85_decode(key, uid)) {
        S_WHY("no authenticated CURVE key on this connection");
        return 1;
    }
    int32_t id = ps_curve_allow_trainer(a, key);
    if (id >= 0 && (uint32_t)id != h->trainer_id) {
        S_WHY("key %.8s... is bound to trainer %d in --curve-allow; this request says trainer %u",
              uid, (int)id, h->trainer_id);
        return 1;
    }
    if (s_admin_refused(a, id, uid, h, why, why_len))
        return 1;
    if (h->op == ZPS__OP__OP_SHUTDOWN && h->trainer_id != 0 && id != PS_CURVE_ADMIN) {
        S_WHY("SHUTDOWN from trainer %u: with trainer-bound keys only trainer 0 (the chief) may "
              "shut the servers down (or an admin key: zps-ctl)", h->trainer_id);
        return 1;
    }
    return 0;
}

/* After SHUTDOWN (server_admin.c): every trainer request but LEAVE is told so; while a
 * SHUTDOWN waits for its version, so is a push for that step or a later one. */
static int s_draining(const ps_server *s, const Zps__Header *h, char *why, size_t why_len)
{
    int op = (int)h->op;
    if (s->stop_at && s->drain_until <= 0 &&
        (op == ZPS__OP__OP_PUSH || op == ZPS__OP__OP_PUSHPULL) && h->step >= 0 &&
        (uint64_t)h->step + 1 >= s->stop_at) {
        S_WHY("server %d is shutting down at version %" PRIu64 ": no step after it",
              s->cfg.index, s->stop_at - 1);
        return 1;
    }
    if (s->drain_until <= 0 || op == ZPS__OP__OP_LEAVE || op == ZPS__OP__OP_STATS ||
        op == ZPS__OP__OP_SHUTDOWN)
        return 0;
    S_WHY("server %d is shutting down (SHUTDOWN received; its final checkpoint is written)",
          s->cfg.index);
    return 1;
}

/* The checks that need the header: version, op, size, payload frames, key binding. */
static zps_status s_check_header(ps_server *s, const Zps__Header *h, int nframes, uint64_t bytes,
                                 int *op, char *why, size_t why_len)
{
    int o = (int)h->op;
    *op = o;
    if (h->version != ZPS_PROTOCOL_VERSION) {
        S_WHY("protocol version %u, server speaks %u", h->version, ZPS_PROTOCOL_VERSION);
        return ZPS_ERR_VERSION;
    }
    if (o <= 0 || o >= PS_SRV_N_OPS || h->is_reply) {
        *op = o < 0 || o >= PS_SRV_N_OPS ? 0 : o;
        S_WHY("%s", h->is_reply ? "a reply sent to the server" : "unknown op");
        return ZPS_ERR_OP;
    }
    if (bytes > s->cfg.max_message_bytes + ZPS_HEADER_MAX_BYTES) {
        S_WHY("message of %" PRIu64 " bytes (limit --max-message-bytes %" PRIu64 ")", bytes,
              s->cfg.max_message_bytes);
        return ZPS_ERR_TOO_LARGE;
    }
    if (o != ZPS__OP__OP_PUSH && o != ZPS__OP__OP_PUSHPULL && o != ZPS__OP__OP_INIT &&
        nframes != 2) {
        S_WHY("payload frames on an op that carries none");
        return ZPS_ERR_FRAMES;
    }
    if (s_key_mismatch(s, h, why, why_len))
        return ZPS_ERR_UNAUTHORIZED;
    if (s_draining(s, h, why, why_len))
        return ZPS_ERR_SHUTDOWN;
    if ((o == ZPS__OP__OP_CHECKPOINT || o == ZPS__OP__OP_SHUTDOWN) && h->cut &&
        s->mode != PS_MODE_SYNC) {
        S_WHY("a %s cut needs sync mode (this server runs %s): ask for a plain one",
              o == ZPS__OP__OP_SHUTDOWN ? "SHUTDOWN" : "CHECKPOINT", ps_srv_mode_names[s->mode]);
        return ZPS_ERR_UNSUPPORTED;
    }
    return ZPS_OK;
}

zps_status ps_srv_check_message(ps_server *s, int nframes, int overflow, uint64_t bytes,
                                Zps__Header **h, int *op, char *why, size_t why_len)
{
    *h = NULL;
    *op = 0;
    if (nframes < 2) {
        S_WHY("no header frame");
        return ZPS_ERR_FRAMES;
    }
    if (overflow) {
        S_WHY("too many frames in one message");
        return ZPS_ERR_FRAMES;
    }
    size_t hl = zmq_msg_size(&s->frames[1]);
    if (hl > ZPS_HEADER_MAX_BYTES) {
        S_WHY("header frame larger than 1 MiB");
        return ZPS_ERR_TOO_LARGE;
    }
    *h = zps__header__unpack(NULL, hl, zmq_msg_data(&s->frames[1]));
    if (!*h) {
        S_WHY("header frame is not a valid Header protobuf");
        return ZPS_ERR_PROTO;
    }
    return s_check_header(s, *h, nframes, bytes, op, why, why_len);
}

zps_status ps_srv_check_trainer(const ps_server *s, const Zps__Header *h, char *why,
                                size_t why_len)
{
    if (!s->n_trainers || h->trainer_id >= s->n_trainers) {
        S_WHY("trainer %u is not in this job (%u trainers)", h->trainer_id, s->n_trainers);
        return ZPS_ERR_TRAINER;
    }
    const ps_srv_trainer *tr = &s->trainers[h->trainer_id];
    if (!tr->registered) {
        S_WHY("trainer %u has not registered with this server (REGISTER first)", h->trainer_id);
        return ZPS_ERR_TRAINER;
    }
    uint64_t nonce = h->incarnation ? h->incarnation->nonce : 0;
    if (nonce != tr->inc.nonce) {
        /* ZPS_ERR_TRAINER: the client registers again, and that REGISTER says who holds
         * the id when it is still live. */
        S_WHY("trainer %u: this request comes from incarnation %016" PRIx64 ", but the id is "
              "held by incarnation %016" PRIx64 " (host %s pid %u): REGISTER first",
              h->trainer_id, nonce, tr->inc.nonce, tr->inc.host, tr->inc.pid);
        return ZPS_ERR_TRAINER;
    }
    return ZPS_OK;
}

/* Range i of h: dtype, key, bounds, size so far (*total), and its payload frame; into g. */
static zps_status s_check_range(ps_server *s, const Zps__Header *h, size_t i, int has_data,
                                uint64_t *total, ps_srv_range *g, char *why, size_t why_len)
{
    const Zps__KeyRange *r = h->ranges[i];
    int bf16 = r->dtype == ZPS__DTYPE__DTYPE_BF16;
    if (r->dtype != ZPS__DTYPE__DTYPE_F32 && !(bf16 && has_data)) {
        S_WHY("range %zu: dtype %d (served: f32, and bf16 for pushed gradients)", i, (int)r->dtype);
        return ZPS_ERR_DTYPE;
    }
    uint64_t es = bf16 ? 2 : 4;
    if (r->key >= s->num_chunks || s->key_to_local[r->key] < 0) {
        S_WHY("range %zu: key %u is not held by server %d", i, r->key, s->cfg.index);
        return ZPS_ERR_KEY;
    }
    const ps_srv_chunk *c = &s->chunks[s->key_to_local[r->key]];
    if (r->length == 0 || r->length % es || r->offset > c->count ||
        r->length / es > c->count - r->offset) {
        S_WHY("range %zu: key %u offset %" PRIu64 " length %" PRIu64
              " B is outside the chunk of %" PRIu64 " values",
              i, r->key, r->offset, r->length, c->count);
        return ZPS_ERR_RANGE;
    }
    uint64_t at = *total; // packed: where the range's bytes start in the payload frame
    *total += r->length;
    if (*total > s->cfg.max_message_bytes) {
        S_WHY("request of more than %" PRIu64 " bytes (limit --max-message-bytes %" PRIu64 ")",
              *total, s->cfg.max_message_bytes);
        return ZPS_ERR_TOO_LARGE;
    }
    g->lc = (uint32_t)s->key_to_local[r->key];
    g->off = r->offset;
    g->n = r->length / es;
    g->data = NULL;
    g->bf16 = bf16;
    g->shm = 0;
    if (has_data && h->shm_data) {
        /* in the trainer's slot: ps_srv_check_ranges points data there */
    } else if (has_data && h->packed) {
        zmq_msg_t *f = &s->frames[2];
        if (zmq_msg_size(f) < *total) {
            S_WHY("range %zu: the packed payload of %zu bytes ends before it", i, zmq_msg_size(f));
            return ZPS_ERR_FRAMES;
        }
        g->data = (const char *)zmq_msg_data(f) + at;
    } else if (has_data) {
        zmq_msg_t *f = &s->frames[2 + i];
        if (zmq_msg_size(f) != r->length) {
            S_WHY("range %zu: frame of %zu bytes, header says %" PRIu64, i, zmq_msg_size(f),
                  r->length);
            return ZPS_ERR_FRAMES;
        }
        g->data = zmq_msg_data(f);
    }
    return ZPS_OK;
}

zps_status ps_srv_check_ranges(ps_server *s, const Zps__Header *h, int nframes, int has_data,
                               char *why, size_t why_len)
{
    if (!s->initialised) {
        S_WHY("no INIT yet: variables have no values");
        return ZPS_ERR_NOT_INIT;
    }
    if (h->n_ranges == 0 || h->n_ranges > PS_MAX_RANGES) {
        S_WHY("%zu ranges (want 1..%d)", h->n_ranges, PS_MAX_RANGES);
        return ZPS_ERR_FRAMES;
    }
    const float *slot = NULL; // Header.shm_data: the pushing trainer's slot
    if (has_data && h->shm_data) {
        const ps_shm *m = ps_srv_shm(s);
        if (!m || h->shm_nonce != m->hdr->nonce || s->mode != PS_MODE_SYNC ||
            h->trainer_id >= m->hdr->n_trainers) {
            /* the client resends the data in frames (client_shm.c) */
            S_WHY("gradients in shared memory %016" PRIx64 ", which server %d does not use%s: "
                  "send them in frames", h->shm_nonce, s->cfg.index,
                  s->mode != PS_MODE_SYNC ? " outside sync mode" : "");
            return ZPS_ERR_FRAMES;
        }
        slot = ps_shm_slot(m, h->trainer_id);
    }
    int want = 2 + (has_data && !slot ? (h->packed ? 1 : (int)h->n_ranges) : 0);
    if (nframes != want) {
        S_WHY("%d payload frames for %zu ranges (want %d)", nframes - 2, h->n_ranges, want - 2);
        return ZPS_ERR_FRAMES;
    }
    uint64_t total = 0;
    for (size_t i = 0; i < h->n_ranges; i++) {
        zps_status st = s_check_range(s, h, i, has_data, &total, &s->ranges[i], why, why_len);
        if (st != ZPS_OK)
            return st;
        ps_srv_range *g = &s->ranges[i];
        if (slot && g->bf16) {
            S_WHY("range %zu: bfloat16 gradients in shared memory (only f32 travel there)", i);
            return ZPS_ERR_FRAMES;
        }
        if (slot) {
            g->data = slot + s->chunks[g->lc].off + g->off;
            g->shm = 1;
        }
    }
    if (has_data && !slot && h->packed && zmq_msg_size(&s->frames[2]) != total) {
        S_WHY("packed payload of %zu bytes, the ranges say %" PRIu64, zmq_msg_size(&s->frames[2]),
              total);
        return ZPS_ERR_FRAMES;
    }
    /* Finite values last: the cheap checks of every range come first. */
    for (size_t i = 0; has_data && i < h->n_ranges; i++) {
        const ps_srv_range *g = &s->ranges[i];
        if (!(g->bf16 ? ps_bf16_all_finite(g->data, g->n) : ps_f32_all_finite(g->data, g->n))) {
            S_WHY("range %zu (key %u): NaN or Inf in the payload", i, h->ranges[i]->key);
            return ZPS_ERR_NONFINITE;
        }
    }
    return ZPS_OK;
}

static void s_plan_summary(char *buf, size_t len, uint64_t hash, uint32_t vars, uint64_t total,
                           uint32_t servers, uint64_t chunk)
{
    snprintf(buf, len, "%016" PRIx64 " (%u variables, %" PRIu64 " values, %u servers, chunk %" PRIu64
             " B)", hash, vars, total, servers, chunk);
}

/* The trainer's plan is the one the server holds (when it holds one). */
static zps_status s_check_plan(const ps_server *s, const Zps__Header *h, char *why, size_t why_len)
{
    const Zps__JobConfig *j = h->job;
    if (!s->have_plan || h->plan_hash == s->plan_hash)
        return ZPS_OK;
    char mine[160], theirs[160];
    s_plan_summary(mine, sizeof mine, s->plan_hash, s->plan_vars, s->plan_total, s->plan_servers,
                   s->plan_chunk_bytes);
    s_plan_summary(theirs, sizeof theirs, h->plan_hash, j ? j->num_variables : 0,
                   j ? j->total_count : 0, j ? j->num_servers : 0, j ? j->chunk_bytes : 0);
    S_WHY("plan mismatch: trainer %u has plan %s, server %d holds %s from %s", h->trainer_id,
          theirs, s->cfg.index, mine, s->plan_src);
    return ZPS_ERR_PLAN;
}

/* REGISTER's mode and trainer count: the server's own flags win; a conflict is an error. */
static zps_status s_check_job_mode(const ps_server *s, const Zps__Header *h, uint32_t *nt,
                                   char *why, size_t why_len)
{
    const Zps__JobConfig *j = h->job;
    if (s->mode != PS_MODE_UNSET && j->mode != ZPS__MODE__MODE_UNKNOWN &&
        (int)j->mode != (int)s->mode) {
        S_WHY("server runs %s mode, trainer %u asked for %s", ps_srv_mode_names[s->mode],
              h->trainer_id, (unsigned)j->mode < 4 ? ps_srv_mode_names[j->mode] : "?");
        return ZPS_ERR_CONFIG;
    }
    if ((unsigned)j->mode > 3) {
        S_WHY("unknown mode");
        return ZPS_ERR_INVALID;
    }
    if (s->n_trainers && j->num_trainers && j->num_trainers != s->n_trainers) {
        S_WHY("server has %u trainers, trainer %u says %u", s->n_trainers, h->trainer_id,
              j->num_trainers);
        return ZPS_ERR_CONFIG;
    }
    *nt = s->n_trainers ? s->n_trainers : j->num_trainers;
    if (!*nt || *nt > PS_MAX_TRAINERS) {
        S_WHY("number of trainers unknown (give --num-trainers or job.num_trainers 1..4096)");
        return ZPS_ERR_CONFIG;
    }
    if (h->trainer_id >= *nt) {
        S_WHY("trainer %u is not in this job (%u trainers)", h->trainer_id, *nt);
        return ZPS_ERR_TRAINER;
    }
    return ZPS_OK;
}

/* REGISTER's aggregation and staleness against the server's. */
static zps_status s_check_job_sync(const ps_server *s, const Zps__Header *h, uint32_t nt,
                                   char *why, size_t why_len)
{
    const Zps__JobConfig *j = h->job;
    uint32_t want_r = s->replicas ? s->replicas : 0;
    if (want_r && j->replicas_to_aggregate && j->replicas_to_aggregate != want_r) {
        S_WHY("server aggregates %u replicas, trainer %u says %u", want_r, h->trainer_id,
              j->replicas_to_aggregate);
        return ZPS_ERR_CONFIG;
    }
    if (j->replicas_to_aggregate > nt) {
        S_WHY("replicas_to_aggregate exceeds the number of trainers");
        return ZPS_ERR_CONFIG;
    }
    if (s->staleness >= 0 && j->staleness && (int)j->staleness != s->staleness) {
        S_WHY("server staleness is %d, trainer %u says %u", s->staleness, h->trainer_id,
              j->staleness);
        return ZPS_ERR_CONFIG;
    }
    return ZPS_OK;
}

/* REGISTER's incarnation: complete, with a host name fit for a log line. */
static zps_status s_check_incarnation(const Zps__Header *h, char *why, size_t why_len)
{
    const Zps__Incarnation *in = h->incarnation;
    if (!in || !in->nonce || !in->pid || !in->host) {
        S_WHY("REGISTER of trainer %u without an incarnation (nonce, start time, host, pid): "
              "the client is older than this server", h->trainer_id);
        return ZPS_ERR_INVALID;
    }
    size_t n = strlen(in->host);
    int ok = n > 0 && n < sizeof ((ps_srv_incarnation *)0)->host;
    for (size_t i = 0; ok && i < n; i++)
        ok = in->host[i] > ' ' && in->host[i] < 127;
    if (!ok) {
        S_WHY("REGISTER of trainer %u: incarnation host name is empty, longer than 63 bytes "
              "or not printable ASCII", h->trainer_id);
        return ZPS_ERR_INVALID;
    }
    return ZPS_OK;
}

/* A second live incarnation of the same trainer id is refused, naming both. */
static zps_status s_check_holder(const ps_server *s, const Zps__Header *h, char *why,
                                 size_t why_len)
{
    uint32_t t = h->trainer_id;
    double silent;
    if (!s->trainers || h->incarnation->nonce == s->trainers[t].inc.nonce ||
        !ps_srv_incarnation_live(s, t, &silent))
        return ZPS_OK;
    const ps_srv_incarnation *old = &s->trainers[t].inc;
    const Zps__Incarnation *in = h->incarnation;
    /* A successor on the holder's own host that found the holder's pid gone (a supervisor
     * restarting a killed trainer) takes the id now rather than after the timeout. */
    if (h->dead_holder && h->dead_holder == old->nonce && !strcmp(old->host, in->host))
        return ZPS_OK;
    S_WHY("trainer %u is held by a live process, host %s pid %u (incarnation %016" PRIx64
          ", heard from %.1f s ago); this REGISTER comes from host %s pid %u (incarnation %016"
          PRIx64 "). Two processes with one id would mix their updates: stop one or give it "
          "another id (the id is free once its holder LEAVEs or is silent for %g s)",
          t, old->host, old->pid, old->nonce, silent, in->host, in->pid, in->nonce,
          s->cfg.trainer_timeout_s > 0 ? s->cfg.trainer_timeout_s : PS_SRV_IDENT_SILENT_S);
    return ZPS_ERR_EXISTS;
}

zps_status ps_srv_check_register(const ps_server *s, const Zps__Header *h, uint32_t *nt,
                                 char *why, size_t why_len)
{
    const Zps__JobConfig *j = h->job;
    if (!j || h->plan_hash == 0 || j->num_chunks == 0 || j->num_chunks > (1u << 24)) {
        S_WHY("REGISTER needs a job config, a plan hash and 1..2^24 chunks");
        return ZPS_ERR_INVALID;
    }
    if (s->cfg.check_index && h->server_index != (uint32_t)s->cfg.index) {
        S_WHY("this is server %d, the trainer addressed server %u", s->cfg.index, h->server_index);
        return ZPS_ERR_CONFIG;
    }
    zps_status st = s_check_job_mode(s, h, nt, why, why_len);
    if (st == ZPS_OK)
        st = s_check_job_sync(s, h, *nt, why, why_len);
    if (st == ZPS_OK)
        st = s_check_plan(s, h, why, why_len);
    if (st != ZPS_OK)
        return st;
    if (s->have_plan && s->num_chunks != j->num_chunks) {
        S_WHY("plan has %u chunks on the server, %u on trainer %u", s->num_chunks, j->num_chunks,
              h->trainer_id);
        return ZPS_ERR_PLAN;
    }
    if ((st = s_check_incarnation(h, why, why_len)) != ZPS_OK)
        return st;
    return s_check_holder(s, h, why, why_len);
}

/* INIT's optimizer, plan and first-writer rule; the ranges' count against the frames. */
static zps_status s_check_init_job(const ps_server *s, const Zps__Header *h, int nframes,
                                   ps_optim_config *oc, char *why, size_t why_len)
{
    char owhy[256];
    if (ps_optim_from_proto(h->optimizer, oc, owhy, sizeof owhy) != ZPS_OK) {
        S_WHY("bad optimizer: %s", owhy);
        return ZPS_ERR_INVALID;
    }
    zps_status st = s_check_plan(s, h, why, why_len);
    if (st != ZPS_OK)
        return st;
    if (s->initialised && !s->cfg.allow_reinit) {
        if (!ps_optim_equal(oc, &s->opt)) {
            S_WHY("server %d holds optimizer %s lr %g; this INIT asks for %s lr %g", s->cfg.index,
                  ps_optim_kind_name(s->opt.kind), s->opt.lr, ps_optim_kind_name(oc->kind), oc->lr);
            return ZPS_ERR_CONFIG;
        }
        S_WHY("already initialised (version %" PRIu64 "); first writer wins",
              ps_srv_min_version(s));
        return ZPS_ERR_ALREADY_INIT;
    }
    size_t n = h->n_ranges;
    if (n == 0 || n > PS_MAX_RANGES || nframes != 2 + (int)n) {
        S_WHY("INIT with %zu ranges and %d payload frames", n, nframes - 2);
        return ZPS_ERR_FRAMES;
    }
    if (!s->have_plan || s->num_chunks == 0) {
        S_WHY("no plan known (REGISTER first)");
        return ZPS_ERR_PLAN;
    }
    return ZPS_OK;
}

/* INIT's ranges: whole chunks, keys ascending, finite f32 values; into t. */
static zps_status s_check_init_table(const ps_server *s, const Zps__Header *h,
                                     ps_srv_init_table *t, char *why, size_t why_len)
{
    size_t n = h->n_ranges;
    uint8_t *seen = zps_xcalloc(s->num_chunks, 1);
    zps_status st = ZPS_OK;
    for (size_t i = 0; i < n && st == ZPS_OK; i++) {
        const Zps__KeyRange *r = h->ranges[i];
        zmq_msg_t *f = &s->frames[2 + i];
        if (r->dtype != ZPS__DTYPE__DTYPE_F32) {
            st = ZPS_ERR_DTYPE;
            S_WHY("range %zu: dtype %d (only f32)", i, (int)r->dtype);
        } else if (r->key >= s->num_chunks || seen[r->key] || (i && r->key <= t->keys[i - 1])) {
            st = ZPS_ERR_KEY;
            S_WHY("range %zu: key %u unknown, repeated or out of order", i, r->key);
        } else if (r->offset != 0 || r->length == 0 || r->length % 4) {
            st = ZPS_ERR_RANGE;
            S_WHY("range %zu: INIT needs whole chunks (offset 0, length 4k)", i);
        } else if (zmq_msg_size(f) != r->length) {
            st = ZPS_ERR_FRAMES;
            S_WHY("range %zu: frame of %zu bytes, header says %" PRIu64, i, zmq_msg_size(f),
                  r->length);
        } else if ((t->total += r->length) > s->cfg.max_message_bytes) {
            st = ZPS_ERR_TOO_LARGE;
            S_WHY("INIT larger than --max-message-bytes %" PRIu64, s->cfg.max_message_bytes);
        } else {
            if (!ps_f32_all_finite(zmq_msg_data(f), r->length / 4)) {
                st = ZPS_ERR_NONFINITE;
                S_WHY("range %zu: NaN or Inf in initial values", i);
            }
            seen[r->key] = 1;
            t->keys[i] = r->key;
            t->counts[i] = r->length / 4;
        }
    }
    free(seen);
    return st;
}

zps_status ps_srv_check_init(const ps_server *s, const Zps__Header *h, int nframes,
                             ps_srv_init_table *t, char *why, size_t why_len)
{
    memset(t, 0, sizeof *t);
    zps_status st = s_check_init_job(s, h, nframes, &t->opt, why, why_len);
    if (st != ZPS_OK)
        return st;
    t->n = (uint32_t)h->n_ranges;
    t->keys = zps_xmalloc(t->n * sizeof *t->keys);
    t->counts = zps_xmalloc(t->n * sizeof *t->counts);
    st = s_check_init_table(s, h, t, why, why_len);
    if (st != ZPS_OK)
        ps_srv_init_table_free(t);
    return st;
}

void ps_srv_init_table_free(ps_srv_init_table *t)
{
    free(t->keys);
    free(t->counts);
    t->keys = NULL;
    t->counts = NULL;
}
