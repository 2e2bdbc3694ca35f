"""contrib-gelu: one of the GELU-family activations → ONNX Runtime contrib ops.

* **Gelu** (exact, erf form):   ``gelu(x) = 0.5·x·(1 + erf(x/√2))``  →  ``com.microsoft.Gelu(x)``
  (and ONNX's own ``Gelu`` with ``approximate="none"``, opset 20: the same function, so a bias Add before
  it can become BiasGelu, as for the decomposed form: :func:`~onnxfuse.rewrites.contrib.activation.native_gelu`)

How matching works and the conditions (as ONNX Runtime's own fusions): :mod:`onnxfuse.rewrites.contrib.activation`.
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.activation import (
    HALF_X_ONE_PLUS_T, gelu_mode, native_gelu, SQRT_HALF, activation_dtype, fused_name, match_activation, scaled_x,
)
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import FP16, FP32, FP64, is_op, nodes_of


class ContribGelu(ContribRule):
    name = "contrib-gelu"
    description = "0.5·x·(1+erf(x/√2)) → com.microsoft Gelu"

    def match(self, graph):
        return nodes_of(graph, "Erf") + [n for n in nodes_of(graph, "Gelu") if gelu_mode(n) == "none"]

    def analyze(self, graph, node):
        if is_op(node, "Gelu"):  # ONNX's own (opset 20), approximate="none": the same function
            plan = native_gelu(node)
        else:
            plan = match_activation(graph, node, scaled_x(SQRT_HALF), HALF_X_ONE_PLUS_T, through_casts=True)
        if isinstance(plan, Refuse):
            return plan
        problem = dtype_problem(activation_dtype(graph, plan), (FP16, FP32, FP64), "Gelu input")
        return problem or plan

    def apply(self, graph, node, plan):
        fuse(graph, plan.nodes, "Gelu", [plan.x], plan.root.outputs[0], name=fused_name(plan.root, "Gelu"))
        return {"op": "com.microsoft.Gelu", "input": plan.x.name, "replaced": len(plan.nodes)}
