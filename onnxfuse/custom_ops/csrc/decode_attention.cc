// DecodeAttention (domain ai.onnxfuse, opset 1): attention of a few query rows per key/value head over a
// long cache, split along the keys (flash-decoding). Why and the maths: onnxfuse/rewrites/contrib/
// contrib_decode_attention.py; the contract: docs/custom-ops.md.
//
//   inputs   query [B, R, G·D] (R rows per key/value head: row s·n + j of head g is query head g·n + j at
//            token s, as AttentionInputs' grouped query writes it), key [B, G, T, D], value [B, G, T, D],
//            optionally bias [1 or B, 1, 1 or S, T] (S = R / n, added to every head's scores of token s)
//   outputs  out [B, R, G·D], scratch (any shape: the split partials, not for reading)
//   attribute spec (string): "num_heads=H kv_num_heads=G head_size=D scale=c max_rows=L", n = H / G
//
// With more than L rows (prefill: another op's work, chosen by an If on the same test) the op computes
// nothing and `out` is [B, 0, G·D].
//
// Row r of head g: out = softmax(c · q_r · Kᵀ + bias[s = r / n]) · V, scores and sums in float32.
// A row whose every score is -inf gets 0 (there is no key to attend to).
#include "decode_attention.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "attention_common.h"
#include "cuda_runtime.h"

namespace onnxfuse {
namespace {

using namespace onnxfuse_ort;

const char* const kOpName = "DecodeAttention";
const OrtApi* api = nullptr;

// Threads per block of the CUDA kernels.
constexpr unsigned kThreads = 256;
// Dims per lane of the kernel variant for a head size: 2 (D <= 64), 4 (D <= 128) or 8 (D <= 256).
int64_t dims_per_lane(int64_t head_size) { return head_size <= 64 ? 2 : head_size <= 128 ? 4 : 8; }
// Query rows per key/value head the CUDA kernel takes (RMAX of its variant: each lane's RMAX · DL
// accumulators stay in registers, within the 128 a thread has at two blocks per multiprocessor; the
// D <= 256 variant needs 168 and runs one): 16 for D <= 64, else 8. The rule, contrib-decode-attention, sends no more (its max_rows mirrors this one).
int64_t max_rows(int64_t head_size) { return head_size <= 64 ? 16 : 8; }

OrtStatus* fail(OrtErrorCode code, const std::string& node, const std::string& msg) {
  return op_error(api, code, kOpName, node, msg);
}

struct Spec {
  int64_t heads = 0, kv_heads = 0, size = 0, max_rows = 0;
  double scale = 0;
};

// The shapes of one call, checked against the spec.
struct Call {
  int64_t B = 0, R = 0, S = 0, T = 0, bias_b = 0, bias_s = 0;  // bias_b 0: no bias
  int type = 0;
  const void* in[4] = {};
  void* out = nullptr;
  std::vector<int64_t> out_dims;
};

OrtStatus* prepare(OrtKernelContext* ctx, const Spec& sp, const std::string& node, Call* c) {
  size_t nin = 0, nout = 0;
  OrtStatus* st;
  if ((st = api->KernelContext_GetInputCount(ctx, &nin))) return st;
  if ((st = api->KernelContext_GetOutputCount(ctx, &nout))) return st;
  if ((nin != 3 && nin != 4) || nout != 2)
    return fail(ORT_INVALID_GRAPH, node, "takes 3 or 4 inputs and 2 outputs, got " + std::to_string(nin) + " and " +
                                             std::to_string(nout));
  const int64_t G = sp.kv_heads, D = sp.size, n = sp.heads / sp.kv_heads;
  std::vector<std::vector<int64_t>> dims(nin);
  std::vector<int> types(nin);
  for (size_t i = 0; i < nin; ++i)
    if ((st = read_input(api, ctx, i, &dims[i], &types[i], &c->in[i]))) return st;
  const auto& q = dims[0];
  if (q.size() != 3 || q[2] != G * D || q[1] % n)
    return fail(ORT_INVALID_ARGUMENT, node, "query is " + shape_text(q) + ", expected [B, S·" + std::to_string(n) + ", " +
                                                std::to_string(G * D) + "]");
  c->B = q[0], c->R = q[1], c->S = q[1] / n;
  for (int i = 1; i <= 2; ++i) {
    const auto& k = dims[i];
    if (k.size() != 4 || k[0] != c->B || k[1] != G || k[3] != D || (i == 2 && k[2] != dims[1][2]))
      return fail(ORT_INVALID_ARGUMENT, node, std::string(i == 1 ? "key" : "value") + " is " + shape_text(k) + ", expected [" +
                                                  std::to_string(c->B) + ", " + std::to_string(G) + ", T, " + std::to_string(D) + "]");
  }
  c->T = dims[1][2];
  if (nin == 4) {
    const auto& m = dims[3];
    if (m.size() != 4 || (m[0] != 1 && m[0] != c->B) || m[1] != 1 || (m[2] != 1 && m[2] != c->S) || m[3] != c->T)
      return fail(ORT_INVALID_ARGUMENT, node, "bias is " + shape_text(m) + ", expected [1 or " + std::to_string(c->B) +
                                                  ", 1, 1 or " + std::to_string(c->S) + ", " + std::to_string(c->T) + "]");
    c->bias_b = m[0], c->bias_s = m[2];
  }
  c->type = types[0];
  for (size_t i = 1; i < nin; ++i)
    if (types[i] != c->type) return fail(ORT_INVALID_ARGUMENT, node, "every input must have the query's element type");
  if (c->type != kFloat && c->type != kFloat16 && c->type != kBFloat16)
    return fail(ORT_INVALID_ARGUMENT, node, "element type " + std::to_string(c->type) + ": float, float16 or bfloat16 only");
  if (c->R > sp.max_rows) c->R = 0;  // not this op's case: an empty output, nothing computed
  c->out_dims = {c->B, c->R, q[2]};
  return make_output(api, ctx, 0, c->out_dims, &c->out);
}

// ------------------------------------------------------------------ CPU

struct CpuDecodeAttention {
  static const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
  Spec spec;
  std::string node;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    try {
      Call c;
      if (OrtStatus* st = prepare(ctx, spec, node, &c)) return st;
      void* scratch = nullptr;
      if (OrtStatus* st = make_output(api, ctx, 1, {0}, &scratch)) return st;
      const int64_t G = spec.kv_heads, D = spec.size, n = spec.heads / spec.kv_heads, T = c.T;
      const float scale = static_cast<float>(spec.scale);
      std::vector<float> scores(T), acc(D);
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t r = 0; r < c.R; ++r) {
            const int64_t qi = ((b * c.R + r) * G + g) * D, kv = (b * G + g) * T * D;
            float top = -std::numeric_limits<float>::infinity();
            for (int64_t t = 0; t < T; ++t) {
              float s = 0;
              for (int64_t d = 0; d < D; ++d) s += load(c.in[0], qi + d, c.type) * scale * load(c.in[1], kv + t * D + d, c.type);
              if (c.bias_b)
                s += load(c.in[3], ((c.bias_b > 1 ? b : 0) * c.bias_s + (c.bias_s > 1 ? r / n : 0)) * T + t, c.type);
              scores[t] = s;
              top = std::max(top, s);
            }
            float sum = 0;
            for (int64_t t = 0; t < T; ++t) {
              scores[t] = top == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(scores[t] - top);
              sum += scores[t];
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t = 0; t < T; ++t)
              for (int64_t d = 0; d < D; ++d) acc[d] += scores[t] * load(c.in[2], kv + t * D + d, c.type);
            for (int64_t d = 0; d < D; ++d) store(c.out, qi + d, c.type, sum > 0 ? acc[d] / sum : 0.f);
          }
      return nullptr;
    } catch (const std::exception& e) {
      return fail(ORT_RUNTIME_EXCEPTION, node, e.what());
    } catch (...) {
      return fail(ORT_RUNTIME_EXCEPTION, node, "unknown error");
    }
  }
};

// ------------------------------------------------------------------ CUDA
// Block (split, b·G + g) takes its keys [split·chunk, …) one tile of TK keys at a time. Every thread first
// issues all of its loads for the tile: its share of one key's row (SPK threads per key, at most four
// 16-byte chunks each) and, for p · V, the V rows of its warp's keys (KPW keys, DL dims per lane). So a
// block has a whole tile in flight at once; the first kernel, which loaded a key's dims in dependent
// steps, ran at 142 GB/s (118 µs per layer at B=8, P=4096 on an H200: docs/benchmarks.md 5.33). Then
// the SPK threads of a key score the R query rows (held in shared memory, float32), the warps take the
// rows' online softmax, and each warp adds p · V for its keys with lane l holding dims l·DL … l·DL + DL - 1
// of every row (accumulators in registers: RMAX·DL <= 64). The warps' sums meet in a tree. One
// split writes the output; several write partials (acc, max, sum per row) that the combine kernel merges.
// Everything in float32. With `vec` (the host checks 16-byte alignment) the loads are 4- to 16-byte
// vectors; otherwise they read element by element, the same layout.
const char* kCudaSource = R"CUDA(
#define THREADS 256
#define WARPS (THREADS / 32)
#define INFINITY __int_as_float(0x7f800000)
struct Args {
  const void* q; const void* k; const void* v; const void* bias; void* out; float* part;
  long long B, R, S, T, G, D, n, bias_b, bias_s, splits, chunk, vec;
  float scale; float pad_;
};
__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
// Element types: ES bytes; raw() the element's bits; unpack() a 32-bit word's 4 / ES elements as floats.
struct F32 {
  enum { ES = 4 };
  static __device__ __forceinline__ unsigned raw(const void* p, long long i) { return ((const unsigned*)p)[i]; }
  static __device__ __forceinline__ void unpack(unsigned w, float* f) { f[0] = __uint_as_float(w); }
  static __device__ __forceinline__ float value(unsigned bits) { return __uint_as_float(bits); }
  static __device__ __forceinline__ float ld(const void* p, long long i) { return ld_f32(p, i); }
  static __device__ __forceinline__ void st(void* p, long long i, float v) { st_f32(p, i, v); }
};
struct F16 {
  enum { ES = 2 };
  static __device__ __forceinline__ unsigned raw(const void* p, long long i) { return ((const u16*)p)[i]; }
  static __device__ __forceinline__ void unpack(unsigned w, float* f) {
    asm("cvt.f32.f16 %0, %1;" : "=f"(f[0]) : "h"((u16)(w & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f[1]) : "h"((u16)(w >> 16)));
  }
  static __device__ __forceinline__ float value(unsigned bits) { float f[2]; unpack(bits, f); return f[0]; }
  static __device__ __forceinline__ float ld(const void* p, long long i) { return ld_f16(p, i); }
  static __device__ __forceinline__ void st(void* p, long long i, float v) { st_f16(p, i, v); }
};
struct BF16 {
  enum { ES = 2 };
  static __device__ __forceinline__ unsigned raw(const void* p, long long i) { return ((const u16*)p)[i]; }
  static __device__ __forceinline__ void unpack(unsigned w, float* f) {
    f[0] = __uint_as_float(w << 16); f[1] = __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ float value(unsigned bits) { return __uint_as_float(bits << 16); }
  static __device__ __forceinline__ float ld(const void* p, long long i) { return ld_bf16(p, i); }
  static __device__ __forceinline__ void st(void* p, long long i, float v) { st_bf16(p, i, v); }
};
// W 32-bit words of elements from element e on (byte offset 16-aligned when W >= 4 and vec); elements at
// or past `lim` read as 0 (only the element path meets them: the host sets vec only when rows are whole
// vectors).
template <class Ty, int W>
__device__ __forceinline__ void load_words(const void* p, long long e, long long lim, bool vec, unsigned* w) {
  enum { EPW = 4 / Ty::ES };
  if (vec) {
    const char* c = (const char*)p + e * Ty::ES;
    if (W == 1) {
      w[0] = *(const unsigned*)c;
    } else if (W == 2) {
      const uint2 x = *(const uint2*)c; w[0] = x.x; w[1] = x.y;
    } else {
      _Pragma("unroll") for (int i = 0; i < W / 4; ++i) {
        const uint4 x = ((const uint4*)c)[i];
        w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
      }
    }
  } else {
    _Pragma("unroll") for (int i = 0; i < W; ++i) {
      unsigned x = 0;
      _Pragma("unroll") for (int u = 0; u < EPW; ++u)
        if (e + i * EPW + u < lim) x |= Ty::raw(p, e + i * EPW + u) << (16 * u);
      w[i] = x;
    }
  }
}
template <class Ty, int DL, int RMAX>
__device__ __forceinline__ void decode_attention(const Args& a) {
  enum { ES = Ty::ES, EPW = 4 / ES, EPC = 16 / ES,  // elements per 32-bit word, per 16-byte chunk
         SPK = DL * ES / 2,                         // threads per key: 4 chunks each cover the variant's widest row
         TK = THREADS / SPK,                        // keys per tile
         KPW = TK / WARPS,                          // keys per warp in p · V
         VW = DL * ES / 4,                          // words of V per lane and key
         QU = (RMAX * 32 * DL + THREADS - 1) / THREADS };  // q elements per thread
  extern __shared__ float smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, kk = tid / SPK, h = tid % SPK;
  const int R = (int)a.R, D = (int)a.D, n = (int)a.n;
  const long long T = a.T, bg = blockIdx.y, b = bg / a.G, g = bg % a.G;
  const int CPR = (D + EPC - 1) / EPC, Dp = CPR * EPC;  // chunks per row; q's padded row
  const int bias_rows = a.bias_b == 0 ? 0 : a.bias_s > 1 ? R / n : 1;  // bias rows a tile reads (tokens)
  const long long t_begin = (long long)blockIdx.x * a.chunk;
  const long long t_end = t_begin + a.chunk < T ? t_begin + a.chunk : T;
  const bool vec = a.vec != 0;
  // q, the scores and the bias rows (the warps' reduction buffer after the last tile) from the start of
  // shared memory (16-byte aligned: q is read as float4), then three floats per row.
  const int region = R * (Dp + 2 * TK) > 4 * R * Dp ? R * (Dp + 2 * TK) : 4 * R * Dp;
  float* qs = smem; float* sc = qs + R * Dp; float* sb = sc + R * TK;
  float* mrow = smem + region; float* lrow = mrow + R; float* frow = lrow + R;
  // q's bits go to registers now; scaled and zero-padded to Dp, they go to shared memory after the first
  // tile's loads are issued, so that their latencies overlap (nothing reads a load's result early).
  unsigned qbits[QU];
  _Pragma("unroll") for (int u = 0; u < QU; ++u) {
    const int i = tid + THREADS * u, r = i / Dp, d = i % Dp;
    qbits[u] = i < R * Dp && d < D ? Ty::raw(a.q, ((b * R + r) * a.G + g) * D + d) : 0u;
  }
  float acc[RMAX][DL];
  _Pragma("unroll") for (int r = 0; r < RMAX; ++r)
    _Pragma("unroll") for (int i = 0; i < DL; ++i) acc[r][i] = 0.f;
  const long long kv = (b * a.G + g) * T * D;
  const long long bias_base = (a.bias_b > 1 ? b : 0) * a.bias_s * T;
  bool first = true;
  for (long long t0 = t_begin; t0 < t_end || first; t0 += TK) {
    const long long left = t_end - t0, keys = left < 0 ? 0 : left < TK ? left : TK, t = t0 + kk;
    unsigned kw[4][4], vw[KPW][VW];
    _Pragma("unroll") for (int i = 0; i < 4; ++i) {
      const int c = h + SPK * i;
      if (kk < keys && c < CPR) load_words<Ty, 4>(a.k, kv + t * D + c * EPC, kv + (t + 1) * D, vec, kw[i]);
      else _Pragma("unroll") for (int u = 0; u < 4; ++u) kw[i][u] = 0u;
    }
    _Pragma("unroll") for (int j = 0; j < KPW; ++j) {
      const int key = warp + WARPS * j, d0 = lane * DL;
      if (key < keys && d0 < D) load_words<Ty, VW>(a.v, kv + (t0 + key) * D + d0, kv + (t0 + key + 1) * D, vec, vw[j]);
      else _Pragma("unroll") for (int u = 0; u < VW; ++u) vw[j][u] = 0u;
    }
    unsigned bv[RMAX];
    _Pragma("unroll") for (int s = 0; s < RMAX; ++s)
      bv[s] = h == 0 && s < bias_rows && kk < keys ? Ty::raw(a.bias, bias_base + s * T + t) : 0u;
    if (first) {
      _Pragma("unroll") for (int u = 0; u < QU; ++u)
        if (tid + THREADS * u < R * Dp) qs[tid + THREADS * u] = Ty::value(qbits[u]) * a.scale;
      for (int r = tid; r < R; r += THREADS) { mrow[r] = -INFINITY; lrow[r] = 0.f; }
      first = false;
      __syncthreads();
      if (keys == 0) break;  /* no keys at all (T = 0): every row is 0 */
    }
    if (h == 0) _Pragma("unroll") for (int s = 0; s < RMAX; ++s) if (s < bias_rows) sb[s * TK + kk] = Ty::value(bv[s]);
    float dots[RMAX];
    _Pragma("unroll") for (int r = 0; r < RMAX; ++r) dots[r] = 0.f;
    _Pragma("unroll") for (int i = 0; i < 4; ++i) {
      const int c = h + SPK * i;
      if (c < CPR) {
        float kf[EPC];
        _Pragma("unroll") for (int u = 0; u < 4; ++u) Ty::unpack(kw[i][u], kf + u * EPW);
        _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {
          const float4* q4 = (const float4*)(qs + r * Dp + c * EPC);
          _Pragma("unroll") for (int u = 0; u < EPC / 4; ++u) {
            const float4 x = q4[u];
            dots[r] += x.x * kf[4 * u] + x.y * kf[4 * u + 1] + x.z * kf[4 * u + 2] + x.w * kf[4 * u + 3];
          }
        }
      }
    }
    _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {
      float s = dots[r];
      _Pragma("unroll") for (int o = SPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (h == 0) {
        if (bias_rows) s += sb[(bias_rows > 1 ? r / n : 0) * TK + kk];  /* this thread wrote it */
        sc[r * TK + kk] = kk < keys ? s : -INFINITY;
      }
    }
    __syncthreads();
    for (int r = warp; r < R; r += WARPS) {
      float mx = -INFINITY;
      for (int j = lane; j < TK; j += 32) mx = fmaxf(mx, sc[r * TK + j]);
      mx = warp_max(mx);
      const float m_new = fmaxf(mrow[r], mx);
      const float f = m_new == -INFINITY ? 1.f : __expf(mrow[r] - m_new);
      float sum = 0.f;
      for (int j = lane; j < TK; j += 32) {
        const float p = m_new == -INFINITY ? 0.f : __expf(sc[r * TK + j] - m_new);
        sc[r * TK + j] = p; sum += p;
      }
      sum = warp_sum(sum);
      __syncwarp();
      if (lane == 0) { lrow[r] = lrow[r] * f + sum; mrow[r] = m_new; frow[r] = f; }
    }
    __syncthreads();
    _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {
      const float f = frow[r];
      _Pragma("unroll") for (int i = 0; i < DL; ++i) acc[r][i] *= f;
    }
    _Pragma("unroll") for (int j = 0; j < KPW; ++j) {
      const int key = warp + WARPS * j;
      if (key < keys) {
        float vf[DL];
        _Pragma("unroll") for (int u = 0; u < VW; ++u) Ty::unpack(vw[j][u], vf + u * EPW);
        _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {
          const float p = sc[r * TK + key];
          _Pragma("unroll") for (int i = 0; i < DL; ++i) acc[r][i] += p * vf[i];
        }
      }
    }
    __syncthreads();
  }
  // The warps' sums: a tree through shared memory (q, the scores and the bias rows are done with), four
  // warps, then two, then one add another's; warp 0 ends with every row's total. (Shared float atomics
  // are a compare-and-swap loop on sm_90: eight warps on the same addresses cost several µs.)
  float* buf = qs;  /* [WARPS / 2][R][Dp] */
  _Pragma("unroll") for (int half = WARPS / 2; half >= 1; half /= 2) {
    if (warp >= half && warp < 2 * half)
      _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R)
        _Pragma("unroll") for (int i = 0; i < DL; ++i)
          if (lane * DL + i < D) buf[((warp - half) * R + r) * Dp + lane * DL + i] = acc[r][i];
    __syncthreads();
    if (warp < half)
      _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R)
        _Pragma("unroll") for (int i = 0; i < DL; ++i)
          if (lane * DL + i < D) acc[r][i] += buf[(warp * R + r) * Dp + lane * DL + i];
    __syncthreads();
  }
  if (warp != 0) return;
  const long long BG = a.B * a.G, split = blockIdx.x;
  _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {
    const float m = mrow[r], l = lrow[r];
    _Pragma("unroll") for (int i = 0; i < DL; ++i) {
      const int d = lane * DL + i;
      if (d >= D) continue;
      if (a.splits == 1) {
        Ty::st(a.out, ((b * R + r) * a.G + g) * D + d, l > 0.f ? acc[r][i] / l : 0.f);
      } else {
        const long long prow = (split * BG + bg) * R + r;
        a.part[prow * D + d] = acc[r][i];
        if (d == 0) { a.part[a.splits * BG * R * D + prow] = m; a.part[a.splits * BG * R * (D + 1) + prow] = l; }
      }
    }
  }
}
// One thread per output element (b, g, r, d): the splits' partials merged in one online-softmax pass,
// eight splits at a time whose loads are all issued before any is used (a loop that used each split's
// values at once waited a memory round trip per split: 12.6 µs for 33 splits on an H100).
template <class Ty>
__device__ __forceinline__ void decode_combine(const Args& a) {
  const long long BG = a.B * a.G, R = a.R, D = a.D;
  const long long i = (long long)blockIdx.x * THREADS + threadIdx.x;
  if (i >= BG * R * D) return;
  const long long d = i % D, r = (i / D) % R, bg = i / (D * R), b = bg / a.G, g = bg % a.G;
  const float* m = a.part + a.splits * BG * R * D;
  const float* l = a.part + a.splits * BG * R * (D + 1);
  float top = -INFINITY, sum = 0.f, acc = 0.f;
  for (long long s0 = 0; s0 < a.splits; s0 += 8) {
    float ms[8], ls[8], ps[8];
    _Pragma("unroll") for (int u = 0; u < 8; ++u) {
      const long long row = ((s0 + u) * BG + bg) * R + r;
      const bool in = s0 + u < a.splits;
      ms[u] = in ? m[row] : -INFINITY; ls[u] = in ? l[row] : 0.f; ps[u] = in ? a.part[row * D + d] : 0.f;
    }
    _Pragma("unroll") for (int u = 0; u < 8; ++u) {
      if (ms[u] == -INFINITY) continue;  /* a split with every key masked (or past the last) adds nothing */
      const float top_new = fmaxf(top, ms[u]);
      const float f = __expf(top - top_new), w = __expf(ms[u] - top_new);
      sum = sum * f + ls[u] * w; acc = acc * f + ps[u] * w; top = top_new;
    }
  }
  Ty::st(a.out, ((b * R + r) * a.G + g) * D + d, sum > 0.f ? acc / sum : 0.f);
}
#define OFX_DECODE_ATTENTION(T, TY)                                                                      \
  extern "C" __global__ void __launch_bounds__(THREADS, 2) ofx_decode_attention_##T##_d64(Args a) {    \
    decode_attention<TY, 2, 16>(a); }                                                                    \
  extern "C" __global__ void __launch_bounds__(THREADS, 2) ofx_decode_attention_##T##_d128(Args a) {   \
    decode_attention<TY, 4, 8>(a); }                                                                     \
  extern "C" __global__ void __launch_bounds__(THREADS, 1) ofx_decode_attention_##T##_d256(Args a) {   \
    decode_attention<TY, 8, 8>(a); }                                                                     \
  extern "C" __global__ void ofx_decode_attention_##T##_combine(Args a) { decode_combine<TY>(a); }
OFX_DECODE_ATTENTION(f32, F32)
OFX_DECODE_ATTENTION(f16, F16)
OFX_DECODE_ATTENTION(bf16, BF16)
)CUDA";

// The kernel's argument block, laid out as `struct Args` above (8-byte fields, two floats last).
struct CudaArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* bias;
  void* out;
  float* part;
  long long B, R, S, T, G, D, n, bias_b, bias_s, splits, chunk, vec;
  float scale, pad_;
};

// Keys per tile of the kernel variant (TK above): 256 threads / (dims per lane · element size / 2).
int64_t tile_keys(int64_t head_size, size_t element_size) {
  return kThreads / (dims_per_lane(head_size) * static_cast<int64_t>(element_size) / 2);
}

// Keys per split: enough blocks to fill the GPU (`resident`: the blocks the device runs at once) when
// the heads alone do not, a whole number of tiles per block.
// Shared memory of the kernel, in floats: q [R][Dp] (Dp: D rounded up to whole 16-byte chunks), the
// scores [R][TK] and the tile's bias rows [≤ R][TK], which the warps' reduction reuses ([4][R][Dp])
// after the last tile; then three per row.
int64_t shared_floats(int64_t rows, int64_t head_size, int64_t tile, size_t element_size) {
  const int64_t per_chunk = 16 / static_cast<int64_t>(element_size), padded = (head_size + per_chunk - 1) / per_chunk * per_chunk;
  const int64_t tiles = rows * (padded + 2 * tile), reduction = 4 * rows * padded;
  return 3 * rows + (tiles > reduction ? tiles : reduction);
}

// Vector loads (4 to 16 bytes): K and V 16-byte aligned, rows whole 16-byte chunks, and whole DL-element
// groups per lane.
bool vector_loads(const Call& c, int64_t head_size, int64_t lanes) {
  const size_t es = element_size(c.type);
  return reinterpret_cast<uintptr_t>(c.in[1]) % 16 == 0 && reinterpret_cast<uintptr_t>(c.in[2]) % 16 == 0 &&
         (head_size * static_cast<int64_t>(es)) % 16 == 0 && head_size % lanes == 0;
}

int64_t keys_per_split(int64_t blocks_without_split, int64_t keys, int64_t resident, int64_t tile) {
  int64_t splits = blocks_without_split >= resident ? 1 : (resident + blocks_without_split - 1) / blocks_without_split;
  const int64_t most = (keys + tile - 1) / tile;
  if (splits > most) splits = most;
  if (splits < 1) splits = 1;
  const int64_t chunk = (keys + splits - 1) / splits;
  return (chunk + tile - 1) / tile * tile;
}

struct CudaDecodeAttention {
  static const char* provider(const OrtCustomOp*) { return "CUDAExecutionProvider"; }
  Spec spec;
  std::string node;
  std::vector<void*> fns;  // per type (f32, f16, bf16): the d64, d128 and d256 variants, then the combine
  std::vector<int64_t> resident;  // per kernel of fns: the blocks the device runs at once
  void* cu_ctx = nullptr;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    try {
      Call c;
      if (OrtStatus* st = prepare(ctx, spec, node, &c)) return st;
      if (spec.size > static_cast<int64_t>(kThreads))
        return fail(ORT_INVALID_ARGUMENT, node, "head size above " + std::to_string(kThreads));
      if (c.R > max_rows(spec.size))  // the spec's max_rows is above the kernel's
        return fail(ORT_INVALID_ARGUMENT, node, std::to_string(c.R) + " query rows per key/value head; with head size " +
                                                    std::to_string(spec.size) + " the kernel takes at most " +
                                                    std::to_string(max_rows(spec.size)));
      CudaArgs a{};
      a.q = c.in[0], a.k = c.in[1], a.v = c.in[2], a.bias = c.in[3], a.out = c.out;
      a.B = c.B, a.R = c.R, a.S = c.S, a.T = c.T, a.G = spec.kv_heads, a.D = spec.size, a.n = spec.heads / spec.kv_heads;
      a.bias_b = c.bias_b, a.bias_s = c.bias_s, a.scale = static_cast<float>(spec.scale);
      const int64_t BG = c.B * a.G;
      const int type = c.type == kFloat ? 0 : c.type == kFloat16 ? 1 : 2, lanes = static_cast<int>(dims_per_lane(a.D));
      const int which = type * 4 + (lanes == 2 ? 0 : lanes == 4 ? 1 : 2);
      const int64_t tile = tile_keys(a.D, element_size(c.type));
      a.chunk = keys_per_split(BG, c.T, resident[which], tile);
      a.splits = c.T > 0 ? (c.T + a.chunk - 1) / a.chunk : 1;
      if (a.splits < 1) a.splits = 1;
      const int64_t floats = a.splits > 1 ? a.splits * BG * c.R * (a.D + 2) : 0;
      void* scratch = nullptr;  // the partials, as elements of the query's type
      if (OrtStatus* st = make_output(api, ctx, 1, {(floats * 4 + (int64_t)element_size(c.type) - 1) / (int64_t)element_size(c.type)},
                                      &scratch))
        return st;
      a.part = static_cast<float*>(scratch);
      if (BG == 0 || c.R == 0) return nullptr;
      void* stream = nullptr;
      if (OrtStatus* st = api->KernelContext_GetGPUComputeStream(ctx, &stream)) return st;
      a.vec = vector_loads(c, a.D, lanes) ? 1 : 0;
      const unsigned shared = static_cast<unsigned>(shared_floats(c.R, a.D, tile, element_size(c.type)) * sizeof(float));
      void* args[] = {&a};
      std::string err;
      if (!launch_fixed(fns[which], cu_ctx, a.splits, kThreads, stream, args, &err, BG, shared))
        return fail(ORT_RUNTIME_EXCEPTION, node, err);
      const int64_t outputs = BG * c.R * a.D;
      if (a.splits > 1 && !launch_fixed(fns[type * 4 + 3], cu_ctx, (outputs + kThreads - 1) / kThreads, kThreads, stream,
                                        args, &err))
        return fail(ORT_RUNTIME_EXCEPTION, node, err);
      return nullptr;
    } catch (const std::exception& e) {
      return fail(ORT_RUNTIME_EXCEPTION, node, e.what());
    } catch (...) {
      return fail(ORT_RUNTIME_EXCEPTION, node, "unknown error");
    }
  }
};

template <class Kernel>
OrtStatus* load_spec(const OrtKernelInfo* info, Kernel* k) {
  k->node = node_label(api, info);
  std::map<std::string, std::string> items;
  std::string err;
  if (!read_spec_items(api, info, {"num_heads", "kv_num_heads", "head_size", "scale", "max_rows"}, &items, &err))
    return fail(ORT_INVALID_GRAPH, k->node, err);
  Spec& s = k->spec;
  const bool complete = items.count("num_heads") && items.count("kv_num_heads") && items.count("head_size") &&
                        items.count("scale") && items.count("max_rows") && spec_int(items["num_heads"], &s.heads) &&
                        spec_int(items["kv_num_heads"], &s.kv_heads) && spec_int(items["head_size"], &s.size) &&
                        spec_number(items["scale"], &s.scale) && spec_int(items["max_rows"], &s.max_rows);
  if (!complete || s.heads <= 0 || s.kv_heads <= 0 || s.heads % s.kv_heads || s.size <= 0 || !(s.scale > 0) ||
      s.max_rows < 0)
    return fail(ORT_INVALID_GRAPH, k->node,
                "spec needs num_heads H > 0 divisible by kv_num_heads G > 0, head_size D > 0, a scale > 0 and "
                "max_rows >= 0");
  return nullptr;
}

OrtStatus* init_cuda(const OrtKernelInfo* info, CudaDecodeAttention* k) {
  if (OrtStatus* st = load_spec(info, k)) return st;
  std::string err;
  if (!fixed_kernels(std::string(kCudaTypedIo) + kCudaSource,
                     {"ofx_decode_attention_f32_d64", "ofx_decode_attention_f32_d128", "ofx_decode_attention_f32_d256",
                      "ofx_decode_attention_f32_combine", "ofx_decode_attention_f16_d64", "ofx_decode_attention_f16_d128",
                      "ofx_decode_attention_f16_d256", "ofx_decode_attention_f16_combine", "ofx_decode_attention_bf16_d64",
                      "ofx_decode_attention_bf16_d128", "ofx_decode_attention_bf16_d256", "ofx_decode_attention_bf16_combine"},
                     device_of(api, info), &k->fns, &k->cu_ctx, &err))
    return fail(ORT_FAIL, k->node, err);
  // The blocks each variant keeps resident at its largest shared memory (the split count fills them).
  // 264 (two per multiprocessor of an H100) where the driver does not say.
  const size_t sizes[] = {4, 2, 2};
  const int64_t heads[] = {64, 128, 256};
  for (size_t i = 0; i < k->fns.size(); ++i) {
    const int64_t D = heads[i % 4 == 3 ? 0 : i % 4];
    const int64_t shared = shared_floats(max_rows(D), D, tile_keys(D, sizes[i / 4]), sizes[i / 4]) * 4;
    const int n = resident_blocks(k->fns[i], k->cu_ctx, device_of(api, info), kThreads, static_cast<unsigned>(shared));
    k->resident.push_back(n > 0 ? n : 264);
  }
  return nullptr;
}

OrtStatusPtr creation_error(const char* what) { return fail(ORT_RUNTIME_EXCEPTION, "", what); }

}  // namespace

const OrtCustomOp* decode_attention_cpu_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CpuDecodeAttention, load_spec<CpuDecodeAttention>, &kOpName, 3, 2, creation_error>(version);
}

const OrtCustomOp* decode_attention_cuda_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CudaDecodeAttention, init_cuda, &kOpName, 3, 2, creation_error>(version);
}

}  // namespace onnxfuse
