/* bf16.h — the one bfloat16 rounding of the project: what the PS wire format sends
 * (ps/dtype.c) and what a bf16 convolution multiplies (kernels.h, k_conv2d.bf16), on the host
 * and in CUDA kernels alike.
 *
 * Round to nearest, ties to even: add half an ulp of bfloat16, plus one when the kept part is
 * odd, and keep the top 16 bits. A NaN keeps its sign and gets the quiet bit (rounding could
 * carry it into Inf); an Inf stays an Inf.
 */
#ifndef ZPS_COMMON_BF16_H
#define ZPS_COMMON_BF16_H

#include "common/hd.h"

#include <stdint.h>

/* x's bfloat16 bits. */
ZPS_HD uint16_t zps_bf16_bits(float x)
{
    union {
        float f;
        uint32_t u;
    } v = {x};
    uint32_t nan = (v.u & 0x7fffffffu) > 0x7f800000u;
    return (uint16_t)((nan ? (v.u | 0x00400000u) : v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* x rounded to bfloat16 and widened back to float (exactly). */
ZPS_HD float zps_bf16_round(float x)
{
    union {
        uint32_t u;
        float f;
    } v = {(uint32_t)zps_bf16_bits(x) << 16};
    return v.f;
}

#endif
