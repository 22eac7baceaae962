/* nccl_allreduce.cu — NCCL all-reduce for the GPU variant of the in-node all-reduce baseline.
 *
 * Plain C entry points (declared in cuda_api.h) wrap one NCCL communicator and a CUDA stream
 * per process. The unique id travels between ranks through trainer/allreduce.c's CPU
 * broadcast; nothing here knows about processes. Every call synchronises its stream before
 * returning, so the caller sees a finished result. Errors come back as a non-zero return with
 * the library's text in msg; nothing here exits.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/cuda_int.h"

static_assert(sizeof(ncclUniqueId) == K_NCCL_ID_BYTES, "K_NCCL_ID_BYTES != sizeof(ncclUniqueId)");

struct k_nccl_comm {
    ncclComm_t comm;     // the communicator
    cudaStream_t stream; // its stream
    int device;          // CUDA device it runs on
    float *staging;      // device buffer for k_nccl_host_allreduce, grown on demand
    size_t staging_n;    // its capacity in floats
    cudaEvent_t after;   // a point of the compute stream the NCCL stream waits for
    cudaEvent_t done;    // a point of the NCCL stream the compute stream waits for
};

#define S_CUDA(call)                                                                   \
    do {                                                                               \
        cudaError_t e_ = (call);                                                       \
        if (e_ != cudaSuccess) {                                                       \
            snprintf(msg, msg_len, "%s: %s", #call, cudaGetErrorString(e_));           \
            return -1;                                                                 \
        }                                                                              \
    } while (0)

#define S_NCCL(call)                                                                   \
    do {                                                                               \
        ncclResult_t r_ = (call);                                                      \
        if (r_ != ncclSuccess) {                                                       \
            snprintf(msg, msg_len, "%s: %s", #call, ncclGetErrorString(r_));           \
            return -1;                                                                 \
        }                                                                              \
    } while (0)

extern "C" int k_nccl_unique_id(void *id, char *msg, size_t msg_len)
{
    ncclUniqueId u;
    S_NCCL(ncclGetUniqueId(&u));
    memcpy(id, &u, sizeof u);
    return 0;
}

extern "C" int k_nccl_init(void **comm, int n_ranks, int rank, const void *id, int device,
                           char *msg, size_t msg_len)
{
    *comm = NULL;
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    S_CUDA(cudaSetDevice(device));
    k_nccl_comm *c = (k_nccl_comm *)calloc(1, sizeof *c);
    if (!c) {
        snprintf(msg, msg_len, "out of memory");
        return -1;
    }
    c->device = device;
    cudaError_t e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        snprintf(msg, msg_len, "cudaStreamCreate: %s", cudaGetErrorString(e));
        free(c);
        return -1;
    }
    if (cudaEventCreateWithFlags(&c->after, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming) != cudaSuccess) {
        snprintf(msg, msg_len, "cudaEventCreate: %s", cudaGetErrorString(cudaGetLastError()));
        cudaStreamDestroy(c->stream);
        free(c);
        return -1;
    }
    ncclResult_t r = ncclCommInitRank(&c->comm, n_ranks, u, rank);
    if (r != ncclSuccess) {
        snprintf(msg, msg_len, "ncclCommInitRank: %s", ncclGetErrorString(r));
        cudaEventDestroy(c->after);
        cudaEventDestroy(c->done);
        cudaStreamDestroy(c->stream);
        free(c);
        return -1;
    }
    *comm = c;
    return 0;
}

extern "C" int k_nccl_allreduce(void *comm, float *dev_buf, size_t n, int average, char *msg,
                                size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    S_CUDA(cudaSetDevice(c->device));
    S_NCCL(ncclAllReduce(dev_buf, dev_buf, n, ncclFloat32, average ? ncclAvg : ncclSum, c->comm,
                         c->stream));
    S_CUDA(cudaStreamSynchronize(c->stream));
    return 0;
}

/* Ordered against the back-end's compute stream (backend.cu) by events, never by the host. */
extern "C" int k_nccl_allreduce_async(void *comm, float *dev_buf, size_t n, int average,
                                      char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    S_CUDA(cudaEventRecord(c->after, k_cuda_compute_stream()));
    S_CUDA(cudaStreamWaitEvent(c->stream, c->after, 0));
    S_NCCL(ncclAllReduce(dev_buf, dev_buf, n, ncclFloat32, average ? ncclAvg : ncclSum, c->comm,
                         c->stream));
    return 0;
}

extern "C" int k_nccl_join(void *comm, char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    S_CUDA(cudaEventRecord(c->done, c->stream));
    S_CUDA(cudaStreamWaitEvent(k_cuda_compute_stream(), c->done, 0));
    return 0;
}

extern "C" int k_nccl_host_allreduce(void *comm, float *buf, size_t n, int average, char *msg,
                                     size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    S_CUDA(cudaSetDevice(c->device));
    if (n > c->staging_n) {
        if (c->staging)
            S_CUDA(cudaFree(c->staging));
        c->staging = NULL;
        c->staging_n = 0;
        S_CUDA(cudaMalloc((void **)&c->staging, n * sizeof(float)));
        c->staging_n = n;
    }
    S_CUDA(cudaMemcpyAsync(c->staging, buf, n * sizeof(float), cudaMemcpyHostToDevice,
                           c->stream));
    S_NCCL(ncclAllReduce(c->staging, c->staging, n, ncclFloat32, average ? ncclAvg : ncclSum,
                         c->comm, c->stream));
    S_CUDA(cudaMemcpyAsync(buf, c->staging, n * sizeof(float), cudaMemcpyDeviceToHost,
                           c->stream));
    S_CUDA(cudaStreamSynchronize(c->stream));
    return 0;
}

extern "C" int k_nccl_destroy(void *comm)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    if (!c)
        return 0;
    cudaSetDevice(c->device);
    if (c->staging)
        cudaFree(c->staging);
    ncclCommDestroy(c->comm);
    cudaEventDestroy(c->after);
    cudaEventDestroy(c->done);
    cudaStreamDestroy(c->stream);
    free(c);
    return 0;
}
