"""fuse-elementwise leaves decomposed LayerNorms (and the residual Add before them) to ONNX Runtime's
own LayerNormFusion, but still fuses the elementwise chain after them."""

from __future__ import annotations

import onnx
from onnx import parser

from onnxfuse.optimize import rewrite_model
from onnxfuse.rewrites import select_rules

MODEL = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[2, 8, 16] x, float[2, 8, 16] r) => (float[2, 8, 16] y) <float two = {2.0}, float eps = {1e-5},
    float[16] gamma = {1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1}, float[16] beta = {0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0},
    float half = {0.5}, float three = {3.0}> {
  s = Add(x, r)
  mu = ReduceMean<axes = [-1]>(s)
  d = Sub(s, mu)
  d2 = Pow(d, two)
  var = ReduceMean<axes = [-1]>(d2)
  ve = Add(var, eps)
  sd = Sqrt(ve)
  n = Div(d, sd)
  g = Mul(n, gamma)
  ln = Add(g, beta)
  a = Mul(ln, half)
  b = Add(a, three)
  y = Relu(b)
}
"""


def test_layernorm_parts_stay_standard_and_tail_fuses():
    model = parser.parse_model(MODEL)
    out, report = rewrite_model(model, select_rules("cuda", only="fuse-elementwise"))
    ops = [n.op_type for n in out.graph.node]
    # The whole LayerNorm (and its residual Add) is untouched...
    for op, count in (("ReduceMean", 2), ("Sub", 1), ("Pow", 1), ("Sqrt", 1), ("Div", 1)):
        assert ops.count(op) == count, ops
    # ...and the Mul/Add/Relu chain after it is one fused node.
    assert ops.count("FusedElementwise") == 1
    fused = next(n for n in out.graph.node if n.op_type == "FusedElementwise")
    assert fused.input[0] == "ln" and fused.output[0] == "y"
    reasons = {r.reason for r in report.refusals}
    assert any("LayerNormFusion" in r for r in reasons)
    assert any("SkipLayerNormFusion" in r for r in reasons)
    onnx.checker.check_model(out)
