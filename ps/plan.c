/* plan.c — see plan.h. Pure functions: no I/O except ps_vars_load_tsv. */
#include "ps/plan.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/mem.h"

#define S_FNV_OFFSET 0xcbf29ce484222325ull
#define S_FNV_PRIME 0x100000001b3ull

static uint64_t s_fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= S_FNV_PRIME;
    }
    return h;
}

static uint64_t s_fnv_u64(uint64_t h, uint64_t v)
{
    unsigned char b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)(v >> (8 * i));
    return s_fnv(h, b, 8);
}

uint64_t ps_plan_hash(const ps_var *vars, int n_vars, int n_servers, uint64_t chunk_bytes)
{
    if (!chunk_bytes)
        chunk_bytes = PS_DEFAULT_CHUNK_BYTES;
    uint64_t h = S_FNV_OFFSET;
    h = s_fnv_u64(h, PS_PLAN_ALGO);
    h = s_fnv_u64(h, (uint64_t)n_servers);
    h = s_fnv_u64(h, chunk_bytes);
    h = s_fnv_u64(h, (uint64_t)n_vars);
    for (int i = 0; i < n_vars; i++) {
        const char *nm = vars[i].name ? vars[i].name : "";
        h = s_fnv(h, nm, strlen(nm) + 1);
        h = s_fnv_u64(h, vars[i].count);
    }
    return h;
}

void ps_plan_destroy(ps_plan **pp)
{
    if (!pp || !*pp)
        return;
    ps_plan *p = *pp;
    for (int i = 0; i < p->n_vars; i++)
        free(p->names[i]);
    free(p->names);
    free(p->var_count);
    free(p->var_offset);
    free(p->chunks);
    free(p->server_elems);
    free(p->server_chunks);
    free(p);
    *pp = NULL;
}

/* The arguments ps_plan_new accepts; *total gets the element count of the model. */
static zps_status s_check_args(const ps_var *vars, int n_vars, int n_servers,
                               uint64_t chunk_bytes, uint64_t *total)
{
    if (!vars || n_vars < 1 || n_servers < 1 || n_servers > 65536 || chunk_bytes < 4) {
        zps_log(ZPS_ERROR, "plan", "bad plan arguments: %d variables, %d servers, chunk %llu B",
                n_vars, n_servers, (unsigned long long)chunk_bytes);
        return ZPS_ERR_INVALID;
    }
    *total = 0;
    for (int i = 0; i < n_vars; i++) {
        if (vars[i].count == 0 || vars[i].count > (1ull << 40)) {
            zps_log(ZPS_ERROR, "plan", "variable %d (%s) has bad count %llu", i,
                    vars[i].name ? vars[i].name : "?", (unsigned long long)vars[i].count);
            return ZPS_ERR_INVALID;
        }
        *total += vars[i].count;
    }
    return ZPS_OK;
}

/* The chunk limit E of rule 1 (plan.h). */
static uint64_t s_chunk_limit(uint64_t total, int n_servers, uint64_t chunk_bytes)
{
    uint64_t e = chunk_bytes / 4;
    uint64_t bal = (total + 32ull * (uint64_t)n_servers - 1) / (32ull * (uint64_t)n_servers);
    if (bal < 1024)
        bal = 1024;
    if (bal < e)
        e = bal;
    if (e < 1)
        e = 1;
    return e;
}

/* Rule 2 over p's variables with limit e: returns the number of chunks, and writes them
 * (server 0) to chunks unless it is NULL, so one walk both counts and fills. */
static uint32_t s_cut_chunks(const ps_plan *p, uint64_t e, ps_chunk *chunks)
{
    uint32_t n = 0;
    uint64_t open_start = 0, open_count = 0; // the open chunk (open_count 0: none)
    for (int i = 0; i < p->n_vars; i++) {
        uint64_t c = p->var_count[i], vo = p->var_offset[i];
        if (open_count && open_count + c <= e) {
            open_count += c;
            continue;
        }
        if (open_count) {
            if (chunks)
                chunks[n] = (ps_chunk){n, 0, open_start, open_count};
            n++;
            open_count = 0;
        }
        if (c <= e) {
            open_start = vo;
            open_count = c;
            continue;
        }
        uint64_t k = (c + e - 1) / e, base = c / k, extra = c % k, o = vo;
        for (uint64_t j = 0; j < k; j++) {
            uint64_t cnt = base + (j < extra ? 1 : 0);
            if (chunks)
                chunks[n] = (ps_chunk){n, 0, o, cnt};
            n++;
            o += cnt;
        }
    }
    if (open_count) {
        if (chunks)
            chunks[n] = (ps_chunk){n, 0, open_start, open_count};
        n++;
    }
    return n;
}

/* Rule 3: each chunk in key order to the server with the fewest elements so far. */
static void s_place_chunks(ps_plan *p)
{
    p->server_elems = zps_xcalloc((size_t)p->n_servers, sizeof *p->server_elems);
    p->server_chunks = zps_xcalloc((size_t)p->n_servers, sizeof *p->server_chunks);
    for (uint32_t k = 0; k < p->n_chunks; k++) {
        int best = 0;
        for (int s = 1; s < p->n_servers; s++)
            if (p->server_elems[s] < p->server_elems[best])
                best = s;
        p->chunks[k].server = (uint32_t)best;
        p->server_elems[best] += p->chunks[k].count;
        p->server_chunks[best]++;
    }
}

zps_status ps_plan_new(const ps_var *vars, int n_vars, int n_servers, uint64_t chunk_bytes,
                       ps_plan **out)
{
    *out = NULL;
    if (!chunk_bytes)
        chunk_bytes = PS_DEFAULT_CHUNK_BYTES;
    uint64_t total;
    ZPS_TRY(s_check_args(vars, n_vars, n_servers, chunk_bytes, &total));
    ps_plan *p = zps_xcalloc(1, sizeof *p);
    p->n_vars = n_vars;
    p->names = zps_xcalloc((size_t)n_vars, sizeof *p->names);
    p->var_count = zps_xmalloc((size_t)n_vars * sizeof *p->var_count);
    p->var_offset = zps_xmalloc(((size_t)n_vars + 1) * sizeof *p->var_offset);
    uint64_t off = 0;
    for (int i = 0; i < n_vars; i++) {
        p->names[i] = zps_xstrdup(vars[i].name ? vars[i].name : "");
        p->var_count[i] = vars[i].count;
        p->var_offset[i] = off;
        off += vars[i].count;
    }
    p->var_offset[n_vars] = off;
    p->total = total;
    p->n_servers = n_servers;
    p->chunk_bytes = chunk_bytes;
    p->chunk_elems = s_chunk_limit(total, n_servers, chunk_bytes);
    p->n_chunks = s_cut_chunks(p, p->chunk_elems, NULL);
    p->chunks = zps_xcalloc(p->n_chunks, sizeof *p->chunks);
    s_cut_chunks(p, p->chunk_elems, p->chunks);
    s_place_chunks(p);
    p->hash = ps_plan_hash(vars, n_vars, n_servers, chunk_bytes);
    *out = p;
    return ZPS_OK;
}

/* Index of the chunk holding flat element x (chunks tile [0, total)). */
static uint32_t s_find_chunk(const ps_plan *p, uint64_t x)
{
    uint32_t lo = 0, hi = p->n_chunks - 1;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo + 1) / 2;
        if (p->chunks[mid].offset <= x)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

size_t ps_plan_pieces(const ps_plan *p, int first_var, int n_vars, ps_piece *out, size_t max)
{
    assert(first_var >= 0 && n_vars >= 0 && first_var + n_vars <= p->n_vars);
    if (n_vars == 0)
        return 0;
    uint64_t a = p->var_offset[first_var], b = p->var_offset[first_var + n_vars];
    size_t n = 0;
    for (uint32_t k = s_find_chunk(p, a); k < p->n_chunks && p->chunks[k].offset < b; k++) {
        const ps_chunk *c = &p->chunks[k];
        uint64_t lo = a > c->offset ? a : c->offset;
        uint64_t hi = b < c->offset + c->count ? b : c->offset + c->count;
        if (n < max)
            out[n] = (ps_piece){c->key, c->server, lo - c->offset, lo, hi - lo};
        n++;
    }
    return n;
}

void ps_vars_free(ps_var **vars, int n_vars)
{
    if (!vars || !*vars)
        return;
    for (int i = 0; i < n_vars; i++)
        free((char *)(*vars)[i].name);
    free(*vars);
    *vars = NULL;
}

zps_status ps_vars_load_tsv(const char *path, const char *kind, ps_var **vars, int *n_vars)
{
    *vars = NULL;
    *n_vars = 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        zps_log(ZPS_ERROR, "plan", "%s: %s", path, strerror(errno));
        return errno == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;
    }
    char line[4096];
    int cap = 0, n = 0, lineno = 0;
    ps_var *v = NULL;
    zps_status st = ZPS_OK;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (line[0] == '#' || line[0] == '\n' || !strncmp(line, "kind\t", 5))
            continue;
        char k[64], name[1024], shape[256];
        unsigned long long cnt;
        if (sscanf(line, "%63s\t%1023s\t%255s\t%llu", k, name, shape, &cnt) != 4) {
            zps_log(ZPS_ERROR, "plan", "%s:%d: expected kind, name, shape, count", path,
                    lineno);
            st = ZPS_ERR_PARSE;
            break;
        }
        if (kind && strcmp(kind, k))
            continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 64;
            v = zps_xrealloc(v, (size_t)cap * sizeof *v);
        }
        v[n].name = zps_xstrdup(name);
        v[n].count = cnt;
        n++;
    }
    fclose(f);
    if (st != ZPS_OK) {
        ps_vars_free(&v, n);
        return st;
    }
    *vars = v;
    *n_vars = n;
    return ZPS_OK;
}
