// onnxfuse FusedElementwise: the op maths, written once.
//
// This header is compiled twice: by g++ for the CPU kernel (OFX_HD = static inline) and, embedded
// as a string (setup.py generates ops_h.inc), as the head of every CUDA source that NVRTC compiles
// (OFX_HD = __device__ __forceinline__). Keep it free of includes on the device side and of
// anything that is host-only outside the #else branch below.
//
// Value representation while computing ("compute types"):
//   float32 / float16 / bfloat16 -> float   (rounded to storage only at outputs and at Cast)
//   int32 -> int,  int64 -> ofx_i64,  bool -> bool
// Storage types: float, unsigned short (fp16 bits), unsigned short (bf16 bits), int, ofx_i64, bool.
#ifndef ONNXFUSE_OPS_H_
#define ONNXFUSE_OPS_H_

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#define OFX_DEVICE 1
#define OFX_HD __device__ __forceinline__
typedef long long ofx_i64;
#define OFX_I32_MIN (-2147483647 - 1)
#define OFX_I64_MIN (-9223372036854775807LL - 1LL)
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
#define OFX_HD static inline
typedef int64_t ofx_i64;
#define OFX_I32_MIN INT32_MIN
#define OFX_I64_MIN INT64_MIN
#endif

// ---------------------------------------------------------------- float16 / bfloat16 storage
OFX_HD unsigned int ofx_f2u(float f) {
#ifdef OFX_DEVICE
  return __float_as_uint(f);
#else
  unsigned int u; memcpy(&u, &f, 4); return u;
#endif
}
OFX_HD float ofx_u2f(unsigned int u) {
#ifdef OFX_DEVICE
  return __uint_as_float(u);
#else
  float f; memcpy(&f, &u, 4); return f;
#endif
}

// float -> IEEE binary16 bits, round to nearest even.
OFX_HD unsigned short ofx_f2h(float f) {
#ifdef OFX_DEVICE
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  unsigned int x = ofx_f2u(f);
  unsigned int sign = (x >> 16) & 0x8000u;
  unsigned int ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (unsigned short)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  if (ax < 0x38800000u) {  // result is subnormal (or zero): exact via float arithmetic
    float v = ofx_u2f(ax) + 0.5f;  // 0.5 = 2^-1: ulp of v is 2^-24 = fp16 subnormal step, RNE
    return (unsigned short)(sign | (ofx_f2u(v) - 0x3f000000u));
  }
  unsigned int mant_odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + mant_odd;  // rebias exponent (-112 << 23) and round
  return (unsigned short)(sign | (ax >> 13));
#endif
}

OFX_HD float ofx_h2f(unsigned short h) {
#ifdef OFX_DEVICE
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
  unsigned int exp = ((unsigned int)h >> 10) & 0x1fu;
  unsigned int mant = (unsigned int)h & 0x3ffu;
  if (exp == 0x1fu) return ofx_u2f(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    float v = (float)mant * 5.9604644775390625e-08f;  // mant * 2^-24
    return sign ? -v : v;
  }
  return ofx_u2f(sign | ((exp + 112u) << 23) | (mant << 13));
#endif
}

// float -> bfloat16 bits, round to nearest even; NaN stays NaN.
OFX_HD unsigned short ofx_f2bf(float f) {
  unsigned int x = ofx_f2u(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (unsigned short)(x >> 16);
}
OFX_HD float ofx_bf2f(unsigned short b) { return ofx_u2f(((unsigned int)b) << 16); }

OFX_HD float ofx_round_f16(float x) { return ofx_h2f(ofx_f2h(x)); }
OFX_HD float ofx_round_bf16(float x) { return ofx_bf2f(ofx_f2bf(x)); }

// ---------------------------------------------------------------- arithmetic
OFX_HD float ofx_add(float a, float b) { return a + b; }
OFX_HD int ofx_add(int a, int b) { return (int)((unsigned int)a + (unsigned int)b); }
OFX_HD ofx_i64 ofx_add(ofx_i64 a, ofx_i64 b) { return (ofx_i64)((unsigned long long)a + (unsigned long long)b); }
OFX_HD float ofx_sub(float a, float b) { return a - b; }
OFX_HD int ofx_sub(int a, int b) { return (int)((unsigned int)a - (unsigned int)b); }
OFX_HD ofx_i64 ofx_sub(ofx_i64 a, ofx_i64 b) { return (ofx_i64)((unsigned long long)a - (unsigned long long)b); }
OFX_HD float ofx_mul(float a, float b) { return a * b; }
OFX_HD int ofx_mul(int a, int b) { return (int)((unsigned int)a * (unsigned int)b); }
OFX_HD ofx_i64 ofx_mul(ofx_i64 a, ofx_i64 b) { return (ofx_i64)((unsigned long long)a * (unsigned long long)b); }
OFX_HD float ofx_div(float a, float b) { return a / b; }
// Integer division truncates toward zero (C, ONNX Runtime). x/0 gives 0 and MIN/-1 gives MIN
// instead of trapping.
OFX_HD int ofx_div(int a, int b) { return b == 0 ? 0 : (b == -1 ? (int)(0u - (unsigned int)a) : a / b); }
OFX_HD ofx_i64 ofx_div(ofx_i64 a, ofx_i64 b) {
  return b == 0 ? 0 : (b == -1 ? (ofx_i64)(0ull - (unsigned long long)a) : a / b);
}
OFX_HD float ofx_pow(float a, float b) { return powf(a, b); }
// Min/Max propagate NaN, as ONNX Runtime does.
OFX_HD float ofx_min(float a, float b) { return (a != a || b != b) ? a + b : (b < a ? b : a); }
OFX_HD int ofx_min(int a, int b) { return b < a ? b : a; }
OFX_HD ofx_i64 ofx_min(ofx_i64 a, ofx_i64 b) { return b < a ? b : a; }
OFX_HD float ofx_max(float a, float b) { return (a != a || b != b) ? a + b : (b > a ? b : a); }
OFX_HD int ofx_max(int a, int b) { return b > a ? b : a; }
OFX_HD ofx_i64 ofx_max(ofx_i64 a, ofx_i64 b) { return b > a ? b : a; }

OFX_HD float ofx_neg(float x) { return -x; }
OFX_HD int ofx_neg(int x) { return (int)(0u - (unsigned int)x); }
OFX_HD ofx_i64 ofx_neg(ofx_i64 x) { return (ofx_i64)(0ull - (unsigned long long)x); }
OFX_HD float ofx_abs(float x) { return fabsf(x); }
OFX_HD int ofx_abs(int x) { return x < 0 ? ofx_neg(x) : x; }
OFX_HD ofx_i64 ofx_abs(ofx_i64 x) { return x < 0 ? ofx_neg(x) : x; }
OFX_HD float ofx_sign(float x) { return x > 0.f ? 1.f : (x < 0.f ? -1.f : (x == 0.f ? 0.f : x)); }
OFX_HD int ofx_sign(int x) { return x > 0 ? 1 : (x < 0 ? -1 : 0); }
OFX_HD ofx_i64 ofx_sign(ofx_i64 x) { return x > 0 ? 1 : (x < 0 ? -1 : 0); }

// ---------------------------------------------------------------- float-only unary
OFX_HD float ofx_exp(float x) { return expf(x); }
OFX_HD float ofx_log(float x) { return logf(x); }
OFX_HD float ofx_sqrt(float x) { return sqrtf(x); }
OFX_HD float ofx_reciprocal(float x) { return 1.0f / x; }
OFX_HD float ofx_sin(float x) { return sinf(x); }
OFX_HD float ofx_cos(float x) { return cosf(x); }
OFX_HD float ofx_atan(float x) { return atanf(x); }
OFX_HD float ofx_tanh(float x) { return tanhf(x); }
OFX_HD float ofx_erf(float x) { return erff(x); }
OFX_HD float ofx_floor(float x) { return floorf(x); }
OFX_HD float ofx_ceil(float x) { return ceilf(x); }
OFX_HD float ofx_round(float x) { return rintf(x); }  // half to even (default rounding mode)

OFX_HD float ofx_sigmoid(float x) {
  if (x >= 0.f) return 1.0f / (1.0f + expf(-x));
  float e = expf(x);
  return e / (1.0f + e);
}
OFX_HD float ofx_relu(float x) { return x > 0.f ? x : (x == x ? 0.f : x); }
OFX_HD int ofx_relu(int x) { return x > 0 ? x : 0; }
OFX_HD ofx_i64 ofx_relu(ofx_i64 x) { return x > 0 ? x : 0; }
OFX_HD float ofx_softplus(float x) { return x > 0.f ? x + log1pf(expf(-x)) : log1pf(expf(x)); }
OFX_HD float ofx_softsign(float x) { return x / (1.0f + fabsf(x)); }
OFX_HD float ofx_mish(float x) { return x * tanhf(ofx_softplus(x)); }
OFX_HD float ofx_hard_swish(float x) {
  float t = x * (1.0f / 6.0f) + 0.5f;
  t = t < 0.f ? 0.f : (t > 1.f ? 1.f : t);
  return x * t;
}
OFX_HD float ofx_leaky_relu(float x, float alpha) { return x < 0.f ? alpha * x : x; }
OFX_HD float ofx_elu(float x, float alpha) { return x < 0.f ? alpha * expm1f(x) : x; }
OFX_HD float ofx_celu(float x, float alpha) {
  float neg = alpha * expm1f(x / alpha);
  return (x > 0.f ? x : 0.f) + (neg < 0.f ? neg : 0.f);
}
OFX_HD float ofx_selu(float x, float alpha, float gamma) {
  return x > 0.f ? gamma * x : gamma * (alpha * expf(x) - alpha);
}
OFX_HD float ofx_hard_sigmoid(float x, float alpha, float beta) {
  float t = alpha * x + beta;
  return t < 0.f ? 0.f : (t > 1.f ? 1.f : t);
}
OFX_HD float ofx_gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752440f)); }
OFX_HD float ofx_gelu_tanh(float x) {
  float inner = 0.79788456080286535588f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.0f + tanhf(inner));
}
// Clip: lower bound first, then upper (ONNX: if min > max the result is max). NaN passes through.
OFX_HD float ofx_clip(float x, float lo, float hi) { x = x < lo ? lo : x; return x > hi ? hi : x; }
OFX_HD int ofx_clip(int x, int lo, int hi) { x = x < lo ? lo : x; return x > hi ? hi : x; }
OFX_HD ofx_i64 ofx_clip(ofx_i64 x, ofx_i64 lo, ofx_i64 hi) { x = x < lo ? lo : x; return x > hi ? hi : x; }

template <typename T> OFX_HD T ofx_identity(T x) { return x; }
template <typename T> OFX_HD T ofx_where(bool c, T a, T b) { return c ? a : b; }

// ---------------------------------------------------------------- comparisons and logic
template <typename T> OFX_HD bool ofx_equal(T a, T b) { return a == b; }
template <typename T> OFX_HD bool ofx_less(T a, T b) { return a < b; }
template <typename T> OFX_HD bool ofx_less_equal(T a, T b) { return a <= b; }
template <typename T> OFX_HD bool ofx_greater(T a, T b) { return a > b; }
template <typename T> OFX_HD bool ofx_greater_equal(T a, T b) { return a >= b; }
OFX_HD bool ofx_not(bool a) { return !a; }
OFX_HD bool ofx_and(bool a, bool b) { return a && b; }
OFX_HD bool ofx_or(bool a, bool b) { return a || b; }
OFX_HD bool ofx_xor(bool a, bool b) { return a != b; }

// ---------------------------------------------------------------- Cast
// Conversions between compute types. A float16/bfloat16 source is first rounded to its storage
// dtype (done by the caller through ofx_round_f16/bf16); a float16/bfloat16 destination is
// rounded here by the caller too. Float -> integer truncates toward zero (as C, ONNX Runtime);
// out-of-range and NaN inputs saturate instead of being undefined behaviour.
OFX_HD int ofx_f2i32(float x) {
  return x != x ? 0 : (x >= 2147483648.0f ? 2147483647 : (x <= -2147483648.0f ? OFX_I32_MIN : (int)x));
}
OFX_HD ofx_i64 ofx_f2i64(float x) {
  return x != x ? 0
                : (x >= 9223372036854775808.0f ? (ofx_i64)9223372036854775807LL
                                               : (x <= -9223372036854775808.0f ? (ofx_i64)OFX_I64_MIN : (ofx_i64)x));
}
OFX_HD float ofx_cast_f(float x) { return x; }
OFX_HD float ofx_cast_f(int x) { return (float)x; }
OFX_HD float ofx_cast_f(ofx_i64 x) { return (float)x; }
OFX_HD float ofx_cast_f(bool x) { return x ? 1.0f : 0.0f; }
OFX_HD int ofx_cast_i32(float x) { return ofx_f2i32(x); }
OFX_HD int ofx_cast_i32(int x) { return x; }
OFX_HD int ofx_cast_i32(ofx_i64 x) { return (int)(unsigned int)(unsigned long long)x; }
OFX_HD int ofx_cast_i32(bool x) { return x ? 1 : 0; }
OFX_HD ofx_i64 ofx_cast_i64(float x) { return ofx_f2i64(x); }
OFX_HD ofx_i64 ofx_cast_i64(int x) { return (ofx_i64)x; }
OFX_HD ofx_i64 ofx_cast_i64(ofx_i64 x) { return x; }
OFX_HD ofx_i64 ofx_cast_i64(bool x) { return x ? 1 : 0; }
OFX_HD bool ofx_cast_b(float x) { return x != 0.0f; }
OFX_HD bool ofx_cast_b(int x) { return x != 0; }
OFX_HD bool ofx_cast_b(ofx_i64 x) { return x != 0; }
OFX_HD bool ofx_cast_b(bool x) { return x; }

#endif  // ONNXFUSE_OPS_H_
