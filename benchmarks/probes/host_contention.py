"""Probe (docs/benchmarks.md 5.63): does a busy host slow onnxfuse's output more than the original?

5.63's second job timed EfficientNet-B0 at batch 1 without CUDA graphs while the same machine ran three
other GPU jobs (exports, pytest -n 8): the original ran 1.7x slower than alone, the optimized model 4.3x
slower, 0.52x its original (1.36x alone). Such a cell is bound by the host: each node costs a launch
and ONNX Runtime's bookkeeping on the CPU. This probe exports a zoo model (the zoo's builder and
exporter), optimizes it as a user would (``onnxfuse optimize --no-bench``), then times the pair with
``onnxfuse bench`` (interleaved rounds, IOBinding) at each batch, first alone, then with N processes
spinning on the CPU beside it (a pure-Python busy loop each: no GPU, no memory traffic), and prints
both ratios. If the optimized model loses more than the original under load, the FusedElementwise
host path (``custom_ops/csrc/custom_op.cc``, ``CudaKernelOrt::ComputeV2``) is where to look, with
``onnxfuse bench --profile`` under the same load.

Run on the GPU machine from the repository root (torch and torchvision importable)::

    python3 benchmarks/probes/host_contention.py --model efficientnet_b0 --hogs 0,16,64 --out $OUT/contention

Writes ``contention.json`` and the bench reports in --out; the models go to --out/models. An
exploration tool, never imported by the package.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import zoo  # noqa: E402  (benchmarks/zoo.py: the builders and the exporter the zoo's numbers come from)
from host_overhead import spinning  # noqa: E402  (the CPU load both scripts time beside)


def bench(original: Path, optimized: Path, batch: int, budget: float, report: Path) -> dict:
    """``onnxfuse bench ORIGINAL OPTIMIZED --batch B``: the two medians (ms) and their ratio."""
    proc = subprocess.run([sys.executable, "-m", "onnxfuse", "bench", str(original), str(optimized), "--batch",
                           str(batch), "--time-budget", str(budget), "--sessions", "2", "-q", "--json", str(report)],
                          capture_output=True, text=True)
    try:
        models = json.loads(report.read_text())["result"]["models"]
        ms = [m["latency_ms"]["median_ms"] for m in models]
    except (OSError, ValueError, KeyError, TypeError):
        return {"exit": proc.returncode, "message": (proc.stdout + proc.stderr)[-400:]}
    return {"exit": proc.returncode, "ms": ms, "speedup": ms[0] / ms[1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="efficientnet_b0", help="a zoo model (benchmarks/zoo.py SPECS)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--hogs", default="0,16", help="comma list: busy processes beside the timing (0: alone)")
    ap.add_argument("--time-budget", type=float, default=1.0, help="seconds of timed runs per model and session")
    ap.add_argument("--out", type=Path, default=Path("contention"))
    args = ap.parse_args(argv)
    models = args.out / "models"
    models.mkdir(parents=True, exist_ok=True)
    spec = zoo.SPECS[args.model]
    original, optimized = models / f"{args.model}.onnx", models / f"{args.model}.opt.onnx"
    zoo.export(spec, zoo.build_module(spec), original, 14)
    done = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(original), str(optimized), "--no-bench",
                           "--force", "-q"], capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout + done.stderr)
        return done.returncode
    record = {"model": args.model, "cells": []}
    for hogs in [int(h) for h in args.hogs.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            with spinning(hogs):
                cell = bench(original, optimized, batch, args.time_budget, args.out / f"bench-b{batch}-h{hogs}.json")
            cell.update(batch=batch, hogs=hogs)
            record["cells"].append(cell)
            print(json.dumps(cell), flush=True)
            (args.out / "contention.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
