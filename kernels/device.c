/* device.c — run-time discovery of the CUDA library and its devices (see device.h).
 *
 * The process's one dlopen of libzps_cuda.so: the library is loaded once, under a mutex, and
 * every entry point is looked up at that moment, so a library missing a symbol is refused as a
 * whole (with the symbol's name) instead of failing later at a call site. The outcome, success
 * or the reason for failure, is kept for the life of the process.
 */
#include "kernels/device.h"

#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"

static pthread_mutex_t s_mu = PTHREAD_MUTEX_INITIALIZER;
static int s_tried;          // the load was attempted (under s_mu)
static k_cuda_lib s_api;     // valid when s_ok
static int s_ok;             // the library loaded with every symbol
static char s_why[320];      // why not, when !s_ok
static int s_present;        // the library file exists (so a failure to load it is a fault)
static atomic_flag s_told = ATOMIC_FLAG_INIT; // the chosen GPU was logged at info once
static atomic_int s_gpu;     // the visible device this process uses (k_device_use_gpu)

void k_device_use_gpu(int index) { atomic_store(&s_gpu, index < 0 ? 0 : index); }
int k_device_gpu(void) { return atomic_load(&s_gpu); }

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

/* dlsym into a typed field; the name goes to s_why when missing. POSIX guarantees that the
 * object pointer dlsym returns converts to a function pointer. */
#define S_SYM(field, sym)                                                              \
    do {                                                                               \
        void *p_ = dlsym(lib, #sym);                                                   \
        if (!p_) {                                                                     \
            snprintf(s_why, sizeof s_why, "CUDA library %s lacks " #sym, path);        \
            return 0;                                                                  \
        }                                                                              \
        s_api.field = (sym##_fn)p_;                                                    \
    } while (0)

/* Loads the library and looks up every entry point; 0 with s_why set on failure. */
static int s_load(void)
{
    char path[PATH_MAX + 32];
    k_device_cuda_lib_path(path, sizeof path);
    /* a bare name (ZPS_CUDA_LIB=libzps_cuda.so) is the loader's to find on its paths */
    if (strchr(path, '/') && access(path, R_OK) != 0) {
        snprintf(s_why, sizeof s_why, "zps was built without CUDA (no %s)", path);
        return 0;
    }
    s_present = 1;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(s_why, sizeof s_why, "cannot load %s: %s", path, dlerror());
        return 0;
    }
    /* on a missing symbol the library stays loaded: dlclose of CUDA libraries is unsafe */
    S_SYM(probe, k_cuda_probe);
    S_SYM(backend, k_cuda_backend);
    S_SYM(last_error, k_cuda_last_error);
    S_SYM(nccl_version, k_nccl_version);
    S_SYM(nccl_unique_id, k_nccl_unique_id);
    S_SYM(nccl_init, k_nccl_init);
    S_SYM(nccl_allreduce_async, k_nccl_allreduce_async);
    S_SYM(nccl_broadcast_async, k_nccl_broadcast_async);
    S_SYM(nccl_record, k_nccl_record);
    S_SYM(nccl_mark, k_nccl_mark);
    S_SYM(nccl_join, k_nccl_join);
    S_SYM(nccl_progress, k_nccl_progress);
    S_SYM(nccl_abort, k_nccl_abort);
    S_SYM(nccl_finalize, k_nccl_finalize);
    S_SYM(nccl_destroy, k_nccl_destroy);
    return 1;
}

const k_cuda_lib *k_device_cuda_lib(char *reason, size_t reason_len)
{
    pthread_mutex_lock(&s_mu);
    if (!s_tried) {
        s_tried = 1;
        s_ok = s_load();
    }
    pthread_mutex_unlock(&s_mu);
    if (!s_ok && reason && reason_len)
        snprintf(reason, reason_len, "%s", s_why);
    return s_ok ? &s_api : NULL;
}

/* Whether --device auto's fall back to the CPU hides a fault: the CUDA library is there but
 * does not load (a missing cuDNN or cuBLAS, a CUDA older than it was built for), or it loaded
 * (`loaded`) and found no device while an NVIDIA driver is present (a driver older than
 * CUDA 13, a device the container does not pass through). A user on such a machine would
 * otherwise see only a slow run on the CPU. */
static int s_broken(int loaded)
{
    if (!loaded)
        return s_present;
    return access("/proc/driver/nvidia/version", R_OK) == 0 || access("/dev/nvidiactl", F_OK) == 0;
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
        zps_log(ZPS_DEBUG, "device", "using the CPU (--device cpu)");
        return ZPS_OK;
    }
    const k_cuda_lib *lib = k_device_cuda_lib(out->reason, sizeof out->reason);
    int misplaced = 0; // GPUs are visible, --gpu names none of them
    if (lib) {
        char msg[256] = "";
        int count = 0, gpu = k_device_gpu();
        int rc = lib->probe(gpu, &count, out->name, sizeof out->name, out->uuid, msg,
                            sizeof msg);
        out->cuda_devices = rc == 0 ? count : 0;
        if (rc == 0 && gpu < count) {
            out->kind = K_DEVICE_CUDA;
            snprintf(out->reason, sizeof out->reason, "%d CUDA device(s)", count);
            /* the trainer asks, then the CUDA back-end asks again: say it once */
            zps_log(atomic_flag_test_and_set(&s_told) ? ZPS_DEBUG : ZPS_INFO, "device",
                    "using CUDA device %d (%s) of %d", gpu, out->name, count);
            return ZPS_OK;
        }
        snprintf(out->name, sizeof out->name, "cpu");
        misplaced = rc == 0 && count > 0;
        const char *vis = getenv("CUDA_VISIBLE_DEVICES");
        if (misplaced)
            snprintf(out->reason, sizeof out->reason, "--gpu %d: %d CUDA device(s) visible "
                     "(numbered from 0; CUDA_VISIBLE_DEVICES=%s)", gpu, count,
                     vis ? vis : "unset");
        else
            snprintf(out->reason, sizeof out->reason, "no CUDA device found (%s)",
                     msg[0] ? msg : "0 devices");
    }
    if (is_cuda) {
        zps_log(ZPS_ERROR, "device", "--device cuda, but %s", out->reason);
        return ZPS_ERR_NO_DEVICE;
    }
    /* the usual case on a CPU-only machine is not worth a line on every start; GPUs that
     * --gpu misses are, and so is a CUDA that is there but fails (s_broken) */
    zps_log(misplaced || s_broken(lib != NULL) ? ZPS_WARN : ZPS_DEBUG, "device",
            "%s; using the CPU", out->reason);
    return ZPS_OK;
}
