#!/usr/bin/env python3
"""Which ONNX Runtime attention op should contrib-attention emit? One BERT-base self-attention layer.

Issue 15 asks to choose between com.microsoft ``MultiHeadAttention`` and the packed ``Attention`` op by
measurement. This builds one encoder self-attention layer (E = 768, H = 12, S = 128, a padding mask
with the last eighth of each row's keys masked for odd batch items), in float32 and float16, as:

* ``original``: the decomposed graph exporters write (three MatMul + bias projections, Reshape and
  Transpose into heads, QKᵀ, ÷√D, + (1 - mask)·-10000, Softmax, ×V, merge);
* ``onnxfuse``: ``original`` rewritten by the default rules (what we emit now: packed ``Attention``
  with the projections inside and the mask as an expanded [B,1,S,L] ``attention_bias``, input 5);
* ``mha-key-mask``: MultiHeadAttention on the same projections with the mask as ``key_padding_mask``
  ([B, L] int32) instead of an additive bias;
* ``mha-no-mask``: MultiHeadAttention without any mask (the ViT/Whisper case; output differs from
  the masked ones, so it is timed but not compared);
* ``attention-packed``: ``Attention(x, W[E,3E], b[3E], mask_index[B,L])``, the op ONNX Runtime's
  transformers optimizer writes (projections inside the op);
* ``mha-packed-qkv``: one [E,3E] MatMul + bias, Reshape to [B,S,H,3,D], MultiHeadAttention's packed
  query with ``key_padding_mask``.

Every masked variant is checked against ``original`` on the GPU first (float32: 1e-3, float16: 1e-2),
then all are timed interleaved under ORT_ENABLE_ALL with IOBinding.

Usage (repo root, onnxruntime-gpu importable)::

    python benchmarks/attention_ops.py --out /tmp/attention [--time-budget 0.4] [--batches 1,16]

Writes ``attention_ops.json`` and ``attention_ops.md`` under ``--out``. Never imported by the package.
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

from onnxfuse.pipeline import rewrite_model  # noqa: E402
from onnxfuse.rewrites import select_rules  # noqa: E402
from onnxfuse.runtime.inputs import Inputs  # noqa: E402
from onnxfuse.runtime.session import run_model  # noqa: E402
from onnxfuse.timing import BenchConfig, time_models  # noqa: E402

E, H, S = 768, 12, 128
D = E // H
MS = "com.microsoft"


def _weights(dtype):
    rng = np.random.default_rng(0)
    w = [(rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype) for _ in range(3)]
    b = [(rng.standard_normal(E) * 0.1).astype(dtype) for _ in range(3)]
    return w, b


def _model(nodes, inits, inputs, elem, name):
    out = helper.make_tensor_value_info("out", elem, ["B", S, E])
    graph = helper.make_graph(nodes, name, inputs, [out], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def _x(elem):
    return helper.make_tensor_value_info("x", elem, ["B", S, E])


def _mask_input():
    return helper.make_tensor_value_info("mask", TensorProto.INT64, ["B", S])


def original(dtype) -> object:
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    w, b = _weights(dtype)
    inits = [numpy_helper.from_array(a, n) for a, n in zip(w + b, ["wq", "wk", "wv", "bq", "bk", "bv"])]
    inits += [numpy_helper.from_array(np.array([0, 0, H, D], np.int64), "heads"),
              numpy_helper.from_array(np.array([0, 0, E], np.int64), "merge"),
              numpy_helper.from_array(np.array(np.sqrt(D), dtype), "sqrt_d"),
              numpy_helper.from_array(np.array(1.0, dtype), "one"),
              numpy_helper.from_array(np.array(-10000.0, dtype), "neg"),
              numpy_helper.from_array(np.array([1, 2], np.int64), "axes12")]
    nodes = []
    for t in "qkv":
        nodes += [helper.make_node("MatMul", ["x", f"w{t}"], [f"{t}0"]),
                  helper.make_node("Add", [f"{t}0", f"b{t}"], [f"{t}1"]),
                  helper.make_node("Reshape", [f"{t}1", "heads"], [f"{t}2"])]
    nodes += [helper.make_node("Transpose", ["q2"], ["qh"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["k2"], ["kt"], perm=[0, 2, 3, 1]),
              helper.make_node("Transpose", ["v2"], ["vh"], perm=[0, 2, 1, 3]),
              helper.make_node("MatMul", ["qh", "kt"], ["s0"]),
              helper.make_node("Div", ["s0", "sqrt_d"], ["s1"]),
              helper.make_node("Cast", ["mask"], ["mf"], to=elem),
              helper.make_node("Sub", ["one", "mf"], ["mi"]),
              helper.make_node("Mul", ["mi", "neg"], ["mb"]),
              helper.make_node("Unsqueeze", ["mb", "axes12"], ["m4"]),
              helper.make_node("Add", ["s1", "m4"], ["s2"]),
              helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vh"], ["o0"]),
              helper.make_node("Transpose", ["o0"], ["o1"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["o1", "merge"], ["out"])]
    return _model(nodes, inits, [_x(elem), _mask_input()], elem, "attention-original")


def _separate_projections(dtype, bias_in_op: bool):
    w, b = _weights(dtype)
    inits = [numpy_helper.from_array(a, n) for a, n in zip(w, ["wq", "wk", "wv"])]
    nodes = [helper.make_node("MatMul", ["x", f"w{t}"], [t]) for t in "qkv"]
    inits.append(numpy_helper.from_array(np.concatenate(b), "bqkv"))
    return nodes, inits


def _key_mask_nodes():
    return [helper.make_node("Cast", ["mask"], ["mask32"], to=TensorProto.INT32)]


def mha_key_mask(dtype, masked: bool = True):
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    nodes, inits = _separate_projections(dtype, True)
    inputs = [_x(elem)]
    mha_in = ["q", "k", "v", "bqkv"]
    if masked:
        nodes += _key_mask_nodes()
        mha_in.append("mask32")
        inputs.append(_mask_input())
    nodes.append(helper.make_node("MultiHeadAttention", mha_in, ["out"], domain=MS, num_heads=H))
    return _model(nodes, inits, inputs, elem, "mha")


def attention_packed(dtype):
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    w, b = _weights(dtype)
    inits = [numpy_helper.from_array(np.concatenate(w, axis=1), "wqkv"),
             numpy_helper.from_array(np.concatenate(b), "bqkv")]
    nodes = _key_mask_nodes() + [helper.make_node("Attention", ["x", "wqkv", "bqkv", "mask32"], ["out"],
                                                  domain=MS, num_heads=H)]
    return _model(nodes, inits, [_x(elem), _mask_input()], elem, "attention-packed")


def mha_packed_qkv(dtype):
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    w, b = _weights(dtype)
    # Packed query [B, S, H, 3, D]: column block (h, t, d) of the packed weight is column t·E + h·D + d.
    wp = np.stack([wt.reshape(E, H, D) for wt in w], axis=2).reshape(E, 3 * E)
    bp = np.stack([bt.reshape(H, D) for bt in b], axis=1).reshape(3 * E)
    inits = [numpy_helper.from_array(wp, "wqkv"), numpy_helper.from_array(bp, "bqkv"),
             numpy_helper.from_array(np.array([0, 0, H, 3, D], np.int64), "packed")]
    nodes = [helper.make_node("MatMul", ["x", "wqkv"], ["p0"]),
             helper.make_node("Add", ["p0", "bqkv"], ["p1"]),
             helper.make_node("Reshape", ["p1", "packed"], ["p2"])] + _key_mask_nodes()
    nodes.append(helper.make_node("MultiHeadAttention", ["p2", "", "", "", "mask32"], ["out"], domain=MS,
                                  num_heads=H))
    return _model(nodes, inits, [_x(elem), _mask_input()], elem, "mha-packed-qkv")


def feeds(batch: int, dtype, masked: bool = True) -> dict:
    rng = np.random.default_rng(batch)
    mask = np.ones((batch, S), np.int64)
    mask[1::2, S - S // 8:] = 0
    f = {"x": rng.standard_normal((batch, S, E)).astype(dtype)}
    if masked:
        f["mask"] = mask
    return f


def variants(dtype) -> list[tuple[str, object, bool]]:
    orig = original(dtype)
    fused, report = rewrite_model(orig, select_rules("cuda"))
    ops = [n.op_type for n in fused.graph.node]
    assert {"Attention", "MultiHeadAttention"} & set(ops), f"contrib-attention did not fire: {ops}"
    return [("original", orig, True), ("onnxfuse", fused, True), ("mha-key-mask", mha_key_mask(dtype), True),
            ("mha-no-mask", mha_key_mask(dtype, masked=False), False),
            ("attention-packed", attention_packed(dtype), True), ("mha-packed-qkv", mha_packed_qkv(dtype), True)]


def main(argv=None) -> int:
    args, out, batches = parse_args(__doc__, time_budget=0.4, argv=argv)
    rows = []
    for dtype, tol in ((np.float32, 1e-3), (np.float16, 1e-2)):
        vs = variants(dtype)
        for batch in batches:
            ref = run_model(vs[0][1], Inputs(feeds=feeds(batch, dtype)), args.device, name="original")["out"]
            checks = {}
            for label, model, masked in vs[1:]:
                try:
                    got = run_model(model, Inputs(feeds=feeds(batch, dtype, masked)), args.device, name=label)["out"]
                    err = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64))))
                    checks[label] = {"max_abs": err, "ok": bool(err <= tol) if masked else None}
                except Exception as exc:  # an op/kernel this ONNX Runtime cannot run: recorded
                    checks[label] = {"error": " ".join(str(exc).split())[:300]}
            runnable = [(label, m, Inputs(feeds=feeds(batch, dtype, masked))) for label, m, masked in vs
                        if "error" not in checks.get(label, {})]
            cfg = BenchConfig(device=args.device, warmup=5, time_budget_s=args.time_budget, min_iterations=10)
            results = time_models(runnable, cfg, rounds=3)
            times = {label: r.stats.median_ms for (label, _, _), r in zip(runnable, results)}
            row = {"dtype": np.dtype(dtype).name, "batch": batch, "median_ms": times, "checks": checks}
            rows.append(row)
            print(json.dumps(row), flush=True)
    labels = ["original", "onnxfuse", "mha-key-mask", "mha-no-mask", "attention-packed", "mha-packed-qkv"]
    md = ["| dtype | batch | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for r in rows:
        cells = []
        for label in labels:
            t = r["median_ms"].get(label)
            c = r["checks"].get(label, {})
            mark = "" if c.get("ok", True) in (True, None) else " (WRONG)"
            cells.append("error" if t is None else f"{t:.3f}{mark}")
        md.append(f"| {r['dtype']} | {r['batch']} | " + " | ".join(cells) + " |")
    write_results(out, "attention_ops", rows, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
