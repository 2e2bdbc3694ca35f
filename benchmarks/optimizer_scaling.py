#!/usr/bin/env python3
"""How `onnxfuse optimize` scales with graph size: chains of N elementwise nodes (Relu, Neg, Abs,
Sigmoid, Tanh repeating) on a [1, 64] input, fused into one FusedElementwise region. Runs on the CPU.

    python benchmarks/optimizer_scaling.py --sizes 2500,5000,10000,20000 [--out results.json]

For each size: the rewrite time (`OptimizeResult.rewrite_seconds`), the total time with CPU
validation, and the node count after. Results: docs/benchmarks.md, "Optimizer scaling".
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import onnx
from onnx import TensorProto, helper

OPS = ["Relu", "Neg", "Abs", "Sigmoid", "Tanh"]


def chain(n: int) -> onnx.ModelProto:
    nodes, prev = [], "x"
    for i in range(n):
        nodes.append(helper.make_node(OPS[i % len(OPS)], [prev], [f"t{i}"], name=f"n{i}"))
        prev = f"t{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2500,5000,10000,20000")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import onnxfuse

    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        model = chain(n)
        t0 = time.perf_counter()
        result = onnxfuse.optimize(model)
        total = time.perf_counter() - t0
        row = {"nodes": n, "rewrite_s": round(result.rewrite_seconds, 2), "total_s": round(total, 2),
               "nodes_after": len(result.model.graph.node), "validated": result.validation.passed}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": platform.platform(), "python": platform.python_version(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
