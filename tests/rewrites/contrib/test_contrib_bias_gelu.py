"""contrib-bias-gelu: a 1-D bias Add before a Gelu (or FastGelu) → com.microsoft BiasGelu (FastGelu with its bias
input); shared Adds and broadcast scalar biases refused."""

from __future__ import annotations

import numpy as np
from contrib_testlib import fuse, ops, parse, refusals, same_outputs
from test_contrib_gelu import BIAS, FAST, FAST_FORMS, FAST_TAIL, GELU, GELU_FORMS, HEAD, _bias_model


def test_bias_gelu():
    model = _bias_model(GELU_FORMS["torch"])
    out, report = fuse(model, GELU, BIAS)
    assert report.counts[BIAS.name] == 1, refusals(report)
    assert ops(out) == {"MatMul": 1, "com.microsoft:BiasGelu": 1}
    same_outputs(model, out)

def test_fast_gelu_with_bias():
    model = _bias_model(FAST_FORMS["pow"] + FAST_TAIL)
    out, report = fuse(model, FAST, BIAS)
    assert ops(out) == {"MatMul": 1, "com.microsoft:FastGelu": 1}
    node = [n for n in out.graph.node if n.op_type == "FastGelu"][0]
    assert list(node.input) == ["mm", "b"]
    same_outputs(model, out)

def test_bias_gelu_refuses_broadcast_scalar_bias():
    model = _bias_model(GELU_FORMS["torch"], bias_shape=(1,))
    out, report = fuse(model, GELU, BIAS)
    assert report.counts[GELU.name] == 1 and report.counts[BIAS.name] == 0
    assert any("1 entries" in r for r in refusals(report, BIAS)), refusals(report)

def test_bias_gelu_refuses_shared_add():
    rng = np.random.default_rng(0)
    inits = {"W": rng.standard_normal((6, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}
    body = "mm = MatMul(v, W)\nx = Add(mm, b)\n" + GELU_FORMS["torch"]
    model = parse("g (float[2,5,6] v) => (float[2,5,8] y, float[2,5,8] x) {\n" + body + "}", inits=inits)
    out, report = fuse(model, GELU, BIAS)
    assert report.counts[BIAS.name] == 0
    assert "com.microsoft:Gelu" in ops(out)

def test_native_gelu_after_a_bias_becomes_bias_gelu():
    # The reason for the mapping: a FusedElementwise Add+Gelu was 27-42% slower than BiasGelu.
    model = parse(HEAD.replace("{\n", "{\n    b = Constant <value = float[8] {0.1, -0.2, 0.3, 0.0, 1.0, -1.5, 0.25, 2.0}> ()\n")
                  + "    t = Add(x, b)\n    y = Gelu(t)\n}", opset=20)
    out, report = fuse(model, GELU, BIAS)
    found = ops(out)
    assert found["com.microsoft:BiasGelu"] == 1 and not found["Add"] and not found["Gelu"], refusals(report)
    same_outputs(model, out, rtol=1e-5, atol=1e-6)
