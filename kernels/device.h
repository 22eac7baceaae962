/* device.h — choosing where kernels run, and the one door to the CUDA library.
 *
 * The CUDA back-end is a shared library (build/lib/libzps_cuda.so, built by nvcc when the
 * toolkit and cuDNN exist) loaded with dlopen at run time, so the same binaries run on
 * machines with no CUDA at all. `--device auto` uses CUDA when the library loads and a device
 * answers, else the CPU. A chosen GPU is logged at info, once per process however often it
 * is asked; the CPU (no device answered, or --device cpu) at debug level: the usual case,
 * not worth a line on every start.
 *
 * device.c is the only place that dlopens the library and looks up its symbols: everything
 * else (k_backend_cuda in kernels.c for the op table, the NCCL all-reduce in trainer/allreduce.c)
 * calls through the typed entry points of k_device_cuda_lib().
 */
#ifndef ZPS_KERNELS_DEVICE_H
#define ZPS_KERNELS_DEVICE_H

#include <stddef.h>

#include "common/status.h"
#include "kernels/cuda/cuda_api.h"

typedef enum k_device_kind {
    K_DEVICE_CPU = 0,
    K_DEVICE_CUDA = 1,
} k_device_kind;

typedef struct k_device_info {
    k_device_kind kind;   // what was chosen
    int cuda_devices;     // visible devices the CUDA library reported (0: none, not loaded)
    char name[128];       // "cpu" or the GPU's name
    unsigned char uuid[16]; // the GPU's UUID (zeros for the CPU): the same GPU in any process
    char reason[256];     // why CUDA was or was not chosen
} k_device_info;

/* want: "auto", "cpu" or "cuda". "cuda" with no usable device is ZPS_ERR_NO_DEVICE (logged);
 * "auto" never fails for lack of a GPU. Unknown strings are ZPS_ERR_INVALID. */
zps_status k_device_select(const char *want, k_device_info *out);

/* The visible CUDA device (an index after CUDA_VISIBLE_DEVICES, from 0) this process uses:
 * the trainer's --gpu N, set before the first k_device_select or k_backend_cuda (a process
 * uses one device; later changes are not seen by a back-end already made). 0 by default. */
void k_device_use_gpu(int index);
int k_device_gpu(void);

/* Every entry point of the CUDA library (cuda_api.h documents them), all non-NULL. */
typedef struct k_cuda_lib {
    k_cuda_probe_fn probe;                      // device count and name
    k_cuda_backend_fn backend;                  // the cuda op table
    k_cuda_last_error_fn last_error;            // text of the library's last failure
    k_nccl_version_fn nccl_version;             // NCCL all-reduce (nccl_allreduce.cu) ...
    k_nccl_unique_id_fn nccl_unique_id;
    k_nccl_init_fn nccl_init;
    k_nccl_allreduce_async_fn nccl_allreduce_async;
    k_nccl_broadcast_async_fn nccl_broadcast_async;
    k_nccl_record_fn nccl_record;
    k_nccl_mark_fn nccl_mark;
    k_nccl_join_fn nccl_join;
    k_nccl_progress_fn nccl_progress;
    k_nccl_abort_fn nccl_abort;
    k_nccl_finalize_fn nccl_finalize;
    k_nccl_destroy_fn nccl_destroy;
} k_cuda_lib;

/* The CUDA library's entry points, loading it on the first call (thread-safe). NULL when the
 * library is absent, does not load or lacks a symbol; reason (when non-NULL) then says why.
 * Loading is not probing: a device may still be missing (k_device_select asks). */
const k_cuda_lib *k_device_cuda_lib(char *reason, size_t reason_len);

/* Path tried for the CUDA library: $ZPS_CUDA_LIB, else ../lib/libzps_cuda.so beside the
 * running binary. Written into buf; returns buf. */
char *k_device_cuda_lib_path(char *buf, unsigned len);

#endif
