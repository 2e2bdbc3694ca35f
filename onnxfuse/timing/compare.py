"""Timing an original and an optimized model side by side: the hook ``onnxfuse optimize`` calls.

Both models get the same inputs, the same ONNX Runtime settings (``ORT_ENABLE_ALL``, IOBinding on the
GPU) and the same time budget, taken in alternating rounds (A, B, A, B, …) so that clock or thermal
drift during the measurement hits both alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import onnx

from onnxfuse.timing.profile import ProfileResult, profile
from onnxfuse.timing.runner import (
    NO_GPU_MESSAGE,
    BenchConfig,
    BenchResult,
    Progress,
    Timer,
    gpu_unavailable_reason,
)
from onnxfuse.timing.stats import speedup, summarize
from onnxfuse.errors import OnnxfuseError, first_line
from onnxfuse.runtime.inputs import Inputs, for_model


@dataclass
class ComparisonResult:
    """Latency of the original and the optimized model. ``status``: ok, no-gpu or failed."""

    status: str
    device: str
    cuda_graph: bool
    original: BenchResult | None = None
    optimized: BenchResult | None = None
    nodes_original: int = 0
    nodes_optimized: int = 0
    profile_original: ProfileResult | None = None
    profile_optimized: ProfileResult | None = None
    message: str | None = None
    notes: list[str] = field(default_factory=list)
    # The input shapes timed ({input: dims}, None where not recorded), and the same two models timed at
    # the other sizes the user asked to tune at (``--tune-shape``): each a ComparisonResult with its
    # ``shapes`` (onnxfuse.selection judges a candidate at every size).
    shapes: dict | None = None
    other_sizes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def speedup(self) -> float | None:
        """Original median / optimized median (>1: the optimized model is faster)."""
        if not (self.original and self.optimized):
            return None
        return speedup(self.original.stats.median_ms, self.optimized.stats.median_ms)

    @property
    def kernels_original(self) -> float | None:
        return self.profile_original.summary.kernels_per_run if self.profile_original else None

    @property
    def kernels_optimized(self) -> float | None:
        return self.profile_optimized.summary.kernels_per_run if self.profile_optimized else None

    def to_dict(self) -> dict:
        sp = self.speedup
        return {
            "status": self.status,
            "message": self.message,
            "device": self.device,
            "cuda_graph": self.cuda_graph,
            "speedup": None if sp is None else round(sp, 4),
            "nodes": {"original": self.nodes_original, "optimized": self.nodes_optimized},
            "kernels_per_run": {"original": self.kernels_original, "optimized": self.kernels_optimized},
            "original": self.original.to_dict() if self.original else None,
            "optimized": self.optimized.to_dict() if self.optimized else None,
            "profile": {
                "original": self.profile_original.to_dict() if self.profile_original else None,
                "optimized": self.profile_optimized.to_dict() if self.profile_optimized else None,
            } if (self.profile_original or self.profile_optimized) else None,
            "notes": list(self.notes),
            "shapes": self.shapes,
            "other_sizes": [o.size_dict() for o in self.other_sizes],
        }

    def size_dict(self) -> dict:
        """The figures of one size, as ``other_sizes`` lists them."""
        def ms(r, stat):
            return round(getattr(r.stats, stat), 6) if r is not None else None

        sp = self.speedup
        return {"shapes": self.shapes, "status": self.status, "message": self.message,
                "speedup": None if sp is None else round(sp, 4),
                "original_median_ms": ms(self.original, "median_ms"), "optimized_median_ms": ms(self.optimized, "median_ms"),
                "original_min_ms": ms(self.original, "min_ms"), "optimized_min_ms": ms(self.optimized, "min_ms")}


def time_models(models: list[tuple], config: BenchConfig, rounds: int = 3,
                progress: Progress | None = None) -> list[BenchResult]:
    """Time several models under one configuration, interleaved in ``rounds`` rounds.

    ``models``: ``(name, model, inputs)`` tuples, optionally with a fourth item, the model's output
    specs from an earlier plain run (saves a probing run in CUDA-graph mode; see ``BenchResult.output_specs``).
    The budget (``time_budget_s`` and ``iterations``) is per model, split across the rounds.
    With ``config.sessions`` > 1 the whole measurement is repeated in that many fresh sessions (the
    budget split between them) and each model's samples are pooled; the result notes each session's
    median.
    Raises :class:`~onnxfuse.timing.runner.NoGPU` / :class:`~onnxfuse.errors.RuntimeFailure`.
    """
    config.validate()
    step = progress or (lambda _m, _f: None)
    k = config.sessions
    if k == 1:
        return _time_session(models, config, rounds, step)
    share = replace(config, sessions=1,
                    time_budget_s=None if config.time_budget_s is None else config.time_budget_s / k,
                    iterations=None if config.iterations is None else max(1, -(-config.iterations // k)),
                    min_iterations=max(1, -(-config.min_iterations // k)))
    runs: list[list[BenchResult]] = []
    for s in range(k):
        runs.append(_time_session(models, share, rounds,
                                  lambda m, f, s=s: step(f"session {s + 1}/{k}: {m}", (s + f) / k)))
        # Later sessions reuse the output specs the first one probed.
        models = [(name, model, inputs, r.output_specs) for (name, model, inputs, *_), r in zip(models, runs[-1])]
    return [pool_sessions([run[i] for run in runs]) for i in range(len(models))]


def pool_sessions(results: list[BenchResult]) -> BenchResult:
    """One result from the same model timed in several sessions: samples pooled, per-session medians noted."""
    first = results[0]
    samples = [x for r in results for x in r.samples_ms]
    medians = ", ".join(f"{r.stats.median_ms:.3f}" for r in results)
    notes = list(first.notes) + [f"{len(results)} sessions pooled; per-session medians (ms): {medians}"]
    return replace(first, stats=summarize(samples), samples_ms=samples, notes=notes,
                   session_medians_ms=[r.stats.median_ms for r in results])


def _time_session(models: list[tuple], config: BenchConfig, rounds: int, step: Progress) -> list[BenchResult]:
    """One session per model, created, warmed up and sampled in interleaved rounds."""
    rounds = max(1, rounds)
    n = len(models)
    timers: list[Timer] = []
    try:
        for i, (name, model, inputs, *specs) in enumerate(models):
            step(f"{name}: creating session", 0.1 * i / n)
            timers.append(Timer(model, inputs, config, name=name, output_specs=specs[0] if specs else None))
        for i, timer in enumerate(timers):
            step(f"{timer.name}: warm-up", 0.1 + 0.1 * i / n)
            timer.warmup()
        per_round_iters = None if config.iterations is None else max(1, -(-config.iterations // rounds))
        per_round_budget = None if config.time_budget_s is None else config.time_budget_s / rounds
        floor = max(1, -(-config.min_iterations // rounds))
        for r in range(rounds):
            for i, timer in enumerate(timers):
                remaining = None if config.iterations is None else config.iterations - len(timer.samples_ms)
                if remaining is not None and remaining <= 0:
                    continue
                iters = per_round_iters if remaining is None else min(per_round_iters, remaining)
                timer.sample(iters, per_round_budget, min_iterations=floor)
                step(f"{timer.name}: round {r + 1}/{rounds}", 0.2 + 0.8 * (r * n + i + 1) / (rounds * n))
        return [t.result() for t in timers]
    finally:
        for t in timers:
            t.close()


def compare_models(
    original: onnx.ModelProto,
    optimized: onnx.ModelProto,
    inputs: Inputs,
    config: BenchConfig | None = None,
    *,
    profile_ops: bool = False,
    profile_runs: int = 20,
    rounds: int = 3,
    progress: Progress | None = None,
) -> ComparisonResult:
    """Time ``original`` and ``optimized`` on the same ``inputs``; never raises for a missing GPU.

    Returns ``status="no-gpu"`` with :data:`NO_GPU_MESSAGE` where ``config.device`` is ``cuda`` and no GPU
    is usable (the caller prints the message and carries on), ``status="failed"`` with a one-line message
    when ONNX Runtime cannot load or run a model. ``progress(message, fraction)`` is called along the way.
    """
    config = config or BenchConfig()
    config.validate()
    step = _monotonic(progress)
    result = _new_result(original, optimized, config)
    timing_share = 0.7 if profile_ops else 1.0

    def timing_step(message: str, fraction: float) -> None:
        step(message, fraction * timing_share)

    def measure() -> None:
        fitted = for_model(optimized, inputs)  # float16 inputs where the optimized model takes them (--float16-io)
        result.original, result.optimized = time_models(
            [("original", original, inputs), ("optimized", optimized, fitted)], config, rounds=rounds,
            progress=timing_step,
        )
        if profile_ops:
            result.profile_original = profile(original, inputs, config, name="original", runs=profile_runs,
                                              progress=lambda m, f: step(m, 0.7 + 0.15 * f))
            result.profile_optimized = profile(optimized, fitted, config, name="optimized", runs=profile_runs,
                                               progress=lambda m, f: step(m, 0.85 + 0.15 * f))
            result.notes.extend(result.profile_original.summary.notes[:1])

    _measured(measure, config, [result])
    step("timing done", 1.0)
    return result


def compare_beside(
    original: onnx.ModelProto,
    candidate: onnx.ModelProto,
    incumbent: onnx.ModelProto,
    inputs: Inputs,
    config: BenchConfig | None = None,
    *,
    rounds: int = 3,
    sessions: int = 2,
    progress: Progress | None = None,
) -> tuple[ComparisonResult, ComparisonResult]:
    """``candidate`` and ``incumbent`` each against ``original``, all three timed in one interleaved run
    (original, incumbent, candidate, in ``rounds`` rounds): the two results share the original's samples.
    The run is repeated in at least ``sessions`` fresh sessions of each model (``config.sessions`` if more;
    the time budget split between them), samples pooled and each session's median kept
    (``BenchResult.session_medians_ms``), so a decision can ask that the candidate win in every session.

    Why one run: a measured choice is kept when the candidate's speed-up beats the incumbent's. Taken in two
    runs, each ratio carries its own run's spread of the original (a fresh session each time: cuDNN picks
    its algorithms per session) and of the GPU's clocks, and the gain compares two such ratios. On an H200
    the YOLO-style detector's output measured 1.31x the original at the validation shape in one run and
    1.73x in another, minutes apart, which flipped the channels-last choice (docs/benchmarks.md 5.57). In
    one run the original's figure is the same for both, so the gain is the incumbent's time over the
    candidate's, taken side by side. Two sessions at least, because a session's own level moves by more
    than a choice's gain: BERT-base's optimized half() export timed 0.823 and 1.100 ms (medians) in two
    sessions of one ``onnxfuse bench`` run at batch 1 (docs/benchmarks.md 5.57; cuDNN's per-session
    algorithm choice does the same to conv nets, ``BenchConfig.sessions``). Never raises for a missing
    GPU (both results carry the status)."""
    config = config or BenchConfig()
    config.validate()
    config = replace(config, sessions=max(config.sessions, sessions))
    step = _monotonic(progress)
    ours, theirs = _new_result(original, candidate, config), _new_result(original, incumbent, config)

    def measure() -> None:
        timed = time_models([("original", original, inputs), ("incumbent", incumbent, for_model(incumbent, inputs)),
                             ("candidate", candidate, for_model(candidate, inputs))], config, rounds=rounds,
                            progress=step)
        ours.original = theirs.original = timed[0]
        theirs.optimized, ours.optimized = timed[1], timed[2]

    _measured(measure, config, [ours, theirs])
    step("timing done", 1.0)
    return ours, theirs


def _new_result(original: onnx.ModelProto, optimized: onnx.ModelProto, config: BenchConfig) -> ComparisonResult:
    return ComparisonResult(status="ok", device=config.device, cuda_graph=config.cuda_graph,
                            nodes_original=len(original.graph.node), nodes_optimized=len(optimized.graph.node))


def _measured(measure, config: BenchConfig, results: list[ComparisonResult]) -> None:
    """Run ``measure()``; a missing GPU, or a model ONNX Runtime cannot load or run, becomes every result's
    status and one-line message, never an exception."""
    status = message = None
    if config.device == "cuda" and gpu_unavailable_reason():
        status, message = "no-gpu", NO_GPU_MESSAGE
    else:
        try:
            measure()
        except OnnxfuseError as exc:
            status, message = "failed", str(exc)
        except Exception as exc:  # e.g. the custom-op library is missing: still a status, never a crash
            status, message = "failed", f"{type(exc).__name__}: {first_line(exc)}"
    if status is not None:
        for result in results:
            result.status, result.message = status, message


def _monotonic(progress: Progress | None) -> Progress:
    """``progress`` with fractions clamped to 0..1 and never going backwards."""
    if progress is None:
        return lambda _m, _f: None
    last = [0.0]

    def step(message: str, fraction: float) -> None:
        last[0] = max(last[0], min(1.0, max(0.0, fraction)))
        progress(message, last[0])

    return step
