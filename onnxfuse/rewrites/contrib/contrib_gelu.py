"""contrib-gelu: one of the GELU-family activations → ONNX Runtime contrib ops.

* **Gelu** (exact, erf form):   ``gelu(x) = 0.5·x·(1 + erf(x/√2))``  →  ``com.microsoft.Gelu(x)``
  (and ONNX's own ``Gelu`` with ``approximate="none"``, opset 20: the same function, so a bias Add before
  it can become BiasGelu, as for the decomposed form: :func:`~onnxfuse.rewrites.contrib.activation.native_gelu`)
* In **bfloat16** com.microsoft ``Gelu`` has no CUDA kernel (ONNX Runtime 1.31.1's library), ``BiasGelu``
  has: ``gelu(x + b)`` with ``b`` a 1-D bias (:func:`~onnxfuse.rewrites.contrib.activation.bias_add`, as
  contrib-bias-gelu takes it) becomes ``com.microsoft.BiasGelu(x, b)`` here, Add included; a bfloat16 GELU
  without such a bias is refused (fuse-elementwise takes it).

How matching works and the conditions (as ONNX Runtime's own fusions): :mod:`onnxfuse.rewrites.contrib.activation`.
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.activation import (
    HALF_X_ONE_PLUS_T, gelu_mode, native_gelu, SQRT_HALF, activation_dtype, bias_add, fused_name, match_activation,
    scaled_x,
)
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import BF16, FP16, FP32, FP64, is_op, nodes_of


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
        dtype = activation_dtype(graph, plan)
        if dtype is not None and dtype in BF16:
            readers = [n for n in plan.nodes if any(t is plan.x for t in n.inputs)]
            found = bias_add(graph, plan.x, readers, "bfloat16 Gelu (com.microsoft Gelu has no bfloat16 CUDA kernel; "
                                                     "BiasGelu has)")
            return found if isinstance(found, Refuse) else (plan, found)
        problem = dtype_problem(dtype, (FP16, FP32, FP64), "Gelu input")
        return problem or (plan, None)

    def apply(self, graph, node, found):
        plan, biased = found
        if biased is not None:  # bfloat16: BiasGelu(x, b), the Add included
            add, x, bias_t, _ = biased
            fuse(graph, [add, *plan.nodes], "BiasGelu", [x, bias_t], plan.root.outputs[0],
                 name=fused_name(plan.root, "BiasGelu"))
            return {"op": "com.microsoft.BiasGelu", "input": x.name, "bias": bias_t.name, "replaced": len(plan.nodes) + 1}
        fuse(graph, plan.nodes, "Gelu", [plan.x], plan.root.outputs[0], name=fused_name(plan.root, "Gelu"))
        return {"op": "com.microsoft.Gelu", "input": plan.x.name, "replaced": len(plan.nodes)}
