// FusedConcat (domain ai.onnxfuse, opset 1): FusedElementwise's concatenating form (fused_concat.cc;
// contract: docs/custom-ops.md).
#ifndef ONNXFUSE_FUSED_CONCAT_H_
#define ONNXFUSE_FUSED_CONCAT_H_

#include "ort_abi.h"

namespace onnxfuse {

// The op's CPU and CUDA registrations, built once; `version`: the OrtCustomOp version the library
// registers with. They call ONNX Runtime through elementwise_io.h's g_api, which must be set first.
const onnxfuse_ort::OrtCustomOp* fused_concat_cpu_op(uint32_t version);
const onnxfuse_ort::OrtCustomOp* fused_concat_cuda_op(uint32_t version);

}  // namespace onnxfuse

#endif  // ONNXFUSE_FUSED_CONCAT_H_
