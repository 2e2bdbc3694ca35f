"""The CUDA source of FusedElementwise's fast half-precision maths: one function per op that has one,
carried by its row of :data:`onnxfuse.custom_ops.expr.OP_TABLE` (``fast_src``), written into the
generated header (``csrc/op_table.gen.h``: ``kFastPrelude``, rows in table order, so a function another
calls comes first) by ``tools/gen_op_table.py``. Adding a fast path is one row: its name in ``fast`` (or
``fast_bf16``) and its source here (issue 36: it used to be four places).

Why they exist and what they promise is the :data:`HEADER` comment, emitted above them.
"""

from __future__ import annotations

#: The comment above the functions in the generated CUDA source: their accuracy contract.
HEADER = r"""// ---- Fast maths for ops whose declared dtype is float16 / bfloat16 -------------------------------
// Their results are rounded to half precision (unit roundoff 2^-11 for float16, 2^-8 for bfloat16)
// anyway; every function here has a relative error at most 2^-16 (bfloat16 tanh: 2^-10.987) wherever
// the result is a normal float, i.e. 32x (8x) below that rounding. Bounds are the documented ones:
// CUDA C++ Programming Guide, "Intrinsic Functions" (ulp = 2^-23 relative at worst) and the PTX ISA.
// float32 ops keep the accurate ops.h functions. The CPU kernel is unchanged (ops.h).
"""

#: Div (ofx_fast_div): also what Reciprocal and Softsign divide with, so it comes first in the table.
DIV = r"""// IEEE a/b, or __fdividef where its bound holds: max 2 ulp for 2^-126 <= |b| <= 2^126. Outside it
// (b zero, subnormal, > 2^126, inf, NaN) __fdividef returns 0 or NaN, so those take a / b.
__device__ __forceinline__ float ofx_fast_div(float a, float b) {
  const float ab = fabsf(b);
  return (ab >= 0x1p-126f && ab <= 0x1p126f) ? __fdividef(a, b) : a / b;
}
"""

#: Reciprocal (ofx_fast_reciprocal).
RECIPROCAL = r"""__device__ __forceinline__ float ofx_fast_reciprocal(float x) { return ofx_fast_div(1.0f, x); }
"""

#: Exp (ofx_fast_exp).
EXP = r"""// __expf (ex2.approx.ftz of x*log2(e)): max 2 + floor(|1.173 x|) ulp. Finite non-zero float results
// need |x| < 88.8, so at most 106 ulp = 2^-16.3 (float16's range, |x| < 17.4: 22 ulp = 2^-18.5).
// Results below 2^-126 flush to 0 (absolute error < 2^-126; zero in float16 anyway).
__device__ __forceinline__ float ofx_fast_exp(float x) { return __expf(x); }
"""

#: Sigmoid (ofx_fast_sigmoid): also Gelu's tanh form.
SIGMOID = r"""// 1 / (1 + e^-x). The denominator is >= 1, so __fdividef is within its bound (2 ulp) up to 2^126 and
// gives 0 beyond (also for e^-x = inf, x -> -inf): true result < 2^-126. Error: e^-x's
// (2 + floor(|1.173 x|) ulp, weighted by e/(1+e) <= 1) + 2.5 ulp, so <= 2^-16 while the result is
// >= 2^-126 (|x| <= 87.4). x = +inf -> 1, NaN -> NaN.
__device__ __forceinline__ float ofx_fast_sigmoid(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
"""

#: Tanh (ofx_fast_tanh; ofx_fast_tanh_bf16 for bfloat16).
TANH = r"""// tanh without tanh.approx (whose documented bound, 2^-10.987, is float16's own rounding error):
// |x| >= 1/4: 1 - 2/(e^{2|x|} + 1): e^{2|x|} within 23 ulp for 2|x| <= 18 (beyond, the result
// rounds to 1 whatever the error), the quotient q <= 0.76 within 2^-18.3, so 1 - q >= tanh(1/4) =
// 0.245 within 0.76 * 2^-18.3 / 0.245 = 2^-16.7 relative. |x| < 1/4: odd Taylor polynomial to x^7,
// truncation error 62/2835 x^9 (relative 2^-21.5). Sign by copysign (tanh(-0) = -0, NaN -> NaN).
__device__ __forceinline__ float ofx_fast_tanh(float x) {
  const float a = fabsf(x);
  const float q = __fdividef(2.0f, 1.0f + __expf(2.0f * a));
  const float a2 = a * a;
  const float p = fmaf(a * a2, fmaf(a2, fmaf(a2, -0.053968254f, 0.13333334f), -0.33333334f), a);
  return copysignf(a < 0.25f ? p : 1.0f - q, x);
}
// bfloat16 tanh: tanh.approx.f32 (sm_75+, one MUFU op), max relative error 2^-10.987 (PTX ISA),
// 1/8 of bfloat16's unit roundoff 2^-8. Not used for float16 (see ofx_fast_tanh), nor inside
// Gelu (1 + tanh(u) cancels for u << 0).
__device__ __forceinline__ float ofx_fast_tanh_bf16(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750 && !defined(OFX_NO_TANH_APPROX)
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return ofx_fast_tanh(x);
#endif
}
"""

#: Softsign (ofx_fast_softsign).
SOFTSIGN = r"""// x / (1 + |x|): ofx_fast_div (2 ulp).
__device__ __forceinline__ float ofx_fast_softsign(float x) { return ofx_fast_div(x, 1.0f + fabsf(x)); }
"""

#: Gelu with approximate=tanh (ofx_fast_gelu_tanh).
GELU_TANH = r"""// Gelu, tanh approximation: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3):
// ofx_fast_sigmoid's bound (no cancellation for u << 0, unlike 1 + tanh(u)) + 0.5 ulp.
__device__ __forceinline__ float ofx_fast_gelu_tanh(float x) {
  const float u = 0.79788456080286535588f * (x + 0.044715f * x * x * x);
  return x * ofx_fast_sigmoid(2.0f * u);
}
"""
