// ChannelTranspose: NCHW <-> NHWC of a tensor with few channels, by tiles staged in shared memory
// (channel_transpose.cc).
#ifndef ONNXFUSE_CHANNEL_TRANSPOSE_H_
#define ONNXFUSE_CHANNEL_TRANSPOSE_H_

#include "ort_abi.h"

namespace onnxfuse {

// The op's CPU and CUDA registrations (domain ai.onnxfuse), built once; `version`: the OrtCustomOp
// version the library registers with.
const onnxfuse_ort::OrtCustomOp* channel_transpose_cpu_op(const onnxfuse_ort::OrtApi* api, uint32_t version);
const onnxfuse_ort::OrtCustomOp* channel_transpose_cuda_op(const onnxfuse_ort::OrtApi* api, uint32_t version);

}  // namespace onnxfuse

#endif  // ONNXFUSE_CHANNEL_TRANSPOSE_H_
