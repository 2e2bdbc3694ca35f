"""Per-op time and counts from ONNX Runtime's profiler: which ops a run spends its time in, how many
nodes (and, when the trace has them, GPU kernels) a run launches.

Profiling runs without CUDA graphs (a replayed graph has no per-node records), after warm-up, and the
warm-up runs are left out of the averages.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from dataclasses import dataclass

import onnx

from onnxfuse.timing.runner import BenchConfig, Progress, Timer
from onnxfuse.timing.trace import TraceSummary, load_trace, summarize_trace
from onnxfuse.runtime.inputs import Inputs
from onnxfuse.runtime.session import make_session


@dataclass
class ProfileResult:
    name: str
    device: str
    summary: TraceSummary

    def to_dict(self, top: int = 10) -> dict:
        return {"name": self.name, "device": self.device, **self.summary.to_dict(top)}


def _profiling_session_factory(prefix: str):
    """:func:`onnxfuse.runtime.session.make_session` with ONNX Runtime's profiler switched on."""

    def configure(opts) -> None:
        opts.enable_profiling = True
        opts.profile_file_prefix = prefix

    return functools.partial(make_session, configure=configure)


def profile(model: onnx.ModelProto, inputs: Inputs, config: BenchConfig | None = None, name: str = "model",
            runs: int = 20, progress: Progress | None = None, keep_trace: str | None = None) -> ProfileResult:
    """Profile ``runs`` runs after warm-up; per-op time (host-side node time) and per-run counts.

    ``keep_trace``: a path to copy the raw trace to (for chrome://tracing or Perfetto).
    """
    base = config or BenchConfig()
    cfg = BenchConfig(device=base.device, warmup=max(1, base.warmup), iterations=runs, time_budget_s=None,
                      min_iterations=1, cuda_graph=False, optimization=base.optimization,
                      device_id=base.device_id, provider_options=dict(base.provider_options))
    step = progress or (lambda _m, _f: None)
    with tempfile.TemporaryDirectory(prefix="onnxfuse-profile-") as tmp:
        step(f"{name}: profiling", 0.0)
        timer = Timer(model, inputs, cfg, name=name, session_factory=_profiling_session_factory(os.path.join(tmp, "ort")))
        try:
            timer.warmup()
            timer.sample(runs, None, min_iterations=1)
            path = timer.session.end_profiling()
        finally:
            timer.close()
        events = load_trace(path)
        if keep_trace:
            shutil.copyfile(path, keep_trace)
    summary = summarize_trace(events, skip_runs=cfg.effective_warmup)
    step(f"{name}: profiled", 1.0)
    return ProfileResult(name=name, device=cfg.device, summary=summary)
