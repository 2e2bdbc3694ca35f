"""contrib-channel-transpose: a Transpose NCHW ↔ NHWC of a tensor with few channels → ai.onnxfuse
ChannelTranspose.

Two levels, each against an independent reference: the op itself (ONNX Runtime's CPU provider running the
library's CPU kernel) against NumPy's transpose, bit for bit, over float32, float16 and bfloat16, both
directions, channel counts from 1 to the op's limit and pixel counts that leave a partial tile; and the
rule on graphs (a channels-last region's boundary transposes, a lone transpose) against the original
graph on ONNX Runtime, plus its refusals. The CUDA kernel runs the same op cases in
tests/gpu/test_channel_transpose_gpu.py."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

import helpers
from contrib_testlib import fuse, ops, refusals
from onnxfuse.custom_ops import DOMAIN, session_options
from onnxfuse.rewrites.contrib.contrib_channel_transpose import MAX_CHANNELS, ContribChannelTranspose

RULE = ContribChannelTranspose()
OP = f"{DOMAIN}:ChannelTranspose"
PERMS = {"nhwc": (0, 2, 3, 1), "nchw": (0, 3, 1, 2)}


def op_model(direction: str, elem: int) -> onnx.ModelProto:
    """One ChannelTranspose node; a bfloat16 tensor (which numpy cannot hand to ONNX Runtime) behind
    float32 Casts, which are exact for values that are bfloat16 already."""
    nodes, x, y = [], "x", "y"
    io = TP.FLOAT if elem == TP.BFLOAT16 else elem
    if elem == TP.BFLOAT16:
        nodes.append(h.make_node("Cast", ["x"], ["x16"], to=TP.BFLOAT16))
        x, y = "x16", "y16"
    nodes.append(h.make_node("ChannelTranspose", [x], [y], domain=DOMAIN, spec=f"to={direction}", name="ct"))
    if elem == TP.BFLOAT16:
        nodes.append(h.make_node("Cast", ["y16"], ["y"], to=TP.FLOAT))
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", io, None)], [h.make_tensor_value_info("y", io, None)])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)], ir_version=8)


def run(model, feeds, provider="CPUExecutionProvider"):
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=[provider])
    return sess.run(None, feeds)[0]


def sample(shape, elem, seed=0):
    """Random values of the element type (bfloat16 ones as float32 holding bfloat16 values), signed zeros,
    infinities and a NaN among them: a copy must keep every bit."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[:4] = [-0.0, np.inf, -np.inf, np.nan][: flat.size]
    if elem == TP.FLOAT16:
        return x.astype(np.float16)
    if elem == TP.BFLOAT16:
        return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    return x


OP_CASES = [(d, c, hw) for d in ("nhwc", "nchw") for c, hw in ((1, (3, 5)), (3, (7, 9)), (4, (1, 1)), (31, (4, 33)),
                                                                (64, (2, 3)))]


@pytest.mark.parametrize("elem", [TP.FLOAT, TP.FLOAT16, TP.BFLOAT16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("direction,c,hw", OP_CASES)
def test_the_op_is_numpy_transpose_bit_for_bit(direction, c, hw, elem):
    shape = (2, c, *hw) if direction == "nhwc" else (2, *hw, c)
    x = sample(shape, elem)
    got = run(op_model(direction, elem), {"x": x})
    want = np.ascontiguousarray(x.transpose(PERMS[direction]))
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


def test_the_op_refuses_more_channels_than_its_tile_in_one_line():
    with pytest.raises(Exception, match=r"ChannelTranspose node 'ct'.*65 channels; the op takes at most 64"):
        run(op_model("nhwc", TP.FLOAT), {"x": np.zeros((1, 65, 2, 2), np.float32)})


@pytest.mark.parametrize("spec", ["to=nwhc", "direction=nhwc", ""])
def test_a_malformed_spec_fails_session_creation_naming_the_node(spec):
    model = op_model("nhwc", TP.FLOAT)
    model.graph.node[0].attribute[0].s = spec.encode()
    with pytest.raises(Exception, match=r"ChannelTranspose node 'ct'"):
        run(model, {"x": np.zeros((1, 3, 2, 2), np.float32)})


# --- the rule --------------------------------------------------------------------------------------------


def transpose_model(perm, shape, elem=TP.FLOAT) -> onnx.ModelProto:
    """x → Relu → Transpose(perm) → y, shapes declared (the rule reads the channel count from them)."""
    out_shape = [shape[p] for p in perm] if len(perm) == len(shape) else None
    graph = h.make_graph(
        [h.make_node("Relu", ["x"], ["r"]), h.make_node("Transpose", ["r"], ["y"], perm=list(perm), name="t")], "g",
        [h.make_tensor_value_info("x", elem, shape)], [h.make_tensor_value_info("y", elem, out_shape)],
        value_info=[h.make_tensor_value_info("r", elem, shape)])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


@pytest.mark.parametrize("perm,shape", [((0, 2, 3, 1), [2, 3, 5, 7]), ((0, 3, 1, 2), [2, 5, 7, 31]),
                                        ((0, 2, 3, 1), ["batch", 3, "h", "w"])])
def test_a_few_channel_layout_transpose_becomes_the_op_and_computes_the_same(perm, shape):
    model = transpose_model(perm, shape)
    out, report = fuse(model, RULE)
    assert ops(out) == {"Relu": 1, OP: 1} and report.counts[RULE.name] == 1
    concrete = [d if isinstance(d, int) else 4 for d in shape]
    x = np.random.default_rng(1).standard_normal(concrete).astype(np.float32)
    want = run(model, {"x": x})
    assert np.array_equal(run(out, {"x": x}), want)


@pytest.mark.parametrize("perm,shape,elem,reason", [
    ((0, 2, 3, 1), [2, MAX_CHANNELS, 5, 7], TP.FLOAT, "32 channels"),
    ((0, 3, 1, 2), [2, 5, 7, 40], TP.FLOAT, "40 channels"),
    ((0, 2, 3, 1), [2, "c", 5, 7], TP.FLOAT, "channel count is not known"),
    ((0, 2, 1, 3), [2, 3, 5, 7], TP.FLOAT, "neither NCHW"),
    ((0, 2, 1), [2, 3, 5], TP.FLOAT, "neither NCHW"),
    ((0, 2, 3, 1), [2, 3, 5, 7], TP.INT64, "int64"),
])
def test_refusals(perm, shape, elem, reason):
    model = transpose_model(perm, shape, elem)
    out, report = fuse(model, RULE)
    assert OP not in ops(out)
    assert any(reason in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_a_channels_last_region_gets_the_op_at_its_few_channel_boundaries_and_validates():
    """The zoo-style YOLO block under contrib-channels-last: its 3-channel input and 27-channel output cross
    the region boundary through ChannelTranspose, and the optimized model matches the original (the CPU
    provider runs NhwcConv as its definition and ChannelTranspose's CPU kernel)."""
    import onnxfuse

    model = helpers.load_testdata("yolo_conv_bn_silu_opset13")
    result = onnxfuse.optimize(model, only="+contrib-channels-last,+contrib-channel-transpose", bench=False,
                               provider="cpu")
    found = [n for n in result.model.graph.node if n.op_type in ("Transpose", "ChannelTranspose")]
    assert sorted((n.op_type, n.attribute[0].s.decode()) for n in found) == [
        ("ChannelTranspose", "to=nchw"), ("ChannelTranspose", "to=nhwc")]
    assert result.validation.passed and result.applied.counts["contrib-channel-transpose"] == 2
