"""Mask steps proved to be a 0/fill keep mask, which the fused op takes raw (``mask_index``,
``key_padding_mask``) instead of as an additive ``attention_bias``.

**Keep masks as a raw ``mask_index``** (packed ``Attention``; float32, or a float32 softmax island
below): when the mask is one ``Where`` of a bool condition that is a broadcast of a tensor ``keep``
provably ``[B|1, 1, 1, L]`` or ``[B|1, 1, S, L]`` (B, S = L x's;
:func:`keep_mask`: transformers 5's ``sdpa_mask``,
``Where(keep, 0, finfo.min)``, its GPT-2 form ``Where(Not(And(causal, padding)), finfo.min, zeros)``,
or a ``masked_fill``), the op gets ``mask_index`` = ``Cast(Flatten(keep), int32)`` ([B, L], a key padding
mask) or ``Cast(Squeeze(keep, [1]), int32)`` ([B, S, L], a mask per query: causal and padding), with a
batch of 1 spelled out by ``Expand`` first and ``Not`` first when the Where fills where the condition is
True, and ``mask_filter_value`` = the fill, instead of the expanded [B, 1, S, L] ``attention_bias``.
A [B, 1, S, L] keep that is provably the same for every query (:func:`constant_along`: transformers 4's
sdpa mask expands the padding mask before inverting it) is a key padding mask: its first query's row,
[B, L]. ONNX Runtime runs a [B, S, L] and a [B, L] raw mask on the same unfused kernel, but only the
[B, L] one becomes 1-D key lengths under ``--right-padded`` (contrib-mask-lengths), which the fused
float16 kernels take: with the [B, S, L] mask, BERT-base sdpa under ``--precision fp16`` ran 1.20-1.29x
its optimized ``.half()`` export on an H200, promise or not, where eager BERT with 1-D lengths ran
1.03-1.07x (docs/benchmarks.md 5.61); with this [B, L] row and the promise, 1.05-1.06x at batch 16 (5.63).
Where a raw mask is the only way to fuse (below), transformers 4's sdpa mask is one too: the inverted
``1 - m`` masked_filled with finfo.min where nonzero, ``Where(Cast(t, bool), f, t)``, adds 0 exactly
where its condition is False (:func:`zero_where_false`), whatever m holds.
"Provably" is by name (the same static size or ``dim_param``) or, where inference invented the
dimension, by length proved from how keep and the query or key are made
(:func:`~onnxfuse.rewrites.facts.shape_values.axis_length`: a KV-cache mask grid ``Range(0, past + S)``
against the key ``Concat(past, new)``, term by term); a ``Slice`` that cuts the mask to a length it
provably has already is seen through (:func:`whole_slice`: transformers 4.57's sdpa attention,
``mask[:, :, :, :key.shape[-2]]``, in optimum's export). ONNX
Runtime's kernels add ``mask_filter_value`` in float32 to a score whose mask entry is 0 (CUDA ``mask ==
0``, CPU ``mask > 0`` keeps: the same for 0/1) and nothing otherwise, which is what the graph computes
(``s + fill`` or ``s + 0``): exact for any finite fill, rows with every key masked included (uniform for
finfo.min, as in the graph). A raw mask takes ONNX Runtime's unfused CUDA path (flash, memory-efficient
and TensorRT kernels take no raw mask; ``attention.cc``). Measured (one BERT-base layer, H100): 0.069
against 0.076 ms at fp32 batch 1. Not in float16: there the raw mask was slower (0.096 against 0.079 ms
at batch 16) than ``attention_bias``, which reaches the memory-efficient kernel. A ``(1 - m)·c`` float
mask (transformers 4's extended mask) equals a keep/drop mask only for m in {0, 1}: it is converted only
where m is an input the user promised right-padded (``--right-padded``, which promises 0/1 values; the
raw mask is then m itself cast to int32), else it stays an additive bias (refused in a float32 softmax
island, with a reason naming the promise). MultiHeadAttention (q, k, v not
packed: given heads, cross-attention) takes the same raw mask as its ``key_padding_mask`` with the same
``mask_filter_value``, B and S read from its query, L from its key; only where a float16 bias would not be
exact (a float32 softmax island, a float16 masked_fill of -65504), since the raw mask leaves the fused
float16 kernels (checked on ONNX Runtime 1.32 CPU: rows with every key masked average V).

**Float32 softmax islands** (GPT-2's float16 export, which promotes the scores to the float32 mask's
type): ``Cast(to=float)`` of the float16 scaled scores, float32 mask steps, a float32 Softmax and
``Cast(to=float16)`` of its result for ×V. The island fuses into a float16 ``Attention`` (every
float16 kernel of ONNX Runtime's computes the softmax in float32 and rounds the weights to float16, as
the Casts do) only with the mask as a raw ``mask_index``, whose fill the kernel adds in float32 exactly
as the island does; a float16 ``attention_bias`` would hold finfo(float32).min as -inf (a fully masked
row becomes NaN) or, clamped, as -65504 (that row then follows its scores instead of being uniform).
Refused otherwise (a mask that is not a keep mask, q/k/v not packed), with that reason.

**Float32 P·V** (optimum's float16 Llama export with transformers' sdpa attention, issue 31: torch's
legacy symbolic of scaled_dot_product_attention promotes the float16 scores to its float32 mask
constants' type, so the Softmax, the NaN guard, ``P·Cast(V, to=float)`` and everything up to the
residual stream are float32): taken as an island whose weights are not cast down, with ``V``'s upcast
(exact) in the pattern and the fused float16 op's output cast up to float32 (exact) for the merge.
Not bitwise: the kernel rounds the float32 weights to float16 and its output to float16 (two roundings
of relative size 2⁻¹¹ that the original does not make; its scores were already float16), measured on
``optimum_llama_kv_fp16`` against a float64 evaluation of the float32 export at prefill and decode: every
output within 1.4x the original export's own error (logits 1.3e-3 against 9.6e-4 at prefill, relative to
max(1, |logit|); tests/rewrites/contrib/test_optimum_kv_cache.py).
The float16 op is the one the speed policy lets through: MultiHeadAttention over given heads in float32
was measured slower (:mod:`~onnxfuse.rewrites.contrib.attention.policy`). The mask rules are the
island's.

**Float16 masked_fill** (DistilBERT's float16 export, and ``--precision fp16`` of its float32 one):
``Where(keep, s, -65504)``, float16's finfo.min, which is not absorbing (s - 65504 != -65504 for |s| >= 16),
fuses only as a raw keep ``mask_index`` with ``mask_filter_value`` = finfo(float32).min, which the
kernel adds in float32: a masked score becomes finfo(float32).min, so a row with every key masked is
uniform as in the original (-65504 everywhere), and where a row keeps a key with a score above -65487
(any a float16 model gives short of overflow) each masked weight exp(-65504 - max) < 2^-25 rounds to 0
in the original's float16 output, as it is 0 in the kernel. Slower than an ``attention_bias`` (0.096
against 0.079 ms, one BERT-base layer at batch 16, H100, above) and below the decomposed layer (0.117
ms, H200, "Which op" in :mod:`~onnxfuse.rewrites.contrib.attention.plan`; not measured side by side), but
the bias is not exact here. Refused otherwise (not packed, not a keep mask), with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.facts.graph import (
    POINTWISE,
    REARRANGING,
    constant_value,
    dims_equal,
    dtype_of,
    is_op,
    producer_of,
    provably_nonnegative,
    scalar_constant,
    shape_of,
)
from onnxfuse.rewrites.facts.shape_values import axis_length, same_length, whole_slice

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
    #: ``keep`` is not bool but a tensor proved to hold only 0 and 1 (:func:`promised_zero_one`): keys are
    #: kept where it is 1; a raw mask only (its Cast to int32 is the mask itself), never a Where's condition
    zero_one: bool = False
    #: ``keep`` is ``[·, 1, S, L]`` but provably the same for every query (:func:`constant_along`: a key
    #: padding mask expanded to the scores' shape before the steps that made it a condition, transformers
    #: 4's sdpa mask): ``rank`` is 2 and the raw mask is its first query's row
    first_query: bool = False


def keep_mask(graph, terms, batch, queries, keys, infinite_fill: bool = False, lengths=None,
              zero_one_inputs: frozenset[str] = frozenset(), inverted: bool = False) -> KeepMask | None:
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
    float mask computed as ``(1 - m)·c``) gives None: the mask then stays an additive bias.
    ``infinite_fill``: f may be -inf too (torch's legacy export of scaled_dot_product_attention,
    ``Where(keep, 0, -inf)``, whose NaN guard the caller emulates; the fill is then replaced).
    ``zero_one_inputs``: graph inputs the user promised hold only 0 and 1 (``--right-padded``); then a
    ``(1 - m)·c`` mask (transformers 4's extended attention mask, :func:`one_minus_mask`) whose m is
    one of them, rearranged only (:func:`promised_zero_one`), is a keep mask too: it adds c where m is 0
    and nothing where m is 1, which is what the raw mask ``Cast(m, int32)`` with ``mask_filter_value`` c
    makes the kernel add (without the promise it is not one: m = 2 would add -c), a 0/1 m of any type
    cast to int32 being 0/1 too.
    ``inverted``: also ``x + Where(Cast(t, bool), f, Cast*(t))``, transformers 4's sdpa mask
    (``_prepare_4d_attention_mask_for_sdpa``: the inverted mask ``1 - m`` masked_filled with finfo.min
    where it is nonzero), a keep mask for any m: where the condition is False, t is 0 and so is every
    Cast of it (:func:`zero_where_false`); keep = Not(condition), per query when the mask was expanded to
    [B, 1, S, L] before the Sub. Only where a raw mask is the one way to fuse (a float32 softmax island, a
    float16 fill): elsewhere its additive bias is exact, and the raw per-query mask was not timed.
    ``lengths``: ``(tensor, axis)`` where B, S and L are read at run time; a dimension of ``keep`` that
    is not provably 1 or its name is then compared by length, both proved from how the tensors are made
    (:func:`~onnxfuse.rewrites.facts.shape_values.axis_length`): a KV-cache decoder's causal and padding
    mask is ``past + sequence`` keys long through index grids whose lengths inference invents, its key
    ``Concat(past, new)`` (optimum's transformers 4.57 export)."""
    if len(terms) != 1:
        return None
    term = terms[0]
    zero_one = False
    if term.kind == "add" and not is_op(producer_of(term.mask), "Where"):
        found = one_minus_mask(graph, term.mask)
        if found is None or infinite_fill or not promised_zero_one(graph, found[0], zero_one_inputs):
            return None
        (cond, fill), keep_if_true, zero_one = found, True, True
    elif term.kind == "add":
        where = producer_of(term.mask)
        if len(where.inputs) != 3:
            return None
        cond, a, b = where.inputs
        va, vb = scalar_constant(graph, a), scalar_constant(graph, b)
        va = None if va is None else float(np.asarray(va, np.float64).reshape(()))
        vb = None if vb is None else float(np.asarray(vb, np.float64).reshape(()))
        usable = (lambda f: f is not None and (np.isfinite(f) or (infinite_fill and f == -np.inf)))
        if is_zeros(graph, a) and usable(vb):
            keep_if_true, fill = True, vb
        elif (is_zeros(graph, b) or (inverted and zero_where_false(graph, cond, b))) and usable(va):
            keep_if_true, fill = False, va
        else:
            return None
        zeros, scores = (a if keep_if_true else b), [batch, None, queries, keys]
        if scalar_constant(graph, zeros) is None and not (_fits(shape_of(graph, where.outputs[0]), scores)
                                                          or _fits(_shape_source(graph, zeros), scores)):
            return None  # a shaped zeros branch must not make the mask larger than the scores
    else:
        cond, keep_if_true, fill = term.cond, term.scores_if_true, term.fill
    keep, negate = (cond if zero_one else broadcast_source(graph, cond)), not keep_if_true
    inverse = producer_of(keep)
    if negate and is_op(inverse, "Not") and inverse.inputs:  # Where(Not(k), f, 0) keeps where k
        keep, negate = broadcast_source(graph, inverse.inputs[0]), False
    shape = shape_of(graph, keep)
    if (dtype_of(graph, keep) != np.dtype(bool) and not zero_one) or shape is None or len(shape) > 4:
        return None
    dims = [1] * (4 - len(shape)) + list(shape)
    wants, pad = [batch, 1, queries, keys], 4 - len(shape)
    sources = [None, None, None, None] if lengths is None else [lengths[0], None, lengths[1], lengths[2]]
    equal = [dims_equal(d, want) for d, want in zip(dims, wants)]
    ones = [d == 1 for d in dims]
    for i, (d, want) in enumerate(zip(dims, wants)):
        if d == 1 or want is None or equal[i]:  # fits as named (:func:`_fits`)
            continue
        equal[i] = _same_length(graph, keep, pad, i, sources[i])  # else proved from how both are made
        ones[i] = not equal[i] and i >= pad and axis_length(graph, keep, i - pad) == 1
        if not (equal[i] or ones[i]):
            return None
    if not ones[1]:
        return None
    rank = 2 if ones[2] else 3
    # the same row for every query: the [B, L] mask of its first query (S = L, so a Slice of an empty
    # query axis is the [B, 0] mask of no keys, not a wrong-shaped one)
    self_attention = dims_equal(queries, keys) or (lengths is not None and lengths[1][0] is lengths[2][0]
                                                   and lengths[1][1] == lengths[2][1])
    first_query = rank == 3 and len(shape) >= 2 and self_attention and constant_along(graph, keep, 2)
    rank = 2 if first_query else rank
    expand = len(shape) != 4 or not (equal[0] and equal[3])
    return KeepMask(keep, negate, fill, rank, expand, zero_one, first_query)


def constant_along(graph, tensor, back: int, depth: int = 12, _seen: dict | None = None) -> bool:
    """Every slice of ``tensor`` along its axis ``-back`` (counted from the end, the axis broadcasting
    aligns) holds the same values, by construction: that axis is 1 or absent; a constant whose slices
    are equal; ``Expand``, ``Identity`` or a whole ``Slice`` of such a tensor (Expand aligns from the end
    too: a broadcast axis repeats one slice); ``Where(c, x, x)`` of one (expand-by-broadcast's form of an
    Expand, whatever c holds); a pointwise op (:data:`~onnxfuse.rewrites.facts.graph.POINTWISE`: each
    output element a function of its inputs' elements at the broadcast index) of such tensors. Anything
    else is not proved. transformers 4's sdpa mask expands the [B, 1, 1, L] padding mask to [B, 1, S, L]
    first and then inverts and casts it: the same keys for every query. Each tensor is answered once per
    call (``_seen``): a hostile graph of reconverging pointwise ops would otherwise cost 3^depth visits."""
    seen = {} if _seen is None else _seen
    if id(tensor) not in seen:
        seen[id(tensor)] = _constant_along(graph, tensor, back, depth, seen)
    return seen[id(tensor)]


def _constant_along(graph, tensor, back: int, depth: int, seen: dict) -> bool:
    shape = shape_of(graph, tensor)
    if shape is not None and (len(shape) < back or shape[-back] == 1):
        return True
    value = constant_value(graph, tensor)
    if value is not None:
        if value.ndim < back or value.size == 0:
            return True
        first = np.take(value, [0], axis=value.ndim - back)
        same = value == first
        if value.dtype.kind in "fc":
            same |= np.isnan(value) & np.isnan(first)
        return bool(np.all(same))
    p = producer_of(tensor)
    if depth == 0 or p is None or not p.inputs:
        return False
    if is_op(p, "Expand", "Identity") or (is_op(p, "Slice") and whole_slice(graph, p)):
        return constant_along(graph, p.inputs[0], back, depth - 1, seen)
    if is_op(p, "Where") and len(p.inputs) == 3 and p.inputs[1] is p.inputs[2]:
        return constant_along(graph, p.inputs[1], back, depth - 1, seen)
    if is_op(p, *POINTWISE) and len(p.outputs) == 1:
        return all(constant_along(graph, t, back, depth - 1, seen) for t in p.inputs if t.name)
    return False


def zero_where_false(graph, cond, tensor) -> bool:
    """``tensor`` is 0 wherever the bool ``cond`` is False: cond is ``Cast(t, to=bool)`` and tensor is t or
    Casts of it (Cast(t, bool) is False only where t is 0, and any Cast of 0 is 0)."""
    cast = producer_of(cond)
    if not is_op(cast, "Cast") or int(cast.attrs.get("to", 0)) != 9 or not cast.inputs:
        return False
    source = cast.inputs[0]
    for _ in range(4):
        if tensor is source:
            return True
        p = producer_of(tensor)
        if not is_op(p, "Cast") or not p.inputs:
            return False
        tensor = p.inputs[0]
    return tensor is source


def one_minus_mask(graph, tensor) -> tuple[gs.Tensor, float] | None:
    """(m, c) when ``tensor`` is ``Mul(Sub(1, m), c)`` (either operand order of the Mul; Casts between the
    Sub and the Mul, as ``--precision fp16`` leaves them, seen through: for m in {0, 1}, 1 - m is 0 or 1
    in every float type), c a finite scalar constant: transformers 4's extended attention mask ``(1.0 -
    mask.to(dtype)) * finfo.min``, m being the ``Cast``; else None."""
    mul = producer_of(tensor)
    if not is_op(mul, "Mul") or len(mul.inputs) != 2:
        return None
    for sub_out, scale in (mul.inputs, mul.inputs[::-1]):
        c, sub = scalar_constant(graph, scale), producer_of(sub_out)
        while is_op(sub, "Cast") and sub.inputs:  # --precision fp16: the Sub in float16, cast up (1 - m is 0 or 1)
            sub = producer_of(sub.inputs[0])
        if c is None or not is_op(sub, "Sub") or len(sub.inputs) != 2:
            continue
        c, one = float(np.asarray(c, np.float64).reshape(())), scalar_constant(graph, sub.inputs[0])
        if np.isfinite(c) and one is not None and float(np.asarray(one).reshape(())) == 1.0:
            return sub.inputs[1], c
    return None


def promised_zero_one(graph, tensor, inputs: frozenset[str]) -> bool:
    """``tensor`` holds only 0 and 1 because it is one of ``inputs`` (promised 0/1) rearranged by ops
    whose output elements are elements of their first input (:data:`~onnxfuse.rewrites.facts.graph.REARRANGING`:
    Gather and Tile too) and Casts (0 and 1 stay 0 and 1, or False and True)."""
    seen = 0
    while inputs and seen < 16:
        if any(t is tensor for t in graph.inputs):
            return tensor.name in inputs
        node = producer_of(tensor)
        if node is None or not node.inputs or not (is_op(node, *REARRANGING) or is_op(node, "Cast")):
            return False
        tensor, seen = node.inputs[0], seen + 1
    return False


def _same_length(graph, keep, pad: int, i: int, source) -> bool:
    """Dimension ``i`` of ``keep`` (right-aligned to rank 4: ``pad`` leading axes missing) has the length
    of ``source`` = (tensor, axis), both proved from how the tensors are made
    (:func:`~onnxfuse.rewrites.facts.shape_values.axis_length`)."""
    if source is None or i < pad:
        return False
    return same_length(axis_length(graph, keep, i - pad), axis_length(graph, *source))


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


def _bool_values_kept(graph, node) -> bool:
    """``node``'s output holds its first input's bool values, at most broadcast: ``Expand``, ``Identity``,
    a bool-to-bool ``Cast``."""
    return node is not None and bool(node.inputs) and (is_op(node, "Expand", "Identity") or (
        is_op(node, "Cast") and int(node.attrs.get("to", 0)) == 9 and dtype_of(graph, node.inputs[0]) == np.dtype(bool)))


def always_true(graph, tensor, depth: int = 8) -> bool:
    """Every element of the bool ``tensor`` is True whatever the inputs: an all-True constant; ``x >= c``
    (``c <= x``) with x provably non-negative (:func:`~onnxfuse.rewrites.facts.graph.provably_nonnegative`)
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
    if _bool_values_kept(graph, p):
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


def always_false(graph, tensor, depth: int = 8) -> bool:
    """Every element of the bool ``tensor`` is False whatever the inputs: an all-False constant; ``And(x,
    Not(x))``, the contradiction expand-by-broadcast writes to broadcast a bool tensor (``Or(x, never)``,
    never = ``And(cond, Not(cond))`` of the Expand's shape: DistilBERT's float16 ``mask.expand_as(scores)``
    becomes that); ``And`` with one such operand, ``Or`` of two, ``Not`` of :func:`always_true`, and
    bool-to-bool ``Cast``, ``Expand`` and ``Identity`` of one."""
    value = constant_value(graph, tensor)
    if value is not None:
        return value.dtype == np.bool_ and value.size > 0 and not bool(np.any(value))
    p = producer_of(tensor)
    if depth == 0 or p is None or not p.inputs:
        return False
    if _bool_values_kept(graph, p):
        return always_false(graph, p.inputs[0], depth - 1)
    if is_op(p, "Not"):
        return always_true(graph, p.inputs[0], depth - 1)
    if is_op(p, "And", "Or") and len(p.inputs) == 2:
        a, b = p.inputs
        if p.op == "And":
            def negates(y, x) -> bool:  # y = Not(x)
                n = producer_of(y)
                return is_op(n, "Not") and bool(n.inputs) and n.inputs[0] is x

            return negates(b, a) or negates(a, b) or always_false(graph, a, depth - 1) \
                or always_false(graph, b, depth - 1)
        return always_false(graph, a, depth - 1) and always_false(graph, b, depth - 1)
    return False


def broadcast_source(graph, tensor, depth: int = 8):
    """The tensor that ``tensor`` is a broadcast of: back through ``Expand`` (it only broadcasts),
    ``And`` with an all-True operand (a constant, or :func:`always_true`) and ``Or`` with an all-False
    one (a constant, or :func:`always_false`: expand-by-broadcast's form of a bool Expand) (the
    identities of bool logic, which then only broadcast the other operand), bool-to-bool
    ``Cast``, ``Identity`` and a ``Slice`` that keeps every element (:func:`whole_slice`: transformers'
    sdpa attention cuts its mask to the key's length, ``mask[:, :, :, :L]``, which it already is).
    Each step keeps every element of the result equal to the source's element at the broadcast index."""
    for _ in range(depth):
        p = producer_of(tensor)
        if _bool_values_kept(graph, p) or (is_op(p, "Slice") and whole_slice(graph, p)):
            tensor = p.inputs[0]
        elif is_op(p, "And", "Or") and len(p.inputs) == 2:
            identity = p.op == "And"
            for this, other in (p.inputs, p.inputs[::-1]):
                value = constant_value(graph, other)
                if (value is not None and value.dtype == np.bool_ and bool(np.all(value == identity))) \
                        or (identity and always_true(graph, other)) or (not identity and always_false(graph, other)):
                    tensor = this
                    break
            else:
                return tensor
        else:
            return tensor
    return tensor


