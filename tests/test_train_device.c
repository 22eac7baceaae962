/* test_train_device.c — the trainer on a device back-end, end to end (real zps-trainer and
 * zps-server processes on 127.0.0.1): suite it_staged without a GPU, it_gpu on one.
 *
 * `--device staged` runs cpu's ops with every tensor in memory of its own, reached only
 * through the back-end's copies, and asynchronous copies held back until an event after them
 * is waited for (kernels/cpu/staged.c). So a run there takes every path a GPU run takes
 * (pinned batch, device accumulator, local optimizer on the device, and for PS and all-reduce
 * the pinned mirrors, the per-layer copies and the staging thread of trainer/stage.c), and
 * any missing copy or wait shows as stale or NaN values. Each case trains the convnet for 20
 * steps on the cpu and on staged with the same seed and input and asserts that the exported
 * weights are the same file, byte for byte (OMP_NUM_THREADS=1: the same sums in the same
 * order on both), and that the runs moved the weights at all.
 *
 * it_gpu runs the same fleets with --device cuda (two trainer processes share the one GPU
 * where that is all there is) for 5 steps, with TF32 off (NVIDIA_TF32_OVERRIDE=0: cuDNN
 * and cuBLAS in full f32), and compares weight by weight within 1e-5 + 1e-3 |cpu| (the
 * tolerance of it_train's equivalences): cuDNN's algorithms sum in other orders. Without a
 * GPU they SKIP (the GPU suite requires them).
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels/kernels.h"
#include "tests/ps_test_util.h"
#include "tests/test_k.h"
#include "tests/train_test_util.h"
#include "tests/testutil.h"

static char s_tmp[512], s_data[600];

static void s_setup(void)
{
    pst_tmpdir(s_tmp, sizeof s_tmp);
    snprintf(s_data, sizeof s_data, "%s/fm", s_tmp);
    char log[700];
    snprintf(log, sizeof log, "%s/data.log", s_tmp);
    zt_make_fashion(s_data, 1024, 2, log);
    setenv("OMP_NUM_THREADS", "1", 1);
    setenv("NVIDIA_TF32_OVERRIDE", "0", 1);
}

static void s_cleanup(void)
{
    if (s_tmp[0])
        zt_rmtmp(s_tmp);
}

TestSuite(it_staged, .init = s_setup, .fini = s_cleanup, .timeout = 240);

static const char *s_common[] = {"--data", NULL, "--model", "convnet", "--steps", "20",
                                 "--shard", "batch", "--eval-batches", "1", "--no-progress",
                                 "--seed", "11", "--threads", "0", "--dropout", "0",
                                 "--batch-size", "16", "--lr", "0.05"};
enum { S_NC = sizeof s_common / sizeof s_common[0] };
static const char *s_steps = "20"; // it_gpu: 5

/* 1 when the two files hold the same bytes. */
static int s_same_file(const char *a, const char *b)
{
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    cr_assert(fa && fb, "cannot open %s or %s", a, b);
    int same = 1, ca, cb;
    do {
        ca = fgetc(fa), cb = fgetc(fb);
        same = ca == cb;
    } while (same && ca != EOF);
    fclose(fa);
    fclose(fb);
    return same;
}

/* A fleet of n trainers in mode (with servers when uris is set), on devices dev[r], each
 * with the extra args (NULL-terminated, or NULL); trainer 0 exports to out. Asserts every
 * trainer not on the cpu logged `want`. */
static void s_fleet(const char *tag, const char *mode, int n, const char *const *dev,
                    const char *uris, const char *const *extra, const char *out,
                    const char *want)
{
    const char *common[S_NC];
    memcpy(common, s_common, sizeof common);
    common[1] = s_data;
    common[5] = s_steps;
    pst_server t[2];
    char logs[2][700], id[2][4], num[4], job[64];
    snprintf(num, sizeof num, "%d", n);
    snprintf(job, sizeof job, "st%d%s", (int)getpid(), tag);
    for (int r = 0; r < n; r++) {
        snprintf(id[r], sizeof id[r], "%d", r);
        const char *more[40] = {"--mode", mode, "--device", dev[r], "--num-trainers", num,
                                "--trainer-id", id[r], "--job", job, "--export", out};
        int k = 12;
        if (uris)
            more[k++] = "--servers", more[k++] = uris;
        for (int e = 0; extra && extra[e]; e++)
            more[k++] = extra[e];
        more[k] = NULL;
        char name[32];
        snprintf(name, sizeof name, "%s-%d", tag, r);
        trt_trainer(&t[r], s_tmp, name, logs[r], sizeof logs[r], common, S_NC, more);
    }
    for (int r = 0; r < n; r++) {
        trt_expect_ok(&t[r], logs[r], 120);
        if (want && strcmp(dev[r], "cpu") != 0)
            cr_assert(zt_file_has(logs[r], want), "%s: trainer %d logged no '%s'", tag, r,
                      want);
    }
}

/* The same fleet on cpu and on the devices dev_b, with servers of smode when given, extra
 * args on both sides and extra_b on dev_b's only: the same weights, byte for byte where
 * exact, else within trt_compare's tolerance. */
static void s_same(const char *mode, int n, const char *smode, const char *const *extra,
                   const char *const *extra_b, const char *const *dev_b, int exact)
{
    static const char *cpu[2] = {"cpu", "cpu"};
    char a[700], b[700], init[700];
    snprintf(a, sizeof a, "%s/%s-cpu.w", s_tmp, mode);
    snprintf(b, sizeof b, "%s/%s-staged.w", s_tmp, mode);
    snprintf(init, sizeof init, "%s/init.w", s_tmp);
    const char *staged_line = strcmp(mode, "local") ? "pinned host mirrors" : "--device staged";
    if (strcmp(dev_b[0], "cuda") == 0)
        staged_line = "using CUDA device";
    for (int run = 0; run < 2; run++) {
        pst_server srv[2];
        char uris[600] = "";
        if (smode) { /* "MODE" or "MODE/T": the servers expect T trainers (default n) */
            char nt[8], sm[16];
            snprintf(sm, sizeof sm, "%s", smode);
            char *slash = strchr(sm, '/');
            snprintf(nt, sizeof nt, "%s", slash ? slash + 1 : "");
            if (slash)
                *slash = 0;
            else
                snprintf(nt, sizeof nt, "%d", n);
            const char *sargs[] = {"--mode", sm, "--num-trainers", nt, NULL};
            trt_servers(srv, sargs, uris, sizeof uris);
        }
        const char *args[16] = {0};
        int k = 0;
        for (int e = 0; extra && extra[e]; e++)
            args[k++] = extra[e];
        for (int e = 0; run && extra_b && extra_b[e]; e++)
            args[k++] = extra_b[e];
        s_fleet(run ? "b" : "a", mode, n, run ? dev_b : cpu, smode ? uris : NULL, args,
                run ? b : a, run ? staged_line : NULL);
        if (smode)
            for (int s = 0; s < 2; s++)
                pst_kill(&srv[s], SIGTERM);
    }
    /* the seeded start, to know that the runs trained */
    const char *common[S_NC];
    memcpy(common, s_common, sizeof common);
    common[1] = s_data;
    common[5] = s_steps;
    const char *zero[] = {"--mode", "local", "--lr", "0", "--export", init, NULL};
    pst_server p;
    char log[700];
    trt_trainer(&p, s_tmp, "init", log, sizeof log, common, S_NC, zero);
    trt_expect_ok(&p, log, 120);
    double moved = trt_max_diff(a, init);
    cr_assert(moved > 1e-3, "%s: %s steps moved no weight by more than %g", mode, s_steps,
              moved);
    if (exact)
        cr_assert(s_same_file(a, b), "%s: the weights trained on %s differ from the cpu's "
                  "(largest difference %g)", mode, dev_b[0], trt_max_diff(a, b));
    else
        trt_compare(a, b, mode);
}

static const char *s_staged2[2] = {"staged", "staged"};
static const char *s_accumulate[] = {"--accumulate", "2", NULL};

Test(it_staged, local_with_accumulation_equals_cpu)
{
    s_same("local", 1, NULL, s_accumulate, NULL, s_staged2, 1);
}

/* --precision bf16 on both sides: the device path changes no bit of bf16 training either. */
Test(it_staged, bf16_equals_cpu_bf16)
{
    static const char *bf16[] = {"--precision", "bf16", NULL};
    s_same("local", 1, NULL, bf16, NULL, s_staged2, 1);
}

/* The activation memory a run's trainer 0 reported (MiB; -1 when it said none). */
static double s_act_mib(const char *tag)
{
    char path[700], line[512];
    snprintf(path, sizeof path, "%s/%s-0.log", s_tmp, tag);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    double mib = -1;
    while (fgets(line, sizeof line, f)) {
        const char *at = strstr(line, "activations and their gradients: ");
        if (at)
            mib = strtod(at + strlen("activations and their gradients: "), NULL);
    }
    fclose(f);
    return mib;
}

/* --recompute on the device side only: gradient checkpointing changes no bit either, and
 * it did checkpoint (less activation memory than the cpu run's). */
Test(it_staged, recompute_equals_cpu_without)
{
    static const char *recompute[] = {"--recompute", NULL};
    s_same("local", 1, NULL, NULL, recompute, s_staged2, 1);
    double cpu = s_act_mib("a"), staged = s_act_mib("b");
    cr_assert(cpu > 0 && staged > 0 && staged < cpu,
              "activation memory with --recompute %.1f MiB, without %.1f MiB", staged, cpu);
}

Test(it_staged, sync_ps_fleet_equals_cpu)
{
    s_same("sync", 2, "sync", NULL, NULL, s_staged2, 1);
}

/* A node of two staged trainers (--node-trainers 2): the leader's PS back-end and the node's
 * all-reduce behind the mirrors; the servers see one trainer. */
Test(it_staged, node_sync_fleet_equals_cpu)
{
    static const char *node[] = {"--node-trainers", "2", NULL};
    s_same("sync", 2, "sync/1", node, NULL, s_staged2, 1);
}

/* One trainer of each kind in one sync fleet: the servers cannot tell them apart. */
Test(it_staged, mixed_sync_fleet_equals_cpu)
{
    static const char *mixed[2] = {"staged", "cpu"};
    s_same("sync", 2, "sync", NULL, NULL, mixed, 1);
}

/* --push-dtype bf16: the staged trainers round their gradients on the device (k_pack_bf16)
 * and push the bf16 mirror as it is; the cpu trainers round on the host as they push. Both
 * sync and async, one staged trainer beside a cpu one: the servers get the same bits. */
static void s_bf16_pushes(const char *mode, int n, const char *const *dev)
{
    static const char *bf16[] = {"--push-dtype", "bf16", NULL};
    s_same(mode, n, mode, bf16, NULL, dev, 1);
    char log[700];
    snprintf(log, sizeof log, "%s/b-0.log", s_tmp);
    cr_assert(zt_file_has(log, "values and bf16 gradients staged"),
              "%s: the staged trainer did not send bf16 from the device", mode);
}

Test(it_staged, bf16_pushes_leave_the_device_rounded)
{
    static const char *mixed[2] = {"staged", "cpu"};
    s_bf16_pushes("sync", 2, mixed);
    s_bf16_pushes("async", 1, s_staged2);
}

Test(it_staged, async_ps_equals_cpu)
{
    s_same("async", 1, "async", NULL, NULL, s_staged2, 1);
}

Test(it_staged, allreduce_fleet_equals_cpu)
{
    s_same("allreduce", 2, NULL, NULL, NULL, s_staged2, 1);
}

/* ---- on a GPU ---- */

static const char *s_cuda2[2] = {"cuda", "cuda"};

static void s_gpu_init(void)
{
    ZT_CUDA_OR_SKIP();
    s_setup();
    s_steps = "5";
}

TestSuite(it_gpu, .init = s_gpu_init, .fini = s_cleanup, .timeout = 300);

Test(it_gpu, local_with_accumulation_close_to_cpu)
{
    s_same("local", 1, NULL, s_accumulate, NULL, s_cuda2, 0);
}

Test(it_gpu, sync_ps_fleet_close_to_cpu)
{
    s_same("sync", 2, "sync", NULL, NULL, s_cuda2, 0);
}

Test(it_gpu, async_ps_close_to_cpu)
{
    s_same("async", 1, "async", NULL, NULL, s_cuda2, 0);
}

/* One rank: NCCL itself (two ranks on one GPU sum through the host, below). */
Test(it_gpu, allreduce_nccl_close_to_cpu)
{
    s_same("allreduce", 1, NULL, NULL, NULL, s_cuda2, 0);
}

Test(it_gpu, allreduce_fleet_close_to_cpu)
{
    s_same("allreduce", 2, NULL, NULL, NULL, s_cuda2, 0);
}

/* Recompute on the GPU: the same training within the tolerance, and less memory. */
Test(it_gpu, recompute_close_to_cpu_without)
{
    static const char *recompute[] = {"--recompute", NULL};
    s_same("local", 1, NULL, NULL, recompute, s_cuda2, 0);
    double cpu = s_act_mib("a"), cuda = s_act_mib("b");
    cr_assert(cpu > 0 && cuda > 0 && cuda < cpu,
              "activation memory with --recompute on cuda %.1f MiB, without on cpu %.1f MiB",
              cuda, cpu);
}

/* A node of two trainers sharing the GPU (--node-trainers 2): on a device its sums and the
 * leader's pushes overlap backward, bucket by bucket. */
Test(it_gpu, node_sync_fleet_close_to_cpu)
{
    static const char *node[] = {"--node-trainers", "2", NULL};
    s_same("sync", 2, "sync/1", node, NULL, s_cuda2, 0);
}

/* --push-dtype bf16: the gradients rounded on the GPU (k_pack_bf16) and pushed as they are. */
Test(it_gpu, bf16_pushes_close_to_cpu)
{
    static const char *bf16[] = {"--push-dtype", "bf16", NULL};
    s_same("sync", 2, "sync", bf16, NULL, s_cuda2, 0);
}
