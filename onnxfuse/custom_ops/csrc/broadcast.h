// Multidirectional (numpy/ONNX) broadcasting of all node inputs, with dimension coalescing.
#ifndef ONNXFUSE_BROADCAST_H_
#define ONNXFUSE_BROADCAST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "op_table.gen.h"

namespace onnxfuse {

// FusedElementwise's limit on the broadcast rank (the largest input rank), checked by make_layout
// and by shape inference. Fixed-size arrays depend on it: the CPU kernel's coordinates
// (cpu_kernel.cc) and the CUDA kernels' dims/strides (cuda_max_dims in cuda_codegen.h; launch()
// splits a layout with more merged dims than the kernel takes). kMaxRank is defined in
// op_table.gen.h, generated from custom_ops.MAX_RANK; fuse-elementwise refuses higher ranks.

inline std::string rank_limit_error(size_t rank) {
  return "rank " + std::to_string(rank) + " exceeds FusedElementwise's limit of " + std::to_string(kMaxRank);
}

struct BroadcastLayout {
  std::vector<int64_t> out_shape;             // the broadcast shape of all inputs
  int64_t n = 0;                              // its element count
  // Coalesced iteration space: dims (outermost first) and, per input, element strides in it
  // (0 along broadcast dimensions). At least one dim, at most kMaxRank.
  std::vector<int64_t> dims;
  std::vector<std::vector<int64_t>> strides;
  enum Kind { kFull = 0, kScalar = 1, kGeneral = 2 };
  std::vector<int> kind;                      // per input
  bool all_fast() const {
    for (int k : kind)
      if (k == kGeneral) return false;
    return true;
  }
};

inline bool make_layout(const std::vector<std::vector<int64_t>>& in_shapes, BroadcastLayout* L, std::string* err) {
  size_t rank = 0;
  for (const auto& s : in_shapes) rank = s.size() > rank ? s.size() : rank;
  if (rank > static_cast<size_t>(kMaxRank)) {
    for (size_t i = 0; i < in_shapes.size(); ++i) {
      if (in_shapes[i].size() != rank) continue;
      *err = rank_limit_error(rank) + " (input " + std::to_string(i) + " has " + std::to_string(rank) + " dimensions)";
      break;
    }
    return false;
  }
  std::vector<int64_t> out(rank, 1);
  for (size_t i = 0; i < in_shapes.size(); ++i) {
    const auto& s = in_shapes[i];
    size_t off = rank - s.size();
    for (size_t d = 0; d < s.size(); ++d) {
      int64_t a = out[off + d], b = s[d];
      if (b < 0) {
        *err = "input " + std::to_string(i) + " has a negative dimension";
        return false;
      }
      if (a == b || b == 1) continue;
      if (a == 1) {
        out[off + d] = b;
        continue;
      }
      std::string sh;
      for (size_t k = 0; k < s.size(); ++k) sh += (k ? "," : "") + std::to_string(s[k]);
      *err = "input " + std::to_string(i) + " of shape [" + sh + "] does not broadcast with the other inputs (dimension " +
             std::to_string(d) + " is " + std::to_string(b) + ", others have " + std::to_string(a) + ")";
      return false;
    }
  }
  L->out_shape = out;
  L->n = 1;
  for (int64_t d : out) L->n *= d;
  const size_t nin = in_shapes.size();
  // Full strides over the output rank.
  std::vector<std::vector<int64_t>> st(nin, std::vector<int64_t>(rank, 0));
  L->kind.assign(nin, BroadcastLayout::kGeneral);
  for (size_t i = 0; i < nin; ++i) {
    const auto& s = in_shapes[i];
    size_t off = rank - s.size();
    int64_t acc = 1, numel = 1;
    for (size_t d = s.size(); d-- > 0;) {
      st[i][off + d] = s[d] == 1 ? 0 : acc;
      acc *= s[d];
    }
    for (int64_t d : s) numel *= d;
    if (numel == L->n) L->kind[i] = BroadcastLayout::kFull;
    else if (numel == 1) L->kind[i] = BroadcastLayout::kScalar;
  }
  // Drop size-1 output dims, then merge neighbours that are contiguous for every input.
  std::vector<int64_t> dims;
  std::vector<std::vector<int64_t>> cs(nin);
  for (size_t d = 0; d < rank; ++d) {
    if (out[d] == 1) continue;
    dims.push_back(out[d]);
    for (size_t i = 0; i < nin; ++i) cs[i].push_back(st[i][d]);
  }
  if (dims.empty()) {
    dims.push_back(1);
    for (size_t i = 0; i < nin; ++i) cs[i].push_back(0);
  }
  std::vector<int64_t> md{dims[0]};
  std::vector<std::vector<int64_t>> ms(nin);
  for (size_t i = 0; i < nin; ++i) ms[i].push_back(cs[i][0]);
  for (size_t d = 1; d < dims.size(); ++d) {
    bool merge = true;
    for (size_t i = 0; i < nin && merge; ++i) merge = ms[i].back() == cs[i][d] * dims[d];
    if (merge) {
      md.back() *= dims[d];
      for (size_t i = 0; i < nin; ++i) ms[i].back() = cs[i][d];
    } else {
      md.push_back(dims[d]);
      for (size_t i = 0; i < nin; ++i) ms[i].push_back(cs[i][d]);
    }
  }
  L->dims = md;
  L->strides = ms;
  return true;
}

}  // namespace onnxfuse

#endif  // ONNXFUSE_BROADCAST_H_
