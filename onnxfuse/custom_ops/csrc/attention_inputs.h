// AttentionInputs: the inputs of a decoder's cached attention in one kernel (attention_inputs.cc).
#ifndef ONNXFUSE_ATTENTION_INPUTS_H_
#define ONNXFUSE_ATTENTION_INPUTS_H_

#include "ort_abi.h"

namespace onnxfuse {

// The op's CPU and CUDA registrations (domain ai.onnxfuse), built once; `version`: the OrtCustomOp
// version the library registers with.
const onnxfuse_ort::OrtCustomOp* attention_inputs_cpu_op(const onnxfuse_ort::OrtApi* api, uint32_t version);
const onnxfuse_ort::OrtCustomOp* attention_inputs_cuda_op(const onnxfuse_ort::OrtApi* api, uint32_t version);

}  // namespace onnxfuse

#endif  // ONNXFUSE_ATTENTION_INPUTS_H_
