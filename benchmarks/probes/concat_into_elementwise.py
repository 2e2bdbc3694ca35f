"""Probe (issue 34; run from the repository root on the GPU machine with $OUT set): the zoo's YOLO-style
detector with and without concat-into-elementwise (FusedConcat: each FusedElementwise result written into
its slice of the Concat's output), both under contrib-channels-last and contrib-channel-transpose (the
layout the measured choices keep on this model, docs/benchmarks.md 5.61), against the original, float32
(``optimize``) and float16 (``optimize --precision fp16`` of the float32 export), timed interleaved in one
process at each batch; with TORCH=1 also torch.compile (mode default) of the module (``.half()`` for
float16). Results in $OUT/concat/concat.log and concat.json.

    OUT=/tmp/o TORCH=1 python3 benchmarks/probes/concat_into_elementwise.py [--batches 1,16] [--budget 0.4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import onnx  # noqa: E402

import onnxfuse  # noqa: E402
import zoo  # noqa: E402
from onnxfuse.runtime.inputs import Inputs  # noqa: E402
from onnxfuse.timing import BenchConfig, time_models  # noqa: E402

RULE = "concat-into-elementwise"
LAYOUT = "+contrib-channels-last,+contrib-channel-transpose"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds of timed runs per model and round")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    out = Path(os.environ["OUT"]) / "concat"
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}

    def log(*a):
        print(*a, flush=True)
        with open(out / "concat.log", "a") as f:
            print(*a, file=f)

    cfg = BenchConfig(device="cuda", warmup=10, time_budget_s=args.budget, min_iterations=20)
    spec = zoo.SPECS["yolo_silu"]
    batches = [int(b) for b in args.batches.split(",")]
    module = zoo.build_module(spec)
    path = Path("/tmp/yolo_concat_probe.onnx")
    zoo.export(spec, module, path, 14)
    original = onnx.load(str(path))
    for precision in ("fp32", "fp16"):
        t0 = time.time()
        made = {}
        for label, skip in (("without", RULE), ("with", None)):
            r = onnxfuse.optimize(original, only=LAYOUT, skip=skip, bench=False, provider="cuda", precision=precision)
            ops = [n.op_type for n in r.model.graph.node]
            made[label] = r.model
            row = {"validation": r.validation.passed if r.validation else None, "nodes": len(ops),
                   **{o: ops.count(o) for o in ("Concat", "FusedConcat", "FusedElementwise", "Slice")}}
            results.setdefault(precision, {})[label] = row
            log(f"{precision} {label}: {row}")
        for batch in batches:
            feeds = spec.feeds(batch)
            rows = []
            for rnd in range(args.rounds):
                res = time_models([(k, m, Inputs(feeds=feeds, seed=0, source="probe"))
                                   for k, m in [("original", original), *made.items()]], cfg, rounds=3)
                rows.append({k: round(x.stats.median_ms, 3) for k, x in zip(("original", *made), res)})
                log(f"  {precision} b{batch} round {rnd}: {rows[-1]}")
            results[precision][f"b{batch}"] = rows
        if os.environ.get("TORCH") == "1":
            import torch

            m = (zoo.build_module(spec).half() if precision == "fp16" else zoo.build_module(spec)).cuda().eval()
            fn = torch.compile(m, dynamic=False)
            for batch in batches:
                example = [x.half() if precision == "fp16" else x for x in spec.example(batch, "cuda")]
                with torch.inference_mode():
                    fn(*example)
                    torch.cuda.synchronize()
                r = zoo.time_torch(fn, example, 10, args.budget * 2, 20, "cuda")
                results[precision][f"torch_compile_b{batch}"] = round(r["latency_ms"]["median_ms"], 3)
                log(f"  {precision} torch.compile b{batch}: {r['latency_ms']['median_ms']:.3f} ms")
            m.cpu()
            torch.cuda.empty_cache()
        log(f"  {precision}: {time.time() - t0:.0f} s")
        (out / "concat.json").write_text(json.dumps(results, indent=1))
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
