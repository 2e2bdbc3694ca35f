#!/usr/bin/env python3
"""Which fused op serves a KV-cache decoder's attention, and is it exact? GroupQueryAttention against
MultiHeadAttention and the decomposed graph, at prefill and decode.

A Llama/Qwen2-style export with ``past_key_values`` computes, per layer, from q [B, H, S, D] (rotated),
the new k, v [B, H_kv, S, D] (k rotated) and the cached past_k, past_v [B, H_kv, P, D]:
``present = Concat(past, new, axis=2)`` (a graph output), ``repeat_kv`` (H / H_kv copies of each head),
``softmax(s·QKᵀ + M)·V`` with M the additive causal-and-padding mask [B, 1, S, P + S], merged to
[B, S, E]. Variants, each producing the output and both presents:

* ``decomposed``: that graph as onnxfuse leaves it today (FusedMatMul for QKᵀ);
* ``mha``: Concat and repeat_kv kept, ``MultiHeadAttention(q [B, S, E], K, V [B, H, L, D],
  attention_bias=M)`` (what contrib-attention writes for given heads in float16);
* ``gqa-bias``: ``GroupQueryAttention(q, k, v [B, S, ·], past_k, past_v, seqlens_k = P + S - 1,
  total_sequence_length = P + S, attention_bias = M)`` with ``causal=0``: the mask as the graph has
  it, so exact for any mask the graph computes; its presents are the op's;
  (without ``query_seqlens``, which needs ``causal=1``, a batch above 1 with new tokens and a cache is
  refused, on the CPU at least);
* ``gqa-causal-bias``: ``causal=1`` and the bias, with ``query_seqlens`` = S for every entry where the
  running ONNX Runtime has that input (exact unless a row keeps no key at or before its own position);
* ``gqa-causal``: the same with ``causal=1`` and no bias (exact only for a causal mask with no padding).

Each variant is checked against a float64 NumPy reference on the device first (the padded rows of
batch entries with left padding included; float32 1e-3, float16 1e-2 absolute), then the runnable ones
are timed interleaved (IOBinding, ORT_ENABLE_ALL). GroupQueryAttention's inputs are placed by the names
the running ONNX Runtime's schema gives them (they moved between versions).

Usage (repo root, onnxruntime-gpu importable)::

    python benchmarks/gqa_kv_cache.py --out /tmp/gqa-kv [--time-budget 0.3]

Writes ``gqa_kv_cache.json`` and ``gqa_kv_cache.md`` under ``--out``. Never imported by the package.
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

from gqa_attention import _repeat_kv, _to_bsd  # noqa: E402  (the same graph pieces as the no-cache probe)
from micro import parse_args, write_results  # noqa: E402

from onnxfuse.runtime.inputs import Inputs  # noqa: E402
from onnxfuse.runtime.session import run_model  # noqa: E402
from onnxfuse.timing import BenchConfig, time_models  # noqa: E402

MS = "com.microsoft"
VARIANTS = ["decomposed", "mha", "gqa-bias", "gqa-causal-bias", "gqa-causal"]
#: (label, H, H_kv, D, [(batch, new tokens S, cached P, padded)]): small cases check semantics, the
#: Qwen2-0.5B-shaped ones (14 / 2 heads of 64) are the decode benchmark's shapes
CASES = [("tiny", 4, 2, 16, [(2, 3, 0, False), (2, 1, 5, False), (2, 3, 4, False), (2, 3, 4, True),
                             (2, 1, 5, True)]),
         ("qwen2-0.5b", 14, 2, 64, [(1, 1, 1024, False), (8, 1, 1024, False), (1, 1, 4096, False),
                                    (1, 512, 0, False), (8, 1, 1024, True)])]


def gqa_input_names() -> list[str]:
    """GroupQueryAttention's formal inputs in the running ONNX Runtime, in order."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    for s in C.get_all_operator_schema():
        if s.name == "GroupQueryAttention" and s.domain == MS:
            return [i.name for i in s.inputs]
    raise SystemExit("this onnxruntime has no com.microsoft GroupQueryAttention")


def build(variant, heads, kv_heads, size, elem):
    nodes, inits = [], []
    hidden, scale = heads * size, float(size) ** -0.5
    if variant.startswith("gqa"):
        inits += [numpy_helper.from_array(np.array([], np.int64), "scalar"),
                  numpy_helper.from_array(np.array([1], np.int32), "one")]
        q = _to_bsd(nodes, inits, "q", hidden)
        k = _to_bsd(nodes, inits, "k", kv_heads * size)
        v = _to_bsd(nodes, inits, "v", kv_heads * size)
        # seqlens_k = P + S - 1 and total = P + S, from the mask's last dimension (every key counted)
        nodes += [helper.make_node("Shape", ["m"], ["m_shape"], start=3, end=4),
                  helper.make_node("Cast", ["m_shape"], ["total_1"], to=TensorProto.INT32),
                  helper.make_node("Reshape", ["total_1", "scalar"], ["total"]),
                  helper.make_node("Shape", ["q"], ["b_shape"], start=0, end=1),
                  helper.make_node("Sub", ["total_1", "one"], ["last"]),
                  helper.make_node("Expand", ["last", "b_shape"], ["seqlens"])]
        given = {"query": q, "key": k, "value": v, "past_key": "past_k", "past_value": "past_v",
                 "seqlens_k": "seqlens", "total_sequence_length": "total"}
        names = gqa_input_names()
        if variant != "gqa-causal":
            given["attention_bias"] = "m"
        if variant == "gqa-causal-bias":
            if "query_seqlens" in names:  # S valid rows for every entry: batched chunks with a cache run
                nodes += [helper.make_node("Shape", ["q"], ["s_shape"], start=2, end=3),
                          helper.make_node("Cast", ["s_shape"], ["s_1"], to=TensorProto.INT32),
                          helper.make_node("Expand", ["s_1", "b_shape"], ["query_seqlens"])]
                given["query_seqlens"] = "query_seqlens"
        last = max(names.index(n) for n in given)
        ins = [given.get(n, "") for n in names[:last + 1]]
        nodes.append(helper.make_node("GroupQueryAttention", ins, ["out", "present_k", "present_v"], domain=MS,
                                      num_heads=heads, kv_num_heads=kv_heads, scale=scale,
                                      causal=0 if variant == "gqa-bias" else 1))
    else:
        nodes += [helper.make_node("Concat", ["past_k", "k"], ["present_k"], axis=2),
                  helper.make_node("Concat", ["past_v", "v"], ["present_v"], axis=2)]
        kr = _repeat_kv(nodes, inits, "present_k", heads, kv_heads, size)
        vr = _repeat_kv(nodes, inits, "present_v", heads, kv_heads, size)
        if variant == "decomposed":
            nodes += [helper.make_node("FusedMatMul", ["q", kr], ["s"], domain=MS, transB=1, alpha=scale),
                      helper.make_node("Add", ["s", "m"], ["sm"]),
                      helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
                      helper.make_node("MatMul", ["p", vr], ["o"])]
            nodes.append(helper.make_node("Identity", [_to_bsd(nodes, inits, "o", hidden)], ["out"]))
        else:
            q = _to_bsd(nodes, inits, "q", hidden)
            nodes.append(helper.make_node("MultiHeadAttention", [q, kr, vr, "", "", "m"], ["out"], domain=MS,
                                          num_heads=heads, scale=scale))
    inputs = [helper.make_tensor_value_info("q", elem, ["B", heads, "S", size]),
              helper.make_tensor_value_info("k", elem, ["B", kv_heads, "S", size]),
              helper.make_tensor_value_info("v", elem, ["B", kv_heads, "S", size]),
              helper.make_tensor_value_info("past_k", elem, ["B", kv_heads, "P", size]),
              helper.make_tensor_value_info("past_v", elem, ["B", kv_heads, "P", size]),
              helper.make_tensor_value_info("m", elem, ["B", 1, "S", "T"])]
    outputs = [helper.make_tensor_value_info("out", elem, ["B", "S", hidden]),
               helper.make_tensor_value_info("present_k", elem, ["B", kv_heads, "T", size]),
               helper.make_tensor_value_info("present_v", elem, ["B", kv_heads, "T", size])]
    graph = helper.make_graph(nodes, variant, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def feeds(batch, heads, kv_heads, size, seq, past, padded, dtype) -> dict:
    """Random q, k, v and cache; the bottom-right causal mask over P + S keys, and with ``padded`` the
    first two keys of odd batch entries masked (left padding, as transformers' generate writes it)."""
    rng = np.random.default_rng(batch * 1000 + seq * 10 + past)
    total = past + seq
    keep = np.tril(np.ones((seq, total), bool), k=past)[None, None].repeat(batch, 0)
    if padded:
        keep[1::2, :, :, :2] = False
    return {"q": rng.standard_normal((batch, heads, seq, size)).astype(dtype),
            "k": rng.standard_normal((batch, kv_heads, seq, size)).astype(dtype),
            "v": rng.standard_normal((batch, kv_heads, seq, size)).astype(dtype),
            "past_k": rng.standard_normal((batch, kv_heads, past, size)).astype(dtype),
            "past_v": rng.standard_normal((batch, kv_heads, past, size)).astype(dtype),
            "m": np.where(keep, 0, np.finfo(dtype).min).astype(dtype)}


def reference(f, heads, kv_heads, size) -> dict:
    """float64: present = Concat(past, new); softmax(s·QKᵀ + M)·V over repeated heads, merged."""
    pk = np.concatenate([f["past_k"], f["k"]], axis=2).astype(np.float64)
    pv = np.concatenate([f["past_v"], f["v"]], axis=2).astype(np.float64)
    rep = heads // kv_heads
    kr, vr = np.repeat(pk, rep, axis=1), np.repeat(pv, rep, axis=1)
    s = f["q"].astype(np.float64) @ kr.transpose(0, 1, 3, 2) * size ** -0.5 + f["m"].astype(np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ vr).transpose(0, 2, 1, 3)
    return {"out": o.reshape(o.shape[0], o.shape[1], -1), "present_k": pk, "present_v": pv}


def main(argv=None) -> int:
    args, out, _ = parse_args(__doc__, time_budget=0.3, argv=argv)
    rows = []
    for dtype, elem, tol in ((np.float16, TensorProto.FLOAT16, 1e-2), (np.float32, TensorProto.FLOAT, 1e-3)):
        for label, heads, kv_heads, size, shapes in CASES:
            models = {v: build(v, heads, kv_heads, size, elem) for v in VARIANTS}
            for batch, seq, past, padded in shapes:
                f = feeds(batch, heads, kv_heads, size, seq, past, padded, dtype)
                ref = reference(f, heads, kv_heads, size)
                checks = {}
                for v in VARIANTS:
                    try:
                        got = run_model(models[v], Inputs(feeds=f), args.device, name=v)
                        err = max(float(np.max(np.abs(got[o].astype(np.float64) - ref[o]), initial=0.0)) for o in ref)
                        checks[v] = {"max_abs": err, "ok": bool(err <= tol)}
                    except Exception as exc:  # a form this ONNX Runtime cannot run: recorded
                        checks[v] = {"error": " ".join(str(exc).split())[:300]}
                row = {"dtype": np.dtype(dtype).name, "shape": label, "batch": batch, "seq": seq, "past": past,
                       "padded": padded, "checks": checks, "median_ms": {}}
                if label != "tiny":
                    runnable = [(v, models[v], Inputs(feeds=f)) for v in VARIANTS if "error" not in checks[v]]
                    cfg = BenchConfig(device=args.device, warmup=5, time_budget_s=args.time_budget, min_iterations=10)
                    results = time_models(runnable, cfg, rounds=3)
                    row["median_ms"] = {v: r.stats.median_ms for (v, _, _), r in zip(runnable, results)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    md = ["| dtype | shape | B | S | P | padded | " + " | ".join(VARIANTS) + " |",
          "|---|---|---:|---:|---:|---|" + "---:|" * len(VARIANTS)]
    for r in rows:
        cells = []
        for v in VARIANTS:
            c, t = r["checks"][v], r["median_ms"].get(v)
            if "error" in c:
                cells.append("error")
            else:
                cells.append((f"{t:.3f}" if t is not None else "ok") + ("" if c["ok"] else f" (WRONG {c['max_abs']:.2g})"))
        md.append(f"| {r['dtype']} | {r['shape']} | {r['batch']} | {r['seq']} | {r['past']} | {r['padded']} | "
                  + " | ".join(cells) + " |")
    write_results(out, "gqa_kv_cache", rows, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
