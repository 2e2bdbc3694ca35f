"""What optimize validates on: the seeded draws (or the user's inputs), and the samples added at other sizes.

Why more than one size: a rewrite that bakes in a dynamic dimension (a Reshape to the sample's length, a
mask built for one batch) passes at the size it was checked at and breaks at any other. So besides the
drawn samples (:func:`sample_inputs`), validation adds, where onnxfuse drew them, a sample at a second size
of every dynamic dimension (:func:`add_second_size`; a KV-cache decoder's tied dimensions get a second size,
a prefill and a decode sample instead, :func:`add_variants`) and a token model's realistic sample
(:func:`add_realistic_size`: real padding in the masks). Each is kept only where the *original* runs on it
(``run``: :class:`onnxfuse.validate.reference.OriginalRuns`), with its outputs appended to ``reference``;
where it runs on none, a note says what was not validated.

``options`` is the run's :class:`onnxfuse.pipeline.OptimizeOptions`, read here (never imported:
validate/ sits below the pipeline, tests/test_layers.py).
"""

from __future__ import annotations

import onnx

from onnxfuse.errors import RuntimeFailure, UsageError
from onnxfuse.runtime.inputs import (Inputs, derived_shapes, input_specs, make_samples, relation_variants,
                                     second_size_candidates)
from onnxfuse.runtime.realistic import LENGTHS, realistic_sample


def sample_inputs(model: onnx.ModelProto, options, default_dim: int = 1, derive: bool = True) -> list[Inputs]:
    """The samples validation runs on: the user's (``options.inputs`` or ``options.inputs_path``), else
    seeded draws (at sizes derived from the graph's dimension relations where it has binding ones,
    ``derive``). Timing uses the first."""
    if options.inputs is not None and options.inputs_path is not None:
        raise UsageError("give the inputs once: OptimizeOptions.inputs or inputs_path, not both")
    given = options.inputs if options.inputs is not None else options.inputs_path
    return make_samples(model, options.shapes, options.seed, given, options.input_ranges, default_dim, options.samples,
                        right_padded=options.right_padded, derive=derive)


def add_second_size(model, samples: list, reference: list, options, run) -> None:
    """Append a sample at a second size of every dynamic dimension (and the original's outputs on it)
    when the original runs there (:func:`onnxfuse.runtime.inputs.second_size_candidates`); else a
    note says validation ran at one size."""
    groups = relation_variants(model, samples[0], options.seed)
    if groups:
        add_variants(samples, reference, groups, run)
        return
    candidates = second_size_candidates(model, samples[0], options.seed)
    if add_first_that_runs(candidates, samples, reference, run):
        return
    if candidates:
        samples[0].notes.append("validated at one size only: the original model does not run with its dynamic "
                                "dimensions one larger (use --shape to choose sizes)")


def add_variants(samples: list, reference: list, groups, run) -> None:
    """For a model whose dynamic dimensions are tied: the first candidate of each group (second size,
    prefill, decode: :func:`onnxfuse.runtime.inputs.relation_variants`) the original runs on, with a note
    for a group where it runs on none."""
    for how, draws in groups:
        if not add_first_that_runs(draws, samples, reference, run):
            samples[0].notes.append(f"no {how} sample: the original model does not run at the sizes derived for it")


def add_first_that_runs(draws, samples: list, reference: list, run) -> bool:
    """Append the first of ``draws`` the original model runs on (and its outputs); False when none runs."""
    for draw in draws:
        try:
            (outputs,) = run([draw])
        except RuntimeFailure:
            continue
        samples.append(draw)
        reference.append(outputs)
        return True
    return False


def add_realistic_size(model, samples: list, reference: list, options, run) -> None:
    """Append a token model's realistic sample (:mod:`onnxfuse.runtime.realistic`: three rows at the first of
    128, 64, 32, 16 tokens the original runs at, masks with real padding) and the original's outputs on it;
    nothing for other models, for KV-cache decoders (sizes derived from relations: their prefill and
    decode samples do this job) or where the original runs at none of the lengths."""
    if derived_shapes(model, input_specs(model), options.shapes or {}) is not None:
        return
    for length in LENGTHS:
        sample = realistic_sample(model, length, options.seed + 7, options.right_padded, options.shapes)
        if sample is None:
            return
        try:
            outputs = run([sample])
        except RuntimeFailure:
            continue
        samples.append(sample)
        reference.extend(outputs)
        return
