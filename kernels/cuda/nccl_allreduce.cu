/* nccl_allreduce.cu — NCCL all-reduce for the GPU variant of the in-node all-reduce baseline.
 *
 * Plain C entry points (declared in cuda_api.h) wrap one NCCL communicator and a CUDA stream
 * per process. The unique id travels between ranks through trainer/allreduce.c's CPU
 * broadcast; nothing here knows about processes. Errors come back as -1 with the library's
 * text in msg; nothing here exits or waits for the device.
 *
 * The communicator is non-blocking (ncclConfig_t.blocking = 0): no NCCL call waits for the
 * peers on the host; a call may answer "in progress" (1), and the caller polls
 * k_nccl_progress until it is settled before the next call. So the caller can give up on a
 * peer that died (trainer/allreduce_nccl.c watches their liveness) and abort, where a
 * blocking communicator would hold it inside NCCL for ever. After each sum is queued,
 * k_nccl_mark queues a host function behind it that counts it finished, so k_nccl_progress
 * also says how many queued sums the device has not finished.
 */
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/cuda_int.h"

static_assert(sizeof(ncclUniqueId) == K_NCCL_ID_BYTES, "K_NCCL_ID_BYTES != sizeof(ncclUniqueId)");

/* NCCL itself is loaded on first use (dlopen of libnccl.so.2 from the loader's paths), not
 * linked: a GPU machine without NCCL, or with one older than 2.14 (no non-blocking
 * communicators), still loads this library and trains on the GPU in every mode but the NCCL
 * ones, whose set-up says what is missing. */
static struct {
    ncclResult_t (*GetVersion)(int *);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
    ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                              ncclComm_t, cudaStream_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t,
                              cudaStream_t);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*CommFinalize)(ncclComm_t);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    const char *(*GetErrorString)(ncclResult_t);
    const char *(*GetLastError)(ncclComm_t);
} s_nccl;
static pthread_once_t s_nccl_once = PTHREAD_ONCE_INIT;
static char s_nccl_why[320]; // empty when loaded

#define S_SYM(field)                                                                   \
    do {                                                                               \
        *(void **)&s_nccl.field = dlsym(lib, "nccl" #field);                           \
        if (!s_nccl.field && !s_nccl_why[0])                                           \
            snprintf(s_nccl_why, sizeof s_nccl_why, "%s has no nccl" #field, name);    \
    } while (0)

static void s_nccl_load(void)
{
    const char *name = "libnccl.so.2";
    void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        snprintf(s_nccl_why, sizeof s_nccl_why, "cannot load NCCL (%s): %s", name, dlerror());
        return;
    }
    S_SYM(GetVersion);
    S_SYM(GetUniqueId);
    S_SYM(AllReduce);
    S_SYM(Broadcast);
    S_SYM(CommGetAsyncError);
    S_SYM(CommAbort);
    S_SYM(CommDestroy);
    S_SYM(GetErrorString);
    *(void **)&s_nccl.GetLastError = dlsym(lib, "ncclGetLastError"); // optional: 2.13+
    if (s_nccl_why[0])
        return;
    S_SYM(CommInitRankConfig); // 2.14: non-blocking communicators
    S_SYM(CommFinalize);
    if (s_nccl_why[0]) {
        int v = 0;
        s_nccl.GetVersion(&v);
        snprintf(s_nccl_why, sizeof s_nccl_why, "NCCL %d.%d.%d has no non-blocking "
                 "communicators (ncclCommInitRankConfig, ncclCommFinalize): zps needs NCCL "
                 "2.14 or later", v / 10000, v / 100 % 100, v % 100);
    }
    /* on failure the library stays loaded: unloading NCCL is not safe */
}
#undef S_SYM

/* 0 once NCCL is usable, else -1 with why in msg. */
static int s_nccl_ready(char *msg, size_t msg_len)
{
    pthread_once(&s_nccl_once, s_nccl_load);
    if (!s_nccl_why[0])
        return 0;
    snprintf(msg, msg_len, "%s", s_nccl_why);
    return -1;
}

struct k_nccl_comm {
    ncclComm_t comm;     // the communicator
    cudaStream_t stream; // its stream
    int device;          // CUDA device it runs on
    cudaEvent_t after;   // a point of the compute stream the NCCL stream waits for
    cudaEvent_t done;    // a point of the NCCL stream the compute stream waits for
    unsigned long long posted;   // sums marked (k_nccl_mark, the caller's thread)
    unsigned long long finished; // of them done: written by s_finished on CUDA's callback thread
    int aborted;                 // k_nccl_abort ran: the communicator is gone
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
            snprintf(msg, msg_len, "%s: %s", #call, s_nccl.GetErrorString(r_));           \
            return -1;                                                                 \
        }                                                                              \
    } while (0)

/* A call of a non-blocking communicator: 0 done, 1 in progress, -1 failed (msg says). */
static int s_state(ncclResult_t r, const char *call, ncclComm_t comm, char *msg, size_t msg_len)
{
    if (r == ncclSuccess || r == ncclInProgress)
        return r == ncclInProgress;
    snprintf(msg, msg_len, "%s: %s (%s)", call, s_nccl.GetErrorString(r),
             comm && s_nccl.GetLastError ? s_nccl.GetLastError(comm) : "");
    return -1;
}

/* Frees what c holds: the communicator only when it is not aborted (ncclCommDestroy waits
 * for its queued work; callers finalize or abort first), after the stream drained, since
 * an s_finished still queued behind aborted sums must not outlive c. */
static void s_free(k_nccl_comm *c)
{
    if (c->comm && !c->aborted)
        s_nccl.CommDestroy(c->comm);
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    if (c->after)
        cudaEventDestroy(c->after);
    if (c->done)
        cudaEventDestroy(c->done);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c);
}

extern "C" int k_nccl_version(int *version, char *msg, size_t msg_len)
{
    *version = 0;
    pthread_once(&s_nccl_once, s_nccl_load);
    if (!s_nccl.GetVersion) {
        snprintf(msg, msg_len, "%s", s_nccl_why);
        return -1;
    }
    S_NCCL(s_nccl.GetVersion(version));
    return 0;
}

extern "C" int k_nccl_unique_id(void *id, char *msg, size_t msg_len)
{
    if (s_nccl_ready(msg, msg_len) != 0)
        return -1;
    ncclUniqueId u;
    S_NCCL(s_nccl.GetUniqueId(&u));
    memcpy(id, &u, sizeof u);
    return 0;
}

extern "C" int k_nccl_init(void **comm, int n_ranks, int rank, const void *id, int device,
                           char *msg, size_t msg_len)
{
    *comm = NULL;
    if (s_nccl_ready(msg, msg_len) != 0)
        return -1;
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    S_CUDA(cudaSetDevice(device));
    k_nccl_comm *c = (k_nccl_comm *)calloc(1, sizeof *c);
    if (!c) {
        snprintf(msg, msg_len, "out of memory");
        return -1;
    }
    c->device = device;
    /* the highest priority: backward's kernels can fill every SM, and a sum queued behind
     * them would start only after backward, losing the overlap (PyTorch's NCCL streams do
     * the same) */
    int lo = 0, hi = 0;
    cudaError_t e = cudaDeviceGetStreamPriorityRange(&lo, &hi);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithPriority(&c->stream, cudaStreamNonBlocking, hi);
    if (e == cudaSuccess)
        e = cudaEventCreateWithFlags(&c->after, cudaEventDisableTiming);
    if (e == cudaSuccess)
        e = cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        snprintf(msg, msg_len, "NCCL's stream and events: %s", cudaGetErrorString(e));
        s_free(c);
        return -1;
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    int rc = s_state(s_nccl.CommInitRankConfig(&c->comm, n_ranks, u, rank, &config),
                     "ncclCommInitRankConfig", NULL, msg, msg_len);
    if (rc < 0) {
        if (c->comm) { // half made: abort, not destroy
            s_nccl.CommAbort(c->comm);
            c->aborted = 1;
        }
        s_free(c);
        return -1;
    }
    *comm = c;
    return rc;
}

/* NCCL's stream waits for the compute stream's work so far (backend.cu): collectives are
 * ordered against it by events, never by the host. */
static int s_after_compute(k_nccl_comm *c, char *msg, size_t msg_len)
{
    S_CUDA(cudaEventRecord(c->after, k_cuda_stream));
    S_CUDA(cudaStreamWaitEvent(c->stream, c->after, 0));
    return 0;
}

extern "C" int k_nccl_allreduce_async(void *comm, float *dev_buf, size_t n, int average,
                                      char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    if (s_after_compute(c, msg, msg_len) != 0)
        return -1;
    return s_state(s_nccl.AllReduce(dev_buf, dev_buf, n, ncclFloat32, average ? ncclAvg : ncclSum,
                                 c->comm, c->stream),
                   "ncclAllReduce", c->comm, msg, msg_len);
}

extern "C" int k_nccl_broadcast_async(void *comm, float *dev_buf, size_t n, int root,
                                      char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    if (s_after_compute(c, msg, msg_len) != 0)
        return -1;
    return s_state(s_nccl.Broadcast(dev_buf, dev_buf, n, ncclFloat32, root, c->comm, c->stream),
                   "ncclBroadcast", c->comm, msg, msg_len);
}

extern "C" int k_nccl_record(void *comm, void *event, char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    S_CUDA(cudaEventRecord(((k_event *)event)->ev, c->stream));
    return 0;
}

/* On CUDA's callback thread, once NCCL's stream reached it: one more sum done. No CUDA
 * call is allowed here. */
static void CUDART_CB s_finished(void *p)
{
    __atomic_add_fetch(&((k_nccl_comm *)p)->finished, 1, __ATOMIC_RELEASE);
}

extern "C" int k_nccl_mark(void *comm, char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    S_CUDA(cudaLaunchHostFunc(c->stream, s_finished, c));
    __atomic_add_fetch(&c->posted, 1, __ATOMIC_RELEASE);
    return 0;
}

extern "C" int k_nccl_join(void *comm, char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    S_CUDA(cudaEventRecord(c->done, c->stream));
    S_CUDA(cudaStreamWaitEvent(k_cuda_stream, c->done, 0));
    return 0;
}

extern "C" int k_nccl_progress(void *comm, unsigned long long *posted,
                               unsigned long long *finished, char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    *posted = __atomic_load_n(&c->posted, __ATOMIC_ACQUIRE);
    *finished = __atomic_load_n(&c->finished, __ATOMIC_ACQUIRE);
    if (__atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE))
        return 0;
    ncclResult_t state = ncclSuccess;
    S_NCCL(s_nccl.CommGetAsyncError(c->comm, &state));
    return s_state(state, "the communicator", c->comm, msg, msg_len);
}

extern "C" int k_nccl_abort(void *comm, char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    if (__atomic_exchange_n(&c->aborted, 1, __ATOMIC_ACQ_REL))
        return 0;
    /* the watchdog's thread may never have used the GPU; abort even if this fails, or the
     * kernels would never return */
    cudaError_t e = cudaSetDevice(c->device);
    S_NCCL(s_nccl.CommAbort(c->comm));
    if (e != cudaSuccess) {
        snprintf(msg, msg_len, "cudaSetDevice before ncclCommAbort: %s", cudaGetErrorString(e));
        return -1;
    }
    return 0;
}

extern "C" int k_nccl_finalize(void *comm, char *msg, size_t msg_len)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    return s_state(s_nccl.CommFinalize(c->comm), "ncclCommFinalize", c->comm, msg, msg_len);
}

extern "C" int k_nccl_destroy(void *comm)
{
    k_nccl_comm *c = (k_nccl_comm *)comm;
    if (!c)
        return 0;
    cudaSetDevice(c->device);
    s_free(c);
    return 0;
}
