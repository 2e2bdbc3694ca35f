"""Probe (issue 34, next step after FusedConcat; run from the repository root on the GPU machine with $OUT
set): would splitting a C2f block's first 1x1 Conv by its two output halves make the YOLO-style detector
faster under onnxfuse?

Why: with FusedConcat (docs/benchmarks.md 5.65) a C2f block's Concat still copies the block's first part,
cv1's output (2c channels): the bottlenecks read its second half through a Slice and feed the same Concat,
so absorbing that FusedElementwise would make a cycle. If cv1 were two convolutions of c output channels
each, the first half would be read by the Concat alone (absorbed: written straight into its slice), the
second half would need no Slice, and only c channels would be copied instead of 2c, for one more
convolution launch with half the output channels each. This probe measures that before any rule is written:
it builds the zoo's detector twice with the same weights, once as exported today and once with each C2f's
cv1 (Conv, BatchNorm, SiLU) replaced by two of them holding the halves of its weights and statistics
(exactly the same values: a per-channel op split by channels), exports both, optimizes both as a user
would (channels-last and its transpose, the layout the measured choices keep here), and times the original
and both outputs interleaved in one process, float32 and ``--precision fp16``, at each batch.

    OUT=/tmp/o python3 benchmarks/probes/c2f_split_conv.py [--batches 1,16] [--budget 0.4]

Results in $OUT/c2f/c2f.log and c2f.json. An exploration tool, never imported by the package.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, "benchmarks")

LAYOUT = "+contrib-channels-last,+contrib-channel-transpose"


def split_c2f(module):
    """``module`` with every C2f block's cv1 split into cv1a and cv1b (the halves of its output channels),
    in place; returns how many blocks changed."""
    import torch

    def forward(self, x):
        y = [self.cv1a(x), self.cv1b(x)]
        for m in self.m:
            y.append(m(y[-1]))
        return self.cv2(torch.cat(y, 1))

    changed = 0
    for block in module.modules():
        if type(block).__name__ != "C2f":
            continue
        cv1, c = block.cv1, block.c
        halves = []
        for part in (slice(0, c), slice(c, 2 * c)):
            half = type(cv1)(cv1.conv.in_channels, c, cv1.conv.kernel_size[0], cv1.conv.stride[0])
            with torch.no_grad():
                half.conv.weight.copy_(cv1.conv.weight[part])
                for name in ("weight", "bias", "running_mean", "running_var"):
                    getattr(half.bn, name).copy_(getattr(cv1.bn, name)[part])
            half.bn.eps = cv1.bn.eps
            halves.append(half.eval())
        block.cv1a, block.cv1b = halves
        del block.cv1
        block.forward = types.MethodType(forward, block)
        changed += 1
    return changed


def main() -> int:
    import numpy as np
    import onnx
    import torch

    import onnxfuse
    import zoo
    from onnxfuse.runtime.inputs import Inputs
    from onnxfuse.timing import BenchConfig, time_models

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds of timed runs per model and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cpu: export and optimize only (a smoke test)")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "/tmp")) / "c2f"
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}

    def log(*a):
        print(*a, flush=True)
        with open(out / "c2f.log", "a") as f:
            print(*a, file=f)

    spec = zoo.SPECS["yolo_silu"]
    base, split = zoo.build_module(spec), zoo.build_module(spec)
    results["blocks_split"] = split_c2f(split)
    x = spec.example(2)[0]
    with torch.no_grad():
        drift = float((base(x) - split(x)).abs().max())
    log(f"C2f blocks split: {results['blocks_split']}; torch max abs difference {drift:.3g}")
    results["torch_max_abs"] = drift
    models = {}
    for label, module in (("base", base), ("split", split)):
        path = out / f"yolo_{label}.onnx"
        zoo.export(spec, module, path, 14)
        models[label] = onnx.load(str(path))
    provider = "cuda" if args.device == "cuda" else "cpu"
    for precision in ("fp32", "fp16"):
        t0 = time.time()
        made = {}
        for label, model in models.items():
            r = onnxfuse.optimize(model, only=LAYOUT if provider == "cuda" else None, bench=False, provider=provider,
                                  precision=precision)
            ops = [n.op_type for n in r.model.graph.node]
            made[label] = r.model
            row = {"validation": r.validation.passed if r.validation else None, "nodes": len(ops),
                   **{o: ops.count(o) for o in ("Conv", "NhwcConv", "Concat", "FusedConcat", "FusedElementwise",
                                                "Slice")}}
            results.setdefault(precision, {})[label] = row
            log(f"{precision} {label}: {row}")
        if args.device != "cuda":
            continue
        for batch in [int(b) for b in args.batches.split(",")]:
            feeds = spec.feeds(batch)
            rows = []
            for rnd in range(args.rounds):
                res = time_models([(k, m, Inputs(feeds=feeds, seed=0, source="probe"))
                                   for k, m in [("original", models["base"]), *made.items()]],
                                  BenchConfig(device="cuda", warmup=10, time_budget_s=args.budget, min_iterations=20),
                                  rounds=3)
                rows.append({k: round(v.stats.median_ms, 3) for k, v in zip(("original", *made), res)})
                log(f"  {precision} b{batch} round {rnd}: {rows[-1]}")
            results[precision][f"b{batch}"] = rows
        log(f"  {precision}: {time.time() - t0:.0f} s")
    (out / "c2f.json").write_text(json.dumps(results, indent=1, default=lambda v: v if np.isscalar(v) else str(v)))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
