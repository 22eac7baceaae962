/* check.h — CHECK macros for calls into the environment.
 *
 * Each macro evaluates a call once; on failure it logs the call, file:line and the library's
 * own error text at error level, then returns a zps_status from the enclosing function (which
 * must return zps_status). Use them for every ZeroMQ, LMDB, file and system call; API misuse
 * inside zps is an assert instead.
 *
 *   ZPS_TRY(expr)            (common/try.h) expr returns zps_status; propagate anything
 *                            but ZPS_OK
 *   ZPS_CHECK_ZMQ(expr)      libzmq convention: -1 is failure (NULL-returning calls: ZPS_CHECK_PTR)
 *   ZPS_CHECK_LMDB(expr)     LMDB convention: non-zero return code is failure
 *   ZPS_CHECK_SYS(expr)      POSIX convention: -1 is failure, errno set -> ZPS_ERR_SYS
 *   ZPS_CHECK_FILE(expr, path)  like ZPS_CHECK_SYS but names the file -> ZPS_ERR_IO
 *   ZPS_CHECK_PTR(expr, status) NULL is failure -> status
 */
#ifndef ZPS_COMMON_CHECK_H
#define ZPS_COMMON_CHECK_H

#include <errno.h>
#include <lmdb.h>
#include <string.h>
#include <zmq.h>

#include "common/log.h"
#include "common/status.h"
#include "common/try.h"

#define ZPS_CHECK_ZMQ(expr)                                                            \
    do {                                                                               \
        if ((expr) == -1) {                                                            \
            int zps_e_ = zmq_errno();                                                  \
            zps_log(ZPS_ERROR, "zmq", "%s failed: %s", #expr, zmq_strerror(zps_e_));   \
            return zps_e_ == ETERM ? ZPS_ERR_SHUTDOWN : ZPS_ERR_ZMQ;                   \
        }                                                                              \
    } while (0)

#define ZPS_CHECK_LMDB(expr)                                                           \
    do {                                                                               \
        int zps_rc_ = (expr);                                                          \
        if (zps_rc_ != MDB_SUCCESS) {                                                  \
            zps_log(ZPS_ERROR, "lmdb", "%s failed: %s", #expr, mdb_strerror(zps_rc_));  \
            return zps_rc_ == MDB_NOTFOUND ? ZPS_ERR_NOT_FOUND                         \
                   : zps_rc_ == MDB_CORRUPTED || zps_rc_ == MDB_INVALID                \
                       ? ZPS_ERR_CORRUPT                                               \
                       : ZPS_ERR_LMDB;                                                 \
        }                                                                              \
    } while (0)

#define ZPS_CHECK_SYS(expr)                                                            \
    do {                                                                               \
        if ((expr) == -1) {                                                            \
            zps_log(ZPS_ERROR, "sys", "%s failed: %s", #expr, strerror(errno));        \
            return ZPS_ERR_SYS;                                                        \
        }                                                                              \
    } while (0)

#define ZPS_CHECK_FILE(expr, path)                                                     \
    do {                                                                               \
        if ((expr) == -1) {                                                            \
            zps_log(ZPS_ERROR, "file", "%s: %s failed: %s", (path), #expr,             \
                    strerror(errno));                                                  \
            return errno == ENOENT ? ZPS_ERR_NOT_FOUND : ZPS_ERR_IO;                   \
        }                                                                              \
    } while (0)

#define ZPS_CHECK_PTR(expr, status)                                                    \
    do {                                                                               \
        if ((expr) == NULL) {                                                          \
            zps_log(ZPS_ERROR, "check", "%s returned NULL", #expr);                    \
            return (status);                                                           \
        }                                                                              \
    } while (0)

#endif
