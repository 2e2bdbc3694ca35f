"""onnxfuse: make ONNX models faster on NVIDIA GPUs under ONNX Runtime, without changing their answers.

Python API (the command line calls the same functions)::

    import onnxfuse

    result = onnxfuse.optimize("model.onnx", "model.opt.onnx", inputs={"x": x})  # raises ValidationFailed on drift
    result.model, result.validation, result.to_json()
    batch = onnxfuse.optimize_many(["a.onnx", "exports/"], "optimized")         # batch.runs, batch.exit_code
    report = onnxfuse.diff("model.onnx", "model.opt.onnx", samples=4)          # drift is reported: report.passed
    timing = onnxfuse.bench("model.onnx", "model.opt.onnx", batch=8)           # timing.speedup, timing.to_json()

``import onnxfuse`` is light: ONNX Runtime, onnx and the rewrites load when first used. Errors are the
classes of :mod:`onnxfuse.errors`, re-exported here; the result types load on first access.
"""

import importlib

__version__ = "0.1.0"

from onnxfuse.api import bench, diff, optimize, optimize_many  # noqa: E402  (after __version__, which modules import from here)
from onnxfuse.errors import (  # noqa: E402
    InputsError,
    InternalError,
    ModelLoadError,
    ModelSaveError,
    ModelsFailed,
    OnnxfuseError,
    OnnxRuntimeConflictWarning,
    OnnxRuntimeUnavailable,
    PrecisionError,
    RuntimeFailure,
    SlowerThanAllowed,
    UsageError,
    ValidationFailed,
)

#: Result types, imported on first access (they pull in onnx, numpy and the rewrites).
_LAZY = {
    "OptimizeResult": "onnxfuse.pipeline",
    "BatchResult": "onnxfuse.batch",
    "DiffReport": "onnxfuse.drift",
    "ValidationReport": "onnxfuse.validate",
    "Comparison": "onnxfuse.runtime.compare",
    "BenchReport": "onnxfuse.timing.bench",
    "BenchConfig": "onnxfuse.timing.runner",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onnxfuse' has no attribute {name!r}")

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BatchResult", "ModelsFailed", "optimize_many",
    "BenchConfig", "BenchReport", "Comparison", "DiffReport", "InputsError", "InternalError", "ModelLoadError", "ModelSaveError", "OnnxRuntimeConflictWarning", "PrecisionError",
    "OnnxRuntimeUnavailable", "OnnxfuseError", "OptimizeResult", "RuntimeFailure", "SlowerThanAllowed",
    "UsageError", "ValidationFailed", "ValidationReport", "bench", "diff", "optimize", "__version__",
]
