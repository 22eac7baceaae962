/* status.c — strings for the codes of status.h. */
#include "common/status.h"

#include <stddef.h>

#define ZPS_X_COUNT(name, value, msg) +1
_Static_assert(0 ZPS_STATUS_LIST(ZPS_X_COUNT) == ZPS_STATUS_COUNT,
               "ZPS_STATUS_COUNT must equal the length of ZPS_STATUS_LIST");
#undef ZPS_X_COUNT

const char *zps_strerror(int status)
{
    switch (status) {
#define ZPS_X_MSG(name, value, msg) case value: return msg;
        ZPS_STATUS_LIST(ZPS_X_MSG)
#undef ZPS_X_MSG
    }
    return "unknown status";
}

const char *zps_status_name(int status)
{
    switch (status) {
#define ZPS_X_NAME(name, value, msg) case value: return #name;
        ZPS_STATUS_LIST(ZPS_X_NAME)
#undef ZPS_X_NAME
    }
    return NULL;
}
