"""contrib-bias-gelu: one of the GELU-family activations → ONNX Runtime contrib ops.

* **BiasGelu / FastGelu+bias**: ``Gelu(x + b)`` with ``b`` a 1-D vector over x's last axis
  →  ``com.microsoft.BiasGelu(x, b)`` / ``com.microsoft.FastGelu(x, b)``

``b`` is a constant, or a tensor computed at run time (a graph input, as in ONNX Runtime's
bias_gelu_fusion*.onnx and bias_onnx_*gelu_fusion.onnx test models) whose shape is known to be ``[d]``
with d the static last dimension of x: ONNX Runtime checks a graph input's declared static dimensions
when it runs, and an inferred shape of an intermediate holds whenever the model runs. The op's kernel
adds ``b`` along the last axis as the Add broadcast it, so the result is the same Gelu of the same sums.

How matching works and the conditions (as ONNX Runtime's own fusions): :mod:`onnxfuse.rewrites.contrib.activation`.
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.activation import fused_name
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    BF16, FP16, FP32, FP64, constant_value, dtype_of, is_ms_op, is_op, last_dim, only_read_by, producer_of, shape_of,
)


class ContribBiasGelu(ContribRule):
    name = "contrib-bias-gelu"
    description = "Add(x, constant 1-D bias) → Gelu/FastGelu becomes com.microsoft BiasGelu / FastGelu(x, bias)"

    def match(self, graph):
        return [n for n in graph.nodes if is_ms_op(n, "Gelu", "FastGelu")]

    def analyze(self, graph, node):
        live_inputs = [t for t in node.inputs if not t.is_empty()]
        if len(live_inputs) != 1:
            return Refuse(f"{node.op} already has a bias")
        add = producer_of(node.inputs[0])
        if not is_op(add, "Add") or len(add.inputs) != 2:
            return Refuse(f"{node.op} input is not produced by an Add")
        problem = only_read_by(graph, add.outputs[0], [node])
        if problem:
            return problem
        found = self._bias_and_x(graph, add)
        if found is None:
            return Refuse("the Add has no 1-D bias operand (a constant, or a tensor of known shape [d])")
        bias_t, x, n, bias_dtype = found
        d = last_dim(graph, x)
        if d is None:
            return Refuse(f"last dimension of {x.name!r} unknown; cannot prove the bias covers it")
        if n != d:
            return Refuse(f"bias has {n} entries, {x.name!r} has last dimension {d}")
        allowed = ((FP16, FP32, FP64) if node.op == "Gelu" else (FP16, FP32)) + BF16
        problem = dtype_problem(bias_dtype, allowed, f"{node.op} bias")
        if problem:
            return problem
        return (add, x, bias_t)

    @staticmethod
    def _bias_and_x(graph, add):
        """``(bias, x, entries, dtype)`` for the Add's 1-D operand: a constant first, else a run-time tensor of
        known shape ``[n]`` (n static) beside a non-constant x; ``None`` when neither operand is one."""
        for i in (1, 0):
            bias_t, x = add.inputs[i], add.inputs[1 - i]
            b = constant_value(graph, bias_t)
            if b is not None and b.ndim == 1 and constant_value(graph, x) is None:
                return bias_t, x, b.shape[0], b.dtype
        for i in (1, 0):
            bias_t, x = add.inputs[i], add.inputs[1 - i]
            shape = shape_of(graph, bias_t)
            if (constant_value(graph, bias_t) is None and constant_value(graph, x) is None and shape is not None
                    and len(shape) == 1 and isinstance(shape[0], int)):
                return bias_t, x, shape[0], dtype_of(graph, bias_t)
        return None

    def apply(self, graph, node, plan):
        add, x, bias_t = plan
        op = "BiasGelu" if node.op == "Gelu" else "FastGelu"
        fuse(graph, [add, node], op, [x, bias_t], node.outputs[0], name=fused_name(node, op))
        return {"op": f"com.microsoft.{op}", "input": x.name, "bias": bias_t.name}
