"""A validation sample the way a token model meets its inputs in use: a realistic sequence length and
padded rows (issue 35).

Why: with every dynamic dimension at 1 (and 2 for the second size), a BERT or GPT-2 export was validated
on one or two tokens and an attention mask of random 0/1 values. Padding and long-range behaviour were
never exercised: a rewrite that mishandled a padded key, a row whose every key is masked, or positions
past the first few would pass. This sample adds, for a model with token inputs (integer inputs that index
an embedding, :func:`token_inputs`), a batch of three rows at :data:`LENGTHS`' first length the original
runs at (128, else 64, 32, 16: a model's position table bounds it), and fills its 2-D integer or bool
inputs named like a mask with real padding: row 0 keeps every token, row 1 is right-padded (its last
quarter dropped), row 2 left-padded (its first quarter dropped; a causal model then has query rows that
see no key, the case exporters guard with ``Where(IsNaN)``). With ``--right-padded NAME`` that mask's
rows are all right-padded, as promised.

Not added when the user gives inputs or sizes for a token input (``--inputs``, ``--shape``), when the
sequence dimension is static, or for models whose sizes are derived from dimension relations (KV-cache
decoders: their prefill and decode samples already exercise lengths and padding).
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.runtime.inputs import input_specs, random_inputs, value_ranges

#: sequence lengths tried in order; the first the original model runs at is kept
LENGTHS = (128, 64, 32, 16)
ROWS = 3


def token_inputs(model: onnx.ModelProto, ranges: dict) -> list[str]:
    """Rank-2 integer inputs whose values index an embedding (``ranges``: what
    :func:`~onnxfuse.runtime.inputs.value_ranges` implied, the ``Gather`` row counts)."""
    return [s.name for s in input_specs(model) if len(s.shape) == 2 and np.issubdtype(s.dtype, np.integer)
            and s.name in ranges and ranges[s.name].indexes]


def _is_mask(spec, tokens) -> bool:
    return (spec.name not in tokens and len(spec.shape) == 2 and "mask" in spec.name.lower()
            and (np.issubdtype(spec.dtype, np.integer) or spec.dtype == np.bool_))


def realistic_sample(model: onnx.ModelProto, length: int, seed: int, right_padded=(), shapes=None):
    """Three rows of ``length`` tokens with padded masks (module docstring), as an
    :class:`~onnxfuse.runtime.inputs.Inputs`; None when the model has no token input with a dynamic
    sequence dimension, or ``shapes`` (the user's ``--shape``) sizes one."""
    specs = input_specs(model)
    ranges, _ = value_ranges(model)
    tokens = token_inputs(model, ranges)
    if not tokens or any(t in (shapes or {}) for t in tokens):
        return None
    by_name = {s.name: s for s in specs}
    if all(isinstance(by_name[t].shape[1], int) for t in tokens):
        return None
    sized = {t: [ROWS if not isinstance(by_name[t].shape[0], int) else by_name[t].shape[0],
                 length if not isinstance(by_name[t].shape[1], int) else by_name[t].shape[1]] for t in tokens}
    draw = random_inputs(specs, {**(shapes or {}), **sized}, seed, ranges)
    padded = []
    for spec in specs:
        array = draw.feeds.get(spec.name)
        if array is None or not _is_mask(spec, tokens) or array.ndim != 2 or array.shape[1] < 4:
            continue
        rows, cols = array.shape
        mask = np.ones((rows, cols), dtype=array.dtype)
        quarter = max(1, cols // 4)
        if rows > 1:
            mask[1, cols - quarter:] = 0
        if rows > 2:
            if spec.name in right_padded:
                mask[2, cols - 2 * quarter:] = 0
            else:
                mask[2, :quarter] = 0
        draw.feeds[spec.name] = mask
        padded.append(spec.name)
    shown = ", ".join(f"{t} {'x'.join(map(str, draw.feeds[t].shape))}" for t in tokens)
    draw.notes = [f"a realistic sample: {shown} tokens"
                  + (f", {', '.join(padded)} with a full, a right-padded and a "
                     f"{'right' if set(padded) & set(right_padded) else 'left'}-padded row" if padded else "")]
    return draw


__all__ = ["LENGTHS", "realistic_sample", "token_inputs"]
