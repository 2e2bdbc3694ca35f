"""q, k and v as projections of one tensor: packed into ``Attention``'s one weight and bias, or, not
packed, their biases folded into MultiHeadAttention's ``bias`` input.

**Projection biases** (batch-first only): when q, k and v are each ``Add(MatMul(·), b)`` with ``b`` a
1-D constant of E values, or a bare MatMul output (its bias is then E zeros, and ``x + 0 == x``:
Whisper's bias-free ``k_proj``), with at least one real bias and each read only by the attention, the
[3E] concatenation becomes MultiHeadAttention's ``bias`` input and the kernel adds it. Otherwise q, k
and v are taken as they are (when the projections are not packed into ``Attention``: below).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.facts import single_reader
from onnxfuse.rewrites.contrib.attention.layout import copies_dim
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    axes_of,
    constant_value,
    dtype_of,
    is_op,
    only_read_by,
    perm_of,
    producer_of,
    rank_of,
    shape_of,
)
from onnxfuse.rewrites.facts.row_wise import row_wise_gemm

def projection_bias(graph, tensor):
    """(MatMul output, bias values, Add) when ``tensor`` = Add(MatMul(...), b) with b a 1-D constant."""
    p = producer_of(tensor)
    if p is None or not is_op(p, "Add") or len(p.inputs) != 2:
        return None
    for x, b in (p.inputs, p.inputs[::-1]):
        value = constant_value(graph, b)
        mm = producer_of(x)
        if value is not None and value.ndim == 1 and mm is not None and is_op(mm, "MatMul"):
            return x, value, p
    return None


@dataclass
class PackedProjections:
    """q, k, v = x·W_q + b_q, x·W_k + b_k, x·W_v + b_v as the one ``x·W + b`` of ``Attention``."""

    x: gs.Tensor  # [B, S, E_in], read by all three MatMuls
    weight: np.ndarray  # [E_in, 3E]: W_q | W_k | W_v along the columns
    bias: np.ndarray  # [3E]: b_q | b_k | b_v (E zeros for a projection without a bias)
    nodes: list  # the three MatMuls and the bias Adds, replaced by the packed op


def packed_projections(graph, sources, hidden: int, dtype) -> PackedProjections | None:
    """The projections behind ``sources`` (q, k, v) packed, or None.

    Holds when each source is ``MatMul(x, W_i)`` or ``Add(MatMul(x, W_i), b_i)`` with the same ``x`` of
    rank 3, ``W_i`` a constant [E_in, E] (or ``Transpose(perm=[1, 0])`` of a constant [E, E_in]: torch's
    ``nn.Linear`` export, left unfolded by fold-constants above its size limit) and ``b_i`` a constant of E values, all of ``dtype``, and each
    MatMul / Add output is read only on its way to the attention. Column block i of ``x·[W_q | W_k | W_v]``
    is exactly ``x·W_i`` (each output column is its own dot product), so packing changes no value; a
    missing bias is E zeros (``y + 0 == y``). ``Attention`` then computes the three projections in one
    GEMM and adds the bias inside its own kernel, which is why it beats three MatMuls feeding
    MultiHeadAttention (benchmarks/attention_ops.py).

    Also one projection cut into three: by a Split (GPT-2, :func:`_split_projection`) or by torch.nn.
    MultiheadAttention's unflatten (:func:`_unflatten_projection`). The packing does not depend on the
    layout: x is [B, S, E_in] or, sequence-first, [S, B, E_in].
    """
    for form in (_split_projection, _unflatten_projection):
        found = form(graph, sources, hidden, dtype)
        if found is not None:
            return found
    projections = []
    for t in sources:
        found = _linear(graph, t, hidden, dtype) if single_reader(graph, t) else None
        if found is None or (projections and found.x is not projections[0].x):
            return None
        projections.append(found)
    x = projections[0].x
    if rank_of(graph, x) != 3 or dtype_of(graph, x) != dtype:
        return None
    return PackedProjections(x, np.concatenate([p.weight for p in projections], axis=1),
                             np.concatenate([p.bias for p in projections]), [n for p in projections for n in p.nodes])


def _linear(graph, t, width: int, dtype) -> PackedProjections | None:
    """``t = MatMul(x, W)`` or ``Add(MatMul(x, W), b)`` as (x, W, b, [Add, MatMul]): W a constant
    [E_in, width] (read through a Transpose too), b a constant of ``width`` values (zeros when there is no
    Add), both of ``dtype``, the MatMul output read only by the Add; else None."""
    nodes = []
    found = projection_bias(graph, t)
    if found is not None:
        mm_out, bias, add = found
        if bias.shape != (width,) or not single_reader(graph, mm_out):
            return None
        nodes.append(add)
    else:
        mm_out, bias = t, np.zeros(width, dtype)
    mm = producer_of(mm_out)
    if mm is None or not is_op(mm, "MatMul") or len(mm.inputs) != 2:
        return None
    w = _constant_matrix(graph, mm.inputs[1])
    if w is None or w.shape[1] != width or w.dtype != dtype or bias.dtype != dtype:
        return None
    return PackedProjections(mm.inputs[0], w, bias, nodes + [mm])


def _split_projection(graph, sources, hidden: int, dtype) -> PackedProjections | None:
    """q, k, v = outputs 0, 1, 2 of ``Split(t, [E, E, E], axis=-1)`` with t one packed projection of x
    (:func:`_packed_source`), or None. Split's blocks are W's column blocks [W_q | W_k | W_v], the layout
    ``Attention`` wants."""
    split = producer_of(sources[0])
    if split is None or not is_op(split, "Split") or len(split.outputs) != 3:
        return None
    if any(split.outputs[i] is not sources[i] or not single_reader(graph, sources[i]) for i in range(3)):
        return None
    t = split.inputs[0]
    t_shape = shape_of(graph, t)
    if t_shape is None or len(t_shape) != 3 or t_shape[2] != 3 * hidden or int(split.attrs.get("axis", 0)) not in (2, -1):
        return None
    sizes = constant_value(graph, split.inputs[1]) if len(split.inputs) > 1 else split.attrs.get("split")
    if sizes is not None and [int(v) for v in np.asarray(sizes).reshape(-1)] != [hidden] * 3:
        return None
    return _packed_source(graph, t, hidden, dtype, [split])


#: torch's ``unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2)``: [S, B, 3, E] → [1, S, B, 3, E]
#: → [3, S, B, 1, E] → [3, S, B, E]
_UNFLATTEN_PERM = [3, 1, 2, 0, 4]


def _unflatten_projection(graph, sources, hidden: int, dtype) -> PackedProjections | None:
    """q, k, v = ``Gather(u, i, axis=0)`` for i = 0, 1, 2 of ``u = Squeeze(Transpose(Unsqueeze(Reshape(t,
    [a, b, 3, E]), 0), perm=[3, 1, 2, 0, 4]), 3)`` with t [A, B, 3E] one packed projection of x
    (:func:`_packed_source`), or None. That is torch.nn.MultiheadAttention's self-attention
    ``in_projection_packed``, whatever the layout.

    Why it is t's column block i: element (a, b, i·E + e) of t is (a, b, i, e) after the Reshape when
    [a, b] keeps t's first two dimensions (each entry equal to the static dimension or 0, or one of them
    -1 while the other keeps its dimension: the element count then forces it), (0, a, b, i, e) after the
    Unsqueeze, (i, a, b, 0, e) after the Transpose, (i, a, b, e) after the Squeeze, and (a, b, e) of
    Gather i."""
    gathers = [producer_of(t) for t in sources]
    if not all(is_op(g, "Gather") and len(g.inputs) == 2 and int(g.attrs.get("axis", 0)) == 0 for g in gathers):
        return None
    u = gathers[0].inputs[0]
    indices = [constant_value(graph, g.inputs[1]) for g in gathers]
    if any(g.inputs[0] is not u for g in gathers) or any(i is None or i.shape != () for i in indices):
        return None
    if [int(i) for i in indices] != [0, 1, 2] or not all(single_reader(graph, t) for t in sources):
        return None
    if only_read_by(graph, u, gathers):
        return None
    squeeze = producer_of(u)
    axes = axes_of(graph, squeeze) if is_op(squeeze, "Squeeze") else None
    if axes not in ([3], [-2]):
        return None
    transpose = producer_of(squeeze.inputs[0])
    if perm_of(transpose) != _UNFLATTEN_PERM or not single_reader(graph, squeeze.inputs[0]):
        return None
    unsqueeze = producer_of(transpose.inputs[0])
    if not is_op(unsqueeze, "Unsqueeze") or axes_of(graph, unsqueeze) != [0] or not single_reader(graph, transpose.inputs[0]):
        return None
    reshape = producer_of(unsqueeze.inputs[0])
    if not is_op(reshape, "Reshape") or len(reshape.inputs) != 2 or int(reshape.attrs.get("allowzero", 0)):
        return None
    if not single_reader(graph, unsqueeze.inputs[0]):
        return None
    t = reshape.inputs[0]
    target, t_shape = constant_value(graph, reshape.inputs[1]), shape_of(graph, t)
    if target is None or target.shape != (4,) or t_shape is None or len(t_shape) != 3 or t_shape[2] != 3 * hidden:
        return None
    target = [int(v) for v in target]
    copies = [copies_dim(target[i], t_shape[i]) for i in (0, 1)]
    if target[2:] != [3, hidden] or not (all(copies) or (target[0] == -1 and copies[1])
                                         or (target[1] == -1 and copies[0])):
        return None
    return _packed_source(graph, t, hidden, dtype, [*gathers, squeeze, transpose, unsqueeze, reshape])


def _packed_source(graph, t, hidden: int, dtype, nodes: list) -> PackedProjections | None:
    """t [A, B, 3E] as one packed projection ``x·W + b`` of x [A, B, E_in], or None: t is ``Reshape(Gemm(
    Reshape(x, [N, E_in]), W, b), [A, B, 3E])`` (GPT-2's Conv1D), or ``MatMul(x, W)`` with an optional ``Add``
    of a [3E] constant, read only by the node that cuts it (``nodes[0]``).

    Why the Gemm chain is ``x·W + b`` on [A, B, ·]: it applies the Gemm to each row of x and gives back
    [A, B, 3E], proved by :func:`~onnxfuse.rewrites.facts.row_wise.row_wise_gemm` (the proof
    gemm-rows-to-matmul uses, which turns the chain into the MatMul form when it runs first)."""
    if not single_reader(graph, t):
        return None
    nodes = list(nodes)
    p = producer_of(t)
    bias = np.zeros(3 * hidden, dtype)
    if p is not None and is_op(p, "Reshape"):  # Reshape(Gemm(Reshape(x, [N, E_in])), [A, B, 3E])
        rows = row_wise_gemm(graph, p)
        if isinstance(rows, Refuse) or rows.n != 3 * hidden:
            return None
        x, gemm = rows.x, rows.gemm
        w = _constant_matrix(graph, gemm.inputs[1])
        if w is not None and int(gemm.attrs.get("transB", 0)):
            w = w.T
        if rows.bias is not None:
            bias = rows.bias.reshape(-1)
        nodes += [p, gemm, rows.flat]
    else:  # MatMul(x, W) (+ b)
        found = _linear(graph, t, 3 * hidden, dtype)
        if found is None:
            return None
        x, w, bias = found.x, found.weight, found.bias
        nodes += found.nodes
    if w is None or w.shape[1] != 3 * hidden or w.dtype != dtype or bias.dtype != dtype:
        return None
    if rank_of(graph, x) != 3 or dtype_of(graph, x) != dtype:
        return None
    return PackedProjections(x, w, bias, nodes)


def _constant_matrix(graph, tensor) -> np.ndarray | None:
    """A 2-D constant, or the transpose of one (``Transpose(W, perm=[1, 0])`` is ``W.T`` exactly)."""
    value = constant_value(graph, tensor)
    if value is not None:
        return value if value.ndim == 2 else None
    p = producer_of(tensor)
    if p is None or not is_op(p, "Transpose") or len(p.inputs) != 1 or perm_of(p) != [1, 0]:
        return None
    value = constant_value(graph, p.inputs[0])
    return value.T if value is not None and value.ndim == 2 else None


def fold_biases(graph, sources, hidden, dtype):
    """The projection biases as MultiHeadAttention's [3E] ``bias`` when each of q, k, v is Add(MatMul, b)
    with b of E values or a bare MatMul output (its bias: E zeros; x + 0 == x), at least one has a bias,
    and each is read only by the attention."""
    found = []
    for t in sources:
        b = projection_bias(graph, t)
        if b is not None and b[1].shape == (hidden,):
            found.append(b)
        elif b is None and producer_of(t) is not None and is_op(producer_of(t), "MatMul"):
            found.append((t, np.zeros(hidden, dtype), None))
        else:
            return None
    if all(f[2] is None for f in found) or not all(single_reader(graph, t) for t in sources):
        return None
    values = np.concatenate([np.asarray(f[1]) for f in found]).astype(dtype, copy=False)
    return found[0][0], found[1][0], found[2][0], values, [f[2] for f in found if f[2] is not None]
