// MixedRMSNorm (domain ai.onnxfuse, opset 1): a residual sum and RMS normalization computed in float32,
// whose result is rounded to γ's type before γ multiplies, as the float32 island of a float16 model's
// RMSNorm does it. Why and when: onnxfuse/rewrites/contrib/contrib_mixed_rmsnorm.py; the contract:
// docs/custom-ops.md.
//
//   inputs   x [..., d] (float32, float16 or bfloat16), optionally skip (float32, x's shape), gamma [d]
//            (float32, float16 or bfloat16): two inputs are (x, gamma), three (x, skip, gamma)
//   outputs  y (gamma's type, x's shape), optionally sum (float32, x's shape)
//   attribute spec (string): "epsilon=ε"
//
// Per row of d elements, T = gamma's type, round_T rounding to nearest even in T:
//   s = float(x) + skip           (float32; s = float(x) without skip)     sum = s
//   r = 1 / sqrt(Σ s² / d + ε)    (float32; the sum in another order than a ReduceMean's)
//   y = round_T(round_T(s · r) · γ)
#include "mixed_rmsnorm.h"

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attention_common.h"
#include "cuda_runtime.h"

namespace onnxfuse {
namespace {

using namespace onnxfuse_ort;

const char* const kOpName = "MixedRMSNorm";
const OrtApi* api = nullptr;

// Threads per block of the CUDA kernel (one block per row).
constexpr unsigned kThreads = 256;

OrtStatus* fail(OrtErrorCode code, const std::string& node, const std::string& msg) {
  return op_error(api, code, kOpName, node, msg);
}

bool float_type(int t) { return t == kFloat || t == kFloat16 || t == kBFloat16; }

// The tensors of one call, checked.
struct Call {
  int64_t rows = 0, d = 0;
  int x_type = 0, gamma_type = 0;
  const void* x = nullptr;
  const float* skip = nullptr;
  const void* gamma = nullptr;
  void* y = nullptr;
  float* sum = nullptr;
};

OrtStatus* prepare(OrtKernelContext* ctx, const std::string& node, Call* c) {
  size_t nin = 0, nout = 0;
  OrtStatus* st;
  if ((st = api->KernelContext_GetInputCount(ctx, &nin))) return st;
  if ((st = api->KernelContext_GetOutputCount(ctx, &nout))) return st;
  if ((nin != 2 && nin != 3) || (nout != 1 && nout != 2))
    return fail(ORT_INVALID_GRAPH, node, "takes 2 or 3 inputs and 1 or 2 outputs, got " + std::to_string(nin) + " and " +
                                             std::to_string(nout));
  std::vector<std::vector<int64_t>> dims(nin);
  std::vector<int> types(nin);
  std::vector<const void*> data(nin);
  for (size_t i = 0; i < nin; ++i)
    if ((st = read_input(api, ctx, i, &dims[i], &types[i], &data[i]))) return st;
  const auto& x = dims[0];
  const auto& g = dims[nin - 1];
  if (x.empty()) return fail(ORT_INVALID_ARGUMENT, node, "x is a scalar; it needs a last axis to normalize");
  c->d = x.back();
  c->rows = 1;
  for (size_t i = 0; i + 1 < x.size(); ++i) c->rows *= x[i];
  if (g.size() != 1 || g[0] != c->d)
    return fail(ORT_INVALID_ARGUMENT, node, "gamma is " + shape_text(g) + ", expected [" + std::to_string(c->d) + "]");
  if (nin == 3 && dims[1] != x)
    return fail(ORT_INVALID_ARGUMENT, node, "skip is " + shape_text(dims[1]) + ", expected x's shape " + shape_text(x));
  c->x_type = types[0], c->gamma_type = types[nin - 1];
  if (!float_type(c->x_type) || !float_type(c->gamma_type))
    return fail(ORT_INVALID_ARGUMENT, node, "x and gamma must be float, float16 or bfloat16");
  if (nin == 3 && types[1] != kFloat) return fail(ORT_INVALID_ARGUMENT, node, "skip must be float");
  c->x = data[0], c->gamma = data[nin - 1];
  c->skip = nin == 3 ? static_cast<const float*>(data[1]) : nullptr;
  if ((st = make_output(api, ctx, 0, x, &c->y))) return st;
  if (nout == 2) {
    void* sum = nullptr;
    if ((st = make_output(api, ctx, 1, x, &sum))) return st;
    c->sum = static_cast<float*>(sum);
  }
  return nullptr;
}

// The output types and shapes from the inputs' (ONNX Runtime's type inference of the node): y has
// gamma's type, sum float32, both x's shape.
OrtStatusPtr infer(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  size_t nin = 0;
  if (OrtStatus* st = api->ShapeInferContext_GetInputCount(ctx, &nin)) return st;
  if (nin != 2 && nin != 3) return fail(ORT_INVALID_GRAPH, "", "takes 2 or 3 inputs, got " + std::to_string(nin));
  OrtTensorTypeAndShapeInfo* x = nullptr;  // owned by ONNX Runtime
  OrtTensorTypeAndShapeInfo* g = nullptr;
  if (OrtStatus* st = api->ShapeInferContext_GetInputTypeShape(ctx, 0, &x)) return st;
  if (OrtStatus* st = api->ShapeInferContext_GetInputTypeShape(ctx, nin - 1, &g)) return st;
  if (!x || !g) return nullptr;
  ONNXTensorElementDataType gt = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  size_t nd = 0;
  OrtStatus* st = api->GetTensorElementType(g, &gt);
  if (!st) st = api->GetDimensionsCount(x, &nd);
  std::vector<int64_t> d(nd);
  std::vector<const char*> sym(nd, nullptr);
  if (!st && nd) st = api->GetDimensions(x, d.data(), nd);
  if (!st && nd) st = api->GetSymbolicDimensions(x, sym.data(), nd);
  if (st) return st;
  for (auto& s : sym)
    if (!s) s = "";
  const ONNXTensorElementDataType out_types[2] = {gt, static_cast<ONNXTensorElementDataType>(kFloat)};
  for (size_t j = 0; j < 2; ++j) {
    OrtTensorTypeAndShapeInfo* info = nullptr;
    if ((st = api->CreateTensorTypeAndShapeInfo(&info))) return st;
    st = api->SetTensorElementType(info, out_types[j]);
    if (!st) st = api->SetDimensions(info, d.data(), nd);
    if (!st) st = api->SetSymbolicDimensions(info, sym.data(), nd);
    if (!st) st = api->ShapeInferContext_SetOutputTypeShape(ctx, j, info);
    api->ReleaseTensorTypeAndShapeInfo(info);
    if (st) {
      if (j == 0) return st;
      api->ReleaseStatus(st);  // a node with one output: no second to declare
    }
  }
  return nullptr;
}

// ------------------------------------------------------------------ CPU

struct CpuMixedRMSNorm {
  static const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }
  float epsilon = 0;
  std::string node;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    Call c;
    if (OrtStatus* st = prepare(ctx, node, &c)) return st;
    std::vector<float> s(static_cast<size_t>(c.d));
    for (int64_t r = 0; r < c.rows; ++r) {
      double squares = 0;  // float32 squares, summed in double (at least as accurate as a float ReduceMean)
      for (int64_t i = 0; i < c.d; ++i) {
        const int64_t at = r * c.d + i;
        float v = load(c.x, at, c.x_type);
        if (c.skip) v += c.skip[at];
        s[i] = v;
        if (c.sum) c.sum[at] = v;
        squares += static_cast<double>(v * v);
      }
      const float mean = static_cast<float>(squares / static_cast<double>(c.d));
      const float inv = 1.0f / std::sqrt(mean + epsilon);
      for (int64_t i = 0; i < c.d; ++i)
        store(c.y, r * c.d + i, c.gamma_type, round_as(s[i] * inv, c.gamma_type) * load(c.gamma, i, c.gamma_type));
    }
    return nullptr;
  }
};

// ------------------------------------------------------------------ CUDA
// One block per row: each thread sums the squares of its elements (strided by the block), the block's
// warps reduce them, then each thread writes its elements' y (and the sum on the first pass). IEEE
// square root and division (NVRTC's defaults), so only the order of the squares' sum differs from the
// decomposed graph.
const char* kCudaSource = R"CUDA(
#define THREADS 256
struct Args {
  const void* x; const float* skip; const void* gamma; void* y; float* sum;
  long long d; float epsilon; float pad_;
};
#define OFX_MIXED_RMSNORM(XN, GN)                                                                     \
  extern "C" __global__ void __launch_bounds__(THREADS) ofx_mixed_rmsnorm_##XN##_##GN(Args a) {       \
    __shared__ float part[THREADS / 32];                                                               \
    const long long row = blockIdx.x, base = row * a.d;                                                \
    float sq = 0.f;                                                                                    \
    for (long long i = threadIdx.x; i < a.d; i += THREADS) {                                           \
      float v = ld_##XN(a.x, base + i);                                                                \
      if (a.skip) v += a.skip[base + i];                                                               \
      if (a.sum) a.sum[base + i] = v;                                                                  \
      sq += v * v;                                                                                     \
    }                                                                                                  \
    for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);                        \
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = sq;                                            \
    __syncthreads();                                                                                   \
    float total = 0.f;                                                                                 \
    for (int w = 0; w < THREADS / 32; ++w) total += part[w];                                           \
    const float inv = 1.0f / sqrtf(total / (float)a.d + a.epsilon);                                    \
    for (long long i = threadIdx.x; i < a.d; i += THREADS) {                                           \
      float v = ld_##XN(a.x, base + i);                                                                \
      if (a.skip) v += a.skip[base + i];                                                               \
      st_##GN(a.y, base + i, rnd_##GN(v * inv) * ld_##GN(a.gamma, i));                                 \
    }                                                                                                  \
  }
OFX_MIXED_RMSNORM(f32, f32) OFX_MIXED_RMSNORM(f32, f16) OFX_MIXED_RMSNORM(f32, bf16)
OFX_MIXED_RMSNORM(f16, f32) OFX_MIXED_RMSNORM(f16, f16) OFX_MIXED_RMSNORM(f16, bf16)
OFX_MIXED_RMSNORM(bf16, f32) OFX_MIXED_RMSNORM(bf16, f16) OFX_MIXED_RMSNORM(bf16, bf16)
)CUDA";

// The kernel's argument block, laid out as `struct Args` above.
struct CudaArgs {
  const void* x;
  const float* skip;
  const void* gamma;
  void* y;
  float* sum;
  long long d;
  float epsilon, pad_;
};

int type_index(int type) { return type == kFloat ? 0 : type == kFloat16 ? 1 : 2; }

struct CudaMixedRMSNorm {
  static const char* provider(const OrtCustomOp*) { return "CUDAExecutionProvider"; }
  float epsilon = 0;
  std::string node;
  std::vector<void*> fns;  // x type × gamma type (f32, f16, bf16 each)
  void* cu_ctx = nullptr;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    Call c;
    if (OrtStatus* st = prepare(ctx, node, &c)) return st;
    if (c.rows == 0 || c.d == 0) return nullptr;
    if (c.rows > 2147483647LL) return fail(ORT_INVALID_ARGUMENT, node, "more than 2^31 - 1 rows");
    CudaArgs a{};
    a.x = c.x, a.skip = c.skip, a.gamma = c.gamma, a.y = c.y, a.sum = c.sum, a.d = c.d, a.epsilon = epsilon;
    void* stream = nullptr;
    if (OrtStatus* st = api->KernelContext_GetGPUComputeStream(ctx, &stream)) return st;
    void* args[] = {&a};
    std::string err;
    void* fn = fns[type_index(c.x_type) * 3 + type_index(c.gamma_type)];
    if (!launch_fixed(fn, cu_ctx, c.rows, kThreads, stream, args, &err)) return fail(ORT_RUNTIME_EXCEPTION, node, err);
    return nullptr;
  }
};

template <class Kernel>
OrtStatus* load_spec(const OrtKernelInfo* info, Kernel* k) {
  k->node = node_label(api, info);
  std::map<std::string, std::string> items;
  std::string err;
  if (!read_spec_items(api, info, {"epsilon"}, &items, &err)) return fail(ORT_INVALID_GRAPH, k->node, err);
  double eps = 0;
  if (!items.count("epsilon") || !spec_number(items["epsilon"], &eps) || !(eps >= 0) || !std::isfinite(eps))
    return fail(ORT_INVALID_GRAPH, k->node, "spec needs epsilon >= 0, a finite number");
  k->epsilon = static_cast<float>(eps);
  return nullptr;
}

OrtStatus* init_cuda(const OrtKernelInfo* info, CudaMixedRMSNorm* k) {
  if (OrtStatus* st = load_spec(info, k)) return st;
  std::vector<std::string> names;
  for (const char* x : {"f32", "f16", "bf16"})
    for (const char* g : {"f32", "f16", "bf16"}) names.push_back(std::string("ofx_mixed_rmsnorm_") + x + "_" + g);
  std::string err;
  if (!fixed_kernels(std::string(kCudaTypedIo) + kCudaSource, names, device_of(api, info), &k->fns, &k->cu_ctx, &err))
    return fail(ORT_FAIL, k->node, err);
  return nullptr;
}

// The registration: inputs and outputs of mixed element types, their types inferred by `infer`.
template <class Kernel, OrtStatus* (*Init)(const OrtKernelInfo*, Kernel*)>
const OrtCustomOp* mixed_op(uint32_t version) {
  static OrtCustomOp* op = [version] {
    OrtCustomOp* o = new OrtCustomOp(make_variadic_op<Kernel, create_kernel<Kernel, Init>, &kOpName, 2, 1, &api>(version));
    o->GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 0; };
    o->GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 0; };
    o->InferOutputShapeFn = &infer;
    return o;
  }();
  return op;
}

}  // namespace

const OrtCustomOp* mixed_rmsnorm_cpu_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return mixed_op<CpuMixedRMSNorm, load_spec<CpuMixedRMSNorm>>(version);
}

const OrtCustomOp* mixed_rmsnorm_cuda_op(const OrtApi* ort, uint32_t version) {
  api = ort;
  return mixed_op<CudaMixedRMSNorm, init_cuda>(version);
}

}  // namespace onnxfuse
