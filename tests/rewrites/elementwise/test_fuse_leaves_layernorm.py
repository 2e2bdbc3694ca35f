"""fuse-elementwise leaves decomposed LayerNorms (and the residual Add before them) to ONNX Runtime's
own LayerNormFusion, but still fuses the elementwise chain after them."""

from __future__ import annotations

import onnx
from onnx import parser

from onnxfuse.pipeline import rewrite_model
from onnxfuse.precision import BFLOAT16, convert_to_fp16
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


SOFTMAX = """
<ir_version: 8, opset_import: ["" : 13]>
g (float[2, 4, 8, 8] s, float[2, 1, 1, 8] mask) => (float[2, 4, 8, 8] y) <float k = {0.125}> {
  sc = Mul(s, k)
  a = Add(sc, mask)
  y = Softmax<axis = -1>(a)
}
"""


def test_add_before_softmax_is_left_for_bias_softmax():
    out, report = rewrite_model(parser.parse_model(SOFTMAX), select_rules("cuda", only="fuse-elementwise"))
    ops = [n.op_type for n in out.graph.node]
    assert ops == ["Mul", "Add", "Softmax"], ops
    assert any("BiasSoftmaxFusion" in r.reason for r in report.refusals)


def test_fp16_layernorm_with_casts_is_left_alone():
    text = """
<ir_version: 8, opset_import: ["" : 13]>
g (float16[2, 8, 16] x) => (float16[2, 8, 16] y) <float two = {2.0}, float eps = {1e-5}, float16 g1 = {15872}, float16 b1 = {14336}> {
  mu = ReduceMean<axes = [-1]>(x)
  d = Sub(x, mu)
  df = Cast<to = 1>(d)
  d2 = Pow(df, two)
  var = ReduceMean<axes = [-1]>(d2)
  ve = Add(var, eps)
  sd = Sqrt(ve)
  n = Div(df, sd)
  nh = Cast<to = 10>(n)
  g = Mul(nh, g1)
  y = Add(g, b1)
}
"""
    out, _ = rewrite_model(parser.parse_model(text), select_rules("cuda", only="fuse-elementwise"))
    assert "FusedElementwise" not in [n.op_type for n in out.graph.node]


def test_residual_add_before_an_onnx_layernorm_is_left_for_skip_layernorm_fusion():
    # The sum is read twice (the LayerNorm and the next residual), so contrib-skip-layernorm leaves
    # it; ONNX Runtime's SkipLayerNormFusion takes Add + LayerNormalization together (its extra
    # output carries the sum). fuse-elementwise must not pull the Add into a region with the bias Add.
    model = parser.parse_model("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2, 8, 16] x, float[2, 8, 16] r) => (float[2, 8, 16] y, float[2, 8, 16] s) <
        float[16] bias = {1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1}, float[16] gamma = {1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1},
        float[16] beta = {0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0}> {
      xb = Add(x, bias)
      s = Add(xb, r)
      y = LayerNormalization <axis = -1> (s, gamma, beta)
    }
    """)
    out, report = rewrite_model(model, select_rules("cuda", only="fuse-elementwise"))
    assert [n.op_type for n in out.graph.node] == ["Add", "Add", "LayerNormalization"]
    reasons = [r.reason for r in report.refusals]
    assert any("SkipLayerNormFusion" in why for why in reasons), reasons


def test_a_bfloat16_layernorm_is_fused_in_pieces_since_onnx_runtime_does_not_fuse_it():
    # ONNX Runtime's LayerNormFusion takes float16/float/double only: in bfloat16 the decomposed LayerNorm
    # would run as eight kernels, so the elementwise fusion takes its pieces around the two ReduceMeans
    model, _ = convert_to_fp16(parser.parse_model(MODEL), target=BFLOAT16)
    out, report = rewrite_model(model, select_rules("cuda", only="fuse-elementwise"))
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("ReduceMean") == 2
    assert not {"Sub", "Pow", "Sqrt", "Div", "Relu"} & set(ops), ops
    assert ops.count("FusedElementwise") >= 2
    assert not any("LayerNormFusion" in r.reason for r in report.refusals)
    onnx.shape_inference.infer_shapes(out, strict_mode=True, check_type=True)
