"""Validation: run the original and the optimized model on the same inputs and compare every output.

Both models run on ONNX Runtime with its own graph optimizations disabled, so any difference found is
onnxfuse's doing. The CUDA provider is used when a GPU is really usable, else the CPU provider.
Sessions, inputs and the comparison itself are :mod:`onnxfuse.runtime`'s; this package adds what only
validation does: the original model's noise floor and the pass rule built on it (here), and optimize's
validation around them, which the pipeline calls stage by stage:

* :mod:`~onnxfuse.validate.samples`: what validation runs on (drawn or given samples, a second size,
  variants for tied dimensions, a realistic size);
* :mod:`~onnxfuse.validate.reference`: the original's outputs on them, retried at other sizes;
* :mod:`~onnxfuse.validate.verdict`: one :class:`~onnxfuse.validate.verdict.Validator` per run, judging
  every candidate alike;
* :mod:`~onnxfuse.validate.precision_judge` and :mod:`~onnxfuse.validate.drift_budget`: how a precision
  change is judged; :mod:`~onnxfuse.validate.float16_range`: the nodes float16 cannot hold;
  :mod:`~onnxfuse.validate.float16_drift`: the nodes whose float16 results break the drift budget;
* :mod:`~onnxfuse.validate.culprit`: the rule to blame, and a checked ``--skip``, when the output fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from onnxfuse.runtime.compare import Comparison, Tolerance, compare_runs, lowest_float_precision
from onnxfuse.runtime.inputs import Inputs, for_model
from onnxfuse.runtime.session import resolve_provider, run_samples
from onnxfuse.validate.drift_budget import Drift, PrecisionJudge, apply_budget, output_drift
from onnxfuse.errors import RuntimeFailure


@dataclass
class ValidationReport:
    provider: str
    outputs: list[Comparison] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.outputs)

    def failing(self) -> list[str]:
        return [c.name for c in self.outputs if not c.passed]

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "provider": self.provider,
            "outputs": [c.to_dict() for c in self.outputs],
            "notes": list(self.notes),
        }


#: A result also passes (unless strict) when its largest error is within this many times the model's
#: own noise floor. Rewrites that are exact in real arithmetic measured within 1-3x it (float32,
#: testdata and the zoo); each planted bug in tests/validate/test_noise_floor_mutations.py is 100x or
#: more beyond it, so 10x absorbs rounding reorderings without hiding wrong maths.
FLOOR_MULTIPLE = 10.0


def noise_floor(original: onnx.ModelProto, samples: list[Inputs], reference: list[dict], provider: str = "auto",
                name: str = "model") -> dict[str, float]:
    """Per output, how far two legitimate runs of the *original* model differ on the same inputs:
    ONNX Runtime with its graph optimizations off (the reference) and all on (how it is deployed:
    fusions, layout changes, reordered sums), and on a GPU also the CUDA provider against the CPU
    provider (on the CPU, a small float16 model as ONNX specifies it joins when a candidate fails:
    :meth:`onnxfuse.validate.verdict.Validator.validate`). Differences below that are the model's own noise, not
    a rewrite's fault; a model that amplifies rounding (ids 0/1 through an embedding, say) shows a high
    floor. {} when the optimized run fails (then only the tolerances judge)."""
    kind = resolve_provider(provider)
    ways = [(kind, "all")] + ([("cpu", "disable")] if kind == "cuda" else [])  # and CPU against CUDA on a GPU
    runs = []
    for way_provider, level in ways:
        try:
            runs.append(run_samples(original, samples, way_provider, name=name, optimization=level))
        except RuntimeFailure:
            continue
    return largest_errors(reference, runs)


def largest_errors(reference: list[dict], runs: list[list[dict]]) -> dict[str, float]:
    """Per output, the largest finite absolute difference between ``reference`` and any of ``runs``."""
    floor: dict[str, float] = {}
    for ref, dep in ((r, d) for deployed in runs for r, d in zip(reference, deployed)):
        for out, a in ref.items():
            b = dep.get(out)
            if b is None or a.shape != b.shape or a.dtype.kind not in "fc":
                continue
            a64, b64 = a.astype(np.float64), b.astype(np.float64)
            both = np.isfinite(a64) & np.isfinite(b64)
            err = float(np.abs(a64[both] - b64[both]).max()) if both.any() else 0.0
            floor[out] = max(floor.get(out, 0.0), err)
    return floor


def conversion_drift(converted: onnx.ModelProto, samples: list[Inputs], reference: list[dict],
                     provider: str = "auto", name: str = "converted model") -> dict[str, Drift]:
    """Per output, how far the original merely converted to a lower precision (``--precision fp16``, before
    any rewrite) lands from the float32 original's ``reference`` on the same inputs, run as validation runs
    the optimized model (with ONNX Runtime's optimizations on, its CPU provider crashed on one converted
    test model). That is what the precision itself costs: a float16 model of 12 residual
    blocks drifts beyond float16's default tolerance with no rewrite at all (issue 33: BERT-base, max abs
    0.0026 against an atol of 1e-3), so judging the rewritten model by float32's noise floor blamed a rule
    for float16's rounding. Per float output its :class:`~onnxfuse.validate.drift_budget.Drift`: the largest
    absolute error (what joins the noise floor), the normalized max error and the cosine (what the drift
    budget compares with). {} when the converted model does not run."""
    try:
        runs = [run_samples(converted, [for_model(converted, s) for s in samples], resolve_provider(provider),
                            name=name)]
    except RuntimeFailure:
        return {}
    return output_drift(reference, runs[0])


def _apply_floor(comparisons: list[Comparison], floor: dict[str, float] | None, strict: bool) -> None:
    """Record each output's floor and multiple; pass what is within FLOOR_MULTIPLE x the floor."""
    for c in comparisons:
        f = (floor or {}).get(c.name)
        if f is None:
            continue
        c.extra["noise_floor"] = f
        c.extra["floor_multiple"] = (c.max_abs / f) if f > 0 else (0.0 if c.max_abs == 0 else None)
        if not c.passed and not strict and c.error is None and f > 0 and c.nonfinite_mismatches == 0 \
                and c.max_abs <= FLOOR_MULTIPLE * f:
            c.passed = True
            c.extra["passed_by"] = "noise floor"


def validate_models(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    inputs: Inputs | list[Inputs],
    provider: str = "auto",
    rtol: float | None = None,
    atol: float | None = None,
    reference: dict | list[dict] | None = None,
    floor: dict[str, float] | None = None,
    strict: bool = False,
    precision: str | None = None,
    judge: PrecisionJudge | None = None,
) -> ValidationReport:
    """Compare every output of ``optimized`` with ``original`` on ``inputs`` (one sample, or a list).

    ``reference`` (the original's outputs, one dict per sample) may be passed in to avoid re-running the
    original when validating several candidates, as the culprit search does. Default tolerances follow
    the least precise float type the original computes in (a float32 output of a float16 model is judged
    as float16). With several samples an output passes when it passes on every sample, and its row is
    the worst sample's (a failing one first, else the largest max abs error), numbered in
    ``extra["worst_sample"]``. ``precision`` ("float16") judges at that type's tolerances whatever the
    original computes in: ``--precision fp16`` compares a float16 model with its float32 original, and
    ``judge`` then also records each output's drift figures and passes what is within its drift budget
    (:mod:`onnxfuse.validate.drift_budget`; ``precision`` is the judge's).
    """
    samples = [inputs] if isinstance(inputs, Inputs) else list(inputs)
    kind = resolve_provider(provider)
    if reference is None:
        references = run_samples(original, samples, kind, name="original model")
    else:
        references = [reference] if isinstance(reference, dict) else list(reference)
    # A sample the optimized model fails on (the original ran on it) is a failing comparison, not the user's error.
    gots = run_samples(optimized, [for_model(optimized, s) for s in samples], kind, name="optimized model",
                       keep_failures=True)
    precision = precision or (judge.precision if judge else None) or lowest_float_precision(original)
    notes = list(dict.fromkeys(n for s in samples for n in s.notes))
    if precision and (rtol is None or atol is None) and any(
            a.dtype.kind == "f" and a.dtype.name != precision for a in references[0].values()):
        notes.append(f"the model computes in {precision}: its wider float outputs are compared with "
                     f"{precision}'s default tolerance")
    gots = [f"the optimized model fails on this input: {g}" if isinstance(g, str) else g for g in gots]
    outputs, _ = compare_runs(references, gots, Tolerance(rtol=rtol, atol=atol, precision=precision), stack=False)
    _apply_floor(outputs, floor, strict)
    if any(c.extra.get("passed_by") == "noise floor" for c in outputs):
        notes.append(f"output(s) beyond tolerance but within {FLOOR_MULTIPLE:g}x the original model's own noise floor "
                     "(ONNX Runtime's optimizations off vs on; CPU vs CUDA on a GPU; a small float16 model as ONNX "
                     "specifies it, on the CPU) passed; --strict judges by tolerance alone")
    if judge is not None:
        notes.extend(apply_budget(outputs, references, gots, judge))
    return ValidationReport(provider=kind, outputs=outputs, notes=notes)


__all__ = ["FLOOR_MULTIPLE", "Drift", "PrecisionJudge", "ValidationReport", "conversion_drift", "largest_errors",
           "noise_floor",
           "validate_models"]
