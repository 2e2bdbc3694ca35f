"""The ``optimize`` pipeline as plain functions: the stages in order, each calling into the package that
owns it. What stays here is their order and the result they fill in.

:func:`run_pipeline` takes a path or a ``ModelProto`` and an optional output path; the Python API
(:func:`onnxfuse.optimize`) and the CLI (through it) only turn their arguments into
:class:`OptimizeOptions` and read the :class:`OptimizeResult`. The stages (:func:`run_pipeline`, then
:func:`optimize_model`):

1. load (:mod:`onnxfuse.model_io`; the output path checked first) and repair (:mod:`onnxfuse.repair`);
2. precision: the float16 conversion (:mod:`onnxfuse.precision`), the nodes kept float32 measured by
   :mod:`onnxfuse.validate.float16_range` (values float16 cannot hold) and
   :mod:`onnxfuse.validate.float16_drift` (float16 results that break the drift budget);
3. rewrite: :func:`rewrite_model` on :mod:`onnxfuse.rewrites` (a broken rule is dropped), then stamped;
4. validate (:mod:`onnxfuse.validate`): the samples and the original's outputs on them, one
   :class:`~onnxfuse.validate.verdict.Validator` for every candidate; when the output fails,
   :mod:`onnxfuse.validate.culprit` names the rule to blame, nothing is written and
   :class:`~onnxfuse.errors.ValidationFailed` carries the culprit;
5. a tuning record's decision applied (:func:`onnxfuse.tuning_record.apply_decision`);
6. time both models (:mod:`onnxfuse.timing`), then never slower and the measured choices
   (:func:`onnxfuse.selection.fall_back_if_slower`, :func:`~onnxfuse.selection.add_measured_choices`),
   the decision recorded (:func:`onnxfuse.tuning_record.record_decision`) and the slowdown checked;
7. save (atomically, :func:`onnxfuse.model_io.save_model`).

The candidates of stages 5 and 6 come from one maker here (:func:`_fewer_rewrites`: rewritten, then
judged by the run's Validator), and :func:`_adopt` makes the result describe the one kept.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import onnx

from onnxfuse import model_io, repair, selection, tune_sizes, tuning_record
from onnxfuse.bodies import bodies_read_new_constants, body_rules, left_note, rewrite_bodies
from onnxfuse.custom_ops import DOMAIN, FUSED_VALUES_KEY
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
from onnxfuse.precision import BFLOAT16, FLOAT16, PRECISIONS, TARGETS, convert_to_fp16, float32_nodes_left
from onnxfuse.precision_kernels import bfloat16_usable, installed_kernel_islands, kernel_islands
from onnxfuse.reports.jsonreport import optimize_json
from onnxfuse.rewrites import (ApplyReport, Assumptions, Rule, RuleFailed, apply_rules, rule_names, select_rules,
                               target_for_device)
from onnxfuse.rewrites.engine.rule import unnamed_label
from onnxfuse.rewrites.facts.inference import inferred_and_proven
from onnxfuse.runtime.inputs import Inputs, input_specs, save_samples
from onnxfuse.runtime.right_padding import right_padded_draws
from onnxfuse.runtime.session import uses_custom_ops
from onnxfuse.runtime.stand_ins import cuda_only_ops
from onnxfuse.selection import ALL
from onnxfuse.timing import BenchConfig
from onnxfuse.unfused import unfused_patterns
from onnxfuse.validate import ValidationReport
from onnxfuse.validate.culprit import explain_failure, first_failing_rule, unloadable
from onnxfuse.validate.float16_drift import drift_islands
from onnxfuse.validate.float16_range import largest_magnitudes, out_of_range_nodes
from onnxfuse.validate.precision_judge import conversion_notes, drift_budget_of
from onnxfuse.validate.reference import validation_inputs
from onnxfuse.validate.samples import sample_inputs
from onnxfuse.validate.verdict import make_validator, refusal_reason

#: Metadata key recording which onnxfuse produced a model (and with which rules).
METADATA_KEY = "onnxfuse"


from onnxfuse.options import declared_fields  # noqa: E402  (beside the one class it shapes)


@dataclass
@declared_fields
class OptimizeOptions:
    """What one ``optimize`` run does. A field for every option of :data:`onnxfuse.options.OPTIMIZE` (its
    meaning, default and check are declared there once; :func:`onnxfuse.api.optimize` fills them checked),
    then the fields below, which no option sets."""

    inputs_path: str | None = None  # an .npz file (as ``inputs`` takes one; only one of the two)


def for_device(options: OptimizeOptions) -> OptimizeOptions:
    """``options`` with the device's target, validation provider and timing configuration filled in.

    ``device="cpu"`` optimizes for ONNX Runtime's CPU provider: the rules of ``--target contrib`` (or
    ``onnx``; never FusedElementwise, see :func:`onnxfuse.rewrites.target_for_device`), validated on the
    CPU provider, both models timed there, so the never-slower ladder (:mod:`onnxfuse.selection`) and
    ``--fail-on-slowdown`` decide on CPU timings. ``device="cuda"`` changes nothing (the defaults)."""
    target = target_for_device(options.target, options.device)
    if options.device != "cpu":
        return replace(options, target=target)
    if options.provider not in ("auto", "cpu"):
        raise UsageError(f"--device cpu validates on the CPU provider; drop --provider {options.provider}")
    config = options.bench_config
    if config is None:
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
    body_ops_before: dict[str, int] = field(default_factory=dict)  # in If/Loop/Scan bodies (op_counts(in_bodies))
    body_ops_after: dict[str, int] = field(default_factory=dict)
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
            "ops_in_bodies": {"before": self.body_ops_before, "after": self.body_ops_after},
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
        return optimize_json(self)

    def save(self, path: str | os.PathLike, force: bool = False) -> Path:
        """Write the optimized model to ``path`` atomically (as ``output`` does); refuses to overwrite the
        input file unless ``force``. Sets :attr:`output_path`."""
        source = self.input_path if self.input_path and Path(self.input_path).is_file() else None
        out = model_io.save_model(self.model, path, input_path=source, force=force, check=False)
        self.output_path = str(path)
        return out


def op_counts(model: onnx.ModelProto, in_bodies: bool = False) -> dict[str, int]:
    """Node count per op type (``domain::Op`` for non-standard domains), main graph only; ``in_bodies``:
    the nodes of the If branches and Loop/Scan bodies instead, at any depth (a KV-cache decoder's
    DecodeAttention and prefill MultiHeadAttention sit in an If per layer: without these rows the
    report showed neither)."""
    graphs = list(model_io.proto_graphs(model.graph))[1:] if in_bodies else [model.graph]
    counts = Counter(
        (f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type) for g in graphs for n in g.node
    )
    return dict(sorted(counts.items()))


def growth_note(applied: ApplyReport) -> str | None:
    """One line naming the rules that made the stored weights larger by more than 1 MiB in all (a file
    twice the input's size should not come as a surprise), with the ``--skip`` that avoids it; None
    otherwise."""
    grown = applied.bytes_added()
    if sum(total for total, _ in grown.values()) <= 1 << 20:
        return None
    parts = [f"{rule} {total / 1e6:.1f} MB ({count} tensor{'s' if count != 1 else ''})"
             for rule, (total, count) in sorted(grown.items())]
    return (f"the output stores more weight bytes than the input: {', '.join(parts)}; "
            f"--skip {','.join(sorted(grown))} keeps the file smaller")


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
            with model_io.quiet_graphsurgeon():  # (bfloat16 tensors: a warning per tensor, expected)
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


def _rewrite_once(model: onnx.ModelProto, rules: list[Rule], bodies: bool = True,
                  again: bool = True) -> tuple[onnx.ModelProto, ApplyReport]:
    """``rules`` applied to the main graph, after the bodies of its If/Loop/Scan nodes were rewritten
    each as a model of its own by the rules that may run there (:mod:`onnxfuse.bodies`; ``bodies``: not
    for a body itself). Where the main pass made a value a body reads a constant, the whole is
    rewritten once more (``again``), so that a second optimize finds nothing to do."""
    inner = body_rules(rules) if bodies else []
    body_reports, left = [], []
    if inner:
        model, body_reports, left = rewrite_bodies(model, lambda body: _rewrite_once(body, inner, bodies=False))
    graph = inferred_and_proven(model, model_io.to_graph)
    report = apply_rules(graph, rules)
    for body in body_reports:
        report.absorb(body.report)
    report.bodies = [*({"node": r.node, "attribute": r.attribute, "rewrites": r.report.total} for r in body_reports),
                     *({"node": s.node, "attribute": s.attribute, "left": s.reason} for s in left)]
    out = model_io.to_model(graph, model)
    correct_output_shapes(out)  # a declaration the rewritten graph provably contradicts (onnxfuse/declared_shapes.py)
    if inner and again and bodies_read_new_constants(model, out):
        out, more = _rewrite_once(out, rules, bodies=True, again=False)
        report.absorb(more)
        report.bodies.extend(more.bodies)
    return out, report


def _first_invalidating_rule(model: onnx.ModelProto, changed: list[Rule]) -> str | None:
    """The first rule (in run order) whose prefix of ``changed`` gives an invalid model (or raises): the
    culprit search's bisection (:func:`~onnxfuse.validate.culprit.first_failing_rule`) with the checker as
    judge; the empty prefix is valid (the input was checked at load), the whole list not."""

    def rewrite(start, rules):  # a prefix whose rule raises is as invalid as one the checker refuses
        try:
            return _rewrite_once(start, rules)
        except RuleFailed as failed:
            return failed, None

    def problem(candidate):
        return "a rule raised" if isinstance(candidate, RuleFailed) else repair.validity_problem(candidate)

    return first_failing_rule(model, changed, problem, rewrite)


def custom_library_needed(model: onnx.ModelProto) -> str | None:
    """The custom-op domain the model needs a library for, if any (ONNX Runtime's contrib ops don't)."""
    return DOMAIN if uses_custom_ops(model) else None


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
    if options.max_drift is not None and options.precision not in TARGETS:
        raise UsageError("--max-drift is the drift budget of a precision change: use it with --precision fp16, "
                         "fp16-io or bf16")
    if options.right_padded:  # usage errors (unknown names) before any work, validated or not
        right_padded_draws(input_specs(model), options.right_padded)
    # --tune-shape's and --tune-dim's draws, made now so that a size the model cannot take is a usage error
    # before any work
    other_sizes = tune_sizes.tune_size_inputs(model, options) if options.bench else []
    rules = select_rules(options.target, options.only, options.skip, options.rules,
                         Assumptions(right_padded=frozenset(options.right_padded)))
    model, repairs = repair.repaired(model)  # what ONNX Runtime runs and onnx.checker refuses (onnxfuse/repair.py)
    repair_notes = [repair.note(repairs)] if repairs else []
    start, precision, precision_notes, float32_nodes, drift_notes = model, None, [], {}, []
    measured_rounding: dict = {}  # the conversion's drift rounded per op, if the island search measured it
    samples = reference = None
    target = TARGETS.get(options.precision)
    if target is not None:
        if target is BFLOAT16:
            bfloat16_usable(options)
            float32_nodes = kernel_islands(model, target)  # ops ONNX Runtime's CUDA provider has no bfloat16 for
        if options.validate:
            if target is BFLOAT16:  # what the installed ONNX Runtime lacks beside the table (on CUDA: checked)
                step("loading the bfloat16 conversion on CUDA")
                float32_nodes, drift_notes = installed_kernel_islands(model, target, float32_nodes, source)
            if target is FLOAT16:  # the nodes float16 cannot hold (bfloat16 holds float32's range)
                step("measuring float16 ranges")
                samples, reference = validation_inputs(model, options, source)
                float32_nodes = out_of_range_nodes(model, largest_magnitudes(model, samples, options.provider, source))
            else:
                samples, reference = validation_inputs(model, options, source)
            budget = drift_budget_of(options)
            if budget is not None:  # the nodes whose float16 (bfloat16) results break the drift budget
                step(f"measuring {target.name} drift")
                drifting, search_notes = drift_islands(model, float32_nodes, samples, reference, budget,
                                                       options.provider, options.precision == "fp16-io", source,
                                                       rounded=measured_rounding, target=target, progress=step)
                float32_nodes, drift_notes = {**float32_nodes, **drifting}, drift_notes + search_notes
        step(f"converting to {target.name}")
        start, precision_notes = convert_to_fp16(model, keep_nodes=float32_nodes,
                                                 float16_io=options.precision == "fp16-io", target=target)
        precision_notes += drift_notes
        precision = target.name
    elif options.precision != "fp32":
        raise UsageError(f"unknown precision {options.precision!r}; choose one of {', '.join(PRECISIONS)}")
    step("rewriting")
    optimized, applied = rewrite_model(start, rules)  # checked there: it returns a valid model or raises
    # The rewrites' graphsurgeon graphs are reference cycles (nodes <-> tensors) holding weight arrays (a
    # folded BatchNorm's, a loaded lazy weight's): freed now, not whenever the collector next runs, so
    # validation's sessions (each a copy of the weights) do not stack on top of them. Measured: a lazily
    # loaded 256 MiB model peaked at 2.1x its weights or 1.1x, depending only on the collector's timing.
    gc.collect()
    _stamp(optimized, applied, repairs)
    rewrite_seconds = time.perf_counter() - t0
    result = OptimizeResult(input_path=source, output_path=None, target=options.target, device=options.device,
                            rules=[r.name for r in rules], applied=applied, ops_before=op_counts(model), ops_after={},
                            rewrite_seconds=rewrite_seconds, body_ops_before=op_counts(model, in_bodies=True))
    _set_output(result, optimized, applied)
    result.extra["repairs"] = list(repairs)  # also without validation (its note carries them otherwise)
    if precision:
        budget = drift_budget_of(options)
        left, fused_note = float32_nodes_left(float32_nodes, optimized)
        precision_notes += [fused_note] if fused_note else []
        result.extra["precision"] = {"precision": options.precision, "notes": precision_notes,
                                     "float32_nodes": float32_nodes, "float32_nodes_left": left,
                                     "max_drift": budget.to_dict() if budget is not None else None}
    if options.right_padded:
        result.extra["assumptions"] = {"right_padded": list(options.right_padded)}
    validator = None
    if options.validate:
        step("validating")
        t1 = time.perf_counter()
        if samples is None:
            samples, reference = validation_inputs(model, options, source)
        if options.save_inputs:
            save_samples(samples, options.save_inputs)
        validator = make_validator(model, start, samples, reference, options, source, precision,
                                   measured_rounding.get("drift"))
        try:
            report = validator.validate(optimized)
        except SessionRefused as exc:
            step("searching for the rule responsible")
            raise unloadable(exc, model, start, rules, applied, options, rewrite_model) from None
        body_notes = [n for n in [left_note(applied.bodies), growth_note(applied)] if n]
        converted = conversion_notes(report, validator.conversion, precision or "float16")
        report.notes.extend(repair_notes + body_notes + precision_notes + converted)
        result.validation = report
        if not report.passed:
            step("searching for the rule responsible")
            culprit, skip, message = explain_failure(validator, report, start, rules, applied, rewrite_model,
                                                     precision)
            result.validation_seconds = time.perf_counter() - t1
            result.total_seconds = time.perf_counter() - t0
            result.error, result.exit_code, result.culprit = message, EXIT_VALIDATION_FAILED, culprit
            raise ValidationFailed(message, culprit=culprit, report=result, skip=skip)
        result.validation_seconds = time.perf_counter() - t1
    if (options.bench or options.tuning_record) and samples is None:
        samples = sample_inputs(model, options)
    fewer = functools.partial(_fewer_rewrites, start, rules, validator, options, repair_notes + precision_notes, step)
    adopt = functools.partial(_adopt, result, repairs)
    pending = decided = None
    if options.tuning_record:
        pending, decided = tuning_record.apply_decision(result, model, samples, options, fewer, adopt)
    if options.bench:
        step("timing")
        t2 = time.perf_counter()

        def time_one(candidate, inputs):
            return time_both(model, candidate, inputs, options, bench_progress)

        def time_two(candidate, incumbent, inputs):
            return time_both(model, candidate, inputs, options, bench_progress, beside=incumbent)

        def retime(candidate, beside=None):
            """The output or a candidate against the original; with ``beside`` (the incumbent a measured
            choice must beat) both in one run: (candidate's timing, incumbent's)."""
            if beside is not None:  # a measured choice's trial: stopped between sizes at the deadline
                return tune_sizes.time_beside_at_sizes(time_two, candidate, beside, samples[0], other_sizes,
                                                       deadline)
            return tune_sizes.time_at_sizes(time_one, candidate, samples[0], other_sizes)

        deadline = None  # (set below, before any trial: the output's own timing is never cut)
        result.timing = retime(result.model)

        deadline = selection.deadline_after(options.tune_time)
        if options.never_slower and decided is None:
            selection.fall_back_if_slower(result, fewer, retime, adopt, deadline)
        if options.tune and decided is None and "selection" not in result.extra:
            selection.add_measured_choices(result, options, fewer, retime, adopt, deadline)
        if pending is not None and decided is None:
            tuning_record.record_decision(result, *pending)
        result.timing.notes.extend(tune_sizes.size_notes(result.timing))
        result.timing_seconds = time.perf_counter() - t2
        result.total_seconds = time.perf_counter() - t0
        check_slowdown(result, options.fail_on_slowdown)
    result.total_seconds = time.perf_counter() - t0
    return result


def _stamp(optimized, applied, repairs) -> None:
    """The metadata every output carries: the rules that applied, the repairs, FusedElementwise values."""
    model_io.set_metadata(optimized, METADATA_KEY, ",".join(applied.applied_rules()) or "none")
    if repairs:
        model_io.set_metadata(optimized, repair.METADATA_KEY, "; ".join(repairs))
    fused_values: dict = {}
    for d in applied.details:  # in the order the rewrites happened
        if d.get("values"):
            fused_values[d["node"]] = d["values"]
        # concat-into-elementwise removed these FusedElementwise nodes (their values are computed inside a
        # FusedConcat now, where expose_fused_values does not look): no entry names a node that is gone. A
        # later node given the same name brings its own entry after this.
        for name in d.get("absorbed_nodes", ()):
            fused_values.pop(name, None)
    if fused_values:
        model_io.set_metadata(optimized, FUSED_VALUES_KEY, json.dumps(fused_values, sort_keys=True))


def _adopt(result: OptimizeResult, repairs, model, applied, validation, added=()) -> None:
    """``result`` describes another candidate instead (the never-slower ladder's, a measured choice's, a
    tuning record's): ``model`` as ``applied`` wrote it, stamped (with the run's ``repairs``), with its
    ``validation`` (None when validation is off) and the opt-in rules ``added`` among the rules run."""
    _stamp(model, applied, repairs)
    _set_output(result, model, applied)
    if validation is not None:
        result.validation = validation
    if added:
        chosen = set(result.rules) | set(added)
        result.rules = [name for name in rule_names() if name in chosen]


def _set_output(result: OptimizeResult, optimized, applied) -> None:
    """``result`` describes ``optimized``, written by the rewrite ``applied``."""
    result.model, result.applied, result.ops_after = optimized, applied, op_counts(optimized)
    result.body_ops_after = op_counts(optimized, in_bodies=True)
    result.custom_library = custom_library_needed(optimized)

    needs_cuda = cuda_only_ops(optimized)  # only when there are some: reports without them stay as they were
    if needs_cuda:
        result.extra["cuda_only_ops"] = needs_cuda
    else:
        result.extra.pop("cuda_only_ops", None)
    result.unfused = unfused_patterns(applied.refusals, {n.name or unnamed_label(n.op_type, n.output[0] if n.output else ""):
                                                         n.op_type for n in optimized.graph.node})


def _fewer_rewrites(start, rules, validator, options, notes, step, skipped, added=()):
    """``start`` rewritten without the ``skipped`` rules (:data:`~onnxfuse.selection.ALL`: none run) and
    with the opt-in rules ``added`` (in their place in the run order), validated as the first model was
    (``validator``: :class:`~onnxfuse.validate.verdict.Validator`, None when validation is off):
    (model, applied, validation or None), or why it cannot be kept."""
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
            report = validator.validate(candidate)
        except SessionRefused as exc:  # never kept, never written; the reason says whose fault it is
            return f"ONNX Runtime cannot load it, an onnxfuse bug ({refusal_reason(exc)})"
        report.notes.extend(notes)
        if not report.passed:
            return "validation failed"
    return candidate, applied, report








def time_both(original, optimized, inputs: Inputs, options: OptimizeOptions, progress=None, beside=None):
    """Time both models under ORT_ENABLE_ALL on ``options.bench_config``'s device (the GPU by default,
    ``status='no-gpu'`` where there is none; the CPU for ``--device cpu``, :func:`for_device`). With
    ``beside`` (a measured choice's incumbent), that model too, in the same interleaved run: (optimized's
    timing, beside's), both against the original (``timing.compare_beside``)."""
    # looked up when called: tests/test_device_cpu.py stands in for compare_models
    from onnxfuse.timing import compare_beside, compare_models

    config = options.bench_config if options.bench_config is not None else BenchConfig()
    if beside is not None:
        return compare_beside(original, optimized, beside, inputs, config, progress=progress)
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
