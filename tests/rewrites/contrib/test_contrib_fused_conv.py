"""Conv (+ Add) + Relu → com.microsoft FusedConv."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_testlib import fuse, ops, parse, refusals, same_outputs, to_dtype

from onnxfuse.rewrites.contrib.contrib_fused_conv import ContribFusedConv

CONV = ContribFusedConv()
RNG = np.random.default_rng(0)
W = {"W": RNG.standard_normal((4, 3, 3, 3)).astype(np.float32), "B": RNG.standard_normal(4).astype(np.float32)}


def conv_model(body, inputs="float[1,3,8,8] x", outputs="float[1,4,8,8] y", inits=W):
    return parse(f"g ({inputs}) => ({outputs}) {{\n{body}\n}}", inits=inits)


def test_conv_relu():
    m = conv_model("c = Conv <pads = [1, 1, 1, 1]> (x, W, B)\ny = Relu(c)")
    out, report = fuse(m, CONV)
    assert ops(out) == {"com.microsoft:FusedConv": 1}, refusals(report)
    node = out.graph.node[0]
    attrs = {a.name: a for a in node.attribute}
    assert attrs["activation"].s == b"Relu" and list(attrs["pads"].ints) == [1, 1, 1, 1]
    same_outputs(m, out)


@pytest.mark.parametrize("order", ["Add(c, z)", "Add(z, c)"])
def test_conv_add_relu(order):
    m = conv_model(f"c = Conv <pads = [1, 1, 1, 1]> (x, W, B)\ns = {order}\ny = Relu(s)",
                   inputs="float[1,3,8,8] x, float[1,4,8,8] z")
    out, report = fuse(m, CONV)
    assert ops(out) == {"com.microsoft:FusedConv": 1}, refusals(report)
    assert list(out.graph.node[0].input) == ["x", "W", "B", "z"]
    same_outputs(m, out)


def test_conv_without_bias_add_relu():
    m = conv_model("c = Conv <pads = [1, 1, 1, 1]> (x, W)\ns = Add(c, z)\ny = Relu(s)",
                   inputs="float[1,3,8,8] x, float[1,4,8,8] z", inits={"W": W["W"]})
    out, report = fuse(m, CONV)
    assert ops(out) == {"com.microsoft:FusedConv": 1}, refusals(report)
    assert list(out.graph.node[0].input) == ["x", "W", "", "z"]
    same_outputs(m, out)


def test_conv_relu_fp16_refused():
    m = to_dtype(conv_model("c = Conv <pads = [1, 1, 1, 1]> (x, W, B)\ny = Relu(c)"), np.float16)
    out, report = fuse(m, CONV)
    assert report.counts[CONV.name] == 0
    assert any("float16" in r for r in refusals(report, CONV)), refusals(report)


@pytest.mark.parametrize(
    "body,inputs,outputs,why",
    [
        # broadcast Add (per-channel tensor): cuDNN adds Z without broadcasting
        ("c = Conv <pads = [1, 1, 1, 1]> (x, W, B)\ns = Add(c, z)\ny = Relu(s)", "float[1,3,8,8] x, float[1,4,1,1] z",
         "float[1,4,8,8] y", "not provably"),
        # Conv output also a graph output
        ("c = Conv <pads = [1, 1, 1, 1]> (x, W, B)\ny = Relu(c)", "float[1,3,8,8] x", "float[1,4,8,8] y, float[1,4,8,8] c",
         "graph output"),
        # other activation
        ("c = Conv <pads = [1, 1, 1, 1]> (x, W, B)\ny = Sigmoid(c)", "float[1,3,8,8] x", "float[1,4,8,8] y", "not Relu"),
        # Add result read twice
        ("c = Conv <pads = [1, 1, 1, 1]> (x, W, B)\ns = Add(c, z)\ny = Relu(s)", "float[1,3,8,8] x, float[1,4,8,8] z",
         "float[1,4,8,8] y, float[1,4,8,8] s", "graph output"),
        # Add of the Conv output to itself
        ("c = Conv <pads = [1, 1, 1, 1]> (x, W, B)\ns = Add(c, c)\ny = Relu(s)", "float[1,3,8,8] x", "float[1,4,8,8] y",
         "itself"),
    ],
)
def test_fused_conv_near_misses(body, inputs, outputs, why):
    m = conv_model(body, inputs=inputs, outputs=outputs)
    out, report = fuse(m, CONV)
    assert report.counts[CONV.name] == 0
    assert any(why in r for r in refusals(report, CONV)), refusals(report)
