"""flat-index-gather: transformers 5's ``mask[batch_idx, kv_idx]``, a Gather over ``Range(0, B)·S + Range(0, S)``,
becomes a Slice of the flat data, with the original's outputs (ONNX Runtime CPU, the original as the
reference) also when the mask and the ids differ in size, and refusals name their reason."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from helpers import run_ort
from onnxfuse.pipeline import rewrite_model
from onnxfuse.rewrites import select_rules

RULE = "flat-index-gather"


def grid_model(multiplier_from="ids", outer_axes=(1, 2, 3), inner_axes=(0, 1, 2)) -> object:
    """``Gather(Flatten(mask), Range(0, B)[:, None, None, None]·S + Range(0, S)[None, None, None, :])`` with
    B, S read from ``Shape(ids)``, reshaped to the grid's own Shape, as transformers 5 writes it.
    ``multiplier_from``: the tensor whose dimension 1 multiplies the batch index ("mask": not the inner
    Range's length)."""
    i64 = lambda name, v: numpy_helper.from_array(np.asarray(v, np.int64), name)  # noqa: E731
    inits = [i64("zero", 0), i64("one", 1), i64("one_1d", [1]), i64("outer_axes", list(outer_axes)),
             i64("inner_axes", list(inner_axes)), i64("flat", [-1])]
    nodes = [h.make_node("Shape", ["ids"], ["ids_shape"]), h.make_node("Shape", [multiplier_from], ["m_shape"]),
             h.make_node("Gather", ["ids_shape", "zero"], ["b"], axis=0),
             h.make_node("Gather", ["ids_shape", "one"], ["s"], axis=0),
             h.make_node("Gather", ["m_shape", "one_1d"], ["c"], axis=0),
             h.make_node("Range", ["zero", "b", "one"], ["rows"]), h.make_node("Range", ["zero", "s", "one"], ["cols"]),
             h.make_node("Unsqueeze", ["rows", "outer_axes"], ["rows4"]),
             h.make_node("Unsqueeze", ["cols", "inner_axes"], ["cols4"]),
             h.make_node("Mul", ["rows4", "c"], ["offsets"]), h.make_node("Add", ["cols4", "offsets"], ["grid"]),
             h.make_node("Flatten", ["mask"], ["flat_mask"], axis=2),
             h.make_node("Gather", ["flat_mask", "grid"], ["picked"], axis=0),
             h.make_node("Shape", ["grid"], ["grid_shape"]),
             h.make_node("Reshape", ["picked", "flat"], ["picked_flat"]),
             h.make_node("Reshape", ["picked_flat", "grid_shape"], ["keep"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("ids", T.INT64, ["batch", "sequence"]),
                                      # the names ids declares: ONNX Runtime does not check they agree
                                      h.make_tensor_value_info("mask", T.INT64, ["batch", "sequence"])],
                         [h.make_tensor_value_info("keep", T.INT64, None)], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _optimize(model):
    return rewrite_model(model, select_rules("cuda", only=[RULE]))


def test_the_grid_gather_becomes_a_slice_with_the_same_outputs():
    model = grid_model()
    out, report = _optimize(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = [n.op_type for n in out.graph.node]
    assert "Range" not in ops and "Gather" not in [n.op_type for n in out.graph.node if n.input and n.input[0] == "flat_mask"]
    assert "Slice" in ops and "Add" not in ops  # nothing computes the grid any more
    rng = np.random.default_rng(0)
    # same sizes; a mask with more rows (the original reads its first ones); a longer mask row (the
    # original reads flat positions b·S + s, which are not row b's then: the Slice reads the same)
    for ids_shape, mask_shape in [((2, 5), (2, 5)), ((2, 5), (3, 5)), ((2, 5), (2, 7)), ((1, 1), (1, 1))]:
        feeds = {"ids": np.zeros(ids_shape, np.int64), "mask": rng.integers(0, 2, mask_shape).astype(np.int64)}
        want, got = run_ort(model, feeds)["keep"], run_ort(out, feeds)["keep"]
        assert want.shape == got.shape and np.array_equal(want, got), (ids_shape, mask_shape)


def test_a_mask_too_small_fails_in_both():
    # ids [2, 5] index flat positions up to 9 of a mask with 5 entries: the original's Gather fails
    model = grid_model()
    out, _ = _optimize(model)
    feeds = {"ids": np.zeros((2, 5), np.int64), "mask": np.ones((1, 5), np.int64)}
    for m in (model, out):
        with pytest.raises(Exception):
            run_ort(m, feeds)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(multiplier_from="mask"), "not provably the inner Range's length"),
    (dict(outer_axes=(0, 1, 2), inner_axes=(1, 2, 3)), "not on an earlier axis"),
])
def test_refusals_carry_their_reason(kwargs, reason):
    out, report = _optimize(grid_model(**kwargs))
    assert report.counts[RULE] == 0
    assert any(reason in r.reason for r in report.refusals if r.rule == RULE), report.refusals


def static_grid_model(length=5, mask_length=5, grid_shape_read=True):
    """grid_model with a static sequence: ids [batch, length], mask [batch, mask_length] (ONNX Runtime checks
    static input dimensions); without ``grid_shape_read`` the result is reshaped to a constant target, as
    constant-reshape-target leaves transformers' static export."""
    model = grid_model()
    for vi, size in zip(model.graph.input, (length, mask_length)):
        vi.type.tensor_type.shape.dim[1].ClearField("dim_param")
        vi.type.tensor_type.shape.dim[1].dim_value = size
    if not grid_shape_read:
        model.graph.initializer.append(numpy_helper.from_array(np.array([-1, 1, 1, length], np.int64), "grid_target"))
        (reshape,) = [n for n in model.graph.node if n.output[0] == "keep"]
        reshape.input[1] = "grid_target"
    return model


@pytest.mark.parametrize("grid_shape_read", [True, False])
def test_a_static_length_reads_the_rows_on_the_device(grid_shape_read):
    """With S static the inner Range folds to a constant and the flat mask is the [B', S] mask flattened:
    GatherElements(mask, idx[b, s] = s) on the device, B carried by the ids (no Shape node left when nothing
    else reads one: CUDA graphs), the original's values wherever it runs."""
    model = static_grid_model(grid_shape_read=grid_shape_read)
    out, report = rewrite_model(model, select_rules("cuda", only=["fold-constants", RULE]))
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = [n.op_type for n in out.graph.node]
    assert "GatherElements" in ops and "Range" not in ops and "Slice" in ops  # the Slice is the ids' carrier
    if not grid_shape_read:
        assert "Shape" not in ops
    rng = np.random.default_rng(1)
    for ids_rows, mask_rows in [(2, 2), (2, 3), (1, 1), (3, 4)]:
        feeds = {"ids": np.zeros((ids_rows, 5), np.int64), "mask": rng.integers(0, 2, (mask_rows, 5)).astype(np.int64)}
        want, got = run_ort(model, feeds)["keep"], run_ort(out, feeds)["keep"]
        assert want.shape == got.shape and np.array_equal(want, got), (ids_rows, mask_rows)
    feeds = {"ids": np.zeros((2, 5), np.int64), "mask": np.ones((1, 5), np.int64)}  # too few mask rows
    for m in (model, out):
        with pytest.raises(Exception):
            run_ort(m, feeds)


def test_a_static_length_over_other_rows_is_refused():
    # the mask's rows hold 7 entries, the grid strides by 5: flat position b·5 + s is not row b's entry s
    out, report = rewrite_model(static_grid_model(mask_length=7), select_rules("cuda", only=["fold-constants", RULE]))
    assert report.counts[RULE] == 0
    assert any("flattened row-major" in r.reason for r in report.refusals if r.rule == RULE), report.refusals
