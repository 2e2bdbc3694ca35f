"""Store a float16 weight that the model casts up to float32 in float32: ``Cast(W16, to=float)`` of a
constant becomes the constant ``float32(W16)``.

Why
---
torch's legacy exporter writes a ``half()`` GPT-2 or BERT with sdpa attention as a float32 model with
float16 weights: its attention symbolic computes the scale in float32, the attention output and then
the residual stream are promoted to float32, and from the first layer on every weight is read through a
``Cast(to=float)`` (GPT-2 small: 48 projection weights, the LayerNorm scales and biases). Our pattern
rules match constant weights, so behind those Casts the q/k/v projections stayed three MatMuls and a
Split into ``MultiHeadAttention`` (11 of 12 layers), and the biases stayed separate Adds: 180 nodes
against 92 for the float32 export of the same model, and 3.292 against 2.835 ms at batch 16 on an
H200 (docs/benchmarks.md 5.48), for what is the same float32 computation.

fold-constants leaves these Casts, each result being over its 1 MiB growth limit. ONNX Runtime folds
them itself when it loads the model (checked with ONNX Runtime 1.32's optimized-model output at
ORT_ENABLE_BASIC: ``Cast(W16) → MatMul`` becomes ``MatMul`` of a float32 initializer), so the session
holds float32 weights either way; storing them so costs file size only (twice the float16 bytes of
each weight folded), and lets every later rule see the constant it needs.

What (exact)
------------
A ``Cast`` to float32 whose input is a float16 constant becomes an ``Identity`` of a new float32
constant holding the same values (float16 → float32 is exact). Refused when the input is not a float16
constant, when ``to`` is not float32, and when its float32 copy is over
:data:`~onnxfuse.rewrites.fold.SIZE_LIMIT` and something other than this Cast reads the float16 one too:
the model would then store the weight twice.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto

from onnxfuse.rewrites.engine.edit import new_constant, to_identity
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, consumers, int_attr, is_op
from onnxfuse.rewrites.fold import SIZE_LIMIT


class FoldWeightUpcast(Rule):
    """Cast(float16 constant W, to=float) → constant float32(W), whatever its size, when that stores no
    weight twice."""

    name = "fold-weight-upcast"
    description = "Cast of a float16 constant weight to float32 → the float32 constant (half() sdpa exports)"
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Cast") and len(node.inputs) == 1 and len(node.outputs) == 1:
                yield node

    def check(self, graph, node):
        if int_attr(node, "to", 0) != TensorProto.FLOAT:
            return Refuse("the Cast is not to float32")
        weight = node.inputs[0]
        value = constant_value(graph, weight)
        if value is None:
            return Refuse("the Cast's input is not a constant")
        if value.dtype != np.float16:
            return Refuse(f"the constant is {value.dtype}, not float16")
        added = value.size * 4  # the float32 copy, stored beside the float16 one where something else reads it
        if added > SIZE_LIMIT and any(r is not node for r in consumers(weight)):
            return Refuse(f"the constant ({value.nbytes} bytes) is read elsewhere too: folding would store it twice")
        return Plan(node, None)

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        node = plan.anchor
        weight = node.inputs[0]
        value = constant_value(graph, weight)
        # the float16 copy goes where this Cast was its only reader (the model grows by its bytes), else
        # both stay (a small shared weight: the model grows by the float32 copy's)
        shared = any(r is not node for r in consumers(weight))
        folded = new_constant(graph, f"{weight.name}/float32", value.astype(np.float32))
        to_identity(node, folded)
        return {"node": node.name, "shape": list(folded.shape),
                "bytes_added": int(folded.values.nbytes if shared else value.nbytes)}
