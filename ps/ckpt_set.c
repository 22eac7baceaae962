/* ckpt_set.c — the servers' checkpoint shards read as one model (ckpt.h; zps-ctl export).
 *
 * Invariants:
 *   - Nothing is merged unless every shard of the fleet is there, verified (ps_ckpt_read),
 *     at its own index, of the same fleet (plan hash, server count, chunk size, chunk
 *     count, mode), and, in sync mode, every chunk of every shard at one version: a model
 *     stitched from different versions never reaches a weights file.
 *   - The merge places each chunk where the caller's plan puts it, after checking that the
 *     plan is the shards' (hash) and that the shards cover its chunk table exactly once.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/mem.h"
#include "ps/ckpt.h"
#include "ps/server.h"

/* Shard i's path: versioned (version >= 0) or the latest. */
static void s_shard_path(const char *dir, int i, int64_t version, char *buf, size_t len)
{
    if (version >= 0)
        ps_ckpt_version_path(dir, i, (uint64_t)version, buf, len);
    else
        ps_ckpt_path(dir, i, buf, len);
}

/* Shard c (read from path, expected at index i) belongs with shard 0; else why. */
static zps_status s_same_fleet(const ps_ckpt *c0, const ps_ckpt *c, uint32_t i,
                               const char *path, char *why, size_t wl)
{
    if (c->server_index != i) {
        snprintf(why, wl, "%s holds server %u's shard, not server %u's", path, c->server_index, i);
        return ZPS_ERR_CORRUPT;
    }
    if (c->plan_hash != c0->plan_hash || c->n_servers != c0->n_servers ||
        c->chunk_bytes != c0->chunk_bytes || c->num_chunks != c0->num_chunks ||
        c->n_vars != c0->n_vars || c->total != c0->total) {
        snprintf(why, wl, "%s is of another fleet than server 0's shard (plan %016" PRIx64
                 " for %u servers, not %016" PRIx64 " for %u)", path, c->plan_hash,
                 c->n_servers, c0->plan_hash, c0->n_servers);
        return ZPS_ERR_PLAN;
    }
    if (c->mode != c0->mode) {
        snprintf(why, wl, "%s was written in another mode (%u) than server 0's shard (%u)",
                 path, c->mode, c0->mode);
        return ZPS_ERR_CONFIG;
    }
    return ZPS_OK;
}

/* The smallest and largest chunk version of the set, and the sync check. */
static zps_status s_versions(ps_ckpt_set *s, char *why, size_t wl)
{
    s->version_min = UINT64_MAX;
    s->version_max = 0;
    for (uint32_t i = 0; i < s->n; i++)
        for (uint32_t k = 0; k < s->shards[i].n_local; k++) {
            uint64_t v = s->shards[i].chunks[k].version;
            s->version_min = v < s->version_min ? v : s->version_min;
            s->version_max = v > s->version_max ? v : s->version_max;
        }
    if (s->version_min == UINT64_MAX)
        s->version_min = 0;
    if (s->shards[0].mode == PS_MODE_SYNC && s->version_min != s->version_max) {
        char lo[64] = "", hi[64] = "";
        for (uint32_t i = 0; i < s->n; i++)
            for (uint32_t k = 0; k < s->shards[i].n_local; k++) {
                uint64_t v = s->shards[i].chunks[k].version;
                if (v == s->version_min && !lo[0])
                    snprintf(lo, sizeof lo, "server %u at %" PRIu64, i, v);
                if (v == s->version_max && !hi[0])
                    snprintf(hi, sizeof hi, "server %u at %" PRIu64, i, v);
            }
        snprintf(why, wl, "the shards are of different versions (%s, %s): not one model; take "
                 "a versioned cut (--ckpt-version V, from zps-ctl checkpoint or "
                 "--checkpoint-every-versions)", lo, hi);
        return ZPS_ERR_STALE;
    }
    return ZPS_OK;
}

zps_status ps_ckpt_set_read(const char *dir, int64_t version, ps_ckpt_set *out, char *why,
                            size_t wl)
{
    memset(out, 0, sizeof *out);
    char path[1100];
    s_shard_path(dir, 0, version, path, sizeof path);
    ps_ckpt c0;
    zps_status st = ps_ckpt_read(path, &c0, why, wl);
    if (st == ZPS_ERR_NOT_FOUND)
        snprintf(why, wl, "no shard of server 0: %s is missing", path);
    if (st != ZPS_OK)
        return st;
    uint32_t n = c0.n_servers ? c0.n_servers : 1;
    out->n = n;
    out->shards = zps_xcalloc(n, sizeof *out->shards);
    out->shards[0] = c0;
    for (uint32_t i = 1; i < n && st == ZPS_OK; i++) {
        s_shard_path(dir, (int)i, version, path, sizeof path);
        st = ps_ckpt_read(path, &out->shards[i], why, wl);
        if (st == ZPS_ERR_NOT_FOUND)
            snprintf(why, wl, "missing shard: %s (the fleet had %u servers)", path, n);
        else if (st == ZPS_OK)
            st = s_same_fleet(&c0, &out->shards[i], i, path, why, wl);
    }
    if (st == ZPS_OK && c0.server_index != 0) {
        s_shard_path(dir, 0, version, path, sizeof path);
        snprintf(why, wl, "%s holds server %u's shard, not server 0's", path, c0.server_index);
        st = ZPS_ERR_CORRUPT;
    }
    if (st == ZPS_OK)
        st = s_versions(out, why, wl);
    if (st != ZPS_OK)
        ps_ckpt_set_free(out);
    return st;
}

zps_status ps_ckpt_set_merge(const ps_ckpt_set *s, const ps_plan *plan, float *flat, char *why,
                             size_t wl)
{
    const ps_ckpt *c0 = &s->shards[0];
    if (plan->hash != c0->plan_hash || (uint32_t)plan->n_servers != s->n) {
        snprintf(why, wl, "the shards hold another model: their plan %016" PRIx64 " (%u variables, "
                 "%" PRIu64 " values, %u servers) is not this model's %016" PRIx64 " (%d "
                 "variables, %" PRIu64 " values)", c0->plan_hash, c0->n_vars, c0->total, s->n,
                 plan->hash, plan->n_vars, plan->total);
        return ZPS_ERR_PLAN;
    }
    uint8_t *seen = zps_xcalloc(plan->n_chunks ? plan->n_chunks : 1, 1);
    zps_status st = ZPS_OK;
    for (uint32_t i = 0; i < s->n && st == ZPS_OK; i++) {
        const ps_ckpt *c = &s->shards[i];
        uint64_t off = 0; // local values: the shard's chunks back to back, in its order
        for (uint32_t k = 0; k < c->n_local && st == ZPS_OK; k++) {
            const ps_ckpt_chunk *ch = &c->chunks[k];
            const ps_chunk *pc = ch->key < plan->n_chunks ? &plan->chunks[ch->key] : NULL;
            if (!pc || pc->server != i || pc->count != ch->count || seen[ch->key]) {
                snprintf(why, wl, "server %u's shard holds chunk %u (%" PRIu64 " values), which "
                         "the plan does not give it", i, ch->key, ch->count);
                st = ZPS_ERR_PLAN;
                break;
            }
            seen[ch->key] = 1;
            memcpy(flat + pc->offset, c->values + off, ch->count * sizeof *flat);
            off += ch->count;
        }
    }
    for (uint32_t k = 0; k < plan->n_chunks && st == ZPS_OK; k++)
        if (!seen[k]) {
            snprintf(why, wl, "no shard holds chunk %u (server %u's in the plan)", k,
                     plan->chunks[k].server);
            st = ZPS_ERR_PLAN;
        }
    free(seen);
    return st;
}

void ps_ckpt_set_free(ps_ckpt_set *s)
{
    for (uint32_t i = 0; s->shards && i < s->n; i++)
        ps_ckpt_free(&s->shards[i]);
    free(s->shards);
    memset(s, 0, sizeof *s);
}
