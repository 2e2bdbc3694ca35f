"""Right-padded masks: the promise ``--right-padded NAME`` makes about an input, how validation draws
inputs that keep it, and how given inputs are held to it.

A tokenizer that pads on the right (BERT's, by default) writes an attention mask whose every row is
n ≥ 1 ones followed by zeros. ONNX Runtime's ``Attention`` reads such a mask fastest as 1-D lengths
(``mask_index`` of shape [B]: "the first n keys are kept"; docs/benchmarks.md 5.9 and 5.10 measure
it). Lengths are wrong for any other mask (left padding, holes), so onnxfuse writes them only under the user's promise
(rule ``contrib-mask-lengths``), and validation then draws masks that keep it: judging a rewrite that
relies on a promise with inputs that break it would only cry wolf.

n ≥ 1: a fully masked row (n = 0) is not a tokenizer's output, and kernels disagree on it (the CUDA
kernel attends to every key, the original adds the fill to every score).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxfuse.errors import InputsError, UsageError


@dataclass(frozen=True)
class RightPadded:
    """The draw for an input promised right-padded: along the last axis, each row holds n ones then
    zeros, n uniform in [1, L] (L the row length), drawn per row (every leading index)."""

    why: str = "--right-padded"

    def describe(self, name: str) -> str:
        return f"input {name!r}: right-padded rows, n >= 1 ones then zeros ({self.why})"

    def draw(self, rng: np.random.Generator, dtype: np.dtype, shape: list[int]) -> np.ndarray:
        if not shape:
            raise InputsError("a right-padded input needs at least one axis (the keys)")
        length = shape[-1]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        if length == 0 or rows == 0:
            return np.zeros(shape, dtype=dtype)
        kept = rng.integers(1, length + 1, size=rows)
        mask = np.arange(length)[None, :] < kept[:, None]
        return mask.reshape(shape).astype(dtype)


def right_padded_draws(specs, names) -> dict[str, RightPadded]:
    """``{name: RightPadded()}`` for the inputs ``--right-padded`` names, checked: each is a model input
    of rank >= 1 (usage errors otherwise)."""
    by_name = {s.name: s for s in specs}
    draws = {}
    for name in names or ():
        spec = by_name.get(name)
        if spec is None:
            raise UsageError(f"--right-padded names unknown input {name!r}; model inputs: "
                             f"{', '.join(by_name) or '(none)'}")
        if spec.shape is not None and len(spec.shape) == 0:
            raise UsageError(f"--right-padded {name}: a scalar input has no rows to pad")
        draws[name] = RightPadded()
    return draws


def first_break(array: np.ndarray) -> tuple[int, ...] | None:
    """The leading index of the first row of ``array`` (last axis) that is not n >= 1 nonzeros followed
    by zeros, or None when every row is."""
    if array.ndim == 0:
        return ()
    rows = (np.asarray(array) != 0).reshape(-1, array.shape[-1]) if array.size else None
    if rows is None:
        return None
    kept = rows.sum(axis=1)
    prefix = np.arange(array.shape[-1])[None, :] < kept[:, None]
    bad = np.nonzero((kept == 0) | np.any(rows != prefix, axis=1))[0]
    if bad.size == 0:
        return None
    return tuple(int(i) for i in np.unravel_index(int(bad[0]), array.shape[:-1]))


def check_given(samples, names) -> None:
    """Given inputs (``--inputs``) must keep the promise: one line naming the first row that breaks it."""
    for k, sample in enumerate(samples):
        for name in names or ():
            where = first_break(sample.feeds[name])
            if where is not None:
                row = ", ".join(str(i) for i in where)
                raise InputsError(f"--right-padded {name}: sample {k}, row [{row}] is not ones followed by "
                                  "zeros (at least one 1); the promise does not hold for these inputs")
