/* bench_util.c — helpers every benchmark shares (bench.h): its flags, where its JSON goes,
 * whether the machine was busy. */
#include <stdio.h>
#include <unistd.h>

#include "bench/bench.h"

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
