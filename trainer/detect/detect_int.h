/* detect_int.h — private to trainer/detect: the workspace and helpers its .c files share. */
#ifndef ZPS_TRAINER_DETECT_DETECT_INT_H
#define ZPS_TRAINER_DETECT_DETECT_INT_H

#include "common/mem.h"
#include "trainer/detect/detect.h"

/* An arena: a call takes its scratch from it and resets it on return, so after the largest
 * call the same requests reuse the same memory (common/mem.h's invariant). */
struct det_ws {
    zps_arena *arena;
};

/* Indices 0..n-1 of vals sorted by value descending, the lower index first on ties (a
 * stable descending merge sort; NaN is not expected). idx and tmp: n entries each. */
void det_argsort_desc(const float *vals, size_t n, int32_t *idx, int32_t *tmp);

/* log(sum(exp(x[0..n)))), shifted by the maximum and summed in double. */
float det_logsumexp(const float *x, int n);

#endif
