"""The reference side of validation: the original model's outputs on the validation samples.

Every candidate optimize writes (the first output, the never-slower ladder's rungs, the measured
choices, the culprit search's prefixes) is compared with these same outputs, computed once here
(:func:`validation_inputs`). The original runs with ONNX Runtime's graph optimizations off, from one
session (:class:`OriginalRuns`), on the drawn samples and the ones added at other sizes
(:mod:`onnxfuse.validate.samples`). Where the original cannot run at the default sizes, other sizes are
retried (:func:`reference_run`) rather than the user being asked for ``--shape`` at once.

``options`` is the run's :class:`onnxfuse.pipeline.OptimizeOptions`, read here (never imported:
validate/ sits below the pipeline, tests/test_layers.py).
"""

from __future__ import annotations

from onnxfuse.validate.samples import add_realistic_size, add_second_size, sample_inputs
from onnxfuse.errors import InputsError, RuntimeFailure
from onnxfuse.runtime.inputs import input_specs, unsized_dimensions

#: Sizes tried, in order, for dynamic dimensions nobody sized when the original model cannot run at 1
#: (a 3x3 Conv over H = W = 1, a pooling window wider than the input).
DEFAULT_DIM_RETRIES = (8, 32, 224)


class OriginalRuns:
    """The original model's outputs (graph optimizations off) on any draws, from one ONNX Runtime session
    made on first use: the reference run, its retries at other sizes and the second size's candidates
    used to make a session each. Why: creating a session is most of validation's time on large models;
    measured (cProfile, this 2-core machine, CPU): BERT-base 0.34 s a session, a 1.1B-parameter decoder
    4.4 s, six sessions a run (docs/benchmarks.md 5.23). Outputs are those of :func:`run_samples`, which
    makes the same session (a failed creation is not kept: the next call tries again, as before)."""

    def __init__(self, model, provider: str, name: str):
        self.model, self.provider, self.name, self.session = model, provider, name, None

    def __call__(self, samples: list) -> list:
        # looked up when called: tests/validate/test_two_sizes.py counts make_session's calls
        from onnxfuse.runtime.session import make_session, run_session

        if self.session is None:
            self.session = make_session(self.model, provider=self.provider, name=self.name)
        return [run_session(self.session, s if isinstance(s, dict) else s.feeds, name=self.name) for s in samples]

    def close(self) -> None:
        self.session = None


def validation_inputs(model, options, source: str):
    """The validation samples and the original's outputs on them: the drawn (or given) samples, plus the
    second size when onnxfuse drew them, all from one session of the original (:class:`OriginalRuns`)."""
    original = OriginalRuns(model, options.provider, source)
    samples, reference = reference_run(model, options, original)
    if options.inputs is None and options.inputs_path is None:
        add_second_size(model, samples, reference, options, original)
        add_realistic_size(model, samples, reference, options, original)
    original.close()  # before the noise floor's and the optimized model's sessions: one model's at a time
    return samples, reference


def reference_run(model, options, original: OriginalRuns):
    """The validation samples and the original's outputs on them. Unsized dynamic dimensions default
    to 1; where the original cannot run at 1, to 8, 32 and then 224 (with a note); where it runs at
    none of these, one line names the dimensions and the --shape to pass."""
    samples = sample_inputs(model, options)
    given = options.inputs is not None or options.inputs_path is not None
    unsized = [] if given else unsized_dimensions(input_specs(model), options.shapes)
    try:
        return samples, original(samples)
    except RuntimeFailure as first:
        if not unsized:
            raise
        for size, derive in ((1, False), *((size, True) for size in DEFAULT_DIM_RETRIES)):
            retry = sample_inputs(model, options, default_dim=size, derive=derive)
            if not derive and retry[0].feeds.keys() == samples[0].feeds.keys() and all(
                    retry[0].feeds[k].shape == samples[0].feeds[k].shape for k in retry[0].feeds):
                continue  # no sizes were derived: the same draw as the one that failed
            try:
                reference = original(retry)
            except RuntimeFailure:
                continue
            if not derive:
                retry[0].notes.append(f"the original model does not run at the sizes derived from its dimension "
                                      f"relations ({first}); validated with every dynamic dimension at 1")
            else:
                retry[0].notes.append(f"the original model does not run with {', '.join(unsized)} set to 1 "
                                      f"({first}); validated with {size}")
            return retry, reference
        raise InputsError(f"the original model does not run with dynamic dimension(s) {', '.join(unsized)} set to "
                          f"1, 8, 32 or 224; give sizes with --shape NAME:D0,D1,... ({first})") from None
