/* ckpt.h — server checkpoint files: values, optimizer slots, versions and the plan hash.
 *
 * One file per server, DIR/server-INDEX.ckpt, written atomically: the bytes go to
 * DIR/.server-INDEX.ckpt.tmp, which is fsync'ed and renamed over the old file, then the
 * directory is fsync'ed. Readers therefore see the old checkpoint or the new one, never a
 * mix. The file ends with a CRC-32 (zlib) of everything before it and the total length, so
 * a truncated or corrupt file is refused with ZPS_ERR_CORRUPT and a reason, never loaded.
 *
 * Layout (little-endian, as the machine writes it; x86-64 only):
 *   "ZPSCKPT1" | u32 format(1) | u32 server_index | u64 plan_hash | u32 n_vars | u64 total
 *   | u32 n_servers | u64 chunk_bytes | u32 num_chunks | u32 mode | u32 n_local
 *   | u32 n_slots | u32 opt_len | opt_len bytes (OptimizerConfig protobuf)
 *   | n_local x {u32 key, u32 pad, u64 count, u64 version} | values (f32 x local_total)
 *   | slots (n_slots x local_total f32) | u64 file_length | u32 crc32
 */
#ifndef ZPS_PS_CKPT_H
#define ZPS_PS_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"
#include "ps/plan.h"

typedef struct ps_ckpt_chunk {
    uint32_t key;
    uint64_t count;
    uint64_t version;
} ps_ckpt_chunk;

/* What a checkpoint holds. Pointers are borrowed for write and owned (free()) after
 * read: chunks, values, slots (one block: n_slots x local_total floats), opt. */
typedef struct ps_ckpt {
    uint32_t server_index;
    uint64_t plan_hash;
    uint32_t n_vars;
    uint64_t total;
    uint32_t n_servers;
    uint64_t chunk_bytes;
    uint32_t num_chunks;
    uint32_t mode;
    uint32_t n_local;
    ps_ckpt_chunk *chunks; // (n_local)
    uint64_t local_total;  // sum of chunk counts
    uint32_t n_slots;
    float *values;         // (local_total)
    float *slots;          // (n_slots * local_total), slot-major
    uint8_t *opt;          // packed OptimizerConfig
    uint32_t opt_len;
} ps_ckpt;

/* "DIR/server-INDEX.ckpt" into buf. */
void ps_ckpt_path(const char *dir, int index, char *buf, size_t len);
/* Sync mode keeps versioned copies as well (docs/ps.md "Recovery"):
 * DIR/server-INDEX.vVERSION.ckpt, a hard link to the server-INDEX.ckpt of that version,
 * made right after it was written, so a versioned file is as atomic as the latest. */
void ps_ckpt_version_path(const char *dir, int index, uint64_t version, char *buf, size_t len);
/* Links the current DIR/server-INDEX.ckpt as version `version` (replacing an older link of
 * that version) and removes every versioned file but the `keep` newest. */
zps_status ps_ckpt_keep_version(const char *dir, int index, uint64_t version, int keep);
/* Removes the versioned checkpoints of server INDEX newer than version. */
void ps_ckpt_drop_after(const char *dir, int index, uint64_t version);
/* The newest versioned checkpoint of server INDEX in DIR: ZPS_ERR_NOT_FOUND when none. */
zps_status ps_ckpt_newest_version(const char *dir, int index, uint64_t *version);
/* Atomic write (see above). */
zps_status ps_ckpt_write(const char *dir, int index, const ps_ckpt *c);
/* Reads and verifies path. ZPS_ERR_NOT_FOUND when absent, ZPS_ERR_CORRUPT with a logged
 * reason (and in why) when anything is off. On success the caller frees with
 * ps_ckpt_free. */
zps_status ps_ckpt_read(const char *path, ps_ckpt *out, char *why, size_t why_len);
void ps_ckpt_free(ps_ckpt *c);

/* ---- ckpt_set.c: every server's shard read as one model (zps-ctl export) */

typedef struct ps_ckpt_set {
    uint32_t n;                  // shards = the fleet's servers (from server 0's file)
    ps_ckpt *shards;             // (n) shard i is server i's
    uint64_t version_min, version_max; // over every chunk of every shard
} ps_ckpt_set;

/* Reads DIR/server-I.vV.ckpt (version >= 0) or DIR/server-I.ckpt (version -1) for every
 * server I of the fleet. Refuses, naming the file in why: a missing shard
 * (ZPS_ERR_NOT_FOUND), a corrupt one or one at another index (ZPS_ERR_CORRUPT), one of
 * another fleet (ZPS_ERR_PLAN: plan hash, server count, chunk size), another mode
 * (ZPS_ERR_CONFIG) and, in sync mode, chunks at different versions (ZPS_ERR_STALE). Async
 * and ssp shards differ in version by nature: version_min and version_max say by how much.
 * On success the caller frees with ps_ckpt_set_free. */
zps_status ps_ckpt_set_read(const char *dir, int64_t version, ps_ckpt_set *out, char *why,
                            size_t why_len);
/* The model's values into flat (plan->total floats, flat order): ZPS_ERR_PLAN (why) when
 * plan is not the shards' (hash, server count, chunk table). */
zps_status ps_ckpt_set_merge(const ps_ckpt_set *s, const ps_plan *plan, float *flat, char *why,
                             size_t why_len);
void ps_ckpt_set_free(ps_ckpt_set *s);

#endif
