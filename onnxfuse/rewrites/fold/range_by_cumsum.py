"""``Range(0, n, 1)`` with n a tensor's dimension becomes an exclusive ``CumSum`` of ones of that length.

Why
---
transformers 5 builds its attention masks from index grids, ``batch_idx = Range(0, B, 1)`` with ``B =
Gather(Shape(hidden_states), 0)``. ONNX Runtime runs that Shape → Gather → Cast → Range on the CPU at
every inference and copies the result to the GPU; after the other rules it was the last CPU chain in
BERT-base's optimized graph, and one CPU node is enough for ONNX Runtime to refuse a CUDA graph.

What (exact)
------------
The limit is traced back (integer Casts, Squeeze, Reshape, Identity) to ``Gather(Shape(T), k)``, a
dimension of a tensor T the graph already computes before the Range (the Range reads its shape). Then
``ones = Where(cond, 1, 1)`` with ``cond`` carrying T's dimension k as a 1-D tensor
(:func:`~onnxfuse.rewrites.facts.shape_values.carrier_cond`: a one-element-per-index Slice of T,
values irrelevant) is n ones, and ``CumSum(ones, axis=0, exclusive=1)`` is ``[0, 1, …, n-1]``:
exactly ``Range(0, n, 1)``, in the Range's integer type, computed on the device from T itself (no
symbolic name is trusted: T is the very tensor whose shape gave n).

Refused: a start other than the constant 0 or a delta other than 1; a float or other non-int32/int64
Range; a limit not traced to one dimension of a tensor; T not numeric or bool (``Equal`` reads it);
T's other dimensions not static positive sizes (the slice must have one element per index); an opset
below 11 (CumSum).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.carriers import carrier_cond, carrier_problem, dimension_source
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import dtype_of, is_op, opset_of, unit_range_limit

_INTS = (np.dtype(np.int64), np.dtype(np.int32))


class RangeByCumsum(Rule):
    """Range(0, Gather(Shape(T), k), 1) → CumSum(Where(carrier of T's dim k, 1, 1), exclusive)."""

    name = "range-by-cumsum"
    description = "Range(0, a tensor's dimension, 1) → exclusive CumSum of ones carried by that tensor: no CPU shape chain"
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Range") and len(node.inputs) == 3 and len(node.outputs) == 1:
                yield node

    def check(self, graph, node):
        limit = unit_range_limit(graph, node)
        if limit is None:
            return Refuse("start is not the constant 0 or delta not the constant 1")
        if dtype_of(graph, node.outputs[0]) not in _INTS:
            return Refuse("not an int32/int64 Range")
        if opset_of(graph) < 11:
            return Refuse("opset below 11 (CumSum)")
        found = dimension_source(graph, limit)
        if found is None:
            return Refuse("the limit is not traced to a tensor's dimension (Gather(Shape(T), k))")
        tensor, axis = found
        problem = carrier_problem(graph, tensor, axis)
        if problem:
            return Refuse(f"the tensor whose shape gives the limit {problem.reason}")
        return Plan(node, (tensor, axis))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        node = plan.anchor
        tensor, axis = plan.found
        names = NameAllocator(graph)
        base = node.name or node.outputs[0].name
        dtype = dtype_of(graph, node.outputs[0])
        cond = carrier_cond(graph, names, base, tensor, axis, 1, 0)
        one = new_constant(graph, f"{base}/one", np.array(1, dtype))
        ones = gs.Variable(names(f"{base}/ones"), dtype=dtype)
        graph.nodes.append(gs.Node("Where", names(f"{base}/ones"), inputs=[cond, one, one], outputs=[ones]))
        out = node.outputs[0]
        node.outputs.clear()
        node.inputs.clear()
        graph.nodes.append(gs.Node("CumSum", names(f"{base}/cumsum"), {"exclusive": 1}, inputs=[
            ones, new_constant(graph, f"{base}/axis", np.array(0, np.int64))], outputs=[out]))
        return {"node": node.name, "carrier": tensor.name, "axis": axis}
