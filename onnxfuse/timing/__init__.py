"""GPU timing of ONNX models on ONNX Runtime: IOBinding, warm-up, percentiles, CUDA graphs, profiling.

The library never imports click or rich. (The package is ``timing``, not ``bench``: ``onnxfuse.bench``
is the API function, and importing a subpackage of that name would replace it.) Entry points:

* :func:`bench_models` — what ``onnxfuse bench`` does (``onnxfuse.bench()`` calls it) → :class:`BenchReport`;
* :func:`time_model` — one model, one configuration → :class:`BenchResult`;
* :func:`time_models` — several models interleaved under one configuration;
* :func:`compare_models` — original vs optimized → :class:`ComparisonResult` (the ``optimize`` hook);
* :func:`compare_beside` — a candidate and the incumbent each against the original, in one run (measured choices);
* :func:`profile` — per-op time and node/kernel counts from ONNX Runtime's profiler;
* :func:`gpu_unavailable_reason` — None, or the one line saying timing needs a CUDA GPU.
"""

from onnxfuse.timing.bench import BenchReport, bench_models
from onnxfuse.timing.compare import ComparisonResult, compare_beside, compare_models, time_models
from onnxfuse.timing.inputs import batch_shapes
from onnxfuse.timing.profile import ProfileResult, profile
from onnxfuse.timing.runner import (
    NO_GPU_MESSAGE,
    BenchConfig,
    BenchResult,
    NoGPU,
    OutputSpec,
    Timer,
    gpu_unavailable_reason,
    probe_output_specs,
    require_gpu,
    time_model,
)
from onnxfuse.timing.stats import LatencyStats, percentile, speedup, summarize
from onnxfuse.timing.trace import OpStat, TraceSummary, load_trace, summarize_trace

__all__ = [
    "NO_GPU_MESSAGE", "BenchConfig", "BenchReport", "BenchResult", "bench_models", "ComparisonResult", "LatencyStats", "NoGPU", "OpStat",
    "OutputSpec", "ProfileResult", "Timer", "TraceSummary", "batch_shapes", "compare_beside", "compare_models",
    "gpu_unavailable_reason", "load_trace", "percentile", "probe_output_specs", "profile", "require_gpu",
    "speedup", "summarize", "summarize_trace", "time_model", "time_models",
]
