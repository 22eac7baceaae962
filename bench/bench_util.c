/* bench_util.c — helpers every benchmark shares (bench.h): its flags, where its JSON goes,
 * whether the machine was busy, running a Python peer. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench.h"
#include "common/log.h"

int bench_opts_parse(const zps_opts *o, void *cfg, int argc, char **argv)
{
    o->defaults(cfg);
    int first, code;
    zps_opts_parse(o, cfg, argc, argv, &first, &code);
    return code;
}

FILE *bench_json_open(const char *bench, const char *name, char *path, size_t len)
{
    snprintf(path, len, "%s/%s", bench_out_dir(), name);
    FILE *f = fopen(path, "w");
    if (!f)
        fprintf(stderr, "zps-bench %s: cannot write %s\n", bench, path);
    return f;
}

static char **s_argv;

void bench_set_argv(char **argv) { s_argv = argv; }

char **bench_argv(void) { return s_argv; }

int bench_loadavg(double *load)
{
    FILE *f = fopen("/proc/loadavg", "r");
    if (!f)
        return -1;
    int ok = fscanf(f, "%lf", load) == 1;
    fclose(f);
    return ok ? 0 : -1;
}

int bench_busy(double load)
{
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    return cores > 0 && load > (double)cores;
}

int bench_peer(const char *script, const char *args, char *out, size_t cap)
{
    const char *root = getenv("ZPS_ROOT");
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 %s/scripts/%s %s", root && *root ? root : ".",
             script, args);
    out[0] = 0;
    FILE *p = popen(cmd, "r");
    if (!p) {
        zps_log(ZPS_ERROR, "bench", "cannot run %s", cmd);
        return -1;
    }
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    if (st != 0) {
        zps_log(ZPS_ERROR, "bench", "the peer failed (status %d): %s", st, cmd);
        return -1;
    }
    return 0;
}

int bench_json_numbers(const char *js, const char *key, double *v, int n)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\":", key);
    size_t pl = strlen(pat);
    int k = 0;
    for (const char *at = strstr(js, pat); at && k < n; at = strstr(at + pl, pat))
        v[k++] = strtod(at + pl, NULL);
    return k;
}
