// Launch tuning for FusedElementwise's generated kernels: which block size and how many work items per
// thread a launch uses, chosen by timing the candidates on the first launch of each size.
//
// Why: every generated kernel walks its items with a grid-stride loop (cuda_codegen.cc), so the grid is
// free. One item per thread in blocks of 256 (the default) is right for most kernels, but what is fastest
// at 4M-16M elements depends on the program (a transcendental chain is compute-bound, a scale-and-bias is
// memory-bound), the element type and the GPU; issue 32 asks for the choice to be measured, as TensorRT
// times its tactics. The output does not depend on the choice: every element is computed by the same
// code whichever thread runs it, so tuning changes time, never values.
//
// When: only for launches of at least kTuneMinElements elements (below that a launch is dominated by its
// fixed cost and the timings by noise), never while the stream is being captured into a CUDA graph (the
// default is used and not recorded, so a later uncaptured launch still tunes), and not when
// ONNXFUSE_LAUNCH_TUNING=0. The decision is kept per loaded module (shared by the nodes of one program),
// kernel variant and element count, for the life of the process.
#ifndef ONNXFUSE_LAUNCH_TUNING_H_
#define ONNXFUSE_LAUNCH_TUNING_H_

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace onnxfuse {

struct LaunchShape {
  unsigned threads = 256;  // per block
  long long blocks = 0;
  int items_per_thread = 1;  // the grid covers this many items per thread (the last ones fewer)
  bool operator==(const LaunchShape& o) const { return threads == o.threads && blocks == o.blocks; }
};

constexpr long long kTuneMinElements = 1ll << 20;
// A candidate replaces the default only when it is faster by more than this fraction: the timings of
// one tuning pass move by a few per cent between passes, so a smaller win is as likely noise.
constexpr double kTuneMargin = 0.03;

// One work item per thread in blocks of `threads`.
LaunchShape default_launch(long long items, unsigned threads);

// The shapes tried for `items` work items, the default (blocks of `default_threads`, one item per
// thread) first: blocks of 128 and 256 threads with 1, 2, 4 and 8 items per thread, without duplicates
// (a small launch gives the same grid for several).
std::vector<LaunchShape> launch_candidates(long long items, unsigned default_threads);

// Index of the shape to keep given each candidate's time (candidate 0 is the default): the fastest,
// unless it does not beat the default by more than kTuneMargin. Negative or non-finite times (a
// failed measurement) never win.
int pick_launch(const std::vector<double>& ms);

// False when the environment says ONNXFUSE_LAUNCH_TUNING=0 (read on every call: callers ask only when a
// new size is seen, so tests and benchmarks can switch it).
bool launch_tuning_enabled();

// Decisions already made: (kernel variant, 64-bit index, element count) -> shape. Thread-safe.
class LaunchTable {
 public:
  bool find(int variant, bool wide, long long n, LaunchShape* out) const;
  void put(int variant, bool wide, long long n, const LaunchShape& s);

 private:
  mutable std::mutex mu_;
  std::map<std::tuple<int, bool, long long>, LaunchShape> table_;
};

}  // namespace onnxfuse

#endif  // ONNXFUSE_LAUNCH_TUNING_H_
