/* test_plan.c — the sharding plan: Inception-v3's variable list (torchvision's 292
 * trainable tensors, 27,161,264 values) is balanced within 1.05x of the mean on 2, 3, 4 and
 * 8 servers; chunks tile the flat buffer and respect the size limit; small variables are
 * packed and large ones split; pieces of any variable range cover it exactly; independent
 * processes compute identical plans; the hash changes with every input. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/mem.h"
#include "ps/plan.h"
#include "tests/ps_test_util.h"

static void s_load_inception(ps_var **v, int *n)
{
    const char *root = getenv("ZPS_ROOT");
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/data/inception_v3_variables.tsv", root ? root : ".");
    cr_assert_eq(ps_vars_load_tsv(path, "param", v, n), ZPS_OK, "cannot read %s", path);
}

static void s_check_tiling(const ps_plan *p)
{
    uint64_t off = 0;
    for (uint32_t k = 0; k < p->n_chunks; k++) {
        cr_assert_eq(p->chunks[k].key, k);
        cr_assert_eq(p->chunks[k].offset, off, "chunk %u", k);
        cr_assert(p->chunks[k].count >= 1 && p->chunks[k].count <= p->chunk_elems);
        cr_assert((int)p->chunks[k].server < p->n_servers);
        off += p->chunks[k].count;
    }
    cr_assert_eq(off, p->total);
}

Test(plan, inception_v3_is_balanced_within_5_percent)
{
    ps_var *v;
    int n;
    s_load_inception(&v, &n);
    cr_assert_eq(n, 292);
    uint64_t total = 0;
    for (int i = 0; i < n; i++)
        total += v[i].count;
    cr_assert_eq(total, 27161264ull);
    const int servers[] = {1, 2, 3, 4, 8};
    for (int k = 0; k < 5; k++) {
        ps_plan *p;
        cr_assert_eq(ps_plan_new(v, n, servers[k], 0, &p), ZPS_OK);
        s_check_tiling(p);
        cr_assert(p->chunk_elems * 4 <= PS_DEFAULT_CHUNK_BYTES);
        double mean = (double)total / servers[k], mx = 0;
        for (int s = 0; s < servers[k]; s++)
            if ((double)p->server_elems[s] > mx)
                mx = (double)p->server_elems[s];
        cr_expect(mx <= 1.05 * mean, "%d servers: max %.0f vs mean %.0f (%.3fx)", servers[k], mx,
                  mean, mx / mean);
        ps_plan_destroy(&p);
    }
    ps_vars_free(&v, n);
}

Test(plan, packs_small_and_splits_large_variables)
{
    /* E = 1024 elements (chunk_bytes 4096) */
    ps_var v[] = {{"a", 100}, {"b", 200}, {"c", 3000}, {"d", 10}, {"e", 1024}, {"f", 1}};
    ps_plan *p;
    cr_assert_eq(ps_plan_new(v, 6, 2, 4096, &p), ZPS_OK);
    cr_assert_eq(p->chunk_elems, 1024);
    s_check_tiling(p);
    /* a+b packed; c cut in 3 x 1000; d alone (e does not fit after it); e; f */
    cr_assert_eq(p->n_chunks, 1 + 3 + 1 + 1 + 1);
    cr_assert_eq(p->chunks[0].count, 300);
    cr_assert_eq(p->chunks[1].count, 1000);
    cr_assert_eq(p->chunks[4].count, 10);
    cr_assert_eq(p->chunks[5].count, 1024);
    cr_assert_eq(p->chunks[6].count, 1);
    /* greedy placement by bytes */
    cr_assert_eq(p->chunks[0].server, 0);
    cr_assert_eq(p->chunks[1].server, 1);
    cr_assert_eq(p->chunks[2].server, 0);
    ps_plan_destroy(&p);
}

Test(plan, pieces_cover_every_variable_range_exactly)
{
    uint64_t seed = pst_seed(), r = seed;
    int n = 40;
    ps_var v[40];
    char names[40][16];
    for (int i = 0; i < n; i++) {
        snprintf(names[i], sizeof names[i], "v%d", i);
        v[i].name = names[i];
        v[i].count = 1 + (uint64_t)((pst_uniform(&r) + 1.0f) * (i % 5 == 0 ? 20000 : 700));
    }
    ps_plan *p;
    cr_assert_eq(ps_plan_new(v, n, 3, 8192, &p), ZPS_OK);
    s_check_tiling(p);
    for (int trial = 0; trial < 200; trial++) {
        int a = (int)((pst_uniform(&r) + 1.0f) * 0.5f * n) % n;
        int k = 1 + (int)((pst_uniform(&r) + 1.0f) * 0.5f * (n - a)) % (n - a);
        size_t np = ps_plan_pieces(p, a, k, NULL, 0);
        ps_piece *pc = zps_xmalloc(np * sizeof *pc);
        cr_assert_eq(ps_plan_pieces(p, a, k, pc, np), np);
        uint64_t at = p->var_offset[a];
        for (size_t i = 0; i < np; i++) {
            const ps_chunk *c = &p->chunks[pc[i].key];
            cr_assert_eq(pc[i].flat_offset, at, "seed %llu", (unsigned long long)seed);
            cr_assert_eq(c->offset + pc[i].chunk_offset, pc[i].flat_offset);
            cr_assert(pc[i].chunk_offset + pc[i].count <= c->count);
            cr_assert_eq(pc[i].server, c->server);
            at += pc[i].count;
        }
        cr_assert_eq(at, p->var_offset[a + k]);
        free(pc);
    }
    ps_plan_destroy(&p);
}

static uint64_t s_digest(const ps_plan *p)
{
    uint64_t h = p->hash;
    for (uint32_t k = 0; k < p->n_chunks; k++)
        h = (h ^ (p->chunks[k].offset * 31 + p->chunks[k].count * 7 + p->chunks[k].server)) *
            0x100000001b3ull;
    return h;
}

Test(plan, independent_processes_compute_identical_plans, .timeout = 20)
{
    ps_var *v;
    int n;
    s_load_inception(&v, &n);
    uint64_t mine[4];
    for (int s = 0; s < 4; s++) {
        ps_plan *p;
        cr_assert_eq(ps_plan_new(v, n, s + 2, 0, &p), ZPS_OK);
        mine[s] = s_digest(p);
        ps_plan_destroy(&p);
    }
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        /* a fresh exec would be stricter; a forked child recomputes from its own loaded copy */
        ps_var *cv;
        int cn;
        const char *root = getenv("ZPS_ROOT");
        char path[1024];
        snprintf(path, sizeof path, "%s/tests/data/inception_v3_variables.tsv", root ? root : ".");
        if (ps_vars_load_tsv(path, "param", &cv, &cn) != ZPS_OK)
            _exit(2);
        for (int s = 0; s < 4; s++) {
            ps_plan *p;
            if (ps_plan_new(cv, cn, s + 2, 0, &p) != ZPS_OK)
                _exit(3);
            uint64_t d = s_digest(p);
            if (write(fds[1], &d, sizeof d) != sizeof d)
                _exit(4);
            ps_plan_destroy(&p);
        }
        _exit(0);
    }
    close(fds[1]);
    for (int s = 0; s < 4; s++) {
        uint64_t d = 0;
        cr_assert_eq(read(fds[0], &d, sizeof d), (ssize_t)sizeof d);
        cr_assert_eq(d, mine[s], "plan for %d servers differs between processes", s + 2);
    }
    int ws;
    cr_assert_eq(waitpid(pid, &ws, 0), pid);
    cr_assert(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
    close(fds[0]);
    ps_vars_free(&v, n);
}

Test(plan, hash_depends_on_every_input)
{
    ps_var a[] = {{"x", 10}, {"y", 20}};
    ps_var b[] = {{"x", 10}, {"y", 21}};
    ps_var c[] = {{"x", 10}, {"z", 20}};
    uint64_t h = ps_plan_hash(a, 2, 2, 0);
    cr_assert_eq(h, ps_plan_hash(a, 2, 2, PS_DEFAULT_CHUNK_BYTES));
    cr_assert_neq(h, ps_plan_hash(b, 2, 2, 0));
    cr_assert_neq(h, ps_plan_hash(c, 2, 2, 0));
    cr_assert_neq(h, ps_plan_hash(a, 2, 3, 0));
    cr_assert_neq(h, ps_plan_hash(a, 2, 2, 4096));
    cr_assert_neq(h, ps_plan_hash(a, 1, 2, 0));
    ps_plan *p;
    cr_assert_eq(ps_plan_new(a, 2, 2, 0, &p), ZPS_OK);
    cr_assert_eq(p->hash, h);
    ps_plan_destroy(&p);
    ps_var z[] = {{"x", 0}};
    cr_assert_eq(ps_plan_new(z, 1, 2, 0, &p), ZPS_ERR_INVALID);
    cr_assert_eq(ps_plan_new(a, 2, 0, 0, &p), ZPS_ERR_INVALID);
}
