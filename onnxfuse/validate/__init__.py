"""Validation: run the original and the optimized model on the same inputs and compare every output.

Both models run on ONNX Runtime with its own graph optimizations disabled, so any difference found is
onnxfuse's doing. The CUDA provider is used when a GPU is really usable, else the CPU provider.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from onnxfuse.validate.compare import Comparison, compare_arrays, default_tolerance, lowest_float_precision
from onnxfuse.validate.inputs import Inputs, make_inputs, make_samples, parse_shape_options
from onnxfuse.validate.session import cuda_available, make_session, resolve_provider, run_session


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


def run_model(model: onnx.ModelProto, inputs: Inputs, provider: str = "auto", name: str = "model") -> dict:
    """Outputs of ``model`` on ``inputs`` (graph optimizations off)."""
    session = make_session(model, provider=provider, optimization="disable", name=name)
    return run_session(session, inputs.feeds, name=name)


def run_samples(model: onnx.ModelProto, samples: list[Inputs], provider: str = "auto", name: str = "model") -> list[dict]:
    """Outputs of ``model`` on each of ``samples``, in one session (graph optimizations off)."""
    session = make_session(model, provider=provider, optimization="disable", name=name)
    return [run_session(session, s.feeds, name=name) for s in samples]


def compare_outputs(reference: dict, candidate: dict, rtol=None, atol=None, precision=None) -> list[Comparison]:
    results = []
    for name, ref in reference.items():
        if name not in candidate:
            results.append(Comparison(name=name, dtype=str(ref.dtype), shape=list(ref.shape), passed=False,
                                      rtol=0.0, atol=0.0, mismatch_fraction=1.0, error="output missing"))
            continue
        results.append(compare_arrays(name, ref, candidate[name], rtol=rtol, atol=atol, precision=precision))
    return results


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
    provider. Differences below that are the model's own noise, not
    a rewrite's fault; a model that amplifies rounding (ids 0/1 through an embedding, say) shows a high
    floor. {} when the optimized run fails (then only the tolerances judge)."""
    from onnxfuse.errors import RuntimeFailure

    kind = resolve_provider(provider)
    ways = [(kind, "all")] + ([("cpu", "disable")] if kind == "cuda" else [])  # and CPU against CUDA on a GPU
    runs = []
    for way_provider, level in ways:
        try:
            session = make_session(original, provider=way_provider, optimization=level, name=name)
            runs.append([run_session(session, s.feeds, name=name) for s in samples])
        except RuntimeFailure:
            continue
    if not runs:
        return {}
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
) -> ValidationReport:
    """Compare every output of ``optimized`` with ``original`` on ``inputs`` (one sample, or a list).

    ``reference`` (the original's outputs, one dict per sample) may be passed in to avoid re-running the
    original when validating several candidates, as the culprit search does. Default tolerances follow
    the least precise float type the original computes in (a float32 output of a float16 model is judged
    as float16). With several samples an output passes when it passes on every sample, and its row is
    the worst sample's (a failing one first, else the largest max abs error), numbered in
    ``extra["worst_sample"]``.
    """
    samples = [inputs] if isinstance(inputs, Inputs) else list(inputs)
    kind = resolve_provider(provider)
    if reference is None:
        references = run_samples(original, samples, kind, name="original model")
    else:
        references = [reference] if isinstance(reference, dict) else list(reference)
    gots = _run_each(optimized, samples, kind)
    precision = lowest_float_precision(original)
    notes = list(dict.fromkeys(n for s in samples for n in s.notes))
    if precision and (rtol is None or atol is None) and any(
            a.dtype.kind == "f" and a.dtype.name != precision for a in references[0].values()):
        notes.append(f"the model computes in {precision}: its wider float outputs are compared with "
                     f"{precision}'s default tolerance")
    per_sample = [_failed_run(ref, got) if isinstance(got, str) else compare_outputs(ref, got, rtol, atol, precision)
                  for ref, got in zip(references, gots)]
    outputs = _worst_of(per_sample)
    _apply_floor(outputs, floor, strict)
    if any(c.extra.get("passed_by") == "noise floor" for c in outputs):
        notes.append(f"output(s) beyond tolerance but within {FLOOR_MULTIPLE:g}x the original model's own noise floor "
                     "(ONNX Runtime's optimizations off vs on) passed; --strict judges by tolerance alone")
    return ValidationReport(provider=kind, outputs=outputs, notes=notes)


def _run_each(model, samples, kind) -> list:
    """Outputs of ``model`` per sample, or the one-line error for a sample it cannot run on (the
    original ran on it: the optimized model failing there is a validation failure, not the user's)."""
    from onnxfuse.errors import RuntimeFailure

    session = make_session(model, provider=kind, optimization="disable", name="optimized model")
    out = []
    for s in samples:
        try:
            out.append(run_session(session, s.feeds, name="optimized model"))
        except RuntimeFailure as e:
            out.append(str(e))
    return out


def _failed_run(reference: dict, error: str) -> list[Comparison]:
    return [Comparison(name=name, dtype=str(ref.dtype), shape=list(ref.shape), passed=False, rtol=0.0, atol=0.0,
                       mismatch_fraction=1.0, error=f"the optimized model fails on this input: {error}")
            for name, ref in reference.items()]


def _worst_of(per_sample: list[list[Comparison]]) -> list[Comparison]:
    """Per output, the comparison of its worst sample (one sample: the comparisons as they are)."""
    if len(per_sample) == 1:
        return per_sample[0]
    worst = []
    for rows in zip(*per_sample):
        k = max(range(len(rows)), key=lambda i: (not rows[i].passed, rows[i].max_abs))
        row = rows[k]
        row.passed = all(r.passed for r in rows)
        row.extra["worst_sample"] = k
        worst.append(row)
    return worst


__all__ = [
    "Comparison", "Inputs", "ValidationReport", "compare_arrays", "compare_outputs", "cuda_available",
    "default_tolerance", "noise_floor", "FLOOR_MULTIPLE", "lowest_float_precision", "make_inputs", "make_samples", "make_session", "parse_shape_options",
    "resolve_provider", "run_model", "run_samples", "run_session", "validate_models",
]
