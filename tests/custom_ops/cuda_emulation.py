"""Running a fixed CUDA source of the library on the CPU, for the tests that check a kernel's index
arithmetic without a GPU (test_channel_transpose_emulated.py, test_channels_last_mean_emulated.py).

The kernels' own text (the raw string in their csrc/*.cc, as NVRTC compiles it) is built with g++ under a
small emulation of CUDA's execution model: a block's threads are threads of the host sharing the block's
``__shared__`` arrays (``static``), ``__syncthreads()`` is a barrier of the block, ``__shfl_xor_sync`` an
exchange through a block-wide array between two barriers (every thread of the block must call it, as in
the kernels here), and blocks run one after another (``launch``). A test supplies the checks and
``main``, which print one line and exit 1 on a wrong result."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from onnxfuse.custom_ops import native

CSRC = Path(native.__file__).resolve().parent / "csrc"
CXX = shutil.which("g++") or shutil.which("c++")

#: Before the kernels: CUDA's built-ins for the emulation.
PRELUDE = r"""
#include <barrier>
#include <cmath>
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
static float shuffle_slots[1024];
static float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  shuffle_slots[threadIdx.x] = v;
  block_barrier->arrive_and_wait();
  const float got = shuffle_slots[threadIdx.x ^ lane_mask];
  block_barrier->arrive_and_wait();
  return got;
}
"""

#: After the kernels (which define THREADS and their Args): ``launch(kernel, args, blocks)``.
LAUNCH = r"""
template <class F, class A> void launch(F kernel, A a, long long blocks) {
  for (long long b = 0; b < blocks; ++b) {
    blockIdx.x = (unsigned)b;
    std::barrier<> bar(THREADS);
    block_barrier = &bar;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < THREADS; ++t) threads.emplace_back([&, t] { threadIdx.x = t; kernel(a); });
    for (auto& t : threads) t.join();
  }
}
"""

needs_cxx = pytest.mark.skipif(CXX is None, reason="needs a C++ compiler")


def kernels_source(file: str) -> str:
    """The one raw CUDA string of ``csrc/<file>``."""
    (cuda,) = re.findall(r'R"CUDA\((.*?)\)CUDA"', (CSRC / file).read_text(), re.S)
    return cuda


def emulate(tmp_path: Path, cuda: str, checks: str, before: str = "", timeout: int = 300) -> subprocess.CompletedProcess:
    """Build PRELUDE, ``before`` (what the kernels need besides CUDA's built-ins), ``cuda``, LAUNCH and
    ``checks`` with g++ and run it; skipped where the compiler has no C++20 ``<barrier>``."""
    cc, exe = tmp_path / "emulated.cc", tmp_path / "emulated"
    cc.write_text(PRELUDE + before + cuda + LAUNCH + checks)
    built = subprocess.run([CXX, "-std=c++20", "-O1", "-pthread", str(cc), "-o", str(exe)], capture_output=True,
                           text=True)
    if built.returncode:
        if "barrier" in built.stderr:
            pytest.skip(f"{CXX} has no C++20 <barrier>")
        raise AssertionError(built.stderr[-2000:])
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=timeout)
