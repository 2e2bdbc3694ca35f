"""conv-bias-into-elementwise: a Conv's bias moves into the FusedElementwise region reading its output."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from test_fuse_elementwise import assert_same, fused_nodes, needs_library, parse, program_of

from helpers import load_testdata, optimize

RULE = "conv-bias-into-elementwise"
RNG = np.random.default_rng(3)
W = numpy_helper.from_array(RNG.standard_normal((6, 4, 3, 3)).astype(np.float32), "W")
B = numpy_helper.from_array(RNG.standard_normal(6).astype(np.float32), "B")
W2 = numpy_helper.from_array(RNG.standard_normal((6, 6, 1, 1)).astype(np.float32), "W2")


def lift(model):
    out, report = optimize(model, only=f"{RULE},fuse-elementwise")
    onnx.checker.check_model(out)
    return out, report


def reasons(report):
    return {r.node: r.reason for r in report.refusals if r.rule == RULE}


def conv_inputs(model):
    return [list(n.input) for n in model.graph.node if n.op_type == "Conv"]


SILU = """
    g (float[2,4,8,8] x) => (float[2,6,8,8] y) {
        c = Conv <pads = [1, 1, 1, 1]> (x, W, B)
        s = Sigmoid(c)
        y = Mul(c, s)
    }
"""


@needs_library
def test_silu_after_conv_takes_the_bias():
    m = parse(SILU, inits=[W, B])
    out, report = lift(m)
    assert report.counts[RULE] == 1 and report.counts["fuse-elementwise"] == 1
    assert conv_inputs(out) == [["x", "W"]]  # the Conv lost its bias
    (node,) = fused_nodes(out)
    assert len(node.input) == 2  # the conv output and the bias, shaped [6,1,1]
    bias = next(i for i in out.graph.initializer if i.name == node.input[1])
    assert list(bias.dims) == [6, 1, 1]
    np.testing.assert_array_equal(numpy_helper.to_array(bias).ravel(), numpy_helper.to_array(B))
    assert "Add(" in program_of(node) and "Sigmoid(" in program_of(node)
    # The CPU Conv adds its bias inside the accumulation, so the two differ by a rounding of the
    # conv sum (on CUDA, cuDNN adds it in a second pass: the same single rounding as the region's).
    assert_same(m, out, rtol=1e-6, atol=1e-5)


@needs_library
def test_relu_after_conv_becomes_a_two_op_region():
    m = parse("""
        g (float[2,4,8,8] x) => (float[2,6,8,8] y) {
            c = Conv <pads = [1, 1, 1, 1]> (x, W, B)
            y = Relu(c)
        }
    """, inits=[W, B])
    out, report = lift(m)
    assert report.counts[RULE] == 1
    assert [n.op_type for n in out.graph.node] == ["Conv", "FusedElementwise"]
    assert_same(m, out, rtol=1e-6, atol=1e-5)


def test_refused_when_a_reader_is_not_elementwise():
    m = parse("""
        g (float[2,4,8,8] x) => (float[2,6,8,8] y, float[2,6,1,1] p) {
            c = Conv <pads = [1, 1, 1, 1]> (x, W, B)
            s = Sigmoid(c)
            y = Mul(c, s)
            p = GlobalAveragePool(c)
        }
    """, inits=[W, B])
    out, report = lift(m)
    assert report.counts[RULE] == 0
    assert "GlobalAveragePool" in next(iter(reasons(report).values()))
    assert conv_inputs(out) == [["x", "W", "B"]]


def test_refused_when_the_output_is_a_graph_output():
    m = parse("""
        g (float[2,4,8,8] x) => (float[2,6,8,8] c, float[2,6,8,8] y) {
            c = Conv <pads = [1, 1, 1, 1]> (x, W, B)
            y = Relu(c)
        }
    """, inits=[W, B])
    out, report = lift(m)
    assert report.counts[RULE] == 0
    assert list(reasons(report).values()) == ["its output is a graph output"]


def test_refused_and_graph_untouched_when_no_region_forms():
    # The Conv's only reader is elementwise, but one fuse-elementwise refuses (Cast to int8 is not in
    # the language): the trial finds no region, and the graph is left exactly as it was.
    m = parse("""
        g (float[2,4,8,8] x) => (int8[2,6,8,8] y) {
            c = Conv <pads = [1, 1, 1, 1]> (x, W, B)
            y = Cast <to = 3> (c)
        }
    """, inits=[W, B])
    before = m.SerializeToString()
    out, report = lift(m)
    assert m.SerializeToString() == before
    assert report.counts[RULE] == 0 and report.counts["fuse-elementwise"] == 0
    assert list(reasons(report).values()) == ["the Conv's readers do not form a fused region with the bias Add"]
    assert conv_inputs(out) == [["x", "W", "B"]] and [n.op_type for n in out.graph.node] == ["Conv", "Cast"]


def test_no_bias_is_not_reported():
    m = parse("""
        g (float[2,4,8,8] x) => (float[2,6,8,8] y) {
            c = Conv <pads = [1, 1, 1, 1]> (x, W)
            s = Sigmoid(c)
            y = Mul(c, s)
        }
    """, inits=[W])
    out, report = lift(m)
    assert report.counts[RULE] == 0 and reasons(report) == {}


@needs_library
def test_residual_add_after_projection_conv():
    m = parse("""
        g (float[2,6,8,8] x) => (float[2,6,8,8] y) {
            c = Conv (x, W2, B)
            y = Add(c, x)
        }
    """, inits=[W2, B])
    out, report = lift(m)
    assert report.counts[RULE] == 1
    assert [n.op_type for n in out.graph.node] == ["Conv", "FusedElementwise"]
    assert_same(m, out, rtol=1e-6, atol=1e-6)


@needs_library
def test_real_efficientnet_blocks():
    m = load_testdata("efficientnet_blocks_opset13.onnx")
    out, report = optimize(m)
    # 26 Convs: every one whose output only feeds a SiLU, the SE gate or a residual Add gives its bias
    # to that region (24); the other two feed a Conv or GlobalAveragePool directly.
    assert report.counts[RULE] == 24
    assert sum(len(n.input) == 3 for n in out.graph.node if n.op_type == "Conv") == 2
    assert_same(m, out, rtol=1e-4, atol=1e-5, dims={"batch": 2})


def test_lifted_adds_of_unnamed_convs_get_distinct_names():
    m = parse("""
        g (float[2,4,8,8] x) => (float[2,6,8,8] y) {
            c = Conv <pads = [1, 1, 1, 1]> (x, W, B)
            r = Relu(c)
            c2 = Conv (r, W2, B)
            y = Relu(c2)
        }
    """, inits=[W, B, W2])
    out, report = optimize(m, only=RULE)  # the Adds stay visible without fuse-elementwise
    assert report.counts[RULE] == 2
    adds = [n.name for n in out.graph.node if n.op_type == "Add"]
    assert len(adds) == 2 and len(set(adds)) == 2, adds
    assert sorted(d["add"] for d in report.details if d["rule"] == RULE) == sorted(adds)


@needs_library
@pytest.mark.parametrize("group", [1, 2])
def test_a_conv_transpose_bias_moves_into_its_activation(group):
    """ConvTranspose's bias is a pass of its own too (cuDNN's AddTensor after the backward-data
    convolution): it moves into the Relu's region. Output channels are the weight's second dimension times
    ``group`` (a DB detector's head upsamples 64 → 64 channels by 2)."""
    wt = numpy_helper.from_array(RNG.standard_normal((4, 6 // group, 2, 2)).astype(np.float32), "WT")
    bt = numpy_helper.from_array(RNG.standard_normal(6).astype(np.float32), "BT")
    m = parse(f"""
        g (float[2,4,8,8] x) => (float[2,6,16,16] y) {{
            c = ConvTranspose <strides = [2, 2], group = {group}> (x, WT, BT)
            y = Relu(c)
        }}
    """, inits=[wt, bt])
    out, report = lift(m)
    assert report.counts[RULE] == 1
    assert [n.op_type for n in out.graph.node] == ["ConvTranspose", "FusedElementwise"]
    assert [list(n.input) for n in out.graph.node if n.op_type == "ConvTranspose"] == [["x", "WT"]]
    assert "Add(" in program_of(fused_nodes(out)[0])
    assert_same(m, out, rtol=1e-6, atol=1e-5)


def test_a_conv_transpose_bias_of_the_wrong_length_is_refused():
    wt = numpy_helper.from_array(RNG.standard_normal((4, 6, 2, 2)).astype(np.float32), "WT")
    bt = numpy_helper.from_array(RNG.standard_normal(4).astype(np.float32), "BT")  # the input channels' count
    m = parse("""
        g (float[2,4,8,8] x) => (float[2,6,16,16] y) {
            c = ConvTranspose <strides = [2, 2]> (x, WT, BT)
            y = Relu(c)
        }
    """, inits=[wt, bt])
    out, report = optimize(m, only=f"{RULE},fuse-elementwise")
    assert RULE not in report.counts or report.counts[RULE] == 0
    assert "bias is not one value per output channel" in reasons(report).values()
