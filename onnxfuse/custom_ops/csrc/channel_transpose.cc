// ChannelTranspose (domain ai.onnxfuse, opset 1): ONNX Transpose with perm [0, 2, 3, 1] (NCHW → NHWC,
// spec "to=nhwc") or [0, 3, 1, 2] (NHWC → NCHW, spec "to=nchw") of a rank-4 tensor, for the few-channel
// tensors at a channels-last region's boundary (an RGB image). Why: ONNX Runtime's CUDA Transpose moves
// such a tensor through 32 × 32 tiles of which 3 rows are used: the [16, 3, 640, 640] image of a
// YOLO-style detector took 0.325 ms, about nine times a copy of its bytes (H200, docs/benchmarks.md 5.27).
// Here a block stages a tile of pixels × all C channels in shared memory, so both the reads and the writes
// are whole consecutive runs. Where it is written: onnxfuse/rewrites/contrib/contrib_channel_transpose.py;
// the contract: docs/custom-ops.md.
//
//   input   x: rank 4, float32, float16 or bfloat16; to=nhwc: [N, C, H, W]; to=nchw: [N, H, W, C]
//   output  y: x's type; to=nhwc: [N, H, W, C]; to=nchw: [N, C, H, W]
//   attribute spec (string): "to=nhwc" or "to=nchw"
//
// A copy of every element's bits, so exact; C at most kMaxChannels (the shared-memory tile's), more fail
// the run with one line naming the node.
#include "channel_transpose.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attention_common.h"
#include "cuda_runtime.h"

namespace onnxfuse {
namespace {

using namespace onnxfuse_ort;

const char* const kOpName = "ChannelTranspose";
const OrtApi* api = nullptr;

// Elements of a block's shared tile (TILE_ELEMENTS in the CUDA source: 32 KiB of 4-byte words), and the
// most channels a tile takes (at least 128 pixels of them).
constexpr long long kTileElements = 8192;
constexpr long long kMaxChannels = 64;
constexpr unsigned kThreads = 256;

OrtStatus* fail(OrtErrorCode code, const std::string& node, const std::string& msg) {
  return op_error(api, code, kOpName, node, msg);
}

// The tensors of one call, checked: n images of c channels and p = H·W pixels.
struct Call {
  long long n = 0, c = 0, p = 0;
  int type = 0;
  const void* x = nullptr;
  void* y = nullptr;
};

// The output's dims from the input's: NCHW → NHWC or back.
std::vector<int64_t> moved(const std::vector<int64_t>& d, bool to_nhwc) {
  return to_nhwc ? std::vector<int64_t>{d[0], d[2], d[3], d[1]} : std::vector<int64_t>{d[0], d[3], d[1], d[2]};
}

OrtStatus* prepare(OrtKernelContext* ctx, const std::string& node, bool to_nhwc, Call* c) {
  std::vector<int64_t> d;
  OrtStatus* st;
  if ((st = read_input(api, ctx, 0, &d, &c->type, &c->x))) return st;
  if (d.size() != 4) return fail(ORT_INVALID_ARGUMENT, node, "x is " + shape_text(d) + ", expected rank 4");
  if (c->type != kFloat && c->type != kFloat16 && c->type != kBFloat16)
    return fail(ORT_INVALID_ARGUMENT, node, "x must be float, float16 or bfloat16");
  c->n = d[0];
  c->c = to_nhwc ? d[1] : d[3];
  c->p = to_nhwc ? d[2] * d[3] : d[1] * d[2];
  if (c->c > kMaxChannels)
    return fail(ORT_INVALID_ARGUMENT, node, "x has " + std::to_string(c->c) + " channels; the op takes at most " +
                                                std::to_string(kMaxChannels));
  return make_output(api, ctx, 0, moved(d, to_nhwc), &c->y);
}

// ------------------------------------------------------------------ CPU

struct CpuChannelTranspose {
  static const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
  bool to_nhwc = true;
  std::string node;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    Call c;
    if (OrtStatus* st = prepare(ctx, node, to_nhwc, &c)) return st;
    const size_t e = element_size(c.type);
    const char* x = static_cast<const char*>(c.x);
    char* y = static_cast<char*>(c.y);
    for (long long b = 0; b < c.n; ++b)
      for (long long ch = 0; ch < c.c; ++ch)
        for (long long q = 0; q < c.p; ++q) {
          const long long planar = (b * c.c + ch) * c.p + q, interleaved = (b * c.p + q) * c.c + ch;
          const long long from = to_nhwc ? planar : interleaved, to = to_nhwc ? interleaved : planar;
          std::memcpy(y + to * e, x + from * e, e);
        }
    return nullptr;
  }
};

// ------------------------------------------------------------------ CUDA
// One block per (image, tile of T pixels), T = kTileElements / C rounded down to a multiple of 32 (an
// RGB image: 2,720 pixels a block, each thread moving about 32 elements): the planar side is read or
// written as C runs of T consecutive elements, the interleaved side as one run of T·C, both through the
// shared tile, whose element (pixel q, channel ch) is tile[q·C + ch]. Bits are copied as 16- or 32-bit
// words; no division per element.
const char* kCudaSource = R"CUDA(
#define TILE_ELEMENTS 8192
#define THREADS 256
struct Args { const void* x; void* y; long long n, c, p, tiles, tile_p; };
#define OFX_CHANNEL_TRANSPOSE(NAME, T)                                                                 \
  extern "C" __global__ void __launch_bounds__(THREADS) ofx_to_nhwc_##NAME(Args a) {                   \
    __shared__ T tile[TILE_ELEMENTS];                                                                  \
    const long long b = blockIdx.x / a.tiles, q0 = (blockIdx.x % a.tiles) * a.tile_p;                  \
    const int c = (int)a.c, q_n = (int)(a.p - q0 < a.tile_p ? a.p - q0 : a.tile_p);                    \
    const T* x = (const T*)a.x + b * a.c * a.p + q0;                                                   \
    for (int ch = 0; ch < c; ++ch)                                                                     \
      for (int q = threadIdx.x; q < q_n; q += THREADS) tile[q * c + ch] = x[(long long)ch * a.p + q];  \
    __syncthreads();                                                                                   \
    T* y = (T*)a.y + (b * a.p + q0) * a.c;                                                             \
    for (int k = threadIdx.x; k < q_n * c; k += THREADS) y[k] = tile[k];                               \
  }                                                                                                    \
  extern "C" __global__ void __launch_bounds__(THREADS) ofx_to_nchw_##NAME(Args a) {                   \
    __shared__ T tile[TILE_ELEMENTS];                                                                  \
    const long long b = blockIdx.x / a.tiles, q0 = (blockIdx.x % a.tiles) * a.tile_p;                  \
    const int c = (int)a.c, q_n = (int)(a.p - q0 < a.tile_p ? a.p - q0 : a.tile_p);                    \
    const T* x = (const T*)a.x + (b * a.p + q0) * a.c;                                                 \
    for (int k = threadIdx.x; k < q_n * c; k += THREADS) tile[k] = x[k];                               \
    __syncthreads();                                                                                   \
    T* y = (T*)a.y + b * a.c * a.p + q0;                                                               \
    for (int ch = 0; ch < c; ++ch)                                                                     \
      for (int q = threadIdx.x; q < q_n; q += THREADS) y[(long long)ch * a.p + q] = tile[q * c + ch];  \
  }
OFX_CHANNEL_TRANSPOSE(b16, unsigned short) OFX_CHANNEL_TRANSPOSE(b32, unsigned int)
)CUDA";

// The kernel's argument block, laid out as `struct Args` above.
struct CudaArgs {
  const void* x;
  void* y;
  long long n, c, p, tiles, tile_p;
};

struct CudaChannelTranspose {
  static const char* provider(const OrtCustomOp*) { return "CUDAExecutionProvider"; }
  bool to_nhwc = true;
  std::string node;
  std::vector<void*> fns;  // to_nhwc b16, b32, to_nchw b16, b32
  void* cu_ctx = nullptr;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    Call c;
    if (OrtStatus* st = prepare(ctx, node, to_nhwc, &c)) return st;
    if (c.n == 0 || c.c == 0 || c.p == 0) return nullptr;
    CudaArgs a{};
    a.x = c.x, a.y = c.y, a.n = c.n, a.c = c.c, a.p = c.p;
    a.tile_p = kTileElements / c.c / 32 * 32;  // at least 128 pixels: C <= kMaxChannels
    a.tiles = (c.p + a.tile_p - 1) / a.tile_p;
    void* stream = nullptr;
    if (OrtStatus* st = api->KernelContext_GetGPUComputeStream(ctx, &stream)) return st;
    void* args[] = {&a};
    std::string err;
    void* fn = fns[(to_nhwc ? 0 : 2) + (element_size(c.type) == 4 ? 1 : 0)];
    if (!launch_fixed(fn, cu_ctx, c.n * a.tiles, kThreads, stream, args, &err))
      return fail(ORT_RUNTIME_EXCEPTION, node, err);
    return nullptr;
  }
};

template <class Kernel>
OrtStatus* load_spec(const OrtKernelInfo* info, Kernel* k) {
  k->node = node_label(api, info);
  std::map<std::string, std::string> items;
  std::string err;
  if (!read_spec_items(api, info, {"to"}, &items, &err)) return fail(ORT_INVALID_GRAPH, k->node, err);
  if (!items.count("to") || (items["to"] != "nhwc" && items["to"] != "nchw"))
    return fail(ORT_INVALID_GRAPH, k->node, "spec needs to=nhwc or to=nchw");
  k->to_nhwc = items["to"] == "nhwc";
  return nullptr;
}

OrtStatus* init_cuda(const OrtKernelInfo* info, CudaChannelTranspose* k) {
  if (OrtStatus* st = load_spec(info, k)) return st;
  const std::vector<std::string> names = {"ofx_to_nhwc_b16", "ofx_to_nhwc_b32", "ofx_to_nchw_b16", "ofx_to_nchw_b32"};
  std::string err;
  if (!fixed_kernels(kCudaSource, names, device_of(api, info), &k->fns, &k->cu_ctx, &err))
    return fail(ORT_FAIL, k->node, err);
  return nullptr;
}

}  // namespace

// The registrations: one input and one output of the same type (ONNX Runtime types the output from the
// input; its shape comes from the kernel's output at run time).

const OrtCustomOp* channel_transpose_cpu_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CpuChannelTranspose, load_spec<CpuChannelTranspose>, &kOpName, 1, 1, &api>(version);
}

const OrtCustomOp* channel_transpose_cuda_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CudaChannelTranspose, init_cuda, &kOpName, 1, 1, &api>(version);
}

}  // namespace onnxfuse
