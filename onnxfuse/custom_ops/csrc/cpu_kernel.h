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
  explicit CpuEvaluator(const Program& prog);
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
};

}  // namespace onnxfuse

#endif  // ONNXFUSE_CPU_KERNEL_H_
