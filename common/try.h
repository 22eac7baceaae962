/* try.h — ZPS_TRY, zps's own propagation macro (not installed: common/status.h is the public
 * include/zps/status.h, and an application may have a ZPS_TRY of its own). Apart from
 * check.h, which pulls in lmdb and zmq, so that the CUDA files can use it too. */
#ifndef ZPS_COMMON_TRY_H
#define ZPS_COMMON_TRY_H

#include "common/status.h"

/* Returns expr's status from the calling function when it is a failure. */
#define ZPS_TRY(expr)                                                                  \
    do {                                                                               \
        zps_status zps_try_st_ = (expr);                                               \
        if (zps_try_st_ != ZPS_OK)                                                     \
            return zps_try_st_;                                                        \
    } while (0)

#endif
