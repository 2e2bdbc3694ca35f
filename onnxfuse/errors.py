"""Errors onnxfuse raises on purpose, each carrying the process exit code the CLI maps it to.

Exit codes are a contract with CI pipelines (documented in the README and in ``--help``):

* 0 — success
* 1 — user or model error (bad file, bad model, unwritable output, runtime failure)
* 2 — usage error (bad command line)
* 3 — validation failed (the optimized model's outputs drifted beyond tolerance)
* 4 — the optimized model is slower than ``--fail-on-slowdown`` allows (measured on the device: the GPU,
  or the CPU with ``--device cpu``)
* 5 — internal error: onnxfuse wrote a model ONNX Runtime cannot load, or failed unexpectedly (a bug to
  report, never the user's or the model's fault; see :class:`InternalError`)
* 130, 143 — interrupted by SIGINT or SIGTERM (128 + the signal's number; see :class:`Interrupted`)

With several models (``optimize a.onnx b.onnx --out-dir DIR``) the exit code is the worst of theirs,
by :data:`SEVERITY` (:func:`worst_exit_code`): 2 > 5 > 3 > 4 > 1 > 0.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USER_ERROR = 1
EXIT_USAGE = 2
EXIT_VALIDATION_FAILED = 3
EXIT_SLOWER = 4
EXIT_INTERNAL = 5

#: Exit codes from least to most severe, for a run over several models (:func:`worst_exit_code`).
#: Why this order: a usage error (2) means the command line itself is wrong for some model (an unknown
#: rule, a --shape naming an input it lacks), so nothing the run says about any model can be trusted
#: until it is fixed. Among the models' own outcomes, a verdict outranks a failure to reach one: a
#: validation failure (3: an optimized model would give wrong answers) is what a CI gate exists to
#: catch, then a latency gate (4: correct but slower than allowed), and only then an input that could
#: not be processed at all (1: a bad file, a model ONNX Runtime cannot run), which the per-model lines
#: name anyway. So a drift is never reported as "a file was unreadable" because another model was. An
#: internal error (5: onnxfuse itself failed, or wrote a model ONNX Runtime cannot load) ranks above every
#: verdict, since the tool that gave them is at fault, and below a wrong command line.
SEVERITY = (EXIT_OK, EXIT_USER_ERROR, EXIT_SLOWER, EXIT_VALIDATION_FAILED, EXIT_INTERNAL, EXIT_USAGE)


def worst_exit_code(codes) -> int:
    """The most severe of ``codes`` by :data:`SEVERITY` (0 for none); a code outside it (an interrupt,
    130/143) ranks above all, since the run did not finish."""
    rank = {code: k for k, code in enumerate(SEVERITY)}
    return max(codes, key=lambda c: rank.get(c, len(SEVERITY)), default=EXIT_OK)


def first_line(exc: BaseException) -> str:
    """An exception's first line, whitespace collapsed: ONNX Runtime's and protobuf's messages run over
    many lines, and every onnxfuse error is one line."""
    text = str(exc).strip()
    return " ".join(text.splitlines()[0].split()) if text else type(exc).__name__


class OnnxfuseError(Exception):
    """Base class: a one-line, user-facing message and an exit code. Never shown with a traceback."""

    exit_code = EXIT_USER_ERROR


class ModelLoadError(OnnxfuseError):
    """The input model could not be read or is not a valid ONNX model."""


class ModelSaveError(OnnxfuseError):
    """The output model could not be written (nothing is left behind when this is raised)."""


class ResourceError(OnnxfuseError):
    """The model does not fit: in memory, on disk (a full output folder or ``$TMPDIR``), or in protobuf's
    2 GiB message limit. Exit code 1, like every user or model error; the message names what ran out."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) received by the command line; it exits with ``128 + signum`` (143, 130)
    after deleting its temporary files. A subclass of ``KeyboardInterrupt`` so that code cleaning up
    after Ctrl-C cleans up after SIGTERM too."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class RuntimeFailure(OnnxfuseError):
    """ONNX Runtime could not create a session or run the model."""


class SessionRefused(RuntimeFailure):
    """ONNX Runtime refused to create a session for the model (its type check, an op it has no kernel
    for): exit 1 for a model the user gave, but the pipeline turns it into :class:`InternalError` for a
    model onnxfuse wrote, which is why it is told apart from a failed run or a missing library."""


class InternalError(OnnxfuseError):
    """onnxfuse's own fault, never the user's or the model's: a model it wrote (the optimized model, or
    the ``--precision fp16`` conversion) that ONNX Runtime cannot load, or an unexpected exception in the
    command line. Its own exit code (5), so that CI tells a bug to report from a model to fix (exit 1);
    the message names the rules applied where they are known and asks for a report. ``rules``: the rules
    (or ``precision-fp16`` / ``precision-bf16``, the conversion) the failure is traced to, in run order."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, rules: list[str] | None = None):
        super().__init__(message)
        self.rules = list(rules or [])


class InputsError(OnnxfuseError):
    """User-supplied inputs (``--inputs``, ``--shape``) do not fit the model."""


class PrecisionError(OnnxfuseError):
    """``--precision fp16``: the model cannot be converted (external-data weights, nothing in float32, a
    converted form ONNX type inference rejects); see :mod:`onnxfuse.precision`."""


class UsageError(OnnxfuseError):
    """The command line is inconsistent (unknown rule name, bad --shape syntax, ...)."""

    exit_code = EXIT_USAGE


class ValidationFailed(OnnxfuseError):
    """The optimized model does not reproduce the original's outputs within tolerance."""

    exit_code = EXIT_VALIDATION_FAILED

    def __init__(self, message: str, culprit: str | None = None, report=None, skip: list[str] | None = None):
        super().__init__(message)
        self.culprit = culprit
        self.report = report
        #: The rules the message suggests skipping: checked to give a model that loads and validates
        #: (``[culprit]`` when skipping it alone does); None when no rerun is suggested.
        self.skip = skip


class OnnxRuntimeUnavailable(OnnxfuseError):
    """ONNX Runtime cannot be used: not installed (``reason == "missing"``) or a broken installation
    (``reason == "broken"``). The message is one line saying what to install (see :mod:`onnxfuse.ort_runtime`)."""

    def __init__(self, message: str, reason: str = "missing"):
        super().__init__(message)
        self.reason = reason


class OnnxRuntimeConflictWarning(UserWarning):
    """Both ``onnxruntime`` and ``onnxruntime-gpu`` are installed: they overwrite each other's files."""


class SlowerThanAllowed(OnnxfuseError):
    """``--fail-on-slowdown RATIO``: the optimized model's median latency exceeds RATIO × the original's."""

    exit_code = EXIT_SLOWER

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class ModelsFailed(OnnxfuseError):
    """``optimize`` over several models: at least one did not succeed. ``exit_code`` is the worst of
    theirs (:func:`worst_exit_code`); ``report`` is the :class:`onnxfuse.batch.BatchResult` (every model's
    outcome; the others' outputs were written)."""

    def __init__(self, message: str, exit_code: int, report=None):
        super().__init__(message)
        self.exit_code = exit_code
        self.report = report
