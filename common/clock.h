/* clock.h — monotonic time for timeouts, latencies and rates (never wall time). */
#ifndef ZPS_COMMON_CLOCK_H
#define ZPS_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

/* Nanoseconds on CLOCK_MONOTONIC. */
static inline uint64_t zps_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline double zps_now_s(void) { return (double)zps_now_ns() * 1e-9; }

/* Milliseconds since the Unix epoch (CLOCK_REALTIME), for metrics records only. */
static inline uint64_t zps_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000ull + (uint64_t)ts.tv_nsec / 1000000ull;
}

/* Sleeps for ns nanoseconds, resuming after signals. For pacing and back-off, never as a
 * substitute for synchronisation. */
void zps_sleep_ns(uint64_t ns);

#endif
