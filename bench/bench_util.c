/* bench_util.c — helpers every benchmark shares (bench.h): its flags, where its JSON goes. */
#include <stdio.h>

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
