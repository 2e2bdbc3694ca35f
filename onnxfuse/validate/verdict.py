"""The verdict on a candidate model: one :class:`Validator` per optimize run judges every candidate alike.

Why one object: optimize validates many candidates of the same run (its output, the never-slower
ladder's rungs, the measured choices, a tuning record's decision, the culprit search's prefixes), and each
must be judged exactly as the first: against the original's outputs on the same samples
(:mod:`onnxfuse.validate.reference`), the same noise floor (measured once, :func:`make_validator`), the
same precision judge (:mod:`onnxfuse.validate.precision_judge`) and the user's provider, tolerances and
strictness. A candidate ONNX Runtime cannot load is a problem too (:meth:`Validator.problem`,
:func:`load_problem`): onnxfuse wrote it, so it is no more a way out than drift.

``options`` is the run's :class:`onnxfuse.pipeline.OptimizeOptions`, read here (never imported:
validate/ sits below the pipeline, tests/test_layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import onnx

from onnxfuse.errors import SessionRefused
from onnxfuse.runtime.session import resolve_provider
from onnxfuse.validate.onnx_semantics import onnx_semantics_runs
from onnxfuse.validate.precision_judge import conversion_floor_drift, precision_judge, with_conversion
from onnxfuse.validate import PrecisionJudge, ValidationReport, largest_errors, noise_floor, validate_models


@dataclass
class Validator:
    """``validate_models`` as optimize judges every candidate: the user's provider, tolerances and strictness
    (``options``) against the one ``reference`` (the ``original``'s outputs on ``samples``) and ``floor``,
    and a precision change's ``judge`` (None at fp32). ``conversion``: each output's drift in the model
    merely converted that joined the floor (:func:`~onnxfuse.validate.precision_judge.conversion_floor_drift`;
    {} at fp32), for the report's notes."""

    original: onnx.ModelProto
    samples: list
    reference: list
    options: object
    floor: dict[str, float] | None = None
    judge: PrecisionJudge | None = None
    conversion: dict[str, float] = field(default_factory=dict)
    semantics_checked: bool = False  # the ONNX-semantics run joined the floor (or does not apply)

    def validate(self, candidate: onnx.ModelProto) -> ValidationReport:
        """The validation report of ``candidate``; raises :class:`SessionRefused` when it does not load.
        A candidate that fails, unless ``--strict``, is judged again once the floor also holds the original
        run as ONNX specifies it (:mod:`onnxfuse.validate.onnx_semantics`: a small float16 model on the
        CPU), measured on the first such failure and kept for every later candidate: it costs a numpy
        evaluation of the original, which most runs never need."""
        options = self.options
        report = self._judge(candidate)
        if not report.passed and not options.strict and not self.semantics_checked:
            self.semantics_checked = True
            runs = onnx_semantics_runs(self.original, self.samples, resolve_provider(options.provider))
            if runs is not None:
                extra = largest_errors(self.reference, [runs])
                self.floor = {k: max((self.floor or {}).get(k, 0.0), extra.get(k, 0.0))
                              for k in (self.floor or {}).keys() | extra.keys()}
                report = self._judge(candidate)
        return report

    def _judge(self, candidate: onnx.ModelProto) -> ValidationReport:
        options = self.options
        return validate_models(self.original, candidate, self.samples, options.provider, options.rtol, options.atol,
                               reference=self.reference, floor=self.floor, strict=options.strict, judge=self.judge)

    def problem(self, candidate: onnx.ModelProto) -> str | None:
        """What keeps ``candidate`` from loading in ONNX Runtime and passing validation (None when it passes):
        the culprit searches' test (:mod:`onnxfuse.validate.culprit`)."""
        try:
            report = self.validate(candidate)
        except SessionRefused as exc:
            return f"ONNX Runtime cannot load, an onnxfuse bug: please report it ({refusal_reason(exc)})"
        return None if report.passed else f"still fails validation (output(s) {', '.join(report.failing())})"


def make_validator(original, start, samples, reference, options, source: str, precision: str | None,
                   rounded: dict | None = None) -> Validator:
    """The run's :class:`Validator`: the original's noise floor on the samples (:func:`~onnxfuse.validate.noise_floor`),
    then, for a precision change (``precision``; ``start`` is the model merely converted), its judge and
    the conversion's drift raised into the floor."""
    floor = noise_floor(original, samples, reference, options.provider, name=source)
    judge = precision_judge(start, samples, reference, options, source, rounded) if precision else None
    drift = conversion_floor_drift(judge, options)
    return Validator(original, samples, reference, options, with_conversion(floor, drift), judge, drift)


def load_problem(options) -> Callable[[onnx.ModelProto], str | None]:
    """What keeps ONNX Runtime from creating a session for a candidate, on the provider validation uses
    (None when it loads)."""
    # looked up when called: tests/validate/test_two_sizes.py counts make_session's calls
    from onnxfuse.runtime.session import make_session

    def judge(candidate: onnx.ModelProto) -> str | None:
        try:
            make_session(candidate, options.provider, name="candidate model")
        except SessionRefused as exc:
            return f"ONNX Runtime cannot load either ({refusal_reason(exc)})"
        return None

    return judge


def refusal_reason(exc: SessionRefused) -> str:
    """ONNX Runtime's reason in a :class:`SessionRefused`, without the model's name in front."""
    text = str(exc)
    marker = "ONNX Runtime cannot load the model: "
    return text.split(marker, 1)[1] if marker in text else text
