/* bench_main.c — zps-bench: runs one registered benchmark (bench.h) or `env`. Its own flags
 * and env's are flag tables (common/opts.h); each benchmark parses the flags after its name
 * with its own table (bench_opts_parse). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench/bench.h"
#include "common/log.h"
#include "common/opts.h"
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

static void s_list_help(FILE *f)
{
    fprintf(f, "\nbenchmarks (JSON goes to $ZPS_BENCH_DIR, default build/bench; NAME --help for\n"
               "their flags):\n  %-12s %s\n",
            "env", "report the optional parts found (CUDA library, devices)");
    for (int i = 0; i < s_n; i++)
        fprintf(f, "  %-12s %s\n", s_benches[i].name, s_benches[i].help);
}

/* zps-bench's own flags, before the benchmark's name. */
typedef struct s_top {
    int list; // --list: print the benchmarks' names
} s_top;

static void s_top_defaults(void *p) { memset(p, 0, sizeof(s_top)); }

static const zps_opt s_top_opt[] = {
    {"list", ZPS_OPT_SET, ZPS_OPT_FIELD(s_top, list), .help = "print the benchmarks' names"},
    ZPS_OPT_LOG_LEVEL,
    {.type = ZPS_OPT_END},
};

static const zps_opts s_top_spec = {
    .prog = "zps-bench",
    .usage = "usage: zps-bench [options] NAME [the benchmark's flags]\n",
    .opt = s_top_opt,
    .cfg_size = sizeof(s_top),
    .defaults = s_top_defaults,
    .in_order = 1,
    .more_help = s_list_help,
};

/* `env`'s flags. */
typedef struct s_env_cfg {
    char device[16]; // the device to select
} s_env_cfg;

static void s_env_defaults(void *p) { snprintf(((s_env_cfg *)p)->device, 16, "auto"); }

static const zps_opt_name s_devices[] = {{"auto", 0}, {"cpu", 0}, {"cuda", 0}, {NULL, 0}};

static const zps_opt s_env_opt[] = {
    {"device", ZPS_OPT_STRING, ZPS_OPT_FIELD(s_env_cfg, device), .names = s_devices,
     .help = "the device to select, as zps-trainer does"},
    {.type = ZPS_OPT_END},
};

static const zps_opts s_env_spec =
    BENCH_OPTS("env", s_env_cfg, s_env_opt, s_env_defaults, NULL);

static int s_env(int argc, char **argv)
{
    s_env_cfg c;
    int code = bench_opts_parse(&s_env_spec, &c, argc, argv);
    if (code >= 0)
        return code;
    k_device_info info;
    zps_status st = k_device_select(c.device, &info);
    printf("device: %s (%s)\n", info.kind == K_DEVICE_CUDA ? "cuda" : "cpu", info.reason);
    printf("cuda_devices: %d\n", info.cuda_devices);
    char why[320] = "", msg[256] = "";
    const k_cuda_lib *lib = info.cuda_devices > 0 ? k_device_cuda_lib(why, sizeof why) : NULL;
    int v = 0;
    if (lib && lib->nccl_version(&v, msg, sizeof msg) == 0)
        printf("nccl: %d.%d.%d\n", v / 10000, v / 100 % 100, v % 100);
    else if (lib)
        printf("nccl: unknown (%s)\n", msg);
    return st == ZPS_OK ? 0 : 1;
}

int main(int argc, char **argv)
{
    zps_log_init("bench", -1);
    bench_set_argv(argv);
    s_top top;
    s_top_defaults(&top);
    int i, code;
    if (zps_opts_parse(&s_top_spec, &top, argc, argv, &i, &code) != ZPS_OK || code >= 0)
        return code;
    if (top.list) {
        for (int k = 0; k < s_n; k++)
            printf("%s\n", s_benches[k].name);
        return 0;
    }
    if (i == argc) {
        zps_opts_usage(&s_top_spec, stderr);
        return 2;
    }
    if (!strcmp(argv[i], "env"))
        return s_env(argc - i, argv + i);
    for (int k = 0; k < s_n; k++)
        if (!strcmp(argv[i], s_benches[k].name))
            return s_benches[k].fn(argc - i, argv + i);
    char names[512] = "env";
    for (int k = 0; k < s_n; k++)
        snprintf(names + strlen(names), sizeof names - strlen(names), ", %s", s_benches[k].name);
    zps_opts_fail(&s_top_spec, &code, "unknown benchmark '%s'; benchmarks: %s", argv[i], names);
    return code;
}
