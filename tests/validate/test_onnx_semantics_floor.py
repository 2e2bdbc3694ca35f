"""On the CPU, a small float16 model's noise floor also holds the original run as ONNX specifies it
(:mod:`onnxfuse.validate.onnx_semantics`). ONNX rounds a float16 op's result to float16, and so does a
``Cast`` to float32 of it; ONNX Runtime's CPU provider computes the float16 op in float32 and drops the
rounding before the Cast (issue 33's "Add → Cast"), while FusedElementwise rounds as ONNX says. The model
below makes the difference large on purpose: ``Cast(x·a, float32) - x·a + b`` with |x·a| near 100, where
the rounding of x·a (float16's step there is 1/16) is all that is left beside b."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from onnxfuse.errors import ValidationFailed
from onnxfuse.runtime.inputs import Inputs
from onnxfuse.runtime.session import run_samples
from onnxfuse.validate import FLOOR_MULTIPLE, largest_errors, noise_floor, validate_models
from onnxfuse.validate.onnx_semantics import onnx_semantics_runs

N = 64


def rounding_left(b_sign: float = 1.0) -> onnx.ModelProto:
    """y = Cast(x·a [float16], float32) - x·a [float32] + b: b plus x·a's float16 rounding; ``b_sign`` -1
    plants a wrong b."""
    rng = np.random.default_rng(3)
    a = rng.uniform(90, 110, N).astype(np.float16)
    b = (b_sign * rng.uniform(1, 2, N)).astype(np.float32)
    nodes = [h.make_node("Mul", ["x", "a"], ["xa"]), h.make_node("Cast", ["xa"], ["g"], to=T.FLOAT),
             h.make_node("Cast", ["x"], ["x32"], to=T.FLOAT), h.make_node("Cast", ["a"], ["a32"], to=T.FLOAT),
             h.make_node("Mul", ["x32", "a32"], ["xa32"]), h.make_node("Sub", ["g", "xa32"], ["r"]),
             h.make_node("Add", ["r", "b"], ["y"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT16, [4, N])],
                         [h.make_tensor_value_info("y", T.FLOAT, [4, N])],
                         [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def sample() -> Inputs:
    return Inputs(feeds={"x": np.random.default_rng(5).uniform(0.9, 1.1, (4, N)).astype(np.float16)})


def as_onnx_specifies(model, x):
    """The model in numpy, x·a rounded to float16 before its Cast (ONNX's semantics), independent of ONNX."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    x32, a32 = x.astype(np.float32), inits["a"].astype(np.float32)
    return ((x32 * a32).astype(np.float16).astype(np.float32) - x32 * a32) + inits["b"]


def test_the_run_rounds_as_onnx_says_where_onnx_runtime_cpu_does_not():
    model, s = rounding_left(), sample()
    (as_specified,) = onnx_semantics_runs(model, [s], "cpu")
    np.testing.assert_allclose(as_specified["y"], as_onnx_specifies(model, s.feeds["x"]), rtol=0, atol=1e-5)
    (ort_cpu,) = run_samples(model, [s], "cpu")
    b = numpy_helper.to_array(model.graph.initializer[1]).astype(np.float64)
    assert np.abs(ort_cpu["y"] - b).max() < 1e-4  # x·a kept in float32 through the Cast
    assert np.abs(as_specified["y"] - ort_cpu["y"]).max() > 0.01  # rounded: up to 1/32 off


def test_not_for_float32_models_nor_other_providers():
    model = rounding_left()
    assert onnx_semantics_runs(model, [sample()], "cuda") is None
    widened = onnx.parser.parse_model('<ir_version: 8, opset_import: ["" : 17]>\n'
                                      'g (float[4] x) => (float[4] y) { y = Relu(x) }')
    assert onnx_semantics_runs(widened, [Inputs(feeds={"x": np.ones(4, np.float32)})], "cpu") is None


def test_onnx_rounding_passes_within_the_floor_and_a_planted_bug_does_not():
    """FusedElementwise rounds before the Cast, as ONNX says: beyond float16's tolerance against ONNX
    Runtime's CPU run of the original (--strict fails it), within the floor that the ONNX-semantics run
    sets. A b of the wrong sign is still a failure."""
    model, s = rounding_left(), sample()
    with pytest.raises(ValidationFailed):
        onnxfuse.optimize(model, only="fuse-elementwise", provider="cpu", strict=True, inputs=s.feeds)
    result = onnxfuse.optimize(model, only="fuse-elementwise", provider="cpu", inputs=s.feeds)
    (y,) = result.validation.outputs
    assert "FusedElementwise" in [n.op_type for n in result.model.graph.node]
    assert y.extra["passed_by"] == "noise floor" and y.extra["floor_multiple"] <= 1.5, y.extra
    reference = run_samples(model, [s], "cpu")
    assert noise_floor(model, [s], reference, "cpu")["y"] == 0  # ONNX Runtime alone: the same both ways
    floor = largest_errors(reference, [onnx_semantics_runs(model, [s], "cpu")])
    assert floor["y"] > 0.01
    planted = validate_models(model, rounding_left(b_sign=-1.0), [s], "cpu", reference=reference, floor=floor)
    assert not planted.passed and planted.outputs[0].max_abs > FLOOR_MULTIPLE * floor["y"]


def test_the_run_is_made_only_when_a_candidate_fails(monkeypatch):
    """The numpy evaluation costs time most runs never need: a candidate that passes on its own does not
    trigger it (the same model through a rule that changes nothing here)."""
    import onnxfuse.validate.verdict as verdict

    calls = []
    monkeypatch.setattr(verdict, "onnx_semantics_runs", lambda *a: calls.append(a) or None)
    onnxfuse.optimize(rounding_left(), only="fold-constants", provider="cpu", inputs=sample().feeds)
    assert calls == []
    with pytest.raises(ValidationFailed):  # without the run, the ONNX-rounded output fails
        onnxfuse.optimize(rounding_left(), only="fuse-elementwise", provider="cpu", inputs=sample().feeds)
    assert len(calls) == 1


# --- above MAX_WEIGHT_BYTES: ONNX Runtime on the model with every float16 result rounded explicitly ----------

def test_the_rounded_model_gives_onnx_semantics_on_onnx_runtime(monkeypatch):
    """per_op_rounding: the model in float32 with a Cast pair after each float16 result. On the planted model
    it equals the independent numpy spelling exactly (elementwise ops round as ONNX says); above the weight
    limit the floor comes from it, and optimize then passes the ONNX-rounded output as with numpy's run."""
    from onnxfuse.validate import onnx_semantics

    model, s = rounding_left(), sample()
    rounded = onnx_semantics.per_op_rounding(model)
    onnx.checker.check_model(rounded)
    assert {i.name: i.type.tensor_type.elem_type for i in rounded.graph.input} == {"x": T.FLOAT16}
    assert rounded.graph.output[0].type.tensor_type.elem_type == T.FLOAT
    assert all(t.data_type != T.FLOAT16 for t in rounded.graph.initializer)
    monkeypatch.setattr(onnx_semantics, "MAX_WEIGHT_BYTES", 0)
    (run,) = onnx_semantics_runs(model, [s], "cpu")
    np.testing.assert_array_equal(run["y"], as_onnx_specifies(model, s.feeds["x"]))
    result = onnxfuse.optimize(model, only="fuse-elementwise", provider="cpu", inputs=s.feeds)
    assert result.validation.outputs[0].extra["passed_by"] == "noise floor"


@pytest.mark.parametrize("name", ["optimum_phi3_kv_fp16", "llama_kv_opset17_fp16", "gpt2_tiny_sdpa_opset14"])
def test_the_rounded_model_is_close_to_the_reference_evaluator(name):
    """On real float16 decoders the two runs of ONNX's semantics agree to float16's rounding (they differ
    only where MatMuls and reductions accumulate in another order); a float32 model gets neither."""
    import sys

    from onnxfuse.validate import onnx_semantics

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import kv_cache_feeds, load_testdata

    model = load_testdata(name)
    if name.startswith("gpt2"):
        assert onnx_semantics_runs(model, [], "cpu") is None
        return
    rng = np.random.default_rng(7)
    feeds = kv_cache_feeds(2, 3, 4, np.float16, rng)
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in model.graph.input}}
    (numpy_run,) = onnx_semantics_runs(model, [feeds], "cpu")
    (ort_run,) = onnx_semantics._rounded_runs(model, [feeds])
    (plain,) = run_samples(model, [feeds], "cpu")
    for out, want in numpy_run.items():
        got = ort_run[out].astype(np.float64)
        scale = max(1.0, float(np.abs(want).max()))
        # a few float16 steps of the logits; at least as close as ONNX Runtime's own CPU run of the original
        assert np.abs(got - want).max() / scale <= max(2e-3, np.abs(plain[out].astype(np.float64) - want).max() / scale), out


def test_a_large_float16_decoder_validates_on_the_cpu_through_the_rounded_run(monkeypatch):
    """optimum's float16 Phi-3 passes validation on the CPU only with an ONNX-semantics run in its floor
    (module docstring): with the weight limit at 0 (a model too large for numpy) the rounded model gives it,
    and without any such run the same optimize fails."""
    import sys

    import onnxfuse.validate.verdict as verdict
    from onnxfuse.validate import onnx_semantics

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from helpers import load_testdata

    model = load_testdata("optimum_phi3_kv_fp16")
    monkeypatch.setattr(onnx_semantics, "MAX_WEIGHT_BYTES", 0)
    result = onnxfuse.optimize(model, samples=2, provider="cpu")
    assert result.validation.passed
    assert {o.name: o.extra.get("passed_by") for o in result.validation.outputs}["logits"] == "noise floor"
    monkeypatch.setattr(verdict, "onnx_semantics_runs", lambda *a: None)
    with pytest.raises(ValidationFailed):
        onnxfuse.optimize(model, samples=2, provider="cpu")
