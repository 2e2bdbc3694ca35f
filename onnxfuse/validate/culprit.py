"""Which rule to blame, and which ``--skip`` to suggest, when optimize's output fails validation or does not load.

Why here: the search is validation driving rewrites. It re-applies the rules that changed the model as
growing prefixes (bisection) and judges each prefix as the output was judged
(:meth:`onnxfuse.validate.verdict.Validator.problem`, or :func:`~onnxfuse.validate.verdict.load_problem`
for a model ONNX Runtime refused), so that a failure names the first rule whose rewrites break the
outputs, and a suggested rerun without it is checked before anyone is told to make it
(:func:`working_skip`). The rewriting itself is the pipeline's (``rewrite``:
:func:`onnxfuse.pipeline.rewrite_model`, passed in: validate/ sits below the pipeline and never imports it).
"""

from __future__ import annotations

from typing import Callable

import onnx

from onnxfuse.errors import InternalError, SessionRefused
from onnxfuse.precision import FLOAT16, TARGETS, target_named
from onnxfuse.rewrites import ApplyReport, Rule
from onnxfuse.validate import ValidationReport
from onnxfuse.validate.drift_budget import failure_text
from onnxfuse.validate.precision_judge import precision_drift
from onnxfuse.validate.verdict import Validator, load_problem, refusal_reason

#: The culprit named when ``--precision fp16``'s conversion alone makes validation fail (``precision-bf16`` for
#: ``--precision bf16``'s: :func:`precision_culprit`).
PRECISION_CULPRIT = f"precision-{FLOAT16.short}"


def precision_culprit(precision: str | None) -> str:
    """The culprit name of the conversion to ``precision`` ("float16", "bfloat16")."""
    return f"precision-{target_named(precision).short}"
#: The most rules a suggested ``--skip`` names: each one more costs a bisection of rewrites and validations.
MAX_SKIPS = 3

#: ``rewrite(model, rules)``: the model with ``rules`` applied and what they did (``pipeline.rewrite_model``).
Rewrite = Callable[[onnx.ModelProto, list[Rule]], tuple[onnx.ModelProto, ApplyReport]]


def find_culprit(validator: Validator, rules: list[Rule], applied: ApplyReport, rewrite: Rewrite,
                 start: onnx.ModelProto | None = None) -> str | None:
    """Name the first rule (in run order) whose rewrites make validation fail, by bisecting prefixes.
    A prefix whose model ONNX Runtime cannot load fails too: it is no more a way out than drift.

    ``start`` is what the rules were applied to when it is not the ``validator``'s original
    (``--precision fp16``: the converted model); when ``start`` itself fails, the conversion is named
    (``precision-fp16``)."""
    problem = validator.problem
    if start is not None and (rounded_beyond_budget(validator.judge) or problem(start) is not None):
        return precision_culprit(validator.judge.precision if validator.judge is not None else None)
    active = [r for r in rules if applied.counts.get(r.name, 0) > 0]
    return first_failing_rule(validator.original if start is None else start, active, problem, rewrite)


def rounded_beyond_budget(judge) -> dict:
    """``{output: Drift}`` of the plain conversion, every low-precision result rounded as ONNX specifies
    (``judge.rounded``, measured where the provider computes a chain in float32 and rounds once: the CPU),
    beyond the drift budget: there the conversion itself is to blame, whatever the rules do, though its own
    CPU run may pass. Found on ONNX Runtime's gpt2_past_mask_one_layer.onnx: a -10000 mask added in float16
    erases the scores of fully masked rows; the CPU run of the conversion kept them (ONNX Runtime removes the
    Cast pair around its float16 Softmax), and the search blamed fuse-elementwise, whose kernel rounds as a
    GPU does."""
    if judge is None or judge.budget is None:
        return {}
    return {name: d for name, d in judge.rounded.items() if not judge.budget.admits(d)}


def first_failing_rule(start: onnx.ModelProto, changed: list[Rule], judge, rewrite: Rewrite) -> str | None:
    """The first rule of ``changed`` (the rules that changed the model, in run order) whose prefix gives a
    model ``judge`` finds a problem with, by bisection; the empty prefix (``start`` itself) is known to be
    good and the whole list not. None when no rule changed the model."""
    lo, hi = 0, len(changed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        candidate, _ = rewrite(start, changed[:mid])
        if judge(candidate) is None:
            lo = mid
        else:
            hi = mid
    return changed[hi - 1].name if changed else None


def working_skip(start: onnx.ModelProto, rules: list[Rule], culprit: str,
                 judge: Callable[[onnx.ModelProto], str | None],
                 rewrite: Rewrite) -> tuple[list[str] | None, list[str]]:
    """The rules to suggest skipping after ``culprit`` was blamed, checked before anyone is told to rerun:
    a rerun without a rule can break a model that another rule's rewrites relied on it for (issue 33,
    measured on 93e2115: without contrib-skip-layernorm, ``--precision fp16`` of BERT-base left a
    ``Where`` bound to float16 and float, which ONNX Runtime refused). Starting from ``[culprit]``, the
    rules left are applied to ``start`` and ``judge``d (None when the model is good, else what is wrong
    with it); while it is not good, the first rule whose prefix of the rules left is not good joins the
    set, up to :data:`MAX_SKIPS`. Returns (the set, or None when no set within the limit gives a good
    model; what each smaller set left: "skipping a, b leaves a model that ...")."""
    skipped, failures = [culprit], []
    while True:
        left = [r for r in rules if r.name not in skipped]
        candidate, applied = rewrite(start, left)
        problem = judge(candidate)
        if problem is None:
            return skipped, failures
        failures.append(f"skipping {', '.join(skipped)} leaves a model that {problem}")
        if len(skipped) >= MAX_SKIPS:
            return None, failures
        following = first_failing_rule(start, [r for r in left if applied.counts.get(r.name, 0) > 0], judge, rewrite)
        if following is None:  # no rule left changed the model: skipping cannot help
            return None, failures
        skipped.append(following)


def explain_failure(validator: Validator, report: ValidationReport, start: onnx.ModelProto, rules: list[Rule],
                    applied: ApplyReport, rewrite: Rewrite, precision: str | None):
    """After the output failed validation (``report``): (the culprit: a rule, :data:`PRECISION_CULPRIT` or
    None; the checked ``--skip`` to suggest, None when there is none; the failure's message). ``start``:
    what the rules were applied to (the converted model when ``precision`` changed)."""
    culprit = find_culprit(validator, rules, applied, rewrite, start=start if precision else None)
    skip = None
    failing = ", ".join(report.failing())
    conversion = precision_culprit(precision)
    if culprit == conversion:
        rounded = rounded_beyond_budget(validator.judge)
        name, worst = max(rounded.items(), key=lambda item: item[1].error) if rounded else (None, None)
        blame = (f"; culprit: the {precision} conversion itself, before any rule"
                 + precision_drift(report, validator.judge)
                 + (f"; with every {precision} result rounded as ONNX specifies, the conversion alone drifts "
                    f"{worst.error:.3g} on {name} (cosine {worst.cosine:.6f}), beyond the drift budget"
                    if worst is not None else ""))
    elif culprit:
        skip, failures = working_skip(start, rules, culprit, validator.problem, rewrite)
        blame = f"; culprit rule: {culprit}" + skip_advice(culprit, skip, failures)
    else:
        blame = ""
    figures = "" if culprit == conversion else failure_text(report.outputs, validator.judge)
    message = (f"validation failed: output(s) {failing} differ beyond tolerance{figures}{blame}; nothing was "
               "written")
    return culprit, skip, message


def skip_advice(culprit: str, skip: list[str] | None, failures: list[str]) -> str:
    """The words after "culprit rule: X" in a failure message: the checked rerun, or plainly none."""
    if skip == [culprit]:
        return f" (rerun with --skip {culprit})"
    if skip:
        return f" (rerun with --skip {','.join(skip)}: {'; '.join(failures)})"
    return (f"; no rerun with --skip is suggested: no set of up to {MAX_SKIPS} rules was found that gives a model "
            f"that loads and validates ({'; '.join(failures)})")


def unloadable(exc: SessionRefused, model, start, rules: list[Rule], applied: ApplyReport, options,
               rewrite: Rewrite) -> InternalError:
    """The error for an optimized model ONNX Runtime cannot load: onnxfuse wrote it, so it is an internal
    error (exit 5), never the user's or the model's (exit 1). It names what is to blame, the float16
    conversion (``start`` does not load) or the first rule whose prefix gives a model that does not load,
    with a ``--skip`` that was checked to load, and asks for a report. ``options``: the run's
    :class:`onnxfuse.pipeline.OptimizeOptions` (its provider)."""
    reason = refusal_reason(exc)
    report_it = "; nothing was written. This is onnxfuse's fault, not the model's: please report it"
    judge = load_problem(options)
    if start is not model and judge(start) is not None:
        low = TARGETS.get(options.precision, FLOAT16).name
        return InternalError(f"internal error: onnxfuse's {low} conversion (--precision {options.precision}) wrote a "
                             f"model ONNX Runtime cannot load ({reason}), before any rule; keep --precision "
                             f"fp32{report_it}", rules=[precision_culprit(low)])
    applied_rules = applied.applied_rules()
    changed = [r for r in rules if applied.counts.get(r.name, 0) > 0]
    culprit = first_failing_rule(start, changed, judge, rewrite)
    if culprit is None:  # no rule changed the model: the cleanup alone wrote it
        return InternalError(f"internal error: onnxfuse wrote a model ONNX Runtime cannot load ({reason}) with no rule "
                             f"applied{report_it}", rules=[])
    skip, failures = working_skip(start, rules, culprit, judge, rewrite)
    if skip:
        workaround = f"; rerun with --skip {','.join(skip)} to work around it" + (
            f" ({'; '.join(failures)})" if failures else "")
    else:
        workaround = (f"; no --skip of up to {MAX_SKIPS} rules was found that gives a model ONNX Runtime loads "
                      f"({'; '.join(failures)})")
    return InternalError(f"internal error: onnxfuse wrote a model ONNX Runtime cannot load ({reason}); rules "
                         f"applied: {', '.join(applied_rules)}; traced to rule {culprit}{workaround}{report_it}",
                         rules=skip or [culprit])
