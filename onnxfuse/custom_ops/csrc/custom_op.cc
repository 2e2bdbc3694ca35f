// ONNX Runtime custom-op library: FusedElementwise (domain ai.onnxfuse, opset 1), with a CPU
// kernel and a CUDA kernel registered separately. Exported: RegisterCustomOps (for ONNX Runtime)
// and a few onnxfuse_* C functions for tests and tools (used through ctypes).
//
// Nothing may throw across the C boundary (this library carries its own static libstdc++), so
// every callback catches everything and turns it into an OrtStatus.
#define ORT_API_MANUAL_INIT
#include "onnxruntime_cxx_api.h"
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "broadcast.h"
#include "cpu_kernel.h"
#include "cuda_codegen.h"
#include "cuda_runtime.h"
#include "program.h"

#define OFX_EXPORT extern "C" __attribute__((visibility("default")))

namespace onnxfuse {
namespace {

const char* kDomain = "ai.onnxfuse";
const char* kOpType = "FusedElementwise";
const char* kProgramAttr = "program";

const OrtApi* g_api = nullptr;

OrtStatus* make_status(OrtErrorCode code, const std::string& msg) { return g_api->CreateStatus(code, msg.c_str()); }
void drop(OrtStatus* st) {
  if (st) g_api->ReleaseStatus(st);
}

std::string node_label(const OrtKernelInfo* info) {
  size_t size = 0;
  if (OrtStatus* st = g_api->KernelInfo_GetNodeName(info, nullptr, &size)) {
    g_api->ReleaseStatus(st);
    return "";
  }
  std::string name(size, '\0');
  if (OrtStatus* st = g_api->KernelInfo_GetNodeName(info, &name[0], &size)) {
    g_api->ReleaseStatus(st);
    return "";
  }
  while (!name.empty() && name.back() == '\0') name.pop_back();
  return name;
}

std::string error_prefix(const std::string& node) {
  return std::string(kOpType) + " node" + (node.empty() ? "" : " '" + node + "'") + ": ";
}

// Reads the program attribute and checks it against the node's inputs and outputs.
OrtStatus* load_program(const OrtKernelInfo* info, Program* prog, std::string* node) {
  *node = node_label(info);
  size_t size = 0;
  OrtStatus* st = g_api->KernelInfoGetAttribute_string(info, kProgramAttr, nullptr, &size);
  if (st) {
    g_api->ReleaseStatus(st);
    return make_status(ORT_INVALID_GRAPH, error_prefix(*node) + "missing string attribute 'program'");
  }
  std::string text(size, '\0');
  if ((st = g_api->KernelInfoGetAttribute_string(info, kProgramAttr, &text[0], &size))) return st;
  while (!text.empty() && text.back() == '\0') text.pop_back();
  std::string err;
  if (!parse_program(text, prog, &err))
    return make_status(ORT_INVALID_GRAPH, error_prefix(*node) + "invalid program: " + err);
  size_t nin = 0, nout = 0;
  if ((st = g_api->KernelInfo_GetInputCount(info, &nin))) return st;
  if ((st = g_api->KernelInfo_GetOutputCount(info, &nout))) return st;
  if (nin != prog->inputs.size() || nout != prog->outputs.size())
    return make_status(ORT_INVALID_GRAPH, error_prefix(*node) + "the node has " + std::to_string(nin) + " inputs and " +
                                              std::to_string(nout) + " outputs but its program declares " +
                                              std::to_string(prog->inputs.size()) + " inputs and " +
                                              std::to_string(prog->outputs.size()) + " outputs");
  for (size_t i = 0; i < nin; ++i) {
    OrtTypeInfo* ti = nullptr;
    if ((st = g_api->KernelInfo_GetInputTypeInfo(info, i, &ti))) return st;
    const OrtTensorTypeAndShapeInfo* tsi = nullptr;
    ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    if (!g_api->CastTypeInfoToTensorInfo(ti, &tsi) && tsi) {
      if (OrtStatus* s2 = g_api->GetTensorElementType(tsi, &et)) g_api->ReleaseStatus(s2);
    }
    g_api->ReleaseTypeInfo(ti);
    DType want = prog->values[prog->inputs[i]].dtype;
    if (et != ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED && static_cast<int>(et) != dtype_to_onnx(want))
      return make_status(ORT_INVALID_GRAPH, error_prefix(*node) + "input " + std::to_string(i) + " ('" +
                                                prog->values[prog->inputs[i]].name + "') is declared " +
                                                dtype_name(want) + " in the program but the tensor has ONNX type " +
                                                std::to_string(static_cast<int>(et)));
  }
  return nullptr;
}

// The broadcast layout of the last input shapes a kernel saw. Computing a layout allocates a
// dozen small vectors; a model runs each node with the same shapes call after call, so the layout
// is reused while the shapes stay the same (the per-call host cost is what bounds small batches).
// Compute may run concurrently on one kernel (several threads running a session): guarded.
class LayoutCache {
 public:
  std::shared_ptr<const BroadcastLayout> find(const int64_t* key, size_t len) {
    std::lock_guard<std::mutex> lock(mu_);
    if (layout_ && key_.size() == len && std::equal(key, key + len, key_.begin())) return layout_;
    return nullptr;
  }
  void store(const int64_t* key, size_t len, std::shared_ptr<const BroadcastLayout> layout) {
    std::lock_guard<std::mutex> lock(mu_);
    key_.assign(key, key + len);
    layout_ = std::move(layout);
  }

 private:
  std::mutex mu_;
  std::vector<int64_t> key_;
  std::shared_ptr<const BroadcastLayout> layout_;
};

// Data pointers, broadcast layout and allocated outputs for one Compute call.
struct Io {
  std::vector<const void*> in;
  std::vector<void*> out;
  std::shared_ptr<const BroadcastLayout> layout;
};

// Longest shape key kept on the stack: [rank_0, dims_0..., rank_1, dims_1..., ...].
constexpr size_t kKeyMax = 256;

// Appends the shapes a key holds ([rank, dims..., rank, dims..., ...]) to ``shapes``.
void unpack_key(const int64_t* key, size_t len, std::vector<std::vector<int64_t>>* shapes) {
  for (size_t p = 0; p < len;) {
    size_t r = static_cast<size_t>(key[p++]);
    shapes->emplace_back(key + p, key + p + r);
    p += r;
  }
}

OrtStatus* prepare_io(OrtKernelContext* ctx, LayoutCache* cache, const std::string& node, Io* io) {
  size_t nin = 0, nout = 0;
  OrtStatus* st;
  if ((st = g_api->KernelContext_GetInputCount(ctx, &nin))) return st;
  if ((st = g_api->KernelContext_GetOutputCount(ctx, &nout))) return st;
  int64_t key[kKeyMax];
  size_t klen = 0;
  bool keyed = true;
  std::vector<std::vector<int64_t>> shapes;  // filled only when the key does not fit
  io->in.resize(nin);
  for (size_t i = 0; i < nin; ++i) {
    const OrtValue* v = nullptr;
    if ((st = g_api->KernelContext_GetInput(ctx, i, &v))) return st;
    OrtTensorTypeAndShapeInfo* ti = nullptr;
    if ((st = g_api->GetTensorTypeAndShape(v, &ti))) return st;
    size_t nd = 0;
    drop(g_api->GetDimensionsCount(ti, &nd));
    if (keyed && klen + 1 + nd <= kKeyMax) {
      key[klen++] = static_cast<int64_t>(nd);
      if (nd) drop(g_api->GetDimensions(ti, key + klen, nd));
      klen += nd;
    } else {
      if (keyed) {  // switch to the slow path: the shapes seen so far move out of the key
        keyed = false;
        unpack_key(key, klen, &shapes);
      }
      shapes.emplace_back(nd);
      if (nd) drop(g_api->GetDimensions(ti, shapes.back().data(), nd));
    }
    g_api->ReleaseTensorTypeAndShapeInfo(ti);
    void* data = nullptr;
    if ((st = g_api->GetTensorMutableData(const_cast<OrtValue*>(v), &data))) return st;
    io->in[i] = data;
  }
  io->layout = keyed ? cache->find(key, klen) : nullptr;
  if (!io->layout) {
    if (keyed) unpack_key(key, klen, &shapes);
    auto layout = std::make_shared<BroadcastLayout>();
    std::string err;
    if (!make_layout(shapes, layout.get(), &err)) return make_status(ORT_INVALID_ARGUMENT, error_prefix(node) + err);
    io->layout = layout;
    if (keyed) cache->store(key, klen, layout);
  }
  const BroadcastLayout& L = *io->layout;
  io->out.resize(nout);
  for (size_t j = 0; j < nout; ++j) {
    OrtValue* v = nullptr;
    if ((st = g_api->KernelContext_GetOutput(ctx, j, L.out_shape.data(), L.out_shape.size(), &v))) return st;
    void* data = nullptr;
    if ((st = g_api->GetTensorMutableData(v, &data))) return st;
    io->out[j] = data;
  }
  return nullptr;
}

// ------------------------------------------------------------------ CPU kernel
struct CpuKernel {
  Program prog;
  std::string node;
  std::unique_ptr<CpuEvaluator> eval;
  LayoutCache layouts;

  struct Task {
    const CpuKernel* self;
    const Io* io;
    int64_t nblocks, per_batch;
  };
  static void run_batch(void* p, size_t b) {
    const Task* t = static_cast<const Task*>(p);
    int64_t b0 = static_cast<int64_t>(b) * t->per_batch;
    int64_t b1 = std::min(t->nblocks, b0 + t->per_batch);
    t->self->eval->run_blocks(t->io->in.data(), t->io->out.data(), *t->io->layout, b0, b1);
  }

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    try {
      Io io;
      if (OrtStatus* st = prepare_io(ctx, &layouts, node, &io)) return st;
      const int64_t n = io.layout->n;
      if (n == 0) return nullptr;
      const int64_t nblocks = (n + CpuEvaluator::kBlock - 1) / CpuEvaluator::kBlock;
      // Parallelise over ONNX Runtime's intra-op thread pool for large tensors.
      const int64_t per_batch = 16;  // 32K elements per task
      const int64_t nbatches = (nblocks + per_batch - 1) / per_batch;
      if (nbatches > 1) {
        Task t{this, &io, nblocks, per_batch};
        OrtStatus* st = g_api->KernelContext_ParallelFor(ctx, &CpuKernel::run_batch, static_cast<size_t>(nbatches), 0, &t);
        if (!st) return nullptr;
        g_api->ReleaseStatus(st);  // no thread pool: fall through to a serial run
      }
      eval->run_blocks(io.in.data(), io.out.data(), *io.layout, 0, nblocks);
      return nullptr;
    } catch (const std::exception& e) {
      return make_status(ORT_RUNTIME_EXCEPTION, error_prefix(node) + e.what());
    } catch (...) {
      return make_status(ORT_RUNTIME_EXCEPTION, error_prefix(node) + "unknown error");
    }
  }
};

// ------------------------------------------------------------------ CUDA kernel
struct CudaKernelOrt {
  Program prog;
  std::string node;
  std::unique_ptr<CudaKernel> kernel;
  LayoutCache layouts;

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    try {
      Io io;
      if (OrtStatus* st = prepare_io(ctx, &layouts, node, &io)) return st;
      if (io.layout->n == 0) return nullptr;
      void* stream = nullptr;
      if (OrtStatus* st = g_api->KernelContext_GetGPUComputeStream(ctx, &stream)) return st;
      std::string err;
      if (!kernel->launch(io.in.data(), io.out.data(), *io.layout, stream, &err))
        return make_status(ORT_RUNTIME_EXCEPTION, error_prefix(node) + err);
      return nullptr;
    } catch (const std::exception& e) {
      return make_status(ORT_RUNTIME_EXCEPTION, error_prefix(node) + e.what());
    } catch (...) {
      return make_status(ORT_RUNTIME_EXCEPTION, error_prefix(node) + "unknown error");
    }
  }
};

int device_of(const OrtKernelInfo* info) {
  OrtAllocator* alloc = nullptr;
  int id = 0;
  if (OrtStatus* st = g_api->KernelInfoGetAllocator(info, OrtMemTypeDefault, &alloc)) {
    g_api->ReleaseStatus(st);
    return 0;
  }
  const OrtMemoryInfo* mi = nullptr;
  if (OrtStatus* st = g_api->AllocatorGetInfo(alloc, &mi)) {
    g_api->ReleaseStatus(st);
  } else if (OrtStatus* st2 = g_api->MemoryInfoGetId(mi, &id)) {
    g_api->ReleaseStatus(st2);
    id = 0;
  }
  g_api->ReleaseAllocator(alloc);
  return id;
}

// ------------------------------------------------------------------ shape/type inference
// Every output has the broadcast shape of all inputs and its program dtype.
OrtStatusPtr infer_output_shapes(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  try {
    const OrtOpAttr* attr = nullptr;
    OrtStatus* st = g_api->ShapeInferContext_GetAttribute(ctx, kProgramAttr, &attr);
    if (st || !attr) {
      if (st) g_api->ReleaseStatus(st);
      return make_status(ORT_INVALID_GRAPH, std::string(kOpType) + ": missing string attribute 'program'");
    }
    size_t need = 0;
    char c = 0;
    st = g_api->ReadOpAttr(attr, ORT_OP_ATTR_STRING, &c, 1, &need);
    std::string text;
    if (st) {
      g_api->ReleaseStatus(st);
      std::vector<char> buf(need + 1, '\0');
      if ((st = g_api->ReadOpAttr(attr, ORT_OP_ATTR_STRING, buf.data(), need, &need))) return st;
      text.assign(buf.data(), need);
    } else {
      text.assign(&c, need);
    }
    while (!text.empty() && text.back() == '\0') text.pop_back();
    Program prog;
    std::string err;
    if (!parse_program(text, &prog, &err))
      return make_status(ORT_INVALID_GRAPH, std::string(kOpType) + ": invalid program: " + err);

    size_t nin = 0;
    if ((st = g_api->ShapeInferContext_GetInputCount(ctx, &nin))) return st;
    if (nin != prog.inputs.size())
      return make_status(ORT_INVALID_GRAPH, std::string(kOpType) + ": the node has " + std::to_string(nin) +
                                                " inputs but its program declares " + std::to_string(prog.inputs.size()));
    // Gather input shapes: known ints, named symbols, or unknown (-1 without a name).
    struct Dim {
      int64_t v;
      std::string sym;
    };
    std::vector<std::vector<Dim>> shapes(nin);
    bool have_all = true;
    for (size_t i = 0; i < nin; ++i) {
      OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by ONNX Runtime
      if ((st = g_api->ShapeInferContext_GetInputTypeShape(ctx, i, &info)) || !info) {
        if (st) g_api->ReleaseStatus(st);
        have_all = false;
        continue;
      }
      size_t nd = 0;
      drop(g_api->GetDimensionsCount(info, &nd));
      std::vector<int64_t> d(nd);
      std::vector<const char*> s(nd, nullptr);
      if (nd) {
        drop(g_api->GetDimensions(info, d.data(), nd));
        drop(g_api->GetSymbolicDimensions(info, s.data(), nd));
      }
      for (size_t k = 0; k < nd; ++k) shapes[i].push_back({d[k], s[k] ? std::string(s[k]) : std::string()});
    }
    std::vector<int64_t> odims;
    std::vector<std::string> osyms;
    if (have_all) {
      size_t rank = 0;
      for (const auto& s : shapes) rank = std::max(rank, s.size());
      static std::atomic<long> counter{0};
      for (size_t a = 0; a < rank; ++a) {
        bool have_int = false, have_unknown = false;
        int64_t ival = 1;
        std::string sym;
        bool sym_conflict = false;
        for (const auto& s : shapes) {
          if (a + s.size() < rank) continue;
          const Dim& dm = s[a + s.size() - rank];
          if (!dm.sym.empty()) {
            if (sym.empty()) sym = dm.sym;
            else if (sym != dm.sym) sym_conflict = true;
          } else if (dm.v < 0) {
            have_unknown = true;
          } else if (dm.v != 1) {
            if (have_int && dm.v != ival)
              return make_status(ORT_INVALID_GRAPH, std::string(kOpType) + ": input shapes do not broadcast (dimension " +
                                                        std::to_string(dm.v) + " vs " + std::to_string(ival) + ")");
            have_int = true;
            ival = dm.v;
          }
        }
        if (have_int) {
          odims.push_back(ival);
          osyms.push_back("");
        } else if (!sym.empty() && !sym_conflict && !have_unknown) {
          odims.push_back(-1);
          osyms.push_back(sym);
        } else if (sym.empty() && !have_unknown) {
          odims.push_back(1);
          osyms.push_back("");
        } else {
          odims.push_back(-1);
          osyms.push_back("onnxfuse_dim_" + std::to_string(counter++));
        }
      }
    }
    for (size_t j = 0; j < prog.outputs.size(); ++j) {
      OrtTensorTypeAndShapeInfo* info = nullptr;
      if ((st = g_api->CreateTensorTypeAndShapeInfo(&info))) return st;
      DType t = prog.values[prog.outputs[j]].dtype;
      st = g_api->SetTensorElementType(info, static_cast<ONNXTensorElementDataType>(dtype_to_onnx(t)));
      if (!st && have_all) {
        std::vector<const char*> sp;
        for (const auto& s : osyms) sp.push_back(s.c_str());
        st = g_api->SetDimensions(info, odims.data(), odims.size());
        if (!st) st = g_api->SetSymbolicDimensions(info, sp.data(), sp.size());
      }
      // Without input shapes we can still give the type, but setting a rank-0 shape would be
      // wrong: only set the type+shape when all input shapes are known.
      if (!st && have_all) st = g_api->ShapeInferContext_SetOutputTypeShape(ctx, j, info);
      g_api->ReleaseTensorTypeAndShapeInfo(info);
      if (st) return st;
    }
    return nullptr;
  } catch (const std::exception& e) {
    return make_status(ORT_RUNTIME_EXCEPTION, std::string(kOpType) + " shape inference: " + e.what());
  } catch (...) {
    return make_status(ORT_RUNTIME_EXCEPTION, std::string(kOpType) + " shape inference failed");
  }
}

// ------------------------------------------------------------------ op definitions
template <class TOp, class TKernel>
struct FusedOpBase : Ort::CustomOpBase<TOp, TKernel, true> {
  FusedOpBase() { OrtCustomOp::InferOutputShapeFn = &infer_output_shapes; }
  const char* GetName() const { return kOpType; }
  size_t GetInputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  int GetVariadicInputMinArity() const { return 1; }
  bool GetVariadicInputHomogeneity() const { return false; }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const { return INPUT_OUTPUT_VARIADIC; }
  int GetVariadicOutputMinArity() const { return 1; }
  bool GetVariadicOutputHomogeneity() const { return false; }
};

struct CpuOp : FusedOpBase<CpuOp, CpuKernel> {
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** out) const {
    try {
      std::unique_ptr<CpuKernel> k(new CpuKernel());
      if (OrtStatus* st = load_program(info, &k->prog, &k->node)) return st;
      k->eval.reset(new CpuEvaluator(k->prog));
      *out = k.release();
      return nullptr;
    } catch (const std::exception& e) {
      return make_status(ORT_RUNTIME_EXCEPTION, std::string(kOpType) + ": " + e.what());
    } catch (...) {
      return make_status(ORT_RUNTIME_EXCEPTION, std::string(kOpType) + ": unknown error creating the CPU kernel");
    }
  }
};

struct CudaOp : FusedOpBase<CudaOp, CudaKernelOrt> {
  const char* GetExecutionProviderType() const { return "CUDAExecutionProvider"; }
  OrtStatusPtr CreateKernelV2(const OrtApi&, const OrtKernelInfo* info, void** out) const {
    try {
      std::unique_ptr<CudaKernelOrt> k(new CudaKernelOrt());
      if (OrtStatus* st = load_program(info, &k->prog, &k->node)) return st;
      std::string err;
      k->kernel = CudaKernel::create(k->prog, device_of(info), &err);
      if (!k->kernel) return make_status(ORT_FAIL, error_prefix(k->node) + err);
      *out = k.release();
      return nullptr;
    } catch (const std::exception& e) {
      return make_status(ORT_RUNTIME_EXCEPTION, std::string(kOpType) + ": " + e.what());
    } catch (...) {
      return make_status(ORT_RUNTIME_EXCEPTION, std::string(kOpType) + ": unknown error creating the CUDA kernel");
    }
  }
};

std::mutex g_reg_mu;

}  // namespace
}  // namespace onnxfuse

using namespace onnxfuse;

OFX_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (!api) {  // ONNX Runtime older than the headers we were built with: say so with its own API
    const OrtApi* old = api_base->GetApi(1);
    std::string msg = std::string("onnxfuse's FusedElementwise library needs ONNX Runtime API version ") +
                      std::to_string(ORT_API_VERSION) + " or newer; this ONNX Runtime is " +
                      api_base->GetVersionString();
    return old ? old->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  std::lock_guard<std::mutex> lock(g_reg_mu);
  g_api = api;
  Ort::InitApi(api);
  // Op objects and domains live for the life of the process (ONNX Runtime keeps pointers).
  static CpuOp* cpu_op = new CpuOp();
  static CudaOp* cuda_op = new CudaOp();
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* st = api->CreateCustomOpDomain(kDomain, &domain)) return st;
  if (OrtStatus* st = api->CustomOpDomain_Add(domain, cpu_op)) return st;
  if (OrtStatus* st = api->CustomOpDomain_Add(domain, cuda_op)) return st;
  return api->AddCustomOpDomain(options, domain);
}

// Parses a program; returns 1 if valid, else 0 with "line N: message" in err.
OFX_EXPORT int onnxfuse_check_program(const char* program, char* err, size_t err_size) {
  try {
    Program p;
    std::string e;
    bool ok = parse_program(program ? program : "", &p, &e);
    if (err && err_size) {
      std::strncpy(err, e.c_str(), err_size - 1);
      err[err_size - 1] = '\0';
    }
    return ok ? 1 : 0;
  } catch (...) {
    if (err && err_size) std::strncpy(err, "internal error", err_size - 1);
    return 0;
  }
}

// CUDA source for a program; variants: bit mask (1 fast-vector, 2 fast-scalar, 4 broadcast; 0 or
// 7 = all, as compiled at run time). Returns the length needed (excluding NUL); writes up to
// out_size-1 chars. Returns -1 for an invalid program (message in out).
OFX_EXPORT long onnxfuse_cuda_source(const char* program, int variants, char* out, size_t out_size) {
  try {
    Program p;
    std::string e, code;
    if (!parse_program(program ? program : "", &p, &e)) {
      code = e;
    } else {
      code = cuda_source(p, variants == 0 ? kVariantAll : variants).code;
    }
    if (out && out_size) {
      size_t n = std::min(code.size(), out_size - 1);
      std::memcpy(out, code.data(), n);
      out[n] = '\0';
    }
    return e.empty() ? static_cast<long>(code.size()) : -1;
  } catch (...) {
    return -1;
  }
}

// Kernel-cache and compile counters as JSON (see cuda_stats_json).
OFX_EXPORT long onnxfuse_cuda_stats(char* out, size_t out_size) {
  std::string s = cuda_stats_json();
  if (out && out_size) {
    size_t n = std::min(s.size(), out_size - 1);
    std::memcpy(out, s.data(), n);
    out[n] = '\0';
  }
  return static_cast<long>(s.size());
}

// Version of this library's program language.
OFX_EXPORT int onnxfuse_language_version() { return 1; }

// ------------------------------------------------------------------ test hooks
// Create a CUDA kernel for a program and launch it on given shapes and device pointers without
// ONNX Runtime. Used by tests with a mock CUDA driver (ONNXFUSE_CUDA_DRIVER) to check NVRTC
// compilation, the kernel caches, kernel selection and the parameter block on machines without a
// GPU. Not part of the library's interface.
OFX_EXPORT void* onnxfuse_test_cuda_create(const char* program, int device, char* err, size_t err_size) {
  try {
    Program p;
    std::string e;
    std::unique_ptr<CudaKernel> k;
    if (parse_program(program ? program : "", &p, &e)) k = CudaKernel::create(p, device, &e);
    if (!k && err && err_size) {
      std::strncpy(err, e.c_str(), err_size - 1);
      err[err_size - 1] = '\0';
    }
    return k.release();
  } catch (...) {
    return nullptr;
  }
}

OFX_EXPORT int onnxfuse_test_cuda_launch(void* kernel, int nin, const int* ranks, const int64_t* dims,
                                         const void* const* in, int nout, void* const* out, void* stream,
                                         char* err, size_t err_size) {
  try {
    std::vector<std::vector<int64_t>> shapes(nin);
    for (int i = 0, off = 0; i < nin; off += ranks[i], ++i) shapes[i].assign(dims + off, dims + off + ranks[i]);
    BroadcastLayout L;
    std::string e;
    bool ok = make_layout(shapes, &L, &e) &&
              static_cast<CudaKernel*>(kernel)->launch(in, out, L, stream, &e);
    (void)nout;
    if (!ok && err && err_size) {
      std::strncpy(err, e.c_str(), err_size - 1);
      err[err_size - 1] = '\0';
    }
    return ok ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

OFX_EXPORT void onnxfuse_test_cuda_destroy(void* kernel) { delete static_cast<CudaKernel*>(kernel); }

