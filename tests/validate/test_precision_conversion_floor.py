"""--precision fp16 judged by what float16 allows (issue 33): the drift of the model merely converted to
float16 (no rewrite) joins the noise floor, so a deep residual model whose float16 rounding alone exceeds
float16's default tolerance is not blamed on a rule; a real bug is still caught and named; --strict judges
by tolerance alone; explicit tolerances turn the floor off and leave the drift budget (--max-drift)."""

from __future__ import annotations

import onnx_graphsurgeon as gs
import pytest

import onnxfuse
from helpers import residual_layernorm_stack
from onnxfuse.errors import ValidationFailed
from onnxfuse.validate.precision_judge import CONVERSION_MULTIPLE
from onnxfuse.rewrites import RULES, Rule


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


@pytest.mark.parametrize("kwargs", [dict(strict=True), dict(rtol=1e-2, atol=1e-3, max_drift=(1e-3, 0.999))],
                         ids=["strict", "explicit-tolerance-and-budget"])
def test_strict_and_explicit_tolerances_judge_by_tolerance_alone(kwargs):
    with pytest.raises(ValidationFailed) as err:
        onnxfuse.optimize(residual_layernorm_stack(), precision="fp16", provider="cpu", **kwargs)
    row = err.value.report.validation.outputs[0]
    assert "conversion_drift" not in row.extra and "drift_error" in row.extra  # no floor; the figures reported


def test_explicit_tolerances_leave_the_default_drift_budget():
    """--rtol/--atol with --precision fp16: float16's own rounding (normalized max error ~2e-3, cosine
    0.99999) passes by the drift budget, not by the floor (issue 33's ResNet-50 under --rtol 1e-2 --atol 1e-2)."""
    result = onnxfuse.optimize(residual_layernorm_stack(), precision="fp16", provider="cpu", rtol=1e-2, atol=1e-3)
    (row,) = result.validation.outputs
    assert row.passed and row.extra["passed_by"] == "drift budget", row.to_dict()
    assert "conversion_drift" not in row.extra
    assert row.extra["drift_error"] <= 2e-2 and row.extra["drift_cosine"] >= 0.999
    assert row.extra["drift_error"] <= CONVERSION_MULTIPLE * row.extra["conversion_error"]
    assert result.extra["precision"]["max_drift"] == {"normalized_error": 2e-2, "cosine": 0.999}


def test_a_planted_float16_bug_is_still_caught_and_named():
    with pytest.raises(ValidationFailed) as err:
        onnxfuse.optimize(residual_layernorm_stack(), precision="fp16", provider="cpu", rules=[ScaledGamma(), *RULES])
    assert err.value.culprit == ScaledGamma.name
    row = err.value.report.validation.outputs[0]
    assert row.max_abs > CONVERSION_MULTIPLE * row.extra["conversion_drift"]
