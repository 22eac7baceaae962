/* dtype.c — bfloat16 conversions (see dtype.h). Elementwise integer code: every
 * ZPS_SIMD_CLONES clone gives the same bits. */
#include "ps/dtype.h"

#include <string.h>

#include "common/bf16.h"
#include "common/simd.h"

const char *ps_dtype_name(ps_dtype d)
{
    return d == PS_DTYPE_F32 ? "f32" : d == PS_DTYPE_BF16 ? "bf16" : NULL;
}

int ps_dtype_parse(const char *s, ps_dtype *d)
{
    if (s && !strcmp(s, "f32"))
        *d = PS_DTYPE_F32;
    else if (s && !strcmp(s, "bf16"))
        *d = PS_DTYPE_BF16;
    else
        return -1;
    return 0;
}

ZPS_SIMD_CLONES
void ps_f32_to_bf16(void *dst, const float *src, size_t n)
{
    uint8_t *d = dst;
    for (size_t i = 0; i < n; i++) {
        uint16_t h = zps_bf16_bits(src[i]); /* common/bf16.h: nearest, ties to even */
        memcpy(d + 2 * i, &h, 2);
    }
}

ZPS_SIMD_CLONES
void ps_bf16_to_f32(float *dst, const void *src, size_t n)
{
    const uint8_t *s = src;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, 2);
        uint32_t u = (uint32_t)h << 16;
        memcpy(dst + i, &u, 4);
    }
}

ZPS_SIMD_CLONES
void ps_f32_round_bf16(float *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = zps_bf16_round(src[i]);
}

ZPS_SIMD_CLONES
int ps_f32_all_finite(const void *src, size_t n)
{
    /* A float is NaN or Inf when its exponent bits are all ones. An OR over integer tests
     * has no dependency chain through a float add, so it vectorises. */
    const uint8_t *s = src;
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, s + 4 * i, 4);
        bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

ZPS_SIMD_CLONES
int ps_bf16_all_finite(const void *src, size_t n)
{
    const uint8_t *s = src;
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, s + 2 * i, 2);
        bad |= (h & 0x7f80u) == 0x7f80u;
    }
    return !bad;
}
