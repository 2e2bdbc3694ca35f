"""Drop ``allowzero=1`` from a Reshape whose constant target has no 0: the attribute then means nothing.

Why
---
torch's dynamo exporter (``torch.onnx.export``'s default since torch 2.9) writes every ``view`` and
``reshape`` as ``Reshape(x, t, allowzero=1)``, torch's meaning of a 0 in a shape (a zero-size axis,
not ONNX's "copy this dimension"). The pattern rules (attention's head split and merge, the row-wise
Gemm unflatten) and ONNX Runtime's own fusions match the ordinary ``allowzero=0`` Reshape, so without
this rule no attention in such an export is fused (BERT, ViT, GPT-2, Whisper, ...: measured on tiny
transformers exports, every Softmax stayed).

Exactness
---------
``allowzero`` changes the meaning of one thing only: an entry 0 in the target (ONNX Reshape: with
``allowzero=1`` it is a zero-size axis, with 0 a copy of the input's dimension). A constant target
without a 0 entry is read identically either way, so the Reshape computes the same for every input.
Refused: a target that is not constant (its run-time value might hold a 0; constant-reshape-target
decides those, with the copies it proves) and a constant target with a 0 entry.
"""

from __future__ import annotations

from typing import Any

from onnxfuse.rewrites.engine.rule import TARGETS, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, is_op


class ReshapeAllowzero(Rule):
    """Reshape(x, constant t without 0, allowzero=1) → the same Reshape with allowzero=0."""

    name = "reshape-allowzero"
    description = "Reshape's allowzero=1 dropped where its constant target has no 0 (the attribute then means nothing)"
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Reshape") and int(node.attrs.get("allowzero", 0)) == 1:
                yield node

    def check(self, graph, node):
        if len(node.inputs) != 2:
            return Refuse("the Reshape has no target input")
        target = constant_value(graph, node.inputs[1])
        if target is None:
            return Refuse("the target is computed (constant-reshape-target decides it)")
        if (target == 0).any():
            return Refuse("the target has a 0 entry, which allowzero=1 reads as a zero-size axis")
        return node

    def rewrite(self, graph, node) -> dict[str, Any]:
        node.attrs["allowzero"] = 0
        return {"node": node.name}
