"""How optimize judges a precision change (``--precision fp16``/``fp16-io``): the glue between the run's
options and :mod:`onnxfuse.validate.drift_budget`.

Why: a float16 model cannot meet float32's tolerances or its noise floor, so judged by them alone every
rule was blamed for float16's own rounding (issue 33: BERT-base drifts beyond float16's default tolerance
with no rewrite at all). The model merely converted (no rewrite) is the yardstick instead: its drift
from the float32 original joins the noise floor (:func:`conversion_floor_drift`, :func:`with_conversion`)
and bounds the drift budget (:func:`precision_judge`), each within :data:`CONVERSION_MULTIPLE` times it
(or, on the CPU, no worse than the conversion with every float16 result rounded as ONNX specifies,
:func:`rounded_drift`);
:func:`conversion_notes` and :func:`precision_drift` say so in the report and in a failure's message.

``options`` is the run's :class:`onnxfuse.pipeline.OptimizeOptions`, read here (never imported:
validate/ sits below the pipeline, tests/test_layers.py).
"""

from __future__ import annotations

from onnxfuse.precision import FLOAT16, TARGETS, target_named
from onnxfuse.validate import FLOOR_MULTIPLE, PrecisionJudge, ValidationReport, conversion_drift
from onnxfuse.runtime.session import resolve_provider
from onnxfuse.runtime.inputs import for_model
from onnxfuse.validate.drift_budget import default_budget, output_drift
from onnxfuse.validate.onnx_semantics import onnx_semantics_runs, per_op_rounding

#: ``--precision fp16``: an output passes within this many times the drift of the model merely converted
#: to float16. Tighter than the float32 noise floor's 10x, because float16's drift is large: on a 16-block
#: residual LayerNorm stack the rewritten model drifted 1.4x the plain conversion's (0.0088 against 0.0063),
#: and tests/validate/test_noise_floor_mutations.py's planted float16 bugs are beyond 3x.
CONVERSION_MULTIPLE = 3.0


def precision_judge(start, samples, reference, options, source: str, rounded: dict | None = None):
    """How a precision change is judged besides tolerance and floor (:mod:`onnxfuse.validate.drift_budget`):
    the user's ``--max-drift`` or the default budget (none with ``--strict`` unless given), and the drift of
    the model merely converted (``start``, no rewrite) against the float32 original on the same samples,
    which the rewritten model may exceed by at most :data:`CONVERSION_MULTIPLE` times. ``rounded``: that
    conversion's drift rounded per op when already measured (the drift-island search's), else measured
    here on the CPU."""
    low = TARGETS[options.precision].name  # float16, bfloat16
    conversion = conversion_drift(start, samples, reference, options.provider, name=f"{source} ({low}, no rewrite)")
    if rounded is None and low == "float16" and resolve_provider(options.provider) == "cpu":
        # its CPU run rounds a chain once (bfloat16 is validated on CUDA only: the pipeline refuses the CPU)
        rounded = rounded_drift(start, samples, reference, name=f"{source} (float16 rounded per op, no rewrite)")
    return PrecisionJudge(low, drift_budget_of(options), conversion, CONVERSION_MULTIPLE, rounded or {})


def rounded_drift(converted, samples, reference, name: str, low: int = FLOAT16.elem):
    """Per output, the drift of ``converted`` (a float16 model; ``low``: the element type it computes in,
    bfloat16's for a bfloat16 one) run as ONNX specifies, every op's result rounded, like
    :func:`~onnxfuse.validate.conversion_drift`: on ONNX Runtime's CPU provider rewritten to round
    (:func:`~onnxfuse.validate.onnx_semantics.per_op_rounding`), or, for a float16 model with subgraphs
    (If, Loop, Scan: that rewrite does not reach their bodies), by ONNX's reference evaluator
    (:func:`~onnxfuse.validate.onnx_semantics.onnx_semantics_runs`, small models only). None where neither
    applies. Without it a model with a Loop was judged against its conversion's plain CPU run, which rounds
    a float16 chain once: the fuzz (``tests/fuzz_graphs.check_precision_seed``) found 5 of 4,000 random
    graphs refused, each rewritten output nearer the float32 original than the conversion computed as
    specified; this passes 3 of them (seed 501606: 0.0059 against 0.0062 of normalized error, the CPU
    run's 0.0003)."""
    as_specified = per_op_rounding(converted, low)
    if as_specified is not None:
        return conversion_drift(as_specified, samples, reference, "cpu", name=name)
    if low != FLOAT16.elem:
        return None
    runs = onnx_semantics_runs(converted, [for_model(converted, s) for s in samples], "cpu")
    return None if runs is None else output_drift(reference, runs)


def drift_budget_of(options):
    """The drift budget a precision change is judged by: ``--max-drift``, else the default one of the target
    type (float16's or bfloat16's, :func:`~onnxfuse.validate.drift_budget.default_budget`), except that
    ``--strict`` (tolerance alone) has none unless ``--max-drift`` is given."""
    if options.max_drift is not None:
        return options.max_drift
    return None if options.strict else default_budget(TARGETS[options.precision].name)


def conversion_floor_drift(judge, options) -> dict[str, float]:
    """``--precision fp16`` with the default tolerances: each output's largest absolute drift in the model
    merely converted (no rewrite, ``judge.conversion``), which joins the noise floor
    (:func:`with_conversion`) so that the rewritten model is judged by what float16 allows (within
    :data:`CONVERSION_MULTIPLE` times that drift) rather than by float32's noise. Explicit
    ``--rtol``/``--atol`` keep it off, as ``--strict`` does: they are judged by tolerance, and by the drift
    budget (scale-free, unlike an absolute drift)."""
    if judge is None or options.rtol is not None or options.atol is not None or options.strict:
        return {}
    return {name: d.max_abs for name, d in judge.conversion.items()}


def conversion_share(drift: float) -> float:
    """The floor a conversion ``drift`` stands for: scaled by ``CONVERSION_MULTIPLE / FLOOR_MULTIPLE``, so the
    one floor test (within ``FLOOR_MULTIPLE`` x the floor) applies :data:`CONVERSION_MULTIPLE` to it."""
    return drift * CONVERSION_MULTIPLE / FLOOR_MULTIPLE


def with_conversion(floor: dict[str, float], drift: dict[str, float]) -> dict[str, float]:
    """The noise floor raised, per output, to what its conversion drift allows."""
    return {k: max(floor.get(k, 0.0), conversion_share(drift.get(k, 0.0))) for k in floor.keys() | drift.keys()}


def conversion_notes(report: ValidationReport, drift: dict[str, float], precision: str = "float16") -> list[str]:
    """Each output's conversion drift in the report (``extra["conversion_drift"]``) and one note when an output
    passed only within it. ``precision``: the type converted to ("float16", "bfloat16"), as the note names it."""
    for c in report.outputs:
        if c.name in drift:
            c.extra["conversion_drift"] = drift[c.name]
    helped = [c for c in report.outputs if c.extra.get("passed_by") == "noise floor"
              and conversion_share(drift.get(c.name, 0.0)) >= c.extra.get("noise_floor", 0.0) > 0]
    if not helped:
        return []
    worst = max(helped, key=lambda c: c.max_abs)
    flag = f"--precision {target_named(precision).short}"
    return [f"{flag}: {', '.join(c.name for c in helped)} beyond {precision}'s default tolerance but within "
            f"{CONVERSION_MULTIPLE:g}x the drift of the model merely converted to {precision}, no rewrite "
            f"({worst.name}: "
            f"max abs {worst.max_abs:.3g} against {drift[worst.name]:.3g}); explicit --rtol/--atol judge by tolerance "
            "and the drift budget (--max-drift), --strict by tolerance alone"]


def precision_drift(report: ValidationReport, judge) -> str:
    """What the user needs to decide after ``--precision fp16`` alone fails validation: how far the worst
    output drifted, scale-free (normalized max error) and in direction (cosine: 0.9999+ is float16
    rounding through a deep model, BERT-base's own float16 export drifts 0.01 from float32; a low one,
    values float16 cannot hold), against what the tolerance and the drift budget allowed, and the two
    ways on."""
    failing = [c for c in report.outputs if not c.passed]
    if not failing:
        return " (keep --precision fp32, or widen --max-drift)"
    worst = max(failing, key=lambda c: c.max_abs / max(c.atol, 1e-30))
    b = judge.budget if judge is not None else None
    budget = "" if b is None else f" and the drift budget {b.error:g}, cosine {b.cosine:g} (--max-drift {b.text()})"
    figures = (f"normalized max error {worst.extra['drift_error']:.3g}, cosine {worst.extra['drift_cosine']:.6f}"
               if "drift_error" in worst.extra else f"cosine {worst.cosine:.6f}")
    return (f": {worst.name} drifts up to {worst.max_abs:.3g} from float32 ({figures}) where the tolerance "
            f"allows {worst.atol:.2g} + {worst.rtol:g}·|ref|{budget} (keep --precision fp32, or pass a wider "
            "--max-drift ERR,COS or a looser --atol/--rtol if that drift is acceptable)")
