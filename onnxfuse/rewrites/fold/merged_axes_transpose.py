"""A Transpose done on merged leading axes becomes one Transpose of the original tensor.

Why
---
torch's dynamo exporter (onnxscript's ``aten::transpose`` and its scaled-dot-product attention) swaps the
last two axes of a rank-4 tensor through rank 3: ``Reshape(Transpose(Reshape(k [B, H, L, D], [-1, L,
D]), perm=[0, 2, 1]), [B, H, D, L])``, with both targets computed from ``Shape(k)``. Kᵀ written so is
not the ``Transpose(perm=[0, 1, 3, 2])`` that contrib-attention matches (nor ONNX Runtime's own
attention fusion), so no attention of such an export was fused, and the two Reshapes read sizes on the
CPU. Written as one Transpose it is the form every matcher knows.

What (exact)
------------
``R2(T(R1(x)))`` with x of known rank r, and for some k ≥ 2 (m = r - k + 1):

* ``R1 = Reshape(x, a)``, a = [a₀, a₁, …, a_{m-1}] with a_j (j ≥ 1) proven to be x's dimension
  k - 1 + j, and a₀ either -1 or the static product of x's first k dimensions: R1 merges x's first k
  axes into one, row-major, and keeps the rest;
* ``T = Transpose(perm)`` of rank m with perm[0] = 0: the merged axis stays first;
* ``R2 = Reshape(T's output, b)``, b = [b₀, …, b_{k-1}, b_k, …] with b_i (i < k) proven to be x's
  dimension i and b_{k-1+j} (j ≥ 1) x's dimension k - 1 + perm[j], at most one -1 among them (then
  forced to the one value the element count leaves).

Element (i₀, …, i_{k-1}, t) of x is element (i₀·…, t) after R1, (i₀·…, perm(t)) after T and (i₀, …,
i_{k-1}, perm(t)) after R2: ``R2(T(R1(x))) = Transpose(x, [0, …, k-1, k-1+perm[1], …])``, value for value.
"Proven" means a constant equal to x's static dimension, or a value the Shape chain reads
(:func:`~onnxfuse.rewrites.facts.shape_values.shape_value`) from x at that axis or from a dimension
with x's symbolic name there (the same ``dim_param`` is the same size in ONNX; the dynamo exporter
reads every layer's sizes from the first layer's tensors, named alike). An entry 0 is refused in both targets (a copy with ``allowzero=0``, a zero-size
axis with 1). R1 and T stay when something else reads them; otherwise cleanup removes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import consumers, constant_value, is_op, perm_of, producer_of
from onnxfuse.rewrites.facts.shape_values import SourcedDim, known_name, shape_read, shape_value


def _target(graph, reshape) -> list | None:
    """A Reshape's target as a list of ints and read dimensions (:class:`SourcedDim`), or None when
    unknown. A Concat's parts are read one by one, so that a part reading ``Shape(x)`` names x's axes
    even where x's dimensions are unknown (:func:`shape_read`)."""
    if len(reshape.inputs) != 2:
        return None
    target = reshape.inputs[1]
    value = constant_value(graph, target)
    if value is not None:
        return [int(v) for v in value.reshape(-1)] if value.ndim == 1 else None
    concat = producer_of(target)
    if not is_op(concat, "Concat") or int(concat.attrs.get("axis", 0)) not in (0, -1):
        return shape_value(graph, target)
    entries: list = []
    for part in concat.inputs:
        read = shape_read(graph, part)
        if read is not None:
            src, positions = read
            entries.extend(SourcedDim(str(src.shape[p]), src, p) for p in positions)
            continue
        values = shape_value(graph, part)
        if values is None:
            return None
        entries.extend(values)
    return entries


def _is_dim(entry, x, axis: int) -> bool:
    """``entry`` provably equals dimension ``axis`` of x: read from x there, or (read from another
    tensor, or a constant) the same static size or the same symbolic name as x's there (ONNX: the same
    name is the same size)."""
    dim = x.shape[axis]
    if isinstance(entry, SourcedDim):
        if entry.tensor is x and entry.axis == axis:
            return True
        source = getattr(entry.tensor, "shape", None)
        entry = source[entry.axis] if source is not None and entry.axis < len(source) else None
        if known_name(entry) and known_name(dim):
            return entry == dim
    if isinstance(entry, bool) or not isinstance(entry, (int, np.integer)):
        return False
    return isinstance(dim, (int, np.integer)) and entry == dim and entry > 0


class MergedAxesTranspose(Rule):
    """Reshape(Transpose(Reshape(x, [-1, *tail]), [0, …]), [*lead, *tail']) → Transpose(x)."""

    name = "merged-axes-transpose"
    description = "a Transpose of merged leading axes (Reshape, Transpose, Reshape back) becomes one Transpose"
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Transpose") and is_op(producer_of(node.inputs[0]), "Reshape"):
                readers = consumers(node.outputs[0])
                if len(readers) == 1 and is_op(readers[0], "Reshape") and readers[0].inputs[0] is node.outputs[0]:
                    yield node

    def check(self, graph, t):
        r1, r2 = producer_of(t.inputs[0]), consumers(t.outputs[0])[0]
        x = r1.inputs[0]
        perm = perm_of(t)
        if x.shape is None or perm is None:
            return Refuse("the merged tensor's rank or the perm is unknown")
        rank, m = len(x.shape), len(perm)
        k = rank - m + 1
        if k < 2 or perm[0] != 0:
            return Refuse("the Reshape does not merge leading axes that the Transpose keeps first")
        a, b = _target(graph, r1), _target(graph, r2)
        if a is None or b is None or len(a) != m or len(b) != rank:
            return Refuse("a Reshape target is unknown or of the wrong length")
        if any(not isinstance(e, str) and e == 0 for e in a + b):
            return Refuse("a Reshape target has a 0 entry")
        lead = x.shape[:k]
        merged = int(np.prod(lead)) if all(isinstance(d, (int, np.integer)) for d in lead) else None
        if not (a[0] == -1 or (merged is not None and a[0] == merged)):
            return Refuse("the first Reshape's leading entry is neither -1 nor the merged size")
        if not all(_is_dim(a[j], x, k - 1 + j) for j in range(1, m)):
            return Refuse("the first Reshape does not keep x's trailing axes")
        axes = list(range(k)) + [k - 1 + perm[j] for j in range(1, m)]
        unproven = [i for i in range(rank) if not _is_dim(b[i], x, axes[i])]
        if len(unproven) > 1 or (unproven and b[unproven[0]] != -1):
            return Refuse("the second Reshape does not split the merged axis back into x's leading axes")
        return Plan(r2, (x, axes))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        r2, (x, axes) = plan.anchor, plan.found
        node = fuse(graph, [r2], "Transpose", [x], r2.outputs[0], {"perm": axes}, domain="",
                    name=f"{r2.name or r2.outputs[0].name}/transpose")
        if isinstance(node.outputs[0], gs.Variable) and x.shape is not None:
            node.outputs[0].shape = [x.shape[i] for i in axes]
        return {"node": r2.name, "perm": axes}
