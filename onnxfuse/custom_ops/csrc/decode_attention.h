// DecodeAttention: a few query rows per key/value head over a long cache, split along the keys
// (decode_attention.cc).
#ifndef ONNXFUSE_DECODE_ATTENTION_H_
#define ONNXFUSE_DECODE_ATTENTION_H_

#include "ort_abi.h"

namespace onnxfuse {

// The op's CPU and CUDA registrations (domain ai.onnxfuse), built once; `version`: the OrtCustomOp
// version the library registers with.
const onnxfuse_ort::OrtCustomOp* decode_attention_cpu_op(const onnxfuse_ort::OrtApi* api, uint32_t version);
const onnxfuse_ort::OrtCustomOp* decode_attention_cuda_op(const onnxfuse_ort::OrtApi* api, uint32_t version);

}  // namespace onnxfuse

#endif  // ONNXFUSE_DECODE_ATTENTION_H_
