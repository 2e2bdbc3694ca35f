"""``GatherND(data, stack(grid₀, grid₁, …))`` over ``Range`` grids becomes a ``Slice`` of the data.

Why
---
transformers 5 builds a padding mask by indexing, ``padding_mask[batch_idx, kv_idx]``; torch's dynamo
exporter writes it as ``GatherND(mask, Concat(Unsqueeze(Expand(b, G), -1), Unsqueeze(Expand(l, G), -1)))``
with ``b = Range(0, B)`` and ``l = Range(0, L)`` moved to two axes of the grid shape G = [B, 1, 1, L]
(``Max`` of the two read only for its ``Shape``). That is eight kernels and a CPU size chain at every
inference for what is a view of the mask. (The TorchScript exporter writes the same indexing as a flat
``Gather``: flat-index-gather.) With contrib-embed-layernorm's declared-name bound, BERT-base's dynamo
export went from 115 to 98 nodes (docs/benchmarks.md 5.13; the mask chain: Cast, Slice, Reshape,
Flatten, Cast).

What (exact)
------------
``GatherND(data, idx)`` with ``batch_dims`` 0, data of rank R, ``idx = Concat(u₀, …, u_{R-1}, axis=-1)``,
each ``u_k = Unsqueeze(Expand(r_k, s_k), [-1])`` (or without the Expand) where r_k is ``Range(0, n_k, 1)``
placed along axis a_k of the grid's rank, every other dimension 1 (of a lower rank under an Expand,
which prepends ones; :func:`~onnxfuse.rewrites.fold.index_grid.placed_range`), with a₀ < a₁ < … and the output's every other axis statically 1 (so the
Expands only broadcast the Ranges against each other). Entry g of the output is then
``data[g[a₀], …, g[a_{R-1}]]`` with g[a_k] over 0 … n_k-1: the output is ``data[:n₀, …, :n_{R-1}]``
with axes of 1 inserted, value for value: ``Reshape(Slice(data, 0, n_k on the axes k where n_k is not
provably data's own dimension k), grid shape)``, the grid shape built from the n_k and ones (just
``Unsqueeze(data, other axes)`` when no axis is sliced). "Provably": n_k is read by a Shape chain from
data (or the tensor a Cast made it from) at axis k, or both are the same static size.

Where n_k exceeds data's dimension k the original's GatherND reads out of bounds (an error by the ONNX
spec and in ONNX Runtime's CPU kernel); the Slice stops at the end and the Reshape to the grid's sizes
then fails on the element count: both fail. A Slice bound n_k comes from the Range's own limit, a size
read on the CPU as the original read it.

Refused, with the reason: a Range limit not provably a size (≥ 0: a negative Slice end counts from the
back, where the original's Range is empty), other ``batch_dims``, an index that is not such a stack of
placed Ranges, grid axes out of order or repeated, an output axis outside the grid that is not provably
1, an opset below 13.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import axes_of, is_op, opset_of, producer_of, provably_nonnegative, shape_of
from onnxfuse.rewrites.facts.shape_values import SourcedDim, shape_value
from onnxfuse.rewrites.fold.index_grid import placed_range


def _last_axis_unsqueeze(graph, node, rank: int) -> bool:
    axes = axes_of(graph, node) if is_op(node, "Unsqueeze") else None
    return axes is not None and len(axes) == 1 and axes[0] % (rank + 1) == rank


def _own_dimension(graph, data, k: int, limit) -> bool:
    """The Range limit ``limit`` is provably data's dimension k (read from data, or from the tensor a
    Cast made data from, at axis k; or the same static size)."""
    shape = shape_of(graph, data)
    value = [int(limit)] if isinstance(limit, (int, np.integer)) else shape_value(graph, limit)
    if value is None or len(value) != 1:
        return False
    (dim,) = value
    if isinstance(dim, (int, np.integer)):
        return shape is not None and isinstance(shape[k], int) and shape[k] == int(dim)
    if not isinstance(dim, SourcedDim) or dim.axis != k:
        return False
    cast = producer_of(data)
    return dim.tensor is data or (is_op(cast, "Cast") and dim.tensor is cast.inputs[0])


class GatherndIndexGrid(Rule):
    """GatherND(data, stack of Range grids) → Unsqueeze(Slice(data, 0, n_k), other axes)."""

    name = "gathernd-index-grid"
    description = "GatherND over a stack of Range index grids (transformers 5's mask[b, kv], dynamo) becomes a Slice"
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "GatherND") and len(node.inputs) == 2 and is_op(producer_of(node.inputs[1]), "Concat"):
                yield node

    def check(self, graph, gather):
        if opset_of(graph) < 13:
            return Refuse("opset below 13 (Unsqueeze and Slice take their axes as inputs)")
        if int(gather.attrs.get("batch_dims", 0)) != 0:
            return Refuse("batch_dims is not 0")
        data, idx = gather.inputs
        concat = producer_of(idx)
        data_shape, out_shape = shape_of(graph, data), shape_of(graph, gather.outputs[0])
        if data_shape is None or out_shape is None or len(concat.inputs) != len(data_shape):
            return Refuse("the index does not stack one grid per data axis, or ranks are unknown")
        rank = len(out_shape)
        if int(concat.attrs.get("axis", 0)) % (rank + 1) != rank:
            return Refuse("the grids are not stacked along a new last axis")
        limits, axes = [], []
        for part in concat.inputs:
            unsqueeze = producer_of(part)
            if not _last_axis_unsqueeze(graph, unsqueeze, rank):
                return Refuse("a grid is not Unsqueeze(·, -1) of a placed Range")
            grid = unsqueeze.inputs[0]
            expand = producer_of(grid)
            if is_op(expand, "Expand"):
                grid = expand.inputs[0]
            placed = placed_range(graph, grid)
            # an Expand broadcasts a lower rank as numpy does: ones prepended, the Range's axis moves right
            if placed is None or placed[2] > rank or (placed[2] < rank and not is_op(expand, "Expand")):
                return Refuse("a grid is not Range(0, n, 1) along one axis of the grid's rank")
            if not isinstance(placed[0], (int, np.integer)) and not provably_nonnegative(graph, placed[0]):
                return Refuse("a grid's Range limit is not provably a size (>= 0): a negative end would slice from the back")
            limits.append(placed[0])
            axes.append(placed[1] + rank - placed[2])
        if axes != sorted(set(axes)):
            return Refuse(f"the grids' axes {axes} are not increasing")
        others = [a for a in range(rank) if a not in axes]
        if any(out_shape[a] != 1 for a in others):
            return Refuse("an output axis outside the grids is not provably 1 (the Expands would repeat values)")
        sliced = [(k, limit) for k, limit in enumerate(limits) if not _own_dimension(graph, data, k, limit)]
        return Plan(gather, (sliced, others, limits, axes))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        gather = plan.anchor
        sliced, others, limits, axes = plan.found
        names = NameAllocator(graph)
        base = gather.name or "gathernd"
        data = gather.inputs[0]
        out = gather.outputs[0]
        gather.outputs.clear()
        gather.inputs.clear()
        if not sliced:  # every grid spans its data axis: the data itself, with the grid's axes of 1
            graph.nodes.append(gs.Node("Unsqueeze", names(f"{base}/grid"), inputs=[
                data, new_constant(graph, f"{base}/grid_axes", np.array(others, np.int64))], outputs=[out]))
            return {"node": gather.name, "sliced_axes": [], "inserted_axes": others}
        one = new_constant(graph, f"{base}/one", np.array([1], np.int64))
        sizes = {k: self._one_element(graph, names, base, k, limit, one) for k, limit in enumerate(limits)}
        ends = [sizes[k] for k, _ in sliced]
        if len(ends) > 1:
            ends = [self._concat(graph, names, f"{base}/ends", ends)]
        rows = gs.Variable(names(f"{base}/rows"), dtype=data.dtype)
        graph.nodes.append(gs.Node("Slice", names(f"{base}/rows"), inputs=[
            data, new_constant(graph, f"{base}/starts", np.zeros(len(sliced), np.int64)), ends[0],
            new_constant(graph, f"{base}/axes", np.array([k for k, _ in sliced], np.int64))], outputs=[rows]))
        # Reshaped to the grid's own sizes, not unsqueezed: a Slice clamped at the data's end (more grid
        # rows than data rows) then has too few elements and the Reshape fails, as the original GatherND does
        by_axis = {axis: sizes[k] for k, axis in enumerate(axes)}
        target = self._concat(graph, names, f"{base}/grid_shape",
                              [by_axis.get(a, one) for a in range(len(axes) + len(others))])
        graph.nodes.append(gs.Node("Reshape", names(f"{base}/grid"), inputs=[rows, target], outputs=[out]))
        return {"node": gather.name, "sliced_axes": [k for k, _ in sliced], "inserted_axes": others}

    @staticmethod
    def _one_element(graph, names, base, k, limit, one):
        """The Range limit (a 0-D size, or a static int) as a 1-element int64 tensor."""
        if isinstance(limit, (int, np.integer)):
            return new_constant(graph, f"{base}/size{k}", np.array([int(limit)], np.int64))
        size = gs.Variable(names(f"{base}/size{k}"), dtype=np.int64)
        graph.nodes.append(gs.Node("Reshape", names(f"{base}/size{k}"), inputs=[limit, one], outputs=[size]))
        return size

    @staticmethod
    def _concat(graph, names, name, parts):
        joined = gs.Variable(names(name), dtype=np.int64)
        graph.nodes.append(gs.Node("Concat", names(name), {"axis": 0}, inputs=list(parts), outputs=[joined]))
        return joined
