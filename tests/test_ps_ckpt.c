/* test_ps_ckpt.c — checkpoint files: a round trip keeps every byte; a missing file is
 * NOT_FOUND; truncation at any of several points, a flipped bit, and a foreign file are
 * CORRUPT with a reason; no temporary file is left behind. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/mem.h"
#include "ps/ckpt.h"
#include "tests/ps_test_util.h"

static void s_make(ps_ckpt *c, uint64_t *r)
{
    memset(c, 0, sizeof *c);
    c->server_index = 1;
    c->plan_hash = 0x1234567890abcdefull;
    c->n_vars = 3;
    c->total = 5000;
    c->n_servers = 2;
    c->chunk_bytes = 4096;
    c->num_chunks = 6;
    c->mode = 1;
    c->n_local = 3;
    c->chunks = zps_xcalloc(3, sizeof *c->chunks);
    uint64_t counts[3] = {1000, 17, 800};
    for (int i = 0; i < 3; i++) {
        c->chunks[i] = (ps_ckpt_chunk){(uint32_t)(2 * i + 1), counts[i], 40 + (uint64_t)i};
        c->local_total += counts[i];
    }
    c->n_slots = 2;
    c->values = zps_xaligned(64, c->local_total * 4);
    c->slots = zps_xaligned(64, 2 * c->local_total * 4);
    for (uint64_t i = 0; i < c->local_total; i++)
        c->values[i] = pst_uniform(r);
    for (uint64_t i = 0; i < 2 * c->local_total; i++)
        c->slots[i] = pst_uniform(r);
    c->opt_len = 5;
    c->opt = zps_xmalloc(5);
    memcpy(c->opt, "\x0a\x03sgd", 5);
}

Test(ps_ckpt, round_trip_and_corruption)
{
    uint64_t seed = pst_seed(), r = seed;
    char dir[256], path[512], why[256];
    pst_tmpdir(dir, sizeof dir);
    ps_ckpt c, d;
    s_make(&c, &r);
    ps_ckpt_path(dir, 1, path, sizeof path);
    cr_assert_eq(ps_ckpt_read(path, &d, why, sizeof why), ZPS_ERR_NOT_FOUND);
    cr_assert_eq(ps_ckpt_write(dir, 1, &c), ZPS_OK);
    cr_assert_eq(ps_ckpt_read(path, &d, why, sizeof why), ZPS_OK, "%s", why);
    cr_assert_eq(d.plan_hash, c.plan_hash);
    cr_assert_eq(d.n_local, 3);
    cr_assert_eq(d.chunks[2].key, 5);
    cr_assert_eq(d.chunks[2].version, 42);
    cr_assert_eq(d.local_total, c.local_total);
    cr_assert(!memcmp(d.values, c.values, c.local_total * 4), "seed %llu", (unsigned long long)seed);
    cr_assert(!memcmp(d.slots, c.slots, 2 * c.local_total * 4));
    cr_assert_eq(d.opt_len, 5);
    ps_ckpt_free(&d);
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s/.server-1.ckpt.tmp", dir);
    cr_assert_neq(access(tmp, F_OK), 0, "temporary file left behind");

    struct stat sb;
    cr_assert_eq(stat(path, &sb), 0);
    unsigned char *all = zps_xmalloc((size_t)sb.st_size);
    FILE *f = fopen(path, "rb");
    cr_assert_eq(fread(all, 1, (size_t)sb.st_size, f), (size_t)sb.st_size);
    fclose(f);
    const off_t cuts[] = {0, 5, 40, 100, sb.st_size / 2, sb.st_size - 1};
    for (int k = 0; k < 6; k++) {
        f = fopen(path, "wb");
        fwrite(all, 1, (size_t)cuts[k], f);
        fclose(f);
        cr_assert_eq(ps_ckpt_read(path, &d, why, sizeof why), ZPS_ERR_CORRUPT, "cut at %lld",
                     (long long)cuts[k]);
        cr_assert(why[0]);
    }
    for (int k = 0; k < 8; k++) {
        off_t at = (off_t)((pst_uniform(&r) + 1.0f) * 0.5f * (float)(sb.st_size - 1));
        all[at] ^= (unsigned char)(1u << k);
        f = fopen(path, "wb");
        fwrite(all, 1, (size_t)sb.st_size, f);
        fclose(f);
        cr_assert_eq(ps_ckpt_read(path, &d, why, sizeof why), ZPS_ERR_CORRUPT,
                     "bit %d at %lld not detected (seed %llu)", k, (long long)at, (unsigned long long)seed);
        all[at] ^= (unsigned char)(1u << k);
    }
    f = fopen(path, "wb");
    fputs("this is not a checkpoint at all, just some text of a plausible length\n", f);
    fclose(f);
    cr_assert_eq(ps_ckpt_read(path, &d, why, sizeof why), ZPS_ERR_CORRUPT);
    /* a checkpoint path that cannot be read is an I/O error with its reason, not corruption */
    cr_assert_eq(ps_ckpt_read(dir, &d, why, sizeof why), ZPS_ERR_IO, "%s", why);
    cr_assert_not_null(strstr(why, "cannot read it: Is a directory"), "%s", why);
    free(all);
    free(c.chunks);
    zps_aligned_free(c.values);
    zps_aligned_free(c.slots);
    free(c.opt);
    pst_rmdir(dir);
}

/* Versioned files (sync recovery): each is the checkpoint of its version, the `keep`
 * newest stay, the newest is found by number (not by name order), and drop_after removes
 * the versions of an abandoned timeline. */
Test(ps_ckpt, versioned_files_keep_the_newest)
{
    uint64_t r = pst_seed(), v;
    char dir[256], path[512], why[256];
    pst_tmpdir(dir, sizeof dir);
    ps_ckpt c, d;
    s_make(&c, &r);
    cr_assert_eq(ps_ckpt_newest_version(dir, 1, &v), ZPS_ERR_NOT_FOUND);
    const uint64_t vs[] = {0, 5, 10, 95, 100};
    for (int k = 0; k < 5; k++) {
        c.chunks[0].version = vs[k];
        cr_assert_eq(ps_ckpt_write(dir, 1, &c), ZPS_OK);
        cr_assert_eq(ps_ckpt_keep_version(dir, 1, vs[k], 3), ZPS_OK);
    }
    cr_assert_eq(ps_ckpt_newest_version(dir, 1, &v), ZPS_OK);
    cr_assert_eq(v, 100);
    cr_assert_eq(ps_ckpt_newest_version(dir, 0, &v), ZPS_ERR_NOT_FOUND, "server 0 has none");
    for (int k = 0; k < 5; k++) {
        ps_ckpt_version_path(dir, 1, vs[k], path, sizeof path);
        zps_status st = ps_ckpt_read(path, &d, why, sizeof why);
        cr_assert_eq(st, k < 2 ? ZPS_ERR_NOT_FOUND : ZPS_OK, "version %llu: %s",
                     (unsigned long long)vs[k], why);
        if (st == ZPS_OK) {
            cr_assert_eq(d.chunks[0].version, vs[k]);
            ps_ckpt_free(&d);
        }
    }
    ps_ckpt_drop_after(dir, 1, 10);
    cr_assert_eq(ps_ckpt_newest_version(dir, 1, &v), ZPS_OK);
    cr_assert_eq(v, 10);
    free(c.chunks);
    zps_aligned_free(c.values);
    zps_aligned_free(c.slots);
    free(c.opt);
    pst_rmdir(dir);
}
