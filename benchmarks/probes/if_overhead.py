"""Probe (issue 31; run from the repository root on the GPU machine with $OUT set): what one ``If`` node
costs per run on ONNX Runtime's CUDA provider, the price of guarding a fused op that serves only some
shapes (GroupQueryAttention: no batch > 1 with new tokens over a cache) with an exact fallback branch.

Models, float16 x [1, 1, 896] through 24 steps each, timed interleaved with IOBinding:
* ``plain``: 24 × Add(x, c);
* ``if``: 24 × If(cond) {then: Add(x, c)} {else: Sub(x, c)}, cond a graph input (true);
* ``if-cond-from-shape``: the same with cond computed once from the input's shape
  (Equal(Shape(x)[1], 1)), as the guard would be.
(``if`` − ``plain``) / 24 is the per-If cost."""
import os
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from onnxfuse.runtime.inputs import Inputs  # noqa: E402
from onnxfuse.timing import BenchConfig, time_models  # noqa: E402

out = Path(os.environ.get("OUT", "/tmp")) / "r"
out.mkdir(parents=True, exist_ok=True)
STEPS, WIDTH = 24, 896


def model(kind: str):
    nodes = []
    inits = [numpy_helper.from_array(np.full((WIDTH,), 0.5, np.float16), "c")]
    inputs = [helper.make_tensor_value_info("x", TP.FLOAT16, [1, "S", WIDTH])]
    if kind == "if":
        inputs.append(helper.make_tensor_value_info("cond", TP.BOOL, []))
    if kind == "if-cond-from-shape":
        inits += [numpy_helper.from_array(np.array([1], np.int64), "one"),
                  numpy_helper.from_array(np.array([], np.int64), "scalar")]
        nodes += [helper.make_node("Shape", ["x"], ["xs"], start=1, end=2),
                  helper.make_node("Equal", ["xs", "one"], ["c1"]),
                  helper.make_node("Reshape", ["c1", "scalar"], ["cond"])]
    x = "x"
    for i in range(STEPS):
        y = f"y{i}"
        if kind == "plain":
            nodes.append(helper.make_node("Add", [x, "c"], [y]))
        else:
            then = helper.make_graph([helper.make_node("Add", [x, "c"], [f"t{i}"])], f"then{i}", [],
                                     [helper.make_tensor_value_info(f"t{i}", TP.FLOAT16, [1, "S", WIDTH])])
            other = helper.make_graph([helper.make_node("Sub", [x, "c"], [f"e{i}"])], f"else{i}", [],
                                      [helper.make_tensor_value_info(f"e{i}", TP.FLOAT16, [1, "S", WIDTH])])
            nodes.append(helper.make_node("If", ["cond"], [y], then_branch=then, else_branch=other))
        x = y
    g = helper.make_graph(nodes, kind, inputs, [helper.make_tensor_value_info(x, TP.FLOAT16, [1, "S", WIDTH])], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


feeds = {"x": np.ones((1, 1, WIDTH), np.float16)}
cfg = BenchConfig(device="cuda", warmup=20, time_budget_s=1.0, min_iterations=200)
runs = [("plain", model("plain"), feeds), ("if", model("if"), {**feeds, "cond": np.array(True)}),
        ("if-cond-from-shape", model("if-cond-from-shape"), feeds)]
res = time_models([(n, m, Inputs(feeds=f, seed=0, source="probe")) for n, m, f in runs], cfg, rounds=4)
ms = {n: r.stats.median_ms for (n, _, _), r in zip(runs, res)}
lines = [f"{n}: {v:.4f} ms" for n, v in ms.items()]
lines.append(f"per If: {(ms['if'] - ms['plain']) / STEPS * 1000:.1f} us; "
             f"with the shape-derived cond: {(ms['if-cond-from-shape'] - ms['plain']) / STEPS * 1000:.1f} us")
print("\n".join(lines))
(out / "if_overhead.txt").write_text("\n".join(lines) + "\n")
