"""What a timing was taken on (versions, GPU), for reports: numbers from different machines differ."""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess

from onnxfuse import __version__
from onnxfuse.errors import OnnxfuseError
from onnxfuse.ort_runtime import import_onnxruntime


def gpu_names() -> list[str]:
    """Names of the NVIDIA GPUs (``nvidia-smi``), or [] where there is none or it cannot be asked.
    Asked once per process: every report's ``environment`` names them, and the GPUs do not change."""
    return list(_gpu_names())


@functools.lru_cache(maxsize=1)
def _gpu_names() -> tuple[str, ...]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return ()
    try:
        out = subprocess.run([exe, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(line.strip() for line in out.stdout.splitlines() if line.strip())


def environment(device: str | None = None) -> dict:
    """Versions and devices of this process, for every report (``onnxruntime`` is None where ONNX
    Runtime cannot be imported: a failure report must still say what it ran on)."""
    # start-up: it loads numpy, onnx, which importing this module does not
    import onnx

    try:
        ort_version = import_onnxruntime().__version__
    except OnnxfuseError:
        ort_version = None
    return {
        "onnxfuse": __version__,
        "onnxruntime": ort_version,
        "onnx": onnx.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "device": device,
        "gpus": gpu_names() if device != "cpu" else [],
        "cpu": platform.processor() or platform.machine(),
    }
