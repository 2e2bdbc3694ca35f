// ONNX Runtime glue shared by the library's FusedElementwise ops: FusedElementwise (custom_op.cc) and its
// concatenating form FusedConcat (fused_concat.cc). Reading program attributes and input types, the
// storage dtypes ONNX Runtime imposes on the CPU, the cached broadcast layout of a call's inputs, output
// allocation, the CPU run over ONNX Runtime's thread pool, and shape/type inference of a broadcast.
#ifndef ONNXFUSE_ELEMENTWISE_IO_H_
#define ONNXFUSE_ELEMENTWISE_IO_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "broadcast.h"
#include "cpu_kernel.h"
#include "ort_abi.h"
#include "program.h"

namespace onnxfuse {

using onnxfuse_ort::OrtErrorCode;
using onnxfuse_ort::OrtKernelContext;
using onnxfuse_ort::OrtKernelInfo;
using onnxfuse_ort::OrtShapeInferContext;
using onnxfuse_ort::OrtStatus;

// ONNX Runtime's API, set by RegisterCustomOps before any op is created.
extern const onnxfuse_ort::OrtApi* g_api;

// An OrtStatus with `msg` made printable ASCII (bytes outside it written \xNN: ONNX Runtime's Python
// binding decodes a message as UTF-8, and a hostile program quoted in one must not break that).
OrtStatus* make_status(OrtErrorCode code, const std::string& msg);
// Releases a status nobody needs (null: nothing).
void drop(OrtStatus* st);

// Storage dtypes of a node's inputs and outputs: the program's, except that float16 ones may be
// float32 on the CPU. ONNX Runtime's InsertCastTransformer runs an "isolated" float16 node on the
// CPU in float32 (IsIsolatedFp16NodeOnCpu: the producers of its float16 inputs and the consumers of
// its float16 outputs all lack float16 CPU kernels, e.g. ThresholdedRelu -> fused node ->
// Softmax): it casts the node's float16 inputs to float32, makes its float16 outputs float32 and
// expects a float32 kernel, which it believes exists because this op accepts any type. So when a
// float16 program input arrives as float32, every float16 input and output of the node is stored
// as float32. The program computes as always (float16 values in float32); only its outputs are
// not rounded to float16, as for ONNX Runtime's own kernels in that situation.
struct IoDTypes {
  std::vector<DType> in, out;
  bool f16_as_f32 = false;
};

// `et`: the node's input element types (ONNX, UNDEFINED when unknown).
IoDTypes io_dtypes(const Program& prog, const std::vector<int>& et);

// The node's string attribute `name` in *text; false when it is missing.
bool read_string_attr(const OrtKernelInfo* info, const char* name, std::string* text);

// The node's input element types (ONNX; UNDEFINED when unknown). A known rank above the limit fails
// when the session is created (ONNX Runtime only logs shape inference's error), not at the first run.
OrtStatus* read_input_types(const OrtKernelInfo* info, const char* op, const std::string& node, std::vector<int>* types);

// Checks that node inputs [first, first + program inputs) have the storage types io says.
OrtStatus* check_input_types(const Program& prog, const IoDTypes& io, const std::vector<int>& types, size_t first,
                             const std::string& prefix);

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

// Inputs [first, first + count) of the call: their data pointers in io->in and their broadcast layout
// in io->layout (cached while their shapes stay the same). `prefix` starts error lines.
OrtStatus* read_inputs(OrtKernelContext* ctx, size_t first, size_t count, LayoutCache* cache, const std::string& prefix,
                       Io* io);

// Output j of the call with `dims`: its data pointer in *data.
OrtStatus* alloc_output(OrtKernelContext* ctx, size_t j, const std::vector<int64_t>& dims, void** data);

// Runs `eval` over the whole layout L, split over ONNX Runtime's intra-op thread pool for large tensors
// (serially where there is none).
OrtStatus* run_on_cpu(OrtKernelContext* ctx, const CpuEvaluator& eval, const void* const* in, void* const* out,
                      const BroadcastLayout& L, const std::string& prefix);

// The string attribute `name` of the node being inferred; false when it is missing.
bool read_infer_string(OrtShapeInferContext* ctx, const char* name, std::string* text);

// What shape inference knows of a broadcast shape: per dim a value (-1 unknown) and a symbol ("" none).
struct InferredShape {
  bool known = false;  // every input's shape was given
  std::vector<int64_t> dims;
  std::vector<std::string> syms;
};

// A symbol for a dimension shape inference cannot name, unique in the process.
std::string fresh_symbol();

// The broadcast shape of inputs [first, first + count) as shape inference knows them; (*types)[first + i]
// gets input i's element type.
OrtStatus* infer_broadcast(OrtShapeInferContext* ctx, size_t first, size_t count, const char* op, InferredShape* out,
                           std::vector<int>* types);

// Declares output j: element type `t` and, when known, `shape`. Without input shapes the type alone
// is not declared either (setting a rank-0 shape would be wrong).
OrtStatus* declare_output(OrtShapeInferContext* ctx, size_t j, DType t, const InferredShape& shape);

}  // namespace onnxfuse

#endif  // ONNXFUSE_ELEMENTWISE_IO_H_
