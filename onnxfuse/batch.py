"""Many models in one run: ``onnxfuse optimize a.onnx b.onnx exports/ 'more/*.onnx' --out-dir DIR``.

Why a module of its own: a pipeline that exports ten models should not need ten CI steps, ten reports
and ten exit codes to combine. This module turns the command line's paths into a plan (one
``DIR/<stem>.onnx`` per input, refused up front when two inputs would write the same file or an
output would replace an input), then runs :func:`onnxfuse.pipeline.run_pipeline` on each model in
turn. One model's failure (a bad file, a validation failure, a latency gate) is recorded and the others
still run: a CI job learns about every model in one pass. The outcome, :class:`BatchResult`, holds each
model's :class:`ModelRun` and the worst exit code (:func:`onnxfuse.errors.worst_exit_code`).

Every option applies to each model as it would to one (``--inputs`` included: every model must accept
that .npz); ``save_inputs`` is refused, since one file cannot hold several models' samples.
Each model's output is written atomically as soon as it passes, so an interrupted run keeps the models
already done; the reports cover every model and are written at the end.
"""

from __future__ import annotations

import glob
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from onnxfuse import model_io
from onnxfuse.errors import (EXIT_OK, EXIT_SLOWER, EXIT_USAGE, EXIT_USER_ERROR, EXIT_VALIDATION_FAILED, ModelSaveError,
                             ModelsFailed, OnnxfuseError, UsageError, first_line, worst_exit_code)
from onnxfuse.reports.contract import document
from onnxfuse.reports.jsonreport import optimize_body

#: Characters that make a command-line argument a pattern (when no file has that very name).
GLOB_CHARS = "*?["
#: What a folder given as an input contributes: its ``*.onnx`` files (not its subfolders).
MODEL_SUFFIX = ".onnx"
#: How many failing models the one-line error names before "…".
NAMED_FAILURES = 3


def expand_inputs(args: Sequence[str | os.PathLike]) -> list[Path]:
    """The model files the arguments name, in order: a folder gives its ``*.onnx`` files sorted by name
    (not recursive, so an output folder inside it is not read back), a pattern (``*``, ``?``, ``[``;
    quoted, so the shell leaves it) its matches sorted, anything else the path itself (a missing file
    then fails as that model's load error, exit 1, as with one model). A file reached twice is kept once,
    where it first appears. A folder or pattern that names no model is a usage error (exit 2): a typo
    must not turn into a green run over nothing."""
    found: list[Path] = []
    for arg in args:
        raw = os.fspath(arg)
        p = Path(raw)
        if p.is_dir():
            items = sorted(c for c in p.iterdir() if c.suffix == MODEL_SUFFIX and c.is_file())
            if not items:
                raise UsageError(f"{raw}: the folder holds no {MODEL_SUFFIX} file")
        elif any(c in raw for c in GLOB_CHARS) and not p.exists():
            items = sorted(Path(m) for m in glob.glob(raw) if Path(m).is_file())
            if not items:
                raise UsageError(f"{raw}: the pattern matches no file")
        else:
            items = [p]
        found += items
    unique: list[Path] = []
    seen: set[str] = set()
    for p in found:
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


@dataclass(frozen=True)
class Job:
    """One model of the run: where it is read from and where its optimized form goes."""

    input_path: Path
    output_path: Path

    @property
    def name(self) -> str:
        return self.input_path.name


def plan(args: Sequence[str | os.PathLike], out_dir: str | os.PathLike, force: bool = False) -> list[Job]:
    """One :class:`Job` per model the arguments name (:func:`expand_inputs`), writing ``out_dir/<stem>.onnx``.

    Refused up front, before any model is read (usage errors, exit 2): two inputs with the same stem
    (one output would silently replace the other), and an output that would replace an input or its
    external data (``--out-dir`` the inputs' own folder), unless ``force`` and it is that model's own
    input, as ``--force`` allows with one model."""
    inputs = expand_inputs(args)
    out = Path(out_dir)
    by_stem: dict[str, Path] = {}
    for p in inputs:
        if p.stem in by_stem:
            raise UsageError(f"{by_stem[p.stem]} and {p} would both be written to {out / (p.stem + MODEL_SUFFIX)}; "
                             "rename one or optimize them in separate runs")
        by_stem[p.stem] = p
    jobs = [Job(p, out / (p.stem + MODEL_SUFFIX)) for p in inputs]
    for job in jobs:
        for other in jobs:
            own = other is job
            if model_io.same_file(job.output_path, other.input_path) and not (own and force):
                whose = "its input" if own else f"the input {other.input_path}"
                raise UsageError(f"--out-dir {out_dir}: {job.output_path} would overwrite {whose}; choose another "
                                 "--out-dir" + (" (or pass --force)" if own else ""))
            if own:
                continue  # check_output_path guards a model's own external data
            for data in model_io.input_data_files(other.input_path):
                for written in (job.output_path, model_io.data_path(job.output_path)):
                    if model_io.same_file(written, data):
                        raise UsageError(f"--out-dir {out_dir}: {written} would overwrite the external data of "
                                         f"{other.input_path}; choose another --out-dir")
    return jobs


def check_options(save_inputs=None) -> None:
    """Options that mean one model only, refused with several (usage error)."""
    if save_inputs:
        raise UsageError("--save-inputs writes one model's samples: use it with one model (INPUT OUTPUT)")


@dataclass
class ModelRun:
    """One model's outcome: its result (also after a validation or latency failure, which carry one),
    its exit code and one-line error."""

    input_path: str
    output_path: str | None  # None when nothing was written
    exit_code: int
    error: str | None
    seconds: float
    result: object | None = field(default=None, repr=False)  # onnxfuse.pipeline.OptimizeResult

    @property
    def name(self) -> str:
        return Path(self.input_path).name

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    @property
    def speedup(self) -> float | None:
        timing = getattr(self.result, "timing", None)
        return timing.speedup if timing is not None and timing.status == "ok" else None

    def timing_text(self) -> str:
        """The speed-up as the summary shows it: ``1.93×``, ``1.02× CPU`` (``--device cpu``), ``no GPU``, or
        ``-`` (not timed)."""
        timing = getattr(self.result, "timing", None)
        if timing is None:
            return "-"
        if timing.status == "ok" and timing.speedup:
            return f"{timing.speedup:.2f}×" + (" CPU" if getattr(timing, "device", "cuda") == "cpu" else "")
        return "no GPU" if timing.status == "no-gpu" else "-"

    def verdict(self) -> str:
        """A few words: ``ok``, ``validation failed``, ``slower than allowed``, ``error``, ``usage error``."""
        return {EXIT_OK: "ok", EXIT_VALIDATION_FAILED: "validation failed", EXIT_SLOWER: "slower than allowed",
                EXIT_USAGE: "usage error"}.get(self.exit_code, "error")

    def nodes_text(self) -> str:
        r = self.result
        return "-" if r is None else f"{r.nodes_before} → {r.nodes_after}"

    def to_dict(self) -> dict:
        return {"input": self.input_path, "output": self.output_path, "ok": self.ok, "exit_code": self.exit_code,
                "error": self.error, "seconds": round(self.seconds, 4),
                "result": optimize_body(self.result) if self.result is not None else None}


@dataclass
class BatchResult:
    out_dir: str
    runs: list[ModelRun]
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return worst_exit_code(r.exit_code for r in self.runs)

    @property
    def failed(self) -> list[ModelRun]:
        return [r for r in self.runs if not r.ok]

    @property
    def error(self) -> str | None:
        """The one line the command fails with (and the JSON ``error``), or None when every model passed."""
        bad = self.failed
        if not bad:
            return None
        named = "; ".join(f"{r.name}: {r.error}" for r in bad[:NAMED_FAILURES])
        return (f"{len(bad)} of {len(self.runs)} models failed (worst exit code {self.exit_code}): {named}"
                + (" …" if len(bad) > NAMED_FAILURES else ""))

    def to_dict(self) -> dict:
        ok = sum(r.ok for r in self.runs)
        return {"out_dir": self.out_dir, "models": [r.to_dict() for r in self.runs],
                "summary": {"models": len(self.runs), "ok": ok, "failed": len(self.runs) - ok,
                            "exit_code": self.exit_code, "total_s": round(self.seconds, 4)}}

    def to_json(self) -> dict:
        """The ``onnxfuse optimize ... --out-dir DIR --json`` document: the one contract
        (:mod:`onnxfuse.reports.contract`), ``ok`` only when every model passed, the worst exit code."""
        return document("optimize", self.to_dict(), exit_code=self.exit_code, error=self.error)

    def raise_for_failure(self) -> None:
        """Raise :class:`~onnxfuse.errors.ModelsFailed` (worst exit code, :attr:`error`) unless all passed."""
        if self.failed:
            raise ModelsFailed(self.error, self.exit_code, report=self)


def _outcome(job: Job, exc: BaseException) -> tuple[int, str, object | None]:
    """Exit code, one-line error and (for validation and latency failures) the result of a failed model."""
    if isinstance(exc, OnnxfuseError):
        return exc.exit_code, first_line(exc), getattr(exc, "report", None)
    if isinstance(exc, MemoryError):
        return EXIT_USER_ERROR, "out of memory", None
    return EXIT_USER_ERROR, f"internal error ({type(exc).__name__}: {first_line(exc)}); rerun this model alone " \
                            "with ONNXFUSE_DEBUG=1 for a traceback and please report it", None


def optimize_many(
    jobs: Sequence[Job],
    out_dir: str | os.PathLike,
    options,
    *,
    started: Callable[[int, int, Job], None] | None = None,
    progress: Callable[[str], None] | None = None,
    bench_progress: Callable[[str, float], None] | None = None,
    finished: Callable[[int, int, ModelRun], None] | None = None,
    reraise: bool = False,
) -> BatchResult:
    """Optimize each job's model with ``options`` (an :class:`onnxfuse.pipeline.OptimizeOptions`) and
    write its output, one after the other; a model that fails is recorded and the next one runs.

    ``out_dir`` is created when missing. ``started(k, n, job)`` and ``finished(k, n, run)`` (k from 1)
    frame each model for a UI; ``progress``/``bench_progress`` receive its stages as with one model.
    ``reraise``: let an unexpected exception (an onnxfuse bug) propagate instead of recording it
    (``ONNXFUSE_DEBUG``). Interrupts (Ctrl-C, SIGTERM) always propagate: the models done stay written.
    """
    # start-up: the command line starts (and --help runs) without onnxfuse.pipeline
    from onnxfuse.pipeline import run_pipeline

    check_options(save_inputs=options.save_inputs)
    t0 = time.perf_counter()
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelSaveError(f"--out-dir {out_dir}: cannot create the folder ({exc.strerror})") from None
    runs: list[ModelRun] = []
    n = len(jobs)
    for k, job in enumerate(jobs, 1):
        if started:
            started(k, n, job)
        t = time.perf_counter()
        try:
            result = run_pipeline(str(job.input_path), str(job.output_path), options, progress=progress,
                                  bench_progress=bench_progress)
            run = ModelRun(str(job.input_path), str(job.output_path), EXIT_OK, None, 0.0, result)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # noqa: BLE001  one model's failure must not stop the others
            if reraise and not isinstance(exc, OnnxfuseError):
                raise
            code, error, report = _outcome(job, exc)
            run = ModelRun(str(job.input_path), None, code, error, 0.0, report)
        run.seconds = time.perf_counter() - t
        runs.append(run)
        if finished:
            finished(k, n, run)
    return BatchResult(str(out_dir), runs, time.perf_counter() - t0)


__all__ = ["BatchResult", "Job", "ModelRun", "check_options", "expand_inputs", "optimize_many", "plan"]
