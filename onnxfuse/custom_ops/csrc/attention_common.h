// Shared by the attention ops (attention_inputs.cc, decode_attention.cc): ONNX element types, the one
// status line naming op and node, reading an input tensor, the "key=value ..." spec attribute, the
// registration of an op with variadic homogeneous inputs and outputs, and the CUDA source's typed
// loads and stores (NVRTC: no includes).
#ifndef ONNXFUSE_ATTENTION_COMMON_H_
#define ONNXFUSE_ATTENTION_COMMON_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "ops.h"
#include "ort_abi.h"
#include "ort_util.h"

namespace onnxfuse {

// ONNX TensorProto element types the attention ops take.
constexpr int kFloat = 1, kFloat16 = 10, kBFloat16 = 16;

inline size_t element_size(int type) { return type == kFloat ? 4 : 2; }

// Element i of a float32 / float16 / bfloat16 tensor, through float (the CPU kernels' loads and stores;
// a store rounds to nearest even).
inline float load(const void* p, int64_t i, int type) {
  if (type == kFloat) return static_cast<const float*>(p)[i];
  unsigned short h = static_cast<const unsigned short*>(p)[i];
  return type == kFloat16 ? ofx_h2f(h) : ofx_bf2f(h);
}
inline void store(void* p, int64_t i, int type, float v) {
  if (type == kFloat) {
    static_cast<float*>(p)[i] = v;
    return;
  }
  static_cast<unsigned short*>(p)[i] = type == kFloat16 ? ofx_f2h(v) : ofx_f2bf(v);
}

// A float rounded to `type` (to nearest even) and read back as float; float32: unchanged.
inline float round_as(float v, int type) {
  return type == kFloat16 ? ofx_round_f16(v) : type == kBFloat16 ? ofx_round_bf16(v) : v;
}

// "<op> node '<name>': <msg>" as an OrtStatus.
inline onnxfuse_ort::OrtStatus* op_error(const onnxfuse_ort::OrtApi* api, onnxfuse_ort::OrtErrorCode code, const char* op,
                                         const std::string& node, const std::string& msg) {
  return api->CreateStatus(code, (node_prefix(op, node) + msg).c_str());
}

inline std::string shape_text(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Input i's dims, element type and data pointer.
inline onnxfuse_ort::OrtStatus* read_input(const onnxfuse_ort::OrtApi* api, onnxfuse_ort::OrtKernelContext* ctx, size_t i,
                                           std::vector<int64_t>* dims, int* type, const void** data) {
  using namespace onnxfuse_ort;
  const OrtValue* v = nullptr;
  OrtStatus* st;
  if ((st = api->KernelContext_GetInput(ctx, i, &v))) return st;
  OrtTensorTypeAndShapeInfo* ti = nullptr;
  if ((st = api->GetTensorTypeAndShape(v, &ti))) return st;
  size_t nd = 0;
  ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  st = api->GetDimensionsCount(ti, &nd);
  if (!st) {
    dims->assign(nd, 0);
    if (nd) st = api->GetDimensions(ti, dims->data(), nd);
  }
  if (!st) st = api->GetTensorElementType(ti, &et);
  api->ReleaseTensorTypeAndShapeInfo(ti);
  if (st) return st;
  *type = static_cast<int>(et);
  void* p = nullptr;
  if ((st = api->GetTensorMutableData(const_cast<OrtValue*>(v), &p))) return st;
  *data = p;
  return nullptr;
}

// Allocates output j with `dims` and returns its data pointer.
inline onnxfuse_ort::OrtStatus* make_output(const onnxfuse_ort::OrtApi* api, onnxfuse_ort::OrtKernelContext* ctx, size_t j,
                                            const std::vector<int64_t>& dims, void** data) {
  onnxfuse_ort::OrtValue* v = nullptr;
  if (onnxfuse_ort::OrtStatus* st = api->KernelContext_GetOutput(ctx, j, dims.data(), dims.size(), &v)) return st;
  return api->GetTensorMutableData(v, data);
}

// The node's string attribute "spec" ("key=value key=value ...") as a map; false and *err when it is
// missing, malformed, or names a key not in `keys`.
inline bool read_spec_items(const onnxfuse_ort::OrtApi* api, const onnxfuse_ort::OrtKernelInfo* info,
                            const std::vector<std::string>& keys, std::map<std::string, std::string>* items,
                            std::string* err) {
  using namespace onnxfuse_ort;
  size_t size = 0;
  if (OrtStatus* st = api->KernelInfoGetAttribute_string(info, "spec", nullptr, &size)) {
    api->ReleaseStatus(st);
    *err = "missing string attribute 'spec'";
    return false;
  }
  std::string text(size, '\0');
  if (OrtStatus* st = api->KernelInfoGetAttribute_string(info, "spec", &text[0], &size)) {
    api->ReleaseStatus(st);
    *err = "unreadable attribute 'spec'";
    return false;
  }
  while (!text.empty() && text.back() == '\0') text.pop_back();
  std::istringstream in(text);
  std::string item;
  while (in >> item) {
    size_t eq = item.find('=');
    std::string key = eq == std::string::npos ? item : item.substr(0, eq);
    bool known = false;
    for (const auto& k : keys) known = known || k == key;
    if (eq == std::string::npos || eq + 1 == item.size()) {
      *err = "bad spec item '" + item + "'";
      return false;
    }
    if (!known) {
      *err = "unknown spec key '" + key + "'";
      return false;
    }
    (*items)[key] = item.substr(eq + 1);
  }
  return true;
}

// A spec value as an integer / a number; false when it is not one.
inline bool spec_int(const std::string& text, int64_t* v) {
  char* end = nullptr;
  long long x = std::strtoll(text.c_str(), &end, 10);
  if (!end || *end || text.empty()) return false;
  *v = x;
  return true;
}
inline bool spec_number(const std::string& text, double* v) {
  char* end = nullptr;
  double x = std::strtod(text.c_str(), &end);
  if (!end || *end || text.empty()) return false;
  *v = x;
  return true;
}

// An OrtCustomOp with variadic homogeneous inputs (at least MinIn) and outputs (at least MinOut) of
// any element type, for provider Kernel::provider, created by Create and run by Kernel::ComputeV2. An
// exception while creating or running becomes one status line through *Api, naming the op (*Name) and,
// while running, the kernel's node: the kernels' ComputeV2 need no handler of their own.
template <class Kernel, onnxfuse_ort::OrtStatusPtr (*Create)(const onnxfuse_ort::OrtKernelInfo*, void**), const char* const* Name,
          int MinIn, int MinOut, const onnxfuse_ort::OrtApi* const* Api>
onnxfuse_ort::OrtCustomOp make_variadic_op(uint32_t version) {
  using namespace onnxfuse_ort;
  OrtCustomOp op;
  std::memset(&op, 0, sizeof(op));
  op.version = version;
  op.GetName = [](const OrtCustomOp*) { return *Name; };
  op.GetExecutionProviderType = Kernel::provider;
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetInputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
  op.GetVariadicInputMinArity = [](const OrtCustomOp*) { return MinIn; };
  op.GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_VARIADIC; };
  op.GetVariadicOutputMinArity = [](const OrtCustomOp*) { return MinOut; };
  op.GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  op.CreateKernelV2 = [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info, void** out) -> OrtStatusPtr {
    try {
      return Create(info, out);
    } catch (const std::exception& e) {
      return op_error(*Api, ORT_RUNTIME_EXCEPTION, *Name, "", e.what());
    } catch (...) {
      return op_error(*Api, ORT_RUNTIME_EXCEPTION, *Name, "", "unknown error creating a kernel");
    }
  };
  op.KernelComputeV2 = [](void* kernel, OrtKernelContext* ctx) -> OrtStatusPtr {
    Kernel* k = static_cast<Kernel*>(kernel);
    try {
      return k->ComputeV2(ctx);
    } catch (const std::exception& e) {
      return op_error(*Api, ORT_RUNTIME_EXCEPTION, *Name, k->node, e.what());
    } catch (...) {
      return op_error(*Api, ORT_RUNTIME_EXCEPTION, *Name, k->node, "unknown error");
    }
  };
  op.KernelDestroy = [](void* kernel) { delete static_cast<Kernel*>(kernel); };
  op.GetStartVersion = [](const OrtCustomOp*) { return 1; };
  op.GetEndVersion = [](const OrtCustomOp*) { return 2147483647; };
  return op;
}

// Creates a Kernel for a node: Init reads its attributes (and, for CUDA, compiles its kernels); ONNX
// Runtime gets the kernel only when that succeeded.
template <class Kernel, onnxfuse_ort::OrtStatus* (*Init)(const onnxfuse_ort::OrtKernelInfo*, Kernel*)>
onnxfuse_ort::OrtStatusPtr create_kernel(const onnxfuse_ort::OrtKernelInfo* info, void** out) {
  std::unique_ptr<Kernel> k(new Kernel());
  if (onnxfuse_ort::OrtStatus* st = Init(info, k.get())) return st;
  *out = k.release();
  return nullptr;
}

// The op's OrtCustomOp for Kernel's provider, built once (ONNX Runtime keeps the pointer).
template <class Kernel, onnxfuse_ort::OrtStatus* (*Init)(const onnxfuse_ort::OrtKernelInfo*, Kernel*), const char* const* Name,
          int MinIn, int MinOut, const onnxfuse_ort::OrtApi* const* Api>
const onnxfuse_ort::OrtCustomOp* registered_op(uint32_t version) {
  static onnxfuse_ort::OrtCustomOp* op = new onnxfuse_ort::OrtCustomOp(
      make_variadic_op<Kernel, create_kernel<Kernel, Init>, Name, MinIn, MinOut, Api>(version));
  return op;
}

// CUDA source: loads, stores and roundings of float32, float16 and bfloat16 (round to nearest even)
// through float, for the ops' NVRTC kernels (prepended to each op's own source).
constexpr const char* kCudaTypedIo = R"CUDA(
typedef unsigned short u16;
__device__ __forceinline__ float ld_f32(const void* p, long long i) { return ((const float*)p)[i]; }
__device__ __forceinline__ void st_f32(void* p, long long i, float v) { ((float*)p)[i] = v; }
__device__ __forceinline__ float ld_f16(const void* p, long long i) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(((const u16*)p)[i])); return f;
}
__device__ __forceinline__ void st_f16(void* p, long long i, float v) {
  u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); ((u16*)p)[i] = h;
}
__device__ __forceinline__ float ld_bf16(const void* p, long long i) {
  return __uint_as_float(((unsigned)((const u16*)p)[i]) << 16);
}
__device__ __forceinline__ void st_bf16(void* p, long long i, float v) {
  unsigned u = __float_as_uint(v);
  u16 h = (u & 0x7fffffffu) > 0x7f800000u ? (u16)0x7fc0 : (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  ((u16*)p)[i] = h;
}
// A float rounded to the type (to nearest even) and read back as float, as a store and a load would.
__device__ __forceinline__ float rnd_f32(float v) { return v; }
__device__ __forceinline__ float rnd_f16(float v) {
  u16 h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ float rnd_bf16(float v) {
  unsigned u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return v;
  return __uint_as_float(((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16);
}
)CUDA";

}  // namespace onnxfuse

#endif  // ONNXFUSE_ATTENTION_COMMON_H_
