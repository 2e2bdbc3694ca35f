"""gemm-rows-to-matmul: torch's Conv1D export (Reshape to rows → Gemm → Reshape back) becomes MatMul (+ Add).

Every rewrite is compared with ONNX Runtime on the original at two batch sizes (a wrong unflatten would
give another shape or other values); every refusal leaves the Gemm.
"""

from __future__ import annotations

import numpy as np
import pytest
from contrib_testlib import fuse, ops, parse, refusals

import helpers
from onnxfuse.rewrites.fold.gemm_rows_to_matmul import GemmRowsToMatMul

RULE = GemmRowsToMatMul()
RNG = np.random.default_rng(3)
W = RNG.standard_normal((8, 6)).astype(np.float32)
C = RNG.standard_normal(6).astype(np.float32)


def _conv1d(back="-1, 4, 6", gemm_attrs="", w=W, c=True, flat="-1, 8", out="batch,4,6"):
    inits = {"w": w}
    if c:
        inits["c"] = C
    gemm_in = "rows, w, c" if c else "rows, w"
    attrs = f" <{gemm_attrs}>" if gemm_attrs else ""
    return parse(f"""
    g (float[batch,4,8] x) => (float[{out}] y) {{
        t1 = Constant <value = int64[2] {{ {flat} }}> ()
        rows = Reshape(x, t1)
        prod = Gemm{attrs} ({gemm_in})
        t2 = Constant <value = int64[3] {{ {back} }}> ()
        y = Reshape(prod, t2)
    }}
    """, inits=inits)


def _same(model, out):
    for batch in (1, 3):
        feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 4, 8)).astype(np.float32)}
        want, got = helpers.run_ort(model, feeds)["y"], helpers.run_ort(out, feeds)["y"]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
def test_conv1d_becomes_matmul(with_bias):
    model = _conv1d(c=with_bias)
    out, report = fuse(model, RULE)
    assert report.counts[RULE.name] == 1, refusals(report)
    assert ops(out) == ({"MatMul": 1, "Add": 1} if with_bias else {"MatMul": 1})
    _same(model, out)
    # The output's batch is x's own name now, not one ONNX invented for the [-1, 4, 6] unflatten.
    y = next(v for v in out.graph.output if v.name == "y")
    assert y.type.tensor_type.shape.dim[0].dim_param == "batch"


def test_transposed_constant_weight_is_transposed_once():
    model = _conv1d(gemm_attrs="transB = 1", w=np.ascontiguousarray(W.T))
    out, report = fuse(model, RULE)
    assert report.counts[RULE.name] == 1
    _same(model, out)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(back="-1, 2, 12", out="p,q,r"), "give back x's"),  # [B, 2, 12]: another shape
    (dict(gemm_attrs="alpha = 2.0"), "alpha/beta"),
    (dict(gemm_attrs="transA = 1", flat="8, -1"), "alpha/beta"),
])
def test_refusals_keep_the_gemm(kwargs, reason):
    model = _conv1d(**kwargs)
    out, report = fuse(model, RULE)
    assert report.counts[RULE.name] == 0
    assert "Gemm" in ops(out)
    assert any(reason in r for r in refusals(report, RULE)), refusals(report)
