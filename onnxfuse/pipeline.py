"""The ``optimize`` pipeline as plain functions: load → rewrite → check → validate → time → save.

:func:`run_pipeline` takes a path or a ``ModelProto`` and an optional output path; the Python API
(:func:`onnxfuse.optimize`) and the CLI (through it) only turn their arguments into
:class:`OptimizeOptions` and read the :class:`OptimizeResult`. When validation fails,
:func:`find_culprit` re-applies the rules that changed the model as growing prefixes (binary search)
to name the first rule whose rewrites break the outputs; nothing is written and
:class:`~onnxfuse.errors.ValidationFailed` carries the culprit.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx

from onnxfuse import model_io, repair
from onnxfuse.unfused import unfused_patterns
from onnxfuse.declared_shapes import correct_output_shapes
from onnxfuse.errors import (
    first_line,
    EXIT_SLOWER,
    EXIT_VALIDATION_FAILED,
    InternalError,
    SessionRefused,
    SlowerThanAllowed,
    UsageError,
    ValidationFailed,
)
from onnxfuse.rewrites.engine.rule import unnamed_label
from onnxfuse.rewrites.facts.proven_dims import prove_dims
from onnxfuse.rewrites import ApplyReport, Assumptions, Rule, RuleFailed, apply_rules, select_rules
from onnxfuse.runtime.inputs import Inputs, make_samples
from onnxfuse.validate import ValidationReport, validate_models
from onnxfuse.validate.drift_budget import failure_text

#: Metadata key recording which onnxfuse produced a model (and with which rules).
METADATA_KEY = "onnxfuse"
#: The culprit named when ``--precision fp16``'s conversion alone makes validation fail.
PRECISION_CULPRIT = "precision-fp16"
#: the ``--precision`` values that convert the model to compute in float16 (fp16-io: float16 I/O too)
FLOAT16_PRECISIONS = ("fp16", "fp16-io")


@dataclass
class OptimizeOptions:
    target: str | None = None  # None: the device's own (cuda: "cuda", cpu: "contrib"; rewrites.target_for_device)
    device: str = "cuda"  # the provider the model is for: its rules, validation and timing (``--device``)
    only: list[str] | None = None
    skip: list[str] | None = None
    validate: bool = True
    shapes: dict[str, list[int]] = field(default_factory=dict)
    inputs_path: str | None = None  # an .npz file (``--inputs``); or use ``inputs``
    inputs: object | None = None  # {name: array}, a list of such dicts, or an .npz path (see runtime.inputs.given_inputs)
    seed: int = 0
    input_ranges: dict | None = None  # name -> runtime.input_ranges.ValueRange (``--input-range``)
    right_padded: list[str] = field(default_factory=list)  # inputs promised right-padded (``--right-padded``)
    strict: bool = False  # judge by tolerance alone, not also by the model's own noise floor
    samples: int = 2  # seeded draws validation runs on (seeds seed, seed+1, ...), besides the second size
    save_inputs: str | None = None  # write every sample validation used to this .npz (``--save-inputs``)
    rtol: float | None = None
    atol: float | None = None
    provider: str = "auto"
    force: bool = False
    rules: list[Rule] | None = None  # a custom rule pool (tests, plugins); None = the registry
    precision: str = "fp32"  # "fp16": compute in float16 with float32 I/O (onnxfuse.precision), validated at fp16;
    # "fp16-io": the same with float16 inputs and outputs
    max_drift: object | None = None  # validate.drift_budget.DriftBudget (``--max-drift``); None: the default one
    # with fp16/fp16-io (none with --strict); only with a precision change
    bench: bool = True  # time both models on the device after validation (cuda without a GPU: skipped, with a note)
    bench_config: object | None = None  # onnxfuse.timing.BenchConfig; None = its defaults
    fail_on_slowdown: float | None = None  # fail when optimized median > ratio × original median
    never_slower: bool = True  # timed slower: fall back to fewer rewrites (onnxfuse/selection.py)
    tune: bool = True  # timed: try the measured choices (selection.MEASURED) on top, keep what is faster
    tune_time: float | None = None  # seconds of tuning after the first timing (None: selection.TUNE_TIME_S)
    tuning_record: str | None = None  # read and write measured decisions here (onnxfuse/tuning_record.py)


def for_device(options: OptimizeOptions) -> OptimizeOptions:
    """``options`` with the device's target, validation provider and timing configuration filled in.

    ``device="cpu"`` optimizes for ONNX Runtime's CPU provider: the rules of ``--target contrib`` (or
    ``onnx``; never FusedElementwise, see :func:`onnxfuse.rewrites.target_for_device`), validated on the
    CPU provider, both models timed there, so the never-slower ladder (:mod:`onnxfuse.selection`) and
    ``--fail-on-slowdown`` decide on CPU timings. ``device="cuda"`` changes nothing (the defaults)."""
    from dataclasses import replace

    from onnxfuse.rewrites import target_for_device

    target = target_for_device(options.target, options.device)
    if options.device != "cpu":
        return replace(options, target=target)
    if options.provider not in ("auto", "cpu"):
        raise UsageError(f"--device cpu validates on the CPU provider; drop --provider {options.provider}")
    config = options.bench_config
    if config is None:
        from onnxfuse.timing import BenchConfig

        config = BenchConfig(device="cpu")
    elif config.device != "cpu":
        raise UsageError(f"--device cpu times on the CPU; the timing configuration asks for {config.device!r}")
    return replace(options, target=target, provider="cpu", bench_config=config)


@dataclass
class OptimizeResult:
    input_path: str
    output_path: str | None
    target: str
    rules: list[str]
    applied: ApplyReport
    ops_before: dict[str, int]
    ops_after: dict[str, int]
    rewrite_seconds: float
    validation: ValidationReport | None = None
    validation_seconds: float = 0.0
    total_seconds: float = 0.0
    load_seconds: float = 0.0  # reading the input file (0 for a ModelProto given in memory)
    timing_seconds: float = 0.0  # timing both models on the GPU, never-slower's fallbacks included
    custom_library: str | None = None
    unfused: list = field(default_factory=list)  # onnxfuse.unfused.Unfused rows: patterns left decomposed
    extra: dict = field(default_factory=dict)
    model: onnx.ModelProto | None = field(default=None, repr=False)  # the optimized model (not reported)
    timing: object | None = None  # onnxfuse.timing.ComparisonResult when timing ran (or was skipped)
    device: str = "cuda"  # the device optimized for (``--device``): its rules, validation and timing
    # Set when the run ended in ValidationFailed / SlowerThanAllowed (the result is then the exception's .report):
    error: str | None = None
    exit_code: int = 0
    culprit: str | None = None

    @property
    def nodes_before(self) -> int:
        return sum(self.ops_before.values())

    @property
    def nodes_after(self) -> int:
        return sum(self.ops_after.values())

    def to_dict(self) -> dict:
        return {
            "input": self.input_path,
            "output": self.output_path,
            "target": self.target,
            "device": self.device,
            "rules": self.rules,
            "rewrites": self.applied.to_dict(),
            "nodes": {"before": self.nodes_before, "after": self.nodes_after},
            "ops_before": self.ops_before,
            "ops_after": self.ops_after,
            "custom_library": self.custom_library,
            "unfused": [u.to_dict() for u in self.unfused],
            "validation": self.validation.to_dict() if self.validation else None,
            "timing": self.timing.to_dict() if self.timing is not None else None,
            "timings": {  # per stage (issue 35 item 8: where the time of a run goes); total_s includes them all
                "load_s": round(self.load_seconds, 4),
                "rewrite_s": round(self.rewrite_seconds, 4),
                "validation_s": round(self.validation_seconds, 4),
                "timing_s": round(self.timing_seconds, 4),
                "total_s": round(self.total_seconds, 4),
            },
            **self.extra,
        }

    def to_json(self) -> dict:
        """The report ``onnxfuse optimize --json`` writes for this run: the one contract of every
        command (:mod:`onnxfuse.reports.contract`) with :meth:`to_dict` (and ``culprit``) as its
        ``result``; ``ok``/``exit_code``/``error`` also after a failed validation or latency check."""
        from onnxfuse.reports.jsonreport import optimize_json

        return optimize_json(self)

    def save(self, path: str | os.PathLike, force: bool = False) -> Path:
        """Write the optimized model to ``path`` atomically (as ``output`` does); refuses to overwrite the
        input file unless ``force``. Sets :attr:`output_path`."""
        source = self.input_path if self.input_path and Path(self.input_path).is_file() else None
        out = model_io.save_model(self.model, path, input_path=source, force=force, check=False)
        self.output_path = str(path)
        return out


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Node count per op type (``domain::Op`` for non-standard domains), main graph only."""
    counts = Counter(
        (f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type) for n in model.graph.node
    )
    return dict(sorted(counts.items()))


def rewrite_model(model: onnx.ModelProto, rules: list[Rule]) -> tuple[onnx.ModelProto, ApplyReport]:
    """Apply ``rules`` to a copy of ``model``; the input proto is never modified.

    Shapes are inferred first: several rules (SkipLayerNormalization, FusedConv with a residual, the
    elementwise-region fusion) only fire when they can prove tensor shapes.

    A rule that breaks is not the user's fault: when one raises, or the rewritten model fails the ONNX
    checker, that rule is named (for a checker failure, by bisecting the rules that changed the
    model: the shortest prefix whose result fails), dropped, and the rewrite starts again from the
    input without it. The report lists every dropped rule with its reason (``ApplyReport.dropped``);
    validation then judges what remains as usual.
    """
    active = list(rules)
    dropped: list[dict[str, str]] = []
    while True:
        try:
            out, report = _rewrite_once(model, active)
        except RuleFailed as e:
            culprit, reason = e.rule, f"raised {type(e.error).__name__}: {first_line(e.error)}"
        else:
            problem = repair.validity_problem(out)
            if problem is None:
                report.dropped = dropped
                return out, report
            culprit = _first_invalidating_rule(model, [r for r in active if report.counts.get(r.name)])
            reason = f"its output fails the ONNX checker: {problem}"
            if culprit is None:  # no single rule to blame (cleanup alone breaks it): our output, say so plainly
                names = [d["rule"] for d in dropped]
                raise InternalError(f"internal error: onnxfuse wrote a model the ONNX checker rejects ({problem}) with "
                                    f"no rule to blame (rules dropped on the way: {', '.join(names) or 'none'}); nothing "
                                    "was written. This is onnxfuse's fault, not the model's: please report it",
                                    rules=names)
        dropped.append({"rule": culprit, "reason": reason})
        active = [r for r in active if r.name != culprit]


def _rewrite_once(model: onnx.ModelProto, rules: list[Rule]) -> tuple[onnx.ModelProto, ApplyReport]:
    graph = model_io.to_graph(model_io.infer_shapes(model))
    prove_dims(graph)
    report = apply_rules(graph, rules)
    out = model_io.to_model(graph, model)
    correct_output_shapes(out)  # a declaration the rewritten graph provably contradicts (onnxfuse/declared_shapes.py)
    return out, report


def _first_invalidating_rule(model: onnx.ModelProto, changed: list[Rule]) -> str | None:
    """The first rule (in run order) whose prefix of ``changed`` gives an invalid model; bisection."""
    lo, hi = 0, len(changed)  # prefix of length lo is valid (the input was checked at load); hi is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            candidate, _ = _rewrite_once(model, changed[:mid])
            valid = repair.validity_problem(candidate) is None
        except RuleFailed:
            valid = False
        if valid:
            lo = mid
        else:
            hi = mid
    return changed[hi - 1].name if changed else None


def custom_library_needed(model: onnx.ModelProto) -> str | None:
    """The custom-op domain the model needs a library for, if any (ONNX Runtime's contrib ops don't)."""
    from onnxfuse.custom_ops import DOMAIN
    from onnxfuse.runtime.session import uses_custom_ops

    return DOMAIN if uses_custom_ops(model) else None


def _validate(original, candidate, samples, options: OptimizeOptions, reference, floor, judge) -> ValidationReport:
    """``validate_models`` as optimize judges every candidate: the user's provider, tolerances and strictness
    against the one ``reference`` and ``floor``, and a precision change's ``judge`` (None at fp32)."""
    return validate_models(original, candidate, samples, options.provider, options.rtol, options.atol,
                           reference=reference, floor=floor, strict=options.strict, judge=judge)


def find_culprit(
    original: onnx.ModelProto,
    rules: list[Rule],
    applied: ApplyReport,
    inputs: Inputs | list[Inputs],
    options: OptimizeOptions,
    reference: dict | list[dict],
    floor: dict[str, float] | None = None,
    start: onnx.ModelProto | None = None,
    judge=None,
) -> str | None:
    """Name the first rule (in run order) whose rewrites make validation fail, by bisecting prefixes.
    A prefix whose model ONNX Runtime cannot load fails too: it is no more a way out than drift.

    ``start`` is what the rules were applied to when it is not ``original`` (``--precision fp16``: the
    converted model); when ``start`` itself fails, the conversion is named (``precision-fp16``). ``judge``:
    the precision change's (:class:`~onnxfuse.validate.drift_budget.PrecisionJudge`), None at fp32."""
    problem = _validation_problem(original, inputs, options, reference, floor, judge)
    if start is not None and problem(start) is not None:
        return PRECISION_CULPRIT
    active = [r for r in rules if applied.counts.get(r.name, 0) > 0]
    return _first_failing_rule(original if start is None else start, active, problem)


def _first_failing_rule(start: onnx.ModelProto, changed: list[Rule], judge) -> str | None:
    """The first rule of ``changed`` (the rules that changed the model, in run order) whose prefix gives a
    model ``judge`` finds a problem with, by bisection; the empty prefix (``start`` itself) is known to be
    good and the whole list not. None when no rule changed the model."""
    lo, hi = 0, len(changed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        candidate, _ = rewrite_model(start, changed[:mid])
        if judge(candidate) is None:
            lo = mid
        else:
            hi = mid
    return changed[hi - 1].name if changed else None


#: The most rules a suggested ``--skip`` names: each one more costs a bisection of rewrites and validations.
MAX_SKIPS = 3


def working_skip(start: onnx.ModelProto, rules: list[Rule], culprit: str,
                 judge: Callable[[onnx.ModelProto], str | None]) -> tuple[list[str] | None, list[str]]:
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
        candidate, applied = rewrite_model(start, left)
        problem = judge(candidate)
        if problem is None:
            return skipped, failures
        failures.append(f"skipping {', '.join(skipped)} leaves a model that {problem}")
        if len(skipped) >= MAX_SKIPS:
            return None, failures
        following = _first_failing_rule(start, [r for r in left if applied.counts.get(r.name, 0) > 0], judge)
        if following is None:  # no rule left changed the model: skipping cannot help
            return None, failures
        skipped.append(following)


def _validation_problem(original, samples, options: OptimizeOptions, reference, floor, precision_judge=None):
    """What keeps a candidate from loading in ONNX Runtime and passing validation (None when it passes): the
    culprit searches' test, where a model that does not load is no more a way out than drift."""

    def judge(candidate: onnx.ModelProto) -> str | None:
        try:
            report = _validate(original, candidate, samples, options, reference, floor, precision_judge)
        except SessionRefused as exc:
            return f"ONNX Runtime cannot load, an onnxfuse bug: please report it ({_refusal(exc)})"
        return None if report.passed else f"still fails validation (output(s) {', '.join(report.failing())})"

    return judge


def _load_problem(options: OptimizeOptions):
    """What keeps ONNX Runtime from creating a session for a candidate, on the provider validation uses
    (None when it loads)."""
    from onnxfuse.runtime.session import make_session

    def judge(candidate: onnx.ModelProto) -> str | None:
        try:
            make_session(candidate, options.provider, name="candidate model")
        except SessionRefused as exc:
            return f"ONNX Runtime cannot load either ({_refusal(exc)})"
        return None

    return judge


def _refusal(exc: SessionRefused) -> str:
    """ONNX Runtime's reason in a :class:`SessionRefused`, without the model's name in front."""
    text = str(exc)
    marker = "ONNX Runtime cannot load the model: "
    return text.split(marker, 1)[1] if marker in text else text


def _skip_advice(culprit: str, skip: list[str] | None, failures: list[str]) -> str:
    """The words after "culprit rule: X" in a failure message: the checked rerun, or plainly none."""
    if skip == [culprit]:
        return f" (rerun with --skip {culprit})"
    if skip:
        return f" (rerun with --skip {','.join(skip)}: {'; '.join(failures)})"
    return (f"; no rerun with --skip is suggested: no set of up to {MAX_SKIPS} rules was found that gives a model "
            f"that loads and validates ({'; '.join(failures)})")


def _unloadable(exc: SessionRefused, model, start, rules: list[Rule], applied: ApplyReport,
                options: OptimizeOptions) -> InternalError:
    """The error for an optimized model ONNX Runtime cannot load: onnxfuse wrote it, so it is an internal
    error (exit 5), never the user's or the model's (exit 1). It names what is to blame, the float16
    conversion (``start`` does not load) or the first rule whose prefix gives a model that does not load,
    with a ``--skip`` that was checked to load, and asks for a report."""
    reason = _refusal(exc)
    report_it = "; nothing was written. This is onnxfuse's fault, not the model's: please report it"
    judge = _load_problem(options)
    if start is not model and judge(start) is not None:
        return InternalError(f"internal error: onnxfuse's float16 conversion (--precision fp16) wrote a model ONNX "
                             f"Runtime cannot load ({reason}), before any rule; keep --precision fp32{report_it}",
                             rules=[PRECISION_CULPRIT])
    applied_rules = applied.applied_rules()
    changed = [r for r in rules if applied.counts.get(r.name, 0) > 0]
    culprit = _first_failing_rule(start, changed, judge)
    if culprit is None:  # no rule changed the model: the cleanup alone wrote it
        return InternalError(f"internal error: onnxfuse wrote a model ONNX Runtime cannot load ({reason}) with no rule "
                             f"applied{report_it}", rules=[])
    skip, failures = working_skip(start, rules, culprit, judge)
    if skip:
        workaround = f"; rerun with --skip {','.join(skip)} to work around it" + (
            f" ({'; '.join(failures)})" if failures else "")
    else:
        workaround = (f"; no --skip of up to {MAX_SKIPS} rules was found that gives a model ONNX Runtime loads "
                      f"({'; '.join(failures)})")
    return InternalError(f"internal error: onnxfuse wrote a model ONNX Runtime cannot load ({reason}); rules "
                         f"applied: {', '.join(applied_rules)}; traced to rule {culprit}{workaround}{report_it}",
                         rules=skip or [culprit])


def optimize_model(
    model: onnx.ModelProto,
    options: OptimizeOptions,
    progress: Callable[[str], None] | None = None,
    source: str = "<model>",
    bench_progress: Callable[[str, float], None] | None = None,
) -> OptimizeResult:
    """Optimize an in-memory model; validate unless disabled. Raises ValidationFailed on drift."""
    step = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    options = for_device(options)
    if options.max_drift is not None and options.precision not in FLOAT16_PRECISIONS:
        raise UsageError("--max-drift is the drift budget of a precision change: use it with --precision fp16 or "
                         "fp16-io")
    if options.right_padded:  # usage errors (unknown names) before any work, validated or not
        from onnxfuse.runtime.inputs import input_specs
        from onnxfuse.runtime.right_padding import right_padded_draws

        right_padded_draws(input_specs(model), options.right_padded)
    rules = select_rules(options.target, options.only, options.skip, options.rules,
                         Assumptions(right_padded=frozenset(options.right_padded)))
    model, repairs = repair.repaired(model)  # what ONNX Runtime runs and onnx.checker refuses (onnxfuse/repair.py)
    repair_notes = [repair.note(repairs)] if repairs else []
    start, precision, precision_notes, float32_nodes = model, None, [], {}
    samples = reference = None
    if options.precision in FLOAT16_PRECISIONS:
        from onnxfuse.precision import convert_to_fp16

        if options.validate:  # the nodes float16 cannot hold, measured on the validation inputs
            from onnxfuse.validate.float16_range import largest_magnitudes, out_of_range_nodes

            step("measuring float16 ranges")
            samples, reference = _validation_inputs(model, options, source)
            float32_nodes = out_of_range_nodes(model, largest_magnitudes(model, samples, options.provider, source))
        step("converting to float16")
        start, precision_notes = convert_to_fp16(model, keep_nodes=float32_nodes,
                                                 float16_io=options.precision == "fp16-io")
        precision = "float16"
    elif options.precision != "fp32":
        raise UsageError(f"unknown precision {options.precision!r}; choose fp32, fp16 or fp16-io")
    step("rewriting")
    optimized, applied = rewrite_model(start, rules)  # checked there: it returns a valid model or raises
    # The rewrites' graphsurgeon graphs are reference cycles (nodes <-> tensors) holding weight arrays (a
    # folded BatchNorm's, a loaded lazy weight's): freed now, not whenever the collector next runs, so
    # validation's sessions (each a copy of the weights) do not stack on top of them. Measured: a lazily
    # loaded 256 MiB model peaked at 2.1x its weights or 1.1x, depending only on the collector's timing.
    gc.collect()
    _stamp(optimized, applied, repairs)
    rewrite_seconds = time.perf_counter() - t0
    result = OptimizeResult(
        input_path=source,
        output_path=None,
        target=options.target,
        device=options.device,
        rules=[r.name for r in rules],
        applied=applied,
        ops_before=op_counts(model),
        ops_after={},
        rewrite_seconds=rewrite_seconds,
    )
    _set_output(result, optimized, applied)
    result.extra["repairs"] = list(repairs)  # also without validation (its note carries them otherwise)
    if precision:
        budget = _drift_budget(options)
        result.extra["precision"] = {"precision": options.precision, "notes": precision_notes,
                                     "float32_nodes": float32_nodes,
                                     "max_drift": budget.to_dict() if budget is not None else None}
    if options.right_padded:
        result.extra["assumptions"] = {"right_padded": list(options.right_padded)}
    floor = judge = None
    if options.validate:
        step("validating")
        t1 = time.perf_counter()
        if samples is None:
            samples, reference = _validation_inputs(model, options, source)
        if options.save_inputs:
            from onnxfuse.runtime.inputs import save_samples

            save_samples(samples, options.save_inputs)
        from onnxfuse.validate import noise_floor

        floor = noise_floor(model, samples, reference, options.provider, name=source)
        judge = _precision_judge(start, samples, reference, options, source) if precision else None
        drift = _conversion_drift(judge, options)
        floor = _with_conversion(floor, drift)
        try:
            report = _validate(model, optimized, samples, options, reference, floor, judge)
        except SessionRefused as exc:
            step("searching for the rule responsible")
            raise _unloadable(exc, model, start, rules, applied, options) from None
        report.notes.extend(repair_notes + precision_notes + _conversion_notes(report, drift))
        result.validation = report
        if not report.passed:
            step("searching for the rule responsible")
            culprit = find_culprit(model, rules, applied, samples, options, reference, floor,
                                   start=start if precision else None, judge=judge)
            skip = None
            failing = ", ".join(report.failing())
            if culprit == PRECISION_CULPRIT:
                blame = "; culprit: the float16 conversion itself, before any rule" + _precision_drift(report, judge)
            elif culprit:
                skip, failures = working_skip(start, rules, culprit,
                                              _validation_problem(model, samples, options, reference, floor, judge))
                blame = f"; culprit rule: {culprit}" + _skip_advice(culprit, skip, failures)
            else:
                blame = ""
            result.validation_seconds = time.perf_counter() - t1
            result.total_seconds = time.perf_counter() - t0
            figures = "" if culprit == PRECISION_CULPRIT else failure_text(report.outputs, judge)
            message = (f"validation failed: output(s) {failing} differ beyond tolerance{figures}{blame}; nothing was "
                       "written")
            result.error, result.exit_code, result.culprit = message, EXIT_VALIDATION_FAILED, culprit
            raise ValidationFailed(message, culprit=culprit, report=result, skip=skip)
        result.validation_seconds = time.perf_counter() - t1
    if (options.bench or options.tuning_record) and samples is None:
        samples = sample_inputs(model, options)
    fewer = functools.partial(_fewer_rewrites, model, start, rules, samples, reference, floor, options, judge,
                              repair_notes + precision_notes, step)
    pending = decided = None
    if options.tuning_record:
        pending, decided = _apply_tuning_record(result, model, samples, options, repairs, fewer)
    if options.bench:
        step("timing")
        t2 = time.perf_counter()
        result.timing = time_both(model, result.model, samples[0], options, bench_progress)
        deadline = _tuning_deadline(options)
        if options.never_slower and decided is None:
            _keep_not_slower(result, model, rules, samples, options, repairs, fewer, bench_progress, deadline)
        if options.tune and decided is None and "selection" not in result.extra:
            _try_measured(result, model, samples, options, repairs, fewer, bench_progress, deadline)
        if pending is not None and decided is None:
            _record_decision(result, *pending)
        result.timing_seconds = time.perf_counter() - t2
        result.total_seconds = time.perf_counter() - t0
        check_slowdown(result, options.fail_on_slowdown)
    result.total_seconds = time.perf_counter() - t0
    return result


def _tuning_key(model, options: OptimizeOptions, sample) -> tuple[str, dict]:
    """The tuning record's key for ``model`` under ``options`` at ``sample``'s shapes, and what it hashes."""
    from onnxfuse.tuning_record import fingerprint, record_key

    choices = {"target": options.target, "device": options.device, "only": options.only or [],
               "skip": options.skip or [], "precision": options.precision, "right_padded": list(options.right_padded)}
    shapes = {k: list(v) for k, v in sample.shapes().items()}
    return record_key(model, choices, shapes), {"model": fingerprint(model), "choices": choices, "shapes": shapes}


def _measuring_device(options: OptimizeOptions) -> str | None:
    """What a decision measured here is keyed by: ``cpu`` for ``--device cpu``, else the GPU's name; None
    where nothing can be measured (``--device cuda`` without a usable GPU)."""
    if options.device == "cpu":
        return "cpu"
    from onnxfuse.timing import gpu_unavailable_reason
    from onnxfuse.runtime.env import gpu_names

    if gpu_unavailable_reason():
        return None
    names = gpu_names()
    return names[0].split(",")[0].strip() if names else "CUDA GPU"


def _apply_tuning_record(result, model, samples, options: OptimizeOptions, repairs, fewer):
    """``--tuning-record``: read the record; where it holds a decision for this model, options and shapes
    (measured on this GPU, or on any when none is usable here), apply it: the rules it left out are left
    out again, the candidate validated as the first model was. Returns ((record, key, what the key hashes,
    the device measuring here), the decision applied or None); the report's ``tuning_record`` says which."""
    from onnxfuse import tuning_record

    record = tuning_record.load(options.tuning_record)
    key, meta = _tuning_key(model, options, samples[0])
    here = _measuring_device(options)
    decision = record.lookup(key, here)
    info = {"path": str(record.path), "key": key, "matched": decision is not None, "written": False}
    result.extra["tuning_record"] = info
    pending = (record, key, meta, here)
    if decision is None:
        where = "on this device" if here else "anywhere (no decision for this model, options and shapes)"
        info["note"] = (f"tuning record {record.path}: nothing measured {where}" +
                        ("; measured now and recorded" if here and options.bench else
                         "; the rules' static defaults apply"))
        return pending, None
    info.update({"gpu": decision.gpu, "onnxruntime": decision.onnxruntime, "skipped_rules": decision.skipped_rules,
                 "kept": decision.kept, "measured": decision.measured, "added_rules": decision.added_rules})
    from onnxfuse.selection import ALL

    skipped = ALL if decision.skipped_rules == sorted(ALL) else frozenset(decision.skipped_rules)
    added = tuple(decision.added_rules)
    where = decision.gpu or "an unnamed device"
    if skipped or added:
        made = fewer(skipped, added=added)
        if isinstance(made, str):
            what = ", ".join([f"leave out {', '.join(sorted(skipped))}"] * bool(skipped) +
                             [f"add {', '.join(added)}"] * bool(added))
            info["note"] = (f"tuning record {record.path}: its decision (measured on {where}) to {what} "
                            f"was not applied: {made}")
            return pending, decision
        _adopt(result, *made, repairs, added)
    info["note"] = (f"tuning record {record.path}: applied the decision measured on {where} "
                    f"(ONNX Runtime {decision.onnxruntime or '?'}, {decision.measured or '?'}): "
                    + (f"without {decision.kept}" if skipped else "every rewrite kept")
                    + (f", with {', '.join(added)}" if added else ""))
    return pending, decision


def _record_decision(result, record, key: str, meta: dict, here: str | None) -> None:
    """After timing without a matching decision: what was kept (the never-slower ladder's choice, or every
    rewrite) becomes the record's decision for this model on this device; nothing when timing did not
    measure."""
    from onnxfuse import tuning_record
    from onnxfuse.runtime.env import environment

    timing = result.timing
    if here is None or timing is None or timing.status != "ok":
        return
    selection = result.extra.get("selection")
    skipped = sorted(next((set(t["skipped_rules"]) for t in selection["tried"] if t["candidate"] == selection["kept"]),
                          set())) if selection else []
    decision = tuning_record.Decision(
        skipped_rules=skipped, kept=selection["kept"] if selection else None, gpu=here,
        onnxruntime=environment(timing.device).get("onnxruntime"), device=timing.device,
        original_ms=round(timing.original.stats.median_ms, 6), optimized_ms=round(timing.optimized.stats.median_ms, 6),
        measured=tuning_record.today(),
        added_rules=[t["rule"] for t in result.extra.get("measured", []) if t["kept"]])
    record.store(key, meta, decision)
    record.save()
    result.extra["tuning_record"]["written"] = True


#: ``--precision fp16``: an output passes within this many times the drift of the model merely converted
#: to float16. Tighter than the float32 noise floor's 10x, because float16's drift is large: on a 16-block
#: residual LayerNorm stack the rewritten model drifted 1.4x the plain conversion's (0.0088 against 0.0063),
#: and tests/validate/test_noise_floor_mutations.py's planted float16 bugs are beyond 3x.
CONVERSION_MULTIPLE = 3.0


def _precision_judge(start, samples, reference, options: OptimizeOptions, source: str):
    """How a precision change is judged besides tolerance and floor (:mod:`onnxfuse.validate.drift_budget`):
    the user's ``--max-drift`` or the default budget (none with ``--strict`` unless given), and the drift of
    the model merely converted (``start``, no rewrite) against the float32 original on the same samples,
    which the rewritten model may exceed by at most :data:`CONVERSION_MULTIPLE` times."""
    from onnxfuse.validate import PrecisionJudge, conversion_drift

    conversion = conversion_drift(start, samples, reference, options.provider, name=f"{source} (float16, no rewrite)")
    return PrecisionJudge("float16", _drift_budget(options), conversion, CONVERSION_MULTIPLE)


def _drift_budget(options: OptimizeOptions):
    """The drift budget a precision change is judged by: ``--max-drift``, else the default one, except that
    ``--strict`` (tolerance alone) has none unless ``--max-drift`` is given."""
    from onnxfuse.validate.drift_budget import DEFAULT_BUDGET

    return options.max_drift if options.max_drift is not None else (None if options.strict else DEFAULT_BUDGET)


def _conversion_drift(judge, options: OptimizeOptions) -> dict[str, float]:
    """``--precision fp16`` with the default tolerances: each output's largest absolute drift in the model
    merely converted (no rewrite, ``judge.conversion``), which joins the noise floor
    (:func:`_with_conversion`) so that the rewritten model is judged by what float16 allows (within
    :data:`CONVERSION_MULTIPLE` times that drift) rather than by float32's noise. Explicit
    ``--rtol``/``--atol`` keep it off, as ``--strict`` does: they are judged by tolerance, and by the drift
    budget (scale-free, unlike an absolute drift)."""
    if judge is None or options.rtol is not None or options.atol is not None or options.strict:
        return {}
    return {name: d.max_abs for name, d in judge.conversion.items()}


def _conversion_share(drift: float) -> float:
    """The floor a conversion ``drift`` stands for: scaled by ``CONVERSION_MULTIPLE / FLOOR_MULTIPLE``, so the
    one floor test (within ``FLOOR_MULTIPLE`` x the floor) applies :data:`CONVERSION_MULTIPLE` to it."""
    from onnxfuse.validate import FLOOR_MULTIPLE

    return drift * CONVERSION_MULTIPLE / FLOOR_MULTIPLE


def _with_conversion(floor: dict[str, float], drift: dict[str, float]) -> dict[str, float]:
    """The noise floor raised, per output, to what its conversion drift allows."""
    return {k: max(floor.get(k, 0.0), _conversion_share(drift.get(k, 0.0))) for k in floor.keys() | drift.keys()}


def _conversion_notes(report: ValidationReport, drift: dict[str, float]) -> list[str]:
    """Each output's conversion drift in the report (``extra["conversion_drift"]``) and one note when an output
    passed only within it."""
    for c in report.outputs:
        if c.name in drift:
            c.extra["conversion_drift"] = drift[c.name]
    helped = [c for c in report.outputs if c.extra.get("passed_by") == "noise floor"
              and _conversion_share(drift.get(c.name, 0.0)) >= c.extra.get("noise_floor", 0.0) > 0]
    if not helped:
        return []
    worst = max(helped, key=lambda c: c.max_abs)
    return [f"--precision fp16: {', '.join(c.name for c in helped)} beyond float16's default tolerance but within "
            f"{CONVERSION_MULTIPLE:g}x the drift of the model merely converted to float16, no rewrite ({worst.name}: "
            f"max abs {worst.max_abs:.3g} against {drift[worst.name]:.3g}); explicit --rtol/--atol judge by tolerance "
            "and the drift budget (--max-drift), --strict by tolerance alone"]


def _precision_drift(report: ValidationReport, judge) -> str:
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


#: Sizes tried, in order, for dynamic dimensions nobody sized when the original model cannot run at 1
#: (a 3x3 Conv over H = W = 1, a pooling window wider than the input).
DEFAULT_DIM_RETRIES = (8, 32, 224)


def _validation_inputs(model, options: OptimizeOptions, source: str):
    """The validation samples and the original's outputs on them: the drawn (or given) samples, plus the
    second size when onnxfuse drew them, all from one session of the original (:class:`_OriginalRuns`)."""
    original = _OriginalRuns(model, options.provider, source)
    samples, reference = _reference_run(model, options, source, original)
    if options.inputs is None and options.inputs_path is None:
        _add_second_size(model, samples, reference, options, source, original)
        _add_realistic_size(model, samples, reference, options, original)
    original.close()  # before the noise floor's and the optimized model's sessions: one model's at a time
    return samples, reference


def _add_realistic_size(model, samples: list, reference: list, options: OptimizeOptions, original) -> None:
    """Append a token model's realistic sample (:mod:`onnxfuse.runtime.realistic`: three rows at the first of
    128, 64, 32, 16 tokens the original runs at, masks with real padding) and the original's outputs on it;
    nothing for other models, for KV-cache decoders (sizes derived from relations: their prefill and
    decode samples do this job) or where the original runs at none of the lengths."""
    from onnxfuse.errors import RuntimeFailure
    from onnxfuse.runtime.inputs import derived_shapes, input_specs
    from onnxfuse.runtime.realistic import LENGTHS, realistic_sample

    if derived_shapes(model, input_specs(model), options.shapes or {}) is not None:
        return
    for length in LENGTHS:
        sample = realistic_sample(model, length, options.seed + 7, options.right_padded, options.shapes)
        if sample is None:
            return
        try:
            outputs = original([sample])
        except RuntimeFailure:
            continue
        samples.append(sample)
        reference.extend(outputs)
        return


class _OriginalRuns:
    """The original model's outputs (graph optimizations off) on any draws, from one ONNX Runtime session
    made on first use: the reference run, its retries at other sizes and the second size's candidates
    used to make a session each. Why: creating a session is most of validation's time on large models;
    measured (cProfile, this 2-core machine, CPU): BERT-base 0.34 s a session, a 1.1B-parameter decoder
    4.4 s, six sessions a run (docs/benchmarks.md 5.23). Outputs are those of :func:`run_samples`, which
    makes the same session (a failed creation is not kept: the next call tries again, as before)."""

    def __init__(self, model, provider: str, name: str):
        self.model, self.provider, self.name, self.session = model, provider, name, None

    def __call__(self, samples: list) -> list:
        from onnxfuse.runtime.session import make_session, run_session

        if self.session is None:
            self.session = make_session(self.model, provider=self.provider, name=self.name)
        return [run_session(self.session, s if isinstance(s, dict) else s.feeds, name=self.name) for s in samples]

    def close(self) -> None:
        self.session = None


def _reference_run(model, options: OptimizeOptions, source: str, original: _OriginalRuns | None = None):
    """The validation samples and the original's outputs on them. Unsized dynamic dimensions default
    to 1; where the original cannot run at 1, to 8, 32 and then 224 (with a note); where it runs at
    none of these, one line names the dimensions and the --shape to pass."""
    from onnxfuse.errors import InputsError, RuntimeFailure
    from onnxfuse.runtime.inputs import input_specs, unsized_dimensions

    run = original or _OriginalRuns(model, options.provider, source)
    samples = sample_inputs(model, options)
    given = options.inputs is not None or options.inputs_path is not None
    unsized = [] if given else unsized_dimensions(input_specs(model), options.shapes)
    try:
        return samples, run(samples)
    except RuntimeFailure as first:
        if not unsized:
            raise
        for size, derive in ((1, False), *((size, True) for size in DEFAULT_DIM_RETRIES)):
            retry = sample_inputs(model, options, default_dim=size, derive=derive)
            if not derive and retry[0].feeds.keys() == samples[0].feeds.keys() and all(
                    retry[0].feeds[k].shape == samples[0].feeds[k].shape for k in retry[0].feeds):
                continue  # no sizes were derived: the same draw as the one that failed
            try:
                reference = run(retry)
            except RuntimeFailure:
                continue
            if not derive:
                retry[0].notes.append(f"the original model does not run at the sizes derived from its dimension "
                                      f"relations ({first}); validated with every dynamic dimension at 1")
            else:
                retry[0].notes.append(f"the original model does not run with {', '.join(unsized)} set to 1 "
                                      f"({first}); validated with {size}")
            return retry, reference
        raise InputsError(f"the original model does not run with dynamic dimension(s) {', '.join(unsized)} set to "
                          f"1, 8, 32 or 224; give sizes with --shape NAME:D0,D1,... ({first})") from None


def _add_second_size(model, samples: list, reference: list, options: OptimizeOptions, source: str,
                     original: _OriginalRuns | None = None) -> None:
    """Append a sample at a second size of every dynamic dimension (and the original's outputs on it)
    when the original runs there (:func:`onnxfuse.runtime.inputs.second_size_candidates`); else a
    note says validation ran at one size."""
    from onnxfuse.runtime.inputs import relation_variants, second_size_candidates

    run = original or _OriginalRuns(model, options.provider, source)
    groups = relation_variants(model, samples[0], options.seed)
    if groups:
        _add_variants(model, samples, reference, options, source, groups, run)
        return
    candidates = second_size_candidates(model, samples[0], options.seed)
    if _add_first_that_runs(model, candidates, samples, reference, options, source, run):
        return
    if candidates:
        samples[0].notes.append("validated at one size only: the original model does not run with its dynamic "
                                "dimensions one larger (use --shape to choose sizes)")


def _add_variants(model, samples: list, reference: list, options: OptimizeOptions, source: str, groups,
                  run: _OriginalRuns) -> None:
    """For a model whose dynamic dimensions are tied: the first candidate of each group (second size,
    prefill, decode: :func:`onnxfuse.runtime.inputs.relation_variants`) the original runs on, with a note
    for a group where it runs on none."""
    for how, draws in groups:
        if not _add_first_that_runs(model, draws, samples, reference, options, source, run):
            samples[0].notes.append(f"no {how} sample: the original model does not run at the sizes derived for it")


def _add_first_that_runs(model, draws, samples: list, reference: list, options: OptimizeOptions, source: str,
                         run: _OriginalRuns) -> bool:
    """Append the first of ``draws`` the original model runs on (and its outputs); False when none runs."""
    from onnxfuse.errors import RuntimeFailure

    for draw in draws:
        try:
            (outputs,) = run([draw])
        except RuntimeFailure:
            continue
        samples.append(draw)
        reference.append(outputs)
        return True
    return False


def sample_inputs(model: onnx.ModelProto, options: OptimizeOptions, default_dim: int = 1,
                  derive: bool = True) -> list[Inputs]:
    """The samples validation runs on: the user's (``options.inputs`` or ``options.inputs_path``), else
    seeded draws (at sizes derived from the graph's dimension relations where it has binding ones,
    ``derive``). Timing uses the first."""
    if options.inputs is not None and options.inputs_path is not None:
        raise UsageError("give the inputs once: OptimizeOptions.inputs or inputs_path, not both")
    given = options.inputs if options.inputs is not None else options.inputs_path
    return make_samples(model, options.shapes, options.seed, given, options.input_ranges, default_dim, options.samples,
                        right_padded=options.right_padded, derive=derive)


def _stamp(optimized, applied, repairs) -> None:
    """The metadata every output carries: the rules that applied, the repairs, FusedElementwise values."""
    model_io.set_metadata(optimized, METADATA_KEY, ",".join(applied.applied_rules()) or "none")
    if repairs:
        model_io.set_metadata(optimized, repair.METADATA_KEY, "; ".join(repairs))
    fused_values = {d["node"]: d["values"] for d in applied.details if d.get("values")}
    if fused_values:
        from onnxfuse.custom_ops import FUSED_VALUES_KEY

        model_io.set_metadata(optimized, FUSED_VALUES_KEY, json.dumps(fused_values, sort_keys=True))


def _adopt(result: OptimizeResult, model, applied, validation, repairs, added=()) -> None:
    """``result`` describes another candidate instead (the never-slower ladder's, a measured choice's, a
    tuning record's): ``model`` as ``applied`` wrote it, stamped, with its ``validation`` (None when
    validation is off) and the opt-in rules ``added`` among the rules run."""
    _stamp(model, applied, repairs)
    _set_output(result, model, applied)
    if validation is not None:
        result.validation = validation
    if added:
        from onnxfuse.rewrites import rule_names

        chosen = set(result.rules) | set(added)
        result.rules = [name for name in rule_names() if name in chosen]


def _set_output(result: OptimizeResult, optimized, applied) -> None:
    """``result`` describes ``optimized``, written by the rewrite ``applied``."""
    result.model, result.applied, result.ops_after = optimized, applied, op_counts(optimized)
    result.custom_library = custom_library_needed(optimized)
    from onnxfuse.runtime.stand_ins import cuda_only_ops

    needs_cuda = cuda_only_ops(optimized)  # only when there are some: reports without them stay as they were
    if needs_cuda:
        result.extra["cuda_only_ops"] = needs_cuda
    else:
        result.extra.pop("cuda_only_ops", None)
    result.unfused = unfused_patterns(applied.refusals, {n.name or unnamed_label(n.op_type, n.output[0] if n.output else ""):
                                                         n.op_type for n in optimized.graph.node})


def _fewer_rewrites(model, start, rules, samples, reference, floor, options, judge, notes, step, skipped,
                    added=()):
    """``start`` rewritten without the ``skipped`` rules (:data:`~onnxfuse.selection.ALL`: none run) and
    with the opt-in rules ``added`` (in their place in the run order), validated as the first model was:
    (model, applied, validation or None), or why it cannot be kept."""
    from onnxfuse.selection import ALL

    step("trying fewer rewrites" if not added else f"trying {', '.join(added)}")
    chosen = [] if skipped == ALL else [r for r in rules if r.name not in skipped]
    if added:
        extra = select_rules(options.target, [f"+{name}" for name in added], None, options.rules,
                             Assumptions(right_padded=frozenset(options.right_padded)))
        names = {r.name for r in chosen} | set(added)
        chosen = [r for r in extra if r.name in names]  # the registry's order
    candidate, applied = rewrite_model(start, chosen)
    report = None
    if options.validate:
        try:
            report = _validate(model, candidate, samples, options, reference, floor, judge)
        except SessionRefused as exc:  # never kept, never written; the reason says whose fault it is
            return f"ONNX Runtime cannot load it, an onnxfuse bug ({_refusal(exc)})"
        report.notes.extend(notes)
        if not report.passed:
            return "validation failed"
    return candidate, applied, report


def _tuning_deadline(options: OptimizeOptions) -> float:
    """When tuning (the never-slower ladder, the measured choices) starts no new candidate: now plus
    ``options.tune_time`` seconds (:data:`~onnxfuse.selection.TUNE_TIME_S` by default)."""
    from onnxfuse.selection import TUNE_TIME_S

    return time.monotonic() + (TUNE_TIME_S if options.tune_time is None else options.tune_time)


def _keep_not_slower(result, model, rules, samples, options, repairs, fewer, bench_progress, deadline=None) -> None:
    """:mod:`onnxfuse.selection`: when the output timed slower than the original, fewer rewrites
    (``fewer(skipped)``: :func:`_fewer_rewrites`), each validated and timed, down to the graph as loaded;
    ``result`` then describes the one kept."""
    from onnxfuse.selection import keep_not_slower

    selection = keep_not_slower(result.timing, result.applied.applied_rules(), fewer,
                                lambda candidate: time_both(model, candidate, samples[0], options, bench_progress),
                                deadline)
    if selection is None:
        return
    kept = selection.kept
    _adopt(result, kept.model, kept.applied, kept.validation, repairs)
    if kept.timing is not None and kept.timing.status == "ok":
        result.timing = kept.timing
    result.timing.notes.append(selection.note())
    result.extra["selection"] = selection.to_dict()


def _try_measured(result, model, samples, options, repairs, fewer, bench_progress, deadline=None) -> None:
    """:func:`onnxfuse.selection.try_measured`: the measured choices (opt-in rules whose worth depends on
    the GPU and shapes, ``selection.MEASURED``) tried on top of the output, each validated and timed
    against the original; ``result`` then describes the output with those that were faster. Their
    trials go in the report (``measured``) and one note each. Not with a restricting ``--only`` (the user
    chose the rules), and only rules of the target (``--target contrib``/``onnx``, ``--device cpu``:
    channels-last is for the CUDA provider)."""
    from onnxfuse.rewrites import parse_rule_names
    from onnxfuse.selection import measured_rules, try_measured

    if any(not name.startswith("+") for name in parse_rule_names(options.only)):
        return
    candidates = [name for name in measured_rules(model, result.rules, parse_rule_names(options.skip))
                  if name in {r.name for r in select_rules(options.target, [f"+{name}"], None, options.rules)}]
    if not candidates or result.timing is None or result.timing.status != "ok":
        return
    before = result.timing
    trials = try_measured(before, candidates, lambda added: fewer(frozenset(), added=tuple(added)),
                          lambda candidate: time_both(model, candidate, samples[0], options, bench_progress),
                          deadline)
    kept = [t for t in trials if t.refused is None]
    notes = [t.note(before) for t in trials]
    result.extra["measured"] = [t.to_dict(before) for t in trials]
    if kept:
        last = kept[-1]
        _adopt(result, last.model, last.applied, last.validation, repairs, [t.rule for t in kept])
        result.timing = last.timing
    result.timing.notes.extend(notes)


def time_both(original, optimized, inputs: Inputs, options: OptimizeOptions, progress=None):
    """Time both models under ORT_ENABLE_ALL on ``options.bench_config``'s device (the GPU by default,
    ``status='no-gpu'`` where there is none; the CPU for ``--device cpu``, :func:`for_device`)."""
    from onnxfuse.timing import BenchConfig, compare_models

    config = options.bench_config if options.bench_config is not None else BenchConfig()
    return compare_models(original, optimized, inputs, config, progress=progress)


def check_slowdown(result: OptimizeResult, ratio: float | None) -> None:
    """Raise :class:`SlowerThanAllowed` when timing ran and optimized > ``ratio`` × original (median).

    Where timing could not measure (``--device cuda`` without a GPU, a model ONNX Runtime could not time),
    the timing's one line says that the check was not made, never a silent pass (the JUnit report then
    holds a skipped latency case)."""
    timing = result.timing
    if ratio is not None and timing is not None and timing.status != "ok":
        hint = "; --device cpu optimizes for and times on the CPU" if timing.status == "no-gpu" else ""
        why = getattr(timing, "message", None) or f"timing {timing.status}"
        timing.message = f"--fail-on-slowdown {ratio:g} was not checked: {why}{hint}"
        return
    if ratio is None or timing is None or timing.status != "ok":
        return
    before, after = timing.original.stats.median_ms, timing.optimized.stats.median_ms
    if after > ratio * before:
        message = (f"optimized model is slower than allowed: median {after:.3f} ms vs {before:.3f} ms for the "
                   f"original (ratio {after / before:.3f} > --fail-on-slowdown {ratio}); nothing was written")
        result.error, result.exit_code = message, EXIT_SLOWER
        raise SlowerThanAllowed(message, report=result)


def run_pipeline(
    model: onnx.ModelProto | str | os.PathLike,
    output_path: str | os.PathLike | None,
    options: OptimizeOptions,
    progress: Callable[[str], None] | None = None,
    bench_progress: Callable[[str, float], None] | None = None,
) -> OptimizeResult:
    """Optimize ``model`` (a path, loaded with its external data, or a ``ModelProto``, never modified),
    validate, time (with a GPU, when ``options.bench``), and write ``output_path`` atomically when given.

    The output path is checked before any long work; nothing is written when anything fails.
    """
    step = progress or (lambda _msg: None)
    t0 = time.perf_counter()
    input_path = None
    if isinstance(model, (str, os.PathLike)):
        input_path = model
    elif not isinstance(model, onnx.ModelProto):
        raise TypeError(f"model must be a path or an onnx.ModelProto, not {type(model).__name__}")
    else:
        model_io.check_given_model(model, "<model>")
    if output_path is not None:
        model_io.check_output_path(output_path, input_path, options.force)
    load_seconds = 0.0
    if input_path is not None:
        step("loading")
        t_load = time.perf_counter()
        model = model_io.load_model(input_path)
        load_seconds = time.perf_counter() - t_load
    source = str(input_path) if input_path is not None else "<model>"
    try:
        result = optimize_model(model, options, progress, source=source, bench_progress=bench_progress)
    except (ValidationFailed, SlowerThanAllowed) as exc:  # their report's timings include the load too
        if isinstance(exc.report, OptimizeResult):
            exc.report.load_seconds = load_seconds
            exc.report.total_seconds = time.perf_counter() - t0
        raise
    result.load_seconds = load_seconds
    if output_path is not None:
        step("saving")
        model_io.save_model(result.model, output_path, input_path=input_path, force=options.force,
                            check=False)
        result.output_path = str(output_path)
    result.total_seconds = time.perf_counter() - t0
    return result


def optimize_file(
    input_path: str | Path,
    output_path: str | Path,
    options: OptimizeOptions,
    progress: Callable[[str], None] | None = None,
    bench_progress: Callable[[str, float], None] | None = None,
) -> OptimizeResult:
    """Load ``input_path``, optimize, validate, time (with a GPU), and write ``output_path`` atomically."""
    return run_pipeline(input_path, output_path, options, progress, bench_progress)
