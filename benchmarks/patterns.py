#!/usr/bin/env python3
"""Per-pattern benchmark: ONNX Runtime's contrib op vs our FusedElementwise vs the original graph.

Issue 4 asks, for each known pattern, whether the contrib op (Gelu, FastGelu, BiasGelu, QuickGelu,
FusedConv, LayerNormalization, SkipLayerNormalization) or FusedElementwise is faster on the GPU, so the
faster one can be the default. For each pattern this builds a small model with the decomposed form,
makes the variants with ``onnxfuse.pipeline.rewrite_model`` restricted to one rule family, validates
each against the original on the GPU, and times them interleaved under ORT_ENABLE_ALL (the original
gets ONNX Runtime's own fusions, the fair baseline).

Usage (repo root, onnxruntime-gpu importable)::

    python benchmarks/patterns.py --out /tmp/patterns [--time-budget 0.5]

Writes ``patterns.json`` and ``patterns.md`` under ``--out``. Never imported by the package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from onnxfuse.timing import BenchConfig, time_models  # noqa: E402
from onnxfuse.pipeline import rewrite_model  # noqa: E402
from onnxfuse.rewrites import select_rules  # noqa: E402
from onnxfuse.runtime.compare import compare_outputs  # noqa: E402
from onnxfuse.runtime.inputs import make_inputs  # noqa: E402
from onnxfuse.runtime.session import run_model  # noqa: E402

FP = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "pattern", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _c(name, value, dtype):
    return numpy_helper.from_array(np.asarray(value, dtype=np.float16 if dtype == "float16" else np.float32), name)


def gelu_erf(shape, dtype, bias=False):
    t = FP[dtype]
    nodes, inits = [], [_c("sqrt2", 1.4142135381698608, dtype), _c("one", 1.0, dtype), _c("half", 0.5, dtype)]
    x = "x"
    if bias:
        inits.append(_c("b", np.random.default_rng(0).standard_normal(shape[-1]), dtype))
        nodes.append(helper.make_node("Add", ["x", "b"], ["xb"]))
        x = "xb"
    nodes += [
        helper.make_node("Div", [x, "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", [x, "a"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["y"]),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", t, shape)], [helper.make_tensor_value_info("y", t, shape)], inits)


def gelu_tanh(shape, dtype):
    t = FP[dtype]
    inits = [_c("k3", 0.044715, dtype), _c("s", 0.7978845834732056, dtype), _c("one", 1.0, dtype),
             _c("half", 0.5, dtype), _c("three", 3.0, dtype)]
    nodes = [
        helper.make_node("Pow", ["x", "three"], ["x3"]), helper.make_node("Mul", ["x3", "k3"], ["kx3"]),
        helper.make_node("Add", ["x", "kx3"], ["inner"]), helper.make_node("Mul", ["inner", "s"], ["si"]),
        helper.make_node("Tanh", ["si"], ["th"]), helper.make_node("Add", ["th", "one"], ["a"]),
        helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Mul", ["m", "half"], ["y"]),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", t, shape)], [helper.make_tensor_value_info("y", t, shape)], inits)


def silu(shape, dtype):
    t = FP[dtype]
    nodes = [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Mul", ["x", "s"], ["y"])]
    return _model(nodes, [helper.make_tensor_value_info("x", t, shape)], [helper.make_tensor_value_info("y", t, shape)])


def conv_relu(n, c, hw, dtype="float32", residual=False):
    t = FP[dtype]
    rng = np.random.default_rng(0)
    inits = [_c("w", rng.standard_normal((c, c, 3, 3)) * 0.05, dtype), _c("b", rng.standard_normal(c), dtype)]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1])]
    ins = [helper.make_tensor_value_info("x", t, [n, c, hw, hw])]
    src = "c"
    if residual:
        ins.append(helper.make_tensor_value_info("z", t, [n, c, hw, hw]))
        nodes.append(helper.make_node("Add", ["c", "z"], ["cz"]))
        src = "cz"
    nodes.append(helper.make_node("Relu", [src], ["y"]))
    return _model(nodes, ins, [helper.make_tensor_value_info("y", t, [n, c, hw, hw])], inits)


def layernorm(shape, dtype, skip=False):
    t = FP[dtype]
    h = shape[-1]
    rng = np.random.default_rng(0)
    inits = [_c("two", 2.0, dtype), _c("eps", 1e-5, dtype), _c("g", rng.standard_normal(h), dtype),
             _c("bt", rng.standard_normal(h), dtype)]
    ins = [helper.make_tensor_value_info("x", t, shape)]
    nodes = []
    x = "x"
    if skip:
        ins.append(helper.make_tensor_value_info("r", t, shape))
        nodes.append(helper.make_node("Add", ["x", "r"], ["xr"]))
        x = "xr"
    nodes += [
        helper.make_node("ReduceMean", [x], ["mu"], axes=[-1]), helper.make_node("Sub", [x, "mu"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["d2"]), helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["ve"]), helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["d", "sd"], ["nrm"]), helper.make_node("Mul", ["nrm", "g"], ["sc"]),
        helper.make_node("Add", ["sc", "bt"], ["y"]),
    ]
    return _model(nodes, ins, [helper.make_tensor_value_info("y", t, shape)], inits, opset=17)


def patterns(quick: bool):
    big = [16, 128, 3072] if not quick else [8, 128, 3072]
    act = [16, 64, 112, 112] if not quick else [8, 64, 112, 112]
    out = []
    for dt in ("float32", "float16"):
        out += [
            (f"gelu-erf {dt}", gelu_erf(big, dt), {"contrib": "contrib-gelu", "fused": "fuse-elementwise"}),
            (f"bias-gelu {dt}", gelu_erf(big, dt, bias=True),
             {"contrib": "contrib-gelu,contrib-bias-gelu", "fused": "fuse-elementwise"}),
            (f"fast-gelu {dt}", gelu_tanh(big, dt), {"contrib": "contrib-fast-gelu", "fused": "fuse-elementwise"}),
            (f"silu {dt}", silu(act, dt), {"contrib": "contrib-quick-gelu", "fused": "fuse-elementwise"}),
            (f"layernorm {dt}", layernorm([16, 128, 768], dt), {"contrib": "contrib-layernorm", "fused": "fuse-elementwise"}),
            (f"skip-layernorm {dt}", layernorm([16, 128, 768], dt, skip=True),
             {"contrib": "contrib-skip-layernorm,contrib-layernorm", "fused": "fuse-elementwise"}),
        ]
    out += [
        ("conv-relu float32", conv_relu(16, 64, 56), {"contrib": "contrib-fused-conv"}),
        ("conv-add-relu float32", conv_relu(16, 64, 56, residual=True), {"contrib": "contrib-fused-conv",
                                                                           "fused": "fuse-elementwise"}),
    ]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--time-budget", type=float, default=0.5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: only to check the script")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = BenchConfig(device=args.device, time_budget_s=args.time_budget, warmup=10)
    rows = []
    for name, model, variants in patterns(args.quick):
        t0 = time.time()
        inputs = make_inputs(model, seed=0)
        ref = run_model(model, inputs, args.device)
        entries = [("original", model, inputs)]
        row = {"pattern": name, "variants": {}}
        for label, only in variants.items():
            rules = select_rules("cuda", only=only)
            candidate, report = rewrite_model(model, rules)
            applied = {k: v for k, v in report.counts.items() if v}
            ok = all(c.passed for c in compare_outputs(ref, run_model(candidate, inputs, args.device)))
            row["variants"][label] = {"rules": applied, "valid": ok, "nodes": len(candidate.graph.node),
                                      "ops": sorted({n.op_type for n in candidate.graph.node})}
            if applied:
                entries.append((label, candidate, inputs))
        results = time_models(entries, config, rounds=3)
        for r in results:
            row["variants"].setdefault(r.name, {})["median_ms"] = r.stats.median_ms
        rows.append(row)
        base = row["variants"]["original"]["median_ms"]
        summary = ", ".join(f"{k} {v.get('median_ms', float('nan')):.4f} ms" for k, v in row["variants"].items())
        print(f"{name}: {summary} (base {base:.4f}) [{time.time() - t0:.1f} s]", flush=True)
    (out / "patterns.json").write_text(json.dumps(rows, indent=2))
    lines = ["| pattern | original ms | contrib op ms | FusedElementwise ms | faster |", "|---|---:|---:|---:|---|"]
    for row in rows:
        v = row["variants"]
        cells = []
        for key in ("original", "contrib", "fused"):
            e = v.get(key, {})
            ms = e.get("median_ms")
            cells.append("-" if ms is None else f"{ms:.4f}" + ("" if e.get("valid", True) else " (INVALID)"))
        timed = {k: e["median_ms"] for k, e in v.items() if e.get("median_ms") is not None and k != "original"}
        best = min(timed, key=timed.get) if timed else "-"
        lines.append(f"| {row['pattern']} | " + " | ".join(cells) + f" | {best} |")
    (out / "patterns.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
