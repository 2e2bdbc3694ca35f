// ONNX Runtime glue shared by FusedElementwise and FusedConcat (elementwise_io.h).
#include "elementwise_io.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "ort_util.h"

namespace onnxfuse {

using namespace onnxfuse_ort;

const OrtApi* g_api = nullptr;

// ONNX Runtime's Python binding decodes a status message as UTF-8 and raises UnicodeDecodeError (instead
// of our message) on any other byte sequence; a message quoting a hostile program, or one cut inside a
// multi-byte character, would do that. Bytes outside printable ASCII are written as \xNN.
static std::string ascii_safe(const std::string& msg) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(msg.size());
  for (unsigned char c : msg) {
    if ((c >= 0x20 && c < 0x7f) || c == '\n' || c == '\t') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

OrtStatus* make_status(OrtErrorCode code, const std::string& msg) {
  return g_api->CreateStatus(code, ascii_safe(msg).c_str());
}
void drop(OrtStatus* st) {
  if (st) g_api->ReleaseStatus(st);
}

// `et`: the node's input element types (ONNX, UNDEFINED when unknown).
IoDTypes io_dtypes(const Program& prog, const std::vector<int>& et) {
  IoDTypes io;
  for (size_t i = 0; i < prog.inputs.size(); ++i)
    io.f16_as_f32 = io.f16_as_f32 || (prog.values[prog.inputs[i]].dtype == DType::F16 && i < et.size() &&
                                      et[i] == dtype_to_onnx(DType::F32));
  auto store = [&](int v) {
    DType t = prog.values[v].dtype;
    return io.f16_as_f32 && t == DType::F16 ? DType::F32 : t;
  };
  for (int v : prog.inputs) io.in.push_back(store(v));
  for (int v : prog.outputs) io.out.push_back(store(v));
  return io;
}

// The node's string attribute `name` in *text; false when it is missing.
bool read_string_attr(const OrtKernelInfo* info, const char* name, std::string* text) {
  size_t size = 0;
  OrtStatus* st = g_api->KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st) {
    g_api->ReleaseStatus(st);
    return false;
  }
  text->assign(size, '\0');
  if ((st = g_api->KernelInfoGetAttribute_string(info, name, &(*text)[0], &size))) {
    g_api->ReleaseStatus(st);
    return false;
  }
  while (!text->empty() && text->back() == '\0') text->pop_back();
  return true;
}

// The node's input element types (ONNX; UNDEFINED when unknown). A known rank above the limit fails
// when the session is created (ONNX Runtime only logs shape inference's error), not at the first run.
OrtStatus* read_input_types(const OrtKernelInfo* info, const char* op, const std::string& node, std::vector<int>* types) {
  size_t nin = 0;
  OrtStatus* st;
  if ((st = g_api->KernelInfo_GetInputCount(info, &nin))) return st;
  types->assign(nin, ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED);
  for (size_t i = 0; i < nin; ++i) {
    OrtTypeInfo* ti = nullptr;
    if ((st = g_api->KernelInfo_GetInputTypeInfo(info, i, &ti))) return st;
    const OrtTensorTypeAndShapeInfo* tsi = nullptr;
    ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    size_t rank = 0;  // 0 also when the rank is unknown: then make_layout checks it at run time
    if (!g_api->CastTypeInfoToTensorInfo(ti, &tsi) && tsi) {
      if (OrtStatus* s2 = g_api->GetTensorElementType(tsi, &et)) g_api->ReleaseStatus(s2);
      if (OrtStatus* s2 = g_api->GetDimensionsCount(tsi, &rank)) g_api->ReleaseStatus(s2);
    }
    g_api->ReleaseTypeInfo(ti);
    if (rank > static_cast<size_t>(kMaxRank))
      return make_status(ORT_INVALID_GRAPH, node_prefix(op, node) + rank_limit_error(rank) + " (input " +
                                                std::to_string(i) + " has " + std::to_string(rank) + " dimensions)");
    (*types)[i] = static_cast<int>(et);
  }
  return nullptr;
}

// Checks that node inputs [first, first + program inputs) have the storage types io says.
OrtStatus* check_input_types(const Program& prog, const IoDTypes& io, const std::vector<int>& types, size_t first,
                             const std::string& prefix) {
  for (size_t i = 0; i < prog.inputs.size(); ++i) {
    DType want = io.in[i];
    int have = first + i < types.size() ? types[first + i] : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    if (have != ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED && have != dtype_to_onnx(want))
      return make_status(ORT_INVALID_GRAPH, prefix + "input " + std::to_string(first + i) + " ('" +
                                                prog.values[prog.inputs[i]].name + "') is declared " +
                                                dtype_name(prog.values[prog.inputs[i]].dtype) + " in the program" +
                                                (want != prog.values[prog.inputs[i]].dtype ? " (stored as float32)" : "") +
                                                " but the tensor has ONNX type " + std::to_string(have));
  }
  return nullptr;
}

// Longest shape key kept on the stack: [rank_0, dims_0..., rank_1, dims_1..., ...].
static constexpr size_t kKeyMax = 256;

// Appends the shapes a key holds ([rank, dims..., rank, dims..., ...]) to ``shapes``.
static void unpack_key(const int64_t* key, size_t len, std::vector<std::vector<int64_t>>* shapes) {
  for (size_t p = 0; p < len;) {
    size_t r = static_cast<size_t>(key[p++]);
    shapes->emplace_back(key + p, key + p + r);
    p += r;
  }
}

// Inputs [first, first + count) of the call: their data pointers in io->in and their broadcast layout
// in io->layout (cached while their shapes stay the same). `prefix` starts error lines.
OrtStatus* read_inputs(OrtKernelContext* ctx, size_t first, size_t count, LayoutCache* cache, const std::string& prefix,
                       Io* io) {
  OrtStatus* st;
  int64_t key[kKeyMax];
  size_t klen = 0;
  bool keyed = true;
  std::vector<std::vector<int64_t>> shapes;  // filled only when the key does not fit
  io->in.resize(count);
  for (size_t i = 0; i < count; ++i) {
    const OrtValue* v = nullptr;
    if ((st = g_api->KernelContext_GetInput(ctx, first + i, &v))) return st;
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
    if (!make_layout(shapes, layout.get(), &err)) return make_status(ORT_INVALID_ARGUMENT, prefix + err);
    io->layout = layout;
    if (keyed) cache->store(key, klen, layout);
  }
  return nullptr;
}

// Output j of the call with `dims`: its data pointer in *data.
OrtStatus* alloc_output(OrtKernelContext* ctx, size_t j, const std::vector<int64_t>& dims, void** data) {
  OrtValue* v = nullptr;
  if (OrtStatus* st = g_api->KernelContext_GetOutput(ctx, j, dims.data(), dims.size(), &v)) return st;
  return g_api->GetTensorMutableData(v, data);
}

// Runs `eval` over the whole layout, split over ONNX Runtime's intra-op thread pool for large tensors.
namespace {
struct CpuRun {
  const CpuEvaluator* eval;
  const void* const* in;
  void* const* out;
  const BroadcastLayout* layout;
  int64_t nblocks, per_batch;
  static void batch(void* p, size_t b) {
    const CpuRun* t = static_cast<const CpuRun*>(p);
    int64_t b0 = static_cast<int64_t>(b) * t->per_batch;
    int64_t b1 = std::min(t->nblocks, b0 + t->per_batch);
    t->eval->run_blocks(t->in, t->out, *t->layout, b0, b1);
  }
};
}  // namespace

OrtStatus* run_on_cpu(OrtKernelContext* ctx, const CpuEvaluator& eval, const void* const* in, void* const* out,
                      const BroadcastLayout& L, const std::string& prefix) {
  if (L.n == 0) return nullptr;
  // make_layout already refuses ranks above kMaxRank; checked again here, outside the thread
  // pool, because run_block throws on such a layout and must not do so inside ParallelFor.
  if (L.dims.size() > static_cast<size_t>(kMaxRank))
    return make_status(ORT_INVALID_ARGUMENT, prefix + rank_limit_error(L.dims.size()));
  const int64_t nblocks = (L.n + CpuEvaluator::kBlock - 1) / CpuEvaluator::kBlock;
  const int64_t per_batch = 16;  // 32K elements per task
  const int64_t nbatches = (nblocks + per_batch - 1) / per_batch;
  if (nbatches > 1) {
    CpuRun t{&eval, in, out, &L, nblocks, per_batch};
    OrtStatus* st = g_api->KernelContext_ParallelFor(ctx, &CpuRun::batch, static_cast<size_t>(nbatches), 0, &t);
    if (!st) return nullptr;
    g_api->ReleaseStatus(st);  // no thread pool: fall through to a serial run
  }
  eval.run_blocks(in, out, L, 0, nblocks);
  return nullptr;
}

// The string attribute `name` of the node being inferred; false when it is missing.
bool read_infer_string(OrtShapeInferContext* ctx, const char* name, std::string* text) {
  const OrtOpAttr* attr = nullptr;
  OrtStatus* st = g_api->ShapeInferContext_GetAttribute(ctx, name, &attr);
  if (st || !attr) {
    if (st) g_api->ReleaseStatus(st);
    return false;
  }
  size_t need = 0;
  char c = 0;
  st = g_api->ReadOpAttr(attr, ORT_OP_ATTR_STRING, &c, 1, &need);
  if (st) {
    g_api->ReleaseStatus(st);
    std::vector<char> buf(need + 1, '\0');
    if ((st = g_api->ReadOpAttr(attr, ORT_OP_ATTR_STRING, buf.data(), need, &need))) {
      g_api->ReleaseStatus(st);
      return false;
    }
    text->assign(buf.data(), need);
  } else {
    text->assign(&c, need);
  }
  while (!text->empty() && text->back() == '\0') text->pop_back();
  return true;
}

std::string fresh_symbol() {
  static std::atomic<long> counter{0};
  return "onnxfuse_dim_" + std::to_string(counter++);
}

// The broadcast shape of inputs [first, first + count) as shape inference knows them; (*types)[first + i]
// gets input i's element type.
OrtStatus* infer_broadcast(OrtShapeInferContext* ctx, size_t first, size_t count, const char* op, InferredShape* out,
                           std::vector<int>* types) {
  struct Dim {
    int64_t v;
    std::string sym;
  };
  std::vector<std::vector<Dim>> shapes(count);
  bool have_all = true;
  OrtStatus* st;
  for (size_t i = 0; i < count; ++i) {
    OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by ONNX Runtime
    if ((st = g_api->ShapeInferContext_GetInputTypeShape(ctx, first + i, &info)) || !info) {
      if (st) g_api->ReleaseStatus(st);
      have_all = false;
      continue;
    }
    ONNXTensorElementDataType et = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    drop(g_api->GetTensorElementType(info, &et));
    (*types)[first + i] = static_cast<int>(et);
    size_t nd = 0;
    drop(g_api->GetDimensionsCount(info, &nd));
    // ONNX Runtime reports an input whose shape it does not know (a Loop's output, say) as rank 0,
    // the same as a true scalar, and leaving the output undeclared fails its type inference for
    // bfloat16: rank 0 is taken as a scalar here, and fuse-elementwise never fuses an input of
    // unknown rank (a Loop output declared rank 0 broke the Gather after it, fuzz seed 60).
    std::vector<int64_t> d(nd);
    std::vector<const char*> sy(nd, nullptr);
    if (nd) {
      drop(g_api->GetDimensions(info, d.data(), nd));
      drop(g_api->GetSymbolicDimensions(info, sy.data(), nd));
    }
    for (size_t k = 0; k < nd; ++k) shapes[i].push_back({d[k], sy[k] ? std::string(sy[k]) : std::string()});
  }
  out->known = have_all;
  if (!have_all) return nullptr;
  size_t rank = 0;
  for (const auto& sh : shapes) rank = std::max(rank, sh.size());
  // No output shape for ranks above the limit (ONNX Runtime logs this error; the kernel's
  // creation fails with it too, see load_program).
  if (rank > static_cast<size_t>(kMaxRank)) return make_status(ORT_INVALID_GRAPH, std::string(op) + ": " + rank_limit_error(rank));
  for (size_t a = 0; a < rank; ++a) {
    bool have_int = false, have_unknown = false;
    int64_t ival = 1;
    std::string sym;
    bool sym_conflict = false;
    for (const auto& sh : shapes) {
      if (a + sh.size() < rank) continue;
      const Dim& dm = sh[a + sh.size() - rank];
      if (!dm.sym.empty()) {
        if (sym.empty()) sym = dm.sym;
        else if (sym != dm.sym) sym_conflict = true;
      } else if (dm.v < 0) {
        have_unknown = true;
      } else if (dm.v != 1) {
        if (have_int && dm.v != ival)
          return make_status(ORT_INVALID_GRAPH, std::string(op) + ": input shapes do not broadcast (dimension " +
                                                    std::to_string(dm.v) + " vs " + std::to_string(ival) + ")");
        have_int = true;
        ival = dm.v;
      }
    }
    if (have_int) {
      out->dims.push_back(ival);
      out->syms.push_back("");
    } else if (!sym.empty() && !sym_conflict && !have_unknown) {
      out->dims.push_back(-1);
      out->syms.push_back(sym);
    } else if (sym.empty() && !have_unknown) {
      out->dims.push_back(1);
      out->syms.push_back("");
    } else {
      out->dims.push_back(-1);
      out->syms.push_back(fresh_symbol());
    }
  }
  return nullptr;
}

// Declares output j: element type `t` and, when known, `shape`. Without input shapes the type alone
// is not declared either (setting a rank-0 shape would be wrong).
OrtStatus* declare_output(OrtShapeInferContext* ctx, size_t j, DType t, const InferredShape& shape) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  OrtStatus* st;
  if ((st = g_api->CreateTensorTypeAndShapeInfo(&info))) return st;
  st = g_api->SetTensorElementType(info, static_cast<ONNXTensorElementDataType>(dtype_to_onnx(t)));
  if (!st && shape.known) {
    std::vector<const char*> sp;
    for (const auto& sy : shape.syms) sp.push_back(sy.c_str());
    st = g_api->SetDimensions(info, shape.dims.data(), shape.dims.size());
    if (!st) st = g_api->SetSymbolicDimensions(info, sp.data(), sp.size());
  }
  if (!st && shape.known) st = g_api->ShapeInferContext_SetOutputTypeShape(ctx, j, info);
  g_api->ReleaseTensorTypeAndShapeInfo(info);
  return st;
}

}  // namespace onnxfuse
