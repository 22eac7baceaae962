/* bits.h — ranges of bits in a uint64_t array (bit i is word i / 64, bit i % 64): the
 * server's sync coverage and the client's shared-memory push ranges in flight. */
#ifndef ZPS_COMMON_BITS_H
#define ZPS_COMMON_BITS_H

#include <stdint.h>

/* Whether any bit of [lo, hi) is set. */
static inline int zps_bits_any(const uint64_t *w, uint64_t lo, uint64_t hi)
{
    for (uint64_t i = lo; i < hi;) {
        if (i % 64 == 0 && hi - i >= 64) {
            if (w[i / 64])
                return 1;
            i += 64;
        } else {
            if (w[i / 64] >> (i % 64) & 1)
                return 1;
            i++;
        }
    }
    return 0;
}

/* Sets (v = 1) or clears bits [lo, hi). */
static inline void zps_bits_put(uint64_t *w, uint64_t lo, uint64_t hi, int v)
{
    for (uint64_t i = lo; i < hi;) {
        if (i % 64 == 0 && hi - i >= 64) {
            w[i / 64] = v ? ~0ull : 0;
            i += 64;
        } else {
            if (v)
                w[i / 64] |= 1ull << (i % 64);
            else
                w[i / 64] &= ~(1ull << (i % 64));
            i++;
        }
    }
}

#endif
