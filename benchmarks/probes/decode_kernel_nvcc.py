"""Probe: DecodeAttention's CUDA kernel alone, built by nvcc into a small program, no ONNX Runtime.

The op's kernel source (`kCudaTypedIo` + `kCudaSource`, read from the C++ files) is compiled with a
`main` that launches it the way the op does (float16, head size 64, vector loads; G key/value heads
of n query rows each) and times it with CUDA events: the main kernel and the combine, per launch, and
the K/V bytes read over that time against a device-to-device copy of the same bytes. It checks every
output against a float64 evaluation on the host first. The program is also the target for `ncu`.

    python3 benchmarks/probes/decode_kernel_nvcc.py --out DIR [--shapes 1x1025,8x4097] [--ncu]

`--define NAME=VALUE` (repeatable) passes a macro to the build: `PROBE_KERNEL=ofx_decode_attention_f16_d64_m`
with `PROBE_MMA=1` times the tensor-core variant (default `_v`), `PROBE_SPLITS_CEIL=1` rounds the split count up (as the op
did before 5.38).
Needs nvcc; the GPU machine has it.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "onnxfuse" / "custom_ops" / "csrc"

MAIN = r"""
#ifndef PROBE_KERNEL
#define PROBE_KERNEL ofx_decode_attention_f16_d64_v
#endif
#ifndef PROBE_MMA
#define PROBE_MMA 0
#endif
#undef INFINITY
#define INFINITY HUGE_VALF
#include <cuda_runtime.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>

static unsigned short to_half(float f) { __half h = __float2half_rn(f); return *(unsigned short*)&h; }
static float from_half(unsigned short u) { __half h; *(unsigned short*)&h = u; return __half2float(h); }
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("error %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)

int main(int argc, char** argv) {
  const long long B = atoll(argv[1]), T = atoll(argv[2]);
  const long long G = atoll(argv[3]), n = atoll(argv[4]), D = 64, R = n;
  const int reps = argc > 5 ? atoi(argv[5]) : 200;
  const long long forced_splits = argc > 6 ? atoll(argv[6]) : 0;
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  std::vector<unsigned short> q(B * R * G * D), k(B * G * T * D), v(B * G * T * D), bias(B * T);
  for (auto& x : q) x = to_half(nd(rng));
  for (auto& x : k) x = to_half(nd(rng));
  for (auto& x : v) x = to_half(nd(rng));
  for (long long i = 0; i < B * T; ++i) bias[i] = to_half(i % T < 3 && T > 8 ? -INFINITY : 0.f);
  void *dq, *dk, *dv, *db, *dout, *dpart, *dcopy;
  CK(cudaMalloc(&dq, q.size() * 2)); CK(cudaMalloc(&dk, k.size() * 2)); CK(cudaMalloc(&dv, v.size() * 2));
  CK(cudaMalloc(&db, bias.size() * 2)); CK(cudaMalloc(&dout, q.size() * 2));
  CK(cudaMalloc(&dcopy, k.size() * 4));
  CK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db, bias.data(), bias.size() * 2, cudaMemcpyHostToDevice));
  const long long BG = B * G;
  const int TK = 16384 / (64 * 2) < 128 ? 16384 / (64 * 2) : 128;
  // Shared memory and the split count, as the op's host code computes them.
  auto shared_floats = [&](long long rows) {
    long long groups = 1;  // p · V's row groups of 4 (float16, head size 64); with tensor cores 16 rows
    while (groups * 4 < rows) groups *= 2;
    const long long prows = PROBE_MMA ? 16 : groups * 4, padded = 64, v_row = PROBE_MMA ? 72 : 64;
    const long long sc = rows * padded, vs = (sc + prows * TK + rows * TK + 3) / 4 * 4;
    const long long tile_end = vs + TK * v_row * 2 / 4, sums = sc + rows * padded + (PROBE_MMA ? 4096 : 0);
    return (tile_end > sums ? tile_end : sums) + 3 * prows;
  };
  int per_sm = 0, sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const unsigned shared = shared_floats(R) * 4;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, PROBE_KERNEL, 256, shared_floats(16) * 4));
  const long long resident = (long long)per_sm * sms;
  long long splits = PROBE_SPLITS(BG, resident);
  const long long most = (T + TK - 1) / TK;
  if (splits > most) splits = most;
  if (splits < 1) splits = 1;
  if (forced_splits) splits = forced_splits;
  long long chunk = (T + splits - 1) / splits; chunk = (chunk + TK - 1) / TK * TK;
  splits = (T + chunk - 1) / chunk;
  CK(cudaMalloc(&dpart, (splits * BG * R * (D + 2) + 1) * 4));
  Args a{};
  a.q = dq; a.k = dk; a.v = dv; a.bias = db; a.out = dout; a.part = (float*)dpart;
  a.B = B; a.R = R; a.S = 1; a.T = T; a.G = G; a.D = D; a.n = n; a.bias_b = B; a.bias_s = 1;
  a.splits = splits; a.chunk = chunk; a.vec = 1; a.scale = 0.125f;
  const long long outputs = BG * R * D;
  auto run = [&](bool combine) {
    PROBE_KERNEL<<<dim3(splits, BG), 256, shared>>>(a);
    if (combine && splits > 1) ofx_decode_attention_f16_combine<<<(outputs + 255) / 256, 256>>>(a);
  };
  run(true); CK(cudaDeviceSynchronize());
  // Check against float64.
  std::vector<unsigned short> out(q.size());
  CK(cudaMemcpy(out.data(), dout, out.size() * 2, cudaMemcpyDeviceToHost));
  double worst = 0;
  std::vector<double> s(T);
  for (long long b = 0; b < B; ++b) for (long long g = 0; g < G; ++g) for (long long r = 0; r < R; ++r) {
    double top = -INFINITY;
    for (long long t = 0; t < T; ++t) {
      double x = 0;
      for (long long d = 0; d < D; ++d) x += (double)from_half(q[((b * R + r) * G + g) * D + d]) * 0.125 * from_half(k[((b * G + g) * T + t) * D + d]);
      s[t] = x + from_half(bias[b * T + t]); if (s[t] > top) top = s[t];
    }
    double sum = 0; for (long long t = 0; t < T; ++t) { s[t] = std::exp(s[t] - top); sum += s[t]; }
    for (long long d = 0; d < D; ++d) {
      double acc = 0; for (long long t = 0; t < T; ++t) acc += s[t] * from_half(v[((b * G + g) * T + t) * D + d]);
      const double err = std::fabs(acc / sum - from_half(out[((b * R + r) * G + g) * D + d]));
      if (err > worst) worst = err;
    }
  }
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto time_us = [&](auto fn) {
    for (int i = 0; i < 20; ++i) fn();
    CK(cudaEventRecord(e0));
    for (int i = 0; i < reps; ++i) fn();
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
    float ms = 0; CK(cudaEventElapsedTime(&ms, e0, e1)); return ms * 1000.0 / reps;
  };
  const double both = time_us([&] { run(true); }), main_only = time_us([&] { run(false); });
  const double kv_bytes = 2.0 * B * G * T * D * 2;
  const double copy = time_us([&] { cudaMemcpyAsync(dcopy, dk, (size_t)kv_bytes / 2, cudaMemcpyDeviceToDevice); });
  CK(cudaGetLastError());
  printf("{\"B\": %lld, \"T\": %lld, \"G\": %lld, \"n\": %lld, \"splits\": %lld, \"chunk\": %lld, \"blocks\": %lld, "
         "\"resident\": %lld, \"max_abs_err\": %.3g, \"us\": %.2f, \"main_us\": %.2f, \"GBps\": %.0f, "
         "\"copy_half_us\": %.2f, \"copy_GBps\": %.0f}\n",
         B, T, G, n, splits, chunk, splits * BG, resident, worst, both, main_only, kv_bytes / both / 1e3, copy,
         kv_bytes / copy / 1e3);
  return 0;
}
"""


def raw_string(text: str, name: str) -> str:
    m = re.search(name + r'\s*=\s*R"CUDA\((.*?)\)CUDA"', text, re.S)
    if not m:
        raise SystemExit(f"{name} not found")
    return m.group(1)


def build(work: Path, defines: list[str], csrc: Path = CSRC) -> Path:
    source = raw_string((csrc / "attention_common.h").read_text(), "kCudaTypedIo") + raw_string(
        (csrc / "decode_attention.cc").read_text(), "kCudaSource")
    splits = "(BG >= resident ? 1 : resident / BG)"
    for d in defines:
        if d.startswith("PROBE_SPLITS_CEIL"):
            splits = "(BG >= resident ? 1 : (resident + BG - 1) / BG)"
    cu = work / "decode_probe.cu"
    cu.write_text("#include <cuda_fp16.h>\n" + "#define PROBE_SPLITS(BG, resident) " + splits + "\n" + source + MAIN)
    exe = work / "decode_probe"
    cmd = ["nvcc", "-O3", "-std=c++17", "-arch=sm_90", "-Xptxas", "-v", "-o", str(exe), str(cu)]
    cmd += [f"-D{d}" for d in defines]
    r = subprocess.run(cmd, capture_output=True, text=True)
    (work / "ptxas.txt").write_text(r.stdout + r.stderr)
    if r.returncode:
        raise SystemExit(r.stderr[-4000:])
    return exe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", default="1x1025,1x4097,8x1025,8x4097", help="BxT pairs")
    p.add_argument("--heads", default="2x7", help="GxN: key/value heads and query rows per head")
    p.add_argument("--define", action="append", default=[])
    p.add_argument("--csrc", type=Path, default=CSRC, help="the C++ sources to read the kernel from (another version)")
    p.add_argument("--splits", type=int, default=0, help="force a split count")
    p.add_argument("--ncu", action="store_true", help="also profile the last shape with ncu")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    exe = build(a.out, a.define, a.csrc)
    G, n = a.heads.split("x")
    rows = []
    for shape in a.shapes.split(","):
        B, T = shape.split("x")
        r = subprocess.run([str(exe), B, T, G, n, "200", str(a.splits)], capture_output=True, text=True)
        line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr
        print(line, flush=True)
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            rows.append({"shape": shape, "error": line})
    (a.out / "results.json").write_text(json.dumps({"defines": a.define, "rows": rows}, indent=1))
    if a.ncu:
        B, T = a.shapes.split(",")[-1].split("x")
        r = subprocess.run(["ncu", "--clock-control", "none", "--set", "full", "-k", "regex:ofx_decode_attention_f16_d64",
                            "-c", "1", str(exe), B, T, G, n, "3", str(a.splits)], capture_output=True, text=True)
        (a.out / "ncu.txt").write_text(r.stdout + r.stderr)


if __name__ == "__main__":
    main()
