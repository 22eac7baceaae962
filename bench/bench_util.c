/* bench_util.c — helpers every benchmark shares (bench.h): where its JSON goes. */
#include <stdio.h>

#include "bench/bench.h"

FILE *bench_json_open(const char *bench, const char *name, char *path, size_t len)
{
    snprintf(path, len, "%s/%s", bench_out_dir(), name);
    FILE *f = fopen(path, "w");
    if (!f)
        fprintf(stderr, "%s: cannot write %s\n", bench, path);
    return f;
}
