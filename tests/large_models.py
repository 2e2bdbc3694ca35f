"""Helpers for the large-model and atomic-output tests: models built by benchmarks/large_model.py at small
sizes, thresholds lowered so that megabytes take the code paths gigabytes take, and a way to run the
real command line in a child process with those thresholds."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]

#: Run the onnxfuse command line with lowered thresholds: argv[1] = LAZY_MODEL_BYTES (0: unchanged),
#: argv[2] = model_io._EXTERNAL_THRESHOLD (0: unchanged). Tolerates an onnxfuse without lazy_weights.
WRAPPER = """
import sys
lazy, external = int(sys.argv.pop(1)), int(sys.argv.pop(1))
import onnxfuse.model_io as mio
try:
    import onnxfuse.lazy_weights as lw
    if lazy:
        lw.LAZY_MODEL_BYTES = lazy
except ImportError:
    pass
if external:
    mio._EXTERNAL_THRESHOLD = external
from onnxfuse.cli import main
sys.argv[0] = "onnxfuse"
main()
"""


def builder():
    spec = importlib.util.spec_from_file_location("onnxfuse_bench_large_model", ROOT / "benchmarks" / "large_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(path: Path, layers: int = 2, width: int = 640, seed: int = 0, inline: bool = False) -> int:
    """A ``layers`` × (MatMul ``width``² → BatchNormalization → Add → Relu) model at ``path``, weights in
    ``<path>.data`` unless ``inline``; returns the weights' bytes (640² float32 = 1.6 MB per layer, over
    the 1 MiB lazy-tensor limit)."""
    return builder().build(Path(path), layers=layers, width=width, seed=seed, inline=inline)


def run_cli(args, cwd=None, lazy: int = 0, external: int = 0, env=None, **kwargs) -> subprocess.CompletedProcess:
    """``onnxfuse ARGS`` in a child process (this tree first on ``PYTHONPATH``)."""
    return subprocess.run([sys.executable, "-c", WRAPPER, str(lazy), str(external), *map(str, args)], cwd=cwd,
                          env=child_env(env), capture_output=True, text=True, **kwargs)


def popen_cli(args, cwd=None, lazy: int = 0, external: int = 0, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRAPPER, str(lazy), str(external), *map(str, args)], cwd=cwd,
                            env=child_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_env(extra=None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("ONNXFUSE_IGNORE_ORT_CONFLICT", "1")
    env.update(extra or {})
    return env


def run_model(path, feeds: dict) -> list[np.ndarray]:
    """Outputs of the model file ``path`` on ONNX Runtime's CPU provider (external data from its folder)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def feeds(width: int = 640, seed: int = 1) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((1, width)).astype(np.float32)}


def weights_of(path) -> dict[str, np.ndarray]:
    """Every initializer of the model file ``path``, loaded with its external data by onnx itself."""
    model = onnx.load(str(path))
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def listing(folder) -> list[str]:
    """File names in ``folder`` (hidden temporary files included), sorted."""
    return sorted(os.listdir(folder))
