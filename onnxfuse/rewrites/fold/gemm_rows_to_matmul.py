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
``Reshape(Gemm(Reshape(x, t₁), W, c), t₂)`` → ``Add(MatMul(x, W), c)`` (``MatMul(x, W)`` without c) when the
chain provably applies the Gemm to each row of x [B, S, K] and gives back [B, S, N]: the conditions are
:mod:`onnxfuse.rewrites.facts.row_wise`'s (``contrib-attention`` packs GPT-2's q/k/v projection with the
same proof). With transB = 1, W must be a constant; it is transposed once here.

Exactness: the same dot products; MatMul's broadcast over B runs as one GEMM with M = B·S rows in ONNX
Runtime. The bias is added by its own Add instead of the GEMM's epilogue, which in float32 gives the
same value (the accumulator is float32 either way) and in float16 may differ by one rounding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, is_op, producer_of
from onnxfuse.rewrites.facts.row_wise import row_wise_gemm
from onnxfuse.rewrites.facts.shapes import dims_proven_equal, unify_dims


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
        rows = row_wise_gemm(graph, back)
        if isinstance(rows, Refuse):
            return rows
        w_value = None
        if int(rows.gemm.attrs.get("transB", 0)):
            w_value = constant_value(graph, rows.gemm.inputs[1])
            if w_value is None:
                return Refuse("transB with a W that is not a constant")
        return Plan(back, (rows, None if w_value is None else w_value.T))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        back = plan.anchor
        rows, w_transposed = plan.found
        flat, gemm, x, c, n = rows.flat, rows.gemm, rows.x, rows.bias, rows.n
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
