"""Which ONNX Runtime is installed, and the one helper through which onnxfuse imports it.

ONNX Runtime is the user's choice: ``pip install "onnxfuse[gpu]"`` brings ``onnxruntime-gpu`` (NVIDIA
GPUs: the CUDA provider, and the CPU one), ``pip install "onnxfuse[cpu]"`` brings ``onnxruntime`` (CPU
only). Both distributions install the same Python package, ``onnxruntime``, which gives three ways for
an installation to go wrong, each reported in one line with its fix:

* **missing** — nothing importable as ``onnxruntime``: :class:`~onnxfuse.errors.OnnxRuntimeUnavailable`
  (``reason="missing"``) saying which extra to install;
* **broken** — ``import onnxruntime`` fails, or finds a package without ``InferenceSession`` (what is
  left when both distributions were installed and one was uninstalled: uninstalling removes the files
  they share): :class:`~onnxfuse.errors.OnnxRuntimeUnavailable` (``reason="broken"``) with the
  ``pip install --force-reinstall`` to run;
* **conflict** — both ``onnxruntime`` and ``onnxruntime-gpu`` are installed (by ``importlib.metadata``):
  the package holds whichever was installed last, often the CPU one. This is a *warning*, not an error
  (the runtime may still work): :func:`conflict_warning` returns it; the CLI prints it on stderr (not
  with ``--quiet``), :func:`require_runtime` issues it once as an :class:`~onnxfuse.errors.OnnxRuntimeConflictWarning`.
  ``ONNXFUSE_IGNORE_ORT_CONFLICT=1`` silences it (for environments where another package insists on
  the CPU distribution).

Every module of onnxfuse that needs ONNX Runtime imports it through :func:`import_onnxruntime`, so the
error is the same wherever it is first needed. This module itself imports nothing heavy.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import warnings

from onnxfuse.errors import OnnxRuntimeConflictWarning, OnnxRuntimeUnavailable, first_line

#: The distributions that install the ``onnxruntime`` package, in the order the messages name them.
GPU_DISTRIBUTION = "onnxruntime-gpu"
CPU_DISTRIBUTION = "onnxruntime"
DISTRIBUTIONS = (CPU_DISTRIBUTION, GPU_DISTRIBUTION)
#: Environment variable: set to 1 to silence the warning about both distributions being installed.
IGNORE_CONFLICT_ENV = "ONNXFUSE_IGNORE_ORT_CONFLICT"

MISSING_MESSAGE = (
    'ONNX Runtime is not installed: pip install "onnxfuse[gpu]" for NVIDIA GPUs (onnxruntime-gpu) '
    'or pip install "onnxfuse[cpu]" for the CPU only (onnxruntime)'
)

_warned = False  # the conflict warning was reported in this process (CLI line or Python warning)


def installed_distributions() -> dict[str, str]:
    """``{distribution: version}`` for the ONNX Runtime distributions installed (by their metadata)."""
    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # unreadable metadata: as good as absent for this check
            continue
    return found


def _reinstall_fix(installed: dict[str, str]) -> str:
    if len(installed) == 1:
        return f"pip install --force-reinstall {next(iter(installed))}"
    if len(installed) > 1:
        return (f"pip uninstall -y {CPU_DISTRIBUTION} {GPU_DISTRIBUTION}, then pip install {GPU_DISTRIBUTION} "
                f"(NVIDIA GPU) or {CPU_DISTRIBUTION} (CPU)")
    return f"pip install --force-reinstall {GPU_DISTRIBUTION} (NVIDIA GPU) or {CPU_DISTRIBUTION} (CPU)"


def _broken(what: str) -> OnnxRuntimeUnavailable:
    installed = installed_distributions()
    return OnnxRuntimeUnavailable(f"ONNX Runtime is broken: {what}; fix: {_reinstall_fix(installed)}",
                                  reason="broken")


def import_onnxruntime():
    """The ``onnxruntime`` module; :class:`OnnxRuntimeUnavailable` (one line, with the fix) when it is
    missing or broken."""
    try:
        ort = importlib.import_module("onnxruntime")
    except ModuleNotFoundError as exc:
        if exc.name != "onnxruntime":  # a module onnxruntime itself needs is missing
            raise _broken(f"`import onnxruntime` fails ({first_line(exc)})") from None
        if installed_distributions():  # metadata says installed, yet nothing to import
            raise _broken("the onnxruntime package is registered as installed but cannot be imported") from None
        raise OnnxRuntimeUnavailable(MISSING_MESSAGE, reason="missing") from None
    except Exception as exc:  # ImportError of its native module, OSError of a shared library, ...
        raise _broken(f"`import onnxruntime` fails ({first_line(exc)})") from None
    if not hasattr(ort, "InferenceSession"):
        raise _broken("`import onnxruntime` finds a package without InferenceSession (left behind when "
                      f"{CPU_DISTRIBUTION} and {GPU_DISTRIBUTION} were both installed and one was uninstalled)")
    return ort


def conflict_warning() -> str | None:
    """One line when both ONNX Runtime distributions are installed (unless silenced), else None."""
    if os.environ.get(IGNORE_CONFLICT_ENV, "").strip() not in ("", "0"):
        return None
    installed = installed_distributions()
    if len(installed) < 2:
        return None
    both = " and ".join(f"{name} {version}" for name, version in installed.items())
    return (f"{both} are both installed and overwrite each other's files (the onnxruntime package is "
            f"whichever was installed last); fix: {_reinstall_fix(installed)} "
            f"(or set {IGNORE_CONFLICT_ENV}=1 to silence this)")


#: ONNX Runtime's default-logger severity for the command line without ``--verbose``: fatal only (4).
COMMAND_LINE_LOG_SEVERITY = 4


def check_runtime(runtime_log: bool = False) -> str | None:
    """For the command line: import ONNX Runtime (raises :class:`OnnxRuntimeUnavailable`) and return the
    conflict warning to print, if any. The warning counts as reported (:func:`require_runtime` will not
    repeat it).

    Unless ``runtime_log`` (``--verbose``), ONNX Runtime's own default log is silenced for the process: the
    command line reports ONNX Runtime's failures itself, in one line, and its sessions already log nothing
    (``runtime.session``), but kernels log through the default logger. Why: the float16 optimize of
    MobileNetV3-L (its channels-last trial's NhwcConv sessions, most likely) printed 312 red "cudnn_frontend
    ... No execution plans support the graph" lines (cuDNN trying its engines, harmless) over the run's
    report (the zoo's log, H200, 5.42).
    The Python API leaves the process's log settings alone."""
    global _warned
    ort = import_onnxruntime()
    if not runtime_log:
        ort.set_default_logger_severity(COMMAND_LINE_LOG_SEVERITY)
    message = conflict_warning()
    if message:
        _warned = True
    return message


def require_runtime():
    """For the Python API: the ``onnxruntime`` module (raises :class:`OnnxRuntimeUnavailable`); the
    conflict warning is issued once per process as an :class:`OnnxRuntimeConflictWarning`."""
    global _warned
    ort = import_onnxruntime()
    if not _warned:
        message = conflict_warning()
        if message:
            _warned = True
            warnings.warn(message, OnnxRuntimeConflictWarning, stacklevel=3)
    return ort


__all__ = [
    "CPU_DISTRIBUTION", "DISTRIBUTIONS", "GPU_DISTRIBUTION", "IGNORE_CONFLICT_ENV", "MISSING_MESSAGE",
    "check_runtime", "conflict_warning", "import_onnxruntime", "installed_distributions", "require_runtime",
]
