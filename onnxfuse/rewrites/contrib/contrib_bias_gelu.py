"""contrib-bias-gelu: one of the GELU-family activations → ONNX Runtime contrib ops.

* **BiasGelu / FastGelu+bias**: ``Gelu(x + b)`` with ``b`` a constant 1-D vector over x's last axis
  →  ``com.microsoft.BiasGelu(x, b)`` / ``com.microsoft.FastGelu(x, b)``

How matching works and the conditions (as ONNX Runtime's own fusions): :mod:`onnxfuse.rewrites.contrib.activation`.
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.activation import fused_name
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.facts import (
    FP16, FP32, FP64, constant_value, is_ms_op, is_op, last_dim, only_read_by, producer_of,
)


class ContribBiasGelu(ContribRule):
    name = "contrib-bias-gelu"
    description = "Add(x, constant 1-D bias) → Gelu/FastGelu becomes com.microsoft BiasGelu / FastGelu(x, bias)"

    def match(self, graph):
        return [n for n in graph.nodes if is_ms_op(n, "Gelu", "FastGelu")]

    def analyze(self, graph, node):
        live_inputs = [t for t in node.inputs if not t.is_empty()]
        if len(live_inputs) != 1:
            return f"{node.op} already has a bias", None
        add = producer_of(node.inputs[0])
        if not is_op(add, "Add") or len(add.inputs) != 2:
            return f"{node.op} input is not produced by an Add", None
        problem = only_read_by(graph, add.outputs[0], [node])
        if problem:
            return problem, None
        for i in (1, 0):
            bias_t, x = add.inputs[i], add.inputs[1 - i]
            b = constant_value(graph, bias_t)
            if b is not None and b.ndim == 1 and constant_value(graph, x) is None:
                break
        else:
            return "the Add has no constant 1-D bias operand", None
        d = last_dim(graph, x)
        if d is None:
            return f"last dimension of {x.name!r} unknown; cannot prove the bias covers it", None
        if b.shape[0] != d:
            return f"bias has {b.shape[0]} entries, {x.name!r} has last dimension {d}", None
        allowed = (FP16, FP32, FP64) if node.op == "Gelu" else (FP16, FP32)
        problem = dtype_problem(b.dtype, allowed, f"{node.op} bias")
        if problem:
            return problem, None
        return None, (add, x, bias_t)

    def apply(self, graph, node, plan):
        add, x, bias_t = plan
        op = "BiasGelu" if node.op == "Gelu" else "FastGelu"
        fuse(graph, [add, node], op, [x, bias_t], node.outputs[0], name=fused_name(node, op))
        return {"op": f"com.microsoft.{op}", "input": x.name, "bias": bias_t.name}
