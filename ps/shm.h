/* shm.h — the same-host data plane (docs/ps.md "Shared memory"): a server's segment that
 * trainers on its host map, so gradients and values cross between the processes with one
 * memcpy each instead of going through the kernel's TCP stack. ZeroMQ still carries every
 * request and reply (ids, steps, versions, errors); only the payload bytes move here.
 *
 * The segment is a memfd of the server process. A client maps it through
 * /proc/<server pid>/fd/<fd>, which exists only on the server's host and only while the
 * server lives; it then checks the segment's magic, size and nonce (random per segment, also
 * sent in the offer), so a pid or fd reused by another process, another host's /proc or a
 * replaced segment is never taken for it. Nothing is left behind when a server dies: the
 * memory goes with the last mapping.
 *
 * Layout (every offset 64-byte aligned):
 *   ps_shm_hdr
 *   ps_shm_chunk[n_local]    key, count, element offset, seqlock word, in key order
 *   float values[local_total]               the server's values (its s->values)
 *   float slot[n_trainers][local_total]     trainer t's pushed gradients (written by t)
 *
 * Invariants:
 *   - The server changes chunk c's values only between ps_shm_write_begin(c) and
 *     ps_shm_write_end(c): the seqlock word is odd in between, and a client's copy
 *     (ps_shm_read) that saw it odd or changed is reported torn and not used.
 *   - valid is 1 from creation until the server stops using the segment (its values moved
 *     or its shard was replaced); clients check it before every use.
 *   - Trainer t writes only its own slot, and only ranges the server is not reading: a
 *     range's slot bytes are rewritten only after the server's reply to the push that
 *     carried them (the server keeps a reference only until then, or copies them). Until
 *     that reply the server may also write them: a sync server sums the other trainers'
 *     gradients of a chunk into the first trainer's slot and applies from there
 *     (server_consistency.c); the trainer never reads its slot back.
 */
#ifndef ZPS_PS_SHM_H
#define ZPS_PS_SHM_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define PS_SHM_MAGIC 0x316d68732d73707aull /* "zps-shm1" little-endian */

typedef struct ps_shm_hdr {
    uint64_t magic;
    uint64_t nonce;          // random, never 0
    _Atomic uint32_t valid;  // 0: the server no longer uses this segment
    uint32_t n_local;        // chunks
    uint32_t n_trainers;     // slots
    uint32_t num_chunks;     // keys are 0 .. num_chunks - 1 (the plan's)
    uint64_t local_total;    // floats in values and in each slot
    uint64_t chunks_off, values_off, slots_off, slot_stride_bytes, bytes;
} ps_shm_hdr;

typedef struct ps_shm_chunk {
    uint32_t key;
    uint32_t pad;
    uint64_t count;          // elements
    uint64_t off;            // first element in values / a slot
    _Atomic uint64_t seq;    // even: stable; odd: being written
    uint64_t pad2[4];        // one cache line per chunk
} ps_shm_chunk;

/* One mapping of a segment (the server's own, or a client's). */
typedef struct ps_shm {
    ps_shm_hdr *hdr;
    ps_shm_chunk *chunks;    // (hdr->n_local)
    float *values;
    int32_t *key_to_local;   // (hdr->num_chunks) -1: not in this segment (client side)
    int fd;                  // the server's memfd; -1 on the client
    size_t bytes;
} ps_shm;

/* Server: a new segment for n_local chunks (keys, counts, offs: the shard's table, in key
 * order; num_chunks the plan's) and n_trainers slots; values uninitialised. */
zps_status ps_shm_create(uint32_t n_local, const uint32_t *keys, const uint64_t *counts,
                         const uint64_t *offs, uint32_t num_chunks, uint64_t local_total,
                         uint32_t n_trainers, ps_shm **out);
/* Client: maps the segment of an offer; ZPS_ERR_NOT_FOUND (not this host, or gone),
 * ZPS_ERR_CORRUPT (not the segment offered) with why. */
zps_status ps_shm_attach(uint32_t pid, uint32_t fd, uint64_t bytes, uint64_t nonce, ps_shm **out,
                         char *why, size_t why_len);
/* Unmaps (and closes the server's memfd); NULL-safe, sets *m to NULL. */
void ps_shm_destroy(ps_shm **m);

int ps_shm_valid(const ps_shm *m);
/* Server: no client may use the segment from now on (it stays mapped until destroyed). */
void ps_shm_invalidate(ps_shm *m);

/* Trainer t's slot. */
float *ps_shm_slot(const ps_shm *m, uint32_t t);

/* Server: around every change of local chunk lc's values. */
void ps_shm_write_begin(ps_shm *m, uint32_t lc);
void ps_shm_write_end(ps_shm *m, uint32_t lc);
/* Client: copies n values of local chunk lc from element off into dst; 0 when the copy is
 * consistent, -1 when the server changed the chunk meanwhile (dst then holds garbage). */
int ps_shm_read(const ps_shm *m, uint32_t lc, uint64_t off, uint64_t n, float *dst);

#endif
