"""contrib-skip-layernorm: decomposed (or ONNX) layer normalization after a residual Add →
com.microsoft SkipLayerNormalization.

``contrib-skip-layernorm``: when x itself is ``Add(a, b)`` of two tensors of provably equal shape
(rank 2 or 3: ONNX Runtime's kernel takes no other; dims equal as numbers or as the same named
dim-param) and the normalization is over the last axis only, the Add and the normalization become
``com.microsoft.SkipLayerNormalization(a, b, γ, β)``; an ``Add(y, c)`` with c a constant 1-D bias
feeding one side is absorbed too (its ``bias`` input), as in skip_layer_norm_fusion.cc. When the Add's
result is also read elsewhere (a graph output, or the residual stream of a pre-norm block: GPT-2, ViT,
Whisper read it again for the next residual), it becomes the op's fourth output,
``input_skip_bias_sum`` (a + b + bias, the Add's own value; ONNX Runtime's CPU and CUDA kernels both
write it). It also turns
an existing ONNX ``LayerNormalization`` preceded by such an Add into SkipLayerNormalization, and gives
an existing SkipLayerNormalization without a bias the bias of an ``Add(y, c)`` that became adjacent
after it was written (ViT's attention projection: its Transpose goes in a later round of
cancel-row-transposes), the same sum; on ViT-B/16 that is 12 Add kernels over [B, 197, 768] less.
Element types float16/float (the kernel's); works at any opset (com.microsoft domain).

The maths, the accepted decomposed forms and the conditions: :mod:`onnxfuse.rewrites.contrib.layernorm_pattern`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from onnxfuse.rewrites.contrib.layernorm_pattern import (
    match_any_decomposed, match_standard, mean_candidate, skip_layernorm_params,
)
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import empty_input, fuse
from onnxfuse.rewrites.engine.facts import (
    FP16, FP32, constant_value, first_known_dtype, is_ms_op, is_op, only_read_by, producer_of, shape_of,
    shapes_equal,
)


class _LateBias(NamedTuple):
    """The plan for an existing SkipLayerNormalization taking a bias (:meth:`ContribSkipLayerNorm._late_bias`)."""

    skip_ln: object
    inp: object
    skip: object
    bias: object
    bias_add: object


class ContribSkipLayerNorm(ContribRule):
    name = "contrib-skip-layernorm"
    description = "Add(a, b) of equal shapes (+ optional 1-D bias Add) → LayerNorm becomes com.microsoft SkipLayerNormalization"

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "LayerNormalization") or mean_candidate(n) or _without_bias(n)]

    def analyze(self, graph, node):
        if _without_bias(node):
            return self._late_bias(graph, node)
        if node.op == "ReduceMean":
            reason, m = match_any_decomposed(graph, node)
        else:
            reason, m = match_standard(graph, node)
        if reason:
            return reason, None
        if m.k != 1:
            return f"normalizes the last {m.k} axes; SkipLayerNormalization normalizes the last one", None
        add = producer_of(m.x)
        if not is_op(add, "Add") or len(add.inputs) != 2:
            return "LayerNorm input is not produced by an Add", None
        # Read elsewhere too (a pre-norm block's residual stream: GPT-2, ViT, Whisper): the sum becomes
        # the op's optional fourth output, input_skip_bias_sum, which is exactly this Add's result.
        keep_sum = only_read_by(graph, m.x, m.x_readers) is not None
        a, b = add.inputs
        sa, sb = shape_of(graph, a), shape_of(graph, b)
        if sa is None or sb is None:
            return "shapes of the Add's inputs unknown (run shape inference first)", None
        if len(sa) not in (2, 3) or not shapes_equal(sa, sb):
            return f"Add inputs of shapes {sa} and {sb} are not provably equal rank-2/3 shapes", None
        d = sa[-1]
        if not isinstance(d, (int, np.integer)):
            return "hidden size (last dimension) unknown", None
        dtype = m.dtype or first_known_dtype(graph, a, b)
        problem = dtype_problem(dtype, (FP16, FP32), "SkipLayerNormalization input")
        if problem:
            return problem, None
        inp, skip, bias, bias_add = _bias_side(graph, add, a, b, sa, d) or (a, b, None, None)
        reason, gamma, beta = skip_layernorm_params(graph, m, int(d), dtype)
        if reason:
            return reason, None
        return None, (m, add, inp, skip, gamma, beta, bias, bias_add, keep_sum)

    @staticmethod
    def _late_bias(graph, node):
        """A SkipLayerNormalization written before its bias Add became adjacent (ViT's attention output
        projection: cancel-row-transposes removes the Transpose between them in a later round) absorbs it:
        ``SkipLN(Add(y, c), s)`` → ``SkipLN(y, s, bias=c)``, the same sum (its fourth output included)."""
        shape = shape_of(graph, node.inputs[0])
        if shape is None or not shapes_equal(shape, shape_of(graph, node.inputs[1])) \
                or not isinstance(shape[-1], (int, np.integer)):
            return "shapes of the SkipLayerNormalization's inputs unknown or unequal", None
        found = _bias_side(graph, node, node.inputs[0], node.inputs[1], shape, int(shape[-1]))
        if found is None:
            return "no 1-D bias Add feeds the SkipLayerNormalization", None
        return None, _LateBias(node, *found)

    def apply(self, graph, node, plan):
        if isinstance(plan, _LateBias):
            skip_ln, inp, skip, bias, bias_add = plan
            params = list(skip_ln.inputs[2:4]) + [empty_input()] * (4 - len(skip_ln.inputs))  # γ, β
            skip_ln.inputs.clear()
            skip_ln.inputs.extend([inp, skip, *params, bias])
            bias_add.outputs.clear()
            bias_add.inputs.clear()
            return {"op": "com.microsoft.SkipLayerNormalization", "input": inp.name, "skip": skip.name,
                    "bias": True, "late": True, "replaced": 1}
        m, add, inp, skip, gamma, beta, bias, bias_add, keep_sum = plan
        inputs = [inp, skip, gamma, beta if beta is not None else empty_input()]
        if bias is not None:
            inputs.append(bias)
        nodes = list(m.nodes) + [add] + ([bias_add] if bias_add is not None else [])
        fused = fuse(graph, nodes, "SkipLayerNormalization", inputs, m.root.outputs[0], attrs={"epsilon": m.eps},
                     name=f"{m.root.name}/SkipLayerNorm" if m.root.name else None)
        if keep_sum:  # outputs: normalized, (mean), (inv_std_var), input_skip_bias_sum
            fused.outputs.extend([empty_input(), empty_input(), m.x])
        return {"op": "com.microsoft.SkipLayerNormalization", "input": inp.name, "skip": skip.name,
                "bias": bias is not None, "sum_output": keep_sum, "replaced": len(nodes)}


def _without_bias(node) -> bool:
    """A com.microsoft SkipLayerNormalization with no bias input."""
    return (is_ms_op(node, "SkipLayerNormalization") and len(node.inputs) >= 2
            and (len(node.inputs) < 5 or not node.inputs[4].name))


def _bias_side(graph, reader, a, b, shape, hidden: int):
    """``(y, other, c, bias_add)`` when a or b is ``Add(y, c)`` read only by ``reader``, c a constant of
    ``hidden`` values (1-D) and y a non-constant of ``shape``; else None. Adding c inside the op is the
    same sum (up to float association)."""
    for first, second in ((a, b), (b, a)):
        p = producer_of(first)
        if not is_op(p, "Add") or len(p.inputs) != 2 or only_read_by(graph, first, [reader]):
            continue
        for j in (1, 0):
            c = constant_value(graph, p.inputs[j])
            y = p.inputs[1 - j]
            if (c is not None and c.ndim == 1 and c.shape[0] == hidden and constant_value(graph, y) is None
                    and shapes_equal(shape_of(graph, y), shape)):
                return y, second, p.inputs[j], p
    return None
