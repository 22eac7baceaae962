/* test_device.c — device selection: auto falls back to the CPU with a reason; cuda without a
 * device is an error; the CUDA library, when built, loads here with every entry point and is
 * probed. */
#include <criterion/criterion.h>
#include <criterion/redirect.h>
#include <stdio.h>
#include <stdlib.h>
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

/* NCCL is loaded at run time, not linked: the CUDA library references no NCCL symbol (so a
 * GPU machine without NCCL, or with one older than 2.14, still loads it and trains in every
 * mode but the NCCL ones), and loading it here finds every call zps makes: the version
 * query succeeds only when all of them were found, and says 2.14 or later. The symbol half
 * reads the file with binutils' nm, which the build machines have (gcc needs it) and a GPU
 * machine running the bundle may not: there it is said and left to the build machine's run,
 * as it is a property of the file built there. */
Test(device, nccl_is_loaded_at_run_time)
{
    zps_log_set_level(ZPS_LOG_OFF);
#if ZPS_HAVE_CUDA
    const char *bin = getenv("ZPS_BIN");
    cr_assert_not_null(bin, "ZPS_BIN unset: run through make test");
    char path[4096], cmd[4200], line[256];
    snprintf(path, sizeof path, "%s/../lib/libzps_cuda.so", bin);
    if (system("command -v nm >/dev/null 2>&1") == 0) {
        snprintf(cmd, sizeof cmd, "nm -D '%s'", path);
        FILE *f = popen(cmd, "r");
        cr_assert_not_null(f, "%s", cmd);
        int refs = 0, ours = 0;
        while (fgets(line, sizeof line, f)) {
            refs += strstr(line, " nccl") != NULL;
            ours += strstr(line, " T k_nccl_version") != NULL;
        }
        cr_assert_eq(pclose(f), 0, "%s failed", cmd);
        cr_assert_eq(ours, 1, "%s: no k_nccl_version (is this the library?)", cmd);
        cr_assert_eq(refs, 0, "the CUDA library references NCCL symbols: it must load NCCL itself");
    } else {
        cr_log_warn("no nm on this machine: the library's symbols are checked where it is built");
    }
    setenv("ZPS_CUDA_LIB", path, 1);
    char why[320] = "", msg[256] = "";
    const k_cuda_lib *lib = k_device_cuda_lib(why, sizeof why);
    cr_assert_not_null(lib, "libzps_cuda.so did not load: %s", why);
    int v = 0;
    cr_assert_eq(lib->nccl_version(&v, msg, sizeof msg), 0, "NCCL: %s", msg);
    cr_assert_geq(v, 21400, "NCCL %d: 2.14 or later is needed", v);
    cr_log_info("NCCL %d.%d.%d loaded at run time", v / 10000, v / 100 % 100, v % 100);
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

/* A CUDA library that is there but does not load (a missing cuDNN, a CUDA older than the
 * build's) is a fault: --device auto still trains on the CPU, but says why at WARN, not only
 * at DEBUG, so a slow run on a GPU machine explains itself. No library at all stays quiet
 * (the previous test). */
Test(device, auto_warns_when_the_cuda_library_is_there_but_does_not_load,
     .init = cr_redirect_stderr)
{
    zps_log_set_level(ZPS_LOG_WARN);
    char dir[256], path[300];
    zt_mktmp(dir, sizeof dir, "zps-device");
    snprintf(path, sizeof path, "%s/libzps_cuda.so", dir);
    zt_write_file(path, "not an ELF object\n", 18);
    setenv("ZPS_CUDA_LIB", path, 1);
    k_device_info info;
    cr_assert_eq(k_device_select("auto", &info), ZPS_OK);
    cr_assert_eq(info.kind, K_DEVICE_CPU);
    cr_assert_not_null(strstr(info.reason, "cannot load"), "%s", info.reason);
    cr_assert_eq(k_device_select("cuda", &info), ZPS_ERR_NO_DEVICE);
    fflush(stderr);
    char err[4096];
    zt_read_redirected(cr_get_redirected_stderr(), err, sizeof err);
    zt_rmtmp(dir);
    cr_assert_eq(zt_count(err, " W "), 1, "one warning for auto:\n%s", err);
    cr_assert_not_null(strstr(err, path), "the warning names the library:\n%s", err);
    cr_assert_not_null(strstr(err, "using the CPU"), "%s", err);
}

/* A bare library name is the dynamic loader's to find (LD_LIBRARY_PATH), not "built without
 * CUDA". */
Test(device, a_bare_library_name_is_searched_by_the_loader)
{
    zps_log_set_level(ZPS_LOG_OFF);
    setenv("ZPS_CUDA_LIB", "libzps-no-such-cuda.so", 1);
    char why[320] = "";
    cr_assert_null(k_device_cuda_lib(why, sizeof why));
    cr_assert_null(strstr(why, "built without CUDA"), "%s", why);
    cr_assert_not_null(strstr(why, "cannot load libzps-no-such-cuda.so"), "%s", why);
}
