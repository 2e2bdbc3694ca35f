// MixedRMSNorm: a residual sum and RMS normalization in float32 whose result is rounded to γ's type
// before γ multiplies (mixed_rmsnorm.cc).
#ifndef ONNXFUSE_MIXED_RMSNORM_H_
#define ONNXFUSE_MIXED_RMSNORM_H_

#include "ort_abi.h"

namespace onnxfuse {

// The op's CPU and CUDA registrations (domain ai.onnxfuse), built once; `version`: the OrtCustomOp
// version the library registers with.
const onnxfuse_ort::OrtCustomOp* mixed_rmsnorm_cpu_op(const onnxfuse_ort::OrtApi* api, uint32_t version);
const onnxfuse_ort::OrtCustomOp* mixed_rmsnorm_cuda_op(const onnxfuse_ort::OrtApi* api, uint32_t version);

}  // namespace onnxfuse

#endif  // ONNXFUSE_MIXED_RMSNORM_H_
