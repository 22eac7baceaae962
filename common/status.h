/* status.h — the one status type of zps.
 *
 * 0 is success; every failure is a negative code from ZPS_STATUS_LIST. Functions that can
 * fail return zps_status and hand results back through out parameters. The numeric values
 * travel on the wire (reply headers), so codes are only ever appended, never renumbered.
 */
#ifndef ZPS_COMMON_STATUS_H
#define ZPS_COMMON_STATUS_H

/* X(name, value, message) */
#define ZPS_STATUS_LIST(X)                                                     \
    X(ZPS_OK, 0, "success")                                                    \
    X(ZPS_ERR_NOMEM, -1, "out of memory")                                      \
    X(ZPS_ERR_INVALID, -2, "invalid argument")                                 \
    X(ZPS_ERR_IO, -3, "input/output error")                                    \
    X(ZPS_ERR_PARSE, -4, "parse error")                                        \
    X(ZPS_ERR_NOT_FOUND, -5, "not found")                                      \
    X(ZPS_ERR_EXISTS, -6, "already exists")                                    \
    X(ZPS_ERR_TIMEOUT, -7, "timed out")                                        \
    X(ZPS_ERR_ZMQ, -8, "ZeroMQ call failed")                                   \
    X(ZPS_ERR_LMDB, -9, "LMDB call failed")                                    \
    X(ZPS_ERR_PROTO, -10, "malformed protobuf message")                        \
    X(ZPS_ERR_VERSION, -11, "protocol version mismatch")                       \
    X(ZPS_ERR_OP, -12, "unknown or unexpected op")                             \
    X(ZPS_ERR_PLAN, -13, "sharding plan mismatch")                             \
    X(ZPS_ERR_KEY, -14, "key not in the sharding plan")                        \
    X(ZPS_ERR_RANGE, -15, "range outside its chunk")                           \
    X(ZPS_ERR_FRAMES, -16, "wrong number or length of payload frames")         \
    X(ZPS_ERR_DTYPE, -17, "unsupported or mismatched dtype")                   \
    X(ZPS_ERR_NONFINITE, -18, "NaN or Inf in payload")                         \
    X(ZPS_ERR_TOO_LARGE, -19, "message larger than the limit")                 \
    X(ZPS_ERR_STALE, -20, "stale push dropped")                                \
    X(ZPS_ERR_NOT_INIT, -21, "variables not initialised")                      \
    X(ZPS_ERR_ALREADY_INIT, -22, "variables already initialised")              \
    X(ZPS_ERR_CONFIG, -23, "configuration mismatch")                           \
    X(ZPS_ERR_TRAINER, -24, "unknown or unregistered trainer")                 \
    X(ZPS_ERR_CORRUPT, -25, "corrupt data")                                    \
    X(ZPS_ERR_UNSUPPORTED, -26, "not supported")                               \
    X(ZPS_ERR_NO_DEVICE, -27, "no such device")                                \
    X(ZPS_ERR_CUDA, -28, "CUDA call failed")                                   \
    X(ZPS_ERR_CUDNN, -29, "cuDNN call failed")                                 \
    X(ZPS_ERR_CUBLAS, -30, "cuBLAS call failed")                               \
    X(ZPS_ERR_DNNL, -31, "oneDNN call failed")                                 \
    X(ZPS_ERR_DECODE, -32, "image decode failed")                              \
    X(ZPS_ERR_EOF, -33, "end of data")                                         \
    X(ZPS_ERR_SHUTDOWN, -34, "shutting down")                                  \
    X(ZPS_ERR_INTERRUPTED, -35, "interrupted")                                 \
    X(ZPS_ERR_UNAUTHORIZED, -36, "not authorised")                             \
    X(ZPS_ERR_BUSY, -37, "busy, try again")                                    \
    X(ZPS_ERR_NCCL, -38, "NCCL call failed")                                   \
    X(ZPS_ERR_SYS, -39, "system call failed")                                  \
    X(ZPS_ERR_INTERNAL, -40, "internal error")

typedef enum zps_status {
#define ZPS_X_ENUM(name, value, msg) name = (value),
    ZPS_STATUS_LIST(ZPS_X_ENUM)
#undef ZPS_X_ENUM
} zps_status;

/* Number of codes in ZPS_STATUS_LIST; codes are 0, -1, ..., -(ZPS_STATUS_COUNT - 1). */
enum { ZPS_STATUS_COUNT = 41 };

/* Readable message; never NULL ("unknown status" for a value outside the list). */
const char *zps_strerror(int status);
/* Symbolic name such as "ZPS_ERR_RANGE"; NULL for a value outside the list. */
const char *zps_status_name(int status);

#endif
