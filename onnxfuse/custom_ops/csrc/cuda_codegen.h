// Program -> CUDA C++ source for NVRTC. The source starts with ops.h (embedded at build time), so
// the device maths is the same text the CPU kernel is compiled from.
#ifndef ONNXFUSE_CUDA_CODEGEN_H_
#define ONNXFUSE_CUDA_CODEGEN_H_

#include <string>
#include <vector>

#include "broadcast.h"
#include "program.h"

namespace onnxfuse {

// Kernel variants (bit flags CudaVariant, kernel names kKernelNames: op_table.gen.h, from
// custom_ops.native.KERNELS; the runtime compiles all of them in one module):
//   kVariantFastVec      every input has the output's shape or is a single element; V elements per
//                        thread with 128-bit loads/stores (pointers 16-byte aligned), scalar tail
//   kVariantFastScalar   same inputs, one element per thread (any alignment)
//   kVariantBroadcast    general broadcasting through per-input strides (up to cuda_max_dims dims)
//   kVariantBroadcastVec broadcasting where the innermost (merged) dim is a multiple of V and every
//                        read input has stride 1 (128-bit loads) or 0 (one scalar load) along it: V
//                        consecutive elements per thread, 128-bit stores
constexpr int kBlockThreads = 256;
// The kernel-parameter block is passed by value; 4096 bytes is what every CUDA driver and
// architecture accepts (larger blocks need CUDA 12.1 and Volta or newer).
constexpr int kCudaParamBytes = 4096;
constexpr int kCudaMaxInputs = 48, kCudaMaxOutputs = 64;

// Merged dims the broadcast kernels of a program with nin inputs and nout outputs take: kMaxRank
// while dims[] and strides[nin][] fit in the parameter block (up to 28 inputs), else as many as
// fit, at least 8 within kCudaMaxInputs/kCudaMaxOutputs. CudaKernel::launch() splits a layout
// with more merged dims into one launch per outer coordinate, so every rank up to kMaxRank runs.
inline int cuda_max_dims(int nin, int nout) {
  const long fixed = 8L * (nin + nout) + 24;
  const long d = (kCudaParamBytes - fixed) / (8L * (nin + 1));
  return d < 0 ? 0 : (d > kMaxRank ? kMaxRank : static_cast<int>(d));
}

// Extra 8-byte slots a placed kernel's parameter block holds after strides[][] (place_inner,
// place_pitch, place_off: see cuda_source). Counted like outputs in cuda_max_dims/cuda_params_size.
constexpr int kPlacedParamSlots = 3;

// The `nout` cuda_max_dims and cuda_params_size take for a kernel with nout outputs, placed or not.
inline int cuda_out_slots(int nout, bool placed) { return nout + (placed ? kPlacedParamSlots : 0); }

struct CudaSource {
  std::string code;
  int vec = 4;   // elements per thread of the vectorized kernel
  int max_dims = 8;  // D: cuda_max_dims(nin, nout), the size of OfxParams' dims[] and strides[][]
  int nin = 0, nout = 0;
  std::vector<bool> used_inputs;  // inputs the program reads (others only take part in broadcasting)
};

// Kernel names: kKernelNames[k] + "_32" / "_64" (index width).
//
// Maths: ops whose declared dtype is float16/bfloat16 and whose row names a fast function (OpInfo::fast:
// Exp, Sigmoid, Tanh, Reciprocal, Div, Softsign, Gelu[approximate=tanh]) call the ofx_fast_* functions of
// the prelude (hardware approximations, errors
// stated there, all far below half precision's rounding); float32 ops call the ops.h functions.
//
// `placed`: output 0 is stored into a slice of a larger tensor (FusedConcat's segments): element i of
// the program's output goes to index (i / place_inner) * place_pitch + place_off + i % place_inner of
// out[0], three long longs appended to the parameter struct after strides[][] (kPlacedParamSlots; the
// dims a kernel takes are then cuda_max_dims(nin, nout + kPlacedParamSlots)). Other outputs are
// contiguous. The vectorised kernels are launched for a placed output only when place_inner, place_pitch
// and place_off are multiples of V (a thread's V elements then land in one row, contiguous).
CudaSource cuda_source(const Program& prog, int variants, bool placed = false);

// Byte size of the kernel-parameter struct for nin inputs and nout outputs; its layout, with
// D = cuda_max_dims(nin, nout), is
//   const void* in[nin]; void* out[nout]; long long n; long long scalar_mask; int ndim; int pad;
//   long long dims[D]; long long strides[nin][D];
// scalar_mask bit k: fast kernels - input k is a single element; ofx_bcast_vec - input k has stride 0
// along the innermost dim (one scalar load per thread); ofx_bcast ignores it.
inline size_t cuda_params_size(int nin, int nout) {
  const int d = cuda_max_dims(nin, nout);
  return 8 * (nin + nout) + 24 + 8 * d + 8 * d * nin;
}

}  // namespace onnxfuse

#endif  // ONNXFUSE_CUDA_CODEGEN_H_
