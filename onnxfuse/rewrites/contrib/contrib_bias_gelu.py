"""contrib-bias-gelu: one of the GELU-family activations → ONNX Runtime contrib ops.

* **BiasGelu / FastGelu+bias**: ``Gelu(x + b)`` with ``b`` a 1-D vector over x's last axis
  →  ``com.microsoft.BiasGelu(x, b)`` / ``com.microsoft.FastGelu(x, b)``

``b`` is a constant, or a tensor computed at run time whose shape is known to be ``[d]`` with d the static
last dimension of x (:func:`~onnxfuse.rewrites.contrib.activation.bias_add`, which contrib-gelu's bfloat16
form shares). The op's kernel adds ``b`` along the last axis as the Add broadcast it, so the result is the
same Gelu of the same sums.

How matching works and the conditions (as ONNX Runtime's own fusions): :mod:`onnxfuse.rewrites.contrib.activation`.
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.activation import bias_add, fused_name
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import BF16, FP16, FP32, FP64, is_ms_op


class ContribBiasGelu(ContribRule):
    name = "contrib-bias-gelu"
    description = "Add(x, constant 1-D bias) → Gelu/FastGelu becomes com.microsoft BiasGelu / FastGelu(x, bias)"

    def match(self, graph):
        return [n for n in graph.nodes if is_ms_op(n, "Gelu", "FastGelu")]

    def analyze(self, graph, node):
        live_inputs = [t for t in node.inputs if not t.is_empty()]
        if len(live_inputs) != 1:
            return Refuse(f"{node.op} already has a bias")
        found = bias_add(graph, node.inputs[0], [node], node.op)
        if isinstance(found, Refuse):
            return found
        add, x, bias_t, bias_dtype = found
        allowed = ((FP16, FP32, FP64) if node.op == "Gelu" else (FP16, FP32)) + BF16
        problem = dtype_problem(bias_dtype, allowed, f"{node.op} bias")
        if problem:
            return problem
        return (add, x, bias_t)

    def apply(self, graph, node, plan):
        add, x, bias_t = plan
        op = "BiasGelu" if node.op == "Gelu" else "FastGelu"
        fuse(graph, [add, node], op, [x, bias_t], node.outputs[0], name=fused_name(node, op))
        return {"op": f"com.microsoft.{op}", "input": x.name, "bias": bias_t.name}
