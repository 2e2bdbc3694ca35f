// CPU kernel: interprets the program over blocks of kBlock elements. Each value gets a block
// buffer of its compute type (float for float32/float16/bfloat16, int, int64, bool); the op maths
// is the same ops.h the CUDA kernels are generated from.
#include "cpu_kernel.h"

#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "ops.h"

// Every op needs a case in CpuEvaluator::run_block's switch (generic ones come from op_table.gen.h).
#pragma GCC diagnostic error "-Wswitch"

namespace onnxfuse {

namespace {

size_t compute_size(DType t) {
  switch (t) {
    case DType::F32: case DType::F16: case DType::BF16: return sizeof(float);
    case DType::I32: return sizeof(int);
    case DType::I64: return sizeof(ofx_i64);
    case DType::BOOL: return sizeof(bool);
  }
  return 8;
}

enum Cls { kF, kI, kL, kB };
Cls cls_of(DType t) {
  if (is_float(t)) return kF;
  if (t == DType::I32) return kI;
  if (t == DType::I64) return kL;
  return kB;
}

template <class R, class A, class F>
inline void map1(R* __restrict r, const A* __restrict a, int n, F f) {
  for (int k = 0; k < n; ++k) r[k] = f(a[k]);
}
template <class R, class A, class B, class F>
inline void map2(R* __restrict r, const A* a, const B* b, int n, F f) {
  for (int k = 0; k < n; ++k) r[k] = f(a[k], b[k]);
}

// Load `count` elements of an input (storage dtype t) into its compute buffer.
template <class S, class C, class Conv>
void gather(const S* src, C* dst, const BroadcastLayout& L, size_t i, int64_t start, int count, Conv conv) {
  int kind = L.kind[i];
  if (kind == BroadcastLayout::kFull) {
    const S* p = src + start;
    for (int k = 0; k < count; ++k) dst[k] = conv(p[k]);
    return;
  }
  if (kind == BroadcastLayout::kScalar) {
    C v = conv(src[0]);
    for (int k = 0; k < count; ++k) dst[k] = v;
    return;
  }
  const int nd = static_cast<int>(L.dims.size());  // <= kMaxRank: make_layout checks, run_block asserts
  const int64_t* dims = L.dims.data();
  const int64_t* st = L.strides[i].data();
  int64_t coord[kMaxRank];
  int64_t rem = start, off = 0;
  for (int d = nd - 1; d >= 0; --d) {
    coord[d] = rem % dims[d];
    rem /= dims[d];
    off += coord[d] * st[d];
  }
  const int last = nd - 1;
  int k = 0;
  while (k < count) {
    // run along the innermost dim
    int64_t run = dims[last] - coord[last];
    if (run > count - k) run = count - k;
    const int64_t s = st[last];
    for (int64_t r = 0; r < run; ++r) dst[k + r] = conv(src[off + r * s]);
    k += static_cast<int>(run);
    off += run * s;
    coord[last] += run;
    // carry
    for (int d = last; d > 0 && coord[d] == dims[d]; --d) {
      off -= coord[d] * st[d];
      coord[d] = 0;
      ++coord[d - 1];
      off += st[d - 1];
    }
  }
}

}  // namespace

CpuEvaluator::CpuEvaluator(const Program& prog, std::vector<DType> in_dtypes, std::vector<DType> out_dtypes)
    : prog_(prog), in_dtype_(std::move(in_dtypes)), out_dtype_(std::move(out_dtypes)) {
  // Storage differs from the program's dtype only as float16 -> float32 (same compute buffer).
  if (in_dtype_.size() != prog.inputs.size()) {
    in_dtype_.clear();
    for (int v : prog.inputs) in_dtype_.push_back(prog.values[v].dtype);
  }
  if (out_dtype_.size() != prog.outputs.size()) {
    out_dtype_.clear();
    for (int v : prog.outputs) out_dtype_.push_back(prog.values[v].dtype);
  }
  size_t off = 0;
  for (const auto& v : prog.values) {
    offset_.push_back(off);
    off += (compute_size(v.dtype) * kBlock + 63) / 64 * 64;
  }
  scratch_bytes_ = off;
  used_.assign(prog.values.size(), false);
  for (const auto& ins : prog.instrs)
    for (int a : ins.args) used_[a] = true;
  for (int o : prog.outputs) used_[o] = true;
}

void CpuEvaluator::run_block(const void* const* in, void* const* out, const BroadcastLayout& L, int64_t start,
                             int n) const {
  // make_layout never gives more dims than kMaxRank; a layout built any other way must not reach
  // gather()'s fixed coordinate array (the callers turn the exception into an OrtStatus).
  if (L.dims.empty() || L.dims.size() > static_cast<size_t>(kMaxRank)) throw std::length_error(rank_limit_error(L.dims.size()));
  thread_local std::vector<unsigned char> scratch_storage;
  if (scratch_storage.size() < scratch_bytes_ + 64) scratch_storage.resize(scratch_bytes_ + 64);
  unsigned char* base = scratch_storage.data();
  base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
  auto F = [&](int v) { return reinterpret_cast<float*>(base + offset_[v]); };
  auto I = [&](int v) { return reinterpret_cast<int*>(base + offset_[v]); };
  auto Lg = [&](int v) { return reinterpret_cast<ofx_i64*>(base + offset_[v]); };
  auto B = [&](int v) { return reinterpret_cast<bool*>(base + offset_[v]); };

  // Inputs and constants.
  for (size_t vi = 0; vi < prog_.values.size(); ++vi) {
    const Value& v = prog_.values[vi];
    int id = static_cast<int>(vi);
    if (!used_[vi]) continue;
    if (v.kind == Value::kInput) {
      size_t i = static_cast<size_t>(v.input_index);
      const void* src = in[i];
      switch (in_dtype_[i]) {
        case DType::F32: gather(static_cast<const float*>(src), F(id), L, i, start, n, [](float x) { return x; }); break;
        case DType::F16: gather(static_cast<const unsigned short*>(src), F(id), L, i, start, n, [](unsigned short x) { return ofx_h2f(x); }); break;
        case DType::BF16: gather(static_cast<const unsigned short*>(src), F(id), L, i, start, n, [](unsigned short x) { return ofx_bf2f(x); }); break;
        case DType::I32: gather(static_cast<const int*>(src), I(id), L, i, start, n, [](int x) { return x; }); break;
        case DType::I64: gather(static_cast<const ofx_i64*>(src), Lg(id), L, i, start, n, [](ofx_i64 x) { return x; }); break;
        case DType::BOOL: gather(static_cast<const bool*>(src), B(id), L, i, start, n, [](bool x) { return x; }); break;
      }
    } else if (v.kind == Value::kConst) {
      switch (cls_of(v.dtype)) {
        case kF: { float c = static_cast<float>(v.fconst); float* d = F(id); for (int k = 0; k < n; ++k) d[k] = c; break; }
        case kI: { int c = static_cast<int>(v.iconst); int* d = I(id); for (int k = 0; k < n; ++k) d[k] = c; break; }
        case kL: { ofx_i64 c = v.iconst; ofx_i64* d = Lg(id); for (int k = 0; k < n; ++k) d[k] = c; break; }
        case kB: { bool c = v.iconst != 0; bool* d = B(id); for (int k = 0; k < n; ++k) d[k] = c; break; }
      }
    }
  }

  for (const Instr& ins : prog_.instrs) {
    const int r = ins.result;
    const int a0 = ins.args[0];
    const int a1 = ins.args.size() > 1 ? ins.args[1] : -1;
    const DType t0 = prog_.values[a0].dtype;
    const Cls c0 = cls_of(t0);
    const float fa = static_cast<float>(ins.a), fb = static_cast<float>(ins.b);

#define OFX_F1(FN) map1(F(r), F(a0), n, [&](float x) { return FN; })
#define OFX_NUM1(FN)                                                        \
  switch (c0) {                                                             \
    case kF: map1(F(r), F(a0), n, [](float x) { return FN(x); }); break;    \
    case kI: map1(I(r), I(a0), n, [](int x) { return FN(x); }); break;      \
    case kL: map1(Lg(r), Lg(a0), n, [](ofx_i64 x) { return FN(x); }); break; \
    default: break;                                                         \
  }
#define OFX_NUM2(FN)                                                                          \
  switch (c0) {                                                                               \
    case kF: map2(F(r), F(a0), F(a1), n, [](float x, float y) { return FN(x, y); }); break;    \
    case kI: map2(I(r), I(a0), I(a1), n, [](int x, int y) { return FN(x, y); }); break;        \
    case kL: map2(Lg(r), Lg(a0), Lg(a1), n, [](ofx_i64 x, ofx_i64 y) { return FN(x, y); }); break; \
    default: break;                                                                           \
  }
#define OFX_CMP(FN)                                                                           \
  switch (c0) {                                                                               \
    case kF: map2(B(r), F(a0), F(a1), n, [](float x, float y) { return FN(x, y); }); break;    \
    case kI: map2(B(r), I(a0), I(a1), n, [](int x, int y) { return FN(x, y); }); break;        \
    case kL: map2(B(r), Lg(a0), Lg(a1), n, [](ofx_i64 x, ofx_i64 y) { return FN(x, y); }); break; \
    case kB: map2(B(r), B(a0), B(a1), n, [](bool x, bool y) { return FN(x, y); }); break;      \
  }

    switch (ins.op) {
      // Ops of the generic forms (op_table.gen.h, from expr.OP_TABLE): one case per op.
#define OFX_CASE_NUM1(OP, FN) case Op::OP: OFX_NUM1(FN); break;
#define OFX_CASE_NUM2(OP, FN) case Op::OP: OFX_NUM2(FN); break;
#define OFX_CASE_F1A0(OP, FN) case Op::OP: OFX_F1(FN(x)); break;
#define OFX_CASE_F1A1(OP, FN) case Op::OP: OFX_F1(FN(x, fa)); break;
#define OFX_CASE_F1A2(OP, FN) case Op::OP: OFX_F1(FN(x, fa, fb)); break;
#define OFX_CASE_F2(OP, FN) case Op::OP: map2(F(r), F(a0), F(a1), n, [](float x, float y) { return FN(x, y); }); break;
#define OFX_CASE_CMP(OP, FN) case Op::OP: OFX_CMP(FN); break;
#define OFX_CASE_B1(OP, FN) case Op::OP: map1(B(r), B(a0), n, [](bool x) { return FN(x); }); break;
#define OFX_CASE_B2(OP, FN) case Op::OP: map2(B(r), B(a0), B(a1), n, [](bool x, bool y) { return FN(x, y); }); break;
      ONNXFUSE_OPS_NUMERIC1(OFX_CASE_NUM1)
      ONNXFUSE_OPS_NUMERIC2(OFX_CASE_NUM2)
      ONNXFUSE_OPS_FLOAT1_A0(OFX_CASE_F1A0)
      ONNXFUSE_OPS_FLOAT1_A1(OFX_CASE_F1A1)
      ONNXFUSE_OPS_FLOAT1_A2(OFX_CASE_F1A2)
      ONNXFUSE_OPS_FLOAT2(OFX_CASE_F2)
      ONNXFUSE_OPS_COMPARE(OFX_CASE_CMP)
      ONNXFUSE_OPS_BOOL1(OFX_CASE_B1)
      ONNXFUSE_OPS_BOOL2(OFX_CASE_B2)
#undef OFX_CASE_NUM1
#undef OFX_CASE_NUM2
#undef OFX_CASE_F1A0
#undef OFX_CASE_F1A1
#undef OFX_CASE_F1A2
#undef OFX_CASE_F2
#undef OFX_CASE_CMP
#undef OFX_CASE_B1
#undef OFX_CASE_B2
      // Ops of form special (ONNXFUSE_OPS_SPECIAL); -Werror=switch above catches one without a case.
      case Op::Gelu:
        if (ins.approximate_tanh) OFX_F1(ofx_gelu_tanh(x));
        else OFX_F1(ofx_gelu(x));
        break;
      case Op::Clip:
        switch (c0) {
          case kF: OFX_F1(ofx_clip(x, fa, fb)); break;
          case kI: { int lo = static_cast<int>(ins.ilo), hi = static_cast<int>(ins.ihi);
            map1(I(r), I(a0), n, [&](int x) { return ofx_clip(x, lo, hi); }); break; }
          case kL: { ofx_i64 lo = ins.ilo, hi = ins.ihi;
            map1(Lg(r), Lg(a0), n, [&](ofx_i64 x) { return ofx_clip(x, lo, hi); }); break; }
          default: break;
        }
        break;
      case Op::Identity:
        std::memcpy(base + offset_[r], base + offset_[a0], compute_size(t0) * n);
        break;
      case Op::Cast: {
        // Round a float16/bfloat16 source to its storage dtype, convert, round to the target.
        const DType to = ins.to;
        if (c0 == kF) {
          float* src = F(a0);
          float tmp[kBlock];
          if (t0 == DType::F16) { for (int k = 0; k < n; ++k) tmp[k] = ofx_round_f16(src[k]); src = tmp; }
          if (t0 == DType::BF16) { for (int k = 0; k < n; ++k) tmp[k] = ofx_round_bf16(src[k]); src = tmp; }
          switch (to) {
            case DType::F32: map1(F(r), src, n, [](float x) { return x; }); break;
            case DType::F16: map1(F(r), src, n, [](float x) { return ofx_round_f16(x); }); break;
            case DType::BF16: map1(F(r), src, n, [](float x) { return ofx_round_bf16(x); }); break;
            case DType::I32: map1(I(r), src, n, [](float x) { return ofx_cast_i32(x); }); break;
            case DType::I64: map1(Lg(r), src, n, [](float x) { return ofx_cast_i64(x); }); break;
            case DType::BOOL: map1(B(r), src, n, [](float x) { return ofx_cast_b(x); }); break;
          }
        } else {
#define OFX_CAST_FROM(ACC, T)                                                                   \
  switch (to) {                                                                                 \
    case DType::F32: map1(F(r), ACC(a0), n, [](T x) { return ofx_cast_f(x); }); break;          \
    case DType::F16: map1(F(r), ACC(a0), n, [](T x) { return ofx_round_f16(ofx_cast_f(x)); }); break; \
    case DType::BF16: map1(F(r), ACC(a0), n, [](T x) { return ofx_round_bf16(ofx_cast_f(x)); }); break; \
    case DType::I32: map1(I(r), ACC(a0), n, [](T x) { return ofx_cast_i32(x); }); break;        \
    case DType::I64: map1(Lg(r), ACC(a0), n, [](T x) { return ofx_cast_i64(x); }); break;       \
    case DType::BOOL: map1(B(r), ACC(a0), n, [](T x) { return ofx_cast_b(x); }); break;         \
  }
          if (c0 == kI) { OFX_CAST_FROM(I, int) }
          else if (c0 == kL) { OFX_CAST_FROM(Lg, ofx_i64) }
          else { OFX_CAST_FROM(B, bool) }
#undef OFX_CAST_FROM
        }
        break;
      }
      case Op::Where: {
        const bool* c = B(a0);
        const int x = a1, y = ins.args[2];
        switch (cls_of(prog_.values[x].dtype)) {
          case kF: { float *o = F(r), *p = F(x), *q = F(y); for (int k = 0; k < n; ++k) o[k] = ofx_where(c[k], p[k], q[k]); break; }
          case kI: { int *o = I(r), *p = I(x), *q = I(y); for (int k = 0; k < n; ++k) o[k] = ofx_where(c[k], p[k], q[k]); break; }
          case kL: { ofx_i64 *o = Lg(r), *p = Lg(x), *q = Lg(y); for (int k = 0; k < n; ++k) o[k] = ofx_where(c[k], p[k], q[k]); break; }
          case kB: { bool *o = B(r), *p = B(x), *q = B(y); for (int k = 0; k < n; ++k) o[k] = ofx_where(c[k], p[k], q[k]); break; }
        }
        break;
      }
      case Op::NumOps: break;
    }
#undef OFX_F1
#undef OFX_NUM1
#undef OFX_NUM2
#undef OFX_CMP
  }

  // Outputs: round to the declared storage dtype.
  for (size_t j = 0; j < prog_.outputs.size(); ++j) {
    const int v = prog_.outputs[j];
    const DType t = out_dtype_[j];
    switch (t) {
      case DType::F32: std::memcpy(static_cast<float*>(out[j]) + start, F(v), sizeof(float) * n); break;
      case DType::F16: { unsigned short* o = static_cast<unsigned short*>(out[j]) + start; const float* s = F(v);
        for (int k = 0; k < n; ++k) o[k] = ofx_f2h(s[k]);
        break; }
      case DType::BF16: { unsigned short* o = static_cast<unsigned short*>(out[j]) + start; const float* s = F(v);
        for (int k = 0; k < n; ++k) o[k] = ofx_f2bf(s[k]);
        break; }
      case DType::I32: std::memcpy(static_cast<int*>(out[j]) + start, I(v), sizeof(int) * n); break;
      case DType::I64: std::memcpy(static_cast<ofx_i64*>(out[j]) + start, Lg(v), sizeof(ofx_i64) * n); break;
      case DType::BOOL: std::memcpy(static_cast<bool*>(out[j]) + start, B(v), sizeof(bool) * n); break;
    }
  }
}

void CpuEvaluator::run_blocks(const void* const* in, void* const* out, const BroadcastLayout& L, int64_t b0,
                              int64_t b1) const {
  for (int64_t b = b0; b < b1; ++b) {
    int64_t start = b * kBlock;
    int64_t cnt = L.n - start < kBlock ? L.n - start : kBlock;
    if (cnt > 0) run_block(in, out, L, start, static_cast<int>(cnt));
  }
}

}  // namespace onnxfuse
