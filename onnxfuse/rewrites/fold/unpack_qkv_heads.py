"""q, k and v cut from one packed [B, N, 3, H, D] tensor become three head splits of a Split.

Why
---
timm's vision transformers (ViT, DeiT, BEiT, EVA) and many models built on their ``Attention`` module
(PP-OCR's SVTR, for one) compute q, k and v with one Linear and cut them apart so::

    qkv = self.qkv(x).reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]          # or qkv.unbind(0)

which exports as ``Reshape(x, [b, n, 3, H, D])``, ``Transpose(perm=[2, 0, 3, 1, 4])`` and three
``Gather(axis=0)`` of the indices 0, 1, 2 (``unbind``: a ``Split`` on axis 0 in three, each part
``Squeeze``-d; the dynamo exporter's unbind: three ``Slice`` [i, i+1) on axis 0, each ``Squeeze``-d).
contrib-attention traces heads to the [B, S, E] tensor they were cut from only through
``Transpose(perm=[0, 2, 1, 3])(Reshape(·, [b, s, H, D]))`` (BERT's and GPT-2's split): these heads it
could only take "as given", which it refuses in float32 (measured slower there), so a timm transformer
kept every attention decomposed in float32. Written as GPT-2's form (a Split of the packed projection,
then each part's own head split), the attention is packed into ONNX Runtime's ``Attention`` with the
Linear's weight, as GPT-2's is.

What (exact)
------------
``x`` [B, N, 3E] (E = H·D static), ``R = Reshape(x, [t₀, t₁, 3, H, D])`` (constant target, allowzero 0),
``T = Transpose(R, perm=[2, 0, 3, 1, 4])`` read only by three part extractors, one per index i in
{0, 1, 2}: ``Gather(T, i, axis=0)`` with a scalar i, ``Squeeze(P_i, axes=[0])`` of part i of a
``Split(T, axis=0)`` in three parts of 1, or ``Squeeze(Slice(T, [i], [i + 1], axes=[0]), axes=[0])``.
Element (b, n, j, h, d) of R is x[b, n, j·E + h·D + d]; T puts it at (j, b, h, n, d), and part i holds (b, h, n, d) = x[b, n, i·E + h·D + d]. The rewrite: ``Split(x,
[E, E, E], axis=-1)``, part x_i [B, N, E] with x_i[b, n, e] = x[b, n, i·E + e]; ``Reshape(x_i, [t₀, t₁,
H, D])`` gives (b, n, h, d) = x_i[b, n, h·D + d]; ``Transpose(perm=[0, 2, 1, 3])`` gives (b, h, n, d): the
same values. t₀ and t₁ keep their meaning: a 0 copies x's dimension, which x_i shares; a -1 is inferred
from an element count divided by 3 on both sides. Refused: a non-constant target or one not [·, ·, 3, H,
D], allowzero 1, x not of rank 3 with last dimension 3·H·D, T read by anything else or not by all three
parts. The old Reshape, Transpose and extractors go with cleanup.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, append_split, new_constant
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import (
    axes_of,
    constant_value,
    consumers,
    int_attr,
    is_graph_output,
    is_op,
    perm_of,
    producer_of,
    shape_of,
    slice_bounds,
)

#: timm's ``permute(2, 0, 3, 1, 4)`` of [B, N, 3, H, D]: the three parts first, then [B, H, N, D]
PACKED_HEADS = [2, 0, 3, 1, 4]


def _squeezed(graph, tensor):
    """(the Squeeze, its output) when ``tensor`` (a part of size 1 on axis 0) is read only by a
    ``Squeeze`` of axis 0 and is no graph output; else None."""
    readers = consumers(tensor)
    if is_graph_output(graph, tensor) or len(readers) != 1 or not is_op(readers[0], "Squeeze") \
            or axes_of(graph, readers[0]) != [0]:
        return None
    return readers[0], readers[0].outputs[0]


def _cuts(graph, reader, packed) -> list[tuple[int, gs.Tensor, list]] | Refuse:
    """(index, the part's [B, H, N, D] tensor, the nodes that cut it) for each part ``reader`` of the
    packed heads cuts: one for a Gather or a Slice, three for a Split."""
    also = Refuse(f"the packed heads are also read by {reader.op} {reader.name!r}")
    if is_op(reader, "Gather") and int_attr(reader, "axis", 0) == 0 and reader.inputs[0] is packed:
        index = constant_value(graph, reader.inputs[1])
        if index is None or index.ndim != 0 or int(index) not in (0, 1, 2):
            return also
        return [(int(index), reader.outputs[0], [reader])]
    if is_op(reader, "Slice") and reader.inputs[0] is packed:  # the dynamo exporter's unbind: Slice [i, i+1) on axis 0
        bounds, squeeze = slice_bounds(graph, reader), _squeezed(graph, reader.outputs[0])
        if bounds is None or bounds[2] != [0] or bounds[3] != [1] or squeeze is None:
            return also
        start, end = bounds[0][0] + (3 if bounds[0][0] < 0 else 0), bounds[1][0]
        if start not in (0, 1, 2) or min(end + (3 if end < 0 else 0), 3) != start + 1:
            return also
        return [(start, squeeze[1], [reader, squeeze[0]])]
    if is_op(reader, "Split") and int_attr(reader, "axis", 0) == 0 and len(reader.outputs) == 3:
        sizes = constant_value(graph, reader.inputs[1]) if len(reader.inputs) > 1 and reader.inputs[1].name else None
        if sizes is None and "split" in reader.attrs:
            sizes = np.asarray(reader.attrs["split"])
        if sizes is not None and [int(v) for v in np.asarray(sizes).reshape(-1)] != [1, 1, 1]:
            return also
        squeezes = [_squeezed(graph, piece) for piece in reader.outputs]  # unbind: each part Squeezed on axis 0
        if any(sq is None for sq in squeezes):
            return Refuse("a part of the Split on the packed axis is not Squeezed on axis 0 alone")
        return [(i, out, [reader, sq]) for i, (sq, out) in enumerate(squeezes)]
    return also


def _parts(graph, t) -> dict[int, tuple[gs.Tensor, list]] | Refuse:
    """Part index -> (its tensor, the nodes that cut it) for the packed heads ``t``'s output."""
    packed = t.outputs[0]
    parts: dict[int, tuple[gs.Tensor, list]] = {}
    for reader in consumers(packed):
        cuts = _cuts(graph, reader, packed)
        if isinstance(cuts, Refuse):
            return cuts
        for index, tensor, nodes in cuts:
            if index in parts:
                return Refuse(f"part {index} is cut twice")
            parts[index] = (tensor, nodes)
    if sorted(parts) != [0, 1, 2]:
        return Refuse("the packed heads are not cut into exactly q, k and v")
    return parts


class UnpackQkvHeads(Rule):
    """Gather(Transpose[2,0,3,1,4](Reshape(x, [b, n, 3, H, D])), i)
    → Transpose[0,2,1,3](Reshape(Split(x)[i], [b, n, H, D]))."""

    name = "unpack-qkv-heads"
    description = ("q, k, v cut from one packed [B, N, 3, H, D] tensor (timm's Attention) become a Split "
                   "and three head splits")
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Transpose") and perm_of(node) == PACKED_HEADS \
                    and is_op(producer_of(node.inputs[0]), "Reshape"):
                yield node

    def check(self, graph, t):
        r = producer_of(t.inputs[0])
        if len(r.inputs) != 2 or int(r.attrs.get("allowzero", 0)):
            return Refuse("the packing Reshape has no plain target (allowzero=1)")
        target = constant_value(graph, r.inputs[1])
        if target is None or target.shape != (5,):
            return Refuse("the packing Reshape's target is not a constant of five entries")
        t0, t1, three, heads, size = (int(v) for v in target)
        if three != 3 or heads <= 0 or size <= 0:
            return Refuse(f"the packing Reshape's target {target.tolist()} is not [·, ·, 3, H, D] with H, D given")
        x = r.inputs[0]
        shape = shape_of(graph, x)
        if shape is None or len(shape) != 3 or shape[2] != 3 * heads * size:
            return Refuse(f"{x.name!r} is not [B, N, 3·H·D] = [·, ·, {3 * heads * size}]")
        if is_graph_output(graph, t.outputs[0]):
            return Refuse("the packed heads are a graph output")
        parts = _parts(graph, t)
        if isinstance(parts, Refuse):
            return parts
        return Plan(t, (x, [t0, t1, heads, size], parts))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        t, (x, target, parts) = plan.anchor, plan.found
        names = NameAllocator(graph)
        base = t.name or t.outputs[0].name
        width = target[2] * target[3]
        lead = list(x.shape[:2]) if x.shape is not None else None
        pieces = [gs.Variable(names(f"{base}/part{i}"), dtype=x.dtype, shape=lead and [*lead, width]) for i in range(3)]
        append_split(graph, base, x, [width] * 3, pieces, names)
        shape = new_constant(graph, f"{base}/heads_target", np.asarray(target, np.int64))
        for i, piece in enumerate(pieces):
            out, nodes = parts[i]
            for node in nodes:  # the extractors go (a Split of unbind is listed with each of its parts)
                node.inputs.clear()
                node.outputs.clear()
            split4 = gs.Variable(names(f"{base}/heads{i}"), dtype=x.dtype,
                                 shape=lead and [*lead, target[2], target[3]])
            graph.nodes.append(gs.Node("Reshape", names(f"{base}/Reshape{i}"), inputs=[piece, shape], outputs=[split4]))
            graph.nodes.append(gs.Node("Transpose", names(f"{base}/Transpose{i}"), {"perm": [0, 2, 1, 3]},
                                       inputs=[split4], outputs=[out]))
        return {"node": t.name, "heads": target[2], "size": target[3]}
