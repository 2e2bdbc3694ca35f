#!/usr/bin/env python3
"""Leave-one-rule-out timing: which rewrite makes a zoo model faster or slower on the GPU.

For one model of ``benchmarks/zoo.py`` (fp32 or fp16), optimize with every rule, then with each rule
that applied left out, and time all variants against the original in one interleaved run
(ORT_ENABLE_ALL, IOBinding). A rule whose removal makes the model *faster* is costing time.

Usage (repo root, on the GPU machine)::

    python benchmarks/ablate.py --model bert_base --fp16 --batch 16 --out /tmp/ablate
    python benchmarks/ablate.py --model qwen2_0_5b --exporter dynamo --dynamic-seq --fp16 \
        --leave-out contrib-attention --out /tmp/ablate     # only that rule left out
    python benchmarks/ablate.py --model qwen2_0_5b --exporter dynamo --precision-fp16 ...  # --precision fp16

Never imported by the package.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import zoo  # noqa: E402

from onnxfuse.timing import BenchConfig, time_models  # noqa: E402
from onnxfuse.pipeline import rewrite_model  # noqa: E402
from onnxfuse.rewrites import select_rules  # noqa: E402
from onnxfuse.runtime.inputs import Inputs  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=sorted(zoo.SPECS))
    ap.add_argument("--fp16", action="store_true", help="the module's float16 export (.half())")
    ap.add_argument("--precision-fp16", action="store_true",
                    help="the float32 export converted as `optimize --precision fp16` does, then the rules")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--opset", type=int, default=None, help="default: 14 (legacy), 18 (dynamo)")
    ap.add_argument("--exporter", choices=["legacy", "dynamo"], default="legacy")
    ap.add_argument("--dynamic-seq", action="store_true", help="token models with a dynamic sequence axis")
    ap.add_argument("--leave-out", default="", help="comma list of rules to leave out one at a time "
                    "(default: every rule that applied)")
    ap.add_argument("--time-budget", type=float, default=0.5)
    ap.add_argument("--sessions", type=int, default=1, help="fresh sessions per variant, samples pooled")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: only to check the script")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = zoo.SPECS[args.model]
    module = zoo.build_module(spec, exporter=args.exporter)
    if args.fp16:
        module = zoo.HalfIO(module)
    path = out / f"{args.model}{'.fp16' if args.fp16 else ''}.onnx"
    opset = args.opset or (18 if args.exporter == "dynamo" else 14)
    zoo.export(spec, module, path, opset, device="cuda" if args.fp16 and args.device == "cuda" else "cpu",
               dynamic_seq=args.dynamic_seq, exporter=args.exporter)
    original = onnx.load(str(path))
    start = original
    if args.precision_fp16:
        from onnxfuse.precision import convert_to_fp16

        start, _ = convert_to_fp16(original)
    rules = select_rules("cuda")
    full, report = rewrite_model(start, rules)
    wanted = set(filter(None, args.leave_out.split(",")))
    applied = [r for r in rules if report.counts.get(r.name) and (not wanted or r.name in wanted)]
    variants = [("original", original), ("all rules", full)]
    for rule in applied:
        model, _ = rewrite_model(start, [r for r in rules if r is not rule])
        variants.append((f"without {rule.name}", model))
    feeds = spec.feeds(args.batch)
    inputs = Inputs(feeds=feeds)
    config = BenchConfig(device=args.device, time_budget_s=args.time_budget, warmup=10, sessions=args.sessions)
    results = time_models([(name, m, inputs) for name, m in variants], config, rounds=3)
    base = results[0].stats.median_ms
    label = "fp16" if args.fp16 else "precision-fp16" if args.precision_fp16 else "fp32"
    lines = [f"## {args.model} {label} batch {args.batch}: leave-one-rule-out",
             "", "| variant | nodes | median ms | speed-up vs original |", "|---|---:|---:|---:|"]
    rows = []
    for (name, m), r in zip(variants, results):
        rows.append({"variant": name, "nodes": len(m.graph.node), "median_ms": r.stats.median_ms})
        lines.append(f"| {name} | {len(m.graph.node)} | {r.stats.median_ms:.3f} | {base / r.stats.median_ms:.2f}× |")
    text = "\n".join(lines)
    print(text, flush=True)
    (out / f"ablate-{args.model}-{label}.md").write_text(text + "\n")
    (out / f"ablate-{args.model}-{label}.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
