"""range-by-cumsum: ``Range(0, Gather(Shape(T), k), 1)`` (transformers 5's mask index grids) becomes an
exclusive CumSum of ones carried by T, with the original's outputs at several batch sizes; and
constant-reshape-target's use of the Shape chain's value for a multi-element target part."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import helpers
from helpers import run_ort
from onnxfuse.model_io import infer_shapes

RULE = "range-by-cumsum"
L = 4


def grid_model(start=0, delta=1, dtype=np.int64) -> onnx.ModelProto:
    """``mask[b, l]`` read through ``Gather(Flatten(mask), Range(0, B, 1)·L + arange(L))`` as transformers 5
    does, B read from the Shape of x (the hidden states), then reshaped back by ``Shape`` of the index."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array(start, dtype), "start"),
             numpy_helper.from_array(np.array(delta, dtype), "delta"),
             numpy_helper.from_array(np.array([1, 2, 3], np.int64), "axes123"),
             numpy_helper.from_array(np.array(L, dtype), "L"),
             numpy_helper.from_array(np.arange(L, dtype=dtype).reshape(1, 1, 1, L), "kv"),
             numpy_helper.from_array(np.array([-1], np.int64), "flat")]
    nodes = [h.make_node("Relu", ["x"], ["hidden"]),
             h.make_node("Shape", ["hidden"], ["shape"]),
             h.make_node("Gather", ["shape", "zero"], ["b"], axis=0),
             h.make_node("Cast", ["b"], ["b_cast"], to=elem),
             h.make_node("Range", ["start", "b_cast", "delta"], ["batch_idx"]),
             h.make_node("Unsqueeze", ["batch_idx", "axes123"], ["b4"]),
             h.make_node("Mul", ["b4", "L"], ["rows"]),
             h.make_node("Add", ["rows", "kv"], ["idx_raw"]),
             h.make_node("Cast", ["idx_raw"], ["idx"], to=T.INT64),
             h.make_node("Flatten", ["mask"], ["flat_mask"], axis=2),
             h.make_node("Gather", ["flat_mask", "idx"], ["picked"], axis=0),
             h.make_node("Reshape", ["picked", "flat"], ["picked1"]),
             h.make_node("Shape", ["idx"], ["idx_shape"]),
             h.make_node("Concat", ["idx_shape"], ["target"], axis=0),
             h.make_node("Reshape", ["picked1", "target"], ["keep"]),
             h.make_node("Cast", ["keep"], ["out"], to=T.FLOAT)]
    model = helpers.make_model(nodes, [helpers.vi("x", ["batch", 3, 5]), helpers.vi("mask", ["batch", L], T.INT64)],
                               [helpers.vi("out", ["batch", 1, 1, L])], inits, opset=17)
    onnx.checker.check_model(model, full_check=True)
    return infer_shapes(model)  # as optimize does: ONNX's inference, then Range lengths named (range_dims)


def test_range_becomes_a_cumsum_and_the_shape_chain_goes():
    model = grid_model()
    out, report = helpers.optimize(model, only=["fold-constants", "constant-reshape-target", RULE])
    assert report.counts[RULE] == 1 and report.counts["constant-reshape-target"] >= 1, report.refusals
    ops = helpers.op_types(out)
    assert "Range" not in ops and "Shape" not in ops and "CumSum" in ops
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        feeds = {"x": rng.standard_normal((batch, 3, 5)).astype(np.float32),
                 "mask": rng.integers(0, 2, (batch, L)).astype(np.int64)}
        feeds["x"][0, 0, 0] = np.nan  # the carrier's element: its value must not matter
        want, got = run_ort(model, feeds)["out"], run_ort(out, feeds)["out"]
        assert got.shape == want.shape == (batch, 1, 1, L)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got.reshape(batch, L), feeds["mask"])  # the grid reads the mask in order


@pytest.mark.parametrize("kwargs,reason", [(dict(start=1), "start"), (dict(delta=2), "delta"),
                                           (dict(dtype=np.float32), "int32/int64")])
def test_refusals_carry_their_reason(kwargs, reason):
    out, report = helpers.optimize(grid_model(**kwargs), only=[RULE])
    assert report.counts[RULE] == 0
    assert any(reason in r.reason for r in report.refusals if r.rule == RULE), report.refusals
    assert "Range" in helpers.op_types(out)


def test_a_string_tensor_cannot_carry_the_length():
    nodes = [h.make_node("Shape", ["words"], ["shape"]),
             h.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
             h.make_node("Range", ["start", "n", "delta"], ["out"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(0, np.int64), "start"),
             numpy_helper.from_array(np.array(1, np.int64), "delta")]
    model = infer_shapes(helpers.make_model(nodes, [helpers.vi("words", ["batch", 2], T.STRING)],
                                            [helpers.vi("out", ["batch"], T.INT64)], inits, opset=17))
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 0
    assert any("not numeric or bool" in r.reason for r in report.refusals if r.rule == RULE), report.refusals
