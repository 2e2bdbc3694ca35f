// CUDA side of FusedElementwise: the driver API and NVRTC, loaded with dlopen only when a CUDA
// kernel is created (no CUDA headers or libraries needed to build or to load this library).
#ifndef ONNXFUSE_CUDA_RUNTIME_H_
#define ONNXFUSE_CUDA_RUNTIME_H_

#include <memory>
#include <string>
#include <vector>

#include "broadcast.h"
#include "cuda_codegen.h"
#include "program.h"

namespace onnxfuse {

struct CudaModule;  // a loaded CUmodule with its kernels

// Where a placed kernel stores output 0 (FusedConcat's segments, cuda_source's `placed`): element i of
// the program's output goes to out[0][(i / inner) * pitch + off + i % inner]; `total` is out[0]'s
// element count (it decides the index width).
struct OutputPlacement {
  int64_t inner = 1, pitch = 1, off = 0, total = 0;
};

class CudaKernel {
 public:
  // Generates, compiles (NVRTC, cached in memory and on disk) and loads the kernels of `prog` for
  // CUDA device `device`. Returns nullptr and sets *err (with the NVRTC log) on failure.
  // `placed`: output 0 is stored through an OutputPlacement given to every launch.
  static std::unique_ptr<CudaKernel> create(const Program& prog, int device, std::string* err, bool placed = false);
  // Launches on `stream` (a CUstream / cudaStream_t). No host synchronisation, no allocation on
  // the device. A layout with more merged dims than max_dims_ (at most kMaxRank) takes several
  // launches, one per coordinate of its outer dims.
  // `place`: required by a placed kernel, ignored otherwise.
  bool launch(const void* const* in, void* const* out, const BroadcastLayout& L, void* stream, std::string* err,
              const OutputPlacement* place = nullptr) const;

 private:
  bool launch_one(const void* const* in, void* const* out, const BroadcastLayout& L, void* stream, std::string* err,
                  const OutputPlacement* place) const;

  std::shared_ptr<CudaModule> module_;
  int nin_ = 0, nout_ = 0, vec_ = 4;
  int max_dims_ = 8;  // dims the broadcast kernels take (cuda_max_dims)
  int device_ = 0;
  bool placed_ = false;
  std::vector<bool> used_;  // per input: read by the program
  std::vector<int64_t> in_bytes_, out_bytes_;  // element sizes (pointer offsets when a launch is split)
};

// Compiles CUDA source to PTX (arch like "compute_90") or CUBIN ("sm_90") with NVRTC; for tests.
bool nvrtc_compile(const std::string& source, const std::string& arch, std::string* binary, std::string* log);

// A fixed CUDA source (one that does not depend on a program): compiled with NVRTC once per process and
// device; *fns gets its kernels in the order of `names`, *ctx the device's primary context. False and
// *err on failure.
bool fixed_kernels(const std::string& source, const std::vector<std::string>& names, int device,
                   std::vector<void*>* fns, void** ctx, std::string* err);
// Launches `fn` (from fixed_kernels) on `stream`: a grid of blocks × blocks_y blocks of `threads`, with
// `shared_bytes` of dynamic shared memory (at most 48 KiB); `args` as cuLaunchKernel.
bool launch_fixed(void* fn, void* ctx, long long blocks, unsigned threads, void* stream, void** args, std::string* err,
                  long long blocks_y = 1, unsigned shared_bytes = 0);

// The blocks of `fn` (from fixed_kernels) that device `device` runs at once: multiprocessors × the
// occupancy at `threads` per block and `shared_bytes` of dynamic shared memory. 0 when the driver cannot
// say (no occupancy entry point, or a call fails).
int resident_blocks(void* fn, void* ctx, int device, unsigned threads, unsigned shared_bytes);
// The compute capability of CUDA device `device` as major·10 + minor; 0 where the driver does not say.
int compute_capability(int device);

// JSON with counters: compiles, disk_hits, memory_hits, disk_writes, disk_rejects (entries that
// failed verification, never loaded), last_disk_reject, disk_refused (why the cache folder was not
// used, "" if it was), times, last_entry (file name of the last kernel's
// entry), last_arch, cache_dir.
std::string cuda_stats_json();

}  // namespace onnxfuse

#endif  // ONNXFUSE_CUDA_RUNTIME_H_
