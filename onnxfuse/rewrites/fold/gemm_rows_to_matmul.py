"""A Gemm applied to the flattened rows of a 3-D tensor becomes a MatMul on the tensor itself.

Why
---
transformers' ``Conv1D`` (GPT-2's every projection) is exported as
``Reshape(Gemm(Reshape(x, [-1, K]), W, c), [-1, S, N])``: x [B, S, K] is flattened to rows, multiplied,
and unflattened. On GPT-2 small that is 6 Reshapes per layer (72 nodes) whose only job is to feed a 2-D
op, and worse for the rules after this one: ONNX cannot infer the batch of the ``[-1, S, N]`` result
(it does no symbolic division), so each projection output gets an invented batch dimension and no
residual Add is provably of equal shapes (``contrib-skip-layernorm`` refused all 24 of GPT-2's). As
``MatMul(x, W) + c`` the batch dimension flows through, and the bias Add is where the contrib rules
look for it (SkipLayerNormalization's and FastGelu's bias inputs, the packed ``Attention``).

What
----
``Reshape(Gemm(Reshape(x, t₁), W, c), t₂)`` → ``Add(MatMul(x, W), c)`` (``MatMul(x, W)`` without c) when

* x is [B, S, K] with K static, and the first Reshape gives [M, K]: the row-major flatten, row
  b·S + s holding x[b, s];
* the Gemm has alpha = beta = 1 and transA = 0: row-wise, row r of the result is row r of A times W
  (plus c). With transB = 1 and W a constant, W is transposed once here;
* c (if any) is a constant of N values ([N] or [1, N]): the same bias for every row;
* the second Reshape sends the rows back to [B, S, N]: its target is the constant [-1, S, N] with S
  = x's static sequence size, so that -1 = (B·S·N) / (S·N) = B (or [B, S, N] with B static too), or,
  for a computed target, its inferred output dimensions are provably x's (equal sizes or the same
  name);
* the two intermediate tensors are read only by the next op of the chain (and are no graph outputs).

Exactness: the same dot products; MatMul's broadcast over B runs as one GEMM with M = B·S rows in ONNX
Runtime. The bias is added by its own Add instead of the GEMM's epilogue, which in float32 gives the
same value (the accumulator is float32 either way) and in float16 may differ by one rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.facts import (
    constant_value,
    dims_equal,
    is_alive,
    is_op,
    only_read_by,
    producer_of,
    shape_of,
)
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.engine.shapes import dims_proven_equal, unify_dims


class GemmRowsToMatMul(Rule):
    """Reshape → Gemm → Reshape over the rows of a [B, S, K] tensor → MatMul (+ bias Add)."""

    name = "gemm-rows-to-matmul"
    description = "Reshape(x, [-1, K]) → Gemm → Reshape back to x's [B, S, ·] becomes MatMul(x, W) (+ c)"
    targets = frozenset(TARGETS)
    #: MatMul(x, W) keeps x's batch name where the unflatten had an invented one; inferred again, the
    #: residual Adds downstream (x + MatMul(...)) keep it too, layer after layer.
    makes_shapes_inferable = True

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Reshape") and len(node.inputs) == 2 and is_op(producer_of(node.inputs[0]), "Gemm"):
                yield node

    def check(self, graph, back):
        if not is_alive(back):
            return Refuse("node was already rewritten by an earlier match")
        gemm = producer_of(back.inputs[0])
        flat = producer_of(gemm.inputs[0]) if gemm is not None else None
        if not is_op(flat, "Reshape"):
            return Refuse("the Gemm's A is not a Reshape")
        if (float(gemm.attrs.get("alpha", 1.0)) != 1.0 or float(gemm.attrs.get("beta", 1.0)) != 1.0
                or int(gemm.attrs.get("transA", 0)) != 0):
            return Refuse("the Gemm scales (alpha/beta ≠ 1) or transposes A")
        for tensor, reader in ((gemm.inputs[0], gemm), (back.inputs[0], back)):
            problem = only_read_by(graph, tensor, [reader])
            if problem:
                return Refuse(problem)
        x = flat.inputs[0]
        xs, fs, outs = shape_of(graph, x), shape_of(graph, gemm.inputs[0]), shape_of(graph, back.outputs[0])
        if xs is None or len(xs) != 3 or not isinstance(xs[2], int):
            return Refuse("the flattened tensor is not of rank 3 with a static last dimension")
        if fs is None or len(fs) != 2 or fs[1] != xs[2]:
            return Refuse(f"the first Reshape does not flatten the rows (gives {fs}, from {xs})")
        w = gemm.inputs[1]
        trans_b = int(gemm.attrs.get("transB", 0))
        w_value = constant_value(graph, w)
        w_shape = shape_of(graph, w)
        if w_shape is None or len(w_shape) != 2:
            return Refuse("W's shape is unknown")
        if trans_b and w_value is None:
            return Refuse("transB with a W that is not a constant")
        n = w_shape[0] if trans_b else w_shape[1]
        if not isinstance(n, int):
            return Refuse("W's output size is unknown")
        c = None
        if len(gemm.inputs) > 2 and not gemm.inputs[2].is_empty():
            c = constant_value(graph, gemm.inputs[2])
            if c is None or c.size != n or c.shape[-1] != n:
                return Refuse("C is not a constant bias of N values")
        target = constant_value(graph, back.inputs[1])
        if target is not None:  # decided by the target alone: [-1, S, N], or [B, S, N] with static B
            t = target.reshape(-1).tolist()
            rows_back = isinstance(xs[1], int) and xs[1] > 0 and (
                t == [-1, xs[1], n] or (isinstance(xs[0], int) and t == [xs[0], xs[1], n]))
        else:
            rows_back = (outs is not None and len(outs) == 3 and dims_equal(outs[0], xs[0])
                         and dims_equal(outs[1], xs[1]) and dims_equal(outs[2], n))
        if not rows_back:
            return Refuse("the second Reshape does not provably give back x's [B, S] rows")
        return Plan(back, (flat, gemm, x, w_value.T if trans_b else None, c, n))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        back = plan.anchor
        flat, gemm, x, w_transposed, c, n = plan.found
        names = NameAllocator(graph)
        base = gemm.name or gemm.outputs[0].name
        w = new_constant(graph, f"{base}/weight", np.ascontiguousarray(w_transposed)) if w_transposed is not None \
            else gemm.inputs[1]
        out = back.outputs[0]
        # Proven [B, S, N] (check): ONNX had invented a batch name for the unflatten; every tensor
        # inferred from it gets x's instead.
        proven = [x.shape[0], x.shape[1], n] if x.shape is not None else None
        unify_dims(graph, dims_proven_equal(out.shape, proven))
        if proven is not None:
            out.shape = proven
        for node in (back, gemm, flat):
            node.outputs.clear()
            node.inputs.clear()
        if c is None:
            graph.nodes.append(gs.Node("MatMul", names(f"{base}/MatMul"), inputs=[x, w], outputs=[out]))
        else:
            product = gs.Variable(names(f"{base}/product"), dtype=out.dtype, shape=proven)
            graph.nodes.append(gs.Node("MatMul", names(f"{base}/MatMul"), inputs=[x, w], outputs=[product]))
            bias = new_constant(graph, f"{base}/bias", c.reshape(-1))
            graph.nodes.append(gs.Node("Add", names(f"{base}/bias_add"), inputs=[product, bias], outputs=[out]))
        return {"node": gemm.name, "bias": c is not None, "transposed_weight": w_transposed is not None}
