"""Decomposed layer normalization → LayerNormalization / com.microsoft SkipLayerNormalization.

The maths: over the last k axes of x (the normalized shape),

    μ = mean(x),   σ² = mean((x − μ)²),   y = (x − μ) / √(σ² + ε) · γ + β

Exporters below opset 17 (no ONNX LayerNormalization yet) write it as

    ReduceMean(x) → Sub(x, μ) → Pow(·, 2) → ReduceMean → Add(ε) → Sqrt → Div(x − μ, ·) [→ Mul γ] [→ Add β]

Accepted variants: Mul(d, d) for the square; ``Mul(d, Reciprocal(Sqrt(·)))`` for the division (the
tf2onnx style); TensorFlow/Keras's batch-norm-style form with γ folded into the reciprocal,
``x·s + (β − μ·s)`` with ``s = γ/√(σ² + ε)`` (:func:`match_folded_scale`); the duplicated Sub of old PyTorch exports; ε or γ or β on either side of their Add/Mul;
γ/β absent (ones / no bias); ReduceMean axes as attribute (opset < 18) or constant input (opset ≥ 18);
both ReduceMeans over the same trailing axes with keepdims=1.

The matchers and parameter builders contrib-layernorm and contrib-skip-layernorm share (one file each,
where each rule's own conditions are described); not a rule itself.

Conditions as layer_norm_fusion.cc: every intermediate read only inside the pattern and not a graph
output; γ/β constants broadcasting over the normalized shape only (they are materialized to exactly
that shape when they are scalars); the normalized shape must be known when γ/β are present.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.rewrites.engine.edit import new_constant
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    FP16, consumers, constant_value, dtype_of, first_known_dtype, int_attr, internal_problem, is_graph_output,
    is_op, last_dim, other_input, producer_of, rank_of, scalar_constant, shape_of, sole_reader,
)


class LayerNormMatch:
    def __init__(self, **kw):
        self.x = kw["x"]
        self.k = kw["k"]  # number of normalized trailing axes
        self.eps = kw["eps"]
        self.gamma = kw.get("gamma")  # tensor or None
        self.beta = kw.get("beta")
        self.nodes = kw["nodes"]
        self.root = kw["root"]
        self.x_readers = kw["x_readers"]  # the pattern's nodes that read x
        self.dtype = kw.get("dtype")


def _reduce_axes(graph, node):
    """The axes (or a ``Refuse``) of a ReduceMean with keepdims=1 and explicit axes."""
    if int_attr(node, "keepdims", 1) != 1:
        return Refuse(f"{node.name or 'ReduceMean'} has keepdims=0")
    if "axes" in node.attrs:
        return [int(a) for a in node.attrs["axes"]]
    if len(node.inputs) > 1 and not node.inputs[1].is_empty():
        axes = constant_value(graph, node.inputs[1])
        if axes is None:
            return Refuse(f"{node.name or 'ReduceMean'} axes are not constant")
        return [int(a) for a in np.asarray(axes).reshape(-1)]
    return Refuse(f"{node.name or 'ReduceMean'} reduces over all axes")


def _trailing_k(graph, x, axes):
    """The number k when ``axes`` are exactly the last k axes of x, else ``None``."""
    if not axes:
        return None
    if any(a >= 0 for a in axes):
        r = rank_of(graph, x)
        if r is None:
            return None
        axes = [a - r if a >= 0 else a for a in axes]
    k = len(axes)
    return k if sorted(axes) == list(range(-k, 0)) else None


def _mean_anchor(graph, rm1):
    """``(x, mean, k, axes)`` (or a ``Refuse``) for the first ReduceMean of a decomposed LayerNorm: keepdims=1
    over the last k axes of x."""
    if len(rm1.outputs) != 1 or not rm1.inputs:
        return Refuse("ReduceMean has an unexpected number of inputs or outputs")
    axes = _reduce_axes(graph, rm1)
    if isinstance(axes, Refuse):
        return axes
    x, mu = rm1.inputs[0], rm1.outputs[0]
    k = _trailing_k(graph, x, axes)
    if k is None:
        return Refuse(f"ReduceMean axes {axes} are not the trailing axes of {x.name!r}")
    return (x, mu, k, axes)


def _std_chain(graph, sq_node, x, k, axes):
    """``(rm2, add_eps, eps_tensor, eps, sqrt)`` (or a ``Refuse``) for the standard deviation of a decomposed
    LayerNorm: ReduceMean over the same k trailing axes → Add(ε) → Sqrt, each read only by the next."""
    rm2 = sole_reader(graph, sq_node.outputs[0])
    if not is_op(rm2, "ReduceMean") or rm2.inputs[0] is not sq_node.outputs[0]:
        return Refuse("the square is not read by a ReduceMean only")
    axes2 = _reduce_axes(graph, rm2)
    if isinstance(axes2, Refuse):
        return axes2
    if _trailing_k(graph, sq_node.outputs[0], axes2) != k:
        return Refuse(f"the two ReduceMeans reduce different axes ({axes} vs {axes2})")
    add_eps = sole_reader(graph, rm2.outputs[0])
    if not is_op(add_eps, "Add"):
        return Refuse("the variance is not read by an Add(ε) only")
    eps_t = other_input(add_eps, rm2.outputs[0])
    eps = scalar_constant(graph, eps_t) if eps_t is not None else None
    if eps is None or eps.ndim > 0 and rank_of(graph, x) is None:
        return Refuse("ε is not a scalar constant")
    sqrt = sole_reader(graph, add_eps.outputs[0])
    if not is_op(sqrt, "Sqrt"):
        return Refuse("variance + ε is not read by a Sqrt only")
    return (rm2, add_eps, eps_t, eps, sqrt)


def _square_of(graph, n, d) -> bool:
    """True when node ``n`` computes d²: ``Pow(d, 2)`` or ``Mul(d, d)``."""
    if is_op(n, "Pow") and n.inputs[0] is d:
        e = scalar_constant(graph, n.inputs[1])
        return e is not None and float(e.reshape(())) == 2.0
    return is_op(n, "Mul") and n.inputs[0] is d and n.inputs[1] is d


def _constant_operand(graph, node, op: str, tensor):
    """The constant other operand when ``node`` is ``op(tensor, c)`` or ``op(c, tensor)``, else None."""
    if not is_op(node, op):
        return None
    c = other_input(node, tensor)
    return c if c is not None and constant_value(graph, c) is not None else None


def _finish(graph, x, k, eps_t, eps, gamma, beta, nodes, root, x_readers):
    """The :class:`LayerNormMatch` both decomposed forms end in, once its nodes are known to be private."""
    problem = internal_problem(graph, nodes, root)
    if problem:
        return problem
    dtype = first_known_dtype(graph, *(t for t in (eps_t, gamma, beta) if t is not None), x)
    return LayerNormMatch(x=x, k=k, eps=float(eps.reshape(())), gamma=gamma, beta=beta, nodes=nodes,
                                root=root, x_readers=x_readers, dtype=dtype)


def match_decomposed(graph, rm1):
    """Match the decomposed form anchored at its first ReduceMean: a ``LayerNormMatch`` or a ``Refuse``."""
    anchor = _mean_anchor(graph, rm1)
    if isinstance(anchor, Refuse):
        return anchor
    x, mu, k, axes = anchor
    subs = consumers(mu)
    if not subs or len(subs) > 2 or is_graph_output(graph, mu):
        return Refuse("the mean is not read by one or two Subs only")
    for s in subs:
        if not is_op(s, "Sub") or s.inputs[0] is not x or s.inputs[1] is not mu:
            return Refuse(f"the mean is read by {s.op}, not by Sub(x, mean)")
    # PyTorch's float16 exports compute the variance in float (double when exported on the CPU):
    # Sub → Cast → Pow … Div → Cast back. LayerNormalization(stash_type=1) computes all of it in float,
    # which is at least as accurate as the float16 mean and difference of the decomposed form.
    upcast = sole_reader(graph, subs[0].outputs[0]) if len(subs) == 1 else None
    if not (is_op(upcast, "Cast")
            and int(upcast.attrs.get("to", 0)) in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
            and dtype_of(graph, x) == FP16):
        upcast = None
    diffs = [upcast.outputs[0]] if upcast is not None else [s.outputs[0] for s in subs]
    readers = [(d, r) for d in diffs for r in consumers(d)]
    if len(readers) != 2 or any(is_graph_output(graph, d) for d in diffs):
        return Refuse("x − mean is not read exactly by the square and the division")

    sq = [(d, n) for d, n in readers if _square_of(graph, n, d)]
    if len(sq) != 1:
        return Refuse("no (x − mean)² node")
    (d_sq, sq_node), = sq
    (d_div, div_node), = [(d, n) for d, n in readers if n is not sq_node]

    chain = _std_chain(graph, sq_node, x, k, axes)
    if isinstance(chain, Refuse):
        return chain
    rm2, add_eps, eps_t, eps, sqrt = chain
    nodes = [rm1, *subs, sq_node, rm2, add_eps, sqrt]
    std = sqrt.outputs[0]
    if is_op(div_node, "Div"):
        if div_node.inputs[0] is not d_div or div_node.inputs[1] is not std:
            return Refuse("the division is not (x − mean) / √(σ² + ε)")
    elif is_op(div_node, "Mul"):
        recip = producer_of(other_input(div_node, d_div)) if other_input(div_node, d_div) is not None else None
        if not is_op(recip, "Reciprocal") or recip.inputs[0] is not std:
            return Refuse("the product is not (x − mean) · 1/√(σ² + ε)")
        nodes.append(recip)
    else:
        return Refuse(f"x − mean is read by {div_node.op}, not a Div")
    nodes.append(div_node)
    root = div_node
    if upcast is not None:
        down = sole_reader(graph, div_node.outputs[0])
        want = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype_of(graph, x)))
        if not is_op(down, "Cast") or int(down.attrs.get("to", 0)) != want:
            return Refuse("the float division is not cast back to x's type")
        nodes += [upcast, down]
        root = down
    nxt = sole_reader(graph, root.outputs[0])
    gamma = _constant_operand(graph, nxt, "Mul", root.outputs[0])
    if gamma is not None:
        root = nxt
        nodes.append(nxt)
        nxt = sole_reader(graph, root.outputs[0])
    beta = _constant_operand(graph, nxt, "Add", root.outputs[0])
    if beta is not None:
        root = nxt
        nodes.append(nxt)
    # The Cast form's ε is a float32 constant: the op's type is x's (and γ/β's).
    return _finish(graph, x, k, None if upcast is not None else eps_t, eps, gamma, beta, nodes, root,
                   [rm1, *subs])


def match_folded_scale(graph, rm1):
    """The tf2onnx / Keras form, γ folded into the reciprocal std and the mean subtracted after scaling
    (TensorFlow's batch-norm-style LayerNorm: ``moments`` then ``x·s + (β − μ·s)``)::

        μ = ReduceMean(x);  v = ReduceMean((x − μ)²);  s = Reciprocal(Sqrt(v + ε)) [· γ]
        y = Add(Mul(x, s), Sub(β, Mul(μ, s)))      or, without β,  y = Sub(Mul(x, s), Mul(μ, s))

    a ``LayerNormMatch`` or a ``Refuse``. y = (x − μ)·s + β, i.e. LayerNorm; the LayerNorm kernel computes it
    with less cancellation than the decomposed form when |μ| ≫ σ.
    """
    anchor = _mean_anchor(graph, rm1)
    if isinstance(anchor, Refuse):
        return anchor
    x, mu, k, axes = anchor
    readers = consumers(mu)
    subs = [r for r in readers if is_op(r, "Sub") and r.inputs[0] is x and r.inputs[1] is mu]
    muls = [r for r in readers if is_op(r, "Mul")]
    if len(readers) != 2 or len(subs) != 1 or len(muls) != 1 or is_graph_output(graph, mu):
        return Refuse("the mean is not read by exactly Sub(x, mean) and Mul(mean, s)")
    sub, mul_mu = subs[0], muls[0]
    sq = sole_reader(graph, sub.outputs[0])
    if sq is None or not _square_of(graph, sq, sub.outputs[0]):
        return Refuse("x − mean is not read by a square only")
    chain = _std_chain(graph, sq, x, k, axes)
    if isinstance(chain, Refuse):
        return chain
    rm2, add_eps, eps_t, eps, sqrt = chain
    recip = sole_reader(graph, sqrt.outputs[0])
    if not is_op(recip, "Reciprocal"):
        return Refuse("the std is not read by a Reciprocal only")
    nodes = [rm1, sub, sq, rm2, add_eps, sqrt, recip]
    scale = recip.outputs[0]
    g_mul = sole_reader(graph, scale)
    gamma = _constant_operand(graph, g_mul, "Mul", scale)
    if gamma is not None:
        scale = g_mul.outputs[0]
        nodes.append(g_mul)
    s_readers = consumers(scale)
    if is_graph_output(graph, scale) or len(s_readers) != 2 or mul_mu not in s_readers:
        return Refuse("the scale is not read by exactly Mul(x, s) and Mul(mean, s)")
    if other_input(mul_mu, mu) is not scale:
        return Refuse("Mul(mean, ·) does not multiply by the scale")
    (mul_x,) = [r for r in s_readers if r is not mul_mu]
    if not is_op(mul_x, "Mul") or other_input(mul_x, scale) is not x:
        return Refuse("the scale is not applied to x")
    xm, mm = mul_x.outputs[0], mul_mu.outputs[0]
    beta = None
    root = sole_reader(graph, xm)
    if is_op(root, "Sub") and root.inputs[0] is xm and root.inputs[1] is mm:
        nodes += [mul_x, mul_mu, root]
    else:
        sub_beta = sole_reader(graph, mm)
        if not is_op(sub_beta, "Sub") or sub_beta.inputs[1] is not mm:
            return Refuse("mean · s is not subtracted from β or from x · s")
        beta = sub_beta.inputs[0]
        if constant_value(graph, beta) is None:
            return Refuse("β is not a constant")
        if not is_op(root, "Add") or other_input(root, xm) is not sub_beta.outputs[0]:
            return Refuse("x · s is not added to β − mean · s")
        nodes += [mul_x, mul_mu, sub_beta, root]
    return _finish(graph, x, k, eps_t, eps, gamma, beta, nodes, root, [rm1, sub, mul_x])


def match_any_decomposed(graph, rm1):
    """:func:`match_decomposed`, else :func:`match_folded_scale`; the first one's refusal when neither."""
    m = match_decomposed(graph, rm1)
    if not isinstance(m, Refuse):
        return m
    m2 = match_folded_scale(graph, rm1)
    return m if isinstance(m2, Refuse) else m2


def match_standard(graph, ln):
    """An ONNX LayerNormalization node as a :class:`LayerNormMatch` (normalizing the last axis only)."""
    if len(ln.inputs) < 2 or ln.inputs[1].is_empty():
        return Refuse("LayerNormalization has no scale input")
    if len(ln.outputs) > 1 and any(o.outputs or is_graph_output(graph, o) for o in ln.outputs[1:]):
        return Refuse("LayerNormalization's mean / inverse std outputs are used")
    axis = int_attr(ln, "axis", -1)
    x = ln.inputs[0]
    r = rank_of(graph, x)
    if not (axis == -1 or (r is not None and axis == r - 1)):
        return Refuse(f"LayerNormalization axis={axis} is not the last axis")
    beta = ln.inputs[2] if len(ln.inputs) > 2 and not ln.inputs[2].is_empty() else None
    dtypes = {first_known_dtype(graph, t) for t in (x, ln.inputs[1], beta) if t is not None} - {None}
    if len(dtypes) > 1:
        # ONNX Runtime's own LayerNormalization below opset 17 (kept as ORT runs it, onnxfuse/repair.py)
        # lets Y follow a float32 scale over a float16 x; fused ops take one type (ORT refused the
        # SkipLayerNormalization written for its skip_layer_norm_no_beta_with_cast.onnx)
        return Refuse(f"LayerNormalization mixes {' and '.join(sorted(str(d) for d in dtypes))} (one type in the fused ops)")
    return LayerNormMatch(x=x, k=1, eps=float(ln.attrs.get("epsilon", 1e-5)), gamma=ln.inputs[1], beta=beta,
                                nodes=[ln], root=ln, x_readers=[ln],
                                dtype=first_known_dtype(graph, ln.inputs[1], x))


def _affine_param(graph, tensor, norm_shape, rank, what, role):
    """The tensor (or a ``Refuse``): γ/β as a constant of exactly the normalized shape (reused when it already is)."""
    value = constant_value(graph, tensor)
    if value is None:
        return Refuse(f"{what} {tensor.name!r} is not a constant")
    if tuple(value.shape) == tuple(norm_shape):
        return tensor
    if rank is not None and value.ndim > rank:
        return Refuse(f"{what} of shape {value.shape} would broadcast x to a higher rank")
    k = len(norm_shape)
    lead = value.shape[: max(value.ndim - k, 0)]
    if any(d != 1 for d in lead):
        return Refuse(f"{what} of shape {value.shape} varies outside the normalized axes")
    tail = value.reshape(value.shape[len(lead):])
    try:
        full = np.broadcast_to(tail, norm_shape)
    except ValueError:
        return Refuse(f"{what} of shape {value.shape} does not broadcast to the normalized shape {tuple(norm_shape)}")
    return new_constant(graph, f"{tensor.name}_{role}", full.copy())


def _norm_shape(graph, x, k):
    s = shape_of(graph, x)
    if s is None or len(s) < k:
        return None
    tail = s[len(s) - k:]
    return tuple(int(d) for d in tail) if all(isinstance(d, (int, np.integer)) for d in tail) else None


def layernorm_params(graph, m, dtype):
    """``(gamma_tensor, beta_tensor_or_None)`` over the normalized shape, or a ``Refuse``."""
    norm_shape = _norm_shape(graph, m.x, m.k)
    if norm_shape is None:
        if m.k == 1:
            d = last_dim(graph, m.x)
            norm_shape = (d,) if d is not None else None
    if norm_shape is None:
        return Refuse(f"normalized shape of {m.x.name!r} unknown (run shape inference first)")
    rank = rank_of(graph, m.x)
    if m.gamma is None:
        gamma = new_constant(graph, f"{m.x.name}_ln_scale", np.ones(norm_shape, dtype=dtype))
    else:
        gamma = _affine_param(graph, m.gamma, norm_shape, rank, "γ", "ln_scale")
        if isinstance(gamma, Refuse):
            return gamma
    beta = None
    if m.beta is not None:
        beta = _affine_param(graph, m.beta, norm_shape, rank, "β", "ln_bias")
        if isinstance(beta, Refuse):
            return beta
    return gamma, beta


def mean_candidate(node) -> bool:
    """A ReduceMean whose result is read by Subs only: the first node of a decomposed LayerNorm."""
    if not is_op(node, "ReduceMean") or len(node.outputs) != 1:
        return False
    readers = consumers(node.outputs[0])
    return any(is_op(r, "Sub") for r in readers) and all(is_op(r, "Sub", "Mul") for r in readers)


def skip_layernorm_params(graph, m, d, dtype):
    """``(gamma, beta_or_None)`` of shape (d,) for SkipLayerNormalization, or a ``Refuse``."""
    rank = rank_of(graph, m.x)
    if m.gamma is None:
        gamma = new_constant(graph, f"{m.x.name}_ln_scale", np.ones((d,), dtype=dtype))
    else:
        gamma = _affine_param(graph, m.gamma, (d,), rank, "γ", "ln_scale")
        if isinstance(gamma, Refuse):
            return gamma
    beta = None
    if m.beta is not None:
        beta = _affine_param(graph, m.beta, (d,), rank, "β", "ln_bias")
        if isinstance(beta, Refuse):
            return beta
    return gamma, beta
