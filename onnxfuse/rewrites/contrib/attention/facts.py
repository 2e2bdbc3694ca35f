"""Small facts about the attention's path that several steps read: element-type Casts, scalar factors,
single readers.

**Scale**: scalar constants (finite, non-zero), each a Mul or a Div, on the scores, on the heads of q and
k (torch's D^-1/4 on each: constants once fold-constants evaluated the Shape→Sqrt chain), or on q or k
before the split (Whisper's ``q_proj(x)·D^-1/2``): all multiply the same QKᵀ, so their product is the
scale. A scale applied after a mask step is refused (it would scale the mask too).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.matmul import scale_of
from onnxfuse.rewrites.engine.polynomial import cast_target
from onnxfuse.rewrites.facts.graph import FP32, LOW_FLOATS, dtype_of, is_op, producer_of, sole_reader

def cast_types(graph, node) -> tuple[np.dtype, np.dtype] | None:
    """(input element type, target element type) of a Cast whose input type is known, else None."""
    if not is_op(node, "Cast") or len(node.inputs) != 1:
        return None
    source, target = dtype_of(graph, node.inputs[0]), cast_target(node)
    return None if source is None or target is None else (source, target)


def is_noop_cast(graph, node) -> bool:
    """A Cast to the element type its input already has: the identity."""
    types = cast_types(graph, node)
    return types is not None and types[0] == types[1]


def is_upcast(graph, node, low=None) -> bool:
    """A float16 (or bfloat16) → float32 Cast: exact (every float16 or bfloat16 value is a float32 value),
    the step into a float32 softmax island (:mod:`~onnxfuse.rewrites.contrib.attention.keep_masks`);
    ``low``: from that type only."""
    types = cast_types(graph, node)
    return (types is not None and types[1] == FP32 and types[0] in LOW_FLOATS
            and (low is None or types[0] == np.dtype(low)))


def downcast_type(graph, node) -> np.dtype | None:
    """The type a float32 → float16 (or bfloat16) Cast writes, the step out of a float32 softmax island
    (the attention's element type); None for any other node."""
    types = cast_types(graph, node)
    return types[1] if types is not None and types[0] == FP32 and types[1] in LOW_FLOATS else None


def scalar_factor(graph, node) -> tuple[float, gs.Tensor] | None:
    """(factor, other input) when ``node`` is x·c or x/c with c a finite, non-zero scalar constant
    (:func:`onnxfuse.rewrites.contrib.matmul.scale_of`, which FusedMatMul's scale folding uses too,
    minus the factors that would not survive a product: 0, ±inf, NaN)."""
    found = scale_of(graph, node, None)
    if found is None or not np.isfinite(found[0]) or found[0] == 0.0:
        return None
    return found[0], found[1]


def strip_scale(graph, tensor, nodes, factors):
    """Follow scalar Mul/Div and no-op Cast producers back from ``tensor``; collects their nodes and
    factors; returns the tensor before them."""
    while True:
        p = producer_of(tensor)
        if p is None:
            return tensor
        if is_noop_cast(graph, p):
            nodes.append(p)
            tensor = p.inputs[0]
            continue
        found = scalar_factor(graph, p)
        if found is None:
            return tensor
        factors.append(found[0])
        nodes.append(p)
        tensor = found[1]


def single_reader(graph, tensor) -> bool:
    """Read by exactly one node and not a graph output (removing its producer would orphan the output)."""
    return sole_reader(graph, tensor) is not None
