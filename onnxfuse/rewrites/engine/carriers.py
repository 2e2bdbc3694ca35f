"""A tensor's dimension, carried on the device without reading a shape (the CPU-free twin of
``Gather(Shape(T), k)``), for rules that remove Shape chains (expand-by-broadcast, range-by-cumsum).

Why: ONNX Runtime runs ``Shape`` chains on the CPU and will not capture a CUDA graph of a model that has
any. A rule that needs "a tensor with T's dimension k" can slice T itself instead: the slice has T's
dimension k at run time, whatever the declared names say.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import new_constant
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import constant_value, dtype_of, is_op, producer_of, shape_of


def carrier_problem(graph, tensor, axis: int) -> Refuse | None:
    """Why ``tensor`` cannot carry its dimension ``axis`` (:func:`carrier_cond`), or None: it must be
    numeric or bool (``Equal`` reads it) and its other dimensions static positive sizes (the slice must
    have exactly one element per index; a zero-size axis would make it empty). The reason is a predicate
    ("is not numeric ..."): the caller's sentence names the tensor."""
    kind = dtype_of(graph, tensor)
    if kind is None or kind.kind not in "biuf":
        return Refuse("is not numeric or bool (Equal cannot read it)")
    dims = shape_of(graph, tensor)
    if dims is None or not all(isinstance(d, int) and d > 0 for i, d in enumerate(dims) if i != axis):
        return Refuse("has other dimensions that are not static positive sizes")
    return None


def carrier_cond(graph, names, base: str, tensor, axis: int, rank: int, position: int):
    """A bool tensor of rank ``rank``, 1 everywhere except ``tensor``'s dimension ``axis`` at ``position``,
    computed on the device without reading a shape: ``Equal(c, c)`` of ``c = Reshape(Slice(tensor,
    one element on every other axis))``. Its values are meaningless (False where c is NaN); only its
    shape is used, to broadcast by ``Where(cond, x, x)``. Check :func:`carrier_problem` first."""
    dims = shape_of(graph, tensor)
    ends = [1] * len(dims)
    ends[axis] = np.iinfo(np.int64).max
    piece = gs.Variable(names(f"{base}/carrier"), dtype=tensor.dtype)
    graph.nodes.append(gs.Node("Slice", names(f"{base}/carrier_slice"), inputs=[
        tensor, new_constant(graph, f"{base}/starts", np.zeros(len(dims), np.int64)),
        new_constant(graph, f"{base}/ends", np.array(ends, np.int64))], outputs=[piece]))
    placed_shape = [1] * rank
    placed_shape[position] = -1
    placed = gs.Variable(names(f"{base}/carrier_placed"), dtype=tensor.dtype)
    graph.nodes.append(gs.Node("Reshape", names(f"{base}/carrier_reshape"), inputs=[
        piece, new_constant(graph, f"{base}/placed_shape", np.array(placed_shape, np.int64))], outputs=[placed]))
    cond = gs.Variable(names(f"{base}/carrier_cond"), dtype=np.bool_)
    graph.nodes.append(gs.Node("Equal", names(f"{base}/carrier_equal"), inputs=[placed, placed], outputs=[cond]))
    return cond


def _scalar(graph, tensor):
    value = constant_value(graph, tensor)
    return None if value is None or value.size != 1 else value.reshape(-1)[0].item()


def dimension_source(graph, tensor, depth: int = 8):
    """(T, k) when ``tensor`` is ``Gather(Shape(T), k)`` (Shape's start applied) through integer Casts,
    Squeeze, Reshape and Identity; else None."""
    for _ in range(depth):
        p = producer_of(tensor)
        if is_op(p, "Identity", "Squeeze", "Reshape") or (is_op(p, "Cast") and int(p.attrs.get("to", 0)) in (6, 7)):
            tensor = p.inputs[0]
            continue
        if is_op(p, "Gather") and int(p.attrs.get("axis", 0)) == 0 and len(p.inputs) == 2:
            shape = producer_of(p.inputs[0])
            k = _scalar(graph, p.inputs[1])
            if not is_op(shape, "Shape") or not isinstance(k, int) or "end" in shape.attrs:
                return None
            rank = len(shape_of(graph, shape.inputs[0]) or [])
            k = k + int(shape.attrs.get("start", 0) or 0) if k >= 0 else None
            return (shape.inputs[0], k) if k is not None and 0 <= k < rank else None
        return None
    return None
