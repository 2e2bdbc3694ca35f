"""Creating ONNX Runtime sessions: provider choice, our custom-op library, quiet CUDA probing.

On a machine without a GPU, onnxruntime-gpu still *lists* the CUDA provider, and a session that asks
for it prints red errors about missing libraries before falling back to the CPU. So whether CUDA
really works is decided once, by creating a tiny session with ONNX Runtime's logging silenced and
reading ``session.get_providers()``; after that only working providers are requested.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import onnx

from onnxfuse import model_io
from onnxfuse.errors import OnnxfuseError, RuntimeFailure, SessionRefused, UsageError, first_line

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
#: ONNX Runtime log severity: 3 = errors only, 4 = fatal only.
_QUIET = 4
#: ONNX Runtime's default log severity (warnings). Its Python API can set the default logger's
#: severity but not read it, so the CUDA probe restores this value afterwards.
_ORT_DEFAULT_SEVERITY = 2


def _ort():
    # start-up: the command line starts (and --help runs) without onnxfuse.ort_runtime
    from onnxfuse.ort_runtime import import_onnxruntime

    return import_onnxruntime()


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """True when ONNX Runtime can really run on a CUDA GPU here (probed once, silently)."""
    ort = _ort()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    model.ir_version = 8
    try:
        ort.set_default_logger_severity(_QUIET)
        opts = ort.SessionOptions()
        opts.log_severity_level = _QUIET
        sess = ort.InferenceSession(
            model.SerializeToString(), opts, providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
        )
        return "CUDAExecutionProvider" in sess.get_providers()
    except Exception:
        return False
    finally:
        ort.set_default_logger_severity(_ORT_DEFAULT_SEVERITY)


def resolve_provider(provider: str) -> str:
    """Map ``auto``/``cpu``/``cuda`` to the provider that will actually run (``cuda`` or ``cpu``)."""
    provider = (provider or "auto").lower()
    if provider == "auto":
        return "cuda" if cuda_available() else "cpu"
    if provider not in PROVIDERS:
        raise UsageError(f"unknown provider {provider!r}; choose auto, cpu or cuda")
    if provider == "cuda" and not cuda_available():
        raise RuntimeFailure("the CUDA provider was requested but no usable CUDA GPU was found")
    return provider


def uses_custom_ops(model: onnx.ModelProto) -> bool:
    """True when the model imports our domain (FusedElementwise, FusedConcat and our other ops: it needs our library)."""
    # start-up: the command line starts (and --help runs) without onnxfuse.custom_ops
    from onnxfuse.custom_ops import DOMAIN

    return any(o.domain == DOMAIN for o in model.opset_import)


def make_session(
    model: onnx.ModelProto,
    provider: str = "auto",
    optimization: str = "disable",
    name: str = "model",
    provider_options: dict | None = None,
    tf32: bool = False,
    configure=None,
):
    """An ``InferenceSession`` for ``model`` on ``provider`` ('auto', 'cpu' or 'cuda').

    ``optimization`` is ONNX Runtime's graph optimization level: 'disable', 'basic', 'extended' or
    'all'. Validation uses 'disable' so what is compared is onnxfuse's rewrites, not ONNX Runtime's.
    TF32 math is off unless ``tf32`` (timing turns it on: ONNX Runtime's default, the fair baseline).
    On the CPU, an op only the CUDA provider has (``NhwcConv``) runs as its definition in standard ops
    (:mod:`onnxfuse.runtime.stand_ins`).
    Raises :class:`~onnxfuse.errors.SessionRefused` (a :class:`RuntimeFailure`) with one line when ONNX
    Runtime refuses the model.
    """
    ort = _ort()
    kind = resolve_provider(provider)
    if kind == "cpu":  # ops with a CUDA kernel only run as their standard-op definitions (stand_ins.py)
        # start-up: the command line starts (and --help runs) without onnxfuse.runtime.stand_ins
        from onnxfuse.runtime.stand_ins import for_cpu

        model = for_cpu(model)
    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    if uses_custom_ops(model):
        # start-up: the command line starts (and --help runs) without onnxfuse.custom_ops
        from onnxfuse.custom_ops import LibraryNotFoundError, session_options

        try:
            opts = session_options()
        except LibraryNotFoundError as exc:
            raise RuntimeFailure(f"{name}: {exc}") from None
    else:
        opts = ort.SessionOptions()
    opts.graph_optimization_level = levels[optimization]
    # Errors are reported by onnxfuse itself, in one line; ONNX Runtime's own log would repeat them.
    opts.log_severity_level = _QUIET
    if configure is not None:
        configure(opts)  # e.g. the profiler switches on enable_profiling
    providers: list = ["CPUExecutionProvider"]
    if kind == "cuda":
        cuda_options = dict(provider_options or {})
        if not tf32:
            # TF32 convolutions and matmuls (ONNX Runtime's default on Ampere and newer) err by ~1e-3
            # relative: comparing two models under it would measure TF32 noise, not the rewrites.
            cuda_options.setdefault("use_tf32", "0")
        providers = [("CUDAExecutionProvider", cuda_options), "CPUExecutionProvider"]
    try:
        if model_io.needs_external_data(model):
            # Over protobuf's 2 GB limit: hand ONNX Runtime a file with external data instead of bytes.
            # ONNX Runtime reads (or maps) the data while creating the session, so the folder can go.
            with tempfile.TemporaryDirectory(prefix="onnxfuse-session-") as tmp:
                path = Path(tmp) / "model.onnx"
                model_io.write_model(model, path)
                return ort.InferenceSession(str(path), opts, providers=providers)
        return ort.InferenceSession(model.SerializeToString(), opts, providers=providers)
    except OnnxfuseError:  # writing the external-data copy failed (a full $TMPDIR): its own error
        raise
    except Exception as exc:
        raise SessionRefused(f"{name}: ONNX Runtime cannot load the model: {first_line(exc)}") from None


def run_session(session, feeds: dict, name: str = "model", output_names: list[str] | None = None) -> dict:
    """Run and return ``{output name: array}``; errors become :class:`RuntimeFailure`."""
    names = output_names or [o.name for o in session.get_outputs()]
    try:
        values = session.run(names, feeds)
    except Exception as exc:
        raise RuntimeFailure(f"{name}: ONNX Runtime failed to run the model: {first_line(exc)}") from None
    return dict(zip(names, values))


def _feeds(sample) -> dict:
    """The feeds of ``sample``: an :class:`~onnxfuse.runtime.inputs.Inputs` or a plain ``{name: array}``."""
    return sample if isinstance(sample, dict) else sample.feeds


def run_model(model: onnx.ModelProto, inputs, provider: str = "auto", name: str = "model") -> dict:
    """Outputs of ``model`` on ``inputs`` (an ``Inputs`` or a feeds dict; graph optimizations off)."""
    return run_samples(model, [inputs], provider, name=name)[0]


def run_samples(model: onnx.ModelProto, samples: list, provider: str = "auto", name: str = "model",
                optimization: str = "disable", output_names: list[str] | None = None,
                keep_failures: bool = False) -> list:
    """Outputs of ``model`` on each of ``samples`` (``Inputs`` or feeds dicts), in one session.

    ``keep_failures``: a sample the model fails on gives the one-line error (a ``str``) in its place
    instead of raising :class:`RuntimeFailure` (session creation failing still raises).
    """
    session = make_session(model, provider=provider, optimization=optimization, name=name)
    out: list = []
    for s in samples:
        try:
            out.append(run_session(session, _feeds(s), name=name, output_names=output_names))
        except RuntimeFailure as e:
            if not keep_failures:
                raise
            out.append(str(e))
    return out
