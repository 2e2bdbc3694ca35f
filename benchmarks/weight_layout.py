#!/usr/bin/env python3
"""Does the layout of a constant weight matter to ONNX Runtime's CUDA MatMul? One projection of a BERT layer.

transformers 5.x exports ``nn.Linear`` as ``MatMul(x, Transpose(W))`` with W [N, K] as stored by torch.
ONNX Runtime folds that Transpose at session start (so the original model multiplies by a [K, N]
weight); ``contrib-fused-matmul-transpose`` would instead absorb it as ``FusedMatMul(x, W, transB=1)``,
which keeps W [N, K] and changes the GEMM's layout. This times both forms on x [B, 128, K] for the three
projection shapes of BERT-base outside its attention op (K, N) = (768, 768), (768, 3072), (3072, 768),
float32 and float16, batch 1 and 16, interleaved under ORT_ENABLE_ALL with IOBinding, and checks that
both give the same product.

Usage (repo root, onnxruntime-gpu importable)::

    python benchmarks/weight_layout.py --out /tmp/layout [--time-budget 0.3] [--batches 1,16]

Writes ``weight_layout.json`` and ``weight_layout.md`` under ``--out``. Never imported by the package.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from micro import parse_args, write_results  # noqa: E402

from onnxfuse.runtime.inputs import Inputs  # noqa: E402
from onnxfuse.runtime.session import run_model  # noqa: E402
from onnxfuse.timing import BenchConfig, time_models  # noqa: E402

S = 128
SHAPES = [(768, 768), (768, 3072), (3072, 768)]


def _model(k: int, n: int, dtype, transposed: bool):
    """x [B, S, K] times a constant weight: MatMul with W [K, N], or FusedMatMul(transB=1) with W [N, K]."""
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    w = (np.random.default_rng(k * 7 + n).standard_normal((k, n)) / np.sqrt(k)).astype(dtype)
    if transposed:
        init = numpy_helper.from_array(np.ascontiguousarray(w.T), "w")
        node = helper.make_node("FusedMatMul", ["x", "w"], ["y"], domain="com.microsoft", transB=1)
    else:
        init = numpy_helper.from_array(w, "w")
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph([node], "layout", [helper.make_tensor_value_info("x", elem, ["B", S, k])],
                              [helper.make_tensor_value_info("y", elem, ["B", S, n])], initializer=[init])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def main(argv=None) -> int:
    args, out, batches = parse_args(__doc__, time_budget=0.3, argv=argv)
    rows = []
    for dtype in (np.float32, np.float16):
        for k, n in SHAPES:
            plain, fused = _model(k, n, dtype, False), _model(k, n, dtype, True)
            for batch in batches:
                x = np.random.default_rng(batch).standard_normal((batch, S, k)).astype(dtype)
                feeds = Inputs(feeds={"x": x})
                a = run_model(plain, feeds, args.device, name="MatMul")["y"].astype(np.float64)
                b = run_model(fused, feeds, args.device, name="FusedMatMul")["y"].astype(np.float64)
                diff = float(np.max(np.abs(a - b)) / max(1e-30, float(np.max(np.abs(a)))))
                cfg = BenchConfig(device=args.device, warmup=10, time_budget_s=args.time_budget, min_iterations=20,
                                  sessions=2)
                results = time_models([("MatMul", plain, feeds), ("FusedMatMul-transB", fused, feeds)], cfg, rounds=3)
                row = {"dtype": np.dtype(dtype).name, "K": k, "N": n, "batch": batch, "relative_difference": diff,
                       "median_ms": {r.name: r.stats.median_ms for r in results}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    md = ["| dtype | K × N | batch | MatMul, W [K, N] | FusedMatMul transB, W [N, K] | ratio |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        t = r["median_ms"]
        md.append(f"| {r['dtype']} | {r['K']} × {r['N']} | {r['batch']} | {t['MatMul']:.4f} | "
                  f"{t['FusedMatMul-transB']:.4f} | {t['FusedMatMul-transB'] / t['MatMul']:.2f} |")
    write_results(out, "weight_layout", rows, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
