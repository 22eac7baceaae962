/* test_util.c — the shared test helpers declared in testutil.h (no tests of its own). */
#include <fcntl.h>
#include <lmdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "datasets/shard.h"
#include "tests/testutil.h"

static uint64_t s_state = 1;

uint64_t zt_seed_init(void)
{
    const char *e = getenv("ZPS_TEST_SEED");
    uint64_t seed = e ? strtoull(e, NULL, 0)
                      : ((uint64_t)time(NULL) * 2654435761u) ^ ((uint64_t)getpid() << 16);
    s_state = seed | 1;
    return seed;
}

uint32_t zt_rand(void)
{
    s_state ^= s_state << 13;
    s_state ^= s_state >> 7;
    s_state ^= s_state << 17;
    return (uint32_t)(s_state >> 16);
}

float zt_unif(float lo, float hi) { return lo + (hi - lo) * (float)(zt_rand() % 1000001) / 1e6f; }

int zt_irand(int lo, int hi) { return lo + (int)(zt_rand() % (uint32_t)(hi - lo + 1)); }

void zt_mktmp(char *dir, size_t len, const char *prefix)
{
    snprintf(dir, len, "/tmp/%s-XXXXXX", prefix);
    cr_assert_not_null(mkdtemp(dir), "mkdtemp %s", dir);
}

void zt_rmtmp(const char *dir)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_assert_eq(system(cmd), 0);
}

static int s_saved_fd = -1;
static char s_cap_path[600];

void zt_capture_begin(const char *dir)
{
    fflush(stderr);
    snprintf(s_cap_path, sizeof s_cap_path, "%s/stderr.txt", dir);
    int fd = open(s_cap_path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
    cr_assert(fd >= 0);
    s_saved_fd = dup(2);
    dup2(fd, 2);
    close(fd);
}

char *zt_capture_end(void)
{
    fflush(stderr);
    dup2(s_saved_fd, 2);
    close(s_saved_fd);
    FILE *f = fopen(s_cap_path, "r");
    cr_assert_not_null(f);
    char *buf = calloc(1, 1 << 16);
    cr_assert_not_null(buf);
    size_t n = fread(buf, 1, (1 << 16) - 1, f);
    buf[n] = 0;
    fclose(f);
    fputs(buf, stderr);
    return buf;
}

void zt_shard_corrupt(const char *shard_dir, uint64_t idx, size_t at, uint8_t mask)
{
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    cr_assert_eq(mdb_env_create(&env), 0);
    cr_assert_eq(mdb_env_open(env, shard_dir, 0, 0644), 0, "cannot open %s", shard_dir);
    cr_assert_eq(mdb_txn_begin(env, NULL, 0, &txn), 0);
    cr_assert_eq(mdb_dbi_open(txn, NULL, 0, &dbi), 0);
    char key[DS_KEY_LEN + 1];
    ds_key_format(idx, key);
    MDB_val k = {.mv_size = DS_KEY_LEN, .mv_data = key}, v;
    cr_assert_eq(mdb_get(txn, dbi, &k, &v), 0, "no key %s in %s", key, shard_dir);
    uint8_t *copy = malloc(v.mv_size);
    cr_assert_not_null(copy);
    memcpy(copy, v.mv_data, v.mv_size);
    copy[at % v.mv_size] ^= mask;
    MDB_val nv = {.mv_size = v.mv_size, .mv_data = copy};
    cr_assert_eq(mdb_put(txn, dbi, &k, &nv, 0), 0);
    cr_assert_eq(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    free(copy);
}
