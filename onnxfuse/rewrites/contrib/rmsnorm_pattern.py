"""Decomposed RMS normalization (RMSNorm): the matcher and parameter builder contrib-rmsnorm and
contrib-skip-rmsnorm share; not a rule itself.

The maths, over the last axis of x (d elements):

    y = x / √(mean(x²) + ε) · γ

No mean is subtracted and there is no β (Zhang & Sennrich 2019). Hugging Face's Llama, Mistral, Qwen2
and T5 write it (``LlamaRMSNorm``, ``T5LayerNorm``) with the statistics in a float32 island inside a
float16 model, which torch's exporters give as::

    x32 = Cast(x, to=float)                       (optional: absent in a float32 model)
    v   = ReduceMean(Pow(x32, 2) | Mul(x32, x32), axes=[-1], keepdims=1)
    s   = Sqrt(Add(v, ε))
    n   = Mul(x32, Reciprocal(s)) | Mul(x32, Div(1, s)) | Div(x32, s)
    y   = Mul(γ, Cast(n, to=x's type))             (Llama, T5: γ after the cast back)
        | Cast(Mul(γ, n), to=x's type)             (γ inside the island)
        | Mul(γ, n)  |  n                          (no island; γ absent = ones)

Accepted variants: every operand order of the commutative Add/Mul; the reduction axes as attribute
(opset < 18) or constant input (opset ≥ 18), given as −1 or rank − 1; ε and γ constants of any rank
that broadcast over the last axis only (a scalar ε, γ of shape (d,), (1, …, 1, d) or size 1, made
(d,) in x's type); the reciprocal written ``Reciprocal`` (dynamo) or ``Div(1, ·)`` (TorchScript's
``rsqrt``); in a float32 island, the normalization reading x through a Cast of its own (T5's
``x * rsqrt(v)`` with x float16: torch's type promotion writes a second ``Cast(x, float)``).

Conditions (as ONNX Runtime's SimplifiedLayerNormFusion): normalized over the last axis only (the
fused kernels take no other); every intermediate read only inside the pattern and not a graph output;
ε a constant; γ a constant (a run-time γ stays a Mul after the fused op); x float16 or float32, the
element types both ops have on CPU and CUDA (bfloat16 is refused: ONNX Runtime's CUDA
SkipSimplifiedLayerNormalization and its CPU RMSNormalization have no bfloat16 kernel); in a float32
island, the result cast back to x's type (a float32 result of a float16 input has no fused op of one
type); the hidden size d known.

Exactness: the fused ops compute n·γ with float32 statistics (RMSNormalization and
SimplifiedLayerNormalization with stash_type=1; ONNX Runtime's CPU SkipSimplifiedLayerNormalization
accumulates in float too). Against the decomposed form in float32 they differ by float32 rounding only
(mean and square root in another order: relative ~1e-6). For a float16 model with a float32 island,
the island's result is rounded to float16 once in both; γ applied inside the island is rounded to
float16 first (≤ 2⁻¹¹ relative, within float16's tolerance). ONNX Runtime's *CUDA*
SkipSimplifiedLayerNormalization computes a float16 model's statistics in float16 by default
(``contrib_ops/cuda/bert/skip_layer_norm_impl.cu`` and ``layer_norm.cuh``: the sum of x²/d, ε and the
reciprocal square root in ``half``; the provider option ``enable_skip_layer_norm_strict_mode=1`` takes
the float path): see contrib-skip-rmsnorm.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import onnx

from onnxfuse.rewrites.engine.edit import new_constant
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    BF16, FP16, FP32, axes_of, constant_value, dtype_of, int_attr, internal_problem,
    is_op, last_dim, only_read_by, other_input, producer_of, rank_of, scalar_constant, sole_reader,
)

#: Element types of x an upcast RMSNorm (``Cast(x, float)`` first) reads: ONNX Runtime's CPU and CUDA
#: kernels both have them.
UPCAST_DTYPES = (FP16, FP32)
#: Element types the fused RMSNorm ops take here: those, and bfloat16, which their CUDA kernels take
#: (:data:`~onnxfuse.rewrites.facts.graph.BF16`; a bfloat16 model is one for CUDA).
RMS_DTYPES = UPCAST_DTYPES + BF16


class RmsNormMatch(NamedTuple):
    x: object  # the input as the fused op reads it (before the float32 upcast, if any)
    eps: float
    gamma: object  # constant tensor, or None (ones)
    nodes: list
    root: object  # the node writing the normalized (and scaled) output
    x_readers: list  # the pattern's nodes that read x
    dtype: np.dtype | None  # x's element type


def rms_candidate(node) -> bool:
    """A ReduceMean of a square: the node an RMSNorm is anchored at (cheap pre-filter)."""
    if not is_op(node, "ReduceMean") or len(node.outputs) != 1 or not node.inputs:
        return False
    return is_op(producer_of(node.inputs[0]), "Pow", "Mul")


def _squared(graph, node):
    """x when ``node`` computes x²: ``Pow(x, 2)`` or ``Mul(x, x)``; else None."""
    if is_op(node, "Pow") and len(node.inputs) == 2:
        e = scalar_constant(graph, node.inputs[1])
        return node.inputs[0] if e is not None and float(e.reshape(())) == 2.0 else None
    if is_op(node, "Mul") and len(node.inputs) == 2 and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    return None


def _last_axis_only(graph, rm, x) -> Refuse | None:
    """A refusal unless ``rm`` is ReduceMean over the last axis of ``x`` with keepdims=1."""
    if int_attr(rm, "keepdims", 1) != 1:
        return Refuse("the ReduceMean has keepdims=0")
    axes = axes_of(graph, rm)
    if axes is None:
        return Refuse("the ReduceMean's axes are not a constant list (or it reduces over all axes)")
    r = rank_of(graph, x)
    if axes == [-1] or (r is not None and axes == [r - 1]):
        return None
    return Refuse(f"ReduceMean axes {axes} are not the last axis only (the fused ops normalize the last axis)")


def _to_of(node) -> int:
    return int(node.attrs.get("to", 0))


def _upcast(graph, tensor):
    """The node when ``tensor`` is ``Cast(x, to=float)`` of a float16/float32 x, else None."""
    p = producer_of(tensor)
    if is_op(p, "Cast") and _to_of(p) == onnx.TensorProto.FLOAT and dtype_of(graph, p.inputs[0]) in UPCAST_DTYPES:
        return p
    return None


def _normalization(graph, sqrt, x32):
    """The nodes (or a ``Refuse``): the nodes dividing x by √(v + ε), the last one writing the result. x is read
    as x32 or, in a float32 island, as another ``Cast(x, float)`` of the same x (T5's ``x * rsqrt(v)``,
    the float16 x promoted to float by a Cast of its own), which then comes first in ``nodes``."""
    up = _upcast(graph, x32)

    def operand(t):
        """[] when t is x32, [its Cast] when t is another upcast of x, None otherwise."""
        if t is x32:
            return []
        other = _upcast(graph, t) if t is not None else None
        return [other] if up is not None and other is not None and other.inputs[0] is up.inputs[0] else None

    reader = sole_reader(graph, sqrt.outputs[0])
    if is_op(reader, "Div") and reader.inputs[0] is sqrt.outputs[0]:
        return Refuse("√(mean(x²) + ε) is divided, not the divisor")
    if is_op(reader, "Div") and reader.inputs[1] is sqrt.outputs[0]:
        cast = operand(reader.inputs[0])
        if cast is not None:
            return [*cast, reader]
        one = constant_value(graph, reader.inputs[0])
        if one is None or one.size != 1 or float(one.reshape(-1)[0]) != 1.0:
            return Refuse("√(mean(x²) + ε) divides neither x nor 1")
        recip = reader
    elif is_op(reader, "Reciprocal"):
        recip = reader
    else:
        return Refuse("√(mean(x²) + ε) is not read by one Div or Reciprocal only")
    mul = sole_reader(graph, recip.outputs[0])
    cast = operand(other_input(mul, recip.outputs[0])) if is_op(mul, "Mul") else None
    if cast is None:
        return Refuse("1/√(mean(x²) + ε) is not multiplied by x only")
    return [*cast, recip, mul]


def match_rmsnorm(graph, rm, through_upcast: bool = True):
    """Match the decomposed RMSNorm anchored at its ReduceMean: an ``RmsNormMatch`` or a ``Refuse``.
    ``through_upcast=False``: x is the float32 tensor the statistics read, even where it is a Cast of a
    float16 tensor (no island, no cast back looked for)."""
    if not rms_candidate(rm):
        return Refuse("not a ReduceMean of a square")
    sq = producer_of(rm.inputs[0])
    x32 = _squared(graph, sq)
    if x32 is None:
        return Refuse(f"the ReduceMean reads {sq.op}, not x² (Pow(x, 2) or Mul(x, x))")
    if sole_reader(graph, sq.outputs[0]) is not rm:
        return Refuse("x² is also read outside the pattern")
    problem = _last_axis_only(graph, rm, x32)
    if problem:
        return problem
    add_eps = sole_reader(graph, rm.outputs[0])
    if not is_op(add_eps, "Add"):
        return Refuse("mean(x²) is not read by one Add(ε) only")
    eps_t = other_input(add_eps, rm.outputs[0])
    eps = scalar_constant(graph, eps_t) if eps_t is not None else None
    if eps is None:
        return Refuse("ε is not a size-1 constant")
    r = rank_of(graph, x32)
    if eps.ndim > 0 and (r is None or eps.ndim > r):
        return Refuse(f"ε of shape {eps.shape} may broadcast x to a higher rank")
    sqrt = sole_reader(graph, add_eps.outputs[0])
    if not is_op(sqrt, "Sqrt"):
        return Refuse("mean(x²) + ε is not read by one Sqrt only")
    norm_nodes = _normalization(graph, sqrt, x32)
    if isinstance(norm_nodes, Refuse):
        return norm_nodes
    norm = norm_nodes[-1]
    nodes = [sq, rm, add_eps, sqrt, *norm_nodes]
    second_cast = [n for n in norm_nodes if n.op == "Cast"]  # T5: the normalization's own upcast of x

    # The float32 island: x32 = Cast(x, float) read by the square and the normalization only.
    upcast = _upcast(graph, x32) if through_upcast else None
    if upcast is not None:
        x, x_readers = upcast.inputs[0], [upcast, *second_cast]
        if dtype_of(graph, x) == FP32 and only_read_by(graph, x32, [sq, norm]):
            # torch's .to(float32) of a float32 tensor: a Cast that changes nothing, whose output the
            # residual stream reads too. It stays for those readers; the fused op reads its input.
            x_readers = second_cast
        else:
            nodes.append(upcast)
    else:
        upcast, x, x_readers = None, x32, [sq, norm]
    dtype = dtype_of(graph, x)
    back_to = onnx.helper.np_dtype_to_tensor_dtype(dtype) if dtype is not None else None

    # The tail: the cast back (in an island) and γ, in either order.
    root, gamma, cast_back = norm, None, None
    for _ in range(2):
        nxt = sole_reader(graph, root.outputs[0])
        if upcast is not None and cast_back is None and is_op(nxt, "Cast") and _to_of(nxt) == back_to:
            cast_back = root = nxt
        elif gamma is None and is_op(nxt, "Mul") and constant_value(graph, other_input(nxt, root.outputs[0])) is not None:
            gamma = other_input(nxt, root.outputs[0])
            root = nxt
        else:
            break
        nodes.append(root)
    if upcast is not None and dtype != FP32 and cast_back is None:
        return Refuse("the float32 normalization is not cast back to x's type")
    problem = internal_problem(graph, nodes, root)
    if problem:
        return problem
    return RmsNormMatch(x=x, eps=float(eps.reshape(())), gamma=gamma, nodes=nodes, root=root,
                              x_readers=x_readers, dtype=dtype)


def rmsnorm_gamma(graph, m: RmsNormMatch, role: str = "rms_scale"):
    """The tensor (or a ``Refuse``): γ as a constant of shape (d,) in x's type (ones when absent)."""
    d = last_dim(graph, m.x)
    if d is None:
        return Refuse(f"hidden size (last dimension of {m.x.name!r}) unknown (run shape inference first)")
    if m.gamma is None:
        return new_constant(graph, f"{m.x.name}_{role}", np.ones((d,), dtype=m.dtype))
    value = constant_value(graph, m.gamma)
    r = rank_of(graph, m.x)
    if value.ndim > 0 and (r is None or value.ndim > r):
        return Refuse(f"γ of shape {value.shape} may broadcast x to a higher rank")
    if any(s != 1 for s in value.shape[:-1]) or (value.ndim and value.shape[-1] not in (1, d)):
        return Refuse(f"γ of shape {value.shape} varies outside the last axis (d = {d})")
    full = np.broadcast_to(value.reshape(-1), (d,)).astype(m.dtype)
    if value.shape == (d,) and value.dtype == m.dtype:
        return m.gamma
    return new_constant(graph, f"{m.gamma.name}_{role}", full.copy())
