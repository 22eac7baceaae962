/* bench.h — how benchmark programs plug into zps-bench.
 *
 * Each bench/<name>.c registers its subcommands with ZPS_BENCH(name, help) and needs no
 * change anywhere else: `zps-bench NAME [args]` runs it, `zps-bench --help` lists them all.
 * A benchmark prints its figures and writes JSON under the directory from bench_out_dir()
 * ($ZPS_BENCH_DIR, default build/bench). Compare against a peer in the same run, quote
 * medians.
 */
#ifndef ZPS_BENCH_BENCH_H
#define ZPS_BENCH_BENCH_H

#include <stddef.h>
#include <stdio.h>

#include "common/opts.h"

typedef int (*bench_fn)(int argc, char **argv);

void bench_register(const char *name, bench_fn fn, const char *help);

#define ZPS_BENCH(name, help)                                                          \
    static int s_bench_##name(int argc, char **argv);                                 \
    __attribute__((constructor)) static void s_bench_reg_##name(void)                 \
    {                                                                                  \
        bench_register(#name, s_bench_##name, help);                                   \
    }                                                                                  \
    static int s_bench_##name(int argc, char **argv)

/* The zps_opts of benchmark NAME (a string literal) whose flags table fills settings struct
 * T, defaulted by defaults_fn: every benchmark's messages start "zps-bench NAME" and its
 * help "usage: zps-bench NAME [options]". more_help: NULL or what follows the flags. */
#define BENCH_OPTS(name, T, table, defaults_fn, more)                                  \
    {.prog = "zps-bench " name, .usage = "usage: zps-bench " name " [options]\n",     \
     .opt = (table), .cfg_size = sizeof(T), .defaults = (defaults_fn), .more_help = (more)}

/* Fills cfg with the benchmark's defaults and parses its flags (argv[0] is its name) with
 * its table; a refused flag is one line on stderr (common/opts.h). -1 to go on, else
 * the exit code: 0 after --help, 2 (usage) after a refusal. */
int bench_opts_parse(const zps_opts *o, void *cfg, int argc, char **argv);
/* Output directory for JSON (created when missing). */
const char *bench_out_dir(void);
/* Opens bench_out_dir()/name for writing, its path into path (len bytes). NULL, after
 * "zps-bench BENCH: cannot write PATH" on stderr, when it cannot. */
FILE *bench_json_open(const char *bench, const char *name, char *path, size_t len);
/* The whole command line of zps-bench (main's argv), for a benchmark that re-executes it
 * (common/omp_env.h); bench_set_argv is main's. */
void bench_set_argv(char **argv);
char **bench_argv(void);
/* The machine's 1-minute load average (/proc/loadavg) into *load; -1 when unreadable. */
int bench_loadavg(double *load);
/* 1 when load is above the cores online: a figure taken then is not to be trusted. */
int bench_busy(double load);
/* Runs the peer scripts/SCRIPT ARGS under Debian's /usr/bin/python3 (from $ZPS_ROOT, else
 * the working directory) and keeps its stdout in out (cap bytes, NUL-ended). 0, or -1
 * after logging why (it did not start, or exited non-zero). */
int bench_peer(const char *script, const char *args, char *out, size_t cap);
/* The numbers after each "KEY": in the JSON text js, in order, into v (at most n); how
 * many there were. */
int bench_json_numbers(const char *js, const char *key, double *v, int n);
/* Median of n doubles (sorts v in place). n > 0. */
double bench_median(double *v, size_t n);
/* p-th percentile (0..100) of n doubles, nearest rank (sorts v in place). n > 0. */
double bench_percentile(double *v, size_t n, double p);

#endif
