// ChannelsLastMean (domain ai.onnxfuse, opset 1): GlobalAveragePool of a channels-last tensor, the
// mean over H and W of [N, H, W, C], as [N, 1, 1, C]. Why: a channels-last region's GlobalAveragePool
// (every squeeze-excitation block of MobileNetV3 and EfficientNet) was ReduceMean over axes [1, 2],
// which ONNX Runtime's CUDA provider hands to cuDNN's generic reduction: in a DB text detector at batch
// 16 (MobileNetV3-L at 640 x 640) its eight took 1.08 ms, 4.5 times the original's NCHW
// GlobalAveragePool (ncu, docs/benchmarks.md 5.69). Where it is written:
// onnxfuse/rewrites/contrib/contrib_channels_last.py; the contract: docs/custom-ops.md.
//
//   input   x: [N, H, W, C], float32, float16 or bfloat16
//   output  y: x's type, [N, 1, 1, C]; y[n, 0, 0, c] = round_T(Σ_{h,w} float(x[n, h, w, c]) / (H·W))
//
// The sum is float32 on CUDA (each thread sums its pixels in order, then a fixed tree over threads: the
// same bits on every run) and float64 on the CPU; H·W = 0 gives 0/0 = NaN, as ReduceMean of nothing.
#include "channels_last_mean.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "attention_common.h"
#include "cuda_runtime.h"

namespace onnxfuse {
namespace {

using namespace onnxfuse_ort;

const char* const kOpName = "ChannelsLastMean";
const OrtApi* api = nullptr;

// Threads per block of the CUDA kernel, and the blocks it aims for at least (about two per multiprocessor
// of an H100 / H200) when choosing how many channels a warp's lanes cover.
constexpr unsigned kThreads = 512;
constexpr long long kMinBlocks = 256;

OrtStatus* fail(OrtErrorCode code, const std::string& node, const std::string& msg) {
  return op_error(api, code, kOpName, node, msg);
}

// The tensors of one call, checked: n images of p = H·W pixels of c channels.
struct Call {
  long long n = 0, p = 0, c = 0;
  int type = 0;
  const void* x = nullptr;
  void* y = nullptr;
};

OrtStatus* prepare(OrtKernelContext* ctx, const std::string& node, Call* c) {
  std::vector<int64_t> d;
  OrtStatus* st;
  if ((st = read_input(api, ctx, 0, &d, &c->type, &c->x))) return st;
  if (d.size() != 4) return fail(ORT_INVALID_ARGUMENT, node, "x is " + shape_text(d) + ", expected rank 4 [N, H, W, C]");
  if (c->type != kFloat && c->type != kFloat16 && c->type != kBFloat16)
    return fail(ORT_INVALID_ARGUMENT, node, "x must be float, float16 or bfloat16");
  c->n = d[0], c->p = d[1] * d[2], c->c = d[3];
  return make_output(api, ctx, 0, {d[0], 1, 1, d[3]}, &c->y);
}

// ------------------------------------------------------------------ CPU

struct CpuChannelsLastMean {
  static const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
  std::string node;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    Call c;
    if (OrtStatus* st = prepare(ctx, node, &c)) return st;
    std::vector<double> sums(static_cast<size_t>(c.c));
    for (long long b = 0; b < c.n; ++b) {
      std::fill(sums.begin(), sums.end(), 0.0);
      for (long long q = 0; q < c.p; ++q)
        for (long long ch = 0; ch < c.c; ++ch) sums[ch] += load(c.x, (b * c.p + q) * c.c + ch, c.type);
      for (long long ch = 0; ch < c.c; ++ch)
        store(c.y, b * c.c + ch, c.type, static_cast<float>(sums[ch] / static_cast<double>(c.p)));
    }
    return nullptr;
  }
};

// ------------------------------------------------------------------ CUDA
// One block per (image, group of `lanes` consecutive channels). A warp's 32 lanes cover `lanes` channels
// (32, 16 or 8) of 32 / lanes pixels at once, so each load of a warp reads whole runs of consecutive
// channels (at least 32 bytes of float32); the block's warps take pixels in turn, four loads in flight
// per thread. Each thread sums its pixels in float32 in order; the lanes of one channel are then added
// by shuffles, the warps by one thread per channel in warp order. The host picks `lanes`: the widest
// that still gives kMinBlocks blocks (a [16, 80, 80, 72] tensor: 8 lanes, 144 blocks, none idle).
const char* kCudaSource = R"CUDA(
#define THREADS 512
#define WARPS (THREADS / 32)
struct Args { const void* x; void* y; long long n, p, c, groups; int lanes, pad_; };
#define OFX_CHANNELS_LAST_MEAN(TN)                                                                    \
  extern "C" __global__ void __launch_bounds__(THREADS) ofx_channels_last_mean_##TN(Args a) {          \
    __shared__ float part[WARPS][32];                                                                  \
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, lanes = a.lanes;                       \
    const int rows = 32 / lanes, row = lane / lanes;                                                   \
    const long long b = blockIdx.x / a.groups, ch = (blockIdx.x % a.groups) * lanes + lane % lanes;    \
    const long long step = (long long)WARPS * rows;                                                    \
    float s = 0.f;                                                                                     \
    if (ch < a.c) {                                                                                    \
      const long long base = b * a.p * a.c + ch;                                                       \
      long long q = (long long)warp * rows + row;                                                      \
      for (; q + 3 * step < a.p; q += 4 * step) {                                                      \
        const float v0 = ld_##TN(a.x, base + q * a.c), v1 = ld_##TN(a.x, base + (q + step) * a.c);     \
        const float v2 = ld_##TN(a.x, base + (q + 2 * step) * a.c);                                    \
        const float v3 = ld_##TN(a.x, base + (q + 3 * step) * a.c);                                    \
        s += v0; s += v1; s += v2; s += v3;                                                            \
      }                                                                                                \
      for (; q < a.p; q += step) s += ld_##TN(a.x, base + q * a.c);                                    \
    }                                                                                                  \
    for (int o = 16; o >= lanes; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);                    \
    if (lane < lanes) part[warp][lane] = s;                                                            \
    __syncthreads();                                                                                   \
    if (threadIdx.x < lanes && ch < a.c) {                                                             \
      float total = 0.f;                                                                               \
      for (int w = 0; w < WARPS; ++w) total += part[w][threadIdx.x];                                   \
      st_##TN(a.y, b * a.c + ch, total / (float)a.p);                                                  \
    }                                                                                                  \
  }
OFX_CHANNELS_LAST_MEAN(f32) OFX_CHANNELS_LAST_MEAN(f16) OFX_CHANNELS_LAST_MEAN(bf16)
)CUDA";

// The kernel's argument block, laid out as `struct Args` above.
struct CudaArgs {
  const void* x;
  void* y;
  long long n, p, c, groups;
  int lanes, pad_;
};

// Lanes per channel group: 32 unless fewer give the grid kMinBlocks blocks (down to 8: a warp's load
// is then 8 consecutive channels of 4 pixels, 32 bytes of float32 each).
int lanes_for(long long n, long long c) {
  int lanes = 32;
  while (lanes > 8 && n * ((c + lanes - 1) / lanes) < kMinBlocks) lanes /= 2;
  return lanes;
}

struct CudaChannelsLastMean {
  static const char* provider(const OrtCustomOp*) { return "CUDAExecutionProvider"; }
  std::string node;
  std::vector<void*> fns;  // f32, f16, bf16
  void* cu_ctx = nullptr;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    Call c;
    if (OrtStatus* st = prepare(ctx, node, &c)) return st;
    if (c.n == 0 || c.c == 0) return nullptr;
    CudaArgs a{};
    a.x = c.x, a.y = c.y, a.n = c.n, a.p = c.p, a.c = c.c;
    a.lanes = lanes_for(c.n, c.c);
    a.groups = (c.c + a.lanes - 1) / a.lanes;
    if (c.n * a.groups > 2147483647LL) return fail(ORT_INVALID_ARGUMENT, node, "more than 2^31 - 1 blocks");
    void* stream = nullptr;
    if (OrtStatus* st = api->KernelContext_GetGPUComputeStream(ctx, &stream)) return st;
    void* args[] = {&a};
    std::string err;
    void* fn = fns[c.type == kFloat ? 0 : c.type == kFloat16 ? 1 : 2];
    if (!launch_fixed(fn, cu_ctx, c.n * a.groups, kThreads, stream, args, &err))
      return fail(ORT_RUNTIME_EXCEPTION, node, err);
    return nullptr;
  }
};

OrtStatus* init_cpu(const OrtKernelInfo* info, CpuChannelsLastMean* k) {
  k->node = node_label(api, info);
  return nullptr;
}

OrtStatus* init_cuda(const OrtKernelInfo* info, CudaChannelsLastMean* k) {
  k->node = node_label(api, info);
  std::string err;
  if (!fixed_kernels(std::string(kCudaTypedIo) + kCudaSource,
                     {"ofx_channels_last_mean_f32", "ofx_channels_last_mean_f16", "ofx_channels_last_mean_bf16"},
                     device_of(api, info), &k->fns, &k->cu_ctx, &err))
    return fail(ORT_FAIL, k->node, err);
  return nullptr;
}

}  // namespace

// The registrations: one input and one output of the same type (ONNX Runtime types the output from the
// input; its shape comes from the kernel's output at run time).

const OrtCustomOp* channels_last_mean_cpu_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CpuChannelsLastMean, init_cpu, &kOpName, 1, 1, &api>(version);
}

const OrtCustomOp* channels_last_mean_cuda_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return registered_op<CudaChannelsLastMean, init_cuda, &kOpName, 1, 1, &api>(version);
}

}  // namespace onnxfuse
