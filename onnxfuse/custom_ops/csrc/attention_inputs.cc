// AttentionInputs (domain ai.onnxfuse, opset 1): the inputs of a decoder's cached attention, made in one
// kernel from the packed q/k/v projection. Why and the maths: onnxfuse/rewrites/contrib/
// contrib_attention_inputs.py; the contract: docs/custom-ops.md.
//
//   inputs   qkv [B, S, (H + 2G)·D], past_key [B, G, P, D], past_value [B, G, P, D],
//            with rotary_dim R > 0: cos [B, S, R/2], sin [B, S, R/2], and with bias=1 last: bias [(H + 2G)·D],
//            the projection's bias, added first (x = qkv + bias, rounded to the type as an Add would)
//   outputs  query [B, S, H·D] (rotated), present_key [B, G, P + S, D] (the new keys rotated),
//            present_value [B, G, P + S, D], and optionally key_heads / value_heads [B, H, P + S, D]:
//            the presents with key/value head g repeated for query heads g·n … g·n + n − 1, n = H / G
//   attribute spec (string): "num_heads=H kv_num_heads=G head_size=D rotary_dim=R interleaved=0|1"
//            and optionally "bias=1" and "grouped=1": query is then [B, S·n, G·D], the heads of each key/value head's
//            group as rows (row s·n + j of head g is query head g·n + j at token s), and the node has
//            exactly 3 outputs: MultiHeadAttention over G heads reads the presents themselves
//
// Rotation of one head x (ONNX RotaryEmbedding, opset 23, caches without position ids): for d < R,
// halves (interleaved=0): y[d] = x[d]·c[d] − x[d + R/2]·s[d] (d < R/2), x[d]·c[d − R/2] + x[d − R/2]·s[d − R/2];
// pairs (interleaved=1): y[2i] = x[2i]·c[i] − x[2i+1]·s[i], y[2i+1] = x[2i+1]·c[i] + x[2i]·s[i];
// d >= R: y[d] = x[d]. Computed in float32, rounded once to the tensor type. Everything else is a copy.
#include "attention_inputs.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "attention_common.h"
#include "cuda_runtime.h"
#include "ops.h"
#include "ort_util.h"

namespace onnxfuse {
namespace {

using namespace onnxfuse_ort;

const char* const kOpName = "AttentionInputs";
const OrtApi* api = nullptr;

OrtStatus* fail(OrtErrorCode code, const std::string& node, const std::string& msg) {
  return op_error(api, code, kOpName, node, msg);
}

struct Spec {
  int64_t heads = 0, kv_heads = 0, size = 0, rotary = 0, interleaved = 0, grouped = 0, bias = 0;
};

// The spec's values, checked: H > 0 a multiple of G > 0, D > 0, R even in [0, D], flags 0 or 1.
bool parse_spec(const std::map<std::string, std::string>& items, Spec* s, std::string* err) {
  const char* keys[7] = {"num_heads", "kv_num_heads", "head_size", "rotary_dim", "interleaved", "grouped", "bias"};
  int64_t* slots[7] = {&s->heads, &s->kv_heads, &s->size, &s->rotary, &s->interleaved, &s->grouped, &s->bias};
  std::string text;
  for (const auto& kv : items) text += (text.empty() ? "" : " ") + kv.first + "=" + kv.second;
  for (int k = 0; k < 7; ++k) {
    auto it = items.find(keys[k]);
    if (it == items.end()) {
      if (k < 5) {  // grouped and bias are optional (0)
        *err = "spec needs num_heads, kv_num_heads, head_size, rotary_dim and interleaved";
        return false;
      }
      continue;
    }
    if (!spec_int(it->second, slots[k])) {
      *err = "bad number in spec item '" + it->first + "=" + it->second + "'";
      return false;
    }
  }
  if (s->heads <= 0 || s->kv_heads <= 0 || s->heads % s->kv_heads || s->size <= 0 || s->rotary < 0 ||
      s->rotary > s->size || s->rotary % 2 || (s->interleaved != 0 && s->interleaved != 1) || (s->grouped != 0 && s->grouped != 1) ||
      (s->bias != 0 && s->bias != 1)) {
    *err = "spec '" + text + "': needs H > 0 divisible by G > 0, D > 0, an even R in [0, D], interleaved, grouped and bias 0 or 1";
    return false;
  }
  return true;
}

// The shapes of one call, checked against the spec.
struct Shapes {
  int64_t B = 0, S = 0, P = 0;
  int type = 0;
  int nout = 3;
  std::vector<const void*> in;
  std::vector<void*> out;
  const void* bias = nullptr;  // the projection's bias (spec bias=1), else null
};

OrtStatus* prepare(OrtKernelContext* ctx, const Spec& sp, const std::string& node, Shapes* sh) {
  size_t nin = 0, nout = 0;
  OrtStatus* st;
  if ((st = api->KernelContext_GetInputCount(ctx, &nin))) return st;
  if ((st = api->KernelContext_GetOutputCount(ctx, &nout))) return st;
  const size_t want_in = (sp.rotary > 0 ? 5 : 3) + (sp.bias ? 1 : 0);
  if (nin != want_in || (nout != 3 && (nout != 5 || sp.grouped)))
    return fail(ORT_INVALID_GRAPH, node, "takes " + std::to_string(want_in) + " inputs (rotary_dim " +
                                             std::to_string(sp.rotary) + ", bias " + std::to_string(sp.bias) + ") and " +
                                             (sp.grouped ? "3" : "3 or 5") +
                                             " outputs, got " +
                                             std::to_string(nin) + " and " + std::to_string(nout));
  const int64_t H = sp.heads, G = sp.kv_heads, D = sp.size;
  std::vector<std::vector<int64_t>> dims(nin);
  std::vector<int> types(nin);
  sh->in.assign(nin, nullptr);
  for (size_t i = 0; i < nin; ++i)
    if ((st = read_input(api, ctx, i, &dims[i], &types[i], &sh->in[i]))) return st;
  const auto& shape_str = shape_text;
  const auto& q = dims[0];
  if (q.size() != 3 || q[2] != (H + 2 * G) * D)
    return fail(ORT_INVALID_ARGUMENT, node, "qkv is " + shape_str(q) + ", expected [B, S, " + std::to_string((H + 2 * G) * D) + "]");
  sh->B = q[0];
  sh->S = q[1];
  for (int i = 1; i <= 2; ++i) {
    const auto& p = dims[i];
    if (p.size() != 4 || p[0] != sh->B || p[1] != G || p[3] != D || (i == 2 && p[2] != dims[1][2]))
      return fail(ORT_INVALID_ARGUMENT, node, std::string(i == 1 ? "past_key" : "past_value") + " is " + shape_str(p) +
                                                  ", expected [" + std::to_string(sh->B) + ", " + std::to_string(G) + ", P, " +
                                                  std::to_string(D) + "]");
  }
  sh->P = dims[1][2];
  const size_t caches_end = sp.rotary > 0 ? 5 : 3;
  if (sp.bias) {
    const auto& bias = dims[nin - 1];
    if (bias.size() != 1 || bias[0] != (H + 2 * G) * D)
      return fail(ORT_INVALID_ARGUMENT, node, "bias is " + shape_str(bias) + ", expected [" + std::to_string((H + 2 * G) * D) + "]");
    sh->bias = sh->in[nin - 1];
  }
  for (size_t i = 3; i < caches_end; ++i) {
    const auto& c = dims[i];
    if (c.size() != 3 || c[0] != sh->B || c[1] != sh->S || c[2] != sp.rotary / 2)
      return fail(ORT_INVALID_ARGUMENT, node, std::string(i == 3 ? "cos" : "sin") + " is " + shape_str(c) + ", expected [" +
                                                  std::to_string(sh->B) + ", " + std::to_string(sh->S) + ", " +
                                                  std::to_string(sp.rotary / 2) + "]");
  }
  sh->type = types[0];
  for (size_t i = 1; i < nin; ++i)
    if (types[i] != sh->type) return fail(ORT_INVALID_ARGUMENT, node, "every input must have qkv's element type");
  if (sh->type != kFloat && sh->type != kFloat16 && sh->type != kBFloat16)
    return fail(ORT_INVALID_ARGUMENT, node, "element type " + std::to_string(sh->type) + ": float, float16 or bfloat16 only");
  sh->nout = static_cast<int>(nout);
  const int64_t T = sh->P + sh->S;
  const std::vector<int64_t> query_dims = sp.grouped ? std::vector<int64_t>{sh->B, sh->S * (H / G), G * D}
                                                     : std::vector<int64_t>{sh->B, sh->S, H * D};
  std::vector<std::vector<int64_t>> out_dims = {query_dims, {sh->B, G, T, D}, {sh->B, G, T, D},
                                                {sh->B, H, T, D}, {sh->B, H, T, D}};
  sh->out.assign(nout, nullptr);
  for (size_t j = 0; j < nout; ++j)
    if ((st = make_output(api, ctx, j, out_dims[j], &sh->out[j]))) return st;
  return nullptr;
}

// ------------------------------------------------------------------ CPU

// Element i of the projection: qkv's, plus the bias's (rounded to the type as the Add was) with one.
float projected(const Spec& sp, const Shapes& sh, int64_t i) {
  const float x = load(sh.in[0], i, sh.type);
  if (!sh.bias) return x;
  return round_as(x + load(sh.bias, i % ((sp.heads + 2 * sp.kv_heads) * sp.size), sh.type), sh.type);
}

// Element d of the head starting at `head` (an element index into qkv), rotated.
float rotated(const Spec& sp, const Shapes& sh, int64_t head, int64_t row, int64_t d) {
  const int t = sh.type;
  if (d >= sp.rotary) return projected(sp, sh, head + d);
  const int64_t half = sp.rotary / 2;
  int64_t i, partner;
  float sign;
  if (sp.interleaved) {
    i = d / 2;
    partner = d % 2 ? d - 1 : d + 1;
    sign = d % 2 ? 1.f : -1.f;
  } else {
    i = d < half ? d : d - half;
    partner = d < half ? d + half : d - half;
    sign = d < half ? -1.f : 1.f;
  }
  const float c = load(sh.in[3], row * half + i, t), s = load(sh.in[4], row * half + i, t);
  return projected(sp, sh, head + d) * c + sign * projected(sp, sh, head + partner) * s;
}

// The query head written at head slot `slot` of a token's output row: the slot itself, or grouped, slot
// j·G + g (row s·n + j, head g of [B, S·n, G·D]) holds query head g·n + j.
int64_t query_head(const Spec& sp, int64_t slot) {
  return sp.grouped ? (slot % sp.kv_heads) * (sp.heads / sp.kv_heads) + slot / sp.kv_heads : slot;
}

struct CpuAttentionInputs {
  static const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
  Spec spec;
  std::string node;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    Shapes sh;
    if (OrtStatus* st = prepare(ctx, spec, node, &sh)) return st;
    const int64_t B = sh.B, S = sh.S, P = sh.P, T = P + S, H = spec.heads, G = spec.kv_heads, D = spec.size;
    const int64_t row_len = (H + 2 * G) * D;
    const int t = sh.type;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s)
        for (int64_t slot = 0; slot < H; ++slot) {  // the query's head slots in output order
          const int64_t h = query_head(spec, slot), row = b * S + s;
          for (int64_t d = 0; d < D; ++d) {
            float v = spec.rotary ? rotated(spec, sh, row * row_len + h * D, row, d) : projected(spec, sh, row * row_len + h * D + d);
            store(sh.out[0], (row * H + slot) * D + d, t, v);
          }
        }
    const size_t esize = t == kFloat ? 4 : 2;
    for (int kv = 0; kv < 2; ++kv) {
      const void* past = sh.in[1 + kv];
      void* present = sh.out[1 + kv];
      for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t dst = ((b * G + g) * T) * D, src = ((b * G + g) * P) * D;
          std::memcpy(static_cast<char*>(present) + dst * esize, static_cast<const char*>(past) + src * esize, P * D * esize);
          for (int64_t s = 0; s < S; ++s) {
            const int64_t row = b * S + s, head = row * row_len + (H + kv * G + g) * D;
            for (int64_t d = 0; d < D; ++d) {
              float v = kv == 0 && spec.rotary ? rotated(spec, sh, head, row, d) : projected(spec, sh, head + d);
              store(present, dst + (P + s) * D + d, t, v);
            }
          }
        }
      if (sh.nout == 5) {
        const int64_t n = H / G;
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            std::memcpy(static_cast<char*>(sh.out[3 + kv]) + ((b * H + h) * T * D) * esize,
                        static_cast<const char*>(present) + ((b * G + h / n) * T * D) * esize, T * D * esize);
      }
    }
    return nullptr;
  }
};

// ------------------------------------------------------------------ CUDA
// One thread per output element, over the outputs in order (query, present_key, present_value,
// key_heads, value_heads); three entry points, one per storage type. No includes: NVRTC only.
const char* kCudaSource = R"CUDA(
struct Args {
  const void* qkv; const void* past_k; const void* past_v; const void* cos; const void* sin; const void* bias;
  void* out[5];
  long long B, S, P, H, G, D, R, interleaved, nout, V, grouped;
};
// One thread per unit of V consecutive elements of an output row (V divides D: a unit never crosses a
// head's row). A unit copied from the past moves as one 16-byte vector when V > 1 (the host checks the
// alignment); the units of new rows are computed element by element (rotation).
#define OFX_ATTENTION_INPUTS(NAME, LD, ST, RND)                                                     \
extern "C" __global__ void NAME(Args a) {                                                           \
  const long long T = a.P + a.S, row_len = (a.H + 2 * a.G) * a.D, n = a.H / a.G, V = a.V;           \
  const long long DV = a.D / V;                                                                     \
  /* element i of the projection: qkv's, plus the bias's rounded to the type as the Add was */      \
  auto qkv_at = [&](long long i) {                                                                  \
    return a.bias ? RND(LD(a.qkv, i) + LD(a.bias, i % row_len)) : LD(a.qkv, i); };                   \
  const long long nq = a.B * a.S * a.H * DV, np = a.B * a.G * T * DV, nr = a.B * a.H * T * DV;      \
  const long long total = nq + 2 * np + (a.nout == 5 ? 2 * nr : 0);                                 \
  for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;              \
       idx += (long long)gridDim.x * blockDim.x) {                                                  \
    long long o, u, b, s, d0, col;                                                                  \
    bool rot;                                                                                       \
    if (idx < nq) {                                                                                 \
      o = 0; u = idx; d0 = (u % DV) * V; long long h = (u / DV) % a.H; long long r = u / (DV * a.H);\
      if (a.grouped) h = (h % a.G) * n + h / a.G;                                                   \
      b = r / a.S; s = r % a.S; col = h * a.D; rot = a.R > 0;                                        \
    } else {                                                                                        \
      long long k = idx - nq, heads, kv, g;                                                         \
      if (k < 2 * np) { kv = k / np; u = k % np; o = 1 + kv; heads = a.G; }                         \
      else { k -= 2 * np; kv = k / nr; u = k % nr; o = 3 + kv; heads = a.H; }                      \
      d0 = (u % DV) * V; long long t = (u / DV) % T; long long hh = (u / (DV * T)) % heads;         \
      b = u / (DV * T * heads); g = heads == a.G ? hh : hh / n;                                     \
      if (t < a.P) {                                                                                \
        const void* past = kv ? a.past_v : a.past_k;                                                \
        const long long src = ((b * a.G + g) * a.P + t) * a.D + d0;                                 \
        if (V > 1) {                                                                                \
          ((uint4*)a.out[o])[u] = ((const uint4*)past)[src / V];                                    \
        } else {                                                                                    \
          ST(a.out[o], u, LD(past, src));                                                           \
        }                                                                                           \
        continue;                                                                                   \
      }                                                                                             \
      s = t - a.P; col = (a.H + kv * a.G + g) * a.D; rot = kv == 0 && a.R > 0;                      \
    }                                                                                               \
    const long long row = b * a.S + s, head = row * row_len + col, half = a.R / 2;                  \
    for (long long j = 0; j < V; ++j) {                                                             \
      const long long d = d0 + j;                                                                   \
      float v;                                                                                      \
      if (!rot || d >= a.R) {                                                                       \
        v = qkv_at(head + d);                                                                       \
      } else {                                                                                      \
        long long i, partner; float sign;                                                           \
        if (a.interleaved) { i = d / 2; partner = d % 2 ? d - 1 : d + 1; sign = d % 2 ? 1.f : -1.f; } \
        else { i = d < half ? d : d - half; partner = d < half ? d + half : d - half;               \
               sign = d < half ? -1.f : 1.f; }                                                      \
        const float c = LD(a.cos, row * half + i), sn = LD(a.sin, row * half + i);                  \
        v = qkv_at(head + d) * c + sign * qkv_at(head + partner) * sn;                              \
      }                                                                                             \
      ST(a.out[o], u * V + j, v);                                                                   \
    }                                                                                               \
  }                                                                                                 \
}
OFX_ATTENTION_INPUTS(ofx_attention_inputs_f32, ld_f32, st_f32, rnd_f32)
OFX_ATTENTION_INPUTS(ofx_attention_inputs_f16, ld_f16, st_f16, rnd_f16)
OFX_ATTENTION_INPUTS(ofx_attention_inputs_bf16, ld_bf16, st_bf16, rnd_bf16)
)CUDA";

// The kernel's argument block, laid out as `struct Args` above (8-byte fields, no padding).
struct CudaArgs {
  const void* qkv;
  const void* past_k;
  const void* past_v;
  const void* cos;
  const void* sin;
  const void* bias;
  void* out[5];
  long long B, S, P, H, G, D, R, interleaved, nout, V, grouped;
};

struct CudaAttentionInputs {
  static const char* provider(const OrtCustomOp*) { return "CUDAExecutionProvider"; }
  Spec spec;
  std::string node;
  std::vector<void*> fns;  // f32, f16, bf16
  void* cu_ctx = nullptr;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    Shapes sh;
    if (OrtStatus* st = prepare(ctx, spec, node, &sh)) return st;
    CudaArgs a{};
    a.qkv = sh.in[0];
    a.past_k = sh.in[1];
    a.past_v = sh.in[2];
    a.cos = spec.rotary > 0 ? sh.in[3] : nullptr;
    a.sin = spec.rotary > 0 ? sh.in[4] : nullptr;
    a.bias = sh.bias;
    for (int j = 0; j < sh.nout; ++j) a.out[j] = sh.out[j];
    a.B = sh.B, a.S = sh.S, a.P = sh.P, a.H = spec.heads, a.G = spec.kv_heads, a.D = spec.size;
    a.R = spec.rotary, a.interleaved = spec.interleaved, a.nout = sh.nout, a.grouped = spec.grouped;
    // 16-byte units where every row splits into them and every pointer is 16-byte aligned.
    const long long width = sh.type == kFloat ? 4 : 8;
    bool aligned = a.D % width == 0;
    for (const void* ptr : sh.in) aligned = aligned && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
    for (void* ptr : sh.out) aligned = aligned && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
    a.V = aligned ? width : 1;
    const long long T = a.P + a.S, DV = a.D / a.V;
    const long long total = a.B * a.S * a.H * DV + 2 * a.B * a.G * T * DV + (a.nout == 5 ? 2 * a.B * a.H * T * DV : 0);
    if (total == 0) return nullptr;
    void* stream = nullptr;
    if (OrtStatus* st = api->KernelContext_GetGPUComputeStream(ctx, &stream)) return st;
    const unsigned threads = 256;
    long long blocks = (total + threads - 1) / threads;
    if (blocks > 65535ll * 32) blocks = 65535ll * 32;  // grid-stride loop covers the rest
    void* fn = fns[sh.type == kFloat ? 0 : sh.type == kFloat16 ? 1 : 2];
    void* args[] = {&a};
    std::string err;
    if (!launch_fixed(fn, cu_ctx, blocks, threads, stream, args, &err)) return fail(ORT_RUNTIME_EXCEPTION, node, err);
    return nullptr;
  }
};

template <class Kernel>
OrtStatus* load_spec(const OrtKernelInfo* info, Kernel* k) {
  k->node = node_label(api, info);
  std::map<std::string, std::string> items;
  std::string err;
  if (!read_spec_items(api, info, {"num_heads", "kv_num_heads", "head_size", "rotary_dim", "interleaved", "grouped", "bias"}, &items,
                       &err) ||
      !parse_spec(items, &k->spec, &err))
    return fail(ORT_INVALID_GRAPH, k->node, err);
  return nullptr;
}

OrtStatus* init_cuda(const OrtKernelInfo* info, CudaAttentionInputs* k) {
  if (OrtStatus* st = load_spec(info, k)) return st;
  std::string err;
  if (!fixed_kernels(std::string(kCudaTypedIo) + kCudaSource, {"ofx_attention_inputs_f32", "ofx_attention_inputs_f16", "ofx_attention_inputs_bf16"},
                     device_of(api, info), &k->fns, &k->cu_ctx, &err))
    return fail(ORT_FAIL, k->node, err);
  return nullptr;
}

}  // namespace

const OrtCustomOp* attention_inputs_cpu_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CpuAttentionInputs, load_spec<CpuAttentionInputs>, &kOpName, 3, 3, &api>(version);
}

const OrtCustomOp* attention_inputs_cuda_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CudaAttentionInputs, init_cuda, &kOpName, 3, 3, &api>(version);
}

}  // namespace onnxfuse
