"""contrib-mixed-rmsnorm: a float32 RMSNorm (with its residual Add) whose result is cast to float16
before γ multiplies → one ``ai.onnxfuse.MixedRMSNorm`` kernel.

Why
---
torch's legacy exporter writes transformers' default (sdpa) attention of a float16 Llama-family decoder
with float32 mask constants, so the attention's output, the output projection and the residual stream
after it are float32 (docs/benchmarks.md 5.36). Each RMSNorm then normalizes the float32 residual sum and
casts to float16 before its float16 γ multiplies::

    a32 = Cast(a, to=float)              (a: the MLP's float16 output; absent after the attention)
    s   = Add(residual, a32)             (float32: the residual stream, read on by the next layer)
    n   = s / √(mean(s²) + ε)            (float32: the decomposed form of rmsnorm_pattern)
    y   = Mul(γ, Cast(n, to=float16))

ONNX Runtime has no op of those types: SkipSimplifiedLayerNormalization (contrib-skip-rmsnorm) takes
one element type, so it took the float32 part and left the Cast and γ as a FusedElementwise kernel,
and the Cast of the MLP's output as another: three kernels per RMSNorm where the eager export's float16
residual stream needs one. In a decode step every kernel is host time: the sdpa export's output had 95
more nodes than the eager export's and was 1.04-1.30x onnxruntime-genai's time where the eager
export's was 0.81-0.96x (docs/benchmarks.md 5.33, 5.36).

What (exact up to the order of the squares' float32 sum)
---------------------------------------------------------
``y, s = MixedRMSNorm(x, skip, γ)`` (csrc/mixed_rmsnorm.cc, contract in docs/custom-ops.md): s =
float(x) + skip and n = s · (1 / √(Σ s²/d + ε)) in float32, as the graph computes them (IEEE square
root and division); y = float16(float16(n) · γ), the graph's Cast and float16 Mul. Only the sum of the
squares runs in another order than ONNX Runtime's ReduceMean (float32 rounding, relative ~1e-7 in the
mean), which can move a rounding to float16 by one unit in the last place. x is the Add's operand
that is a Cast of a float16 (or bfloat16) tensor read only by the Add (the op reads the float16 tensor
itself); without one, the Add's first operand. Without an Add (or one that broadcasts, or adds a
constant) the op normalizes x alone. ``s`` is written only where the graph reads the Add's value
elsewhere (the residual stream); a float16 result read by no γ gets γ = 1.

Refused: a normalization not in float32, γ inside the float32 island (Gemma's ``(1 + w)`` multiplies
before the cast: another rounding), a cast to another type than float16 (bfloat16: the rewrite engine
has no bfloat16 constants; the kernel takes it), a run-time γ, the Cast or the Mul's input read
elsewhere, the hidden size unknown, and everything rmsnorm_pattern refuses. A float16 normalization
(the eager export's island) stays contrib-skip-rmsnorm's: ONNX Runtime's kernel for it is measured.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.custom_ops import DOMAIN
from onnxfuse.rewrites.contrib.matching import ContribRule
from onnxfuse.rewrites.contrib.rmsnorm_pattern import match_rmsnorm, rms_candidate, rmsnorm_gamma
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    FP16, FP32, constant_value, dtype_of, internal_problem, is_op, last_dim, only_read_by, other_input,
    producer_of, shape_of, shapes_equal, sole_reader,
)

#: The op this rule writes (csrc/mixed_rmsnorm.cc).
OP_TYPE = "MixedRMSNorm"


def _half_tail(graph, root):
    """``(cast, mul, γ tensor)`` when ``root``'s float32 result is read by one ``Cast(to=float16)`` only and
    that by one ``Mul`` with a constant (``mul`` and γ None when the Cast's result is read otherwise),
    else a ``Refuse``."""
    cast = sole_reader(graph, root.outputs[0])
    if not (is_op(cast, "Cast") and int(cast.attrs.get("to", 0)) == onnx.TensorProto.FLOAT16):
        return Refuse("the float32 normalization is not read by one Cast to float16 only")
    mul = sole_reader(graph, cast.outputs[0])
    if is_op(mul, "Mul") and len(mul.inputs) == 2:
        gamma = other_input(mul, cast.outputs[0])
        if gamma is not None and constant_value(graph, gamma) is not None:
            return cast, mul, gamma
    return cast, None, None


def _float16_upcast(graph, tensor):
    """The node when ``tensor`` is ``Cast(h, to=float)`` of a float16 h, else None."""
    p = producer_of(tensor)
    if is_op(p, "Cast") and int(p.attrs.get("to", 0)) == onnx.TensorProto.FLOAT and dtype_of(graph, p.inputs[0]) == FP16:
        return p
    return None


def _half_source(graph, tensor, reader):
    """The float16 tensor h when ``tensor`` is ``Cast(h, to=float)`` read by ``reader`` only, else None."""
    p = _float16_upcast(graph, tensor)
    return p.inputs[0] if p is not None and only_read_by(graph, tensor, [reader]) is None else None


def _residual(graph, m):
    """``(x, skip, add, absorbed)`` for the op's inputs: the residual Add of two run-time float32 tensors of
    equal shape feeding the normalization (skip None and add None without one); ``absorbed``: the Cast
    nodes the op replaces."""
    add = producer_of(m.x)
    if not (is_op(add, "Add") and len(add.inputs) == 2):
        return m.x, None, None, []
    a, b = add.inputs
    if constant_value(graph, a) is not None or constant_value(graph, b) is not None:
        return m.x, None, None, []
    if dtype_of(graph, a) != FP32 or dtype_of(graph, b) != FP32 or not shapes_equal(shape_of(graph, a), shape_of(graph, b)):
        return m.x, None, None, []
    if _half_source(graph, a, add) is None and _half_source(graph, b, add) is not None:
        a, b = b, a
    half = _half_source(graph, a, add)
    return (half, b, add, [producer_of(a)]) if half is not None else (a, b, add, [])


def _stream_start(graph, m):
    """The node when the float32 x of ``m`` (matched without looking through an upcast) is ``Cast(h,
    to=float)`` of a float16 h and read outside the normalization too: a float32 residual stream starting
    there (the first layer of the sdpa export). None otherwise: a float32 island read by the normalization
    only is the float16 model's own RMSNorm, contrib-skip-rmsnorm's."""
    p = _float16_upcast(graph, m.x)
    return p if p is not None and only_read_by(graph, m.x, m.x_readers) is not None else None


class ContribMixedRmsNorm(ContribRule):
    name = "contrib-mixed-rmsnorm"
    description = ("a float32 RMSNorm (and its residual Add) cast to float16 before γ → one MixedRMSNorm kernel "
                   "(ai.onnxfuse)")
    targets = frozenset({"cuda"})  # an ai.onnxfuse op, like DecodeAttention

    def match(self, graph):
        return [n for n in graph.nodes if rms_candidate(n)]

    def analyze(self, graph, node):
        m = match_rmsnorm(graph, node)
        start = None  # the Cast starting a float32 residual stream from a float16 tensor (the first layer)
        if isinstance(m, Refuse) or m.dtype != FP32:
            plain = match_rmsnorm(graph, node, through_upcast=False)
            if isinstance(plain, Refuse):
                return m if isinstance(m, Refuse) else plain
            start = _stream_start(graph, plain)
            if start is None:
                return Refuse("the normalization is not of a float32 x (a float16 island is contrib-skip-rmsnorm's)")
            m = plain
        if m.gamma is not None:
            return Refuse("γ multiplies inside the float32 island (rounded once there, not after the cast)")
        tail = _half_tail(graph, m.root)
        if isinstance(tail, Refuse):
            return tail
        cast, mul, gamma_t = tail
        d = last_dim(graph, m.x)
        if d is None:
            return Refuse(f"hidden size (last dimension of {m.x.name!r}) unknown (run shape inference first)")
        gamma = rmsnorm_gamma(graph, m._replace(gamma=gamma_t, dtype=FP16), "mixed_rms_scale")
        if isinstance(gamma, Refuse):
            return gamma
        nodes = [*m.nodes, cast] + ([mul] if mul is not None else [])
        root = nodes[-1]
        problem = internal_problem(graph, nodes, root)
        if problem:
            return problem
        if start is not None:  # the op reads the float16 tensor and writes the stream's float32 start as its sum
            x, skip, add, absorbed, keep_sum = start.inputs[0], None, None, [start], True
            nodes.append(start)
        else:
            x, skip, add, absorbed = _residual(graph, m)
            nodes += [add, *absorbed] if add is not None else []
            keep_sum = add is not None and only_read_by(graph, m.x, m.x_readers) is not None
        return dict(nodes=nodes, root=root, x=x, skip=skip, gamma=gamma, eps=m.eps, keep_sum=keep_sum, sum=m.x)

    def apply(self, graph, node, plan):
        inputs = [plan["x"]] + ([plan["skip"]] if plan["skip"] is not None else []) + [plan["gamma"]]
        root = plan["root"]
        fused = fuse(graph, plan["nodes"], OP_TYPE, inputs, root.outputs[0],
                     attrs={"spec": f"epsilon={float(np.float32(plan['eps'])):.9g}"}, domain=DOMAIN,
                     name=f"{root.name}/{OP_TYPE}" if root.name else None)
        if plan["keep_sum"]:
            fused.outputs.append(plan["sum"])
        return {"op": f"{DOMAIN}.{OP_TYPE}", "input": plan["x"].name,
                "skip": plan["skip"].name if plan["skip"] is not None else None,
                "epsilon": plan["eps"], "sum_output": plan["keep_sum"], "replaced": len(plan["nodes"])}
