// ChannelsLastMean: the mean over H and W of a channels-last [N, H, W, C] tensor (channels_last_mean.cc).
#ifndef ONNXFUSE_CHANNELS_LAST_MEAN_H_
#define ONNXFUSE_CHANNELS_LAST_MEAN_H_

#include "ort_abi.h"

namespace onnxfuse {

// The op's CPU and CUDA registrations (domain ai.onnxfuse), built once; `version`: the OrtCustomOp
// version the library registers with.
const onnxfuse_ort::OrtCustomOp* channels_last_mean_cpu_op(const onnxfuse_ort::OrtApi* api, uint32_t version);
const onnxfuse_ort::OrtCustomOp* channels_last_mean_cuda_op(const onnxfuse_ort::OrtApi* api, uint32_t version);

}  // namespace onnxfuse

#endif  // ONNXFUSE_CHANNELS_LAST_MEAN_H_
