#include "fused_concat.h"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attention_common.h"
#include "cpu_kernel.h"
#include "cuda_runtime.h"
#include "elementwise_io.h"
#include "ort_util.h"
#include "program.h"

namespace onnxfuse {
namespace {

using namespace onnxfuse_ort;

// FusedElementwise's concatenating form (custom_ops.CONCAT_OP_TYPE; docs/custom-ops.md): K programs
// ("program_0" .. "program_{K-1}") and an int attribute "axis" (A >= 0). Node inputs: segment 0's program inputs,
// then segment 1's, ...; output 0: the concatenation along A of every segment's program output 0, each
// segment computed over its own inputs exactly as a FusedElementwise node of that program; then each
// segment's program outputs 1.. with its own shape. Each segment stores its output 0 straight into its
// slice of output 0 (CUDA: a placed kernel, OutputPlacement; CPU: into a buffer, then copied), so a
// Concat of fused results costs no read and write of its own. Written by concat-into-elementwise.
const char* kConcatOpType = "FusedConcat";

std::string concat_prefix(const std::string& node) { return node_prefix(kConcatOpType, node); }

struct ConcatSegment {
  Program prog;
  IoDTypes io;
  size_t in_first = 0;    // node input of the program's input 0
  size_t out_first = 0;   // node output of the program's output 1 (its outputs 2.. follow)
  std::unique_ptr<CpuEvaluator> eval;
  std::unique_ptr<CudaKernel> kernel;
  LayoutCache layouts;
};

// What a kernel of either provider holds: its node's name (make_variadic_op's messages read it), axis and
// segments.
struct ConcatNode {
  std::string node;
  int64_t axis = 0;
  std::vector<std::unique_ptr<ConcatSegment>> segs;
};

// Reads spec and programs and checks them against the node's inputs and outputs.
OrtStatus* load_concat(const OrtKernelInfo* info, ConcatNode* c, bool allow_f16_as_f32) {
  c->node = node_label(g_api, info);
  const std::string prefix = concat_prefix(c->node);
  std::string err;
  if (OrtStatus* st = g_api->KernelInfoGetAttribute_int64(info, "axis", &c->axis)) {
    g_api->ReleaseStatus(st);
    return make_status(ORT_INVALID_GRAPH, prefix + "missing int attribute 'axis'");
  }
  if (c->axis < 0 || c->axis >= kMaxRank)
    return make_status(ORT_INVALID_GRAPH, prefix + "attribute axis is " + std::to_string(c->axis) +
                                              "; it must be at least 0 and below " + std::to_string(kMaxRank));
  std::vector<int> types;
  OrtStatus* st;
  if ((st = read_input_types(info, kConcatOpType, c->node, &types))) return st;
  size_t nin = 0, nout = 0, in_at = 0, out_at = 1;
  if ((st = g_api->KernelInfo_GetInputCount(info, &nin))) return st;
  if ((st = g_api->KernelInfo_GetOutputCount(info, &nout))) return st;
  for (int k = 0;; ++k) {
    const std::string name = "program_" + std::to_string(k);
    std::string text;
    if (!read_string_attr(info, name.c_str(), &text)) break;
    std::unique_ptr<ConcatSegment> seg(new ConcatSegment());
    if (!parse_program(text, &seg->prog, &err))
      return make_status(ORT_INVALID_GRAPH, prefix + "invalid " + name + ": " + err);
    if (seg->prog.outputs.empty()) return make_status(ORT_INVALID_GRAPH, prefix + name + " has no output");
    seg->in_first = in_at;
    seg->out_first = out_at;
    in_at += seg->prog.inputs.size();
    out_at += seg->prog.outputs.size() - 1;
    if (in_at <= nin) {
      std::vector<int> mine(types.begin() + seg->in_first, types.begin() + in_at);
      seg->io = io_dtypes(seg->prog, allow_f16_as_f32 ? mine : std::vector<int>());
      if ((st = check_input_types(seg->prog, seg->io, types, seg->in_first, prefix + name + ": "))) return st;
      if (!c->segs.empty() && seg->io.out[0] != c->segs[0]->io.out[0])
        return make_status(ORT_INVALID_GRAPH, prefix + name + "'s output 0 is " + dtype_name(seg->io.out[0]) +
                                                  ", program_0's " + dtype_name(c->segs[0]->io.out[0]));
    }
    c->segs.push_back(std::move(seg));
  }
  if (c->segs.empty()) return make_status(ORT_INVALID_GRAPH, prefix + "missing string attribute 'program_0'");
  if (in_at != nin || out_at != nout)
    return make_status(ORT_INVALID_GRAPH, prefix + "the node has " + std::to_string(nin) + " inputs and " +
                                              std::to_string(nout) + " outputs but its programs declare " +
                                              std::to_string(in_at) + " inputs and " + std::to_string(out_at) + " outputs");
  return nullptr;
}

// One call: every segment's inputs and layout, the outputs allocated, and where each segment's output 0
// goes in output 0.
struct ConcatCall {
  std::vector<Io> io;                   // per segment: inputs, layout, outputs (out[0]: output 0's base)
  std::vector<OutputPlacement> place;   // per segment
};

OrtStatus* prepare_concat(OrtKernelContext* ctx, ConcatNode* c, ConcatCall* call) {
  const std::string prefix = concat_prefix(c->node);
  const size_t K = c->segs.size();
  const size_t a = static_cast<size_t>(c->axis);
  call->io.resize(K);
  call->place.resize(K);
  OrtStatus* st;
  for (size_t k = 0; k < K; ++k) {
    ConcatSegment& seg = *c->segs[k];
    if ((st = read_inputs(ctx, seg.in_first, seg.prog.inputs.size(), &seg.layouts, prefix, &call->io[k]))) return st;
  }
  const std::vector<int64_t>& first = call->io[0].layout->out_shape;
  if (a >= first.size())
    return make_status(ORT_INVALID_ARGUMENT, prefix + "axis " + std::to_string(a) + " but program_0's result has rank " +
                                                 std::to_string(first.size()));
  std::vector<int64_t> shape = first;
  shape[a] = 0;
  for (size_t k = 0; k < K; ++k) {
    const std::vector<int64_t>& sk = call->io[k].layout->out_shape;
    bool fits = sk.size() == first.size();
    for (size_t d = 0; fits && d < sk.size(); ++d) fits = d == a || sk[d] == first[d];
    if (!fits)
      return make_status(ORT_INVALID_ARGUMENT, prefix + "program_" + std::to_string(k) + "'s result " + shape_text(sk) +
                                                   " does not concatenate with program_0's " + shape_text(first) +
                                                   " along axis " + std::to_string(a));
    shape[a] += sk[a];
  }
  int64_t pitch = 1, total = 1;
  for (size_t d = a; d < shape.size(); ++d) pitch *= shape[d];
  for (int64_t v : shape) total *= v;
  void* out0 = nullptr;
  if ((st = alloc_output(ctx, 0, shape, &out0))) return st;
  int64_t offset = 0;  // elements of the axis before this segment's, times the dims after the axis
  for (size_t k = 0; k < K; ++k) {
    ConcatSegment& seg = *c->segs[k];
    Io& io = call->io[k];
    const std::vector<int64_t>& sk = io.layout->out_shape;
    int64_t inner = 1, after = 1;
    for (size_t d = a; d < sk.size(); ++d) inner *= sk[d];
    for (size_t d = a + 1; d < sk.size(); ++d) after *= sk[d];
    call->place[k].inner = inner > 0 ? inner : 1;
    call->place[k].pitch = pitch;
    call->place[k].off = offset;
    call->place[k].total = total;
    offset += sk[a] * after;
    io.out.assign(seg.prog.outputs.size(), nullptr);
    io.out[0] = out0;
    for (size_t j = 1; j < seg.prog.outputs.size(); ++j)
      if ((st = alloc_output(ctx, seg.out_first + j - 1, sk, &io.out[j]))) return st;
  }
  return nullptr;
}

struct CpuConcatKernel : ConcatNode {
  static const char* provider(const OrtCustomOp*) { return "CPUExecutionProvider"; }

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    const size_t es = dtype_size(segs[0]->io.out[0]);
    ConcatCall call;
    if (OrtStatus* st = prepare_concat(ctx, this, &call)) return st;
    for (size_t k = 0; k < segs.size(); ++k) {
      ConcatSegment& seg = *segs[k];
      Io& io = call.io[k];
      const OutputPlacement& pl = call.place[k];
      const BroadcastLayout& L = *io.layout;
      if (L.n == 0) continue;
      // The interpreter writes whole outputs: output 0 goes to a buffer, then row by row into its slice.
      std::vector<unsigned char> buf(static_cast<size_t>(L.n) * es);
      unsigned char* out0 = static_cast<unsigned char*>(io.out[0]);
      io.out[0] = buf.data();
      if (OrtStatus* st = run_on_cpu(ctx, *seg.eval, io.in.data(), io.out.data(), L, concat_prefix(node))) return st;
      const int64_t rows = L.n / pl.inner;
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(out0 + (r * pl.pitch + pl.off) * es, buf.data() + r * pl.inner * es, static_cast<size_t>(pl.inner) * es);
    }
    return nullptr;
  }
};

struct CudaConcatKernel : ConcatNode {
  static const char* provider(const OrtCustomOp*) { return "CUDAExecutionProvider"; }

  OrtStatusPtr ComputeV2(OrtKernelContext* ctx) {
    ConcatCall call;
    if (OrtStatus* st = prepare_concat(ctx, this, &call)) return st;
    void* stream = nullptr;
    if (OrtStatus* st = g_api->KernelContext_GetGPUComputeStream(ctx, &stream)) return st;
    for (size_t k = 0; k < segs.size(); ++k) {
      Io& io = call.io[k];
      if (io.layout->n == 0) continue;
      std::string err;
      if (!segs[k]->kernel->launch(io.in.data(), io.out.data(), *io.layout, stream, &err, &call.place[k]))
        return make_status(ORT_RUNTIME_EXCEPTION, concat_prefix(node) + "program_" + std::to_string(k) + ": " + err);
    }
    return nullptr;
  }
};

OrtStatus* init_cpu_concat(const OrtKernelInfo* info, CpuConcatKernel* k) {
  if (OrtStatus* st = load_concat(info, k, true)) return st;
  for (auto& seg : k->segs) seg->eval.reset(new CpuEvaluator(seg->prog, seg->io.in, seg->io.out));
  return nullptr;
}

OrtStatus* init_cuda_concat(const OrtKernelInfo* info, CudaConcatKernel* k) {
  if (OrtStatus* st = load_concat(info, k, false)) return st;
  for (size_t i = 0; i < k->segs.size(); ++i) {
    std::string err;
    ConcatSegment& seg = *k->segs[i];
    seg.kernel = CudaKernel::create(seg.prog, device_of(g_api, info), &err, true);
    if (!seg.kernel) return make_status(ORT_FAIL, concat_prefix(k->node) + "program_" + std::to_string(i) + ": " + err);
  }
  return nullptr;
}

// Output types (and shapes where every input's is known): output 0 has program_0's output-0 type and
// the segments' common shape with the axis dim summed (a fresh symbol where a segment's is unknown);
// segment k's outputs 1.. have its own broadcast shape.
OrtStatusPtr infer_concat_shapes(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  try {
    int64_t axis = -1;
    const OrtOpAttr* axis_attr = nullptr;
    size_t got = 0;
    OrtStatus* ast = g_api->ShapeInferContext_GetAttribute(ctx, "axis", &axis_attr);
    if (!ast && axis_attr) ast = g_api->ReadOpAttr(axis_attr, ORT_OP_ATTR_INT, &axis, sizeof(axis), &got);
    if (ast) {
      g_api->ReleaseStatus(ast);
      axis = -1;  // unknown: output 0 gets its type only
    }
    size_t nin = 0;
    OrtStatus* st;
    if ((st = g_api->ShapeInferContext_GetInputCount(ctx, &nin))) return st;
    std::vector<int> types(nin, ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED);
    InferredShape concat;
    DType out0 = DType::F32;
    size_t in_at = 0, out_at = 1;
    for (int k = 0;; ++k) {
      std::string text, err;
      if (!read_infer_string(ctx, ("program_" + std::to_string(k)).c_str(), &text)) break;
      Program prog;
      if (!parse_program(text, &prog, &err) || prog.outputs.empty() || in_at + prog.inputs.size() > nin)
        return make_status(ORT_INVALID_GRAPH, std::string(kConcatOpType) + ": invalid program_" + std::to_string(k));
      InferredShape shape;
      if ((st = infer_broadcast(ctx, in_at, prog.inputs.size(), kConcatOpType, &shape, &types))) return st;
      std::vector<int> mine(types.begin() + in_at, types.begin() + in_at + prog.inputs.size());
      const IoDTypes io = io_dtypes(prog, mine);
      for (size_t j = 1; j < prog.outputs.size(); ++j)
        if ((st = declare_output(ctx, out_at + j - 1, io.out[j], shape))) return st;
      if (k == 0) {  // output 0 has segment 0's shape but its own axis dim
        out0 = io.out[0];
        concat = shape;
        if (axis < 0 || static_cast<size_t>(axis) >= concat.dims.size()) concat.known = false;
        else if (concat.known && concat.dims[axis] < 0) concat.syms[axis] = fresh_symbol();
      } else if (concat.known && shape.known && shape.dims.size() == concat.dims.size()) {
        int64_t& d = concat.dims[axis];
        if (d >= 0 && shape.dims[axis] >= 0) {
          d += shape.dims[axis];
        } else {
          d = -1;
          concat.syms[axis] = fresh_symbol();
        }
      } else {
        concat.known = false;
      }
      in_at += prog.inputs.size();
      out_at += prog.outputs.size() - 1;
    }
    return declare_output(ctx, 0, out0, concat);
  } catch (const std::exception& e) {
    return make_status(ORT_RUNTIME_EXCEPTION, std::string(kConcatOpType) + " shape inference: " + e.what());
  } catch (...) {
    return make_status(ORT_RUNTIME_EXCEPTION, std::string(kConcatOpType) + " shape inference failed");
  }
}

// Registrations: variadic inputs and outputs of mixed element types (a program mixes dtypes), typed by
// infer_concat_shapes.
template <class Kernel, OrtStatus* (*Init)(const OrtKernelInfo*, Kernel*)>
const OrtCustomOp* concat_op(uint32_t version) {
  static OrtCustomOp* op = [version] {
    OrtCustomOp* o = new OrtCustomOp(
        make_variadic_op<Kernel, create_kernel<Kernel, Init>, &kConcatOpType, 1, 1, &g_api>(version));
    o->GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 0; };
    o->GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 0; };
    o->InferOutputShapeFn = &infer_concat_shapes;
    return o;
  }();
  return op;
}

}  // namespace

const OrtCustomOp* fused_concat_cpu_op(uint32_t version) {
  return concat_op<CpuConcatKernel, init_cpu_concat>(version);
}

const OrtCustomOp* fused_concat_cuda_op(uint32_t version) {
  return concat_op<CudaConcatKernel, init_cuda_concat>(version);
}

}  // namespace onnxfuse
