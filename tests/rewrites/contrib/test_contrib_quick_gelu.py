"""contrib-quick-gelu: x·Sigmoid(α·x) → com.microsoft QuickGelu; near misses and a Sigmoid read as a graph output
refused."""

from __future__ import annotations

import pytest
from contrib_testlib import fuse, ops, parse, refusals, same_outputs
from test_contrib_gelu import HEAD, QUICK


@pytest.mark.parametrize(
    "body,alpha",
    [
        ("s = Sigmoid(x)\ny = Mul(x, s)", 1.0),  # SiLU
        ("c = Constant <value = float {1.702}> ()\nax = Mul(x, c)\ns = Sigmoid(ax)\ny = Mul(s, x)", 1.702),
        ("c = Constant <value = float {1.702}> ()\nax = Mul(c, x)\ns = Sigmoid(ax)\ny = Mul(x, s)", 1.702),
    ],
)
def test_quick_gelu(body, alpha):
    model = parse(HEAD + body + "}")
    out, report = fuse(model, QUICK)
    assert ops(out) == {"com.microsoft:QuickGelu": 1}, refusals(report)
    attr = {a.name: a.f for a in out.graph.node[0].attribute}
    assert attr["alpha"] == pytest.approx(alpha, rel=1e-6)
    same_outputs(model, out)

@pytest.mark.parametrize(
    "inputs,body",
    [
        ("float[2,5,8] x, float[2,5,8] z", "s = Sigmoid(z)\ny = Mul(x, s)"),  # sigmoid of another tensor
        ("float[2,5,8] x", "c = Constant <value = float {1.0}> ()\nxc = Add(x, c)\ns = Sigmoid(xc)\ny = Mul(x, s)"),
    ],
)
def test_quick_gelu_near_misses(inputs, body):
    model = parse(f"g ({inputs}) => (float[2,5,8] y) {{\n{body}}}")
    out, report = fuse(model, QUICK)
    assert report.counts[QUICK.name] == 0

def test_quick_gelu_refuses_sigmoid_graph_output():
    model = parse("g (float[2,5,8] x) => (float[2,5,8] y, float[2,5,8] s) {\ns = Sigmoid(x)\ny = Mul(x, s)}")
    out, report = fuse(model, QUICK)
    assert report.counts[QUICK.name] == 0
