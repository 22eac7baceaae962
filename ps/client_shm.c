/* client_shm.c — the PS client's same-host data plane (ps/shm.h, docs/ps.md "Shared
 * memory"): mapping a server's segment when it offers one, staging a sync push's gradients
 * in this trainer's slot, and copying pulled values out of the segment.
 *
 * Invariants:
 *   - Everything here is an optimisation over ZeroMQ frames and falls back to them: a server
 *     that refuses staged gradients, a torn or foreign read, a segment that became invalid,
 *     or one that cannot be mapped (another host) leaves the request to the frames path.
 *   - A slot's bytes for elements [a, b) of server i are rewritten only when no push staged
 *     over them is in flight (shm_busy bits), so the server never reads half of two pushes.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "common/bits.h"
#include "common/log.h"
#include "common/mem.h"
#include "ps/client_int.h"
#include "ps/dtype.h"

/* The segment of server, when it is usable now. */
static ps_shm *s_seg(const ps_client *c, int server)
{
    ps_shm *m = c->shm[server];
    return m && ps_shm_valid(m) ? m : NULL;
}

static void s_detach(ps_client *c, int server)
{
    ps_shm_destroy(&c->shm[server]);
    free(c->shm_busy[server]);
    c->shm_busy[server] = NULL;
}

void ps_client_shm_offer(ps_client *c, int server, const Zps__Header *h)
{
    if (!c->o.shm || !h->shm_pid || !h->shm_nonce || h->shm_values)
        return;
    if ((c->shm[server] && c->shm[server]->hdr->nonce == h->shm_nonce) ||
        c->shm_tried[server] == h->shm_nonce)
        return;
    char why[256];
    ps_shm *m;
    zps_status st = ps_shm_attach(h->shm_pid, h->shm_fd, h->shm_bytes, h->shm_nonce, &m, why,
                                  sizeof why);
    if (st != ZPS_OK) {
        c->shm_tried[server] = h->shm_nonce;
        zps_log(ZPS_DEBUG, "client", "server %d (%s): no shared memory (%s): payloads go "
                "through ZeroMQ", server, c->uris[server], why);
        return;
    }
    /* a segment replaced while pushes were staged in the old one: those still finish */
    s_detach(c, server);
    c->shm[server] = m;
    c->shm_busy[server] = zps_xcalloc((m->hdr->local_total + 63) / 64, sizeof(uint64_t));
    zps_log(ZPS_INFO, "client", "server %d (%s) is on this host: payloads cross in its shared "
            "memory", server, c->uris[server]);
}

uint64_t ps_client_shm_nonce(const ps_client *c, int server)
{
    const ps_shm *m = s_seg(c, server);
    return m ? m->hdr->nonce : 0;
}

/* Piece p's local chunk and element offset in m, or -1 when m does not hold all of it. */
static int64_t s_piece_at(const ps_shm *m, const ps_piece *p)
{
    if (p->key >= m->hdr->num_chunks || m->key_to_local[p->key] < 0)
        return -1;
    const ps_shm_chunk *ch = &m->chunks[m->key_to_local[p->key]];
    if (p->chunk_offset > ch->count || p->count > ch->count - p->chunk_offset)
        return -1;
    return (int64_t)(ch->off + p->chunk_offset);
}

int ps_client_shm_stage(ps_client *c, ps_client_slot *sl)
{
    ps_shm *m = s_seg(c, sl->server);
    if (sl->no_shm || !m || !c->registered ||
        c->job.mode != PS_MODE_SYNC || c->trainer >= m->hdr->n_trainers)
        return 0;
    uint64_t *busy = c->shm_busy[sl->server];
    if (!sl->shm_data || sl->shm_nonce != m->hdr->nonce) {
        /* new here: every piece must map and be free of other staged pushes */
        for (size_t i = 0; i < sl->n_pieces; i++) {
            int64_t at = s_piece_at(m, &sl->pieces[i]);
            if (at < 0 || zps_bits_any(busy, (uint64_t)at, (uint64_t)at + sl->pieces[i].count))
                return 0;
        }
        for (size_t i = 0; i < sl->n_pieces; i++) {
            uint64_t at = (uint64_t)s_piece_at(m, &sl->pieces[i]);
            zps_bits_put(busy, at, at + sl->pieces[i].count, 1);
        }
        sl->shm_data = 1;
        sl->shm_nonce = m->hdr->nonce;
    }
    /* The slot holds f32. push_dtype bf16 puts there what the server would widen the wire's
     * bfloat16 to, so the optimizer sees the same values as through frames. */
    float *slot = ps_shm_slot(m, c->trainer);
    int bf16 = c->o.push_dtype == PS_DTYPE_BF16;
    for (size_t i = 0; i < sl->n_pieces; i++) { /* (again on a resend: the same bytes) */
        const ps_piece *p = &sl->pieces[i];
        float *d = slot + s_piece_at(m, p);
        if (sl->src16)
            ps_bf16_to_f32(d, sl->src16 + p->flat_offset, p->count);
        else if (bf16)
            ps_f32_round_bf16(d, sl->src + p->flat_offset, p->count);
        else
            memcpy(d, sl->src + p->flat_offset, p->count * 4);
    }
    return 1;
}

void ps_client_shm_done(ps_client *c, ps_client_slot *sl)
{
    if (!sl->shm_data)
        return;
    sl->shm_data = 0;
    const ps_shm *m = c->shm[sl->server];
    if (!m || m->hdr->nonce != sl->shm_nonce)
        return; // staged in a segment since replaced: its bits went with it
    for (size_t i = 0; i < sl->n_pieces; i++) {
        int64_t at = s_piece_at(m, &sl->pieces[i]);
        if (at >= 0)
            zps_bits_put(c->shm_busy[sl->server], (uint64_t)at,
                         (uint64_t)at + sl->pieces[i].count, 0);
    }
}

int ps_client_shm_take(ps_client *c, ps_client_slot *sl, const Zps__Header *h)
{
    const ps_shm *m = c->shm[sl->server];
    if (!m || m->hdr->nonce != h->shm_nonce)
        return -1;
    for (size_t i = 0; i < sl->n_pieces; i++) {
        const ps_piece *p = &sl->pieces[i];
        int64_t at = s_piece_at(m, p);
        if (at < 0)
            return -1;
        uint32_t lc = (uint32_t)m->key_to_local[p->key];
        if (ps_shm_read(m, lc, p->chunk_offset, p->count, sl->dst + p->flat_offset) != 0) {
            zps_log(ZPS_DEBUG, "client", "server %d: chunk %u changed while its values were "
                    "copied from shared memory: pulling it through ZeroMQ", sl->server, p->key);
            return -1;
        }
    }
    return 0;
}

void ps_client_shm_free(ps_client *c)
{
    for (int i = 0; c->shm && i < c->n; i++)
        s_detach(c, i);
    free(c->shm);
    free(c->shm_tried);
    free(c->shm_busy);
    c->shm = NULL;
    c->shm_tried = NULL;
    c->shm_busy = NULL;
}
