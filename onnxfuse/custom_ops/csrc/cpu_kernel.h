// CPU evaluation of a FusedElementwise program over blocks of elements.
#ifndef ONNXFUSE_CPU_KERNEL_H_
#define ONNXFUSE_CPU_KERNEL_H_

#include <cstdint>
#include <vector>

#include "broadcast.h"
#include "program.h"

namespace onnxfuse {

class CpuEvaluator {
 public:
  static constexpr int kBlock = 2048;
  // in_dtypes/out_dtypes: storage dtypes of the node's inputs/outputs when they differ from the
  // program's (float16 stored as float32, see IoDTypes in custom_op.cc); empty: the program's.
  explicit CpuEvaluator(const Program& prog, std::vector<DType> in_dtypes = {}, std::vector<DType> out_dtypes = {});
  // Computes output elements [start, start + count) (count <= kBlock) of every output.
  // in[i]: input i's data (ORT storage layout), out[j]: output j's data (all of shape L.out_shape).
  void run_block(const void* const* in, void* const* out, const BroadcastLayout& L, int64_t start, int count) const;
  // Whole tensor, optionally split over threads by the caller: blocks [b0, b1).
  void run_blocks(const void* const* in, void* const* out, const BroadcastLayout& L, int64_t b0, int64_t b1) const;

 private:
  const Program& prog_;
  std::vector<size_t> offset_;  // byte offset of each value's block buffer in the scratch area
  size_t scratch_bytes_ = 0;
  std::vector<bool> used_;      // per value: read by an op or an output
  std::vector<DType> in_dtype_, out_dtype_;  // storage dtypes of the inputs and outputs
};

}  // namespace onnxfuse

#endif  // ONNXFUSE_CPU_KERNEL_H_
