"""ChannelsLastMean's CUDA source run on the CPU: the kernels' own text (the raw string in
csrc/channels_last_mean.cc, as NVRTC compiles it) built with g++ under a small emulation of CUDA's
execution model (a block's 512 threads as threads of the host sharing its ``__shared__`` arrays,
``__syncthreads()`` a barrier, ``__shfl_xor_sync`` an exchange through a block-wide array between
barriers, blocks one after another), run on random values and compared with the mean in float64. It
checks the index arithmetic (channel groups of 32, 16 and 8 lanes, a partial last group, the four-load
loop and its tail, one pixel, more warps than pixels) on a machine without a GPU;
tests/gpu/test_channels_last_mean_gpu.py runs the op itself on a GPU. A planted error is caught, so the
check can fail."""

from __future__ import annotations

import pytest

from cuda_emulation import emulate, kernels_source, needs_cxx

SOURCE = "channels_last_mean.cc"

#: The typed loads and stores the kernels call (kCudaTypedIo on a GPU), all as float32 here: the checks
#: run the float32 kernel.
TYPED_IO = r"""
#define OFX_IO(T) \
  static float ld_##T(const void* p, long long i) { return ((const float*)p)[i]; } \
  static void st_##T(void* p, long long i, float v) { ((float*)p)[i] = v; }
OFX_IO(f32) OFX_IO(f16) OFX_IO(bf16)
"""

#: The checks (after the kernels and ``launch``, tests/custom_ops/cuda_emulation.py).
CHECKS = r"""
int check(long long n, long long p, long long c, int lanes) {
  std::mt19937 rng(static_cast<unsigned>(n * 131 + p * 7 + c + lanes));
  std::normal_distribution<float> normal(0.5f, 1.0f);
  std::vector<float> x(n * p * c), y(n * c, -12345.f);
  for (auto& v : x) v = normal(rng);
  Args a{};
  a.x = x.data(), a.y = y.data(), a.n = n, a.p = p, a.c = c, a.lanes = lanes;
  a.groups = (c + lanes - 1) / lanes;  // as CudaChannelsLastMean::ComputeV2 sets it
  launch(ofx_channels_last_mean_f32, a, n * a.groups);
  int bad = 0;
  for (long long b = 0; b < n; ++b)
    for (long long ch = 0; ch < c; ++ch) {
      double want = 0;
      for (long long q = 0; q < p; ++q) want += x[(b * p + q) * c + ch];
      want /= (double)p;
      bad += !(std::fabs(y[b * c + ch] - want) <= 1e-5 * (1 + std::fabs(want)));
    }
  return bad;
}
int main() {
  // (images, pixels, channels): a partial last group, the four-load loop with a tail (pixels beyond
  // 4 x 16 warps x rows), one pixel, fewer pixels than warps, one channel
  const long long cases[][3] = {{2, 300, 72}, {1, 1000, 40}, {2, 1, 9}, {1, 7, 33}, {3, 129, 1}};
  int bad = 0;
  for (auto& s : cases)
    for (int lanes : {32, 16, 8}) bad += check(s[0], s[1], s[2], lanes);
  std::printf("%d wrong means\n", bad);
  return bad ? 1 : 0;
}
"""


pytestmark = needs_cxx


def test_the_cuda_kernel_averages_every_channel_under_emulation(tmp_path):
    run = emulate(tmp_path, kernels_source(SOURCE), CHECKS, before=TYPED_IO)
    assert run.returncode == 0 and run.stdout.strip() == "0 wrong means", run.stdout + run.stderr


@pytest.mark.parametrize("plant", [("s += v0; s += v1;", "s += v0;"),  # a load of the unrolled loop lost
                                   ("o >= lanes", "o > lanes")])  # one lane of a channel left out
def test_a_planted_error_is_caught(tmp_path, plant):
    cuda = kernels_source(SOURCE)
    planted = cuda.replace(*plant, 1)
    assert planted != cuda
    run = emulate(tmp_path, planted, CHECKS, before=TYPED_IO)
    assert run.returncode == 1 and run.stdout.strip() != "0 wrong means", run.stdout
