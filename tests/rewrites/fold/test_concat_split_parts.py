"""concat-split-parts: a Concat of a Split's parts in order (or of Slices tiling a tensor) reads the tensor
itself, and parts nobody reads any more are not written. Pure data movement, so the outputs must be
bit-identical to the original's on ONNX Runtime's CPU provider."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from helpers import make_model, op_types, optimize, snapshot, vi

RULE = "concat-split-parts"


def run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


def c(name, values):
    return numpy_helper.from_array(np.asarray(values, np.int64), name)


def split_model(order=(0, 1), concat_axis=1, sizes=(3, 5), opset=13, part_output=False):
    """x [2, 8, 4, 4] → Split along 1 into ``sizes`` → Concat(parts in ``order``, Relu(part 1)) along ``concat_axis``."""
    inits = []
    if sizes is not None and opset >= 13:
        inits.append(c("sizes", sizes))
        split = helper.make_node("Split", ["x", "sizes"], ["p0", "p1"], axis=1)
    elif sizes is not None:
        split = helper.make_node("Split", ["x"], ["p0", "p1"], axis=1, split=list(sizes))
    else:
        split = helper.make_node("Split", ["x"], ["p0", "p1"], axis=-3)
    nodes = [split, helper.make_node("Relu", ["p1"], ["r"]),
             helper.make_node("Concat", [f"p{k}" for k in order] + ["r"], ["y"], axis=concat_axis)]
    outputs = [vi("y", None)] + ([vi("p0", None)] if part_output else [])
    return make_model(nodes, [vi("x", [2, 8, 4, 4])], outputs, inits, opset=opset)


@pytest.mark.parametrize("sizes,opset", [((3, 5), 13), ((3, 5), 11), (None, 13)])
def test_a_concat_of_a_splits_parts_reads_the_tensor_and_the_unread_part_is_not_written(sizes, opset):
    model = split_model(sizes=sizes, opset=opset)
    out, report = optimize(model, only=RULE)
    assert report.counts.get(RULE) == 1
    assert "Split" not in op_types(out) and op_types(out).count("Slice") == 1  # only part 1, for the Relu
    concat = next(n for n in out.graph.node if n.op_type == "Concat")
    assert concat.input[0] == "x" and len(concat.input) == 2
    slice_node = next(n for n in out.graph.node if n.op_type == "Slice")
    bounds = {i.name: numpy_helper.to_array(i).tolist() for i in out.graph.initializer}
    half = 4 if sizes is None else sizes[0]
    assert [bounds[slice_node.input[k]] for k in (1, 2, 3)] == [[half], [8], [1]]
    x = np.random.default_rng(0).standard_normal((2, 8, 4, 4)).astype(np.float32)
    want, got = run(model, x), run(out, x)
    assert all(np.array_equal(a, b) for a, b in zip(want, got))


def test_a_part_still_read_elsewhere_keeps_the_split():
    model = split_model(part_output=True)
    out, report = optimize(model, only=RULE)
    assert report.counts.get(RULE) == 1 and "Split" in op_types(out)
    x = np.random.default_rng(1).standard_normal((2, 8, 4, 4)).astype(np.float32)
    assert all(np.array_equal(a, b) for a, b in zip(run(model, x), run(out, x)))


@pytest.mark.parametrize("kwargs", [dict(order=(1, 0)), dict(concat_axis=2), dict(order=(0,))])
def test_parts_out_of_order_on_another_axis_or_missing_are_left_alone(kwargs):
    model = split_model(**kwargs) if kwargs.get("concat_axis") != 2 else None
    if model is None:  # along H the parts' channels differ: concatenate two same-shaped halves instead
        nodes = [helper.make_node("Split", ["x"], ["p0", "p1"], axis=1),
                 helper.make_node("Concat", ["p0", "p1"], ["y"], axis=2)]
        model = make_model(nodes, [vi("x", [2, 8, 4, 4])], [vi("y", None)], opset=13)
    out, report = optimize(model, only=RULE)
    assert not report.counts.get(RULE) and snapshot(out) == snapshot(model)


def slices_model(bounds, axis=1):
    """x [2, 8, 4, 4] → one Slice per (start, end) along ``axis`` → Concat(slices, Relu(x)) along ``axis``."""
    nodes, inits, names = [], [c("axis", [axis])], []
    for k, (start, end) in enumerate(bounds):
        inits += [c(f"s{k}", [start]), c(f"e{k}", [end])]
        nodes.append(helper.make_node("Slice", ["x", f"s{k}", f"e{k}", "axis"], [f"q{k}"]))
        names.append(f"q{k}")
    nodes += [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Concat", names + ["r"], ["y"], axis=axis)]
    return make_model(nodes, [vi("x", [2, 8, 4, 4])], [vi("y", None)], inits, opset=13)


@pytest.mark.parametrize("bounds", [[(0, 4), (4, 8)], [(0, 2), (2, 5), (5, 2**62)]])
def test_slices_tiling_the_axis_are_the_tensor(bounds):
    model = slices_model(bounds)
    out, report = optimize(model, only=RULE)
    assert report.counts.get(RULE) == 1 and "Slice" not in op_types(out)
    x = np.random.default_rng(2).standard_normal((2, 8, 4, 4)).astype(np.float32)
    assert all(np.array_equal(a, b) for a, b in zip(run(model, x), run(out, x)))


@pytest.mark.parametrize("bounds", [[(0, 4), (5, 8)], [(1, 4), (4, 8)], [(0, 4), (4, 7)], [(4, 8), (0, 4)]])
def test_slices_with_a_gap_an_offset_a_short_end_or_out_of_order_are_left_alone(bounds):
    model = slices_model(bounds)
    out, report = optimize(model, only=RULE)
    assert not report.counts.get(RULE) and snapshot(out) == snapshot(model)


def test_slices_whose_step_is_computed_at_run_time_are_left_alone():
    # a step read from an input (2 at run time) is not the step 1 tiling needs: the Slices skip elements
    model = slices_model([(0, 4), (4, 8)])
    model.graph.input.append(vi("step", [1], onnx.TensorProto.INT64))
    for node in model.graph.node:
        if node.op_type == "Slice":
            node.input.append("step")
    out, report = optimize(model, only=RULE)
    assert not report.counts.get(RULE) and snapshot(out) == snapshot(model)
