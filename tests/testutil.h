/* testutil.h — small helpers shared by the Criterion tests.
 *
 * Criterion quirks learnt here: cr_log_warn() makes the run exit 1 even when every test
 * passes, and cr_skip_test()'s message is only shown with --verbose. So a test that cannot
 * run (no GPU) prints its reason on stderr itself and then skips: ZPS_TEST_SKIP. */
#ifndef ZPS_TESTS_TESTUTIL_H
#define ZPS_TESTS_TESTUTIL_H

#include <criterion/criterion.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define ZPS_TEST_SKIP(...)                                                             \
    do {                                                                               \
        fprintf(stderr, "[SKIP] %s:%d: ", __FILE__, __LINE__);                          \
        fprintf(stderr, __VA_ARGS__);                                                  \
        fputc('\n', stderr);                                                           \
        cr_skip_test("skipped");                                                       \
    } while (0)

/* A GPU test that cannot run: SKIP as above, except under the GPU suite (`make test-gpu`
 * sets ZPS_REQUIRE_GPU=1), where a missing device or library is a failure, not a skip. */
#define ZPS_GPU_SKIP(...)                                                              \
    do {                                                                               \
        const char *req_ = getenv("ZPS_REQUIRE_GPU");                                  \
        if (req_ && *req_ && *req_ != '0') {                                           \
            fprintf(stderr, "[FAIL] GPU required (ZPS_REQUIRE_GPU): ");                 \
            fprintf(stderr, __VA_ARGS__);                                              \
            fputc('\n', stderr);                                                       \
            cr_assert_fail("GPU test could not run under ZPS_REQUIRE_GPU");           \
        }                                                                              \
        ZPS_TEST_SKIP(__VA_ARGS__);                                                    \
    } while (0)

/* Seeded test randomness (tests/test_util.c): zt_seed_init() takes $ZPS_TEST_SEED, else a
 * fresh seed from the time and pid, and returns it so failures can print it; zt_rand() is
 * xorshift over that state. One stream per test process (Criterion forks each test). */
uint64_t zt_seed_init(void);
uint32_t zt_rand(void);
/* Uniform in [lo, hi] on a grid of 1e-6 of the range. */
float zt_unif(float lo, float hi);
/* Uniform integer in [lo, hi]. */
int zt_irand(int lo, int hi);

/* A fresh directory /tmp/<prefix>-XXXXXX into dir (asserts); zt_rmtmp removes it and all
 * below it, or keeps it and says so when ZPS_TEST_KEEP is set (a failed run's logs). */
void zt_mktmp(char *dir, size_t len, const char *prefix);
void zt_rmtmp(const char *dir);
/* Captures this process's stderr into dir/stderr.txt (log lines carry shard and key names)
 * until zt_capture_end, which restores stderr, echoes the text and returns it (free it). */
void zt_capture_begin(const char *dir);
char *zt_capture_end(void);

/* Flips the bits of mask in byte `at` (modulo the value's length) of the record under key
 * idx in an LMDB shard directory, committing the change: a corrupt record for tests. */
void zt_shard_corrupt(const char *shard_dir, uint64_t idx, size_t at, uint8_t mask);

/* 1 when a line of the file at path holds what (0 when it cannot be opened). Opening a FIFO
 * blocks until its writer opens it; reading it then waits for lines (the writer is the
 * synchronisation). */
int zt_file_has(const char *path, const char *what);

/* argv for $ZPS_BIN/<prog> (build/bin without it) with args (NULL-terminated): path
 * receives the program's path, argv (64 entries) path then args then NULL. */
void zt_bin_argv(const char *prog, const char *const *args, char *path, size_t len,
                 const char **argv);

/* Runs $ZPS_BIN/<prog> (build/bin without it) with args (NULL-terminated) and the "NAME=value"
 * strings of env (NULL-terminated, or NULL), stdout and stderr into log_path; waits at most
 * timeout_s, then kills it and fails. Asserts it exited normally; echoes the output to
 * stderr; returns the exit status, and the output in *out (caller frees). */
int zt_run(const char *prog, const char *const *args, const char *const *env,
           const char *log_path, double timeout_s, char **out);

/* Fashion-MNIST (the first `limit` images of each split) in `shards` LMDB shards at
 * out_dir, by zps-data convert; its log in log_path; asserts it succeeded. */
void zt_make_fashion(const char *out_dir, int limit, int shards, const char *log_path);

/* Python references (tests/ref/) exchange raw little-endian arrays through files:
 * zt_write_file writes n bytes; zt_read_f64 reads exactly n doubles (asserts the length;
 * caller frees). zt_python runs /usr/bin/python3 $ZPS_ROOT/<script> with args
 * (NULL-terminated, at most 30) and asserts it exited 0, naming `needs` on failure;
 * zt_have_torch is 1 when that python imports torch and torchvision. */
void zt_write_file(const char *path, const void *p, size_t n);
double *zt_read_f64(const char *path, size_t n);
void zt_python(const char *script, const char *const *args, const char *needs);
int zt_have_torch(void);

/* zt_run with its output in a temporary file, removed afterwards. */
int zt_run_tmp(const char *prog, const char *const *args, const char *const *env,
               double timeout_s, char **out);
/* Occurrences of what in s (not overlapping). */
int zt_count(const char *s, const char *what);

/* Flag-parser tests: argv = {prog, args..., NULL} (args NULL-terminated, at most cap - 2 of
 * them); returns argc. */
int zt_argv(const char *prog, const char *const *args, char **argv, int cap);
/* What the program wrote to Criterion's redirected stream f (cr_get_redirected_stdout() or
 * _stderr()) since the last call, NUL-terminated, at most n - 1 bytes. */
void zt_read_redirected(FILE *f, char *buf, size_t n);

/* Test programs run by absolute path: zt_run and zt_bin_argv take prog as it is when it
 * starts with '/'. The Python of scripts/py-venv ($ZPS_PYTHON, which make test sets; else
 * $ZPS_ROOT/build/py-venv/bin/python) when it imports modules ("safetensors, torch"),
 * else NULL with the reason in why (for cr_skip_test). */
const char *zt_py_venv(const char *modules, char *why, size_t n);

#endif
