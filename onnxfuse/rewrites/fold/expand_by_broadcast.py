"""An ``Expand`` whose target shape is computed from ``Shape`` becomes a broadcast by ``Where``.

Why
---
torch exports ``x.expand(n, -1, -1)`` (ViT's class token, ``n = images.shape[0]``) as ``Expand(x,
Where(Equal(Concat(Unsqueeze(Gather(Shape(images), 0)), [-1], [-1]), -1), 1, ...))``: a chain of small
integer nodes that ONNX Runtime's CUDA provider runs on the CPU at every inference. Such CPU nodes
cost host time on each run, and ONNX Runtime refuses to capture a CUDA graph of a model that has any:
the optimized ViT-B/16 kept exactly one such chain, this one, after constant-reshape-target
(docs/benchmarks.md, "CUDA graphs for BERT-base and ViT-B/16").

What (exact)
------------
The target is evaluated symbolically (:func:`~onnxfuse.rewrites.facts.shape_values.shape_value`: the
chain above is ``[batch, 1, 1]``) and broadcast with x's known shape into the output's dimensions
(each a static size or a named dimension; a pair that is neither 1 nor equal is refused, as Expand
would fail). Every named output dimension x does not already have (x's is 1 there) is *carried* by a
bool tensor ``Equal(c, c)``, c a one-element-per-index ``Slice`` of the tensor whose ``Shape`` the
target read that dimension from (never another tensor that only shares its name), moved by a constant
``Reshape`` to the output's position with 1 everywhere else; static dimensions x lacks come from a constant all-True tensor. ``And`` of those is the
condition ``cond``, and ``Where(cond, x, x)`` replaces the Expand: Where's output shape is the
broadcast of its three inputs, which is the output's by construction, and each element is x's at the
broadcast index whichever branch is taken: exactly Expand's result. NaN in the carrier only makes
``Equal`` False, which selects the same x. Nothing reads ``Shape`` any more; cleanup removes the
chain when nothing else reads it. An Expand that broadcasts nothing becomes an Identity.

ONNX Runtime's ``Where`` has no bool kernel (nor int16, uint16, uint64, bfloat16 on the CPU; found by the
fuzzer on the keep mask contrib-attention spells out): a bool x is broadcast as ``Or(x, And(cond,
Not(cond)))`` instead, whose second operand is False everywhere and of the output's shape, so each
element is x's at the broadcast index. Element types neither spelling serves on every provider
(:data:`WHERE_TYPES`) are refused.

Refused: a constant target (nothing runs on the CPU then); a target or x's shape not known as above;
a named dimension whose source tensor's other dimensions are not static positive sizes (a zero-size
axis would make the slice empty), or that is not numeric or bool; an opset below 11 (Slice with
inputs, Equal on floats).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.carriers import carrier_cond, carrier_problem
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant, to_identity
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, dtype_of, is_op, opset_of
from onnxfuse.rewrites.facts.proven_dims import broadcast_dims
from onnxfuse.rewrites.facts.shape_values import shape_value, tensor_dims
from onnxfuse.rewrites.facts.shapes import dims_proven_equal, unify_dims


#: element types ONNX Runtime's Where runs on its CPU and CUDA providers (bool goes through Or/And/Not)
WHERE_TYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.float16, np.int32, np.int64, np.uint8))


class ExpandByBroadcast(Rule):
    """Expand(x, shape computed from Shape) → Where(cond, x, x), cond carrying the output's dimensions."""

    name = "expand-by-broadcast"
    description = "Expand to a shape computed from Shape → Where(cond, x, x): no CPU shape nodes (CUDA graphs)"
    targets = frozenset(TARGETS)
    #: the result's dimensions are named (proven) where ONNX could not infer them: see rewrite
    makes_shapes_inferable = True

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Expand") and len(node.inputs) == 2 and len(node.outputs) == 1:
                yield node

    def check(self, graph, node):
        x, target = node.inputs
        if constant_value(graph, target) is not None:
            return Refuse("the target shape is a constant: no shape computation to remove")
        if opset_of(graph) < 11:
            return Refuse("opset below 11 (Slice takes its bounds as inputs from 10, Equal takes floats from 11)")
        wanted = shape_value(graph, target)
        if wanted is None or any(not isinstance(d, (int, str)) or isinstance(d, bool) for d in wanted):
            return Refuse("the target shape is not computed from known dimensions (Shape, Gather, Concat, Where...)")
        dtype = dtype_of(graph, x)
        if dtype is None or (np.dtype(dtype) not in WHERE_TYPES and np.dtype(dtype) != np.bool_):
            return Refuse(f"element type {dtype} has no Where kernel on every ONNX Runtime provider")
        x_dims = tensor_dims(x)
        if x_dims is None:
            return Refuse("the input's shape is not fully known")
        if any(isinstance(d, int) and d < 0 for d in wanted):
            return Refuse(f"the target {wanted} has a negative entry")
        out = broadcast_dims(x_dims, wanted)
        if out is None or None in out:
            return Refuse(f"{x_dims} does not broadcast to {wanted}")
        x_full = [1] * (len(out) - len(x_dims)) + x_dims
        carriers, static = [], [1] * len(out)
        for position, (dim, own) in enumerate(zip(out, x_full)):
            if dim == own:
                continue
            if isinstance(dim, int):
                static[position] = dim
                continue
            source, axis = getattr(dim, "tensor", None), getattr(dim, "axis", None)
            problem = Refuse("is not known") if source is None else carrier_problem(graph, source, axis)
            if problem:
                return Refuse(f"dimension {dim!r} is not read from a numeric tensor whose other dimensions are static: "
                              f"its source {problem.reason}")
            carriers.append((position, source, axis))
        return Plan(node, (len(out), carriers, static, out))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        node = plan.anchor
        rank, carriers, static, out = plan.found
        x = node.inputs[0]
        if not carriers and all(d == 1 for d in static):
            to_identity(node, x)
            return {"node": node.name, "shape": out, "carriers": []}
        names = NameAllocator(graph)
        base = node.name or node.outputs[0].name
        conds = []
        for position, tensor, axis in carriers:
            conds.append(carrier_cond(graph, names, base, tensor, axis, rank, position))
        if any(d != 1 for d in static):
            conds.append(new_constant(graph, f"{base}/static_dims", np.ones(static, np.bool_)))
        cond = conds[0]
        for other in conds[1:]:
            both = gs.Variable(names(f"{base}/cond"), dtype=np.bool_)
            graph.nodes.append(gs.Node("And", names(f"{base}/cond_and"), inputs=[cond, other], outputs=[both]))
            cond = both
        result = node.outputs[0]
        # Proven: the target's dimensions, by the names of the tensors they were read from. ONNX cannot
        # infer them through the carrier's Reshape; without them a Concat with a tensor of that batch
        # (ViT's class token) loses the batch name, and no residual Add after it is provably of equal shapes.
        proven = [d if isinstance(d, int) else str(d) for d in out]
        unify_dims(graph, dims_proven_equal(result.shape, proven))
        result.shape = proven
        node.outputs.clear()
        node.inputs.clear()
        if np.dtype(dtype_of(graph, x)) == np.bool_:  # no bool Where kernel: x or (False of the output's shape)
            negated = gs.Variable(names(f"{base}/cond_not"), dtype=np.bool_)
            never = gs.Variable(names(f"{base}/never"), dtype=np.bool_)
            graph.nodes.append(gs.Node("Not", names(f"{base}/cond_negate"), inputs=[cond], outputs=[negated]))
            graph.nodes.append(gs.Node("And", names(f"{base}/never_and"), inputs=[cond, negated], outputs=[never]))
            graph.nodes.append(gs.Node("Or", names(f"{base}/broadcast"), inputs=[x, never], outputs=[result]))
        else:
            graph.nodes.append(gs.Node("Where", names(f"{base}/broadcast"), inputs=[cond, x, x], outputs=[result]))
        return {"node": node.name, "shape": out, "carriers": [t.name for _, t, _ in carriers]}
