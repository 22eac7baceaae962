/* server_shard.c — the server's shard: values, optimizer slots, the chunk map, the async
 * apply, zero-copy readers of the values, and checkpoint write / restore (server_int.h).
 *
 * Invariants:
 *   - The values and the slots are one flat buffer each, in key order, allocated at INIT
 *     (or restore) and freed only when replaced or at destroy; chunk c is
 *     [chunks[c].off, + count) of each.
 *   - Chunk c's values, slots and version change together, only in ps_srv_apply_ranges
 *     (async / ssp, here) and the sync apply (server_consistency.c), on the one server thread.
 *   - Memory that a request or reply needs on the hot path is allocated once and reused:
 *     the scratch gradient here, the frame array and the ranges in server.c, the
 *     per-trainer accumulators in server_consistency.c.
 *   - Pull replies are sent zero-copy from the values; readers[c] counts frames zmq still
 *     holds, and chunk c is not updated while it is non-zero (ps_srv_wait_readers): a pull
 *     is a consistent snapshot. A peer that stops reading gets the old block retired
 *     (s_cow), never freed under zmq.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/check.h"
#include "common/clock.h"
#include "common/mem.h"
#include "ps/ckpt.h"
#include "ps/dtype.h"
#include "ps/server_int.h"

/* A pushed range that cannot be read as f32 in place is converted and applied in blocks of
 * this many values (32 KiB of f32), so the converted copy is read back from L1/L2. */
#define S_CONVERT_BLOCK 8192

uint64_t ps_srv_min_version(const ps_server *s)
{
    if (!s->n_local)
        return 0;
    uint64_t v = UINT64_MAX;
    for (uint32_t i = 0; i < s->n_local; i++)
        if (s->chunks[i].version < v)
            v = s->chunks[i].version;
    return v;
}

uint64_t ps_srv_ranges_version(const ps_server *s, const ps_srv_range *r, uint32_t n)
{
    uint64_t v = UINT64_MAX;
    for (uint32_t i = 0; i < n; i++)
        if (s->chunks[r[i].lc].version < v)
            v = s->chunks[r[i].lc].version;
    return n ? v : ps_srv_min_version(s);
}

/* ------------------------------------------------------------------------- readers */

void ps_srv_reader_done(void *data, void *hint)
{
    (void)data;
    atomic_fetch_sub((atomic_int *)hint, 1);
}

static int s_all_zero(const atomic_int *r, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (atomic_load(&r[i]))
            return 0;
    return 1;
}

void ps_srv_reap_retired(ps_server *s, int all)
{
    for (ps_srv_retired **pp = &s->retired; *pp;) {
        ps_srv_retired *r = *pp;
        if (!all && !s_all_zero(r->readers, r->n)) {
            pp = &r->next;
            continue;
        }
        *pp = r->next;
        if (r->owned)
            zps_aligned_free(r->values);
        free(r->readers);
        free(r);
    }
}

/* The values block (and its reader counts) joins the retired ones, freed once zmq let go of
 * it (owned = 0: a segment's, never freed here); s->readers starts afresh. */
static void s_retire_values(ps_server *s, int owned)
{
    ps_srv_retired *r = zps_xcalloc(1, sizeof *r);
    r->values = s->values;
    r->owned = owned;
    r->readers = s->readers;
    r->n = s->n_local;
    r->next = s->retired;
    s->retired = r;
    s->readers = zps_xcalloc(s->n_local ? s->n_local : 1, sizeof *s->readers);
}

/* ------------------------------------------------------------------------- shared memory */

static int s_values_in_shm(const ps_server *s)
{
    return s->shm && s->values == s->shm->values;
}

ps_shm *ps_srv_shm(const ps_server *s)
{
    return s_values_in_shm(s) && ps_shm_valid(s->shm) ? s->shm : NULL;
}

/* The segment stops being used (why: for the log, at level); it stays mapped until
 * destroy. */
static void s_shm_retire(ps_server *s, zps_log_level level, const char *why)
{
    if (!s->shm)
        return;
    ps_shm_invalidate(s->shm);
    s->shm_old = zps_xrealloc(s->shm_old, (s->n_shm_old + 1) * sizeof *s->shm_old);
    s->shm_old[s->n_shm_old++] = s->shm;
    s->shm = NULL;
    zps_log(level, "ps", "shared memory segment retired (%s): trainers on this host use "
            "ZeroMQ for the payloads from now on", why);
}

void ps_srv_shm_free_old(ps_server *s)
{
    s_shm_retire(s, ZPS_DEBUG, "server stopping");
    for (size_t i = 0; i < s->n_shm_old; i++)
        ps_shm_destroy(&s->shm_old[i]);
    free(s->shm_old);
    s->shm_old = NULL;
    s->n_shm_old = 0;
}

void ps_srv_shm_ensure(ps_server *s)
{
    if (!s->cfg.shm || s->shm || s->shm_failed || !s->initialised || !s->n_trainers ||
        !s->n_local)
        return;
    uint32_t *keys = zps_xmalloc(s->n_local * sizeof *keys);
    uint64_t *counts = zps_xmalloc(s->n_local * sizeof *counts);
    uint64_t *offs = zps_xmalloc(s->n_local * sizeof *offs);
    for (uint32_t i = 0; i < s->n_local; i++) {
        keys[i] = s->chunks[i].key;
        counts[i] = s->chunks[i].count;
        offs[i] = s->chunks[i].off;
    }
    ps_shm *m;
    zps_status st = ps_shm_create(s->n_local, keys, counts, offs, s->num_chunks, s->local_total,
                                  s->n_trainers, &m);
    free(keys);
    free(counts);
    free(offs);
    if (st != ZPS_OK) {
        s->shm_failed = 1; // logged by ps_shm_create; ZeroMQ carries everything
        return;
    }
    memcpy(m->values, s->values, s->local_total * 4);
    if (s->readers && !s_all_zero(s->readers, s->n_local))
        s_retire_values(s, 1); // zmq still sends from the old block
    else
        zps_aligned_free(s->values);
    s->values = m->values;
    s->shm = m;
    zps_log(ZPS_INFO, "ps", "shared memory offered to trainers on this host: %u chunks, %" PRIu64
            " values, %u trainer slots (%.1f MiB mapped, touched only where used)",
            s->n_local, s->local_total, s->n_trainers, (double)m->bytes / (1 << 20));
}

/* Copy-on-write of the whole values block: the old block stays alive (retired) for the
 * frames still in zmq, updates go to a fresh copy. Only for a peer that stopped reading. */
static void s_cow(ps_server *s)
{
    const float *old = s->values;
    int owned = !s_values_in_shm(s);
    if (!owned)
        s_shm_retire(s, ZPS_INFO, "a peer is not reading its pull replies");
    s_retire_values(s, owned);
    s->values = zps_xaligned(64, s->local_total * 4 + 64);
    memcpy(s->values, old, s->local_total * 4);
    s->st.values_cow++;
    zps_log(ZPS_WARN, "ps", "a peer is not reading its pull replies: values moved to a fresh copy");
}

/* Normally zmq is done with the frames long before the next push arrives; wait a little,
 * and if a peer has stopped reading, copy the values aside instead of waiting for it. */
void ps_srv_wait_readers(ps_server *s, uint32_t lc)
{
    if (atomic_load(&s->readers[lc]) == 0)
        return;
    s->st.reader_waits++;
    for (int spins = 0; atomic_load(&s->readers[lc]) > 0; spins++) {
        if (spins == 300) {
            s_cow(s);
            return;
        }
        zps_sleep_ns(spins < 100 ? 20000 : 1000000);
    }
}

/* ------------------------------------------------------------------------- the shard */

void ps_srv_shard_free(ps_server *s)
{
    if (s->readers && !s_all_zero(s->readers, s->n_local)) {
        s_cow(s); // zmq still sends from the old block: retire it
    }
    free(s->readers);
    s->readers = NULL;
    if (s_values_in_shm(s))
        s_shm_retire(s, ZPS_DEBUG, "its shard is replaced or freed");
    else
        zps_aligned_free(s->values);
    zps_aligned_free(s->slots[0]);
    zps_aligned_free(s->slots[1]);
    zps_aligned_free(s->scratch);
    free(s->chunks);
    free(s->key_to_local);
    free(s->recv_n);
    s->values = s->slots[0] = s->slots[1] = s->scratch = NULL;
    s->chunks = NULL;
    s->key_to_local = NULL;
    s->recv_n = NULL;
    ps_srv_trainers_release(s);
    s->initialised = 0;
    s->n_local = 0;
}

/* Allocates the shard for the given chunk table (keys ascending, counts), values not set. */
static void s_alloc_shard(ps_server *s, uint32_t n, const uint32_t *keys, const uint64_t *counts)
{
    ps_srv_shard_free(s);
    s->n_local = n;
    s->chunks = zps_xcalloc(n, sizeof *s->chunks);
    s->key_to_local = zps_xmalloc((size_t)s->num_chunks * sizeof *s->key_to_local);
    for (uint32_t k = 0; k < s->num_chunks; k++)
        s->key_to_local[k] = -1;
    uint64_t off = 0, mx = 0;
    for (uint32_t i = 0; i < n; i++) {
        s->chunks[i] = (ps_srv_chunk){keys[i], counts[i], off, 0, 0};
        s->key_to_local[keys[i]] = (int32_t)i;
        off += counts[i];
        if (counts[i] > mx)
            mx = counts[i];
    }
    s->local_total = off;
    s->max_chunk = mx;
    s->readers = zps_xcalloc(n, sizeof *s->readers);
    s->values = zps_xaligned(64, off * 4 + 64);
    s->scratch = zps_xaligned(64, mx * 4 + 64);
    s->n_slots = ps_optim_slots(s->opt.kind);
    for (int i = 0; i < s->n_slots; i++) {
        s->slots[i] = zps_xaligned(64, off * 4 + 64);
        float v = ps_optim_slot_init(&s->opt, i);
        for (uint64_t j = 0; j < off; j++)
            s->slots[i][j] = v;
    }
}

void ps_srv_shard_init(ps_server *s, const ps_srv_init_table *t)
{
    s->opt = t->opt;
    s_alloc_shard(s, t->n, t->keys, t->counts);
    for (uint32_t i = 0; i < t->n; i++)
        memcpy(s->values + s->chunks[i].off, zmq_msg_data(&s->frames[2 + i]), t->counts[i] * 4);
    s->initialised = 1;
    ps_srv_trainers_ensure(s);
}

/* ------------------------------------------------------------------------- applying */

float *const *ps_srv_slot_ptrs(ps_server *s, uint64_t off, float **buf)
{
    for (int i = 0; i < s->n_slots; i++)
        buf[i] = s->slots[i] + off;
    return buf;
}

void ps_srv_range_to_f32(const ps_srv_range *g, uint64_t b, uint64_t k, float *dst)
{
    if (g->bf16)
        ps_bf16_to_f32(dst, (const uint8_t *)g->data + 2 * b, k);
    else
        memcpy(dst, (const uint8_t *)g->data + 4 * b, k * 4);
}

/* f32 and float-aligned (ZeroMQ keeps frames of up to 33 bytes inside the message, at any
 * address). */
int ps_srv_range_in_place(const ps_srv_range *g)
{
    return !g->bf16 && (uintptr_t)g->data % sizeof(float) == 0;
}

void ps_srv_apply_ranges(ps_server *s, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        const ps_srv_range *g = &s->ranges[i];
        const ps_srv_chunk *c = &s->chunks[g->lc];
        float *sp[2];
        ps_srv_wait_readers(s, g->lc); // (may move the values out of the segment)
        ps_shm *shm = s_values_in_shm(s) ? s->shm : NULL;
        int in_place = ps_srv_range_in_place(g);
        uint64_t blk = in_place ? g->n : S_CONVERT_BLOCK;
        for (uint64_t b = 0; b < g->n; b += blk) {
            uint64_t k = g->n - b < blk ? g->n - b : blk;
            const float *d = (const float *)g->data + b;
            if (!in_place) {
                ps_srv_range_to_f32(g, b, k, s->scratch);
                d = s->scratch;
            }
            uint64_t at = c->off + g->off + b;
            if (shm)
                ps_shm_write_begin(shm, g->lc);
            ps_apply_pool_run(s->apply, &s->opt, g->version, s->values + at,
                              ps_srv_slot_ptrs(s, at, sp), d, k);
            if (shm)
                ps_shm_write_end(shm, g->lc);
        }
    }
}

/* ------------------------------------------------------------------------- checkpoints */

/* The checkpoint record of the shard; the caller frees c->chunks, c->opt and *slots. */
static void s_ckpt_fill(ps_server *s, ps_ckpt *c, float **slots)
{
    memset(c, 0, sizeof *c);
    c->server_index = (uint32_t)s->cfg.index;
    c->plan_hash = s->plan_hash;
    c->n_vars = s->plan_vars;
    c->total = s->plan_total;
    c->n_servers = s->plan_servers;
    c->chunk_bytes = s->plan_chunk_bytes;
    c->num_chunks = s->num_chunks;
    c->mode = (uint32_t)s->mode;
    c->n_local = s->n_local;
    c->chunks = zps_xcalloc(s->n_local, sizeof *c->chunks);
    for (uint32_t i = 0; i < s->n_local; i++)
        c->chunks[i] = (ps_ckpt_chunk){s->chunks[i].key, s->chunks[i].count, s->chunks[i].version};
    c->local_total = s->local_total;
    c->n_slots = (uint32_t)s->n_slots;
    c->values = s->values;
    *slots = NULL;
    if (s->n_slots) {
        /* The format stores slots contiguously; slot arrays are separate blocks here. */
        *slots = zps_xaligned(64, (size_t)s->n_slots * s->local_total * 4 + 64);
        for (int i = 0; i < s->n_slots; i++)
            memcpy(*slots + (size_t)i * s->local_total, s->slots[i], s->local_total * 4);
    }
    c->slots = *slots;
    Zps__OptimizerConfig om;
    Zps__Schedule sm;
    ps_optim_to_proto(&s->opt, &om, &sm);
    c->opt_len = (uint32_t)zps__optimizer_config__get_packed_size(&om);
    c->opt = zps_xmalloc(c->opt_len + 1);
    zps__optimizer_config__pack(&om, c->opt);
}

/* sync: versioned checkpoints kept (the newest first); a rollback can go back this far. */
#define S_KEEP_VERSIONS 3

uint64_t ps_srv_max_version(const ps_server *s)
{
    uint64_t m = 0;
    for (uint32_t i = 0; i < s->n_local; i++)
        if (s->chunks[i].version > m)
            m = s->chunks[i].version;
    return m;
}

zps_status ps_srv_write_checkpoint(ps_server *s, int cut)
{
    if (!s->cfg.checkpoint_dir[0] || !s->initialised)
        return ZPS_OK;
    ps_ckpt c;
    float *slots;
    s_ckpt_fill(s, &c, &slots);
    double t0 = zps_now_s();
    zps_status st = ps_ckpt_write(s->cfg.checkpoint_dir, s->cfg.index, &c);
    free(c.chunks);
    free(c.opt);
    zps_aligned_free(slots);
    uint64_t v = ps_srv_min_version(s);
    if (st == ZPS_OK && cut && s->cfg.checkpoint_every_versions && s->mode == PS_MODE_SYNC &&
        ps_srv_max_version(s) == v)
        st = ps_ckpt_keep_version(s->cfg.checkpoint_dir, s->cfg.index, v, S_KEEP_VERSIONS);
    if (st == ZPS_OK) {
        s->st.checkpoints++;
        s->last_ckpt_version = v;
        zps_log(ZPS_INFO, "ps", "checkpoint at version %" PRIu64 " written in %.3f s", v,
                zps_now_s() - t0);
    } else {
        zps_log(ZPS_ERROR, "ps", "checkpoint at version %" PRIu64 " failed: %s", v,
                zps_strerror(st));
    }
    s->last_ckpt_s = zps_now_s();
    return st;
}

zps_status ps_server_checkpoint(ps_server *s) { return ps_srv_write_checkpoint(s, 0); }

void ps_srv_maybe_checkpoint(ps_server *s)
{
    uint64_t k = s->cfg.checkpoint_every_versions, v = ps_srv_min_version(s);
    if (!k)
        return;
    /* sync: every server writes at the multiples of K, the moment its last chunk reaches
     * one; no chunk can be further (that needs every trainer to have pulled the whole
     * model at that version), so the files of one version form a consistent cut. */
    if (s->mode == PS_MODE_SYNC ? v % k == 0 && v > s->last_ckpt_version
                                : v >= s->last_ckpt_version + k)
        ps_srv_write_checkpoint(s, 1);
}

/* The checkpoint's optimizer record into *oc, and its server index: ZPS_ERR_CORRUPT (logged)
 * when either is not this server's. */
static zps_status s_restore_opt(ps_server *s, const char *path, const ps_ckpt *c,
                                ps_optim_config *oc)
{
    Zps__OptimizerConfig *om = zps__optimizer_config__unpack(NULL, c->opt_len, c->opt);
    char owhy[200];
    if (!om || ps_optim_from_proto(om, oc, owhy, sizeof owhy) != ZPS_OK ||
        (uint32_t)ps_optim_slots(oc->kind) != c->n_slots ||
        c->server_index != (uint32_t)s->cfg.index) {
        zps_log(ZPS_ERROR, "ps", "--restore: %s: bad optimizer record or server index %u (want %d)",
                path, c->server_index, s->cfg.index);
        if (om)
            zps__optimizer_config__free_unpacked(om, NULL);
        return ZPS_ERR_CORRUPT;
    }
    zps__optimizer_config__free_unpacked(om, NULL);
    return ZPS_OK;
}

/* The checkpoint's plan, chunk table, values, slots and versions become the shard. */
static void s_restore_shard(ps_server *s, const ps_ckpt *c)
{
    s->have_plan = 1;
    s->plan_hash = c->plan_hash;
    s->plan_vars = c->n_vars;
    s->plan_total = c->total;
    s->plan_servers = c->n_servers;
    s->plan_chunk_bytes = c->chunk_bytes;
    s->num_chunks = c->num_chunks;
    snprintf(s->plan_src, sizeof s->plan_src, "the checkpoint");
    uint32_t *keys = zps_xmalloc((c->n_local + 1) * sizeof *keys);
    uint64_t *counts = zps_xmalloc((c->n_local + 1) * sizeof *counts);
    for (uint32_t i = 0; i < c->n_local; i++) {
        keys[i] = c->chunks[i].key;
        counts[i] = c->chunks[i].count;
    }
    s_alloc_shard(s, c->n_local, keys, counts);
    free(keys);
    free(counts);
    memcpy(s->values, c->values, c->local_total * 4);
    for (uint32_t i = 0; i < c->n_slots; i++)
        memcpy(s->slots[i], c->slots + (size_t)i * c->local_total, c->local_total * 4);
    for (uint32_t i = 0; i < c->n_local; i++) {
        s->chunks[i].version = c->chunks[i].version;
        s->st.updates_restored += c->chunks[i].version;
    }
    s->initialised = 1;
    s->last_ckpt_version = ps_srv_min_version(s);
}

zps_status ps_srv_restore(ps_server *s)
{
    char path[1100], why[256];
    uint64_t newest;
    /* sync recovery needs a version every server has: the newest versioned file wins */
    if (ps_ckpt_newest_version(s->cfg.checkpoint_dir, s->cfg.index, &newest) == ZPS_OK)
        ps_ckpt_version_path(s->cfg.checkpoint_dir, s->cfg.index, newest, path, sizeof path);
    else
        ps_ckpt_path(s->cfg.checkpoint_dir, s->cfg.index, path, sizeof path);
    ps_ckpt c;
    zps_status st = ps_ckpt_read(path, &c, why, sizeof why);
    if (st == ZPS_ERR_NOT_FOUND) {
        zps_log(ZPS_WARN, "ps", "--restore: no checkpoint at %s, starting empty", path);
        return ZPS_OK;
    }
    if (st != ZPS_OK) {
        zps_log(ZPS_ERROR, "ps", "--restore: cannot use %s: %s", path, why);
        return st;
    }
    ps_optim_config oc;
    if ((st = s_restore_opt(s, path, &c, &oc)) != ZPS_OK) {
        ps_ckpt_free(&c);
        return st;
    }
    if (s->mode != PS_MODE_UNSET && c.mode != (uint32_t)s->mode)
        zps_log(ZPS_WARN, "ps", "--restore: checkpoint was written in %s mode, running %s",
                c.mode < 4 ? ps_srv_mode_names[c.mode] : "?", ps_srv_mode_names[s->mode]);
    s->opt = oc;
    s_restore_shard(s, &c);
    ps_ckpt_free(&c);
    ps_srv_trainers_ensure(s);
    /* A sync fleet must come back to this version with us (docs/ps.md "Recovery"). */
    s->rb_token = ps_srv_rollback_token(s);
    s->rb_version = ps_srv_min_version(s);
    zps_log(ZPS_INFO, "ps", "restored %s: %u chunks, %" PRIu64 " values, version %" PRIu64
            ", plan %016" PRIx64, path, s->n_local, s->local_total, ps_srv_min_version(s),
            s->plan_hash);
    return ZPS_OK;
}

/* The checkpoint c has the shard's plan and chunk table (a rollback may not change them). */
static int s_same_table(const ps_server *s, const ps_ckpt *c)
{
    if (c->plan_hash != s->plan_hash || c->n_local != s->n_local ||
        c->n_slots != (uint32_t)s->n_slots || c->local_total != s->local_total)
        return 0;
    for (uint32_t i = 0; i < c->n_local; i++)
        if (c->chunks[i].key != s->chunks[i].key || c->chunks[i].count != s->chunks[i].count)
            return 0;
    return 1;
}

uint64_t ps_srv_rollback_token(const ps_server *s)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); // comparable across hosts, unlike the monotonic clock
    uint64_t ms = (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
    return ms << 16 | (s->incarnation & 0xffff);
}

zps_status ps_srv_rollback(ps_server *s, uint64_t v, char *why, size_t why_len)
{
    char path[1100], cwhy[256];
    ps_ckpt_version_path(s->cfg.checkpoint_dir, s->cfg.index, v, path, sizeof path);
    ps_ckpt c;
    zps_status st = s->cfg.checkpoint_dir[0] ? ps_ckpt_read(path, &c, cwhy, sizeof cwhy)
                                             : ZPS_ERR_NOT_FOUND;
    if (st != ZPS_OK) {
        snprintf(why, why_len, "cannot roll back to version %" PRIu64 ": %s", v,
                 st == ZPS_ERR_NOT_FOUND ? "no checkpoint of that version (needs --checkpoint-dir "
                                           "and --checkpoint-every-versions K dividing it)"
                                         : cwhy);
        return st;
    }
    if (!s->initialised || !s_same_table(s, &c)) {
        snprintf(why, why_len, "cannot roll back to version %" PRIu64 ": %s holds another plan "
                 "or chunk table", v, path);
        ps_ckpt_free(&c);
        return ZPS_ERR_CORRUPT;
    }
    for (uint32_t i = 0; i < s->n_local; i++) {
        ps_srv_chunk *ch = &s->chunks[i];
        ps_srv_wait_readers(s, i);
        ps_shm *shm = s_values_in_shm(s) ? s->shm : NULL;
        if (shm)
            ps_shm_write_begin(shm, i);
        memcpy(s->values + ch->off, c.values + ch->off, ch->count * 4);
        if (shm)
            ps_shm_write_end(shm, i);
        for (uint32_t k = 0; k < c.n_slots; k++)
            memcpy(s->slots[k] + ch->off, c.slots + (size_t)k * c.local_total + ch->off, ch->count * 4);
        if (ch->version > c.chunks[i].version)
            s->st.updates_undone += ch->version - c.chunks[i].version;
        ch->version = c.chunks[i].version;
    }
    s->st.rollbacks++;
    ps_ckpt_free(&c);
    ps_ckpt_drop_after(s->cfg.checkpoint_dir, s->cfg.index, v);
    s->last_ckpt_version = v;
    return ZPS_OK;
}
