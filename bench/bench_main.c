/* bench_main.c — zps-bench: runs one registered benchmark (bench.h) or `env`. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench/bench.h"
#include "common/log.h"
#include "kernels/device.h"

#define S_MAX 32
static struct {
    const char *name;
    bench_fn fn;
    const char *help;
} s_benches[S_MAX];
static int s_n;

void bench_register(const char *name, bench_fn fn, const char *help)
{
    if (s_n == S_MAX) {
        fprintf(stderr, "zps-bench: too many benchmarks (raise S_MAX)\n");
        abort();
    }
    s_benches[s_n].name = name;
    s_benches[s_n].fn = fn;
    s_benches[s_n].help = help;
    s_n++;
}

const char *bench_out_dir(void)
{
    const char *d = getenv("ZPS_BENCH_DIR");
    if (!d || !*d)
        d = "build/bench";
    mkdir(d, 0755);
    return d;
}

static int s_cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_median(double *v, size_t n)
{
    qsort(v, n, sizeof *v, s_cmp);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double bench_percentile(double *v, size_t n, double p)
{
    qsort(v, n, sizeof *v, s_cmp);
    size_t rank = (size_t)(p / 100.0 * (double)n + 0.999999);
    if (rank < 1)
        rank = 1;
    if (rank > n)
        rank = n;
    return v[rank - 1];
}

static void s_usage(FILE *f)
{
    fprintf(f, "usage: zps-bench [--log-level L] NAME [args]\n"
               "       zps-bench --list\n"
               "       zps-bench NAME --help\n\n"
               "benchmarks (JSON goes to $ZPS_BENCH_DIR, default build/bench):\n"
               "  %-12s %s\n",
            "env", "report the optional parts found (CUDA library, devices)");
    for (int i = 0; i < s_n; i++)
        fprintf(f, "  %-12s %s\n", s_benches[i].name, s_benches[i].help);
}

static int s_env(int argc, char **argv)
{
    const char *want = "auto";
    static const struct option opts[] = {{"device", required_argument, 0, 'd'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        if (c == 'd')
            want = optarg;
        else {
            fprintf(c == 'h' ? stdout : stderr,
                    "usage: zps-bench env [--device auto|cpu|cuda]\n");
            return c == 'h' ? 0 : 2;
        }
    }
    k_device_info info;
    zps_status st = k_device_select(want, &info);
    printf("device: %s (%s)\n", info.kind == K_DEVICE_CUDA ? "cuda" : "cpu", info.reason);
    printf("cuda_devices: %d\n", info.cuda_devices);
    return st == ZPS_OK ? 0 : 1;
}

int main(int argc, char **argv)
{
    zps_log_init("bench", -1);
    int i = 1;
    for (; i < argc && argv[i][0] == '-' && strcmp(argv[i], "--list"); i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            s_usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--log-level") && i + 1 < argc) {
            if (zps_log_set_level_str(argv[++i]) != ZPS_OK) {
                fprintf(stderr, "zps-bench: bad --log-level '%s'\n", argv[i]);
                return 2;
            }
            continue;
        }
        fprintf(stderr, "zps-bench: unknown option %s\n", argv[i]);
        s_usage(stderr);
        return 2;
    }
    if (i == argc) {
        s_usage(stderr);
        return 2;
    }
    if (!strcmp(argv[i], "--list")) {
        for (int k = 0; k < s_n; k++)
            printf("%s\n", s_benches[k].name);
        return 0;
    }
    if (!strcmp(argv[i], "env"))
        return s_env(argc - i, argv + i);
    for (int k = 0; k < s_n; k++)
        if (!strcmp(argv[i], s_benches[k].name)) {
            optind = 1;
            return s_benches[k].fn(argc - i, argv + i);
        }
    fprintf(stderr, "zps-bench: unknown benchmark '%s'\n", argv[i]);
    s_usage(stderr);
    return 2;
}
