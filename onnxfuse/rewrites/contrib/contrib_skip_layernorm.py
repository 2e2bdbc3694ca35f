"""contrib-skip-layernorm: decomposed (or ONNX) layer normalization after a residual Add →
com.microsoft SkipLayerNormalization.

``contrib-skip-layernorm``: when x itself is ``Add(a, b)`` of two tensors of provably equal shape
(rank 2 or 3: ONNX Runtime's kernel takes no other; dims equal as numbers or as the same named
dim-param), or of a ``[B, S, H]`` input and a ``[1, S, H]`` / ``[S, H]`` skip that the kernel
broadcasts as numpy does (GPT-2's token + position embeddings: :func:`_input_and_skip`), and the
normalization is over the last axis only (a Cast between the Add and the normalization when it is to
the Add's own type, or from float16 to float32, within the tolerance :func:`_add_behind_cast` states), the
Add and the normalization become ``com.microsoft.SkipLayerNormalization(a, b, γ, β)``; an ``Add(y, c)``
with c a constant 1-D bias feeding one side (the full one, for a broadcast skip) is absorbed too (its
``bias`` input), as in skip_layer_norm_fusion.cc. When the Add's
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
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.layernorm_pattern import (
    match_any_decomposed, match_standard, mean_candidate, skip_layernorm_params,
)
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import NameAllocator, empty_input, fuse, new_constant
from onnxfuse.rewrites.engine.polynomial import cast_target
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    BF16, FP16, FP32, constant_value, dims_equal, dtype_of, first_known_dtype, is_ms_op, is_op, only_read_by,
    producer_of, shape_of, shapes_equal,
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
            m = match_any_decomposed(graph, node)
        else:
            m = match_standard(graph, node)
        if isinstance(m, Refuse):
            return m
        if m.k != 1:
            return Refuse(f"normalizes the last {m.k} axes; SkipLayerNormalization normalizes the last one")
        add = producer_of(m.x)
        adds, widen = [add], False
        if is_op(add, "Cast"):
            behind = _add_behind_cast(graph, add)
            if isinstance(behind, Refuse):
                return behind
            add, widen = behind
            if only_read_by(graph, add.outputs[0], [adds[0]]) is None:
                adds.append(add)  # else the float16 sum stays for its other readers
        if not is_op(add, "Add") or len(add.inputs) != 2:
            return Refuse("LayerNorm input is not produced by an Add")
        # Read elsewhere too (a pre-norm block's residual stream: GPT-2, ViT, Whisper): the sum becomes
        # the op's optional fourth output, input_skip_bias_sum, which is exactly this Add's result.
        keep_sum = only_read_by(graph, m.x, m.x_readers) is not None
        sides = _input_and_skip(graph, *add.inputs)
        if isinstance(sides, Refuse):
            return sides
        a, b, sa = sides
        d = sa[-1]
        if not isinstance(d, (int, np.integer)):
            return Refuse("hidden size (last dimension) unknown")
        dtype = FP32 if widen else m.dtype or first_known_dtype(graph, a, b)
        # bfloat16: ONNX Runtime's CUDA kernel takes it (as contrib-layernorm's: a bfloat16 model is one for CUDA)
        problem = dtype_problem(dtype, (FP16, FP32) + BF16, "SkipLayerNormalization input")
        if problem:
            return problem
        broadcast = not shapes_equal(sa, shape_of(graph, b))  # only the full input may carry the bias
        found = _bias_side(graph, add, a, b, sa, d, either=not broadcast)
        inp, skip, bias, bias_add = found or (a, b, None, None)
        params = skip_layernorm_params(graph, m, int(d), dtype)
        if isinstance(params, Refuse):
            return params
        gamma, beta = params
        return (m, adds, inp, skip, gamma, beta, bias, bias_add, keep_sum, widen)

    @staticmethod
    def _late_bias(graph, node):
        """A SkipLayerNormalization written before its bias Add became adjacent (ViT's attention output
        projection: cancel-row-transposes removes the Transpose between them in a later round) absorbs it:
        ``SkipLN(Add(y, c), s)`` → ``SkipLN(y, s, bias=c)``, the same sum (its fourth output included)."""
        shape = shape_of(graph, node.inputs[0])
        if shape is None or not shapes_equal(shape, shape_of(graph, node.inputs[1])) \
                or not isinstance(shape[-1], (int, np.integer)):
            return Refuse("shapes of the SkipLayerNormalization's inputs unknown or unequal")
        found = _bias_side(graph, node, node.inputs[0], node.inputs[1], shape, int(shape[-1]))
        if found is None:
            return Refuse("no 1-D bias Add feeds the SkipLayerNormalization")
        return _LateBias(node, *found)

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
        m, adds, inp, skip, gamma, beta, bias, bias_add, keep_sum, widen = plan
        if widen:  # the float16 operands read in float32 (the tolerance: _add_behind_cast)
            names = NameAllocator(graph)
            inp, skip = (_to_float32(graph, names, t, f"{m.root.name or 'skip_ln'}/{role}_float")
                         for t, role in ((inp, "input"), (skip, "skip")))
            if bias is not None:
                bias = new_constant(graph, f"{bias.name}_float", constant_value(graph, bias).astype(np.float32))
        inputs = [inp, skip, gamma, beta if beta is not None else empty_input()]
        if bias is not None:
            inputs.append(bias)
        nodes = list(m.nodes) + adds + ([bias_add] if bias_add is not None else [])
        fused = fuse(graph, nodes, "SkipLayerNormalization", inputs, m.root.outputs[0], attrs={"epsilon": m.eps},
                     name=f"{m.root.name}/SkipLayerNorm" if m.root.name else None)
        if keep_sum:  # outputs: normalized, (mean), (inv_std_var), input_skip_bias_sum
            fused.outputs.extend([empty_input(), empty_input(), m.x])
        return {"op": "com.microsoft.SkipLayerNormalization", "input": inp.name, "skip": skip.name,
                "bias": bias is not None, "sum_output": keep_sum, "replaced": len(nodes),
                **({"float16_sum_in_float32": True} if widen else {})}


def _add_behind_cast(graph, cast):
    """``(add, widened)`` (or a ``Refuse``) for a LayerNorm that reads ``Cast(Add(a, b))``.

    A Cast to the Add's own element type is absorbed exactly: it returns its input unchanged, so the
    op's sum is the Add's value (the Add's result must be read by the Cast alone).

    A float16 → float32 Cast (ONNX Runtime's ``skip_layer_norm_format*_with_cast`` test models: the
    residual added in float16, normalized in float32) is taken **within a stated tolerance**: the op is
    written in float32 over ``Cast(a)`` and ``Cast(b)`` (as ONNX Runtime's transformers optimizer writes
    it), so the sum (and a 1-D bias Add absorbed with it) is computed in float32 instead of being rounded
    to float16 after each Add. The only difference is that rounding, at most 2⁻¹¹ of |a + b| per element
    and Add, and it moves the result towards the exact value: the original's own float16 error. Through
    the normalization the difference is at most about 2⁻¹⁰·max|a + b|/σ·|γ|; a model whose sum is
    float16 is validated at float16's tolerances. The fused op's sum output (for other readers of the
    Cast) is that float32 sum; other readers of the float16 Add keep the Add. A float16 op instead would
    round the normalized output to float16, a larger change: never written; other Casts are refused."""
    src = cast.inputs[0]
    add = producer_of(src)
    if not is_op(add, "Add"):
        return Refuse("LayerNorm input is a Cast of something other than an Add")
    have, want = dtype_of(graph, src), cast_target(cast)
    if have is None:
        return Refuse("LayerNorm input is a Cast of an Add of unknown element type")
    if have == FP16 and want == FP32:
        return add, True
    if have != want:
        return Refuse(f"LayerNorm input is Cast({have} → {want}) of the Add: SkipLayerNormalization has one element "
                      f"type, and only a float16 sum normalized in float32 is written (in float32)")
    problem = only_read_by(graph, src, [cast])
    if problem:
        return Refuse(f"the Add behind the no-op Cast: {problem.reason}", problem.node)
    return add, False


def _to_float32(graph, names, tensor, base: str):
    """A float32 copy of the float16 ``tensor`` (a new ``Cast``; exact: every float16 value is a float32)."""
    out = gs.Variable(names(base), dtype=np.float32, shape=tensor.shape)
    graph.nodes.append(gs.Node("Cast", names(f"{base}/cast"), {"to": 1}, inputs=[tensor], outputs=[out]))
    return out


def _input_and_skip(graph, a, b):
    """``(input, skip, input_shape)`` for ``Add(a, b)``, or a ``Refuse`` saying why it cannot be the op's sum.

    Equal shapes of rank 2 or 3 (dims equal as numbers or as the same named dim-param): a is the input.
    Else a rank-3 ``[B, S, H]`` operand and a ``[1, S, H]`` or ``[S, H]`` one (S and H provably the
    same): the broadcast sum is ``[B, S, H]``, and ONNX Runtime's kernels (CPU and CUDA, since 1.16)
    read the skip at ``offset % (S·H)``, the same element numpy's broadcast adds; the full operand is
    the input. Anything else (a scalar, a batch that is not provably 1, unknown shapes) is refused."""
    sa, sb = shape_of(graph, a), shape_of(graph, b)
    if sa is None or sb is None:
        return Refuse("shapes of the Add's inputs unknown (run shape inference first)")
    if len(sa) in (2, 3) and shapes_equal(sa, sb):
        return a, b, sa
    for full, part, sf, sp in ((a, b, sa, sb), (b, a, sb, sa)):
        if (len(sf) == 3 and (len(sp) == 2 or len(sp) == 3 and dims_equal(sp[0], 1))
                and shapes_equal(sf[1:], sp[-2:])):
            return full, part, sf
    return Refuse(f"Add inputs of shapes {sa} and {sb} are neither provably equal rank-2/3 shapes nor "
                  "[B, S, H] and a [1, S, H] or [S, H] skip")


def _without_bias(node) -> bool:
    """A com.microsoft SkipLayerNormalization with no bias input."""
    return (is_ms_op(node, "SkipLayerNormalization") and len(node.inputs) >= 2
            and (len(node.inputs) < 5 or not node.inputs[4].name))


def _bias_side(graph, reader, a, b, shape, hidden: int, either: bool = True):
    """``(y, other, c, bias_add)`` when a (or b, if ``either``) is ``Add(y, c)`` read only by ``reader``,
    c a constant of ``hidden`` values (1-D) and y a non-constant of ``shape``; else None. Adding c inside
    the op is the same sum (up to float association)."""
    for first, second in ((a, b), (b, a)) if either else ((a, b),):
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
