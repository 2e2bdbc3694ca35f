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
// A row whose every score is -inf gets 0 (there is no key to attend to). The tensor-core kernels (_m,
// 16-bit types) take p · V with p as hi + lo in the input's type (docs/custom-ops.md).
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
// The kernel variant for a head size: the widest head it takes (DMAX: 64, 128 or 256).
int64_t variant_width(int64_t head_size) { return head_size <= 64 ? 64 : head_size <= 128 ? 128 : 256; }
// Query rows per key/value head the CUDA kernel takes, at every head size: its shared memory holds at
// most 16 padded rows of scores, and it stages at most 16 bias rows per tile. The rule,
// contrib-decode-attention, sends no more (its MAX_ROWS mirrors this one).
constexpr int64_t kMaxRows = 16;
// Kernels per element type (f32, f16, bf16): slots 0-5 the widths 64, 128, 256 with vector then element
// loads, 6 the combine, 7-8 widths 64 and 128 with q · Kᵀ on tensor cores (16-bit types only).
constexpr int kKernelsPerType = 9, kCombineSlot = 6, kTensorCoreSlot = 7;
// The kernel name of a slot, "" where the type has none.
std::string kernel_name(int type, int slot) {
  static const char* const types[] = {"f32", "f16", "bf16"};
  const std::string base = std::string("ofx_decode_attention_") + types[type];
  if (slot == kCombineSlot) return base + "_combine";
  if (slot >= kTensorCoreSlot) return type == 0 ? "" : base + (slot == kTensorCoreSlot ? "_d64_m" : "_d128_m");
  return base + "_d" + std::to_string(64 << (slot / 2)) + (slot % 2 ? "_e" : "_v");
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
  }
};

// ------------------------------------------------------------------ CUDA
// Block (split, b·G + g) takes its keys [split·chunk, …) one tile of TK keys at a time (TK: the tile's V
// in 16 KiB). Every thread first issues all of its loads for the tile, so that a block has the whole tile
// in flight at once: four 16-byte chunks of one key's row (SPK threads per key, chunks interleaved), four
// chunks of the tile's V (staged in shared memory for every warp) and its share of the bias rows. Then
// the SPK threads of a key score the R query rows (q in shared memory, float32) one row at a time, the
// warps take the rows' online softmax, and p · V goes to warps by (row group, key share): a lane takes one
// 16-byte V chunk of a key, converts it once and adds it into ROWS rows (32 floats per lane), so the
// warps' p · V instructions are about a tenth of the multiply-adds'. Lanes of one chunk, then the warps of
// a row group, add up in shared memory after the last tile. One split writes the output; several write
// partials (acc, max, sum per row) that the combine kernel merges. Everything in float32.
//
// The block is bound by its instructions' latency, not by memory (Nsight Compute, docs/benchmarks.md
// 5.38: ≈1,700 instructions per warp and tile at about 5 cycles each). p · V used to give each (row, key
// subset) to one warp whose lanes held D / 32 dims (≈10 instructions per key and row, the largest share);
// before that, every row unrolled (≈7,000 instructions) took 15-20 µs per tile. With `vec` (the host
// checks 16-byte alignment and whole-chunk rows) K and V move as 16-byte vectors (the _v kernels);
// otherwise element by element (_e).
//
// The _m kernels (16-bit types, D a multiple of 32 up to 128, sm_80+) put both products on tensor cores
// (mma.m16n8k16, float32 accumulators): warp w scores keys [w·TK/8, (w+1)·TK/8) of the tile for all 16
// (padded) rows straight from its K registers, and takes p · V for 16 keys and 64 dims with V read by
// ldmatrix from shared memory (rows one 16-byte chunk longer, so ldmatrix's rows fall in different
// banks), which cp.async fills while the scores and softmax run. The warps' sums meet in a tree. Same
// H200 (5.38): 21.8 → 17.2 µs main kernel at batch 8, 4,097 keys; 9.1 → 7.5 µs for a single-tile block.
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
// A 16-bit type's tensor-core steps (PTX type T, "f16" or "bf16"). mma: c (16x8, float32) += a (16x16) ·
// b (16x8), the products exact in float32. split2: (x0, x1) as hi + lo, each a pair of T (x0 in the low
// half): about 22 bits of each for float16 (where lo is normal), 16 for bfloat16.
#define OFX_TENSOR_CORE_OPS(T)                                                                                     \
  static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {            \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
                 "{%0,%1,%2,%3};"                                                                                  \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                                  \
  }                                                                                                                \
  static __device__ __forceinline__ void split2(float x0, float x1, unsigned* hi, unsigned* lo) {                \
    asm("cvt.rn." T "x2.f32 %0, %1, %2;" : "=r"(*hi) : "f"(x1), "f"(x0));                                         \
    const float r0 = x0 - value(*hi & 0xffffu), r1 = x1 - value(*hi >> 16);                                        \
    asm("cvt.rn." T "x2.f32 %0, %1, %2;" : "=r"(*lo) : "f"(r1), "f"(r0));                                         \
  }
// Element types: E holds an element's bits; value() reads them as float; ld/st a tensor's element i.
struct F32 {
  typedef unsigned E;
  enum { ES = 4 };
  static __device__ __forceinline__ float value(unsigned bits) { return __uint_as_float(bits); }
  static __device__ __forceinline__ float ld(const void* p, long long i) { return ld_f32(p, i); }
  static __device__ __forceinline__ void st(void* p, long long i, float v) { st_f32(p, i, v); }
  static __device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {}  /* not used */
  static __device__ __forceinline__ void split2(float x0, float x1, unsigned* hi, unsigned* lo) {}  /* not used */
};
struct F16 {
  typedef u16 E;
  enum { ES = 2 };
  static __device__ __forceinline__ float value(unsigned bits) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((u16)bits)); return f;
  }
  static __device__ __forceinline__ float ld(const void* p, long long i) { return ld_f16(p, i); }
  static __device__ __forceinline__ void st(void* p, long long i, float v) { st_f16(p, i, v); }
  OFX_TENSOR_CORE_OPS("f16")
};
struct BF16 {
  typedef u16 E;
  enum { ES = 2 };
  static __device__ __forceinline__ float value(unsigned bits) { return __uint_as_float(bits << 16); }
  static __device__ __forceinline__ float ld(const void* p, long long i) { return ld_bf16(p, i); }
  static __device__ __forceinline__ void st(void* p, long long i, float v) { st_bf16(p, i, v); }
  OFX_TENSOR_CORE_OPS("bf16")
};
// 16 bytes from global to shared memory without passing registers (sm_80+), and the wait for all of them.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Four 8x8 16-bit matrices from shared memory, transposed (lanes 0-7, 8-15, 16-23, 24-31: their rows).
__device__ __forceinline__ void ldmatrix_x4_trans(const void* row, unsigned* r) {
  const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// The 16 / ES elements of a 16-byte chunk as floats.
template <class Ty>
__device__ __forceinline__ void unpack(const uint4& c, float* f) {
  const unsigned w[4] = {c.x, c.y, c.z, c.w};
  _Pragma("unroll") for (int i = 0; i < 4; ++i) {
    if (Ty::ES == 4) {
      f[i] = Ty::value(w[i]);
    } else {
      f[2 * i] = Ty::value(w[i] & 0xffffu); f[2 * i + 1] = Ty::value(w[i] >> 16);
    }
  }
}
// Chunk c (16 bytes) of the row at element `row` of p, whose elements past `len` read as 0.
template <class Ty, bool VEC>
__device__ __forceinline__ uint4 load_chunk(const void* p, long long row, int c, int len) {
  typedef typename Ty::E E;
  if (VEC) return *(const uint4*)((const char*)p + (row + (long long)c * (16 / Ty::ES)) * Ty::ES);
  unsigned w[4];
  _Pragma("unroll") for (int i = 0; i < 4; ++i) {
    if (Ty::ES == 4) {
      const int d = c * 4 + i;
      w[i] = d < len ? ((const unsigned*)p)[row + d] : 0u;
    } else {
      const int d = c * 8 + 2 * i;
      const unsigned lo = d < len ? ((const E*)p)[row + d] : 0u, hi = d + 1 < len ? ((const E*)p)[row + d + 1] : 0u;
      w[i] = lo | hi << 16;
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// Shared memory, in floats (the host's shared_floats() says the same): q [R][Dp] from 0, the scores
// [Rp][TK] (Rp: the rows padded to whole row groups of p · V; the padding rows stay 0), the tile's bias
// rows [<= R][TK], the tile's V [TK][Dp] elements from a 16-byte boundary (the rows' sums [R][Dp] reuse
// the scores onwards after the last tile); then max, sum and factor per padded row.
struct Layout {
  int sc, sb, vs, rows;
  __device__ __forceinline__ Layout(int R, int Rp, int Dp, int VS, int TK, int ES, int slots) {
    sc = R * Dp; sb = sc + Rp * TK; vs = (sb + R * TK + 3) / 4 * 4;
    const int tile_end = vs + TK * VS * ES / 4, sums = sc + R * Dp + slots;
    rows = tile_end > sums ? tile_end : sums;
  }
};
template <class Ty, int DMAX, bool VEC, bool MMA>
__device__ __forceinline__ void decode_attention(const Args& a) {
  typedef typename Ty::E E;
  enum { ES = Ty::ES, EPC = 16 / ES,                                // elements per 16-byte chunk
         TK = 16384 / (DMAX * ES) < 128 ? 16384 / (DMAX * ES) : 128,  // keys per tile: its V in 16 KiB
         SPK = THREADS / TK,                                          // threads per key in the scores
         CPT = DMAX / EPC / SPK,                                      // K chunks per thread (4)
         VPT = TK * DMAX * ES / 16 / THREADS,                         // V chunks per thread (4)
         BPT = 16 * TK / THREADS,                                     // bias values per thread (<= 16 rows)
         LPK = DMAX / EPC < 32 ? DMAX / EPC : 32,                     // p · V: lanes per key (one chunk each)
         KPI = 32 / LPK,                                              //   keys a warp takes at once
         CPL = DMAX / EPC / LPK,                                      //   chunks per lane (1 or 2)
         ROWS = 32 / (CPL * EPC),                                     //   rows per warp (8 or 4)
         KW = TK / WARPS,                                             // MMA: keys per warp and tile,
         NT = KW / 8 > 0 ? KW / 8 : 1,                                //   in mma tiles of 8 keys,
         SC = DMAX / 32,                                              //   16-byte K chunks per lane and mma tile
         STEPS = DMAX / 16,                                           //   mma steps of 16 dims
         WPS = TK / 16 >= WARPS ? 1 : WARPS / (TK / 16) };            //   p · V: warps per 16 keys (64 dims each)
  extern __shared__ float smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, kk = tid / SPK, h = tid % SPK;
  const int R = (int)a.R, D = (int)a.D, n = (int)a.n;
  const long long T = a.T, bg = blockIdx.y, b = bg / a.G, g = bg % a.G;
  const int CPR = (D + EPC - 1) / EPC, Dp = CPR * EPC;  // chunks per row; q's padded row
  const int bias_rows = a.bias_b == 0 ? 0 : a.bias_s > 1 ? R / n : 1;  // the bias rows a tile reads (tokens)
  // p · V: the rows in groups of ROWS (a power of two groups), WPG warps per group, each a share of the keys.
  int groups = 1;
  while (groups * ROWS < R) groups *= 2;
  const int WPG = WARPS / groups, row0 = warp / WPG * ROWS, wk = warp % WPG, kq = lane / LPK, cl = lane % LPK;
  const long long t_begin = (long long)blockIdx.x * a.chunk;
  const long long t_end = t_begin + a.chunk < T ? t_begin + a.chunk : T;
  // MMA: the rows are the mma's 16 and V's rows in shared memory are 16 bytes longer (ldmatrix's eight
  // rows then start in different banks).
  const int Rp = MMA ? 16 : groups * ROWS, VS = MMA ? Dp + EPC : Dp;
  const Layout L(R, Rp, Dp, VS, TK, ES, MMA ? 4 * 32 * 32 : 0);
  float* qs = smem; float* sc = smem + L.sc; float* sb = smem + L.sb; E* vs = (E*)(smem + L.vs);
  float* mrow = smem + L.rows; float* lrow = mrow + Rp; float* frow = lrow + Rp;
  for (int i = tid; i < (MMA ? 0 : R * Dp); i += THREADS) {
    const int r = i / Dp, d = i % Dp;
    qs[i] = d < D ? Ty::ld(a.q, ((b * R + r) * a.G + g) * D + d) * a.scale : 0.f;
  }
  for (int r = tid; r < Rp; r += THREADS) { mrow[r] = -INFINITY; lrow[r] = 0.f; frow[r] = 1.f; }
  for (int i = tid; i < (Rp - R) * TK; i += THREADS) sc[R * TK + i] = 0.f;  /* padding rows: p = 0 */
  float acc[ROWS][CPL * EPC];
  _Pragma("unroll") for (int rr = 0; rr < ROWS; ++rr)
    _Pragma("unroll") for (int e = 0; e < CPL * EPC; ++e) acc[rr][e] = 0.f;
  const long long kv = (b * a.G + g) * T * D, bias_base = (a.bias_b > 1 ? b : 0) * a.bias_s * T;
  // MMA: q · Kᵀ on tensor cores, 16 rows (R <= 16; missing rows 0) by 8 keys by 16 dims per mma. The dot
  // product's dims may be taken in any order, the same for q and K: lane (grp = lane / 4, quad = lane % 4)
  // loads its key's dims [quad·D/4, (quad+1)·D/4) as whole 16-byte chunks, and mma step s takes dims
  // 4s…4s+3 of every quad's slice (PTX's m16n8k16 fragment: b0 = k 2·quad, 2·quad+1, b1 = the same + 8;
  // a0/a2 row grp, a1/a3 row grp + 8, the same k). So q's fragments take the same slices of its rows,
  // read from q's rows kept as elements in shared memory (in registers for the whole block they spilled).
  const int grp = lane >> 2, quad = lane & 3, Dsteps = D / 16;
  E* qh = (E*)qs;
  if (MMA)
    for (int i = tid; i < R * D; i += THREADS) qh[i] = ((const E*)a.q)[((b * R + i / D) * a.G + g) * D + i % D];
  for (long long t0 = t_begin; t0 < t_end; t0 += TK) {
    const int keys = t_end - t0 < TK ? (int)(t_end - t0) : TK;
    // Every load of the tile first (nothing reads a result before the last is issued).
    uint4 kc[MMA ? NT * SC : CPT], vc[VPT];
    float bv[BPT];
    if (MMA) {
      _Pragma("unroll") for (int nt = 0; nt < NT; ++nt)
        _Pragma("unroll") for (int u = 0; u < SC; ++u) {
          const int j = warp * KW + nt * 8 + grp;
          kc[nt * SC + u] = j < keys && u < D / 32 ? *(const uint4*)((const char*)a.k + (kv + (t0 + j) * D + quad * (D / 4) + u * 8) * ES)
                                                   : make_uint4(0, 0, 0, 0);
        }
    } else {
      _Pragma("unroll") for (int i = 0; i < CPT; ++i) {
        const int c = h + SPK * i;
        kc[i] = kk < keys && c < CPR ? load_chunk<Ty, VEC>(a.k, kv + (t0 + kk) * D, c, D) : make_uint4(0, 0, 0, 0);
      }
    }
    const int v_chunks = VEC ? keys * D * ES / 16 : 0;
    const uint4* vsrc = (const uint4*)((const char*)a.v + (kv + t0 * D) * ES);
    _Pragma("unroll") for (int u = 0; u < VPT; ++u)  /* MMA: V goes straight to shared memory, below */
      vc[u] = !MMA && tid + THREADS * u < v_chunks ? vsrc[tid + THREADS * u] : make_uint4(0, 0, 0, 0);
    _Pragma("unroll") for (int u = 0; u < BPT; ++u) {
      const int i = tid + THREADS * u, s = i / TK, j = i % TK;
      bv[u] = s < bias_rows && j < keys ? Ty::ld(a.bias, bias_base + s * T + t0 + j) : 0.f;
    }
    __syncthreads();  /* q and the row state written; the last tile's V, scores and bias read */
    _Pragma("unroll") for (int u = 0; u < VPT; ++u)
      if (tid + THREADS * u < v_chunks) {
        const int i = tid + THREADS * u;
        if (MMA) cp_async16(vs + i / CPR * VS + i % CPR * EPC, vsrc + i);  /* waited for before p · V */
        else ((uint4*)vs)[i] = vc[u];
      }
    if (MMA && keys < TK)  /* the keys past the last: V 0 (p is 0 there; 0 · a stale non-finite V is not) */
      for (int i = tid; i < (TK - keys) * VS / EPC; i += THREADS) ((uint4*)(vs + keys * VS))[i] = make_uint4(0, 0, 0, 0);
    if (!VEC)
      for (int e = tid; e < keys * D; e += THREADS) vs[e / D * Dp + e % D] = ((const E*)a.v)[kv + t0 * D + e];
    _Pragma("unroll") for (int u = 0; u < BPT; ++u)
      if (tid + THREADS * u < bias_rows * TK) sb[tid + THREADS * u] = bv[u];
    if (MMA) {
      __syncthreads();
      unsigned qa[MMA ? STEPS : 1][4];
      _Pragma("unroll") for (int st = 0; st < STEPS; ++st)
        _Pragma("unroll") for (int hw = 0; hw < 4; ++hw) {
          const int r = grp + 8 * (hw & 1), d = quad * (D / 4) + 4 * st + 2 * (hw >> 1);
          qa[st][hw] = r < R && st < Dsteps ? *(const unsigned*)(qh + r * D + d) : 0u;
        }
      _Pragma("unroll") for (int nt = 0; nt < NT; ++nt) {
        float c4[4] = {0.f, 0.f, 0.f, 0.f};
        _Pragma("unroll") for (int st = 0; st < STEPS; ++st)
          if (st < Dsteps) {
            const uint4 ch = kc[nt * SC + st / 2];
            Ty::mma(c4, qa[st], st % 2 ? ch.z : ch.x, st % 2 ? ch.w : ch.y);
          }
        _Pragma("unroll") for (int e = 0; e < 4; ++e) {  /* c4[e]: row grp + 8·(e / 2), key 2·quad + e % 2 */
          const int r = grp + 8 * (e >> 1), j = warp * KW + nt * 8 + 2 * quad + (e & 1);
          if (r < R) {
            float sv = c4[e] * a.scale;
            if (bias_rows) sv += sb[(bias_rows > 1 ? r / n : 0) * TK + j];
            sc[r * TK + j] = j < keys ? sv : -INFINITY;
          }
        }
      }
    }
    float kf[MMA ? 1 : CPT * EPC];
    if (!MMA) {
      _Pragma("unroll") for (int i = 0; i < CPT; ++i) unpack<Ty>(kc[i], kf + i * EPC);
      __syncthreads();
    }
    for (int r = 0; r < (MMA ? 0 : R); ++r) {
      float s = 0.f, s2 = 0.f;  /* two FMA chains */
      _Pragma("unroll") for (int i = 0; i < CPT; ++i) {
        const int c = h + SPK * i;
        if (c < CPR) {
          const float4* q4 = (const float4*)(qs + r * Dp + c * EPC);
          _Pragma("unroll") for (int u = 0; u < EPC / 4; ++u) {
            const float4 x = q4[u];
            const float* k4 = kf + i * EPC + 4 * u;
            s = fmaf(x.x, k4[0], s); s2 = fmaf(x.y, k4[1], s2); s = fmaf(x.z, k4[2], s); s2 = fmaf(x.w, k4[3], s2);
          }
        }
      }
      s += s2;
      _Pragma("unroll") for (int o = SPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (h == 0) {
        if (bias_rows) s += sb[(bias_rows > 1 ? r / n : 0) * TK + kk];
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
    if (MMA) cp_async_wait_all();
    __syncthreads();
    if (MMA) {
      /* p · V on tensor cores: warp w takes the 16 keys from (w / WPS)·16 and 64 dims from (w % WPS)·64;
         acc as C[8 mma tiles][4] (row grp + 8·(e / 2), dim 2·quad + e % 2 of its 8). p (float32) is
         split as hi + lo, two 16-bit values, so the products keep about 22 bits (float16). */
      float* C = &acc[0][0];
      const float f0 = frow[grp], f1 = frow[grp + 8];
      _Pragma("unroll") for (int nt = 0; nt < 8; ++nt) {
        C[nt * 4] *= f0; C[nt * 4 + 1] *= f0; C[nt * 4 + 2] *= f1; C[nt * 4 + 3] *= f1;
      }
      const int kbase = warp / WPS * 16, dim0 = warp % WPS * 64;
      if (kbase < keys) {
        const float* p0 = sc + grp * TK + kbase + 2 * quad;
        const float* p1 = p0 + 8 * TK;
        unsigned ah[4], al[4];
        Ty::split2(p0[0], p0[1], &ah[0], &al[0]);
        Ty::split2(p1[0], p1[1], &ah[1], &al[1]);
        Ty::split2(p0[8], p0[9], &ah[2], &al[2]);
        Ty::split2(p1[8], p1[9], &ah[3], &al[3]);
        const E* vrow = vs + (kbase + (lane & 15)) * VS + dim0 + (lane >> 4) * 8;
        _Pragma("unroll") for (int nt = 0; nt < 8; nt += 2)
          if (dim0 + nt * 8 < D) {
            unsigned bm[4];
            ldmatrix_x4_trans(vrow + nt * 8, bm);
            Ty::mma(C + nt * 4, ah, bm[0], bm[1]); Ty::mma(C + nt * 4, al, bm[0], bm[1]);
            Ty::mma(C + nt * 4 + 4, ah, bm[2], bm[3]); Ty::mma(C + nt * 4 + 4, al, bm[2], bm[3]);
          }
      }
    }
    /* p · V: the warp's rows, its keys of the tile, one V chunk per lane and key, converted once for
       every row. A key past `keys` is skipped (its staged V is a stale tile's, maybe not finite). */
    if (!MMA) {
    _Pragma("unroll") for (int rr = 0; rr < ROWS; ++rr) {
      const float f = frow[row0 + rr];
      _Pragma("unroll") for (int e = 0; e < CPL * EPC; ++e) acc[rr][e] *= f;
    }
    for (int j = wk * KPI + kq; j - kq < keys; j += WPG * KPI) {
      if (j < keys) {
        float vf[CPL * EPC];
        _Pragma("unroll") for (int c = 0; c < CPL; ++c) {
          const int ch = cl + LPK * c;
          const uint4 raw = ch < CPR ? ((const uint4*)(vs + j * Dp))[ch] : make_uint4(0, 0, 0, 0);
          unpack<Ty>(raw, vf + c * EPC);
        }
        _Pragma("unroll") for (int rr = 0; rr < ROWS; ++rr) {
          const float p = sc[(row0 + rr) * TK + j];  /* 0 in a padding row */
          _Pragma("unroll") for (int e = 0; e < CPL * EPC; ++e) acc[rr][e] = fmaf(p, vf[e], acc[rr][e]);
        }
      }
    }
    }
  }
  float* sums = sc;
  if (MMA) {
    /* The warps of one dim range add up in a tree (warps w and w + half, half = 4, 2, 1 down to WPS;
       each lane's 32 floats through `slot` [4][32][32 lanes] after sums [R][Dp]), then the first
       WPS warps write sums. One after another was 4 µs of a single-tile block (Nsight Compute). */
    float* C = &acc[0][0];
    float* slot = sums + R * Dp;
    for (int half = WARPS / 2; half >= WPS; half /= 2) {
      __syncthreads();
      if (warp >= half && warp < 2 * half)
        _Pragma("unroll") for (int i = 0; i < 32; ++i) slot[((warp - half) * 32 + i) * 32 + lane] = C[i];
      __syncthreads();
      if (warp < half)
        _Pragma("unroll") for (int i = 0; i < 32; ++i) C[i] += slot[(warp * 32 + i) * 32 + lane];
    }
    if (warp < WPS)
      _Pragma("unroll") for (int nt = 0; nt < 8; ++nt)
        _Pragma("unroll") for (int e = 0; e < 4; ++e) {
          const int r = grp + 8 * (e >> 1), d = warp * 64 + nt * 8 + 2 * quad + (e & 1);
          if (r < R && d < D) sums[r * Dp + d] = C[nt * 4 + e];
        }
    __syncthreads();
  } else {
  /* The lanes of one chunk (one per key slot) add up, then the warps of a row group, one after another
     (shared float atomics are a compare-and-swap loop here), into sums [R][Dp] over the finished tile. */
  _Pragma("unroll") for (int o = LPK; o < 32; o <<= 1)
    _Pragma("unroll") for (int rr = 0; rr < ROWS; ++rr)
      _Pragma("unroll") for (int e = 0; e < CPL * EPC; ++e) acc[rr][e] += __shfl_xor_sync(0xffffffffu, acc[rr][e], o);
  __syncthreads();
  for (int w = 0; w < WPG; ++w) {
    if (wk == w && kq == 0)
      _Pragma("unroll") for (int rr = 0; rr < ROWS; ++rr)
        if (row0 + rr < R)
          _Pragma("unroll") for (int c = 0; c < CPL; ++c) {
            const int ch = cl + LPK * c;
            if (ch < CPR)
              _Pragma("unroll") for (int e = 0; e < EPC; ++e) {
                float* x = sums + (row0 + rr) * Dp + ch * EPC + e;
                *x = (w == 0 ? 0.f : *x) + acc[rr][c * EPC + e];
              }
          }
    __syncthreads();
  }
  }
  const long long BG = a.B * a.G, split = blockIdx.x;
  for (int i = tid; i < R * D; i += THREADS) {
    const int r = i / D, d = i % D;
    const float x = sums[r * Dp + d];
    if (a.splits == 1) {
      Ty::st(a.out, ((b * R + r) * a.G + g) * D + d, lrow[r] > 0.f ? x / lrow[r] : 0.f);
    } else {
      const long long prow = (split * BG + bg) * R + r;
      a.part[prow * D + d] = x;
      if (d == 0) { a.part[a.splits * BG * R * D + prow] = mrow[r];
                    a.part[a.splits * BG * R * (D + 1) + prow] = lrow[r]; }
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
// Per element type: head sizes up to 64, 128 and 256, each with vector loads (_v) and element loads
// (_e), then the combine kernel. The vector kernels fit 128 registers (two blocks per multiprocessor);
// the element kernels of 16-bit types need more (MINB_E 1), where a bound of 128 made ptxas spill.
#define OFX_DECODE_VARIANT(T, TY, DMAX, VEC, SUFFIX, MINB, MMA)                                         \
  extern "C" __global__ void __launch_bounds__(THREADS, MINB) ofx_decode_attention_##T##_d##DMAX##SUFFIX(Args a) { \
    decode_attention<TY, DMAX, VEC, MMA>(a); }
#define OFX_DECODE_ATTENTION(T, TY, MINB_E)                                                            \
  OFX_DECODE_VARIANT(T, TY, 64, true, _v, 2, false) OFX_DECODE_VARIANT(T, TY, 64, false, _e, MINB_E, false) \
  OFX_DECODE_VARIANT(T, TY, 128, true, _v, 2, false) OFX_DECODE_VARIANT(T, TY, 128, false, _e, MINB_E, false) \
  OFX_DECODE_VARIANT(T, TY, 256, true, _v, 2, false) OFX_DECODE_VARIANT(T, TY, 256, false, _e, MINB_E, false) \
  extern "C" __global__ void ofx_decode_attention_##T##_combine(Args a) { decode_combine<TY>(a); }
OFX_DECODE_ATTENTION(f32, F32, 2)
OFX_DECODE_ATTENTION(f16, F16, 1)
OFX_DECODE_ATTENTION(bf16, BF16, 1)
// Tensor cores (_m): 16-bit types, head sizes up to 128 that are multiples of 32, vector loads, sm_80 and
// newer (mma.m16n8k16, cp.async; the host picks them only there: below, the kernels are empty).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
OFX_DECODE_VARIANT(f16, F16, 64, true, _m, 2, true) OFX_DECODE_VARIANT(f16, F16, 128, true, _m, 2, true)
OFX_DECODE_VARIANT(bf16, BF16, 64, true, _m, 2, true) OFX_DECODE_VARIANT(bf16, BF16, 128, true, _m, 2, true)
#else
extern "C" __global__ void ofx_decode_attention_f16_d64_m(Args a) {}
extern "C" __global__ void ofx_decode_attention_f16_d128_m(Args a) {}
extern "C" __global__ void ofx_decode_attention_bf16_d64_m(Args a) {}
extern "C" __global__ void ofx_decode_attention_bf16_d128_m(Args a) {}
#endif
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

// Keys per tile of the kernel variant (TK above): the tile's V in 16 KiB, at most 128 keys.
int64_t tile_keys(int64_t head_size, size_t element_size) {
  const int64_t keys = 16384 / (variant_width(head_size) * static_cast<int64_t>(element_size));
  return keys < 128 ? keys : 128;
}

// The rows of p · V padded, as the kernel's `Rp`: with tensor cores the mma's 16; otherwise whole row
// groups (`groups * ROWS`): a warp's lanes take one 16-byte V chunk per key (at most 32 lanes per key, two
// chunks each beyond) and hold 32 floats per lane, so ROWS rows at once; the groups are a power of two
// (they share the eight warps).
int64_t pv_padded_rows(int64_t rows, int64_t head_size, int64_t element_size, bool tensor_cores) {
  if (tensor_cores) return 16;
  const int64_t per_chunk = 16 / element_size, chunks = variant_width(head_size) / per_chunk;
  const int64_t lanes_per_key = chunks < 32 ? chunks : 32, per_lane = chunks / lanes_per_key * per_chunk;
  const int64_t group_rows = 32 / per_lane;
  int64_t groups = 1;
  while (groups * group_rows < rows) groups *= 2;
  return groups * group_rows;
}

// Shared memory of the kernel, in floats, as its `Layout`: q [R][Dp] (Dp: D rounded up to whole 16-byte
// chunks), the scores [Rp][TK] (Rp: pv_padded_rows) and the bias rows [R][TK], the tile's V (TK rows of
// Dp elements, one chunk more with tensor cores, from a 16-byte boundary) or the rows' sums [R][Dp]
// (with tensor cores and 4096 floats for the warps' tree after them), whichever ends later; then three
// floats per padded row.
int64_t shared_floats(int64_t rows, int64_t head_size, int64_t tile, size_t element_size, bool tensor_cores) {
  const int64_t es = static_cast<int64_t>(element_size), per_chunk = 16 / es;
  const int64_t padded = (head_size + per_chunk - 1) / per_chunk * per_chunk;
  const int64_t v_row = tensor_cores ? padded + per_chunk : padded;
  const int64_t sc = rows * padded, padded_rows = pv_padded_rows(rows, head_size, es, tensor_cores);
  const int64_t vs = (sc + padded_rows * tile + rows * tile + 3) / 4 * 4;
  const int64_t tile_end = vs + tile * v_row * es / 4, sums = sc + rows * padded + (tensor_cores ? 4 * 32 * 32 : 0);
  return (tile_end > sums ? tile_end : sums) + 3 * padded_rows;
}

// Vector loads (16 bytes): K and V 16-byte aligned and rows of whole 16-byte chunks.
bool vector_loads(const Call& c, int64_t head_size) {
  return reinterpret_cast<uintptr_t>(c.in[1]) % 16 == 0 && reinterpret_cast<uintptr_t>(c.in[2]) % 16 == 0 &&
         (head_size * static_cast<int64_t>(element_size(c.type))) % 16 == 0;
}

// Keys per split, a whole number of tiles: as many splits as fit in one wave of the GPU (`resident`: the
// blocks the device runs at once) beside the heads' blocks, at least one; a second, nearly empty wave
// would cost a whole block's time (rounding the split count up did that: 17 splits of 16 heads' blocks
// on 264 resident, docs/benchmarks.md 5.38).
int64_t keys_per_split(int64_t blocks_without_split, int64_t keys, int64_t resident, int64_t tile) {
  int64_t splits = blocks_without_split >= resident ? 1 : resident / blocks_without_split;
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
  std::vector<void*> fns;  // per type (f32, f16, bf16): d64, d128 and d256, vector then element loads; the combine
  std::vector<int64_t> resident;  // per kernel of fns: the blocks the device runs at once
  void* cu_ctx = nullptr;
  bool has_tensor_cores = false;  // compute capability 8.0 or newer: the _m kernels

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    Call c;
    if (OrtStatus* st = prepare(ctx, spec, node, &c)) return st;
    if (spec.size > static_cast<int64_t>(kThreads))
      return fail(ORT_INVALID_ARGUMENT, node, "head size above " + std::to_string(kThreads));
    if (c.R > kMaxRows)  // the spec's max_rows is above the kernel's
      return fail(ORT_INVALID_ARGUMENT, node, std::to_string(c.R) + " query rows per key/value head; with head size " +
                                                  std::to_string(spec.size) + " the kernel takes at most " +
                                                  std::to_string(kMaxRows));
    CudaArgs a{};
    a.q = c.in[0], a.k = c.in[1], a.v = c.in[2], a.bias = c.in[3], a.out = c.out;
    a.B = c.B, a.R = c.R, a.S = c.S, a.T = c.T, a.G = spec.kv_heads, a.D = spec.size, a.n = spec.heads / spec.kv_heads;
    a.bias_b = c.bias_b, a.bias_s = c.bias_s, a.scale = static_cast<float>(spec.scale);
    const int64_t BG = c.B * a.G;
    const int64_t width = variant_width(a.D);
    a.vec = vector_loads(c, a.D) ? 1 : 0;
    const int type = c.type == kFloat ? 0 : c.type == kFloat16 ? 1 : 2;
    // Tensor cores for q · Kᵀ where the products are exact in float32 (16-bit types) and a lane's quarter
    // of a key is whole 16-byte chunks.
    const bool tensor_cores = has_tensor_cores && type != 0 && a.vec && a.D % 32 == 0 && width <= 128;
    const int which = type * kKernelsPerType + (tensor_cores ? kTensorCoreSlot + (width == 64 ? 0 : 1)
                                                             : (width == 64 ? 0 : width == 128 ? 2 : 4) + (a.vec ? 0 : 1));
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
    const unsigned shared =
        static_cast<unsigned>(shared_floats(c.R, a.D, tile, element_size(c.type), tensor_cores) * sizeof(float));
    void* args[] = {&a};
    std::string err;
    if (!launch_fixed(fns[which], cu_ctx, a.splits, kThreads, stream, args, &err, BG, shared))
      return fail(ORT_RUNTIME_EXCEPTION, node, err);
    const int64_t outputs = BG * c.R * a.D;
    void* combine = fns[type * kKernelsPerType + kCombineSlot];
    if (a.splits > 1 && !launch_fixed(combine, cu_ctx, (outputs + kThreads - 1) / kThreads, kThreads, stream, args, &err))
      return fail(ORT_RUNTIME_EXCEPTION, node, err);
    return nullptr;
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
  const int device = device_of(api, info);
  std::string err;
  std::vector<std::string> names;  // every slot's kernel that exists, in slot order
  for (int type = 0; type < 3; ++type)
    for (int slot = 0; slot < kKernelsPerType; ++slot)
      if (!kernel_name(type, slot).empty()) names.push_back(kernel_name(type, slot));
  std::vector<void*> loaded;
  if (!fixed_kernels(std::string(kCudaTypedIo) + kCudaSource, names, device, &loaded, &k->cu_ctx, &err))
    return fail(ORT_FAIL, k->node, err);
  // The blocks each kernel keeps resident at its largest shared memory (the split count fills one wave).
  // 264 (two per multiprocessor of an H100) where the driver does not say.
  k->has_tensor_cores = compute_capability(device) >= 80;
  size_t next = 0;
  for (int type = 0; type < 3; ++type)
    for (int slot = 0; slot < kKernelsPerType; ++slot) {
      void* fn = kernel_name(type, slot).empty() ? nullptr : loaded[next++];
      const size_t es = type == 0 ? 4 : 2;
      const int64_t D = slot == kCombineSlot ? 64 : slot >= kTensorCoreSlot ? int64_t{64} << (slot - kTensorCoreSlot)
                                                                             : int64_t{64} << (slot / 2);
      const int64_t shared = shared_floats(kMaxRows, D, tile_keys(D, es), es, slot >= kTensorCoreSlot) * 4;
      const int n = fn ? resident_blocks(fn, k->cu_ctx, device, kThreads, static_cast<unsigned>(shared)) : 0;
      k->fns.push_back(fn);
      k->resident.push_back(n > 0 ? n : 264);
    }
  return nullptr;
}

}  // namespace

const OrtCustomOp* decode_attention_cpu_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CpuDecodeAttention, load_spec<CpuDecodeAttention>, &kOpName, 3, 2, &api>(version);
}

const OrtCustomOp* decode_attention_cuda_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CudaDecodeAttention, init_cuda, &kOpName, 3, 2, &api>(version);
}

}  // namespace onnxfuse
