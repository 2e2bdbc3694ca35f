"""Automatic float32 islands under ``--precision fp16`` (issue 33): a node whose values, measured on the
validation inputs, go beyond float16's range stays float32, named in the report; its readers compute in
float32 too and hand float16 their in-range results."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

import onnxfuse
from helpers import run_ort
from onnxfuse.precision import convert_to_fp16
from onnxfuse.validate.float16_range import LIMIT, largest_magnitudes, out_of_range_nodes


def hostile_model() -> onnx.ModelProto:
    """y = x · ReduceSum(|x|·2000, axis 1) / 4096 over 64 features: the sum reaches ~1e5 (float16 holds
    65504), the scaled-down factor ~25; every other value stays far inside float16's range."""
    nodes = [helper.make_node("Abs", ["x"], ["a"], name="abs"),
             helper.make_node("Mul", ["a", "k"], ["b"], name="scale_up"),
             helper.make_node("ReduceSum", ["b", "axes"], ["s"], name="big_sum", keepdims=1),
             helper.make_node("Div", ["s", "d"], ["m"], name="scale_down"),
             helper.make_node("Mul", ["x", "m"], ["y"], name="apply")]
    graph = helper.make_graph(
        nodes, "hostile", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", 64])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["B", 64])],
        initializer=[numpy_helper.from_array(np.array(2000.0, np.float32), "k"),
                     numpy_helper.from_array(np.array([1], np.int64), "axes"),
                     numpy_helper.from_array(np.array(4096.0, np.float32), "d")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _feeds(batch=3, seed=0):
    return {"x": np.random.default_rng(seed).standard_normal((batch, 64)).astype(np.float32)}


def test_the_out_of_range_sum_and_its_reader_are_found_by_name():
    model = hostile_model()
    largest = largest_magnitudes(model, [_feeds()], provider="cpu")
    assert largest["s"] > 65504 and largest["b"] < LIMIT and largest["m"] < 100
    found = out_of_range_nodes(model, largest)
    assert set(found) == {"big_sum", "scale_down"}, found
    assert found["big_sum"].startswith("ReduceSum writes 's'") and found["scale_down"].startswith("Div reads 's'")


def _float16_run(model, feeds):
    """The model as ONNX specifies it, float16 ops rounding and overflowing in float16 (onnx's reference
    evaluator). ONNX Runtime's CPU provider has no float16 ReduceSum or Div: it runs such a chain in
    float32 and casts once at its ends, so it never shows the overflow a CUDA float16 kernel gives."""
    with np.errstate(over="ignore", invalid="ignore"):
        return onnx.reference.ReferenceEvaluator(model).run(None, feeds)[0]


def test_a_plain_float16_conversion_overflows_and_the_island_does_not():
    import onnx.reference  # noqa: F401

    model, feeds = hostile_model(), _feeds()
    want = run_ort(model, feeds)["y"]
    plain, _ = convert_to_fp16(model)
    assert not np.isfinite(_float16_run(plain, feeds)).all()  # what the island is for
    kept, notes = convert_to_fp16(model, keep_nodes={"big_sum": "measured", "scale_down": "measured"})
    got = _float16_run(kept, feeds)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    assert any("2 node(s) stay float32" in n and "'big_sum'" in n for n in notes), notes
    by_name = {n.name: n for n in kept.graph.node}
    assert "big_sum" in by_name and "apply" in by_name
    # the sum reads float32 (its input cast up) and the Div hands float16 a small value
    casts = [n for n in kept.graph.node if n.op_type == "Cast"]
    assert any(n.output[0] == by_name["big_sum"].input[0] and n.attribute[0].i == onnx.TensorProto.FLOAT
               for n in casts)


def test_optimize_under_fp16_keeps_the_island_and_validates():
    model = hostile_model()
    result = onnxfuse.optimize(model, provider="cpu", precision="fp16", samples=2)
    assert result.validation.passed, result.validation
    kept = result.extra["precision"]["float32_nodes"]
    assert set(kept) == {"big_sum", "scale_down"}, kept
    feeds = _feeds(batch=5, seed=9)
    from onnxfuse.custom_ops import session_options
    import onnxruntime as ort

    got = ort.InferenceSession(result.model.SerializeToString(), session_options(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    np.testing.assert_allclose(got, run_ort(model, feeds)["y"], rtol=5e-3, atol=5e-3)


def test_a_model_inside_float16s_range_keeps_nothing():
    from helpers import load_testdata

    result = onnxfuse.optimize(load_testdata("bert_tiny_sdpa_opset17"), provider="cpu", precision="fp16", samples=2)
    assert result.validation.passed
    assert result.extra["precision"]["float32_nodes"] == {}


def test_fp16_io_takes_and_returns_float16_and_validates():
    """``--precision fp16-io``: the optimized model's inputs and outputs are float16 (no Cast at the
    edges); validation feeds it the same draws cast to float16 and compares with the float32 original."""
    from helpers import load_testdata
    import onnxruntime as ort
    from onnxfuse.custom_ops import session_options

    model = load_testdata("bert_tiny_sdpa_opset17")
    plain = onnxfuse.optimize(model, provider="cpu", precision="fp16", samples=2)
    result = onnxfuse.optimize(model, provider="cpu", precision="fp16-io", samples=2)
    assert result.validation.passed
    out = result.model.graph.output[0].type.tensor_type.elem_type
    assert out == onnx.TensorProto.FLOAT16 and plain.model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    casts = lambda m: sum(n.op_type == "Cast" for n in m.graph.node)  # noqa: E731
    assert casts(result.model) < casts(plain.model)  # the exit Cast to float32 is gone
    rng = np.random.default_rng(2)
    feeds = {"input_ids": rng.integers(0, 1000, (2, 9)).astype(np.int64), "attention_mask": np.ones((2, 9), np.int64)}
    got = ort.InferenceSession(result.model.SerializeToString(), session_options(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), run_ort(model, feeds)["last_hidden_state"], rtol=2e-2, atol=2e-2)


def test_fp16_io_with_a_float_input_and_a_float32_island_output():
    """A float input becomes float16; the island's sum, read from the float16 input cast up, stays float32
    inside and the float16 output is in range."""
    model = hostile_model()
    result = onnxfuse.optimize(model, provider="cpu", precision="fp16-io", samples=2)
    assert result.validation.passed, result.validation
    assert result.model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert set(result.extra["precision"]["float32_nodes"]) == {"big_sum", "scale_down"}
    feeds = _feeds(batch=4, seed=3)
    import onnxruntime as ort
    from onnxfuse.custom_ops import session_options

    got = ort.InferenceSession(result.model.SerializeToString(), session_options(),
                               providers=["CPUExecutionProvider"]).run(None, {"x": feeds["x"].astype(np.float16)})[0]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), run_ort(model, feeds)["y"], rtol=1e-2, atol=1e-2)
