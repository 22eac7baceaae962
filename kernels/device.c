/* device.c — run-time discovery of the CUDA library and its devices (see device.h).
 * The library's entry points are plain C symbols declared in kernels/cuda/cuda_api.h. */
#include "kernels/device.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/cuda/cuda_api.h"

static void *s_lib;

void *k_device_cuda_lib(void) { return s_lib; }

char *k_device_cuda_lib_path(char *buf, unsigned len)
{
    const char *env = getenv("ZPS_CUDA_LIB");
    if (env && *env) {
        snprintf(buf, len, "%s", env);
        return buf;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) {
        snprintf(buf, len, "libzps_cuda.so");
        return buf;
    }
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    if (slash)
        *slash = 0;
    snprintf(buf, len, "%s/../lib/libzps_cuda.so", exe);
    return buf;
}

/* Loads the library once; on failure explains why in reason. */
static int s_load(char *reason, size_t len)
{
    if (s_lib)
        return 1;
    char path[PATH_MAX + 32];
    k_device_cuda_lib_path(path, sizeof path);
    if (access(path, R_OK) != 0) {
        snprintf(reason, len, "zps was built without CUDA (no %s)", path);
        return 0;
    }
    s_lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!s_lib) {
        snprintf(reason, len, "cannot load %s: %s", path, dlerror());
        return 0;
    }
    return 1;
}

zps_status k_device_select(const char *want, k_device_info *out)
{
    memset(out, 0, sizeof *out);
    out->kind = K_DEVICE_CPU;
    snprintf(out->name, sizeof out->name, "cpu");
    if (!want)
        want = "auto";
    int is_auto = strcmp(want, "auto") == 0, is_cuda = strcmp(want, "cuda") == 0;
    if (!is_auto && !is_cuda && strcmp(want, "cpu") != 0) {
        zps_log(ZPS_ERROR, "device", "unknown device '%s' (want auto, cpu or cuda)", want);
        return ZPS_ERR_INVALID;
    }
    if (!is_auto && !is_cuda) {
        snprintf(out->reason, sizeof out->reason, "--device cpu");
        zps_log(ZPS_INFO, "device", "using the CPU (--device cpu)");
        return ZPS_OK;
    }
    if (s_load(out->reason, sizeof out->reason)) {
        k_cuda_probe_fn probe = (k_cuda_probe_fn)dlsym(s_lib, "k_cuda_probe");
        if (!probe) {
            snprintf(out->reason, sizeof out->reason, "CUDA library lacks k_cuda_probe");
        } else {
            char msg[256] = "";
            int count = 0;
            int rc = probe(&count, out->name, sizeof out->name, msg, sizeof msg);
            if (rc == 0 && count > 0) {
                out->kind = K_DEVICE_CUDA;
                out->cuda_devices = count;
                snprintf(out->reason, sizeof out->reason, "%d CUDA device(s)", count);
                zps_log(ZPS_INFO, "device", "using CUDA device 0 (%s) of %d", out->name, count);
                return ZPS_OK;
            }
            snprintf(out->name, sizeof out->name, "cpu");
            snprintf(out->reason, sizeof out->reason, "no CUDA device found (%s)",
                     msg[0] ? msg : "0 devices");
        }
    }
    if (is_cuda) {
        zps_log(ZPS_ERROR, "device", "--device cuda, but %s", out->reason);
        return ZPS_ERR_NO_DEVICE;
    }
    zps_log(ZPS_INFO, "device", "%s; using the CPU", out->reason);
    return ZPS_OK;
}
