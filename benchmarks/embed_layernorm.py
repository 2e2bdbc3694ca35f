#!/usr/bin/env python3
"""Does contrib-embed-layernorm pay? BERT-base's embeddings alone, decomposed against EmbedLayerNormalization.

The model is ``LayerNorm(W[ids] + T[0] + P[arange(S)])`` with BERT-base's sizes (V 30522, H 768, S 128,
512 positions, 2 token types; token type 0 for every token as transformers 5 exports it), float32.
The optimized form is what ``contrib-embed-layernorm`` writes from it (the rule is applied here, not
hand-written). Both are timed interleaved under ORT_ENABLE_ALL with IOBinding at batch 1 and 16, after
checking that they give the same output.

Usage (repo root, onnxruntime-gpu importable)::

    python benchmarks/embed_layernorm.py --out /tmp/embed [--time-budget 0.3] [--batches 1,16]

Writes ``embed_layernorm.json`` under ``--out``. Never imported by the package.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from micro import parse_args, write_results  # noqa: E402

from onnxfuse.model_io import to_graph, to_model  # noqa: E402
from onnxfuse.rewrites import apply_rules, select_rules  # noqa: E402
from onnxfuse.runtime.inputs import Inputs  # noqa: E402
from onnxfuse.runtime.session import run_model  # noqa: E402
from onnxfuse.timing import BenchConfig, time_models  # noqa: E402

V, H, S, P = 30522, 768, 128, 512


def embeddings() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((V, H)) * 0.02).astype(np.float32), "W"),
             numpy_helper.from_array((rng.standard_normal((P, H)) * 0.02).astype(np.float32), "Pt"),
             numpy_helper.from_array((rng.standard_normal((2, H)) * 0.02).astype(np.float32), "Tt"),
             numpy_helper.from_array(np.ones(H, np.float32), "gamma"),
             numpy_helper.from_array(np.zeros(H, np.float32), "beta"),
             numpy_helper.from_array(np.zeros((1, S), np.int64), "types"),
             numpy_helper.from_array(np.arange(S, dtype=np.int64)[None], "positions")]
    nodes = [helper.make_node("Gather", ["W", "ids"], ["w"]), helper.make_node("Gather", ["Tt", "types"], ["t"]),
             helper.make_node("Gather", ["Pt", "positions"], ["p"]), helper.make_node("Add", ["w", "t"], ["wt"]),
             helper.make_node("Add", ["wt", "p"], ["x"]),
             helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-12)]
    graph = helper.make_graph(nodes, "embeddings", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", S])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", S, H])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def main(argv=None) -> int:
    args, out, batches = parse_args(__doc__, time_budget=0.3, argv=argv)
    original = embeddings()
    graph = to_graph(onnx.ModelProto.FromString(original.SerializeToString()))
    report = apply_rules(graph, select_rules("cuda", only=["contrib-embed-layernorm"]))
    fused = to_model(graph, original)
    assert report.counts["contrib-embed-layernorm"] == 1, report.refusals
    rows = []
    for batch in batches:
        feeds = Inputs(feeds={"ids": np.random.default_rng(batch).integers(0, V, (batch, S)).astype(np.int64)})
        a = run_model(original, feeds, args.device, name="decomposed")["y"]
        b = run_model(fused, feeds, args.device, name="EmbedLayerNormalization")["y"]
        cfg = BenchConfig(device=args.device, warmup=10, time_budget_s=args.time_budget, min_iterations=20, sessions=2)
        results = time_models([("decomposed", original, feeds), ("EmbedLayerNormalization", fused, feeds)], cfg,
                              rounds=3)
        row = {"batch": batch, "max_abs_difference": float(np.max(np.abs(a - b))),
               "median_ms": {r.name: r.stats.median_ms for r in results}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_results(out, "embed_layernorm", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
