"""--precision fp16 judged by what float16 allows (issue 33): the drift of the model merely converted to
float16 (no rewrite) joins the noise floor, so a deep residual model whose float16 rounding alone exceeds
float16's default tolerance is not blamed on a rule; a real bug is still caught and named; explicit
tolerances and --strict judge by tolerance alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from onnxfuse.errors import ValidationFailed
from onnxfuse.pipeline import CONVERSION_MULTIPLE
from onnxfuse.rewrites import RULES, Rule

D, BLOCKS = 64, 16


def residual_layernorm_stack() -> onnx.ModelProto:
    """16 blocks of x = LayerNorm(x + x·W): float16's rounding compounds past its default tolerance."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(BLOCKS):
        inits += [numpy_helper.from_array((rng.standard_normal((D, D)) * 1.3 / np.sqrt(D)).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array((rng.random(D) + 0.5).astype(np.float32), f"g{i}"),
                  numpy_helper.from_array((rng.standard_normal(D) * 0.1).astype(np.float32), f"b{i}")]
        nodes += [h.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), h.make_node("Add", [f"m{i}", x], [f"r{i}"]),
                  h.make_node("LayerNormalization", [f"r{i}", f"g{i}", f"b{i}"], [f"n{i}"], axis=-1, epsilon=1e-5)]
        x = f"n{i}"
    nodes.append(h.make_node("Identity", [x], ["y"]))
    graph = h.make_graph(nodes, "stack", [h.make_tensor_value_info("x", T.FLOAT, ["B", 8, D])],
                         [h.make_tensor_value_info("y", T.FLOAT, ["B", 8, D])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


class ScaledGamma(Rule):
    """A planted bug: the first LayerNorm's γ 5% too large (applied once per graph, whatever the run)."""

    name = "planted-gamma-5pct"
    description = "test only"

    def match(self, graph):
        if any(getattr(n.inputs[1], "name", "") == "g_bad" for n in graph.nodes if n.op == "LayerNormalization"):
            return []
        return [n for n in graph.nodes if n.op == "LayerNormalization"][:1]

    def rewrite(self, graph, node):
        gamma = node.inputs[1].values
        node.inputs[1] = gs.Constant("g_bad", (gamma * 1.05).astype(gamma.dtype))
        return {"node": node.name}


def test_float16_drift_within_the_conversions_own_passes_with_a_note():
    model = residual_layernorm_stack()
    result = onnxfuse.optimize(model, precision="fp16", provider="cpu")
    (row,) = result.validation.outputs
    assert row.passed and row.extra["passed_by"] == "noise floor", row.to_dict()
    drift = row.extra["conversion_drift"]
    assert drift > row.atol and row.max_abs <= CONVERSION_MULTIPLE * drift  # float16 itself is beyond tolerance
    assert any("merely converted to float16" in n for n in result.validation.notes)
    assert result.to_json()["result"]["validation"]["outputs"][0]["conversion_drift"] == pytest.approx(drift)


@pytest.mark.parametrize("kwargs", [dict(strict=True), dict(rtol=1e-2, atol=1e-3)], ids=["strict", "explicit-tolerance"])
def test_strict_and_explicit_tolerances_judge_by_tolerance_alone(kwargs):
    with pytest.raises(ValidationFailed) as err:
        onnxfuse.optimize(residual_layernorm_stack(), precision="fp16", provider="cpu", **kwargs)
    assert "conversion_drift" not in err.value.report.validation.outputs[0].extra


def test_a_planted_float16_bug_is_still_caught_and_named():
    with pytest.raises(ValidationFailed) as err:
        onnxfuse.optimize(residual_layernorm_stack(), precision="fp16", provider="cpu", rules=[ScaledGamma(), *RULES])
    assert err.value.culprit == ScaledGamma.name
    row = err.value.report.validation.outputs[0]
    assert row.max_abs > CONVERSION_MULTIPLE * row.extra["conversion_drift"]
