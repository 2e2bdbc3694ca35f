"""Timing one model on ONNX Runtime: IOBinding on device memory, warm-up, repeated runs, CUDA graphs.

How a measurement is taken (``device="cuda"``):

1. a session with ONNX Runtime's graph optimizations at ``ORT_ENABLE_ALL`` (the fair baseline: the
   original model gets every fusion ONNX Runtime can do by itself), CUDA provider, our custom-op
   library registered when the model uses it (all through :func:`onnxfuse.runtime.session.make_session`);
2. inputs copied to the GPU once (``OrtValue.ortvalue_from_numpy(x, "cuda", 0)``) and bound; outputs
   bound to the GPU, so no host↔device copy is timed;
3. warm-up runs (cuDNN algorithm search, arena growth, CUDA-graph capture), then runs timed one by one
   with ``time.perf_counter_ns`` around ``run_with_iobinding`` + ``synchronize_outputs`` until the
   iteration count or the time budget is reached.

CUDA-graph mode (``enable_cuda_graph``) needs inputs and outputs at fixed addresses: outputs are
pre-allocated OrtValues of the shapes a plain run produced (``output_specs``) and bound once.

Without a usable GPU, :func:`require_gpu` raises :class:`NoGPU` (one line: ``timing needs a CUDA GPU``).
The CPU provider is used only when asked for (``device="cpu"``) and results say ``cpu``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx

from onnxfuse.timing.stats import LatencyStats, should_stop, summarize
from onnxfuse.errors import RuntimeFailure, UsageError, first_line
from onnxfuse.runtime.inputs import Inputs
from onnxfuse.runtime.session import cuda_available, make_session
from onnxfuse.ort_runtime import import_onnxruntime

#: The one line printed (or put in reports) where timing is impossible.
NO_GPU_MESSAGE = "timing needs a CUDA GPU (none is usable here)"

DEVICES = ("cuda", "cpu")

#: ``progress(message, fraction)``: fraction of the whole job done, 0..1.
Progress = Callable[[str, float], None]


class NoGPU(RuntimeFailure):
    """Timing on the GPU was asked for, but ONNX Runtime has no usable CUDA GPU here."""

    def __init__(self, message: str = NO_GPU_MESSAGE):
        super().__init__(message)


def gpu_unavailable_reason() -> str | None:
    """None when ONNX Runtime can time on a CUDA GPU here, else the one-line reason."""
    return None if cuda_available() else NO_GPU_MESSAGE


def require_gpu() -> None:
    if not cuda_available():
        raise NoGPU()


@dataclass
class BenchConfig:
    """How to time. ``iterations`` and ``time_budget_s`` both bound the timed runs (first reached wins)."""

    device: str = "cuda"
    warmup: int = 10
    iterations: int | None = None
    time_budget_s: float | None = 1.0
    min_iterations: int = 10
    cuda_graph: bool = False
    optimization: str = "all"
    device_id: int = 0
    provider_options: dict = field(default_factory=dict)
    #: Fresh ONNX Runtime sessions per model; the budget is split across them and their samples pooled.
    #: cuDNN picks convolution algorithms per session (by timing them once), so one session's latency
    #: can be off by 10-20% on depthwise-heavy fp16 models; several sessions average that out.
    sessions: int = 1

    def validate(self) -> None:
        if self.device not in DEVICES:
            raise UsageError(f"unknown device {self.device!r}; choose cuda or cpu")
        if self.cuda_graph and self.device != "cuda":
            raise UsageError("CUDA graphs need --device cuda")
        if self.warmup < 0:
            raise UsageError("--warmup must be >= 0")
        if self.iterations is not None and self.iterations < 1:
            raise UsageError("--iterations must be >= 1")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise UsageError("--time-budget must be > 0 seconds")
        if self.iterations is None and self.time_budget_s is None:
            raise UsageError("give an iteration count or a time budget")
        if self.sessions < 1:
            raise UsageError("--sessions must be >= 1")

    @property
    def effective_warmup(self) -> int:
        # ONNX Runtime makes a regular run before it captures the CUDA graph on the next one.
        return max(self.warmup, 3) if self.cuda_graph else self.warmup

    def to_dict(self) -> dict:
        return {
            "device": self.device, "warmup": self.effective_warmup, "iterations": self.iterations,
            "time_budget_s": self.time_budget_s, "min_iterations": self.min_iterations,
            "cuda_graph": self.cuda_graph, "optimization": self.optimization, "sessions": self.sessions,
        }


@dataclass
class OutputSpec:
    name: str
    shape: list[int]
    dtype: np.dtype


@dataclass
class BenchResult:
    """Latency of one model under one configuration."""

    name: str
    device: str
    cuda_graph: bool
    optimization: str
    stats: LatencyStats
    warmup: int
    shapes: dict[str, list[int]]
    nodes: int
    providers: list[str]
    samples_ms: list[float] = field(default_factory=list, repr=False)
    notes: list[str] = field(default_factory=list)
    output_specs: list[OutputSpec] = field(default_factory=list, repr=False)
    #: each fresh session's median where several were pooled (``BenchConfig.sessions``), in order: the
    #: spread between them is the noise a comparison made within one session cannot see
    session_medians_ms: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.device.upper()}{' + CUDA graph' if self.cuda_graph else ''}"

    def to_dict(self, samples: bool = False) -> dict:
        d = {
            "name": self.name, "device": self.device, "cuda_graph": self.cuda_graph,
            "optimization": self.optimization, "latency_ms": self.stats.to_dict(), "warmup": self.warmup,
            "shapes": self.shapes, "nodes": self.nodes, "providers": self.providers, "notes": list(self.notes),
        }
        if samples:
            d["samples_ms"] = [round(s, 6) for s in self.samples_ms]
        if self.session_medians_ms:
            d["session_medians_ms"] = [round(m, 6) for m in self.session_medians_ms]
        return d


_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def _np_type(ort_type: str) -> np.dtype:
    if ort_type not in _ORT_TYPES:
        raise RuntimeFailure(f"cannot pre-allocate an output of type {ort_type} for CUDA-graph timing")
    return np.dtype(_ORT_TYPES[ort_type])


CONTROL_FLOW = ("If", "Loop", "Scan")


def refuse_control_flow(model: onnx.ModelProto, name: str) -> None:
    """One clear line instead of ONNX Runtime's session error: CUDA graphs replay a fixed sequence of
    kernels, and ONNX Runtime refuses to capture a model with control flow (a branch chosen per run).
    KV-cache decoders optimized with ``contrib-decode-attention`` carry one ``If`` per layer (and their
    growing cache changes shapes every step, which a captured graph cannot follow either)."""
    flow = [n for n in model.graph.node if n.op_type in CONTROL_FLOW and n.domain in ("", "ai.onnx")]
    if flow:
        kinds = "/".join(sorted({n.op_type for n in flow}))
        raise RuntimeFailure(f"{name}: CUDA graphs cannot capture control flow, and the model has {len(flow)} "
                             f"{kinds} node(s) (the first: {flow[0].name or flow[0].op_type}); time it without "
                             "--cuda-graph")


class Timer:
    """A session with its inputs and outputs bound, ready to be run and timed again and again."""

    def __init__(self, model: onnx.ModelProto, inputs: Inputs, config: BenchConfig, name: str = "model",
                 output_specs: list[OutputSpec] | None = None, session_factory=None):
        ort = import_onnxruntime()
        config.validate()
        if config.cuda_graph:
            refuse_control_flow(model, name)
        if config.device == "cuda":
            require_gpu()
        self.name = name
        self.config = config
        self.inputs = inputs
        self.nodes = len(model.graph.node)
        self.samples_ms: list[float] = []
        self.runs = 0
        if config.cuda_graph and output_specs is None:
            output_specs = probe_output_specs(model, inputs, config, name)
        self.output_specs = output_specs or []
        options = dict(config.provider_options)
        if config.device == "cuda":
            options.setdefault("device_id", str(config.device_id))
            if config.cuda_graph:
                options["enable_cuda_graph"] = "1"
        factory = session_factory or make_session
        # TF32 stays as ONNX Runtime sets it by default (on): the baseline users actually get.
        self.session = factory(model, provider=config.device, optimization=config.optimization, name=name,
                               provider_options=options if config.device == "cuda" else None, tf32=True)
        self.providers = list(self.session.get_providers())
        if config.device == "cuda" and "CUDAExecutionProvider" not in self.providers:
            raise NoGPU()
        self.binding = self.session.io_binding()
        self._keep = []  # OrtValues that must outlive the binding
        if config.device == "cuda":
            for key, arr in inputs.feeds.items():
                value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), "cuda", config.device_id)
                self._keep.append(value)
                self.binding.bind_ortvalue_input(key, value)
            if config.cuda_graph:
                for spec in self.output_specs:
                    value = ort.OrtValue.ortvalue_from_shape_and_type(spec.shape, spec.dtype, "cuda",
                                                                      config.device_id)
                    self._keep.append(value)
                    self.binding.bind_ortvalue_output(spec.name, value)
            else:
                for out in self.session.get_outputs():
                    self.binding.bind_output(out.name, "cuda", config.device_id)
        else:
            for key, arr in inputs.feeds.items():
                self.binding.bind_cpu_input(key, np.ascontiguousarray(arr))
            for out in self.session.get_outputs():
                self.binding.bind_output(out.name)

    def run_once(self) -> float:
        """One run; returns its wall time in milliseconds (device work included)."""
        t0 = time.perf_counter_ns()
        try:
            self.session.run_with_iobinding(self.binding)
            if self.config.device == "cuda":
                self.binding.synchronize_outputs()
        except Exception as exc:
            raise RuntimeFailure(f"{self.name}: ONNX Runtime failed to run the model: {first_line(exc)}") from None
        self.runs += 1
        return (time.perf_counter_ns() - t0) / 1e6

    def warmup(self, count: int | None = None) -> None:
        for _ in range(self.config.effective_warmup if count is None else count):
            self.run_once()

    def sample(self, iterations: int | None, time_budget_s: float | None, min_iterations: int | None = None,
               tick: Callable[[int, float], None] | None = None) -> list[float]:
        """Timed runs until ``iterations`` or ``time_budget_s`` (see :func:`stats.should_stop`)."""
        floor = self.config.min_iterations if min_iterations is None else min_iterations
        got: list[float] = []
        start = time.perf_counter()
        while not should_stop(len(got), time.perf_counter() - start, iterations=iterations,
                              time_budget_s=time_budget_s, min_iterations=floor):
            got.append(self.run_once())
            if tick is not None and len(got) % 16 == 0:
                tick(len(got), time.perf_counter() - start)
        self.samples_ms.extend(got)
        return got

    def current_output_specs(self) -> list[OutputSpec]:
        """Shapes and types of the outputs of the last run (to pre-allocate them for CUDA graphs)."""
        if self.config.cuda_graph:
            return list(self.output_specs)
        names = [o.name for o in self.session.get_outputs()]
        return [OutputSpec(n, list(v.shape()), _np_type(v.data_type()))
                for n, v in zip(names, self.binding.get_outputs())]

    def outputs(self) -> dict[str, np.ndarray]:
        """Outputs of the last run, copied to the host."""
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.binding.copy_outputs_to_cpu()))

    def result(self) -> BenchResult:
        if not self.samples_ms:
            raise RuntimeFailure(f"{self.name}: no timed runs")
        return BenchResult(
            name=self.name, device=self.config.device, cuda_graph=self.config.cuda_graph,
            optimization=self.config.optimization, stats=summarize(self.samples_ms),
            warmup=self.config.effective_warmup, shapes=self.inputs.shapes(), nodes=self.nodes,
            providers=self.providers, samples_ms=list(self.samples_ms), notes=list(self.inputs.notes),
            output_specs=self._known_output_specs() if self.runs else [],
        )

    def _known_output_specs(self) -> list[OutputSpec]:
        """The specs a later CUDA-graph run can reuse, or [] where an output has a type it cannot
        pre-allocate (strings): only a run that asks for CUDA graphs probes, and refuses, such a model."""
        try:
            return self.current_output_specs()
        except RuntimeFailure:
            return []

    def close(self) -> None:
        self.binding = None
        self._keep.clear()
        self.session = None
        gc.collect()


def probe_output_specs(model: onnx.ModelProto, inputs: Inputs, config: BenchConfig,
                       name: str = "model") -> list[OutputSpec]:
    """Output shapes and types from one plain (no CUDA graph) run on the same device."""
    plain = BenchConfig(device=config.device, warmup=0, iterations=1, time_budget_s=None,
                        optimization=config.optimization, device_id=config.device_id,
                        provider_options=dict(config.provider_options))
    timer = Timer(model, inputs, plain, name=name)
    try:
        timer.run_once()
        return timer.current_output_specs()
    finally:
        timer.close()


def time_model(model: onnx.ModelProto, inputs: Inputs, config: BenchConfig | None = None, name: str = "model",
               progress: Progress | None = None, output_specs: list[OutputSpec] | None = None) -> BenchResult:
    """Time one model. Raises :class:`NoGPU` on ``device="cuda"`` without a usable GPU."""
    config = config or BenchConfig()
    step = progress or (lambda _m, _f: None)
    step(f"{name}: creating session", 0.0)
    timer = Timer(model, inputs, config, name=name, output_specs=output_specs)
    try:
        step(f"{name}: warm-up", 0.05)
        timer.warmup()

        def tick(count: int, elapsed: float) -> None:
            frac = _fraction(count, elapsed, config)
            step(f"{name}: {count} runs", 0.1 + 0.9 * frac)

        timer.sample(config.iterations, config.time_budget_s, tick=tick)
        step(f"{name}: done", 1.0)
        return timer.result()
    finally:
        timer.close()


def _fraction(count: int, elapsed: float, config: BenchConfig) -> float:
    parts = []
    if config.iterations:
        parts.append(count / config.iterations)
    if config.time_budget_s:
        parts.append(elapsed / config.time_budget_s)
    return min(1.0, max(parts) if parts else 0.0)
