"""contrib-fused-matmul-scale: a scalar scale on a MatMul's input or output → com.microsoft FusedMatMul(alpha)."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_testlib import attrs, fuse, ops, parse, refusals, same_outputs
from onnxfuse.rewrites.contrib.contrib_fused_matmul_scale import ContribFusedMatMulScale

SCALE = ContribFusedMatMulScale()


@pytest.mark.parametrize(
    "body,alpha",
    [
        ("c = Constant <value = float {0.125}> ()\nm = MatMul(a, b)\ny = Mul(m, c)", 0.125),
        ("c = Constant <value = float {8.0}> ()\nm = MatMul(a, b)\ny = Div(m, c)", 0.125),
        ("c = Constant <value = float {2.0}> ()\nsa = Mul(c, a)\ny = MatMul(sa, b)", 2.0),
        ("c = Constant <value = float {4.0}> ()\nsb = Div(b, c)\ny = MatMul(a, sb)", 0.25),
        ("c = Constant <value = float {2.0}> ()\nsa = Mul(a, c)\nsb = Mul(b, c)\nm = MatMul(sa, sb)\ny = Div(m, c)", 2.0),
    ],
)
def test_fused_matmul_scale(body, alpha):
    m = parse(f"g (float[2,3,4,6] a, float[2,3,6,5] b) => (float[2,3,4,5] y) {{\n{body}\n}}")
    out, report = fuse(m, SCALE)
    assert ops(out) == {"com.microsoft:FusedMatMul": 1}, refusals(report)
    assert attrs(out.graph.node[0])["alpha"] == pytest.approx(alpha, rel=1e-7)
    same_outputs(m, out)

def test_fused_matmul_scale_keeps_shared_input_scale():
    body = "c = Constant <value = float {2.0}> ()\nsa = Mul(a, c)\ny = MatMul(sa, b)"
    m = parse(f"g (float[4,6] a, float[6,5] b) => (float[4,5] y, float[4,6] sa) {{\n{body}\n}}")
    out, report = fuse(m, SCALE)
    assert ops(out) == {"com.microsoft:FusedMatMul": 1, "Mul": 1, "Constant": 1}
    same_outputs(m, out)

@pytest.mark.parametrize(
    "body,outputs",
    [
        # the scale is a vector, not a scalar
        ("m = MatMul(a, b)\ny = Mul(m, c)", "float[4,5] y"),
        # MatMul output also read elsewhere
        ("s = Constant <value = float {2.0}> ()\nm = MatMul(a, b)\ny = Mul(m, s)", "float[4,5] y, float[4,5] m"),
        # a size-1 rank-3 constant would broadcast the rank-2 output to rank 3
        ("s = Constant <value = float[1,1,1] {2.0}> ()\nm = MatMul(a, b)\ny = Mul(m, s)", "float[1,4,5] y"),
    ],
)
def test_fused_matmul_scale_near_misses(body, outputs):
    m = parse(f"g (float[4,6] a, float[6,5] b) => ({outputs}) {{\n{body}\n}}",
              inits={"c": np.arange(5, dtype=np.float32)})
    out, report = fuse(m, SCALE)
    assert report.counts[SCALE.name] == 0, ops(out)

def test_fused_matmul_scale_integer_matmul_not_touched():
    m = parse("g (int32[4,6] a, int32[6,5] b) => (int32[4,5] y) {\nc = Constant <value = int32 {2}> ()\n"
              "m = MatMul(a, b)\ny = Mul(m, c)\n}")
    out, report = fuse(m, SCALE)
    assert report.counts[SCALE.name] == 0
