"""``Gather(data, b·L + l)`` over an index grid that is ``arange(B·L)`` in order becomes a ``Slice`` (with a
static L, a ``GatherElements`` of the data's rows).

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
The indices are ``Add(Mul(outer, C), inner)`` (either operand order; or that, int32 or int64, cast to int64), where ``inner`` and ``outer``
are ``Range(0, L, 1)`` and ``Range(0, B, 1)`` moved by ``Unsqueeze`` alone to axes j and i of the
same rank R with i < j (every other axis 1; either may also be a constant holding 0 … L-1 along one
axis, a static length's Range folded), and the scalar C is provably L
(:func:`~onnxfuse.rewrites.facts.shape_values.shape_value`: the same dimension of the same tensor, or
the same constant). Then entry (…, b, …, l, …) is b·L + l, the row-major position of (b, l) in a
[B, L] grid: the indices are ``arange(B·L)`` reshaped, and ``Gather(data, indices, axis=0)`` is
``Reshape(Slice(data, 0, B·L), grid shape + data's other dimensions)``, whenever the original runs
(B·L beyond data's first dimension makes the original's Gather fail, as the ONNX spec and ONNX Runtime's
CPU kernel have it, where its CUDA kernel writes 0; the Slice would stop at the end and the Reshape fail).
B and L are the Ranges' own limits (sizes, so ≥ 0), read where the original read them. A ``Shape`` of
the indices (transformers reshapes the result to it) becomes the Concat of those dimensions, so
nothing computes the grid any more.

**A static length** (the inner Range folded to a constant holding 0 … L-1) takes another form, because the
``Slice`` above reads B·L on the CPU, and one CPU node is enough for ONNX Runtime to refuse a CUDA graph
of the model. When the data is X [R, L] flattened row-major (``Flatten`` at axis 2, or a ``Reshape`` to
[-1] or [-1, 1]; transformers' ``mask.flatten()`` of the [B, L] key mask, whose L ONNX Runtime checks
as a static input dimension), flat position b·L + l is X[b, l], and the Gather is
``Reshape(GatherElements(X, idx, axis=1), [1 …, -1 at i, …, L at j, …])`` with ``idx[b, l] = l`` of
shape [B, L]: ``Where(cond, arange(L), arange(L))``, ``cond`` carrying B on the device
(:func:`~onnxfuse.rewrites.engine.carriers.carrier_cond`, the tensor whose shape gave B). Both fail
when B > R (the original's Gather reads past the data, an error by the ONNX spec and in ONNX Runtime's
CPU kernel, while its CUDA kernel writes 0 there; ONNX Runtime's GatherElements rejects an index shape
larger than the data's off its axis, on both). On static-sequence BERT-base (docs/benchmarks.md 5.12) the
grid goes from 6 small kernels (range-by-cumsum's ``Slice``/``Equal``/``Where``/``CumSum``, the index
arithmetic, the Gather) to 3 (the carrier ``Slice``, the fused ``Where``, ``GatherElements``); with the
mask's two Casts, 8 → 5 (Nsight Compute, docs/benchmarks.md 5.12).

Refused, with the reason: a static length over data that is not such a flattened [R, L] tensor (above),
or whose batch size is not a tensor's dimension; a constant grid; another Gather axis; indices not of
that form; C not provably L; the outer Range on a later axis than the inner one; limits not provably non-negative; an opset below 13
(Unsqueeze with axes as an input).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.carriers import (
    carrier_cond,
    carrier_problem,
    dimension_source,
)
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import (
    constant_value,
    dtype_of,
    is_op,
    is_whole_shape_read,
    opset_of,
    producer_of,
    provably_nonnegative,
    rank_of,
    shape_of,
)
from onnxfuse.rewrites.facts.shape_values import shape_value
from onnxfuse.rewrites.fold.index_grid import placed_range


def _index_sum(graph, indices):
    """The node computing ``indices``, seen through one ``Cast`` to int64 of an int32/int64 value (exact)."""
    p = producer_of(indices)
    if is_op(p, "Cast") and int(p.attrs.get("to", 0)) == 7 and p.inputs \
            and dtype_of(graph, p.inputs[0]) in (np.dtype(np.int32), np.dtype(np.int64)):
        p = producer_of(p.inputs[0])
    return p


def _flattened_rows(graph, data, length: int):
    """X when ``data`` is X [R, length] (a static last dimension) flattened row-major to [R·length] or
    [R·length, 1] (``Flatten`` at axis 2, or ``Reshape`` to a constant [-1] or [-1, 1]): entry p of
    ``data`` is then X[p // length, p % length]; else None."""
    p = producer_of(data)
    if is_op(p, "Flatten") and p.inputs:
        source = p.inputs[0]
        rank = rank_of(graph, source)
        axis = int(p.attrs.get("axis", 1))
        if rank is None or (axis + rank if axis < 0 else axis) != rank:
            return None
    elif is_op(p, "Reshape") and len(p.inputs) == 2:
        source, target = p.inputs[0], constant_value(graph, p.inputs[1])
        if target is None or target.tolist() not in ([-1], [-1, 1]):
            return None
    else:
        return None
    dims = shape_of(graph, source)
    return source if dims is not None and len(dims) == 2 and dims[1] == length else None


def _reshape_into(graph, names, base, gather, values, target) -> None:
    """The Gather's output becomes ``Reshape(values, target)``; the Gather is disconnected."""
    out = gather.outputs[0]
    gather.outputs.clear()
    gather.inputs.clear()
    graph.nodes.append(gs.Node("Reshape", names(f"{base}/grid"), inputs=[values, target], outputs=[out]))


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
    description = ("Gather over an index grid b·L + l (transformers 5's mask[batch_idx, kv_idx]) → Slice + Reshape, "
                   "or GatherElements of the rows for a static L")
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Gather") and len(node.inputs) == 2 and is_op(_index_sum(graph, node.inputs[1]), "Add"):
                yield node

    def check(self, graph, gather):
        if int(gather.attrs.get("axis", 0)) != 0:
            return Refuse("not a Gather on axis 0")
        if opset_of(graph) < 13:
            return Refuse("opset below 13 (Unsqueeze takes its axes as an input)")
        data_rank = rank_of(graph, gather.inputs[0])
        if data_rank is None or data_rank < 1:
            return Refuse("the data's rank is not known")
        add = _index_sum(graph, gather.inputs[1])
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
        rows = None
        if isinstance(l_limit, int):  # a static length: the rows form, on the device
            if isinstance(b_limit, int):
                return Refuse("a constant grid (fold-constants' work)")
            rows = _flattened_rows(graph, gather.inputs[0], l_limit)
            if rows is None:
                return Refuse("a static length, and the data is not a [rows, L] tensor flattened row-major "
                              "(the rows form needs it; the Slice form would read B·L on the CPU, which costs "
                              "CUDA graphs)")
            source = dimension_source(graph, b_limit)
            if source is None:
                return Refuse("the batch Range's limit is not traced to a tensor's dimension (Gather(Shape(T), k))")
            problem = carrier_problem(graph, *source)
            if problem:
                return Refuse(f"the tensor whose shape gives the batch size {problem.reason}")
            rows = (rows, source)
        return Plan(gather, (b_limit, i, l_limit, j, rank_o, data_rank, rows))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        gather = plan.anchor
        b_limit, i, l_limit, j, rank, data_rank, rows = plan.found
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

        readers = [n for n in gather.inputs[1].outputs if is_whole_shape_read(n)]  # the grid's shape, not the grid
        if readers or rows is None:  # sizes read on the CPU: the grid's Shape, the Slice form's count
            b1, l1 = as_int64_1d(b_limit, "batch"), as_int64_1d(l_limit, "length")
            unit = new_constant(graph, f"{base}/unit", np.array([1], np.int64))
            pieces = [b1 if k == i else l1 if k == j else unit for k in range(rank)]
        for reader in readers:
            shape = reader.outputs[0]
            reader.outputs.clear()
            reader.inputs.clear()
            graph.nodes.append(gs.Node("Concat", names(f"{base}/grid_shape"), {"axis": 0}, inputs=list(pieces),
                                       outputs=[shape]))
        if rows is not None:
            self._rows_form(graph, names, base, gather, rows, i, j, l_limit, rank + data_rank - 1)
            return {"node": gather.name, "batch_axis": i, "length_axis": j, "form": "rows"}
        count = gs.Variable(names(f"{base}/count"), dtype=np.int64, shape=[1])
        graph.nodes.append(gs.Node("Mul", names(f"{base}/count"), inputs=[b1, l1], outputs=[count]))
        data = gather.inputs[0]
        sliced = gs.Variable(names(f"{base}/rows"), dtype=data.dtype)
        zero = new_constant(graph, f"{base}/zero", np.array([0], np.int64))
        graph.nodes.append(gs.Node("Slice", names(f"{base}/rows"), inputs=[data, zero, count, zero], outputs=[sliced]))
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
        _reshape_into(graph, names, base, gather, sliced, target)
        return {"node": gather.name, "batch_axis": i, "length_axis": j, "form": "slice"}

    @staticmethod
    def _rows_form(graph, names, base, gather, rows, i, j, length, out_rank):
        """``Reshape(GatherElements(X, idx, axis=1), grid shape + data's unit dims)`` with ``idx[b, l] = l``
        of shape [B, L], B carried on the device by the tensor whose shape gave it (no CPU node)."""
        source, (tensor, axis) = rows
        cond = carrier_cond(graph, names, base, tensor, axis, 2, 0)  # [B, 1]
        columns = new_constant(graph, f"{base}/columns", np.arange(length, dtype=np.int64)[None])  # [1, L]
        idx = gs.Variable(names(f"{base}/row_columns"), dtype=np.int64)
        graph.nodes.append(gs.Node("Where", names(f"{base}/row_columns"), inputs=[cond, columns, columns],
                                   outputs=[idx]))
        picked = gs.Variable(names(f"{base}/row_entries"), dtype=source.dtype)
        graph.nodes.append(gs.Node("GatherElements", names(f"{base}/row_entries"), {"axis": 1},
                                   inputs=[source, idx], outputs=[picked]))
        target = np.ones(out_rank, np.int64)
        target[i], target[j] = -1, length
        _reshape_into(graph, names, base, gather, picked, new_constant(graph, f"{base}/grid_target", target))
