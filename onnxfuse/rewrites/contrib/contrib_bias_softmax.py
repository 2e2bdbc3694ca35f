"""contrib-bias-softmax: Add + Softmax → com.microsoft BiasSoftmax (CUDA provider only; not registered).

**BiasSoftmax** (bias_softmax_fusion.cc) computes ``softmax(x + bias)`` along ``axis`` with the bias
broadcast in one of two simple ways: ``is_inner_broadcast=1`` — bias shape = x's with ones on the axes
*between* the batch prefix and the softmax axis (BERT's ``[B,1,1,S]`` mask on ``[B,H,S,S]`` scores);
``is_inner_broadcast=0`` — bias shape = x's trailing axes with ones (or nothing) in front. Both shapes
must be known (dims equal as numbers or the same named dim-param), the Add read only by the Softmax,
and the Softmax over the last axis (since opset 13 that is the only axis where BiasSoftmax's
coerce-to-2-D semantics agree with Softmax).
ONNX Runtime 1.31 has **no CPU kernel** for BiasSoftmax (CUDA/ROCm only): a model rewritten by
``contrib-bias-softmax`` runs on the CUDA provider only. That is why the rule is *not* in the default
registry; it is importable for an explicit, CUDA-only pool (tests check its structure only).
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.contrib.matmul import MATMUL_DTYPES
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    dims_equal, first_known_dtype, int_attr, is_op, only_read_by, opset_of, producer_of, shape_of,
)


def _broadcast_plan(graph, add, softmax):
    """``(input, bias, axis, is_inner_broadcast)`` or a ``Refuse``, following bias_softmax_fusion.cc."""
    t1, t2 = add.inputs
    s1, s2 = shape_of(graph, t1), shape_of(graph, t2)
    if s1 is None or s2 is None or not s1 or not s2:
        return Refuse("shapes of the Add's inputs unknown (run shape inference first)")
    n1, n2 = len(s1), len(s2)
    rank = max(n1, n2)
    opset = opset_of(graph)
    axis = int_attr(softmax, "axis", -1 if opset >= 13 else 1)
    axis = axis + rank if axis < 0 else axis
    if axis != rank - 1:
        return Refuse(f"Softmax axis {axis} is not the last axis of the rank-{rank} input")
    single = rank - axis
    if single > n1 or single > n2:
        return Refuse("an Add input has lower rank than the softmax's trailing axes")
    for i in range(1, single + 1):
        if not dims_equal(s1[n1 - i], s2[n2 - i]):
            return Refuse(f"Add inputs differ on the softmax axis ({s1} vs {s2})")

    def one(d):
        return isinstance(d, (int, np.integer)) and int(d) == 1

    if n1 == n2:
        pos = 0
        while pos < axis and dims_equal(s1[pos], s2[pos]):
            pos += 1
        lhs_input = pos == axis or not one(s1[pos])
        inp, bias, sb = (t1, t2, s2) if lhs_input else (t2, t1, s1)
        if all(one(sb[i]) for i in range(pos, axis)):
            return (inp, bias, axis, 1)
    p1, p2 = n1 - single - 1, n2 - single - 1
    while p1 >= 0 and p2 >= 0 and dims_equal(s1[p1], s2[p2]):
        p1 -= 1
        p2 -= 1
    lhs_input = p1 > p2 or (p1 == p2 and (p1 < 0 or not one(s1[p1])))
    inp, bias, sb, pb = (t1, t2, s2, p2) if lhs_input else (t2, t1, s1, p1)
    if not all(one(sb[i]) for i in range(pb, -1, -1)):
        return Refuse(f"bias of shape {sb} does not broadcast in a way BiasSoftmax supports")
    return (inp, bias, axis, 0)


class ContribBiasSoftmax(ContribRule):
    """CUDA only: ONNX Runtime 1.31 has no CPU kernel for BiasSoftmax (see the module docstring)."""

    name = "contrib-bias-softmax"
    description = "Add + Softmax(last axis) → com.microsoft BiasSoftmax (CUDA provider only: no CPU kernel)"

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "Softmax")]

    def analyze(self, graph, node):
        add = producer_of(node.inputs[0])
        if not is_op(add, "Add") or len(add.inputs) != 2:
            return Refuse("Softmax input is not produced by an Add")
        problem = only_read_by(graph, add.outputs[0], [node])
        if problem:
            return problem
        plan = _broadcast_plan(graph, add, node)
        if isinstance(plan, Refuse):
            return plan
        problem = dtype_problem(first_known_dtype(graph, *add.inputs, node.outputs[0]), MATMUL_DTYPES,
                                "BiasSoftmax input")
        if problem:
            return problem
        return (add, *plan)

    def apply(self, graph, node, plan):
        add, inp, bias, axis, inner = plan
        fuse(graph, [add, node], "BiasSoftmax", [inp, bias], node.outputs[0],
             attrs={"axis": int(axis), "is_inner_broadcast": int(inner)},
             name=f"{node.name}/BiasSoftmax" if node.name else None)
        return {"op": "com.microsoft.BiasSoftmax", "axis": int(axis), "is_inner_broadcast": int(inner)}
