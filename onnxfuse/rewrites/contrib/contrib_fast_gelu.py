"""contrib-fast-gelu: one of the GELU-family activations → ONNX Runtime contrib ops.

* **FastGelu** (tanh form):     ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``  →  ``com.microsoft.FastGelu(x)``
  (and ONNX's own ``Gelu`` with ``approximate="tanh"``, opset 20: the same function, so a bias Add before
  it can become BiasGelu, as for the decomposed form: :func:`~onnxfuse.rewrites.contrib.activation.native_gelu`)

How matching works and the conditions (as ONNX Runtime's own fusions): :mod:`onnxfuse.rewrites.contrib.activation`.
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.activation import (
    HALF_X_ONE_PLUS_T, gelu_mode, native_gelu, activation_dtype, fast_gelu_inner, fused_name, match_activation,
)
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import BF16, FP16, FP32, is_op, nodes_of


class ContribFastGelu(ContribRule):
    name = "contrib-fast-gelu"
    description = "0.5·x·(1+tanh(√(2/π)(x+0.044715x³))) → com.microsoft FastGelu"

    def match(self, graph):
        return nodes_of(graph, "Tanh") + [n for n in nodes_of(graph, "Gelu") if gelu_mode(n) == "tanh"]

    def analyze(self, graph, node):
        if is_op(node, "Gelu"):  # ONNX's own (opset 20), approximate="tanh": the same function
            plan = native_gelu(node)
        else:
            plan = match_activation(graph, node, fast_gelu_inner, HALF_X_ONE_PLUS_T, through_casts=True)
        if isinstance(plan, Refuse):
            return plan
        problem = dtype_problem(activation_dtype(graph, plan), (FP16, FP32) + BF16, "FastGelu input")
        return problem or plan

    def apply(self, graph, node, plan):
        fuse(graph, plan.nodes, "FastGelu", [plan.x], plan.root.outputs[0], name=fused_name(plan.root, "FastGelu"))
        return {"op": "com.microsoft.FastGelu", "input": plan.x.name, "replaced": len(plan.nodes)}
