"""contrib-quick-gelu: one of the GELU-family activations → ONNX Runtime contrib ops.

* **QuickGelu**:                ``x·sigmoid(α·x)`` (α = 1 is SiLU/Swish)  →  ``com.microsoft.QuickGelu(x, alpha=α)``

How matching works and the conditions (as ONNX Runtime's own fusions): :mod:`onnxfuse.rewrites.contrib.activation`.
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.activation import activation_dtype, any_scaled_x, fused_name, match_activation
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import BF16, FP16, FP32, FP64, nodes_of


class ContribQuickGelu(ContribRule):
    name = "contrib-quick-gelu"
    description = "x·sigmoid(α·x) (SiLU when α=1) → com.microsoft QuickGelu(alpha=α)"
    # On CUDA the same x·sigmoid(x) runs faster as a FusedElementwise region (H100, 2026-11-22:
    # 0.057 vs 0.059 ms fp32, 0.046 vs 0.053 ms fp16; benchmarks/patterns.py), so only --target contrib
    # maps it to QuickGelu.
    targets = frozenset({"contrib"})

    def match(self, graph):
        return nodes_of(graph, "Sigmoid")

    def analyze(self, graph, node):
        plan = match_activation(graph, node, any_scaled_x, {(1, 1): 1.0}, max_outer_steps=1)
        if isinstance(plan, Refuse):
            return plan
        dtype = activation_dtype(graph, plan)
        if dtype is not None:  # Sigmoid only takes float types, all of which QuickGelu's kernels take
            problem = dtype_problem(dtype, (FP16, FP32, FP64) + BF16, "QuickGelu input")
            if problem:
                return problem
        return plan

    def apply(self, graph, node, plan):
        fuse(graph, plan.nodes, "QuickGelu", [plan.x], plan.root.outputs[0], attrs={"alpha": float(plan.alpha)},
             name=fused_name(plan.root, "QuickGelu"))
        return {"op": "com.microsoft.QuickGelu", "input": plan.x.name, "alpha": float(plan.alpha),
                "replaced": len(plan.nodes)}
