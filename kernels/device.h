/* device.h — choosing where kernels run.
 *
 * The CUDA back-end is a shared library (build/lib/libzps_cuda.so, built by nvcc when the
 * toolkit and cuDNN exist) loaded with dlopen at run time, so the same binaries run on
 * machines with no CUDA at all. `--device auto` uses CUDA when the library loads and a device
 * answers, else the CPU, and logs one line saying which and why.
 */
#ifndef ZPS_KERNELS_DEVICE_H
#define ZPS_KERNELS_DEVICE_H

#include "common/status.h"

typedef enum k_device_kind {
    K_DEVICE_CPU = 0,
    K_DEVICE_CUDA = 1,
} k_device_kind;

typedef struct k_device_info {
    k_device_kind kind;   // what was chosen
    int cuda_devices;     // devices the CUDA library reported (0 when none or not loaded)
    char name[128];       // "cpu" or the GPU's name
    char reason[256];     // why CUDA was or was not chosen
} k_device_info;

/* want: "auto", "cpu" or "cuda". "cuda" with no usable device is ZPS_ERR_NO_DEVICE (logged);
 * "auto" never fails for lack of a GPU. Unknown strings are ZPS_ERR_INVALID. */
zps_status k_device_select(const char *want, k_device_info *out);

/* The loaded CUDA library handle (dlopen), or NULL when none was loaded. */
void *k_device_cuda_lib(void);

/* Path tried for the CUDA library: $ZPS_CUDA_LIB, else ../lib/libzps_cuda.so beside the
 * running binary. Written into buf; returns buf. */
char *k_device_cuda_lib_path(char *buf, unsigned len);

#endif
