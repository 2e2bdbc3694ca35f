#!/usr/bin/env python3
"""Does fusing a Llama-style attention core pay? Rotated heads and grouped keys/values (GQA).

Llama, Qwen2 and Mistral exports (either torch exporter) rotate the query and key heads after the head
split (rotary embedding, elementwise on [B, H, S, D]) and repeat each key/value head n = H / H_kv times
(``repeat_kv``: Unsqueeze, Expand, Reshape) before ``softmax(s·QKᵀ + M)·V``. contrib-attention's packed
forms need Q, K and V as projections cut into heads, which these are not. ONNX Runtime's
``MultiHeadAttention`` also takes key and value as [B, H, L, D] heads (its "past key" layout) with a
query [B, S, E]; this times, on the heads as the graph has them (inputs q [B, H, S, D], k and v
[B, H_kv, L, D], an additive causal-and-padding mask [B, 1, S, L] of 0 / the dtype's lowest value):

* ``decomposed``: what the export leaves after onnxfuse today: repeat_kv on k and v,
  ``FusedMatMul(q, k, transB=1, alpha=s)``, ``+ M``, Softmax, MatMul, Transpose, Reshape to [B, S, E];
* ``mha-bnsh``: ``MultiHeadAttention(Reshape(Transpose(q)), repeat_kv(k), repeat_kv(v), attention_bias=M)``;
* ``mha-bsd``: the same with key and value also transposed back to [B, L, E] (the op's usual layout).

Shapes: Llama-3-8B's attention (H 32, H_kv 8, D 128) and Qwen2-0.5B's (H 14, H_kv 2, D 64), sequence
128 and 512, float32 and float16. Each variant is checked against ``decomposed`` on the device first
(float32 1e-3, float16 1e-2), then all are timed interleaved (IOBinding, ORT_ENABLE_ALL).

Usage (repo root, onnxruntime-gpu importable)::

    python benchmarks/gqa_attention.py --out /tmp/gqa [--time-budget 0.3] [--batches 1,8]

Writes ``gqa_attention.json`` and ``gqa_attention.md`` under ``--out``. Never imported by the package.
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

MS = "com.microsoft"
SHAPES = [("llama3-8b", 32, 8, 128), ("qwen2-0.5b", 14, 2, 64)]
SEQS = [128, 512]
VARIANTS = ["decomposed", "mha-bnsh", "mha-bsd"]


def _const(inits, name, value):
    inits.append(numpy_helper.from_array(np.asarray(value), name))
    return name


def _repeat_kv(nodes, inits, name, heads, kv_heads, size):
    """[B, H_kv, L, D] → [B, H, L, D], each head repeated H / H_kv times (transformers' repeat_kv)."""
    rep = heads // kv_heads
    nodes += [helper.make_node("Unsqueeze", [name, _const(inits, f"{name}_ax", np.array([2], np.int64))], [f"{name}_u"]),
              helper.make_node("Expand", [f"{name}_u", _const(inits, f"{name}_rep", np.array([1, 1, rep, 1, 1], np.int64))],
                               [f"{name}_e"]),
              helper.make_node("Reshape", [f"{name}_e", _const(inits, f"{name}_t", np.array([0, heads, -1, size], np.int64))],
                               [f"{name}_r"])]
    return f"{name}_r"


def _to_bsd(nodes, inits, name, hidden):
    nodes += [helper.make_node("Transpose", [name], [f"{name}_t"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", [f"{name}_t", _const(inits, f"{name}_e", np.array([0, 0, hidden], np.int64))],
                               [f"{name}_bsd"])]
    return f"{name}_bsd"


def build(variant: str, heads: int, kv_heads: int, size: int, seq: int, elem: int):
    nodes, inits = [], []
    hidden = heads * size
    k, v = (_repeat_kv(nodes, inits, t, heads, kv_heads, size) for t in ("k", "v"))
    scale = float(size) ** -0.5
    if variant == "decomposed":
        nodes += [helper.make_node("FusedMatMul", ["q", k], ["s"], domain=MS, transB=1, alpha=scale),
                  helper.make_node("Add", ["s", "m"], ["sm"]),
                  helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
                  helper.make_node("MatMul", ["p", v], ["o"])]
        nodes.append(helper.make_node("Identity", [_to_bsd(nodes, inits, "o", hidden)], ["out"]))
    else:
        q = _to_bsd(nodes, inits, "q", hidden)
        if variant == "mha-bsd":
            k, v = _to_bsd(nodes, inits, k, hidden), _to_bsd(nodes, inits, v, hidden)
        nodes.append(helper.make_node("MultiHeadAttention", [q, k, v, "", "", "m"], ["out"], domain=MS,
                                      num_heads=heads, scale=scale))
    inputs = [helper.make_tensor_value_info("q", elem, ["B", heads, seq, size]),
              helper.make_tensor_value_info("k", elem, ["B", kv_heads, seq, size]),
              helper.make_tensor_value_info("v", elem, ["B", kv_heads, seq, size]),
              helper.make_tensor_value_info("m", elem, ["B", 1, seq, seq])]
    graph = helper.make_graph(nodes, variant, inputs, [helper.make_tensor_value_info("out", elem, ["B", seq, hidden])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def feeds(batch, heads, kv_heads, size, seq, dtype) -> dict:
    """Random heads; a causal mask with the first seq/8 keys of odd rows padded (left padding)."""
    rng = np.random.default_rng(batch * seq)
    keep = np.tril(np.ones((seq, seq), bool))[None, None].repeat(batch, 0)
    keep[1::2, :, :, : seq // 8] = False
    keep[:, :, np.arange(seq), np.arange(seq)] = True  # no row entirely masked (its value would be export-specific)
    lowest = np.finfo(dtype).min
    return {"q": rng.standard_normal((batch, heads, seq, size)).astype(dtype),
            "k": rng.standard_normal((batch, kv_heads, seq, size)).astype(dtype),
            "v": rng.standard_normal((batch, kv_heads, seq, size)).astype(dtype),
            "m": np.where(keep, 0, lowest).astype(dtype)}


def main(argv=None) -> int:
    args, out, batches = parse_args(__doc__, time_budget=0.3, argv=argv)
    rows = []
    for dtype, elem, tol in ((np.float32, TensorProto.FLOAT, 1e-3), (np.float16, TensorProto.FLOAT16, 1e-2)):
        for label, heads, kv_heads, size in SHAPES:
            for seq in SEQS:
                models = {v: build(v, heads, kv_heads, size, seq, elem) for v in VARIANTS}
                for batch in batches:
                    f = feeds(batch, heads, kv_heads, size, seq, dtype)
                    ref = run_model(models["decomposed"], Inputs(feeds=f), args.device, name="decomposed")["out"]
                    checks = {}
                    for v in VARIANTS[1:]:
                        try:
                            got = run_model(models[v], Inputs(feeds=f), args.device, name=v)["out"]
                            err = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
                            checks[v] = {"max_abs": err, "ok": bool(err <= tol)}
                        except Exception as exc:  # a layout this ONNX Runtime cannot run: recorded
                            checks[v] = {"error": " ".join(str(exc).split())[:300]}
                    runnable = [(v, models[v], Inputs(feeds=f)) for v in VARIANTS if "error" not in checks.get(v, {})]
                    cfg = BenchConfig(device=args.device, warmup=5, time_budget_s=args.time_budget, min_iterations=10)
                    results = time_models(runnable, cfg, rounds=3)
                    row = {"dtype": np.dtype(dtype).name, "shape": label, "seq": seq, "batch": batch,
                           "median_ms": {v: r.stats.median_ms for (v, _, _), r in zip(runnable, results)},
                           "checks": checks}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    md = ["| dtype | shape | seq | batch | " + " | ".join(VARIANTS) + " |", "|---|---|---:|---:|" + "---:|" * len(VARIANTS)]
    for r in rows:
        cells = []
        for v in VARIANTS:
            t, c = r["median_ms"].get(v), r["checks"].get(v, {})
            cells.append("error" if t is None else f"{t:.3f}" + ("" if c.get("ok", True) else " (WRONG)"))
        md.append(f"| {r['dtype']} | {r['shape']} | {r['seq']} | {r['batch']} | " + " | ".join(cells) + " |")
    write_results(out, "gqa_attention", rows, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
