/* dtype.h — bfloat16 gradients on the wire (ps_client_opts.push_dtype, docs/ps.md "Wire
 * dtypes"): the client rounds each f32 gradient to bfloat16 (round to nearest, ties to even;
 * NaN stays NaN), the server widens it back to f32 exactly before the optimizer. bfloat16 is
 * the top half of an f32: same exponent range, 8 bits of mantissa, so no gradient overflows
 * to Inf on the way (IEEE half would above 65504). */
#ifndef ZPS_PS_DTYPE_H
#define ZPS_PS_DTYPE_H

#include <stddef.h>
#include <stdint.h>

typedef enum ps_dtype { PS_DTYPE_F32 = 0, PS_DTYPE_BF16 = 1 } ps_dtype;

/* "f32" / "bf16" (NULL for anything else) and back; parse returns -1 on an unknown name. */
const char *ps_dtype_name(ps_dtype d);
int ps_dtype_parse(const char *s, ps_dtype *d);
/* Bytes per element on the wire. */
static inline size_t ps_dtype_size(ps_dtype d) { return d == PS_DTYPE_BF16 ? 2 : 4; }

/* dst[i] = src[i] rounded to bfloat16. dst may have any alignment. */
void ps_f32_to_bf16(void *dst, const float *src, size_t n);
/* dst[i] = src[i] widened (exact). src may have any alignment. */
void ps_bf16_to_f32(float *dst, const void *src, size_t n);
/* dst[i] = src[i] rounded to bfloat16 and widened back: the f32 the server makes of the
 * wire's value (same-host pushes in shared memory carry these, ps/client_shm.c). dst == src
 * is allowed. */
void ps_f32_round_bf16(float *dst, const float *src, size_t n);
/* 1 when no element of src (bfloat16, any alignment) is NaN or Inf. */
int ps_bf16_all_finite(const void *src, size_t n);
/* The same for n f32 values at src, any alignment (ZeroMQ keeps frames of up to 33 bytes
 * inside the message, at any address). */
int ps_f32_all_finite(const void *src, size_t n);

#endif
