#!/usr/bin/env python3
"""How long `onnxfuse optimize` itself takes on a ViT-B/16-size model (346 MB of float32 weights).

    python benchmarks/optimizer_vit.py [--model /tmp/vit346.onnx] [--repeats 3] [--out results.json]

Exports ``ViTBlocks(image=224, patch=16, dim=768, heads=12, mlp=3072, layers=12, classes=1000)`` from
``testdata/export_fusion_models.py`` (needs torch; random seeded weights, legacy exporter, opset 14,
dynamic batch) unless ``--model`` already exists, then runs ``onnxfuse.optimize`` on the CPU without
timing on a GPU (``bench=False``) ``--repeats`` times and reports the best and median rewrite,
validation and total seconds. Used to show a refactor leaves the optimizer no slower: run it on the
commit before and after, on the same machine, and compare. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export(path: Path) -> None:
    sys.path.insert(0, str(ROOT / "testdata"))
    import torch
    from export_fusion_models import ViTBlocks

    torch.manual_seed(0)
    model = ViTBlocks(image=224, patch=16, dim=768, heads=12, mlp=3072, layers=12, classes=1000).eval()
    x = torch.randn(1, 3, 224, 224)
    torch.onnx.export(model, (x,), str(path), opset_version=14, dynamo=False, input_names=["input"],
                      output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/vit346.onnx")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    path = Path(args.model)
    if not path.exists():
        export(path)
    import onnxfuse

    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        result = onnxfuse.optimize(str(path), bench=False, provider="cpu")
        total = time.perf_counter() - t0
        runs.append({"rewrite_s": result.rewrite_seconds, "total_s": total,
                     "nodes": [result.nodes_before, result.nodes_after]})
        print(f"rewrite {result.rewrite_seconds:.2f} s, total {total:.2f} s, "
              f"nodes {result.nodes_before} -> {result.nodes_after}", flush=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    summary = {
        "commit": commit, "machine": platform.node(), "model_bytes": path.stat().st_size,
        "rewrite_s": {"best": min(r["rewrite_s"] for r in runs),
                      "median": statistics.median(r["rewrite_s"] for r in runs)},
        "total_s": {"best": min(r["total_s"] for r in runs),
                    "median": statistics.median(r["total_s"] for r in runs)},
        "runs": runs,
    }
    print(json.dumps({k: summary[k] for k in ("commit", "rewrite_s", "total_s")}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
