/* plan.h — the sharding plan: which server owns which part of the model.
 *
 * A model is an ordered list of float32 variables {name, count}. Trainers keep ONE flat
 * buffer of values (and one of gradients): variable i lives at flat offset
 * sum(count[0..i-1]). The plan cuts that flat buffer into chunks, each a contiguous flat
 * range [offset, offset + count), and gives every chunk a key (its index, 0..n_chunks-1, in
 * flat order) and a server.
 *
 * The plan is a pure function of (variables, n_servers, chunk_bytes): every process that
 * computes it gets the same chunks and the same hash, so nothing but the hash travels.
 *
 * Rule (PS_PLAN_ALGO 1):
 *   1. The chunk limit E (elements) is min(chunk_bytes / 4, ceil(total / (32 * n_servers))),
 *      at least 1024 elements (never more than chunk_bytes / 4). The second term makes chunks
 *      small enough that greedy placement balances bytes within ~3% of the mean.
 *   2. Walk the variables in order. A variable that fits in the space left in the open
 *      chunk is packed into it; one that does not but has count <= E closes the open chunk
 *      and opens a new one; a larger one closes the open chunk and is cut into
 *      ceil(count / E) pieces of near-equal size (each its own chunk).
 *   3. Chunks in key order go to the server with the fewest bytes so far (lowest index on a
 *      tie). Placing in flat order interleaves servers along the model, so pushing or
 *      pulling any layer range keeps every server busy.
 * The hash is FNV-1a 64 over the algorithm number, n_servers, chunk_bytes and every
 * (name, count) pair.
 */
#ifndef ZPS_PS_PLAN_H
#define ZPS_PS_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "common/status.h"

#define PS_PLAN_ALGO 1u
#define PS_DEFAULT_CHUNK_BYTES (4ull << 20)

typedef struct ps_var {
    const char *name; // borrowed by ps_plan_new (copied into the plan)
    uint64_t count;   // float32 elements, >= 1
} ps_var;

typedef struct ps_chunk {
    uint32_t key;    // index in the plan, = position in flat order
    uint32_t server; // owner, 0..n_servers-1
    uint64_t offset; // first element in the flat buffer
    uint64_t count;  // elements, >= 1
} ps_chunk;

typedef struct ps_plan {
    int n_vars;
    char **names;            // (n_vars) owned copies
    uint64_t *var_count;     // (n_vars)
    uint64_t *var_offset;    // (n_vars + 1) flat offsets; var_offset[n_vars] = total
    uint64_t total;          // elements in the model
    int n_servers;
    uint64_t chunk_bytes;    // as requested
    uint64_t chunk_elems;    // E, the effective limit
    uint32_t n_chunks;
    ps_chunk *chunks;        // (n_chunks) in flat order
    uint64_t *server_elems;  // (n_servers) elements owned by each server
    uint32_t *server_chunks; // (n_servers) number of chunks owned by each server
    uint64_t hash;
} ps_plan;

/* One piece of a request: part of one chunk, and where it sits in the flat buffer. */
typedef struct ps_piece {
    uint32_t key;
    uint32_t server;
    uint64_t chunk_offset; // first element inside the chunk
    uint64_t flat_offset;  // first element in the flat buffer
    uint64_t count;
} ps_piece;

/* Builds the plan. chunk_bytes 0 means PS_DEFAULT_CHUNK_BYTES. ZPS_ERR_INVALID when there
 * are no variables, a count is 0, n_servers < 1 or chunk_bytes < 4. *out is the caller's. */
zps_status ps_plan_new(const ps_var *vars, int n_vars, int n_servers, uint64_t chunk_bytes,
                       ps_plan **out);
void ps_plan_destroy(ps_plan **pp);

/* Pieces covering variables [first_var, first_var + n_vars) in flat order; writes at most
 * max pieces and returns the number needed (call with max 0 to size). Asserts on a bad
 * range (API misuse). */
size_t ps_plan_pieces(const ps_plan *p, int first_var, int n_vars, ps_piece *out, size_t max);

/* The hash of a plan without building it (same value as ps_plan_new's). */
uint64_t ps_plan_hash(const ps_var *vars, int n_vars, int n_servers, uint64_t chunk_bytes);

/* Reads a variable list in the inception_v3_variables.tsv format (kind, name, shape, count;
 * '#' comments and the header line skipped). kinds: only rows whose kind equals `kind`
 * (e.g. "param"), or every row when kind is NULL. *vars (names owned) is freed with
 * ps_vars_free. */
zps_status ps_vars_load_tsv(const char *path, const char *kind, ps_var **vars, int *n_vars);
void ps_vars_free(ps_var **vars, int n_vars);

#endif
