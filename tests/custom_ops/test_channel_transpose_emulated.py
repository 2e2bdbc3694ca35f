"""ChannelTranspose's CUDA source run on the CPU: the kernels' own text (the raw string in
csrc/channel_transpose.cc, as NVRTC compiles it) built with g++ under a small emulation of CUDA's
execution model (a block's 256 threads as threads of the host sharing the block's ``__shared__`` tile,
``__syncthreads()`` a barrier, blocks one after another), run on random bits and compared with the
transpose element by element. It checks the index arithmetic (tiles, the partial last tile, both
directions, 16- and 32-bit words) on a machine without a GPU; tests/gpu/test_channel_transpose_gpu.py
runs the same cases on a GPU. A planted index error in the source is caught, so the check can fail."""

from __future__ import annotations

import pytest

from cuda_emulation import emulate, kernels_source, needs_cxx

SOURCE = "channel_transpose.cc"

#: The checks (after the kernels and ``launch``, tests/custom_ops/cuda_emulation.py).
CHECKS = r"""
template <class T> int check(long long n, long long c, long long p, bool to_nhwc, void (*kernel)(Args)) {
  std::mt19937 rng(static_cast<unsigned>(n * 131 + c * 7 + p));
  const long long total = n * c * p;
  std::vector<T> x(total), y(total, T(0x5a5a));
  for (auto& v : x) v = static_cast<T>(rng());
  Args a{};
  a.x = x.data(), a.y = y.data(), a.n = n, a.c = c, a.p = p;
  a.tile_p = 8192 / c / 32 * 32;  // as CudaChannelTranspose::ComputeV2 sets it (kTileElements / C, whole warps)
  a.tiles = (p + a.tile_p - 1) / a.tile_p;
  launch(kernel, a, n * a.tiles);
  int bad = 0;
  for (long long b = 0; b < n; ++b)
    for (long long ch = 0; ch < c; ++ch)
      for (long long q = 0; q < p; ++q) {
        const long long planar = (b * c + ch) * p + q, interleaved = (b * p + q) * c + ch;
        bad += to_nhwc ? y[interleaved] != x[planar] : y[planar] != x[interleaved];
      }
  return bad;
}
int main() {
  // (images, channels, pixels): an RGB image over three tiles with a partial last one, one channel, 31
  // and 64 channels (the rule's and the op's limits), single pixels, two tiles of an image
  const long long cases[][3] = {{2, 3, 6097}, {1, 1, 2500}, {2, 31, 117}, {2, 64, 35}, {3, 8, 1}, {1, 3, 3000}};
  int bad = 0;
  for (auto& s : cases) {
    bad += check<unsigned>(s[0], s[1], s[2], true, ofx_to_nhwc_b32) + check<unsigned>(s[0], s[1], s[2], false, ofx_to_nchw_b32);
    bad += check<unsigned short>(s[0], s[1], s[2], true, ofx_to_nhwc_b16) +
           check<unsigned short>(s[0], s[1], s[2], false, ofx_to_nchw_b16);
  }
  std::printf("%d wrong elements\n", bad);
  return bad ? 1 : 0;
}
"""


pytestmark = needs_cxx


def test_the_cuda_kernels_transpose_every_element_under_emulation(tmp_path):
    run = emulate(tmp_path, kernels_source(SOURCE), CHECKS)
    assert run.returncode == 0 and run.stdout.strip() == "0 wrong elements", run.stdout + run.stderr


def test_a_planted_index_error_is_caught(tmp_path):
    cuda = kernels_source(SOURCE)
    planted = cuda.replace("tile[q * c + ch] = x[", "tile[q * c + (ch + 1) % c] = x[", 1)
    assert planted != cuda
    run = emulate(tmp_path, planted, CHECKS)
    assert run.returncode == 1 and run.stdout.strip() != "0 wrong elements", run.stdout
