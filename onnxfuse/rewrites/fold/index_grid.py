"""Index grids, the fold family's shared (non-rule) helper: ``Range(0, n, 1)`` placed along one axis.

transformers 5 writes its masks as indexing (``mask[batch_idx, kv_idx]``) over grids built from
``Range`` and moved to an axis by ``Unsqueeze`` (or ``Reshape`` to a shape of ones but one entry);
flat-index-gather and gathernd-index-grid read such grids as what they are.
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.facts.graph import (
    axes_of,
    constant_value,
    is_op,
    producer_of,
    unit_range_limit,
)


def _constant_arange(graph, tensor):
    """``(L, axis, rank)`` when ``tensor`` is a constant holding 0, 1, …, L-1 (L >= 2) along one axis,
    every other dimension 1 (a static sequence's Range, folded); else None."""
    value = constant_value(graph, tensor)
    if value is None or value.ndim == 0 or not np.issubdtype(value.dtype, np.integer):
        return None
    long_axes = [k for k, d in enumerate(value.shape) if d != 1]
    if len(long_axes) != 1 or value.shape[long_axes[0]] < 2:
        return None
    length = value.shape[long_axes[0]]
    if not np.array_equal(value.reshape(-1), np.arange(length)):
        return None
    return length, long_axes[0], value.ndim


def placed_range(graph, tensor):
    """``(limit, axis, rank)`` when ``tensor`` is ``Range(0, limit, 1)`` moved to ``axis`` of a
    rank-``rank`` tensor whose other dimensions are 1, by Unsqueezes (constant axes) and Reshapes to a
    constant target of ones but one -1 (row-major, the values then run along the -1's axis in order), or
    such a constant (the limit is then an int); else None."""
    folded = _constant_arange(graph, tensor)
    if folded is not None:
        return folded
    chain = []
    while True:
        p = producer_of(tensor)
        if is_op(p, "Unsqueeze", "Reshape") and p.inputs:
            chain.append(p)
            tensor = p.inputs[0]
        else:
            break
    limit = unit_range_limit(graph, p)
    if limit is None:
        return None
    axis, rank = 0, 1
    for step in reversed(chain):  # from the Range outwards
        if is_op(step, "Reshape"):
            target = constant_value(graph, step.inputs[1]) if len(step.inputs) == 2 else None
            if target is None or target.ndim != 1 or sorted(target.tolist()) != [-1] + [1] * (target.size - 1):
                return None
            axis, rank = int(np.flatnonzero(target == -1)[0]), int(target.size)
            continue
        axes = axes_of(graph, step)
        if axes is None:
            return None
        rank += len(axes)
        for a in sorted(a % rank for a in axes):
            if a <= axis:
                axis += 1
    return limit, axis, rank
