"""contrib-channels-last (issue 34): Conv regions on NHWC tensors, one Transpose per boundary.

ONNX Runtime runs ``NhwcConv`` on CUDA only, so on this CPU machine the optimized graph is checked through
an independent stand-in: every ``NhwcConv(x, w)`` replaced by ``Transpose(Conv(Transpose(x), Transpose(w)))``
(the definition of the op, which takes its weight channels-last), run on ONNX Runtime's CPU provider and
compared with the original. The GPU test
(tests/gpu/test_channels_last_gpu.py) runs the real op.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxfuse
from helpers import load_testdata, make_model, op_types, vi
from onnxfuse.custom_ops import session_options
from onnxfuse.rewrites.contrib.contrib_channels_last import TO_NCHW, TO_NHWC

RULE = "contrib-channels-last"


def nchw_stand_in(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every com.microsoft NhwcConv written as Transpose → Conv → Transpose (NCHW), its
    channels-last weight [M, kH, kW, C/group] transposed back to Conv's [M, C/group, kH, kW]."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for k, n in enumerate(model.graph.node):
        if n.op_type != "NhwcConv" or n.domain != "com.microsoft":
            nodes.append(n)
            continue
        x, w, y = f"stand_in_{k}_x", f"stand_in_{k}_w", f"stand_in_{k}_y"
        nodes.append(helper.make_node("Transpose", [n.input[0]], [x], perm=TO_NCHW))
        nodes.append(helper.make_node("Transpose", [n.input[1]], [w], perm=TO_NCHW))  # [M, kH, kW, C/g] → [M, C/g, kH, kW]
        conv = helper.make_node("Conv", [x, w, *n.input[2:]], [y], name=f"stand_in_{k}")
        conv.attribute.extend(n.attribute)
        nodes.append(conv)
        nodes.append(helper.make_node("Transpose", [y], [n.output[0]], perm=TO_NHWC))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    onnx.checker.check_model(out)
    return out


def run(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def channels_last(model):
    return onnxfuse.optimize(model, only=f"+{RULE}", validate=False, bench=False)


CNNS = [  # name, input size, Transposes left (region boundaries the graph cannot avoid)
    ("mobilenet_v2_w035", (2, 3, 96, 96), 2),
    ("mobilenet_v3_small_w025_opset13", (2, 3, 64, 64), 2),
    ("efficientnet_blocks_opset13", (2, 3, 64, 64), 2),
    ("convnext_blocks_opset13", (2, 3, 32, 32), 2),  # its own permutes around LayerNorm cancel ours
    ("yolo_conv_bn_silu_opset13", (2, 3, 64, 64), 2),  # in and out: its nearest Resize takes NHWC scales
]


@pytest.mark.parametrize("name,size,transposes", CNNS)
def test_every_conv_goes_channels_last_and_the_outputs_stay(name, size, transposes):
    model = load_testdata(name)
    result = channels_last(model)
    ops = op_types(result.model)
    assert ops.count("NhwcConv") == op_types(model).count("Conv") and "Conv" not in ops
    assert ops.count("Transpose") == transposes
    x = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    feeds = {model.graph.input[0].name: x}
    want, got = run(model, feeds), run(nchw_stand_in(result.model), feeds)
    for a, b in zip(want, got):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(a).max())))


def _two_conv_model(extra_output=False, bias_shape=(4, 1, 1)):
    rng = np.random.default_rng(1)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "w2")
    b = numpy_helper.from_array(rng.standard_normal(bias_shape).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Sigmoid", ["c1"], ["s"]),
             helper.make_node("Add", ["s", "b"], ["a"]),  # per channel, after a Sigmoid: no fold takes it
             helper.make_node("Relu", ["a"], ["m"]),
             helper.make_node("Conv", ["m", "w2"], ["y"])]
    outputs = [vi("y", [2, 4, 8, 8])] + ([vi("m", [2, 4, 8, 8])] if extra_output else [])
    return make_model(nodes, [vi("x", [2, 3, 8, 8])], outputs, [w1, w2, b], opset=17)


@pytest.mark.parametrize("bias_shape", [(4, 1, 1), (1, 4, 1, 1)])
def test_a_constant_operand_is_permuted_and_an_inner_graph_output_keeps_its_name(bias_shape):
    model = _two_conv_model(extra_output=True, bias_shape=bias_shape)
    result = channels_last(model)
    assert any(i.name.startswith("b/nhwc") and list(i.dims) == [1, 1, 1, 4] for i in result.model.graph.initializer)
    detail = next(d for d in result.applied.details if d["rule"] == RULE)
    assert detail["convs"] == 2 and detail["transposes_in"] == 1 and detail["transposes_out"] == 2
    assert [o.name for o in result.model.graph.output] == ["y", "m"]
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    want, got = run(model, {"x": x}), run(nchw_stand_in(result.model), {"x": x})
    for a, b in zip(want, got):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_a_region_of_one_conv_is_refused_with_the_reason():
    w = numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")
    model = make_model([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
                       [vi("x", [1, 3, 4, 4])], [vi("y", [1, 4, 4, 4])], [w], opset=17)
    result = channels_last(model)
    assert "NhwcConv" not in op_types(result.model)
    reasons = [r.reason for r in result.applied.refusals if r.rule == RULE]
    assert reasons and "a region of 1 Conv" in reasons[0]


@pytest.mark.parametrize("pool, written", [("GlobalAveragePool", "ChannelsLastMean"), ("GlobalMaxPool", "ReduceMax")])
def test_axis_ops_are_renumbered(pool, written):
    """Split and Slice over channels, Concat of the pieces, a global pool: axes 1 → 3, GlobalAveragePool →
    our ChannelsLastMean (its CPU kernel runs here), GlobalMaxPool → ReduceMax over [1, 2]."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1"),
             numpy_helper.from_array(rng.standard_normal((4, 8, 1, 1)).astype(np.float32), "w2"),
             numpy_helper.from_array(np.array([4, 4], np.int64), "halves"),
             numpy_helper.from_array(np.array([2], np.int64), "start"),
             numpy_helper.from_array(np.array([6], np.int64), "end"),
             numpy_helper.from_array(np.array([1], np.int64), "axis")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Split", ["c1", "halves"], ["p", "q"], axis=1),
             helper.make_node("Slice", ["c1", "start", "end", "axis"], ["r"]),
             helper.make_node("Concat", ["q", "p"], ["pq"], axis=-3),
             helper.make_node("Conv", ["pq", "w2"], ["c2"]),
             helper.make_node("Concat", ["c2", "r"], ["cr"], axis=1),
             helper.make_node(pool, ["cr"], ["y"])]
    model = make_model(nodes, [vi("x", [2, 3, 6, 6])], [vi("y", [2, 8, 1, 1])], inits, opset=17)
    result = channels_last(model)
    ops = op_types(result.model)
    assert ops.count("NhwcConv") == 2 and ops.count("Transpose") == 2 and pool not in ops
    assert ops.count(written) == 1 and "ReduceMean" not in ops
    x = rng.standard_normal((2, 3, 6, 6)).astype(np.float32)
    np.testing.assert_allclose(run(nchw_stand_in(result.model), {"x": x})[0], run(model, {"x": x})[0],
                               rtol=1e-5, atol=1e-5)


def test_an_operand_of_another_rank_keeps_the_op_out_of_the_region():
    """A rank-2 non-constant operand does not broadcast the same way once the data is NHWC: that Mul stays
    NCHW, the two Convs around it are separate regions of one Conv each, and nothing changes."""
    w = numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c1"]), helper.make_node("Mul", ["c1", "g"], ["m"]),
             helper.make_node("Conv", ["m", "w"], ["y"])]
    model = make_model(nodes, [vi("x", [1, 4, 4, 4]), vi("g", [4, 4])], [vi("y", [1, 4, 4, 4])], [w], opset=17)
    result = channels_last(model)
    assert "NhwcConv" not in op_types(result.model)


def test_validated_on_the_cpu_through_the_stand_in():
    """NhwcConv has no CPU kernel: validating here, the CPU provider runs it as its definition
    (runtime/stand_ins.py), so the rewrite is checked and written; a rewrite that broke the function
    would fail there (a weight left in Conv's order, planted below, is caught)."""
    from onnxfuse.runtime.session import make_session

    model = _two_conv_model()
    result = onnxfuse.optimize(model, only=f"+{RULE}", provider="cpu", bench=False)
    assert result.validation.passed and op_types(result.model).count("NhwcConv") == 2
    broken = onnx.ModelProto()
    broken.CopyFrom(result.model)
    conv = next(n for n in broken.graph.node if n.op_type == "NhwcConv")
    weight = next(i for i in broken.graph.initializer if i.name == conv.input[1])
    w = numpy_helper.to_array(weight)  # [4, 3, 3, 3] channels-last
    weight.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(w.transpose(TO_NCHW)).reshape(w.shape), weight.name))
    x = {"x": np.random.default_rng(5).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    want = run(model, x)[0]
    np.testing.assert_allclose(make_session(result.model, "cpu").run(None, x)[0], want, rtol=1e-5, atol=1e-5)
    assert np.abs(make_session(broken, "cpu").run(None, x)[0] - want).max() > 1e-2


def test_float16_convs_are_taken_too():
    model = load_testdata("conv_bn_fp16")
    result = channels_last(model)
    convs = op_types(model).count("Conv")
    assert op_types(result.model).count("NhwcConv") == (convs if convs >= 2 else 0)
    assert TensorProto.FLOAT16 in {i.data_type for i in result.model.graph.initializer}


def test_a_tensor_an_if_branch_reads_from_outside_stays_nchw_under_its_name():
    """The If's branches read the region's ``m`` as an outer value (by name): ``m`` is written again, NCHW,
    by the region's exit Transpose, and both branches give the original's result."""
    rng = np.random.default_rng(4)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "w2")
    branch = [vi("t", [2, 4, 8, 8])], [vi("e", [2, 4, 8, 8])]
    then_g = helper.make_graph([helper.make_node("Neg", ["m"], ["t"])], "then", [], branch[0])
    else_g = helper.make_graph([helper.make_node("Abs", ["m"], ["e"])], "else", [], branch[1])
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Sigmoid", ["c1"], ["s"]),
             helper.make_node("Mul", ["c1", "s"], ["m"]), helper.make_node("Conv", ["m", "w2"], ["y"]),
             helper.make_node("If", ["cond"], ["z"], then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [vi("x", [2, 3, 8, 8]), vi("cond", [], TensorProto.BOOL)],
                       [vi("y", [2, 4, 8, 8]), vi("z", [2, 4, 8, 8])], [w1, w2], opset=17)
    result = channels_last(model)
    assert op_types(result.model).count("NhwcConv") == 2
    writer = next(n for n in result.model.graph.node if "m" in n.output)
    assert writer.op_type == "Transpose" and list(writer.attribute[0].ints) == TO_NCHW
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    for cond in (True, False):
        feeds = {"x": x, "cond": np.array(cond)}
        for a, b in zip(run(model, feeds), run(nchw_stand_in(result.model), feeds)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_the_report_says_the_output_needs_the_cuda_provider():
    """A model with NhwcConv runs on ONNX Runtime's CUDA provider only: the report says so (JSON
    ``cuda_only_ops``, schema-valid; Markdown); a model without such an op has no such key."""
    jsonschema = pytest.importorskip("jsonschema")
    from onnxfuse.reports import load_schema
    from onnxfuse.reports.optimize_report import optimize_markdown

    result = channels_last(load_testdata("yolo_conv_bn_silu_opset13"))
    doc = result.to_json()
    assert doc["result"]["cuda_only_ops"] == ["com.microsoft::NhwcConv"]
    jsonschema.validate(doc, load_schema(), cls=jsonschema.Draft202012Validator)
    assert "needs ONNX Runtime's CUDA provider (com.microsoft::NhwcConv)" in optimize_markdown(result)
    plain = onnxfuse.optimize(load_testdata("yolo_conv_bn_silu_opset13"), validate=False, bench=False)
    assert "cuda_only_ops" not in plain.to_json()["result"]


def _resize_model(mode="nearest", by="scales", **attrs):
    """Conv → Resize (×2 along H and W) → Conv, the Resize given constant scales or sizes."""
    rng = np.random.default_rng(5)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 8, 3, 3)).astype(np.float32), "w2")
    if by == "scales":
        target = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "target")
        resize_inputs = ["c1", "", "target"]
    else:
        target = numpy_helper.from_array(np.array([2, 8, 10, 14], np.int64), "target")  # H 5→10, W 7→14
        resize_inputs = ["c1", "", "", "target"]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Resize", resize_inputs, ["r"], mode=mode, **attrs),
             helper.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1])]
    return make_model(nodes, [vi("x", [2, 3, 5, 7])], [vi("y", [2, 4, 10, 14])], [w1, w2, target], opset=17)


@pytest.mark.parametrize("by,attrs", [
    ("scales", dict(coordinate_transformation_mode="asymmetric", nearest_mode="floor")),  # torch's nearest
    ("scales", dict(coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil")),
    ("sizes", dict(coordinate_transformation_mode="align_corners", nearest_mode="round_prefer_floor")),
    ("sizes", dict(coordinate_transformation_mode="pytorch_half_pixel", nearest_mode="ceil")),
])
def test_a_nearest_resize_takes_nhwc_scales_inside_the_region(by, attrs):
    """A nearest Resize joins the region with its scales or sizes permuted like the data ([1, 2, 2, 1]):
    no transpose around it, and the outputs equal the original's."""
    model = _resize_model(by=by, **attrs)
    result = channels_last(model)
    ops = op_types(result.model)
    assert ops.count("NhwcConv") == 2 and ops.count("Transpose") == 2 and "Resize" in ops
    resize = next(n for n in result.model.graph.node if n.op_type == "Resize")
    values = {i.name: numpy_helper.to_array(i) for i in result.model.graph.initializer}
    permuted = values[[t for t in resize.input if t][-1]]
    assert permuted.tolist() == ([1, 2, 2, 1] if by == "scales" else [2, 10, 14, 8])
    x = np.random.default_rng(6).standard_normal((2, 3, 5, 7)).astype(np.float32)
    want, got = run(model, {"x": x}), run(nchw_stand_in(result.model), {"x": x})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode,attrs", [("linear", {}), ("nearest", dict(coordinate_transformation_mode="tf_crop_and_resize"))])
def test_a_linear_or_cropping_resize_stays_a_boundary(mode, attrs):
    """Only nearest resizing (measured in NHWC on CUDA) joins a region; linear and cubic ones and
    tf_crop_and_resize (which reads a roi) stay NCHW: each Conv is then a region of one, refused, so
    nothing changes."""
    model = _resize_model(mode=mode, **attrs)
    result = channels_last(model)
    assert "NhwcConv" not in op_types(result.model) and "Transpose" not in op_types(result.model)
