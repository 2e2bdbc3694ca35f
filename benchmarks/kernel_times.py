#!/usr/bin/env python3
"""Per-kernel GPU time of a model under ONNX Runtime, through Nsight Compute (``ncu``).

ONNX Runtime's own profiler (``onnxfuse bench --profile``) reports host-side node times only when
ONNX Runtime is built without CUDA profiling, which hides what each kernel costs on the GPU. This
script is the target that ``ncu`` runs, and it summarises ncu's CSV:

    ncu --csv --metrics gpu__time_duration.sum \\
        python3 benchmarks/kernel_times.py run model.onnx --batch 16 > model.ncu.csv
    python3 benchmarks/kernel_times.py summarize model.ncu.csv [other.ncu.csv] --top 20

``run`` makes two inferences (cuDNN's heuristic algorithm choice, so no benchmark kernels pollute the
trace); ``summarize`` keeps the second one and prints µs per kernel name, summed over calls. A model with
FusedElementwise nodes needs ``run --warmup 8`` and ``ncu --profile-from-start off``: its kernels tune
their launch shapes on the first runs (hundreds of trial launches, which would fill the trace), so the
warm-up runs go unprofiled and only the two runs after them are traced (cudaProfilerStart/Stop). This is
how docs/benchmarks.md found cuDNN's separate bias-add kernel after every Conv. Never imported by the
package.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(args) -> int:
    import onnx
    import onnxruntime as ort

    from onnxfuse.timing import batch_shapes
    from onnxfuse.custom_ops import session_options
    from onnxfuse.runtime.inputs import make_inputs

    model = onnx.load(args.model)
    feeds = make_inputs(model, batch_shapes(model, args.batch)[0]).feeds
    sess = ort.InferenceSession(args.model, session_options(),
                                providers=[("CUDAExecutionProvider", {"cudnn_conv_algo_search": "HEURISTIC"})])
    for _ in range(args.warmup):  # FusedElementwise tunes its launches on the first runs: keep them out
        sess.run(None, feeds)
    profiler = _cuda_profiler() if args.warmup else None
    if profiler is not None:
        profiler.cudaProfilerStart()
    for _ in range(2):
        sess.run(None, feeds)
    if profiler is not None:
        profiler.cudaProfilerStop()
    return 0


def _cuda_profiler():
    """The CUDA runtime, for cudaProfilerStart/Stop (ncu --profile-from-start off), loaded by ctypes."""
    import ctypes
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("kernel_times: no libcudart to start the profiler with; use --warmup 0")


def _rows(path: str) -> list[dict]:
    lines = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    return list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))


def summarize(args) -> int:
    for path in args.csv:
        rows = _rows(path)
        second = rows[len(rows) // 2:]  # two identical runs: the second one, warm
        per_kernel = collections.defaultdict(lambda: [0, 0.0])
        for r in second:
            entry = per_kernel[r["Kernel Name"][:90]]
            entry[0] += 1
            entry[1] += float(r["Metric Value"].replace(",", "")) / 1000.0  # ns -> µs
        total = sum(t for _, t in per_kernel.values())
        print(f"{path}: {len(second)} kernels, {total:.1f} µs per run")
        for name, (calls, us) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:args.top]:
            print(f"  {calls:5d} {us:9.1f} µs  {name}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="two inferences of MODEL on CUDA (the target ncu profiles)")
    r.add_argument("model")
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--warmup", type=int, default=0,
                   help="unprofiled runs first (run ncu with --profile-from-start off); 0: profile from the start")
    s = sub.add_parser("summarize", help="µs per kernel name from ncu --csv output")
    s.add_argument("csv", nargs="+")
    s.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())
