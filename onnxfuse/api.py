"""The Python API: ``onnxfuse.optimize(...)``, ``onnxfuse.diff(...)`` and ``onnxfuse.bench(...)``.

All are thin: they turn keyword arguments into the library's options and call the same library
functions the command line calls (``onnxfuse optimize``, ``diff`` and ``bench`` call these very
functions), so a script and a CI job get the same result and the same report. This module imports
nothing heavy; ONNX Runtime, onnx and the rewrites load on the first call.

Errors are the documented :mod:`onnxfuse.errors` classes, all subclasses of
:class:`~onnxfuse.errors.OnnxfuseError` with a one-line message: :class:`~onnxfuse.errors.ValidationFailed`
(``.culprit``: the rule responsible; ``.report``: the :class:`~onnxfuse.pipeline.OptimizeResult`),
:class:`~onnxfuse.errors.SlowerThanAllowed`, :class:`~onnxfuse.errors.ModelLoadError`,
:class:`~onnxfuse.errors.ModelSaveError`, :class:`~onnxfuse.errors.InputsError`,
:class:`~onnxfuse.errors.UsageError` (unknown rule or target, inconsistent arguments),
:class:`~onnxfuse.errors.RuntimeFailure` (ONNX Runtime cannot run a model),
:class:`~onnxfuse.errors.OnnxRuntimeUnavailable` (no usable ONNX Runtime installed) and
:class:`~onnxfuse.errors.InternalError` (onnxfuse's own fault: a model it wrote that ONNX Runtime cannot
load; ``.rules`` names the rules it is traced to). A model that is
neither a path nor an ``onnx.ModelProto`` is a ``TypeError``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, Union

from onnxfuse.options import (OPTIMIZE, checked_ranges, checked_seed, checked_shapes, checked_tolerance, field_values,
                              input_names)

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import onnx

    from onnxfuse.drift import DiffReport
    from onnxfuse.pipeline import OptimizeResult
    from onnxfuse.rewrites import Rule
    from onnxfuse.timing.bench import BenchReport

    ModelLike = Union[str, os.PathLike, onnx.ModelProto]
    InputsLike = Union[Mapping[str, np.ndarray], Sequence[Mapping[str, np.ndarray]], str, os.PathLike]


def optimize(
    model: ModelLike,
    output: str | os.PathLike | None = None,
    *,
    inputs: InputsLike | None = None,
    target: str | None = None,
    device: str = "cuda",
    only: str | Sequence[str] | None = None,
    skip: str | Sequence[str] | None = None,
    validate: bool = True,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    input_ranges: Mapping[str, tuple[float, float]] | None = None,
    right_padded: str | Sequence[str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    strict: bool = False,
    samples: int = 2,
    save_inputs: str | os.PathLike | None = None,
    provider: str = "auto",
    precision: str = "fp32",
    max_drift: float | tuple[float, float] | str | None = None,
    bench: bool = False,
    force: bool = False,
    fail_on_slowdown: float | None = None,
    never_slower: bool = True,
    tune: bool = True,
    tune_time: float | None = None,
    tune_shapes: Sequence[Mapping[str, Sequence[int]]] | None = None,
    tune_dims: Mapping[str, Sequence[int]] | None = None,
    tuning_record: str | os.PathLike | None = None,
    bench_config=None,
    rules: list[Rule] | None = None,
    progress: Callable[[str], None] | None = None,
    bench_progress: Callable[[str, float], None] | None = None,
) -> OptimizeResult:
    """Optimize an ONNX model, validate it against the original, and return the result.

    ``model``: a path (loaded with its external data) or an ``onnx.ModelProto`` (never modified).
    ``output``: when given, the optimized model is written there atomically, as the CLI does (with
    external data beside it over 2 GB); nothing is written when anything fails, and the input file
    is not overwritten unless ``force``. Without it, nothing is written: use ``result.model`` or
    ``result.save(path)``.

    ``inputs``: the data validation runs both models on: a dict ``{input name: numpy array}`` (one
    sample), a list of such dicts (several samples: each output must pass on every one), or the path
    of an ``.npz`` file. Dtypes must match the model's inputs. Default: one seeded draw (``seed``):
    floats standard normal, integer inputs in the range the graph implies (ids into an embedding of V
    rows: ``[0, V-1]``; else 0 or 1), ``input_ranges={"input_ids": (0, 30521)}`` to choose (inclusive;
    floats uniform); dynamic dimensions from ``shapes`` (``{"input": [8, 3, 224, 224]}``), else 1.
    ``right_padded=["attention_mask"]`` promises that these inputs hold right-padded rows (n >= 1 ones,
    then zeros: a tokenizer's right padding): ``Attention`` then reads them as 1-D lengths, the form ONNX
    Runtime's transformers optimizer writes (rule contrib-mask-lengths; docs/benchmarks.md 5.10 measures it), and validation draws such rows (given ``inputs`` must
    keep the promise). Wrong for left-padded masks: promise it only when it holds.

    ``target``: ``"cuda"`` (everything, FusedElementwise included; the default), ``"contrib"`` (only ONNX
    Runtime's own fused ops) or ``"onnx"`` (standard ops only). ``device``: the ONNX Runtime provider the
    model is for, ``"cuda"`` (default) or ``"cpu"``: ``"cpu"`` defaults to (and allows only) the
    ``contrib`` or ``onnx`` target, because the CPU FusedElementwise kernel is an interpreter, validates
    on the CPU provider and, with ``bench``, times both models on the CPU, so ``never_slower`` and
    ``fail_on_slowdown`` decide on CPU timings. ``only``/``skip``: rule names (a list or one
    comma-separated string; ``onnxfuse rules`` lists them). ``rules``: a custom rule pool replacing the
    registry (plugins, tests). ``validate=False`` skips validation. ``rtol``/``atol`` replace the
    dtype-aware default tolerances. An output also passes when its error is within
    :data:`onnxfuse.validate.FLOOR_MULTIPLE` times the original model's own noise floor (its outputs
    with ONNX Runtime's optimizations off vs on, and other legitimate runs: :func:`onnxfuse.validate.noise_floor`);
    ``strict=True`` judges by tolerance alone. Without
    ``inputs``, validation runs on ``samples`` seeded draws plus one at a second size of every dynamic
    dimension; ``save_inputs`` writes all of them to an .npz that ``inputs`` replays exactly. ``provider``: ``"auto"``, ``"cpu"`` or ``"cuda"`` for validation.
    ``precision="fp16"`` converts the model to compute in float16 with float32 inputs and outputs before the
    rewrites (:mod:`onnxfuse.precision`; ``"fp16-io"``: float16 inputs and outputs too; ``"bf16"``: bfloat16,
    for ONNX Runtime's CUDA provider, validated there only: :mod:`onnxfuse.precision_kernels`) and validates it
    against the float32 original at float16's tolerances (its inputs cast to float16 for an fp16-io model);
    the conversion is named as the culprit when it alone fails. An output of such a model also passes
    within ``max_drift``, the drift budget of a precision change (:mod:`onnxfuse.validate.drift_budget`):
    its normalized max error (max |got - ref| / max |ref|) at most ERR and its cosine at least COS against
    the float32 original, and its normalized max error within 3x the model merely converted (no rewrite), or,
    validated on the CPU, no worse than that model with every float16 result rounded as ONNX specifies.
    ``max_drift``: ``(ERR, COS)``, a float ERR (COS 0.999) or the command line's ``"ERR[,COS]"``; default
    ``(2e-2, 0.999)``, ``(0.16, 0.999)`` for bfloat16, whose rounding is 8x coarser (none with ``strict``
    unless given); only with a precision change. Every output's
    figures, and the plain conversion's, are in the report (``drift_error``, ``drift_cosine``,
    ``conversion_error``, ``conversion_cosine``, on the CPU ``conversion_error_rounded``; ``passed_by: "drift
    budget"``).

    ``bench``: also time both models on the device (ORT_ENABLE_ALL on both; ``bench_config`` an
    :class:`onnxfuse.timing.runner.BenchConfig`, whose device must be ``"cpu"`` with ``device="cpu"``). Off
    by default in the API, unlike the CLI: timing takes seconds, and for ``device="cuda"`` says nothing
    without a GPU (the result then carries ``timing.status == "no-gpu"``, and ``timing.message`` says when
    ``fail_on_slowdown`` was therefore not checked).
    ``fail_on_slowdown``: with ``bench``, raise :class:`~onnxfuse.errors.SlowerThanAllowed` when the
    optimized median latency exceeds this ratio of the original's.
    ``never_slower`` (default): with ``bench``, when the optimized model times slower than the original
    on the GPU (median and fastest run both beyond 3%), fewer rewrites are tried, each validated and
    timed, down to the graph as loaded; the one kept is returned and ``result.extra["selection"]`` says
    what was measured (:mod:`onnxfuse.selection`). ``False`` keeps the first model whatever its speed.
    ``tune`` (default): with ``bench``, the measured choices (rules whose worth depends on the GPU and the
    shapes, ``selection.MEASURED``: channels-last added for conv nets, then its few-channel transposes as
    ChannelTranspose; contrib-attention taken away in float32 transformers) are tried on the output,
    each validated and timed beside it in one run of two fresh sessions, and kept when faster (in each
    session too); ``result.extra["measured"]`` says what was measured.
    ``tune_time``: seconds of that tuning and of the never-slower ladder after the first timing (default
    60); past it no new candidate starts, and the ladder goes straight to the graph as loaded.
    ``tune_shapes``: more sizes to time at, each ``{input name: [dims]}`` (other inputs as ``shapes`` gives
    them), e.g. ``[{"input": [16, 3, 224, 224]}]`` besides the first timing at batch 1: the model is then
    never kept slower than the original at any of them, and a measured choice is kept only when faster
    by the geometric mean of the sizes and not slower at any (``result.timing.other_sizes``).
    ``tune_dims``: the same sizes spelled by dimension name, ``{"batch": [16]}`` (several names: every
    combination), in every input with that dynamic dimension, other dimensions as the first timing's.
    ``tuning_record``: a file of measured decisions (:mod:`onnxfuse.tuning_record`): where it holds one for
    this model, options and shapes (measured on this GPU, or on any when none is usable here) it is applied
    without timing; else what this run's timing decided is added to it. ``result.extra["tuning_record"]``
    says which.

    ``progress(message)`` and ``bench_progress(message, fraction)`` are optional callbacks for a UI.

    Returns an :class:`~onnxfuse.pipeline.OptimizeResult`: ``.model`` (the optimized ``ModelProto``),
    ``.validation`` (per-output metrics), ``.applied`` (rewrites and refusals), ``.ops_before`` /
    ``.ops_after`` (the main graph's nodes by op type; ``.body_ops_before`` / ``.body_ops_after`` those in If
    branches and Loop/Scan bodies), ``.timing``, ``.to_json()`` (the dict ``onnxfuse optimize --json`` writes) and
    ``.save(path)``. Raises :class:`~onnxfuse.errors.ValidationFailed` (``.culprit`` names the rule,
    ``.skip`` the rules to skip for a model that validates, ``.report.to_json()`` is the failure report)
    when an output drifts beyond tolerance, :class:`~onnxfuse.errors.InternalError` when the model
    onnxfuse wrote cannot be loaded by ONNX Runtime.
    """
    keywords = {name: value for name, value in locals().items() if name in OPTIMIZE}  # first: the parameters
    # start-up: import onnxfuse does not load onnxfuse.ort_runtime
    from onnxfuse.ort_runtime import require_runtime

    require_runtime()
    # start-up: import onnxfuse does not load onnxfuse.pipeline (nor numpy, onnx, graphsurgeon)
    from onnxfuse.pipeline import OptimizeOptions, run_pipeline

    options = OptimizeOptions(**field_values("optimize", **keywords))
    return run_pipeline(model, output, options, progress=progress, bench_progress=bench_progress)


def optimize_many(
    models: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    started=None,
    progress: Callable[[str], None] | None = None,
    bench_progress: Callable[[str, float], None] | None = None,
    finished=None,
    reraise: bool = False,
    **kwargs,
):
    """Optimize several models into ``out_dir`` (``out_dir/<stem>.onnx`` each), as ``onnxfuse optimize
    a.onnx b.onnx --out-dir DIR`` does: ``models`` are paths, folders (their ``*.onnx`` files) or glob
    patterns, expanded in sorted order (:func:`onnxfuse.batch.plan`); ``kwargs`` are :func:`optimize`'s
    and apply to every model (``save_inputs`` excepted: refused).

    Clashing stems, or an output that would overwrite an input, raise :class:`~onnxfuse.errors.UsageError`
    before any model is read. Then every model runs even when one fails; returns a
    :class:`~onnxfuse.batch.BatchResult` (``.runs``: each model's exit code, error and result;
    ``.exit_code``: the worst, :func:`onnxfuse.errors.worst_exit_code`; ``.to_json()``), never raising for
    a model's failure: call ``.raise_for_failure()`` for :class:`~onnxfuse.errors.ModelsFailed`.
    ``started(k, n, job)`` and ``finished(k, n, run)`` frame each model for a UI.
    """
    # start-up: import onnxfuse does not load onnxfuse.ort_runtime
    from onnxfuse.ort_runtime import require_runtime

    require_runtime()
    # start-up: import onnxfuse does not load onnxfuse.batch (nor numpy, onnx, graphsurgeon)
    from onnxfuse.batch import check_options, optimize_many as run_many, plan
    # start-up: import onnxfuse does not load onnxfuse.pipeline (nor numpy, onnx, graphsurgeon)
    from onnxfuse.pipeline import OptimizeOptions

    options = OptimizeOptions(**field_values("optimize_many", **kwargs))
    check_options(save_inputs=options.save_inputs)
    jobs = plan(models, out_dir, force=options.force)
    return run_many(jobs, out_dir, options, started=started, progress=progress, bench_progress=bench_progress,
                    finished=finished, reraise=reraise)


def diff(
    a: ModelLike,
    b: ModelLike,
    *,
    inputs: InputsLike | None = None,
    samples: int = 1,
    intermediates: bool = False,
    rtol: float | None = None,
    atol: float | None = None,
    tolerances: Mapping[str, tuple[float, float]] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    input_ranges: Mapping[str, tuple[float, float]] | None = None,
    right_padded: str | Sequence[str] | None = None,
    provider_a: str = "auto",
    provider_b: str = "auto",
    batch_size: int | None = None,
    histograms: bool = True,
    progress: Callable[[str], None] | None = None,
) -> DiffReport:
    """Run models ``a`` and ``b`` on the same inputs and measure how far apart their outputs are.

    ``a`` and ``b``: paths or ``onnx.ModelProto`` (never modified). ``a`` is the reference. Inputs are
    ``samples`` seeded draws from A's signature (seeds ``seed``, ``seed+1``, ...; floating inputs cast
    to each model's own dtypes, so an fp16 model and its fp32 original see the same values), or the
    user's ``inputs``: a dict ``{input name: array}``, a list of such dicts (one per sample), or an
    ``.npz`` path, in A's dtypes. ``shapes`` sizes dynamic dimensions; integer inputs are drawn in the
    range A's graph implies or ``input_ranges`` gives; ``right_padded`` inputs as right-padded rows (as in
    :func:`optimize`: to check a model optimized under that promise).

    Tolerance per element: ``|b - a| <= atol + rtol * |a|``; defaults depend on the dtype (the looser of
    the two sides). ``rtol``/``atol`` replace them for every tensor, ``tolerances`` (``{name: (rtol,
    atol)}``) for one. ``intermediates=True`` also compares every tensor the two models share and names
    the first that drifts (``report.first_divergence``), ``batch_size`` tensors per run.
    ``provider_a``/``provider_b``: ``"auto"``, ``"cpu"`` or ``"cuda"``.

    Drift is *reported, never raised*: check ``report.passed`` (True when every output is within
    tolerance; intermediate drift is diagnostic). Returns a :class:`~onnxfuse.drift.DiffReport`:
    ``.outputs`` / ``.intermediates`` (per-tensor metrics), ``.first_divergence``, ``.failing()``,
    ``.to_json()`` (the dict ``onnxfuse diff --json`` writes; schema:
    :func:`onnxfuse.reports.schema_path`). Errors (bad models, inputs or arguments) raise the
    :mod:`onnxfuse.errors` classes.
    """
    # start-up: import onnxfuse does not load onnxfuse.ort_runtime
    from onnxfuse.ort_runtime import require_runtime

    require_runtime()
    # start-up: import onnxfuse does not load onnxfuse.drift (nor numpy, onnx, graphsurgeon)
    from onnxfuse.drift import DEFAULT_BATCH_SIZE, diff_models

    checked_tolerance(rtol, "rtol"), checked_tolerance(atol, "atol"), checked_seed(seed)
    for name, (t_rtol, t_atol) in dict(tolerances or {}).items():
        checked_tolerance(t_rtol, "rtol"), checked_tolerance(t_atol, "atol")

    return diff_models(
        a, b, shapes=checked_shapes(shapes), seed=seed, inputs=inputs, samples=samples, provider_a=provider_a,
        provider_b=provider_b, rtol=rtol, atol=atol, tolerances=dict(tolerances or {}),
        intermediates=intermediates, batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
        histograms=histograms, progress=progress, input_ranges=checked_ranges(input_ranges),
        right_padded=input_names(right_padded),
    )


def bench(
    a: ModelLike,
    b: ModelLike | None = None,
    *,
    inputs: str | os.PathLike | None = None,
    batch: int | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    input_ranges: Mapping[str, tuple[float, float]] | None = None,
    device: str = "cuda",
    cuda_graph: bool = False,
    iterations: int | None = None,
    warmup: int = 10,
    time_budget: float | None = 2.0,
    sessions: int = 1,
    profile: bool = False,
    top: int = 10,
    progress: Callable[[str, float], None] | None = None,
) -> BenchReport:
    """Time model ``a`` (and ``b``, side by side) on ONNX Runtime and return the latencies.

    ``a``, ``b``: paths or ``onnx.ModelProto`` (never modified). Each model runs with ONNX Runtime's own
    optimizations on (ORT_ENABLE_ALL), on the GPU with inputs and outputs bound in device memory
    (IOBinding), after ``warmup`` runs; timed runs go on until ``iterations`` or ``time_budget`` seconds,
    whichever comes first; two models alternate in rounds. ``sessions`` > 1 repeats it in fresh
    sessions and pools the samples. ``device="cpu"`` times on the CPU provider instead (results say so).
    ``cuda_graph``: capture the run in a CUDA graph and replay it.

    Inputs: one seeded draw (``seed``) per input signature: ``batch`` sets every input's first dynamic
    dimension, ``shapes`` (``{"input": [8, 3, 224, 224]}``) sizes inputs, ``input_ranges`` as in
    :func:`optimize`; or ``inputs``, the path of an ``.npz`` file. ``profile``: also profile each model
    (top ``top`` ops by time and count, nodes and kernels per run). ``progress(message, fraction)``.

    Returns a :class:`~onnxfuse.timing.bench.BenchReport`: ``.results`` (per model: latency percentiles,
    samples, shapes), ``.speedup`` (a's median / b's), ``.profiles``, ``.notes``, ``.to_json()`` (the dict
    ``onnxfuse bench --json`` writes). Like :func:`diff`, measuring is never an error; what prevents it
    raises the :mod:`onnxfuse.errors` classes: :class:`~onnxfuse.errors.RuntimeFailure` (no usable GPU
    for ``device="cuda"``: ``onnxfuse.timing.runner.NoGPU``; a model ONNX Runtime cannot run),
    :class:`~onnxfuse.errors.UsageError`, :class:`~onnxfuse.errors.InputsError`,
    :class:`~onnxfuse.errors.ModelLoadError`.
    """
    # start-up: import onnxfuse does not load onnxfuse.ort_runtime
    from onnxfuse.ort_runtime import require_runtime

    require_runtime()
    # start-up: import onnxfuse does not load onnxfuse.timing.bench (nor numpy, onnx, graphsurgeon)
    from onnxfuse.timing.bench import bench_models
    # start-up: import onnxfuse does not load onnxfuse.timing.runner (nor numpy, onnx, graphsurgeon)
    from onnxfuse.timing.runner import BenchConfig

    checked_seed(seed)
    config = BenchConfig(device=device, warmup=warmup, iterations=iterations, time_budget_s=time_budget,
                         cuda_graph=cuda_graph, sessions=sessions)
    return bench_models(
        [a] if b is None else [a, b], config, batch=batch, shapes=checked_shapes(shapes),
        inputs=None if inputs is None else os.fspath(inputs), seed=seed, input_ranges=checked_ranges(input_ranges),
        profile_ops=profile, top=top, progress=progress,
    )


__all__ = ["bench", "diff", "optimize", "optimize_many"]
