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

// Threads per block of the CUDA kernels; also the keys scored per step of a block.
constexpr unsigned kThreads = 256;
// Dims per lane of the kernel variant for a head size: 2 (D <= 64), 4 (D <= 128) or 8 (D <= 256).
int64_t dims_per_lane(int64_t head_size) { return head_size <= 64 ? 2 : head_size <= 128 ? 4 : 8; }
// Query rows per key/value head the CUDA kernel takes: 64 / dims per lane (each lane's accumulators, in
// registers), and its shared memory, R·(D + 256 + 3) floats, within 48 KiB (the rule,
// contrib-decode-attention, sends no more).
int64_t max_rows(int64_t head_size) {
  const int64_t fit = (48 * 1024 / 4) / (head_size + kThreads + 3), regs = 64 / dims_per_lane(head_size);
  return fit < regs ? fit : regs;
}

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
// Block (split, b·G + g) takes its keys [split·chunk, …) 256 at a time: one key per thread scores the R
// query rows (held in shared memory; the key read 8 elements at a time, independent loads), each row's
// running max and sum are kept (online softmax), and warp w adds p · V for keys w, w + 8, … with lane l
// holding dims l, l + 32, … of every row (DL = dims per lane, a template: the accumulators stay in
// registers, R·DL <= 64). The warps' sums meet in shared memory. One split writes the output; several
// write partials (acc, max, sum per row) that the combine kernel merges. Everything in float32.
const char* kCudaSource = R"CUDA(
#define THREADS 256
#define WARPS (THREADS / 32)
#define INFINITY __int_as_float(0x7f800000)
struct Args {
  const void* q; const void* k; const void* v; const void* bias; void* out; float* part;
  long long B, R, S, T, G, D, n, bias_b, bias_s, splits, chunk;
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
#define OFX_DECODE_ATTENTION_DL(NAME, LD, ST, DL)                                                     \
extern "C" __global__ void NAME(Args a) {                                                             \
  enum { RMAX = 64 / DL };                                                                            \
  extern __shared__ float smem[];                                                                     \
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;                                      \
  const long long R = a.R, D = a.D, T = a.T, bg = blockIdx.y, b = bg / a.G, g = bg % a.G;             \
  const long long t_begin = (long long)blockIdx.x * a.chunk;                                          \
  const long long t_end = t_begin + a.chunk < T ? t_begin + a.chunk : T;                              \
  float* qs = smem; float* sc = qs + R * D; float* mrow = sc + R * THREADS;                           \
  float* lrow = mrow + R; float* frow = lrow + R;                                                     \
  for (long long i = tid; i < R * D; i += THREADS)                                                    \
    qs[i] = LD(a.q, ((b * R + i / D) * a.G + g) * D + i % D) * a.scale;                               \
  for (long long r = tid; r < R; r += THREADS) { mrow[r] = -INFINITY; lrow[r] = 0.f; }                \
  float acc[RMAX][DL];                                                                                \
  _Pragma("unroll") for (int r = 0; r < RMAX; ++r)                                                    \
    _Pragma("unroll") for (int i = 0; i < DL; ++i) acc[r][i] = 0.f;                                   \
  const long long kv = (b * a.G + g) * T * D;                                                         \
  const long long bias_row = (a.bias_b > 1 ? b : 0) * a.bias_s;                                       \
  __syncthreads();                                                                                    \
  for (long long t0 = t_begin; t0 < t_end; t0 += THREADS) {                                           \
    const long long t = t0 + tid, keys = t_end - t0 < THREADS ? t_end - t0 : THREADS;                 \
    if (t < t_end) {                                                                                  \
      float dots[RMAX];                                                                               \
      _Pragma("unroll") for (int r = 0; r < RMAX; ++r) dots[r] = 0.f;                                 \
      const long long row = kv + t * D;                                                               \
      for (long long dd = 0; dd < D; dd += 8) {                                                       \
        float kx[8];                                                                                  \
        _Pragma("unroll") for (int u = 0; u < 8; ++u) kx[u] = dd + u < D ? LD(a.k, row + dd + u) : 0.f; \
        _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {                                 \
          _Pragma("unroll") for (int u = 0; u < 8; ++u) if (dd + u < D) dots[r] += qs[r * D + dd + u] * kx[u]; \
        }                                                                                             \
      }                                                                                               \
      _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {                                   \
        float s = dots[r];                                                                            \
        if (a.bias_b) s += LD(a.bias, (bias_row + (a.bias_s > 1 ? r / a.n : 0)) * T + t);             \
        sc[r * THREADS + tid] = s;                                                                    \
      }                                                                                               \
    } else {                                                                                          \
      for (long long r = 0; r < R; ++r) sc[r * THREADS + tid] = -INFINITY;                            \
    }                                                                                                 \
    __syncthreads();                                                                                  \
    for (long long r = warp; r < R; r += WARPS) {                                                     \
      float mx = -INFINITY;                                                                           \
      for (int j = lane; j < THREADS; j += 32) mx = fmaxf(mx, sc[r * THREADS + j]);                   \
      mx = warp_max(mx);                                                                              \
      const float m_new = fmaxf(mrow[r], mx);                                                         \
      const float f = m_new == -INFINITY ? 1.f : __expf(mrow[r] - m_new);                             \
      float sum = 0.f;                                                                                \
      for (int j = lane; j < THREADS; j += 32) {                                                      \
        const float p = m_new == -INFINITY ? 0.f : __expf(sc[r * THREADS + j] - m_new);               \
        sc[r * THREADS + j] = p; sum += p;                                                            \
      }                                                                                               \
      sum = warp_sum(sum);                                                                            \
      __syncwarp();                                                                                   \
      if (lane == 0) { lrow[r] = lrow[r] * f + sum; mrow[r] = m_new; frow[r] = f; }                   \
    }                                                                                                 \
    __syncthreads();                                                                                  \
    _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {                                     \
      const float f = frow[r];                                                                        \
      _Pragma("unroll") for (int i = 0; i < DL; ++i) acc[r][i] *= f;                                  \
    }                                                                                                 \
    _Pragma("unroll 4") for (long long j = warp; j < keys; j += WARPS) {                              \
      float vx[DL];                                                                                   \
      const long long vrow = kv + (t0 + j) * D;                                                       \
      _Pragma("unroll") for (int i = 0; i < DL; ++i) {                                                \
        const long long d = lane + 32 * i;                                                            \
        vx[i] = d < D ? LD(a.v, vrow + d) : 0.f;                                                      \
      }                                                                                               \
      _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {                                   \
        const float p = sc[r * THREADS + j];                                                          \
        _Pragma("unroll") for (int i = 0; i < DL; ++i) acc[r][i] += p * vx[i];                        \
      }                                                                                               \
    }                                                                                                 \
    __syncthreads();                                                                                  \
  }                                                                                                   \
  float* total = sc;  /* the scores are done with: the warps' sums meet here, [R][D] */               \
  for (long long i = tid; i < R * D; i += THREADS) total[i] = 0.f;                                    \
  __syncthreads();                                                                                    \
  _Pragma("unroll") for (int r = 0; r < RMAX; ++r) if (r < R) {                                       \
    _Pragma("unroll") for (int i = 0; i < DL; ++i) {                                                  \
      const long long d = lane + 32 * i;                                                              \
      if (d < D) atomicAdd(&total[r * D + d], acc[r][i]);                                             \
    }                                                                                                 \
  }                                                                                                   \
  __syncthreads();                                                                                    \
  const long long BG = a.B * a.G, split = blockIdx.x;                                                 \
  for (long long i = tid; i < R * D; i += THREADS) {                                                  \
    const long long r = i / D, d = i % D;                                                             \
    if (a.splits == 1) {                                                                              \
      ST(a.out, ((b * R + r) * a.G + g) * D + d, lrow[r] > 0.f ? total[i] / lrow[r] : 0.f);           \
    } else {                                                                                          \
      const long long prow = (split * BG + bg) * R + r;                                               \
      a.part[prow * D + d] = total[i];                                                                \
      if (d == 0) { a.part[a.splits * BG * R * D + prow] = mrow[r];                                   \
                    a.part[a.splits * BG * R * (D + 1) + prow] = lrow[r]; }                           \
    }                                                                                                 \
  }                                                                                                   \
}
#define OFX_DECODE_COMBINE(NAME, ST)                                                                  \
extern "C" __global__ void NAME(Args a) {                                                             \
  const long long BG = a.B * a.G, bg = blockIdx.x, b = bg / a.G, g = bg % a.G, R = a.R, D = a.D;      \
  const float* m = a.part + a.splits * BG * R * D;                                                    \
  const float* l = a.part + a.splits * BG * R * (D + 1);                                              \
  for (long long i = threadIdx.x; i < R * D; i += THREADS) {                                          \
    const long long r = i / D, d = i % D;                                                             \
    float top = -INFINITY;                                                                            \
    for (long long s = 0; s < a.splits; ++s) top = fmaxf(top, m[(s * BG + bg) * R + r]);              \
    float sum = 0.f, acc = 0.f;                                                                       \
    if (top != -INFINITY)                                                                             \
      for (long long s = 0; s < a.splits; ++s) {                                                      \
        const long long row = (s * BG + bg) * R + r;                                                  \
        const float w = __expf(m[row] - top);                                                         \
        sum += l[row] * w; acc += a.part[row * D + d] * w;                                            \
      }                                                                                               \
    ST(a.out, ((b * R + r) * a.G + g) * D + d, sum > 0.f ? acc / sum : 0.f);                          \
  }                                                                                                   \
}
#define OFX_DECODE_ATTENTION(T, LD, ST)                                                               \
  OFX_DECODE_ATTENTION_DL(ofx_decode_attention_##T##_d64, LD, ST, 2)                                  \
  OFX_DECODE_ATTENTION_DL(ofx_decode_attention_##T##_d128, LD, ST, 4)                                 \
  OFX_DECODE_ATTENTION_DL(ofx_decode_attention_##T##_d256, LD, ST, 8)                                 \
  OFX_DECODE_COMBINE(ofx_decode_attention_##T##_combine, ST)
OFX_DECODE_ATTENTION(f32, ld_f32, st_f32)
OFX_DECODE_ATTENTION(f16, ld_f16, st_f16)
OFX_DECODE_ATTENTION(bf16, ld_bf16, st_bf16)
)CUDA";

// The kernel's argument block, laid out as `struct Args` above (8-byte fields, two floats last).
struct CudaArgs {
  const void* q;
  const void* k;
  const void* v;
  const void* bias;
  void* out;
  float* part;
  long long B, R, S, T, G, D, n, bias_b, bias_s, splits, chunk;
  float scale, pad_;
};

// Keys per split: enough blocks to fill the GPU (about two per multiprocessor of a large GPU) when the
// heads alone do not, never fewer than kThreads keys per block.
int64_t keys_per_split(int64_t blocks_without_split, int64_t keys) {
  const int64_t want = 264;
  int64_t splits = blocks_without_split >= want ? 1 : (want + blocks_without_split - 1) / blocks_without_split;
  const int64_t most = (keys + kThreads - 1) / kThreads;
  if (splits > most) splits = most;
  if (splits < 1) splits = 1;
  return (keys + splits - 1) / splits;
}

struct CudaDecodeAttention {
  static const char* provider(const OrtCustomOp*) { return "CUDAExecutionProvider"; }
  Spec spec;
  std::string node;
  std::vector<void*> fns;  // per type (f32, f16, bf16): the d64, d128 and d256 variants, then the combine
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
      a.chunk = keys_per_split(BG, c.T);
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
      const int type = c.type == kFloat ? 0 : c.type == kFloat16 ? 1 : 2, lanes = static_cast<int>(dims_per_lane(a.D));
      const int which = type * 4 + (lanes == 2 ? 0 : lanes == 4 ? 1 : 2);
      const unsigned shared = static_cast<unsigned>((c.R * a.D + c.R * kThreads + 3 * c.R) * sizeof(float));
      void* args[] = {&a};
      std::string err;
      if (!launch_fixed(fns[which], cu_ctx, a.splits, kThreads, stream, args, &err, BG, shared))
        return fail(ORT_RUNTIME_EXCEPTION, node, err);
      if (a.splits > 1 && !launch_fixed(fns[type * 4 + 3], cu_ctx, BG, kThreads, stream, args, &err))
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
