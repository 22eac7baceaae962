/* test_util.c — the shared test helpers declared in testutil.h (no tests of its own). */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <lmdb.h>
#include <signal.h>
#include <sys/wait.h>
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
    if (getenv("ZPS_TEST_KEEP")) { /* a failure's logs and run folders, for a look */
        fprintf(stderr, "ZPS_TEST_KEEP: kept %s\n", dir);
        return;
    }
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

void zt_bin_argv(const char *prog, const char *const *args, char *path, size_t len,
                 const char **argv)
{
    const char *bin = getenv("ZPS_BIN");
    if (prog[0] == '/')
        snprintf(path, len, "%s", prog);
    else
        snprintf(path, len, "%s/%s", bin ? bin : "build/bin", prog);
    argv[0] = path;
    int n = 1;
    for (; args[n - 1] && n < 63; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
}

int zt_run(const char *prog, const char *const *args, const char *const *env,
           const char *log_path, double timeout_s, char **out)
{
    char exe[512];
    const char *argv[64];
    zt_bin_argv(prog, args, exe, sizeof exe, argv);
    pid_t pid = fork();
    cr_assert(pid >= 0, "fork failed");
    if (pid == 0) {
        int fd = open(log_path, O_CREAT | O_TRUNC | O_WRONLY, 0644);
        if (fd < 0)
            _exit(126);
        dup2(fd, 1);
        dup2(fd, 2);
        for (int i = 0; env && env[i]; i++)
            putenv((char *)env[i]);
        execv(exe, (char *const *)argv);
        _exit(127);
    }
    int status = 0;
    struct timespec t0, now, nap = {0, 20 * 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    pid_t w;
    for (;;) {
        w = waitpid(pid, &status, WNOHANG);
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (w != 0 || (double)(now.tv_sec - t0.tv_sec) + 1e-9 * (double)(now.tv_nsec - t0.tv_nsec) > timeout_s)
            break;
        nanosleep(&nap, NULL); // polling a bounded wait for the child to exit
    }
    if (w == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        cr_assert_fail("%s did not finish within %.0f s", prog, timeout_s);
    }
    FILE *f = fopen(log_path, "r");
    cr_assert_not_null(f, "no output file %s", log_path);
    *out = calloc(1, 1 << 20);
    cr_assert_not_null(*out);
    size_t got = fread(*out, 1, (1 << 20) - 1, f);
    (*out)[got] = 0;
    fclose(f);
    fprintf(stderr, "%s", *out);
    cr_assert(WIFEXITED(status), "%s did not exit normally (status %d)", prog, status);
    return WEXITSTATUS(status);
}

int zt_run_tmp(const char *prog, const char *const *args, const char *const *env,
               double timeout_s, char **out)
{
    char log[64] = "/tmp/zps-run-XXXXXX";
    int fd = mkstemp(log);
    cr_assert(fd >= 0, "mkstemp failed");
    close(fd);
    int rc = zt_run(prog, args, env, log, timeout_s, out);
    unlink(log);
    return rc;
}

int zt_count(const char *s, const char *what)
{
    int n = 0;
    for (size_t len = strlen(what); (s = strstr(s, what)) != NULL; s += len)
        n++;
    return n;
}

int zt_argv(const char *prog, const char *const *args, char **argv, int cap)
{
    int argc = 0;
    argv[argc++] = (char *)prog;
    for (int i = 0; args[i]; i++) {
        cr_assert_lt(argc, cap - 1, "more than %d arguments", cap - 2);
        argv[argc++] = (char *)args[i];
    }
    argv[argc] = NULL;
    return argc;
}

void zt_read_redirected(FILE *f, char *buf, size_t n)
{
    fflush(stdout);
    fflush(stderr);
    size_t got = fread(buf, 1, n - 1, f);
    buf[got] = 0;
}

int zt_file_has(const char *path, const char *what)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[4096];
    int found = 0;
    while (!found && fgets(line, sizeof line, f))
        found = strstr(line, what) != NULL;
    fclose(f);
    return found;
}

void zt_make_fashion(const char *out_dir, int limit, int shards, const char *log_path)
{
    char l[32], sh[32], *out = NULL;
    snprintf(l, sizeof l, "%d", limit);
    snprintf(sh, sizeof sh, "%d", shards);
    const char *args[] = {"convert", "fashion-mnist", "--out", out_dir, "--limit", l,
                          "--shards", sh, NULL};
    cr_assert_eq(zt_run("zps-data", args, NULL, log_path, 120, &out), 0,
                 "zps-data convert failed (see %s)", log_path);
    free(out);
}

const char *zt_py_venv(const char *modules, char *why, size_t n)
{
    static char py[4096];
    const char *env = getenv("ZPS_PYTHON"), *root = getenv("ZPS_ROOT");
    if (env && env[0])
        snprintf(py, sizeof py, "%s", env);
    else
        snprintf(py, sizeof py, "%s/build/py-venv/bin/python", root ? root : ".");
    if (access(py, X_OK) != 0) {
        snprintf(why, n, "no Python environment at %s (make py-venv makes it: "
                 "scripts/py-venv)", py);
        return NULL;
    }
    char code[512];
    snprintf(code, sizeof code, "import %s", modules);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0)
            dup2(fd, 1), dup2(fd, 2);
        execl(py, py, "-c", code, (char *)NULL);
        _exit(127);
    }
    int st = -1;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        snprintf(why, n, "%s cannot import %s (make py-venv installs them: scripts/py-venv)",
                 py, modules);
        return NULL;
    }
    return py;
}

void zt_write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f, "cannot write %s", path);
    cr_assert_eq(fwrite(p, 1, n, f), n);
    cr_assert_eq(fclose(f), 0);
}

double *zt_read_f64(const char *path, size_t n)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "reference output %s missing", path);
    double *v = malloc((n ? n : 1) * sizeof *v);
    size_t got = fread(v, sizeof *v, n, f);
    char extra;
    cr_assert_eq(got, n, "%s: %zu values, want %zu", path, got, n);
    cr_assert_eq(fread(&extra, 1, 1, f), 0u, "%s longer than expected", path);
    fclose(f);
    return v;
}

void zt_python(const char *script, const char *const *args, const char *needs)
{
    const char *root = getenv("ZPS_ROOT");
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", root ? root : ".", script);
    const char *argv[33] = {"python3", path};
    int n = 2;
    for (; args[n - 2]; n++) {
        cr_assert(n < 32, "too many arguments for %s", script);
        argv[n] = args[n - 2];
    }
    argv[n] = NULL;
    pid_t pid = fork();
    cr_assert(pid >= 0, "fork failed");
    if (pid == 0) {
        execv("/usr/bin/python3", (char *const *)argv);
        _exit(127);
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s failed (status %d); needs %s",
              path, status, needs);
}

int zt_have_torch(void)
{
    return system("/usr/bin/python3 -c 'import torch, torchvision' >/dev/null 2>&1") == 0;
}
