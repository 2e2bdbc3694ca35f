"""contrib-fused-matmul-transpose: a last-two-axes Transpose of a MatMul input → FusedMatMul(transA/transB)."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_testlib import attrs, fuse, ops, parse, refusals, same_outputs, to_dtype
from onnxfuse.rewrites.contrib.contrib_fused_matmul_scale import ContribFusedMatMulScale
from onnxfuse.rewrites.contrib.contrib_fused_matmul_transpose import ContribFusedMatMulTranspose

SCALE = ContribFusedMatMulScale()
TRANS = ContribFusedMatMulTranspose()


@pytest.mark.parametrize(
    "body,trans",
    [
        ("bt = Transpose <perm = [0, 1, 3, 2]> (k)\ny = MatMul(q, bt)", (0, 1)),
        ("at = Transpose <perm = [0, 1, 3, 2]> (qt)\ny = MatMul(at, v)", (1, 0)),
    ],
)
def test_fused_matmul_transpose(body, trans):
    m = parse(f"g (float[2,3,4,6] q, float[2,3,5,6] k, float[2,3,6,4] qt, float[2,3,6,5] v) => (float[2,3,4,5] y) "
              f"{{\n{body}\n}}")
    out, report = fuse(m, TRANS)
    assert ops(out) == {"com.microsoft:FusedMatMul": 1}, refusals(report)
    a = attrs(out.graph.node[0])
    assert (a["transA"], a["transB"]) == trans
    same_outputs(m, out)

def test_fused_matmul_transpose_then_scale():
    body = ("bt = Transpose <perm = [0, 2, 1]> (k)\nm = MatMul(q, bt)\n"
            "c = Constant <value = float {0.5}> ()\ny = Mul(m, c)")
    m = parse(f"g (float[2,4,6] q, float[2,5,6] k) => (float[2,4,5] y) {{\n{body}\n}}")
    out, report = fuse(m, TRANS, SCALE)
    assert ops(out) == {"com.microsoft:FusedMatMul": 1}, refusals(report)
    a = attrs(out.graph.node[0])
    assert a["transB"] == 1 and a["alpha"] == 0.5
    same_outputs(m, out)

@pytest.mark.parametrize("perm", ["[1, 0, 2]", "[2, 1, 0]"])
def test_fused_matmul_transpose_other_perms_refused(perm):
    m = parse(f"g (float[6,2,5] k, float[2,4,6] q) => (float[2,4,5] y) {{\nbt = Transpose <perm = {perm}> (k)\n"
              f"y = MatMul(q, bt)\n}}" if perm == "[1, 0, 2]" else
              f"g (float[5,6,2] k, float[2,4,6] q) => (float[2,4,5] y) {{\nbt = Transpose <perm = {perm}> (k)\n"
              f"y = MatMul(q, bt)\n}}")
    out, report = fuse(m, TRANS)
    assert report.counts[TRANS.name] == 0

def test_fused_matmul_fp16():
    body = "c = Constant <value = float {0.125}> ()\nm = MatMul(a, b)\ny = Mul(m, c)"
    m = to_dtype(parse(f"g (float[4,6] a, float[6,5] b) => (float[4,5] y) {{\n{body}\n}}"), np.float16)
    out, report = fuse(m, SCALE)
    assert ops(out) == {"com.microsoft:FusedMatMul": 1}, refusals(report)
    same_outputs(m, out, rtol=1e-2, atol=1e-2)
