/* log.h — leveled logging with time, role and module.
 *
 * A line looks like
 *     2026-11-21 21:50:01.123 I server[0] ps: applied version 12
 * and goes to stderr in one write(2), so lines of concurrent threads and processes do not
 * interleave. zps_log() tests the level before any formatting happens. The level comes from
 * --log-level (zps_log_set_level_str) or else from the ZPS_LOG environment variable
 * (zps_log_init), default info.
 */
#ifndef ZPS_COMMON_LOG_H
#define ZPS_COMMON_LOG_H

#include "common/status.h"

typedef enum zps_log_level {
    ZPS_LOG_TRACE = 0,
    ZPS_LOG_DEBUG,
    ZPS_LOG_INFO,
    ZPS_LOG_WARN,
    ZPS_LOG_ERROR,
    ZPS_LOG_OFF,
} zps_log_level;

/* Short aliases for call sites: zps_log(ZPS_INFO, "ps", ...). */
#define ZPS_TRACE ZPS_LOG_TRACE
#define ZPS_DEBUG ZPS_LOG_DEBUG
#define ZPS_INFO ZPS_LOG_INFO
#define ZPS_WARN ZPS_LOG_WARN
#define ZPS_ERROR ZPS_LOG_ERROR

/* Current threshold; read without locking (a racy read only delays a level change). */
extern volatile int zps_log_threshold;

#define zps_log(level, module, ...)                                                    \
    do {                                                                               \
        if ((int)(level) >= zps_log_threshold)                                         \
            zps_log_write((level), (module), __FILE__, __LINE__, __VA_ARGS__);         \
    } while (0)

/* Sets role ("server", "trainer", "data", "bench", ...) and index (-1: none) shown on every
 * line, and the level from ZPS_LOG when set. role is copied. */
void zps_log_init(const char *role, int index);
/* Changes role and index only (the level stays as set). */
void zps_log_set_role(const char *role, int index);
void zps_log_set_level(zps_log_level level);
/* Parses "trace|debug|info|warn|error|off"; ZPS_ERR_INVALID on anything else. */
zps_status zps_log_level_parse(const char *s, zps_log_level *out);
/* zps_log_level_parse + set; for --log-level. */
zps_status zps_log_set_level_str(const char *s);

/* Error lines written so far by this process (at any threshold that let them through). A
 * main() whose call failed prints its own "zps-PROG: ..." line only when this is still 0:
 * the module that failed has said why already, and one failure is one message. */
int zps_log_errors(void);
/* For main(): "PROG: WHAT: STATUS" on stderr (WHAT from fmt; empty fmt: "PROG: STATUS"), unless
 * an error line has been logged already (zps_log_errors). */
void zps_log_failure(const char *prog, zps_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

void zps_log_write(zps_log_level level, const char *module, const char *file, int line,
                   const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#endif
