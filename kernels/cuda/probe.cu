/* probe.cu — device discovery for the run-time-loaded CUDA library (cuda_api.h). */
#include <cuda_runtime.h>
#include <cudnn.h>
#include <stdio.h>
#include <string.h>

#include "kernels/cuda/cuda_api.h"

extern "C" int k_cuda_probe(int device, int *count, char *name, size_t name_len,
                            unsigned char *uuid, char *msg, size_t msg_len)
{
    *count = 0;
    if (name_len)
        name[0] = 0;
    if (msg_len)
        msg[0] = 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(msg, msg_len, "cudaGetDeviceCount: %s", cudaGetErrorString(e));
        return 0;
    }
    *count = n;
    if (device >= 0 && device < n) {
        cudaDeviceProp prop;
        e = cudaGetDeviceProperties(&prop, device);
        if (e != cudaSuccess) {
            snprintf(msg, msg_len, "cudaGetDeviceProperties: %s", cudaGetErrorString(e));
            return -1;
        }
        snprintf(name, name_len, "%s (cuDNN %zu)", prop.name, (size_t)cudnnGetVersion());
        memcpy(uuid, prop.uuid.bytes, 16);
    }
    return 0;
}
