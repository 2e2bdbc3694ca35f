"""ChannelTranspose's CUDA source run on the CPU: the kernels' own text (the raw string in
csrc/channel_transpose.cc, as NVRTC compiles it) built with g++ under a small emulation of CUDA's
execution model (a block's 256 threads as threads of the host sharing the block's ``__shared__`` tile,
``__syncthreads()`` a barrier, blocks one after another), run on random bits and compared with the
transpose element by element. It checks the index arithmetic (tiles, the partial last tile, both
directions, 16- and 32-bit words) on a machine without a GPU; tests/gpu/test_channel_transpose_gpu.py
runs the same cases on a GPU. A planted index error in the source is caught, so the check can fail."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from onnxfuse.custom_ops import native

SOURCE = Path(native.__file__).resolve().parent / "csrc" / "channel_transpose.cc"
CXX = shutil.which("g++") or shutil.which("c++")

HARNESS = r"""
#include <barrier>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>
struct Dim3 { unsigned x; };
static thread_local Dim3 threadIdx;
static Dim3 blockIdx;
static std::barrier<>* block_barrier;
#define __global__
#define __launch_bounds__(n)
#define __shared__ static
#define __syncthreads() block_barrier->arrive_and_wait()
@KERNELS@
template <class F> void launch(F kernel, Args a, long long blocks) {
  for (long long b = 0; b < blocks; ++b) {
    blockIdx.x = (unsigned)b;
    std::barrier<> bar(THREADS);
    block_barrier = &bar;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < THREADS; ++t) threads.emplace_back([&, t] { threadIdx.x = t; kernel(a); });
    for (auto& t : threads) t.join();
  }
}
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


def kernels_source() -> str:
    (cuda,) = re.findall(r'R"CUDA\((.*?)\)CUDA"', SOURCE.read_text(), re.S)
    return cuda


def emulate(tmp_path: Path, cuda: str) -> subprocess.CompletedProcess:
    cc, exe = tmp_path / "emulated.cc", tmp_path / "emulated"
    cc.write_text(HARNESS.replace("@KERNELS@", cuda))
    built = subprocess.run([CXX, "-std=c++20", "-O1", "-pthread", str(cc), "-o", str(exe)], capture_output=True,
                           text=True)
    if built.returncode:
        if "barrier" in built.stderr:
            pytest.skip(f"{CXX} has no C++20 <barrier>")
        raise AssertionError(built.stderr[-2000:])
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)


pytestmark = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")


def test_the_cuda_kernels_transpose_every_element_under_emulation(tmp_path):
    run = emulate(tmp_path, kernels_source())
    assert run.returncode == 0 and run.stdout.strip() == "0 wrong elements", run.stdout + run.stderr


def test_a_planted_index_error_is_caught(tmp_path):
    cuda = kernels_source()
    planted = cuda.replace("tile[q * c + ch] = x[", "tile[q * c + (ch + 1) % c] = x[", 1)
    assert planted != cuda
    run = emulate(tmp_path, planted)
    assert run.returncode == 1 and run.stdout.strip() != "0 wrong elements", run.stdout
