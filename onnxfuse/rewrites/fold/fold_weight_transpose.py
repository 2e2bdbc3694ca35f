"""Store a transposed weight transposed: ``Transpose(W)`` of a constant becomes the constant ``Wᵀ``.

Why
---
transformers 5 exports every ``nn.Linear`` as ``MatMul(x, Transpose(W))`` with W ``[N, K]`` as torch
stores it. fold-constants leaves those Transposes (each result is over its 1 MiB limit, a limit that
stops a fold from growing the model), and ``contrib-fused-matmul-transpose`` then absorbed them as
``FusedMatMul(x, W, transB=1)``. ONNX Runtime folds such a Transpose itself when it loads the original
model, so the original multiplies by a ``[K, N]`` weight and ours by ``[N, K]`` with ``transB``: a
different GEMM layout. Measured on an H100 (BERT-base, transformers 5.17 export, fp32, our optimized
model with its 36 FusedMatMul against the same model with the weights stored transposed as MatMul):
batch 1 1.32 → 1.21 ms, batch 16 3.00 → 3.11 ms; per projection shape: ``benchmarks/weight_layout.py``
(docs/benchmarks.md 5.7). Storing ``Wᵀ`` keeps the layout the original model runs with.

What (exact)
------------
A ``Transpose`` (``perm`` given, or absent: all axes reversed) whose input is a constant becomes an
``Identity`` of a new constant holding ``np.transpose(W, perm)``: pure data movement. Refused when the
constant is over :data:`~onnxfuse.rewrites.fold.SIZE_LIMIT` and something other than
this Transpose reads it too: the model would then store the weight twice.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxfuse.rewrites.engine.edit import new_constant, to_identity
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, consumers, is_op
from onnxfuse.rewrites.fold import SIZE_LIMIT


class FoldWeightTranspose(Rule):
    """Transpose(constant W) → constant Wᵀ, whatever its size, when that stores no weight twice."""

    name = "fold-weight-transpose"
    description = "Transpose of a constant weight → the transposed constant (transformers 5's Linear layers)"
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Transpose") and len(node.inputs) == 1 and len(node.outputs) == 1:
                yield node

    def check(self, graph, node):
        weight = node.inputs[0]
        value = constant_value(graph, weight)
        if value is None:
            return Refuse("the Transpose's input is not a constant")
        if value.nbytes > SIZE_LIMIT and any(r is not node for r in consumers(weight)):
            return Refuse(f"the constant ({value.nbytes} bytes) is read elsewhere too: folding would store it twice")
        perm = node.attrs.get("perm")
        perm = list(range(value.ndim))[::-1] if perm is None else [int(p) for p in perm]
        if sorted(perm) != list(range(value.ndim)):
            return Refuse(f"perm {perm} is not a permutation of the constant's {value.ndim} axes")
        return Plan(node, perm)

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        node, perm = plan.anchor, plan.found
        value = constant_value(graph, node.inputs[0])
        folded = new_constant(graph, f"{node.inputs[0].name}/transposed", np.transpose(value, perm))
        to_identity(node, folded)
        return {"node": node.name, "shape": list(folded.shape), "perm": perm}
