"""Drop the run-time check for the ``-1`` size sentinel where the sizes are provably non-negative.

Why
---
torch writes ``t.expand(batch, seq)`` (BERT's ``token_type_ids`` buffer, any ``expand`` of sizes read from
another tensor) as ``Expand(t, Where(Equal(sizes, -1), ones, sizes))``: a size of -1 means "keep
this dimension", so each -1 is swapped for 1 at run time. When the sizes come from ``Shape`` (and
non-negative constants) no entry can be -1, so the Where always picks ``sizes``. Nobody can see
that but us: ONNX shape inference does not propagate values through Equal/Where, so the Expand's
output gets an invented dimension (``unk__0`` instead of ``batch``), and every tensor it reaches
(BERT: the embeddings, then every layer) stops being provably the same shape as the rest; rules that
need equal shapes (``contrib-skip-layernorm``) then refuse. At run time the check is a few CPU nodes
per expand.

What (exact)
------------
``Where(Equal(p, q), a, b)`` with ``p`` provably non-negative (``facts.provably_nonnegative``: from
``Shape``/``Size`` and non-negative constants) and ``q`` a constant whose every element is negative
(or the same with ``p`` and ``q`` swapped): the condition is false everywhere, so the result is
``b`` broadcast against the condition and ``a``. The Where becomes ``b`` when that broadcast is
``b``'s own shape (every shape involved static); otherwise it is refused, since the Where would also
have changed the shape. The Equal stays if something else reads it; cleanup removes it otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxfuse.rewrites.engine.edit import to_identity
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, is_op, producer_of, provably_nonnegative, shape_of


def _static(shape) -> bool:
    return shape is not None and all(isinstance(d, (int, np.integer)) for d in shape)


class FoldSizeSentinel(Rule):
    """Where(Equal(sizes, negative constant), a, b) → b when the sizes cannot be negative."""

    name = "fold-size-sentinel"
    description = "Where(Equal(sizes, -1), a, sizes) → sizes when the sizes come from Shape (never -1)"
    targets = frozenset(TARGETS)
    #: The sizes then reach their Expand/Reshape through ops ONNX propagates values through, so the
    #: dimensions they give are inferred again (BERT's embeddings: ``unk__0`` becomes ``batch``).
    makes_shapes_inferable = True

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Where") and len(node.inputs) == 3 and is_op(producer_of(node.inputs[0]), "Equal"):
                yield node

    def check(self, graph, node):
        equal = producer_of(node.inputs[0])
        if not is_op(equal, "Equal") or len(equal.inputs) != 2:
            return Refuse("condition is no longer an Equal")
        p, q = equal.inputs
        if constant_value(graph, p) is not None:
            p, q = q, p
        sentinel = constant_value(graph, q)
        if sentinel is None or sentinel.dtype.kind != "i" or not np.all(sentinel < 0):
            return Refuse("the Equal does not compare with a constant whose every element is negative")
        if not provably_nonnegative(graph, p):
            return Refuse(f"{p.name!r} is not provably non-negative (not computed from Shape/Size and constants)")
        a, b = node.inputs[1], node.inputs[2]
        shapes = [shape_of(graph, t) for t in (p, q, a, b)]
        if not all(_static(s) for s in shapes):
            return Refuse("the Where's operand shapes are not all static")
        try:
            result = np.broadcast_shapes(*[tuple(int(d) for d in s) for s in shapes])
        except ValueError:
            return Refuse("the Where's operand shapes do not broadcast")
        if tuple(result) != tuple(int(d) for d in shapes[3]):
            return Refuse(f"the Where broadcasts {tuple(shapes[3])} to {tuple(result)}")
        return Plan(node, b)

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        node, kept = plan.anchor, plan.found
        to_identity(node, kept)
        return {"node": node.name, "kept": kept.name}
