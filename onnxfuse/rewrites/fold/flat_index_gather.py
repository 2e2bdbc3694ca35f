"""``Gather(data, b·L + l)`` over an index grid that is ``arange(B·L)`` in order becomes a ``Slice``.

Why
---
transformers 5 builds a key padding mask by indexing: ``padding_mask[batch_idx, kv_idx]`` exports as
``Gather(Flatten(mask), Range(0, B)[:, None, None, None] · S + Range(0, S)[None, None, None, :])``.
The index grid is integer arithmetic over two ``Range``s: CPU nodes whose result ONNX Runtime copies
to the GPU at every inference, or, after range-by-cumsum, about five small kernels; then the Gather.
With the grid read as what it is, one ``Slice`` (a copy) does the same. On BERT-base with a dynamic
sequence axis it is the mask chain contrib-attention keeps (docs/benchmarks.md 5.10/5.11: the chain's
kernels are what is left of the batch-16 gap to ONNX Runtime's transformers optimizer).

What (exact)
------------
The indices are ``Add(Mul(outer, C), inner)`` (either operand order), where ``inner`` and ``outer``
are ``Range(0, L, 1)`` and ``Range(0, B, 1)`` moved by ``Unsqueeze`` alone to axes j and i of the
same rank R with i < j (every other axis 1; either may also be a constant holding 0 … L-1 along one
axis, a static length's Range folded), and the scalar C is provably L
(:func:`~onnxfuse.rewrites.engine.shape_values.shape_value`: the same dimension of the same tensor, or
the same constant). Then entry (…, b, …, l, …) is b·L + l, the row-major position of (b, l) in a
[B, L] grid: the indices are ``arange(B·L)`` reshaped, and ``Gather(data, indices, axis=0)`` is
``Reshape(Slice(data, 0, B·L), grid shape + data's other dimensions)``, whenever the original runs
(B·L beyond data's first dimension makes the original's Gather fail; the Slice would stop at the end).
B and L are the Ranges' own limits (sizes, so ≥ 0), read where the original read them. A ``Shape`` of
the indices (transformers reshapes the result to it) becomes the Concat of those dimensions, so
nothing computes the grid any more.

Only where the length is dynamic (the inner index a ``Range`` at run time): its size arithmetic is on
the CPU then anyway, and nothing is lost. With a static length the grid is left to range-by-cumsum,
which computes it on the device: the ``Slice`` here reads B·L on the CPU, and one CPU node is enough
for ONNX Runtime to refuse a CUDA graph of the model.

Refused, with the reason: a static length (above); another Gather axis; indices not of that form; C not provably L; the outer
Range on a later axis than the inner one; limits not provably non-negative; an opset below 13
(Unsqueeze with axes as an input).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.facts import (
    axes_of, constant_value, dtype_of, is_op, is_whole_shape_read, opset_of, producer_of, provably_nonnegative,
    rank_of, unit_range_limit,
)
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.engine.shape_values import shape_value


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
    """``(limit, axis, rank)`` when ``tensor`` is ``Range(0, limit, 1)`` moved by Unsqueezes (constant
    axes) to ``axis`` of a rank-``rank`` tensor whose other dimensions are 1, or such a constant (the
    limit is then an int); else None."""
    folded = _constant_arange(graph, tensor)
    if folded is not None:
        return folded
    chain = []
    while True:
        p = producer_of(tensor)
        if is_op(p, "Unsqueeze") and p.inputs:
            chain.append(p)
            tensor = p.inputs[0]
        else:
            break
    limit = unit_range_limit(graph, p)
    if limit is None:
        return None
    axis, rank = 0, 1
    for u in reversed(chain):  # from the Range outwards
        axes = axes_of(graph, u)
        if axes is None:
            return None
        rank += len(axes)
        for a in sorted(a % rank for a in axes):
            if a <= axis:
                axis += 1
    return limit, axis, rank


def _same_size(graph, a, b) -> bool:
    """Whether the 0-D/1-element integer tensors (or ints) ``a`` and ``b`` provably hold the same size."""
    va, vb = ([v] if isinstance(v, int) else shape_value(graph, v) for v in (a, b))
    if va is None or vb is None or len(va) != 1 or len(vb) != 1:
        return False
    (x,), (y,) = va, vb
    if isinstance(x, str) or isinstance(y, str):
        same_source = getattr(x, "tensor", None) is getattr(y, "tensor", None) is not None
        return isinstance(x, str) and isinstance(y, str) and same_source and x.axis == y.axis
    return int(x) == int(y)


class FlatIndexGather(Rule):
    """Gather(data, Range(0, B)·L + Range(0, L) on two axes) → Reshape(Slice(data, 0, B·L))."""

    name = "flat-index-gather"
    description = "Gather over an index grid b·L + l (transformers 5's mask[batch_idx, kv_idx]) → Slice + Reshape"
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Gather") and len(node.inputs) == 2 and is_op(producer_of(node.inputs[1]), "Add"):
                yield node

    def check(self, graph, gather):
        if int(gather.attrs.get("axis", 0)) != 0:
            return Refuse("not a Gather on axis 0")
        if opset_of(graph) < 13:
            return Refuse("opset below 13 (Unsqueeze takes its axes as an input)")
        data_rank = rank_of(graph, gather.inputs[0])
        if data_rank is None or data_rank < 1:
            return Refuse("the data's rank is not known")
        add = producer_of(gather.inputs[1])
        found = None
        for mul_side, inner_side in (add.inputs, add.inputs[::-1]):
            mul, inner = producer_of(mul_side), placed_range(graph, inner_side)
            if not is_op(mul, "Mul") or inner is None or len(mul.inputs) != 2:
                continue
            for outer_side, factor in (mul.inputs, mul.inputs[::-1]):
                outer = placed_range(graph, outer_side)
                if outer is not None:
                    found = (outer, inner, factor)
                    break
            if found:
                break
        if found is None:
            return Refuse("the indices are not Range(0, B)·L + Range(0, L) moved by Unsqueezes")
        (b_limit, i, rank_o), (l_limit, j, rank_i), factor = found
        if isinstance(l_limit, int):
            return Refuse("a static length (the inner Range folded): range-by-cumsum keeps that grid on the device, "
                          "which CUDA graphs need, where this rule's Slice would read B·L on the CPU")
        if rank_o != rank_i or i >= j:
            return Refuse("the batch Range is not on an earlier axis of the same rank as the inner one")
        if not _same_size(graph, factor, l_limit):
            return Refuse("the multiplier is not provably the inner Range's length")
        for limit in (b_limit, l_limit):
            if isinstance(limit, int):
                continue
            if not provably_nonnegative(graph, limit):
                return Refuse("a Range limit is not provably a size (non-negative)")
            if dtype_of(graph, limit) not in (np.dtype(np.int64), np.dtype(np.int32)):
                return Refuse("a Range limit is not int32/int64")
        return Plan(gather, (b_limit, i, l_limit, j, rank_o, data_rank))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        gather = plan.anchor
        b_limit, i, l_limit, j, rank, data_rank = plan.found
        names = NameAllocator(graph)
        base = gather.name or gather.outputs[0].name

        def as_int64_1d(limit, tag):
            if isinstance(limit, int):
                return new_constant(graph, f"{base}/{tag}", np.array([limit], np.int64))
            t = limit
            if dtype_of(graph, t) != np.dtype(np.int64):
                wide = gs.Variable(names(f"{base}/{tag}_int64"), dtype=np.int64)
                graph.nodes.append(gs.Node("Cast", names(f"{base}/{tag}_cast"), {"to": 7}, inputs=[t], outputs=[wide]))
                t = wide
            one_d = gs.Variable(names(f"{base}/{tag}_1d"), dtype=np.int64, shape=[1])
            graph.nodes.append(gs.Node("Reshape", names(f"{base}/{tag}_reshape"), inputs=[
                t, new_constant(graph, f"{base}/one_element", np.array([1], np.int64))], outputs=[one_d]))
            return one_d

        b1, l1 = as_int64_1d(b_limit, "batch"), as_int64_1d(l_limit, "length")
        count = gs.Variable(names(f"{base}/count"), dtype=np.int64, shape=[1])
        graph.nodes.append(gs.Node("Mul", names(f"{base}/count"), inputs=[b1, l1], outputs=[count]))
        data = gather.inputs[0]
        sliced = gs.Variable(names(f"{base}/rows"), dtype=data.dtype)
        zero = new_constant(graph, f"{base}/zero", np.array([0], np.int64))
        graph.nodes.append(gs.Node("Slice", names(f"{base}/rows"), inputs=[data, zero, count, zero], outputs=[sliced]))
        unit = new_constant(graph, f"{base}/unit", np.array([1], np.int64))
        pieces = [b1 if k == i else l1 if k == j else unit for k in range(rank)]
        indices = gather.inputs[1]
        for reader in [n for n in indices.outputs if is_whole_shape_read(n)]:  # the grid's shape, not the grid
            shape = reader.outputs[0]
            reader.outputs.clear()
            reader.inputs.clear()
            graph.nodes.append(gs.Node("Concat", names(f"{base}/grid_shape"), {"axis": 0}, inputs=list(pieces),
                                       outputs=[shape]))
        if data_rank > 1:  # data's other dimensions, after the grid's
            rest = gs.Variable(names(f"{base}/data_dims"), dtype=np.int64, shape=[data_rank - 1])
            if opset_of(graph) >= 15:
                graph.nodes.append(gs.Node("Shape", names(f"{base}/data_shape"), {"start": 1}, inputs=[data],
                                           outputs=[rest]))
            else:
                full = gs.Variable(names(f"{base}/data_shape"), dtype=np.int64, shape=[data_rank])
                graph.nodes.append(gs.Node("Shape", names(f"{base}/data_shape"), inputs=[data], outputs=[full]))
                graph.nodes.append(gs.Node("Slice", names(f"{base}/data_rest"), inputs=[
                    full, new_constant(graph, f"{base}/one", np.array([1], np.int64)),
                    new_constant(graph, f"{base}/end", np.array([np.iinfo(np.int64).max], np.int64))],
                    outputs=[rest]))
            pieces.append(rest)
        target = gs.Variable(names(f"{base}/target"), dtype=np.int64, shape=[rank + data_rank - 1])
        graph.nodes.append(gs.Node("Concat", names(f"{base}/target"), {"axis": 0}, inputs=pieces, outputs=[target]))
        out = gather.outputs[0]
        gather.outputs.clear()
        gather.inputs.clear()
        graph.nodes.append(gs.Node("Reshape", names(f"{base}/grid"), inputs=[sliced, target], outputs=[out]))
        return {"node": gather.name, "batch_axis": i, "length_axis": j}
