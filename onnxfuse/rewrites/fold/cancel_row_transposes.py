"""Two Transposes of the leading axes around ops that work row by row cancel: ``Transpose(p)(f(Transpose(q)(y)))``
→ ``f(y)`` when ``p`` undoes ``q``.

Why
---
torch.nn.MultiheadAttention runs sequence-first: with ``batch_first=True`` (torchvision's ViT, most user
models) it transposes its [B, S, E] input to [S, B, E] and its result back. Once ``contrib-attention`` has
turned the attention into ONNX Runtime's ``Attention``, which reads and writes [B, S, E], what is left is
``Transpose(1, 0, 2)`` of the op's output, the output projection, and ``Transpose(1, 0, 2)`` back: two
copies of a [S, B, E] tensor per layer that cancel (ViT-B/16: 24 of them; docs/benchmarks.md 5.9).

What (exact)
------------
``outer = Transpose(p)`` of rank r ≥ 3 with p keeping the last axis, reading a chain of ops ``f`` each of
which computes every vector along the last axis from that vector alone, the same way for every one:

* ``MatMul(a, W)``, W of rank 2 (a [.., K] row times W);
* ``Add``/``Sub``/``Mul``/``Div`` of a and an operand whose every dimension but the last is 1 (a bias or
  scale per column: the same for every row);
* a unary elementwise op (``Relu``, ``Sigmoid``, ``Tanh``, ``Erf``, ``Identity``, ``Cast``);

and the chain reads ``inner = Transpose(q)(y)`` with ``p ∘ q`` the identity. Permuting the leading axes
only moves whole rows, so ``f`` commutes with it: ``p(f(q(y))) = f(p(q(y))) = f(y)``, value for value,
each row computed from the same numbers in the same order. The chain then reads y, its output is the
outer Transpose's, and both Transposes go. Every tensor from the inner Transpose's output on must be
read only by the chain (no graph output), since it now holds the rows in y's order. Refused otherwise,
with the reason.
"""

from __future__ import annotations

from typing import Any

from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import consumers, is_graph_output, is_op, perm_of, producer_of, shape_of
from onnxfuse.rewrites.facts.shapes import dims_proven_equal, unify_dims

#: elementwise ops of one input that compute each element from itself alone
UNARY = ("Relu", "Sigmoid", "Tanh", "Erf", "Identity", "Cast")
BINARY = ("Add", "Sub", "Mul", "Div")


def _chain(graph, outer):
    """(the row-wise ops read by ``outer``, nearest first; the tensor they start from), walking up until a
    producer is a Transpose; None when the walk meets anything else first (or a graph input)."""
    rank, chain, t = len(perm_of(outer)), [], outer.inputs[0]
    while True:
        node = producer_of(t)
        if node is None:
            return None
        if is_op(node, "Transpose"):
            return chain, t
        row = _row_input(graph, node, rank)
        if row is None:
            return None
        chain.append(node)
        t = row


def _row_input(graph, node, rank: int):
    """The input of ``node`` that it computes row by row (module docstring), or None."""
    if is_op(node, *UNARY) and len(node.inputs) == 1:
        return node.inputs[0]
    if is_op(node, "MatMul") and len(node.inputs) == 2:
        w = shape_of(graph, node.inputs[1])
        return node.inputs[0] if w is not None and len(w) == 2 else None
    if is_op(node, *BINARY) and len(node.inputs) == 2:
        shapes = [shape_of(graph, t) for t in node.inputs]
        if any(s is None for s in shapes):
            return None
        for i in (0, 1):
            row, other = shapes[i], shapes[1 - i]
            if len(row) == rank and all(d == 1 for d in other[:-1]):
                return node.inputs[i]
    return None


class CancelRowTransposes(Rule):
    """Transpose(p) ∘ row-wise ops ∘ Transpose(p⁻¹) → the row-wise ops alone."""

    name = "cancel-row-transposes"
    description = ("Transpose(p)(f(Transpose(p⁻¹)(y))) → f(y) when p keeps the last axis and f works row by "
                   "row (MatMul by a matrix, a per-column bias or scale, unary elementwise)")
    targets = frozenset(TARGETS)
    #: the chain's output gets y's dimension names (proven), so residual Adds downstream can be seen to
    #: add equal shapes (contrib-skip-layernorm)
    makes_shapes_inferable = True

    def match(self, graph):
        for node in graph.nodes:
            perm = perm_of(node)
            if perm is None or len(perm) < 3 or perm[-1] != len(perm) - 1:
                continue
            found = _chain(graph, node)
            if found is not None and found[0]:  # a Transpose right after a Transpose is ONNX Runtime's own to cancel
                yield node

    def check(self, graph, outer):
        found = _chain(graph, outer)
        if found is None or not found[0]:
            return Refuse("the chain changed since it was matched")
        chain, t = found
        for between in [n.outputs[0] for n in chain] + [t]:
            if is_graph_output(graph, between) or len(consumers(between)) != 1:
                return Refuse(f"{between.name!r} is read outside the chain (or is a graph output)")
        p, q = perm_of(outer), perm_of(producer_of(t))
        rank = len(p)
        if len(q) != rank or any(q[p[i]] != i for i in range(rank)):
            return Refuse(f"the inner Transpose's perm {q} is not undone by the outer's {p}")
        return Plan(outer, (producer_of(t), chain[::-1]))  # the chain, first op first

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        outer = plan.anchor
        inner, chain = plan.found
        p = perm_of(outer)
        first = chain[0]
        rank = len(p)
        # the chain now reads y: each tensor between holds y's layout, its dims permuted back by p
        row = _row_input(graph, first, rank)
        first.inputs[next(i for i, t in enumerate(first.inputs) if t is row)] = inner.inputs[0]
        for node in chain[:-1]:
            out = node.outputs[0]
            shape = out.shape
            if shape is not None and len(shape) == rank:
                out.shape = [shape[p[i]] for i in range(rank)]
        out = outer.outputs[0]
        # Proven: f(y) has y's leading dims. ONNX may have invented names for the outer Transpose's (its
        # input came through a Reshape it could not follow); every tensor inferred from it gets y's.
        y_shape = inner.inputs[0].shape
        if y_shape is not None and len(y_shape) == rank and out.shape is not None and len(out.shape) == rank:
            proven = [*y_shape[:-1], out.shape[-1]]
            unify_dims(graph, dims_proven_equal(out.shape, proven))
            out.shape = proven
        chain[-1].outputs[0] = out
        for node in (outer, inner):  # the inner Transpose's output was read by the chain alone (check)
            node.outputs.clear()
            node.inputs.clear()
        return {"perm": p, "ops": [n.op for n in chain]}
