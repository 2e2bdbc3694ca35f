"""``onnxfuse bench`` as a library function: time one model, or two side by side, and report.

:func:`bench_models` does what the command does (the CLI parses options, calls it through
:func:`onnxfuse.bench` and renders the :class:`BenchReport`): load the models, draw one set of inputs per
input signature (two models with the same signature share it), time them interleaved under one
:class:`~onnxfuse.timing.runner.BenchConfig`, optionally profile each. Like ``diff``, it returns its
result; problems (bad arguments, no GPU for ``device="cuda"``, a model ONNX Runtime cannot run) raise the
:mod:`onnxfuse.errors` classes (the CLI then writes the contract's failure document,
:func:`onnxfuse.reports.contract.failure_document`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from onnxfuse.errors import UsageError
from onnxfuse.runtime.inputs import input_specs, make_inputs
from onnxfuse.timing.compare import time_models
from onnxfuse.timing.inputs import batch_shapes
from onnxfuse.timing.profile import ProfileResult, profile
from onnxfuse.timing.runner import NO_GPU_MESSAGE, BenchConfig, BenchResult, NoGPU, Progress, gpu_unavailable_reason
from onnxfuse.timing.stats import speedup
from onnxfuse.reports.contract import document
from onnxfuse.runtime.env import environment


@dataclass
class BenchReport:
    """What ``bench`` measured: one :class:`BenchResult` per model (in the order given), their profiles
    when asked for, and the notes on the inputs (dynamic dimensions defaulted, batch applied)."""

    config: BenchConfig
    paths: list[str]
    results: list[BenchResult]
    profiles: list[ProfileResult] = field(default_factory=list)
    top: int = 10
    notes: list[str] = field(default_factory=list)
    environment: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """First model's median / second's (>1: the second is faster); None for one model."""
        if len(self.results) < 2:
            return None
        return speedup(self.results[0].stats.median_ms, self.results[1].stats.median_ms)

    def to_dict(self) -> dict:
        """The body of the JSON report (schema: ``$defs/bench`` in :func:`onnxfuse.reports.schema_path`)."""
        sp = self.speedup
        return {
            "config": self.config.to_dict(),
            "models": [dict(r.to_dict(), path=p) for r, p in zip(self.results, self.paths)],
            "speedup": None if sp is None else round(sp, 4),
            "profiles": [p.to_dict(self.top) for p in self.profiles] or None,
        }

    def to_json(self) -> dict:
        """The report ``onnxfuse bench --json`` writes: the one contract of every command
        (:mod:`onnxfuse.reports.contract`) with :meth:`to_dict` as its ``result``."""
        return document("bench", self.to_dict(), environment=self.environment)


def _labels(paths: list[str]) -> list[str]:
    names = [Path(p).name.removesuffix(".onnx") for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def _same_signature(a: onnx.ModelProto, b: onnx.ModelProto) -> bool:
    sa = [(s.name, s.dtype, s.shape) for s in input_specs(a)]
    sb = [(s.name, s.dtype, s.shape) for s in input_specs(b)]
    return sa == sb


def _load(models: list) -> tuple[list[onnx.ModelProto], list[str]]:
    """Models as ``ModelProto`` (given ones are never modified) and the path each came from
    (``<model N>`` for one given in memory)."""
    # looked up when called: tests/cli/test_cli_lazy.py stands in for load_model
    from onnxfuse.model_io import check_given_model, load_model

    protos, paths = [], []
    for i, m in enumerate(models):
        if isinstance(m, onnx.ModelProto):
            protos.append(check_given_model(m, f"<model {i + 1}>"))
            paths.append(f"<model {i + 1}>")
        elif isinstance(m, (str, os.PathLike)):
            protos.append(load_model(m))
            paths.append(os.fspath(m))
        else:
            raise TypeError(f"model {i + 1}: expected a path or an onnx.ModelProto, got {type(m).__name__}")
    return protos, paths


def bench_models(
    models: list,
    config: BenchConfig | None = None,
    *,
    batch: int | None = None,
    shapes: dict[str, list[int]] | None = None,
    inputs=None,
    seed: int = 0,
    input_ranges=None,
    profile_ops: bool = False,
    top: int = 10,
    progress: Progress | None = None,
) -> BenchReport:
    """Time ``models`` (one or two paths or ``ModelProto``) under ``config`` and return a :class:`BenchReport`.

    Inputs: one seeded draw per input signature (``shapes``, ``batch``: every input's first dynamic
    dimension; integer inputs in the range the graph implies or ``input_ranges`` gives), or the user's
    ``inputs`` (an ``.npz`` path). ``profile_ops``: also profile each model (``top`` rows in the report).
    ``progress(message, fraction)`` reports the whole job, 0..1.
    """
    config = config or BenchConfig()
    if not 1 <= len(models) <= 2:
        raise UsageError(f"bench times one model or two side by side, got {len(models)}")
    config.validate()
    if batch is not None and inputs is not None:
        raise UsageError("--batch cannot be combined with --inputs (the .npz fixes the shapes)")
    if config.device == "cuda" and gpu_unavailable_reason():
        raise NoGPU(f"{NO_GPU_MESSAGE}; use --device cpu to time on the CPU")
    protos, paths = _load(models)
    labels = _labels(paths)
    jobs = []
    for label, model in zip(labels, protos):
        if jobs and _same_signature(jobs[0][1], model):
            jobs.append((label, model, jobs[0][2]))
            continue
        model_shapes, notes = batch_shapes(model, batch, dict(shapes or {}))
        drawn = make_inputs(model, model_shapes, seed, inputs, input_ranges)
        drawn.notes.extend(notes)
        jobs.append((label, model, drawn))

    say = progress or (lambda _m, _f: None)
    share = 0.7 if profile_ops else 1.0
    results = time_models(jobs, config, progress=lambda m, f: say(m, share * f))
    profiles = []
    if profile_ops:
        for i, (label, model, drawn) in enumerate(jobs):
            base, width = share + (1 - share) * i / len(jobs), (1 - share) / len(jobs)
            profiles.append(profile(model, drawn, config, name=label,
                                    progress=lambda m, f, b=base, w=width: say(m, b + w * f)))
    notes = list(dict.fromkeys(n for _, _, drawn in jobs for n in drawn.notes))
    return BenchReport(config=config, paths=paths, results=results, profiles=profiles, top=top, notes=notes,
                       environment=environment(config.device))
