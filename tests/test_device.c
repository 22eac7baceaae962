/* test_device.c — device selection: auto falls back to the CPU with a reason; cuda without a
 * device is an error; the CUDA library, when built, loads here with every entry point and is
 * probed. */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/device.h"
#include "tests/testutil.h"

Test(device, auto_never_fails_and_says_why)
{
    zps_log_set_level(ZPS_LOG_OFF);
    k_device_info info;
    cr_assert_eq(k_device_select("auto", &info), ZPS_OK);
    cr_assert(strlen(info.reason) > 0);
    if (info.kind == K_DEVICE_CPU) {
        cr_assert_eq(info.cuda_devices, 0);
        cr_assert_str_eq(info.name, "cpu");
        /* the same question with --device cuda is an error, not a silent CPU run */
        cr_assert_eq(k_device_select("cuda", &info), ZPS_ERR_NO_DEVICE);
    } else {
        cr_assert(info.cuda_devices > 0);
    }
}

Test(device, cpu_and_bad_names)
{
    zps_log_set_level(ZPS_LOG_OFF);
    k_device_info info;
    cr_assert_eq(k_device_select("cpu", &info), ZPS_OK);
    cr_assert_eq(info.kind, K_DEVICE_CPU);
    cr_assert_eq(k_device_select("tpu", &info), ZPS_ERR_INVALID);
}

Test(device, cuda_library_loads_when_built)
{
    zps_log_set_level(ZPS_LOG_OFF);
#if ZPS_HAVE_CUDA
    const char *bin = getenv("ZPS_BIN");
    cr_assert_not_null(bin, "ZPS_BIN unset: run through make test");
    char path[4096];
    snprintf(path, sizeof path, "%s/../lib/libzps_cuda.so", bin);
    cr_assert_eq(access(path, R_OK), 0, "%s missing though nvcc was found", path);
    setenv("ZPS_CUDA_LIB", path, 1);
    k_device_info info;
    cr_assert_eq(k_device_select("auto", &info), ZPS_OK);
    char why[320] = "";
    const k_cuda_lib *lib = k_device_cuda_lib(why, sizeof why);
    cr_assert_not_null(lib, "libzps_cuda.so did not load: %s", why);
    /* every entry point was looked up at load time */
    cr_assert(lib->probe && lib->backend && lib->last_error && lib->nccl_version &&
              lib->nccl_unique_id &&
              lib->nccl_init && lib->nccl_allreduce_async && lib->nccl_broadcast_async &&
              lib->nccl_record && lib->nccl_mark && lib->nccl_join &&
              lib->nccl_progress && lib->nccl_abort && lib->nccl_finalize &&
              lib->nccl_destroy);
    cr_log_info("CUDA library loaded; %s", info.reason);
#else
    ZPS_GPU_SKIP("zps built without CUDA (CUDA=0 or no nvcc/cuDNN): no CUDA library to load");
#endif
}

/* The NCCL calls that came with 2.14 are weak references in the CUDA library: with an older
 * NCCL on a GPU machine the library still loads (and the GPU trains without NCCL) instead of
 * failing to load for a missing symbol; k_nccl_init then names what is missing. The older
 * calls stay strong. */
Test(device, nccl_2_14_calls_are_weak_references)
{
#if ZPS_HAVE_CUDA
    const char *bin = getenv("ZPS_BIN");
    cr_assert_not_null(bin, "ZPS_BIN unset: run through make test");
    char cmd[4200], line[256];
    snprintf(cmd, sizeof cmd, "nm -D '%s/../lib/libzps_cuda.so'", bin);
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f, "%s", cmd);
    const char *weak[] = {"ncclCommInitRankConfig", "ncclCommFinalize", "ncclGetLastError"};
    int seen_weak = 0, seen_strong = 0;
    while (fgets(line, sizeof line, f)) {
        char kind = 0, name[200] = "";
        if (sscanf(line, " %c %199s", &kind, name) != 2)
            continue;
        for (int i = 0; i < 3; i++)
            if (strcmp(name, weak[i]) == 0) {
                cr_expect_eq(kind, 'w', "%s is '%c', not a weak reference", name, kind);
                seen_weak++;
            }
        if (strcmp(name, "ncclAllReduce") == 0)
            seen_strong += kind == 'U';
    }
    cr_assert_eq(pclose(f), 0, "%s failed", cmd);
    cr_assert_eq(seen_weak, 3, "the library does not reference the 2.14 calls");
    cr_assert_eq(seen_strong, 1, "ncclAllReduce is not an undefined (strong) reference");
#else
    ZPS_GPU_SKIP("zps built without CUDA (CUDA=0 or no nvcc/cuDNN): no CUDA library");
#endif
}

Test(device, the_choice_is_one_info_line_for_a_gpu_and_none_for_the_cpu,
     .init = cr_redirect_stderr)
{
    zps_log_set_level(ZPS_LOG_INFO);
    k_device_info info;
    for (int i = 0; i < 3; i++) /* the trainer, then the back-end, then anyone else */
        cr_assert_eq(k_device_select("auto", &info), ZPS_OK);
    k_device_kind chosen = info.kind;
    cr_assert_eq(k_device_select("cpu", &info), ZPS_OK);
    fflush(stderr);
    char err[4096];
    zt_read_redirected(cr_get_redirected_stderr(), err, sizeof err);
    if (chosen == K_DEVICE_CPU)
        cr_assert_eq(zt_count(err, " device: "), 0, "nothing at info on the CPU:\n%s", err);
    else
        cr_assert_eq(zt_count(err, "using CUDA device"), 1, "once:\n%s", err);
}
