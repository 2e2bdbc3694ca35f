"""cancel-row-transposes: Transpose(p)(row-wise ops(Transpose(p⁻¹)(y))) → the row-wise ops on y.

Checked against ONNX Runtime on the original, at two batch sizes, and the refusals: a tensor between the
Transposes read elsewhere, perms that do not undo each other, an operand that differs from row to row.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper as h
from onnx import numpy_helper

import helpers

RULE = "cancel-row-transposes"
S, E, N = 5, 8, 6


def chain_model(inner=(1, 0, 2), outer=(1, 0, 2), bias_shape=(N,), leak=False, rank=3):
    """y [B, S, E] → Transpose(inner) → MatMul W [E, N] → Add c → Relu → Transpose(outer) → out.
    ``leak``: the MatMul's result is also a graph output. ``rank`` 4 puts a head axis of 2 after S."""
    rng = np.random.default_rng(0)
    y_shape = ["B", S, E] if rank == 3 else ["B", S, 2, E]
    inits = [numpy_helper.from_array(rng.standard_normal((E, N)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(bias_shape).astype(np.float32), "c")]
    nodes = [h.make_node("Transpose", ["y"], ["yt"], perm=list(inner)),
             h.make_node("MatMul", ["yt", "W"], ["mm"]),
             h.make_node("Add", ["mm", "c"], ["biased"]),
             h.make_node("Relu", ["biased"], ["act"]),
             h.make_node("Transpose", ["act"], ["out"], perm=list(outer))]
    outputs = [h.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)]
    if leak:
        outputs.append(h.make_tensor_value_info("mm", onnx.TensorProto.FLOAT, None))
    graph = h.make_graph(nodes, "rows", [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, y_shape)],
                         outputs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def _check_same(model, out, rank=3):
    for batch in (1, 3):
        shape = (batch, S, E) if rank == 3 else (batch, S, 2, E)
        feeds = {"y": np.random.default_rng(batch).standard_normal(shape).astype(np.float32)}
        want, got = helpers.run_ort(model, feeds), helpers.run_ort(out, feeds)
        for name, a in want.items():
            assert got[name].shape == a.shape
            np.testing.assert_allclose(got[name], a, rtol=1e-6, atol=1e-6, err_msg=name)


def test_the_pair_cancels_and_the_values_stay():
    model = chain_model()
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 1
    assert helpers.op_types(out) == ["MatMul", "Add", "Relu"]
    _check_same(model, out)


def test_rank_four_with_a_bias_of_leading_ones():
    model = chain_model(inner=(1, 2, 0, 3), outer=(2, 0, 1, 3), bias_shape=(1, 1, 1, N), rank=4)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 1 and "Transpose" not in helpers.op_types(out)
    _check_same(model, out, rank=4)


def test_refusals():
    leaked = chain_model(leak=True)  # "mm" holds the transposed rows and is read outside
    out, report = helpers.optimize(leaked, only=[RULE])
    assert report.counts[RULE] == 0 and helpers.op_types(out).count("Transpose") == 2
    assert any("read outside the chain" in r.reason for r in report.refusals if r.rule == RULE), report.refusals

    not_undone = chain_model(inner=(1, 2, 0, 3), outer=(1, 2, 0, 3), bias_shape=(N,), rank=4)
    out, report = helpers.optimize(not_undone, only=[RULE])
    assert report.counts[RULE] == 0
    assert any("is not undone" in r.reason for r in report.refusals if r.rule == RULE), report.refusals
    _check_same(not_undone, out, rank=4)

    per_row = chain_model(bias_shape=(S, 1, N))  # differs along the transposed S axis: not row-wise
    out, report = helpers.optimize(per_row, only=[RULE])
    assert report.counts[RULE] == 0 and helpers.op_types(out).count("Transpose") == 2
    _check_same(per_row, out)
