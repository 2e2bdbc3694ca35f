"""Matching helpers for contrib-attention (the ``contrib`` family); not a rule itself.

What each helper proves is written where it is; the rule's module docstring
(:mod:`onnxfuse.rewrites.contrib.contrib_attention`) puts the pieces together:

* :func:`split_heads`: a rank-4 heads tensor ``[B, H, S, D]`` (or Kᵀ ``[B, H, D, L]``) traced back to the
  rank-3 tensor it was cut from, batch-first ``[B, S, E]`` or sequence-first ``[S, B, E]``;
  :func:`given_heads` takes it as it is when that fails (rotated or repeated heads);
* :func:`strip_scale`: scalar Mul/Div (and element-type-preserving Casts) peeled off a tensor;
* :func:`mask_terms`: the Add / Where chain between the scaled scores and the Softmax, as terms of one
  additive ``attention_bias``;
* :func:`keep_mask`: those terms proved to be a 0/fill keep mask per batch item and key (a padding
  mask) or per batch item, query and key (causal and padding), the forms ONNX Runtime's ``Attention``
  takes as a raw 2-D or 3-D ``mask_index``;
* :func:`nan_guard`, :func:`finite_masks`: the dynamo exporter's ``Where(IsNaN(p), 0, p)`` after the Softmax,
  and the proof that it changes nothing;
* :func:`projection_bias`: ``Add(MatMul(·), b)`` with a 1-D constant ``b``;
* :func:`packed_projections`: q, k and v as three constant-weight projections of one tensor, packed
  into the one [E_in, 3E] weight and [3E] bias of ONNX Runtime's ``Attention`` op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from onnxfuse.rewrites.contrib.matmul import scale_of
from onnxfuse.rewrites.engine.facts import (
    axes_of,
    constant_value,
    consumers,
    dims_equal,
    dtype_of,
    is_graph_output,
    is_op,
    only_read_by,
    perm_of,
    producer_of,
    provably_nonnegative,
    rank_of,
    scalar_constant,
    shape_of,
)
from onnxfuse.rewrites.engine.row_wise import row_wise_gemm

DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
#: perm of the Transpose that splits heads: [B, S, H, D] → [B, H, S, D]
HEADS = [0, 2, 1, 3]
#: perm that gives Kᵀ in one step: [B, L, H, D] → [B, H, D, L]
HEADS_T = [0, 2, 3, 1]
SWAP_LAST = [0, 1, 3, 2]
#: merging perm of the sequence-first layout: [B, H, S, D] → [S, B, H, D]
SEQ_FIRST_MERGE = [2, 0, 1, 3]
BATCH_FIRST = "batch-first"  # the heads were cut from [B, S, E]
SEQ_FIRST = "sequence-first"  # the heads were cut from [S, B, E] (torch.nn.MultiheadAttention)
GIVEN = "given-heads"  # [B, H, S, D] heads taken as the graph has them (rotated, repeated: Llama)
#: a Where fill f is absorbing in float32 when f <= this: s + f == f for |s| < ulp(f)/2 (>= 3.7e22)
ABSORBING_FILL = -1e30
#: float16's finfo.min, the fill of torch's ``masked_fill(mask, finfo(float16).min)`` in a float16 export
FP16_MIN = float(np.finfo(np.float16).min)


@dataclass
class Head:
    """One of q/k/v split into heads: the tensor it was cut from, its layout, H and D, the split's nodes."""

    source: gs.Tensor
    heads: int
    size: int
    nodes: list
    layout: str = BATCH_FIRST
    factors: list = field(default_factory=list)  # scalar factors on the source (q·c before the split)
    why: str = ""  # given heads: why they could not be traced to the tensor they were cut from


def cast_types(graph, node) -> tuple[np.dtype, np.dtype] | None:
    """(input element type, target element type) of a Cast whose input type is known, else None."""
    if not is_op(node, "Cast") or len(node.inputs) != 1:
        return None
    source = dtype_of(graph, node.inputs[0])
    try:
        target = np.dtype(helper.tensor_dtype_to_np_dtype(int(node.attrs.get("to", 0))))
    except (KeyError, TypeError, ValueError):
        return None
    return None if source is None else (source, target)


def is_noop_cast(graph, node) -> bool:
    """A Cast to the element type its input already has: the identity."""
    types = cast_types(graph, node)
    return types is not None and types[0] == types[1]


def is_upcast(graph, node) -> bool:
    """A float16 → float32 Cast: exact (every float16 value is a float32 value), the step into a float32
    softmax island (:mod:`~onnxfuse.rewrites.contrib.contrib_attention`)."""
    return cast_types(graph, node) == (np.dtype(np.float16), np.dtype(np.float32))


def is_downcast(graph, node) -> bool:
    """A float32 → float16 Cast, the step out of a float32 softmax island."""
    return cast_types(graph, node) == (np.dtype(np.float32), np.dtype(np.float16))


def scalar_factor(graph, node) -> tuple[float, gs.Tensor] | None:
    """(factor, other input) when ``node`` is x·c or x/c with c a finite, non-zero scalar constant
    (:func:`onnxfuse.rewrites.contrib.matmul.scale_of`, which FusedMatMul's scale folding uses too,
    minus the factors that would not survive a product: 0, ±inf, NaN)."""
    found = scale_of(graph, node, None)
    if found is None or not np.isfinite(found[0]) or found[0] == 0.0:
        return None
    return found[0], found[1]


def strip_scale(graph, tensor, nodes, factors):
    """Follow scalar Mul/Div and no-op Cast producers back from ``tensor``; collects their nodes and
    factors; returns the tensor before them."""
    while True:
        p = producer_of(tensor)
        if p is None:
            return tensor
        if is_noop_cast(graph, p):
            nodes.append(p)
            tensor = p.inputs[0]
            continue
        found = scalar_factor(graph, p)
        if found is None:
            return tensor
        factors.append(found[0])
        nodes.append(p)
        tensor = found[1]


def _copied(target_dim, dim) -> bool:
    """A Reshape target entry that provably keeps the input's dimension at the same index."""
    return int(target_dim) == 0 or (isinstance(dim, int) and dim == int(target_dim))


def _batch_first(graph, r, t) -> Head | str:
    """``Transpose(perm)(Reshape(source [B, S, E], [b, s, H, D]))``: every entry of [b, s] copies the
    source's dimension (0 or the same static value), or one of them is -1 while the other copies and
    H and D are given: the element count then forces -1 to be the remaining dimension."""
    if r is None or not is_op(r, "Reshape") or len(r.inputs) != 2 or int(r.attrs.get("allowzero", 0)):
        return "heads are not split by a Reshape"
    target = constant_value(graph, r.inputs[1])
    if target is None or target.ndim != 1 or target.size != 4:
        return "the head-splitting Reshape's target is not a constant [·, ·, H, D]"
    source = r.inputs[0]
    shape = shape_of(graph, source)
    if shape is None or len(shape) != 3 or not isinstance(shape[2], int):
        return f"{source.name!r} is not [batch, sequence, hidden] with a static hidden size"
    hidden = shape[2]
    target = [int(v) for v in target]
    heads, size = target[2], target[3]
    if heads == -1 and size > 0 and hidden % size == 0:  # [·, ·, -1, D]: H inferred
        heads = hidden // size
        if -1 in target[:2]:
            return "the head-splitting Reshape's target has two -1 entries"
    elif size == -1 and heads > 0 and hidden % heads == 0:  # [·, ·, H, -1]: D inferred
        size = hidden // heads
        if -1 in target[:2]:
            return "the head-splitting Reshape's target has two -1 entries"
    if heads <= 0 or size <= 0 or heads * size != hidden:
        return f"the head-splitting Reshape's target {target} does not split {hidden} into H x D"
    copies = [_copied(target[i], shape[i]) for i in (0, 1)]
    if not (all(copies) or (target[0] == -1 and copies[1]) or (target[1] == -1 and copies[0])):
        return "the head-splitting Reshape changes the batch or sequence dimension"
    return Head(source, heads, size, [t, r], BATCH_FIRST)


def _sequence_first(graph, r4) -> Head | str:
    """torch.nn.MultiheadAttention's split: ``Reshape(Transpose(Reshape(x [S, B, E], [S, -1, D]),
    perm=[1, 0, 2]), [-1, H, S, D])``. Element (s, b, h·D + d) goes to (s, b·H + h, d), then to
    (b·H + h, s, d), then, row-major, to (b, h, s, d): the heads of the sequence-first x."""
    if len(r4.inputs) != 2 or int(r4.attrs.get("allowzero", 0)):
        return "heads are not split by a Reshape"
    t = producer_of(r4.inputs[0])
    if t is None or perm_of(t) != [1, 0, 2]:
        return "heads are not split by Transpose(perm=[0, 2, 1, 3]) nor by Reshape(Transpose(perm=[1, 0, 2]))"
    r3 = producer_of(t.inputs[0])
    if r3 is None or not is_op(r3, "Reshape") or len(r3.inputs) != 2 or int(r3.attrs.get("allowzero", 0)):
        return "the [S, B·H, D] heads are not made by a Reshape"
    t3, t4 = constant_value(graph, r3.inputs[1]), constant_value(graph, r4.inputs[1])
    if t3 is None or t4 is None or t3.shape != (3,) or t4.shape != (4,):
        return "the sequence-first head split's Reshape targets are not constants [S, -1, D] and [-1, H, S, D]"
    source = r3.inputs[0]
    shape = shape_of(graph, source)
    if shape is None or len(shape) != 3 or not isinstance(shape[2], int) or not isinstance(shape[0], int):
        return f"{source.name!r} is not [sequence, batch, hidden] with a static sequence and hidden size"
    seq, hidden = shape[0], shape[2]
    size = int(t3[2])
    if not (_copied(t3[0], seq) and int(t3[1]) == -1 and size > 0 and hidden % size == 0):
        return f"the sequence-first head split's target {t3.tolist()} is not [S, -1, D]"
    heads = hidden // size
    if [int(v) for v in t4] != [-1, heads, seq, size]:
        return f"the sequence-first head merge's target {t4.tolist()} is not [-1, {heads}, {seq}, {size}]"
    return Head(source, heads, size, [r4, t, r3], SEQ_FIRST)


def split_heads(graph, tensor, transposed: bool) -> Head | str:
    """``tensor`` [B, H, S, D] (Kᵀ [B, H, D, L] when ``transposed``) traced to the rank-3 tensor it was cut
    from. Kᵀ is the heads perm [0, 2, 3, 1] in one step, or any heads form followed by a swap of the last
    two axes."""
    t = producer_of(tensor)
    if t is None:
        return "no head-splitting producer"
    perm = perm_of(t)
    if transposed:
        if perm == SWAP_LAST:
            inner = split_heads(graph, t.inputs[0], transposed=False)
            if isinstance(inner, str):
                return "Kᵀ is not a Transpose of the split heads: " + inner
            inner.nodes.insert(0, t)
            return inner
        if perm != HEADS_T:
            return f"expected a Transpose(perm={HEADS_T}) splitting heads"
        return _batch_first(graph, producer_of(t.inputs[0]), t)
    if perm == HEADS:
        return _batch_first(graph, producer_of(t.inputs[0]), t)
    if is_op(t, "Reshape"):
        return _sequence_first(graph, t)
    return f"expected a Transpose(perm={HEADS}) splitting heads"


def given_heads(graph, tensor, transposed: bool, why: str = "") -> Head | str:
    """``tensor`` taken as heads the way the graph already has them, when it cannot be traced to the
    [B, S, E] tensor it was cut from: [B, H, S, D] with H and D static (Kᵀ: ``Transpose(perm=[0, 1, 3,
    2])`` of such a [B, H, L, D] k). This is how Llama-style models reach the scores: rotary embeddings
    rotate q and k after the head split (elementwise on [B, H, S, D]) and ``repeat_kv`` repeats each of
    the H_kv key/value heads H / H_kv times (Unsqueeze, Expand, Reshape) before QKᵀ and P·V. Whatever made
    the heads stays in the graph; MultiHeadAttention reads key and value in this layout (its [B, H, L, D]
    "past" form) and the query merged back to [B, S, E] (:mod:`~onnxfuse.rewrites.contrib.contrib_attention`)."""
    nodes = []
    if transposed:
        t = producer_of(tensor)
        if t is None or perm_of(t) != SWAP_LAST:
            return f"Kᵀ is not Transpose(perm={SWAP_LAST}) of [B, H, L, D] heads"
        nodes, tensor = [t], t.inputs[0]
    shape = shape_of(graph, tensor)
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in (shape[1], shape[3])):
        return f"{tensor.name!r} is not [B, H, S, D] heads with a static H and D"
    return Head(tensor, shape[1], shape[3], nodes, GIVEN, why=why)


def as_given(head: Head, heads_tensor) -> Head | None:
    """A batch-first split ``head`` re-read as given heads: V's ``heads_tensor`` (the [B, H, L, D] it read),
    or K's [B, H, L, D] under the ``Transpose(perm=[0, 1, 3, 2])`` that made Kᵀ (the split's first node);
    the split itself then stays in the graph. None when there is no such tensor (Kᵀ in one step)."""
    if head.layout == GIVEN:
        return head
    if head.layout != BATCH_FIRST:
        return None
    if heads_tensor is not None:
        return Head(heads_tensor, head.heads, head.size, [], GIVEN)
    if len(head.nodes) == 3 and perm_of(head.nodes[0]) == SWAP_LAST:
        return Head(head.nodes[0].inputs[0], head.heads, head.size, [head.nodes[0]], GIVEN)
    return None


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


def _reaches_matmul(graph, tensor, depth: int = 8) -> bool:
    """Whether ``tensor`` is a MatMul's output behind the ops the score path may hold (no-op Cast, the
    float16 → float32 Cast of a softmax island, scalar Mul/Div, Add, Where): tells the scores from the
    mask."""
    p = producer_of(tensor)
    if p is None or depth == 0:
        return False
    if is_op(p, "MatMul"):
        return True
    if is_noop_cast(graph, p) or is_upcast(graph, p) or scalar_factor(graph, p) is not None:
        return _reaches_matmul(graph, p.inputs[0] if is_op(p, "Cast") else scalar_factor(graph, p)[1], depth - 1)
    if is_op(p, "Add", "Where"):
        return any(_reaches_matmul(graph, t, depth - 1) for t in p.inputs)
    return False


@dataclass
class MaskTerm:
    """One step between the scaled scores x and the Softmax: ``x + mask`` (kind "add") or
    ``Where(cond, x, fill)`` / ``Where(cond, fill, x)`` (kind "where"; ``scores_if_true`` tells which)."""

    kind: str
    mask: gs.Tensor | None = None
    cond: gs.Tensor | None = None
    fill: float = 0.0
    scores_if_true: bool = True
    #: ``s + fill == fill`` (a float32 fill <= ABSORBING_FILL); False only for a float16 fill of
    #: :data:`FP16_MIN`, which only a raw keep mask may take (contrib_attention: "float16 masked_fill")
    absorbing: bool = True


def mask_terms(graph, tensor, nodes, dtype) -> tuple[list[MaskTerm], gs.Tensor] | str:
    """Peel the mask steps (Add of a tensor not computed from the scores, Where with a scalar fill, no-op
    Casts) off the Softmax input ``tensor``; returns them outermost first and the tensor inside them."""
    terms: list[MaskTerm] = []
    while True:
        p = producer_of(tensor)
        if p is None:
            return terms, tensor
        if is_noop_cast(graph, p):
            nodes.append(p)
            tensor = p.inputs[0]
            continue
        if is_op(p, "Add") and len(p.inputs) == 2:
            sides = [_reaches_matmul(graph, t) for t in p.inputs]
            if sides == [True, True]:
                return "both operands of the mask Add are computed from a MatMul"
            if sides == [False, False]:
                return "the Softmax input is an Add with no Q·Kᵀ MatMul behind it"
            x, mask = p.inputs if sides[0] else p.inputs[::-1]
            if dtype_of(graph, mask) != dtype:
                return "the mask's element type differs from the scores'"
            m_shape = shape_of(graph, mask)
            if m_shape is None or len(m_shape) > 4:
                return "the mask's rank is unknown or above 4"
            terms.append(MaskTerm("add", mask=mask))
            nodes.append(p)
            tensor = x
            continue
        if is_op(p, "Where") and len(p.inputs) == 3:
            cond, a, b = p.inputs
            fill_a, fill_b = scalar_constant(graph, a), scalar_constant(graph, b)
            if (fill_a is None) == (fill_b is None):
                return "the Where on the scores does not select between the scores and a scalar fill"
            scores_if_true = fill_b is not None
            fill = float(np.asarray(fill_b if scores_if_true else fill_a, np.float64).reshape(()))
            absorbing = dtype == np.dtype(np.float32) and np.isfinite(fill) and fill <= ABSORBING_FILL
            if not absorbing and not (dtype == np.dtype(np.float16) and fill == FP16_MIN):
                return (f"Where-mask fill {fill:g} ({dtype}) is not absorbing: Where(c, s, f) = s + Where(c, 0, f) "
                        f"needs s + f == f, proved only for a finite float32 f <= {ABSORBING_FILL:g}")
            c_shape = shape_of(graph, cond)
            if dtype_of(graph, cond) != np.dtype(bool) or c_shape is None or len(c_shape) > 4:
                return "the Where-mask condition is not a bool tensor of known rank <= 4"
            terms.append(MaskTerm("where", cond=cond, fill=fill, scores_if_true=scores_if_true, absorbing=absorbing))
            nodes.append(p)
            tensor = a if scores_if_true else b
            continue
        return terms, tensor


def nan_guard(graph, probs) -> list | None:
    """``[IsNaN, Where]`` when ``probs`` (the Softmax's weights) is read only as ``Where(IsNaN(p), 0, p)``:
    torch's dynamo exporter (onnxscript's scaled_dot_product_attention with a mask) writes it to turn the
    NaN row of a Softmax whose every score is -inf into zeros. Else None."""
    readers = consumers(probs)
    if len(readers) != 2 or is_graph_output(graph, probs):
        return None
    isnan = next((n for n in readers if is_op(n, "IsNaN")), None)
    where = next((n for n in readers if is_op(n, "Where")), None)
    if isnan is None or where is None or len(where.inputs) != 3 or len(isnan.outputs) != 1:
        return None
    cond, zero, kept = where.inputs
    if cond is not isnan.outputs[0] or kept is not probs or not single_reader(graph, cond):
        return None
    value = scalar_constant(graph, zero)
    if value is None or float(np.asarray(value).reshape(())) != 0.0:
        return None
    return [isnan, where]


def finite_masks(graph, terms) -> bool:
    """Every mask step adds finite values: a Where term (its fill is a finite scalar, checked by
    :func:`mask_terms`), or an Add of a constant whose values are all finite or of ``Where(c, a, b)`` with
    a and b finite scalar constants (transformers' ``sdpa_mask`` as float). Then, for finite scores, no
    Softmax row is all -inf and none is NaN: a NaN guard after it (:func:`nan_guard`) changes nothing."""
    for term in terms:
        if term.kind == "where":
            if not np.isfinite(term.fill):
                return False
            continue
        value = constant_value(graph, term.mask)
        if value is not None:
            if not np.all(np.isfinite(value)):
                return False
            continue
        where = producer_of(term.mask)
        if not is_op(where, "Where") or len(where.inputs) != 3:
            return False
        branches = [scalar_constant(graph, t) for t in where.inputs[1:]]
        if any(b is None or not np.all(np.isfinite(b)) for b in branches):
            return False
    return True


@dataclass
class KeepMask:
    """The additive mask proved to be a keep/drop mask: entry (b, h, s, l) adds 0 where the bool ``keep``
    is True at the broadcast index (False when ``negate``) and ``fill`` elsewhere. ``keep``'s shape,
    right-aligned to rank 4, is ``[B|1, 1, 1, L|1]`` (``rank`` 2: a key padding mask, per batch item and
    key) or ``[B|1, 1, S, L|1]`` (``rank`` 3: per query too, a causal mask and its padding); ``expand``
    says some dimension is a broadcast 1 that the raw ``mask_index`` must spell out."""

    keep: gs.Tensor
    negate: bool
    fill: float
    rank: int = 2
    expand: bool = False


def keep_mask(graph, terms, batch, queries, keys) -> KeepMask | None:
    """The mask steps ``terms`` (:func:`mask_terms`) as a :class:`KeepMask`, or None.

    Accepted: one term, either ``x + Where(c, 0, f)`` / ``x + Where(c, f, 0)`` (one branch a scalar
    constant f, finite; the other zeros: a scalar 0, or a zero-valued ``ConstantOfShape`` or constant
    when the Where's result (or the tensor whose ``Shape`` the ConstantOfShape reads) provably fits the
    scores: transformers 5's ``sdpa_mask``, ``Where(keep, 0,
    finfo.min)``, and its GPT-2 form ``Where(Not(keep), finfo.min, zeros)``) or ``Where(c, x, f)`` / ``Where(c, f, x)``
    (``masked_fill``; :func:`mask_terms` already proved f absorbing), where the bool condition c is a
    broadcast of a tensor ``keep`` (:func:`broadcast_source`; a ``Not`` is absorbed into ``negate``)
    whose shape, right-aligned to rank 4, is provably ``[batch or 1, 1, queries or 1, keys or 1]``.
    Anything else (a head-dependent mask, two terms, a
    float mask computed as ``(1 - m)·c``) gives None: the mask then stays an additive bias."""
    if len(terms) != 1:
        return None
    term = terms[0]
    if term.kind == "add":
        where = producer_of(term.mask)
        if not is_op(where, "Where") or len(where.inputs) != 3:
            return None
        cond, a, b = where.inputs
        va, vb = scalar_constant(graph, a), scalar_constant(graph, b)
        va = None if va is None else float(np.asarray(va, np.float64).reshape(()))
        vb = None if vb is None else float(np.asarray(vb, np.float64).reshape(()))
        if is_zeros(graph, a) and vb is not None and np.isfinite(vb):
            keep_if_true, fill = True, vb
        elif is_zeros(graph, b) and va is not None and np.isfinite(va):
            keep_if_true, fill = False, va
        else:
            return None
        zeros, scores = (a if keep_if_true else b), [batch, None, queries, keys]
        if scalar_constant(graph, zeros) is None and not (_fits(shape_of(graph, where.outputs[0]), scores)
                                                          or _fits(_shape_source(graph, zeros), scores)):
            return None  # a shaped zeros branch must not make the mask larger than the scores
    else:
        cond, keep_if_true, fill = term.cond, term.scores_if_true, term.fill
    keep, negate = broadcast_source(graph, cond), not keep_if_true
    inverse = producer_of(keep)
    if negate and is_op(inverse, "Not") and inverse.inputs:  # Where(Not(k), f, 0) keeps where k
        keep, negate = broadcast_source(graph, inverse.inputs[0]), False
    shape = shape_of(graph, keep)
    if dtype_of(graph, keep) != np.dtype(bool) or shape is None or len(shape) > 4:
        return None
    dims = [1] * (4 - len(shape)) + list(shape)
    if dims[1] != 1 or not _fits(dims, [batch, 1, queries, keys]):
        return None
    rank = 2 if dims[2] == 1 else 3
    expand = len(shape) != 4 or not (dims_equal(dims[0], batch) and dims_equal(dims[3], keys))
    return KeepMask(keep, negate, fill, rank, expand)


def _fits(shape, dims) -> bool:
    """``shape`` (right-aligned to rank 4) broadcasts into ``dims`` without growing them: each entry is 1
    or provably the dimension it meets (``None`` in ``dims``: any)."""
    if shape is None or len(shape) > 4:
        return False
    shape = [1] * (4 - len(shape)) + list(shape)
    return all(d == 1 or want is None or dims_equal(d, want) for d, want in zip(shape, dims))


def _shape_source(graph, tensor):
    """The shape of t when ``tensor`` is ``ConstantOfShape(Shape(t))`` (so it has t's shape), else None."""
    p = producer_of(tensor)
    if not is_op(p, "ConstantOfShape") or not p.inputs:
        return None
    shape = producer_of(p.inputs[0])
    if not is_op(shape, "Shape") or not shape.inputs or shape.attrs.get("start", 0) or "end" in shape.attrs:
        return None
    return shape_of(graph, shape.inputs[0])


def is_zeros(graph, tensor) -> bool:
    """A constant of zeros, or ``ConstantOfShape`` filling zeros (its ``value`` attribute zero or absent)."""
    value = constant_value(graph, tensor)
    if value is not None:
        return value.size > 0 and not np.any(value)
    p = producer_of(tensor)
    if not is_op(p, "ConstantOfShape"):
        return False
    fill = p.attrs.get("value")
    if fill is None:
        return True
    fill = getattr(fill, "values", fill)
    try:
        return not np.any(np.asarray(fill))
    except (TypeError, ValueError):
        return False


def always_true(graph, tensor, depth: int = 8) -> bool:
    """Every element of the bool ``tensor`` is True whatever the inputs: an all-True constant; ``x >= c``
    (``c <= x``) with x provably non-negative (:func:`~onnxfuse.rewrites.engine.facts.provably_nonnegative`)
    and c a constant with no positive element, or ``x > c`` (``c < x``) with every c negative; and of
    those, ``And`` of two, ``Or`` with one, bool-to-bool ``Cast``, ``Expand`` and ``Identity``.
    transformers 5 ands its padding mask with ``q_idx >= 0`` over ``Range(0, S)`` (itself anded with an
    all-True ``ConstantOfShape`` and cast to bool): a constant when S is static, this when it is not."""
    value = constant_value(graph, tensor)
    if value is not None:
        return value.dtype == np.bool_ and value.size > 0 and bool(np.all(value))
    p = producer_of(tensor)
    if depth == 0 or p is None or not p.inputs:
        return False
    if is_op(p, "Expand", "Identity") or (is_op(p, "Cast") and int(p.attrs.get("to", 0)) == 9
                                          and dtype_of(graph, p.inputs[0]) == np.dtype(bool)):
        return always_true(graph, p.inputs[0], depth - 1)
    if is_op(p, "And", "Or") and len(p.inputs) == 2:
        parts = [always_true(graph, t, depth - 1) for t in p.inputs]
        return all(parts) if p.op == "And" else any(parts)
    if not is_op(p, "GreaterOrEqual", "Greater", "LessOrEqual", "Less") or len(p.inputs) != 2:
        return False
    big, small = p.inputs if p.op in ("GreaterOrEqual", "Greater") else p.inputs[::-1]
    bound = constant_value(graph, small)
    if bound is None or bound.size == 0 or bound.dtype.kind not in "iuf":
        return False
    strict = p.op in ("Greater", "Less")
    return bool(np.all(bound < 0) if strict else np.all(bound <= 0)) and provably_nonnegative(graph, big)


def broadcast_source(graph, tensor, depth: int = 8):
    """The tensor that ``tensor`` is a broadcast of: back through ``Expand`` (it only broadcasts),
    ``And`` with an all-True operand (a constant, or :func:`always_true`) and ``Or`` with an all-False
    constant (the identities of bool logic, which then only broadcast the other operand), bool-to-bool
    ``Cast`` and ``Identity``. Each step keeps every element of the result equal to the source's element
    at the broadcast index."""
    for _ in range(depth):
        p = producer_of(tensor)
        if is_op(p, "Expand", "Identity") and p.inputs:
            tensor = p.inputs[0]
        elif is_op(p, "Cast") and dtype_of(graph, p.inputs[0]) == np.dtype(bool) and int(p.attrs.get("to", 0)) == 9:
            tensor = p.inputs[0]
        elif is_op(p, "And", "Or") and len(p.inputs) == 2:
            identity = p.op == "And"
            for this, other in (p.inputs, p.inputs[::-1]):
                value = constant_value(graph, other)
                if (value is not None and value.dtype == np.bool_ and bool(np.all(value == identity))) \
                        or (identity and always_true(graph, other)):
                    tensor = this
                    break
            else:
                return tensor
        else:
            return tensor
    return tensor


def single_reader(graph, tensor) -> bool:
    """Read by exactly one node and not a graph output (removing its producer would orphan the output)."""
    return len(consumers(tensor)) == 1 and not is_graph_output(graph, tensor)


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
    copies = [_copied(target[i], t_shape[i]) for i in (0, 1)]
    if target[2:] != [3, hidden] or not (all(copies) or (target[0] == -1 and copies[1])
                                         or (target[1] == -1 and copies[0])):
        return None
    return _packed_source(graph, t, hidden, dtype, [*gathers, squeeze, transpose, unsqueeze, reshape])


def _packed_source(graph, t, hidden: int, dtype, nodes: list) -> PackedProjections | None:
    """t [A, B, 3E] as one packed projection ``x·W + b`` of x [A, B, E_in], or None: t is ``Reshape(Gemm(
    Reshape(x, [N, E_in]), W, b), [A, B, 3E])`` (GPT-2's Conv1D), or ``MatMul(x, W)`` with an optional ``Add``
    of a [3E] constant, read only by the node that cuts it (``nodes[0]``).

    Why the Gemm chain is ``x·W + b`` on [A, B, ·]: it applies the Gemm to each row of x and gives back
    [A, B, 3E], proved by :func:`~onnxfuse.rewrites.engine.row_wise.row_wise_gemm` (the proof
    gemm-rows-to-matmul uses, which turns the chain into the MatMul form when it runs first)."""
    if not single_reader(graph, t):
        return None
    nodes = list(nodes)
    p = producer_of(t)
    bias = np.zeros(3 * hidden, dtype)
    if p is not None and is_op(p, "Reshape"):  # Reshape(Gemm(Reshape(x, [N, E_in])), [A, B, 3E])
        reason, rows = row_wise_gemm(graph, p)
        if reason or rows.n != 3 * hidden:
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
