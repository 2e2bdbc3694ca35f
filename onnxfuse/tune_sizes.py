"""``--tune-shape``: time the original and each candidate at more than one size, so that what is decided on
timings (the never-slower fallback, the measured choices: :mod:`onnxfuse.selection`) holds at every size
the user deploys, not only at the first (validation's) size.

Why: a decision measured at one size can be wrong at another. MobileNetV3-L's ``--precision fp16`` output
kept the channels-last layout on its batch-1 timing and then took 1.18x the time of the half() export's
output (which had not kept it) at batch 16 (docs/benchmarks.md 5.42). The selection module judges a
timing with ``other_sizes`` at each size (:func:`onnxfuse.selection.sizes`).

A size where a model cannot be timed (the original does not run at those shapes, say) is dropped with a
note, never silently: the decisions then rest on the sizes that were timed.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable

from onnxfuse.errors import UsageError
from onnxfuse.runtime.inputs import Inputs, check_shape_names, input_specs
from onnxfuse.selection import TrialCut, deadline_passed
from onnxfuse.validate.samples import sample_inputs


def dim_sizes(model, options, specs=None) -> list[dict[str, list[int]]]:
    """The sizes ``options.tune_dims`` names (``{"batch": [1, 16]}``; several names: every combination), each
    as ``{input: dims}`` for the inputs that have one of those dynamic dimensions: the named dimensions at
    the size, every other as ``options.shapes`` gives it, else 1 (the first timing's default). A name no
    input's dynamic dimension has is a usage error (exit 2) that lists the names there are. ``specs``: the
    model's :func:`~onnxfuse.runtime.inputs.input_specs`, when the caller has them."""
    if not options.tune_dims:
        return []
    specs = specs if specs is not None else input_specs(model)
    names = {d for spec in specs for d in spec.shape if isinstance(d, str)}
    unknown = set(options.tune_dims) - names
    if unknown:
        raise UsageError(f"--tune-dim names no dynamic dimension of the model's inputs: {', '.join(sorted(unknown))}; "
                         f"named dynamic dimensions: {', '.join(sorted(names)) or '(none)'}")
    given = options.shapes or {}
    out = []
    for combo in itertools.product(*([(name, v) for v in values] for name, values in options.tune_dims.items())):
        sized = dict(combo)
        size = {}
        for spec in specs:
            if not any(d in sized for d in spec.shape if isinstance(d, str)):
                continue
            base = given.get(spec.name) or [d if isinstance(d, int) else 1 for d in spec.shape]
            size[spec.name] = [sized[d] if isinstance(d, str) and d in sized else base[i] for i, d in enumerate(spec.shape)]
        out.append(size)
    return out


def tune_size_inputs(model, options) -> list[Inputs]:
    """One seeded draw per ``options.tune_shapes`` size and per ``options.tune_dims`` one
    (:func:`dim_sizes`): its shapes over ``options.shapes`` (other dynamic dimensions as the first size has
    them), values drawn as validation draws them (``input_ranges``, right-padded masks); never the user's
    ``inputs``, which have their own shapes."""
    if not (options.tune_shapes or options.tune_dims):
        return []
    specs = input_specs(model)
    out = []
    for size in list(options.tune_shapes or ()) + dim_sizes(model, options, specs):
        check_shape_names(specs, size, "--tune-shape")
        sized = replace(options, shapes={**(options.shapes or {}), **size}, inputs=None, inputs_path=None, samples=1)
        try:
            out.append(sample_inputs(model, sized)[0])
        except UsageError as exc:  # the draw's checks speak of --shape; the size came from --tune-shape
            raise UsageError(str(exc).replace("--shape", "--tune-shape", 1)) from None
    return out


def time_at_sizes(time_one: Callable, candidate, first: Inputs, others: list[Inputs]):
    """``time_one(candidate, inputs)`` (a ComparisonResult against the original) at ``first``, then, when
    that timed, at each of ``others`` into its ``other_sizes``; each result carries its ``shapes``."""
    return _at_sizes(lambda inputs: [time_one(candidate, inputs)], first, others)[0]


def time_beside_at_sizes(time_two: Callable, candidate, incumbent, first: Inputs, others: list[Inputs],
                         deadline: float | None = None):
    """``time_two(candidate, incumbent, inputs)`` (both against the original, in one run:
    ``timing.compare_beside``) at every size, as :func:`time_at_sizes` does: (candidate's, incumbent's).
    A measured choice's trial: past ``deadline`` (``time.monotonic()``) before a further size it stops
    with :class:`~onnxfuse.selection.TrialCut` (the trial is refused, not decided on fewer sizes)."""
    return tuple(_at_sizes(lambda inputs: list(time_two(candidate, incumbent, inputs)), first, others, deadline))


def _at_sizes(time_all: Callable, first: Inputs, others: list[Inputs], deadline: float | None = None) -> list:
    """``time_all(inputs)`` (ComparisonResults) at ``first``, then, when all of them timed, at each of
    ``others``, each size's results into the first's ``other_sizes`` in order; past ``deadline`` before
    one of ``others``, :class:`~onnxfuse.selection.TrialCut`."""
    timings = time_all(first)
    for timing in timings:
        timing.shapes = first.shapes()
    if any(timing.status != "ok" for timing in timings):
        return timings
    for done, inputs in enumerate(others, start=1):
        if deadline_passed(deadline):
            raise TrialCut(f"timed at {done} of {len(others) + 1} sizes when the deadline passed")
        for timing, other in zip(timings, time_all(inputs)):
            other.shapes = inputs.shapes()
            if other.status == "ok":
                timing.other_sizes.append(other)
            else:
                timing.notes.append(f"not timed at {shapes_text(other.shapes)}: {other.message or other.status}; "
                                    "decisions rest on the other sizes")
    return timings


def shapes_text(shapes: dict | None) -> str:
    """``input 16x3x224x224, mask 16x128`` (the inputs' shapes, as notes print them)."""
    return ", ".join(f"{name} {'x'.join(str(d) for d in dims) or 'scalar'}" for name, dims in (shapes or {}).items())


def size_notes(timing) -> list[str]:
    """One line per extra size of a timing that ran at several (``--tune-shape``)."""
    if timing is None or not getattr(timing, "other_sizes", None):
        return []
    return [f"also timed at {shapes_text(o.shapes)}: original {o.original.stats.median_ms:.3f} ms, optimized "
            f"{o.optimized.stats.median_ms:.3f} ms ({o.speedup:.2f}x)" for o in timing.other_sizes]
