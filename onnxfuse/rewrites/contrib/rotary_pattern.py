"""The rotary embedding (RoPE) as Llama-family exports write it, matched from its final ``Add``.

transformers' ``apply_rotary_pos_emb`` (Llama, Qwen2, Mistral, Gemma, Phi-3 with full rotation)::

    rotate_half(x) = Concat(Neg(x[..., h:]), x[..., :h], axis=-1)          h = D / 2
    y = x · Unsqueeze(cos, 1) + rotate_half(x) · Unsqueeze(sin, 1)         x [B, H, S, D], cos, sin [B, S, D]

with ``cos = Cos(Concat(f, f, axis=-1))`` (and ``sin`` the same with Sin), ``f = position · inv_freq``
[B, S, h], possibly scaled by a scalar (the rope's ``attention_scaling``) and cast to x's type.

**What is proved** (:func:`match_rotary`): the two Slices cut x's last axis at h = D / 2 with D static and
even (``[:h]`` and ``[h:]``, step 1); the Concat puts the negated second half first; each Mul multiplies
by a ``Unsqueeze(·, axes=[1])`` of a rank-3 tensor (or a ``Cast`` between float types of that Unsqueeze:
optimum's float16 Gemma export rotates its float32 layers with the float16 caches cast up) whose batch
and sequence dimensions are provably x's
(ONNX's ``RotaryEmbedding`` without position ids takes a cache of exactly [B, S, D / 2]), or whose batch
is 1 and broadcast over x's (optimum's Gemma export computes its positions as [1, S]: the rewrite then
expands both caches to x's batch first, a copy per model once duplicates merge); and every
position of cos and sin holds the same value at i and i + h (:func:`halves_repeat`): the tensor is a
chain of elementwise steps (Cast between float types, Cos, Sin, Identity, Neg, or a Mul/Div/Add/Sub with
a one-element constant) over ``Concat(a, a)`` on the last axis with a's last dimension h.

**Why that is the op's maths**: ONNX ``RotaryEmbedding`` (opset 23, no ``position_ids``, not interleaved)
computes, with x₁ = x[..., :h], x₂ = x[..., h:] and c, s its [B, S, h] caches,
``Concat(x₁·c − x₂·s, x₂·c + x₁·s)``. The pattern computes ``x·cos + rotate_half(x)·sin``: its first
half x₁·cos[:h] − x₂·sin[:h], its second x₂·cos[h:] + x₁·sin[h:]; with cos[:h] = cos[h:] = c (the
repetition proved above) and likewise for sin, the same values. The caches are ``cos[..., :h]`` and
``sin[..., :h]`` (one Slice each, shared by every layer once duplicates merge), followed by the same Cast
where the pattern cast its Unsqueeze (a Cast is per element, so casting the slice gives the values the
pattern multiplied by: exact). Rounding: the op
rounds once per output in x's type where the pattern rounded each product and the sum (float16: within
a unit in the last place or two).

**Merged heads** (:func:`merged_form`): when x is ``Transpose(Reshape(src [B, S, E], [b, s, H, D]),
perm=[0, 2, 1, 3])`` (b, s copying src's dimensions; H may be -1, inferred from E) and the rotated heads are only merged back to
[B, S, E] by ``Transpose(perm=[0, 2, 1, 3])`` and a Reshape with a constant target [b, s, E] (what
contrib-attention writes for MultiHeadAttention's query from given heads), the op takes ``src`` in its
3-D form with ``num_heads = H`` and writes the merged tensor directly: it splits [B, S, H·D] into heads
itself, head h's values at h·D + d as the Reshape put them, so the values are the same and the split
and merge (four kernels) go.

**Partial rotation** (:func:`partial_form`; Phi-3 with ``partial_rotary_factor`` < 1, Phi-4-mini, GPT-NeoX's
``rotary_pct``): transformers writes ``Concat(rope(src[..., :R]), src[..., R:], axis=-1)`` with cos and sin
[B, S, R]. The pattern above then matches with x = ``src[..., :R]`` and D = R. When the rotated x is
read only by that Concat, whose other operand is ``src[..., R:]`` (to the end) of the same src
[B, H, S, D], D > R static, the op takes src itself with ``rotary_embedding_dim = R``: ONNX
RotaryEmbedding-23 then rotates ``src[..., :R]`` with the [B, S, R/2] caches and concatenates
``src[..., R:]`` unchanged (the spec's function body: ``x_rotate = x[..., :rotary_embedding_dim]``,
``x_not_rotate = x[..., rotary_embedding_dim:]``, Concat on the last axis), which is the pattern's
value; the pass-through half is copied, bitwise equal. ONNX Runtime 1.32's CPU kernel agrees with a
float64 reference (tests/rewrites/contrib/test_contrib_rotary_embedding.py). Otherwise the sliced x is
rotated as it stands (a full rotation of an R-wide tensor) and the Slices and Concat stay.

**Refused**, with the reason: any piece missing or shaped otherwise; cos and sin narrower than the
rotated x; interleaved pairs (GPT-J); cos or sin not provably
repeated in halves; a cache batch (other than 1) or sequence dimension not provably x's; cos broadcast
over the batch and sin not, or the other way round; an intermediate read outside the pattern; element types other than float32, float16 or
bfloat16, or x's and the caches' types differing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxfuse.rewrites.contrib.attention.layout import HEADS, copies_dim
from onnxfuse.rewrites.facts.graph import (axes_of, consumers, constant_value, dims_equal, dtype_of, internal_problem,
                                            is_graph_output, is_op, perm_of, producer_of, shape_of)
from onnxfuse.rewrites.engine.rule import Refuse

INT64_MAX = np.iinfo(np.int64).max
#: steps that keep "value at i equals value at i + h" on the last axis
_PER_ELEMENT = ("Cast", "Cos", "Sin", "Identity", "Neg")
_SCALAR_BINARY = ("Mul", "Div", "Add", "Sub")


@dataclass
class Rotary:
    """A matched rotary embedding: ``root`` (the Add) computes RoPE of ``x`` with ``cos``/``sin`` [B, S, D]."""

    root: gs.Node
    x: gs.Tensor
    cos: gs.Tensor
    sin: gs.Tensor
    half: int
    nodes: list
    merged: tuple | None = None  # (src [B, S, E], H, the merging Reshape) for the 3-D form: see merged_form
    partial: tuple | None = None  # (src [B, H, S, D], the pass-through Concat) for partial rotation: see partial_form
    broadcast_batch: bool = False  # cos and sin are [1, S, D], broadcast over x's batch: expanded to it first
    cache_cast: np.dtype | None = None  # the type the pattern cast both Unsqueezed caches to, if it did


def _slice_bounds(graph, node):
    """(start, end) of a step-1 Slice of the last axis of a rank-4 tensor, or None."""
    if not is_op(node, "Slice") or len(node.inputs) < 3:
        return None
    values = [constant_value(graph, t) for t in node.inputs[1:]]
    if any(v is None or v.size != 1 for v in values):
        return None
    start, end = int(values[0].ravel()[0]), int(values[1].ravel()[0])
    axis = int(values[2].ravel()[0]) if len(values) > 2 else 0
    step = int(values[3].ravel()[0]) if len(values) > 3 else 1
    if axis not in (-1, 3) or step != 1:
        return None
    return start, end


def _rotate_half(graph, concat, x, half: int):
    """The nodes of ``Concat(Neg(x[..., h:]), x[..., :h], axis=-1)`` or None."""
    if not is_op(concat, "Concat") or len(concat.inputs) != 2 or int(concat.attrs.get("axis", 0)) not in (-1, 3):
        return None
    neg, first = producer_of(concat.inputs[0]), producer_of(concat.inputs[1])
    if not is_op(neg, "Neg"):
        return None
    second = producer_of(neg.inputs[0])
    if not (is_op(first, "Slice") and is_op(second, "Slice")) or first.inputs[0] is not x or second.inputs[0] is not x:
        return None
    if _slice_bounds(graph, first) != (0, half):
        return None
    bounds = _slice_bounds(graph, second)
    if bounds is None or bounds[0] != half or bounds[1] < 2 * half:
        return None
    return [concat, neg, first, second]


#: the Casts taken between an Unsqueezed cache and its Mul: ONNX element type → the numpy type (float32
#: and float16, the types contrib-rotary-embedding writes the op for)
_CAST_TARGETS = {TensorProto.FLOAT: np.dtype(np.float32), TensorProto.FLOAT16: np.dtype(np.float16)}


def _unsqueezed_cache(graph, tensor):
    """(the rank-3 cache, its Unsqueeze, the Cast's target type or None) when ``tensor`` is
    ``Unsqueeze(cache, axes=[1])`` or a Cast between float types of one, else None."""
    node, cast_to = producer_of(tensor), None
    if is_op(node, "Cast") and len(node.inputs) == 1:
        cast_to = _CAST_TARGETS.get(int(node.attrs.get("to", 0)))
        source = producer_of(node.inputs[0])
        if cast_to is None or dtype_of(graph, node.inputs[0]) not in _CAST_TARGETS.values():
            return None
        node = source
    if not is_op(node, "Unsqueeze") or axes_of(graph, node) != [1]:
        return None
    shape = shape_of(graph, node.inputs[0])
    if shape is None or len(shape) != 3:
        return None
    return node.inputs[0], node, cast_to


def halves_repeat(graph, tensor, half: int, depth: int = 0) -> bool:
    """Every value of ``tensor`` at last-axis index i equals the one at i + ``half``: a chain of per-element
    steps (module docstring) over ``Concat(a, a)`` on the last axis, a's last dimension ``half``."""
    node = producer_of(tensor)
    if node is None or depth > 8:
        return False
    if is_op(node, "Concat"):
        shape = shape_of(graph, node.inputs[0]) if len(node.inputs) == 2 else None
        return (len(node.inputs) == 2 and node.inputs[0] is node.inputs[1] and shape is not None
                and int(node.attrs.get("axis", 0)) in (-1, len(shape) - 1) and shape[-1] == half)
    if is_op(node, *_PER_ELEMENT) and len(node.inputs) == 1:
        return halves_repeat(graph, node.inputs[0], half, depth + 1)
    if is_op(node, *_SCALAR_BINARY) and len(node.inputs) == 2:
        for i in (0, 1):
            other = constant_value(graph, node.inputs[1 - i])
            if other is not None and other.size == 1:
                return halves_repeat(graph, node.inputs[i], half, depth + 1)
    return False


def _product(graph, mul):
    """(the tensor multiplied, the rank-3 cache, the cache's Unsqueeze, the Cast's target or None) of
    ``Mul(t, [Cast](Unsqueeze(cache, 1)))`` in either operand order, or None."""
    if not is_op(mul, "Mul") or len(mul.inputs) != 2:
        return None
    for i in (0, 1):
        found = _unsqueezed_cache(graph, mul.inputs[1 - i])
        if found is not None:
            return (mul.inputs[i], *found)
    return None


def rotary_candidate(node) -> bool:
    """An Add of two Mul results, one of them reading a Concat (rotate_half): cheap, so that the refusals
    listed are about rotary embeddings, not every Add of the model."""
    if not is_op(node, "Add") or len(node.inputs) != 2:
        return False
    muls = [producer_of(t) for t in node.inputs]
    return all(is_op(m, "Mul") for m in muls) and any(is_op(producer_of(t), "Concat") for m in muls for t in m.inputs)


def match_rotary(graph, add) -> Rotary | Refuse:
    """The rotary embedding ``add`` computes, or why it is not one (module docstring)."""
    products = [producer_of(t) for t in add.inputs]
    found = [_product(graph, m) for m in products]
    if any(f is None for f in found):
        return Refuse("not x·Unsqueeze(cos, 1) + rotate_half(x)·Unsqueeze(sin, 1)")
    for direct, rotated in ((0, 1), (1, 0)):
        x, cos, cos_u, cos_cast = found[direct]
        r, sin, sin_u, sin_cast = found[rotated]
        if cos_cast != sin_cast:
            return Refuse("cos and sin are not cast alike before their Muls")
        shape = shape_of(graph, x)
        if shape is None or len(shape) != 4 or not isinstance(shape[3], int) or shape[3] % 2:
            continue
        half = shape[3] // 2
        rotate = _rotate_half(graph, producer_of(r), x, half)
        if rotate is None:
            continue
        return _checked(graph, add, x, cos, sin, half, [add, *products, *rotate], shape, (cos_u, sin_u), cos_cast)
    return Refuse("no operand is rotate_half(x) = Concat(Neg(x[..., D/2:]), x[..., :D/2]) of the other's x [B, H, S, D]")


def _checked(graph, add, x, cos, sin, half, nodes, shape, unsqueezes, cache_cast=None) -> Rotary | Refuse:
    broadcast = []
    for name, cache in (("cos", cos), ("sin", sin)):
        cache_shape = shape_of(graph, cache)
        if cache_shape[2] != 2 * half:
            return Refuse(f"{name} is {cache_shape}, not [B, S, {2 * half}] (the caches must span the rotated x exactly)")
        broadcast.append(cache_shape[0] == 1 and not dims_equal(shape[0], 1))
        if not ((dims_equal(cache_shape[0], shape[0]) or broadcast[-1]) and dims_equal(cache_shape[1], shape[2])):
            return Refuse(f"{name}'s batch and sequence {cache_shape[:2]} are not provably x's {[shape[0], shape[2]]} "
                          "(RotaryEmbedding takes a [B, S, D/2] cache of exactly x's batch and sequence)")
        if not halves_repeat(graph, cache, half):
            return Refuse(f"{name} is not provably Concat(f, f) of frequencies f (its halves may differ)")
    cache_types = {dtype_of(graph, t) for t in (cos, sin)} if cache_cast is None else {cache_cast}
    if len(cache_types | {dtype_of(graph, x)}) != 1:
        return Refuse("x, cos and sin have different element types")
    # the Unsqueezes are shared by q's and k's rotary (and by every layer once duplicates merge): they stay
    problem = internal_problem(graph, nodes, add)
    if problem:
        return problem
    if broadcast[0] != broadcast[1]:
        return Refuse("one of cos and sin is broadcast over the batch and the other is not")
    found = Rotary(root=add, x=x, cos=cos, sin=sin, half=half, nodes=nodes, broadcast_batch=broadcast[0],
                   cache_cast=cache_cast)
    found.merged = merged_form(graph, found)
    if found.merged is not None:
        found.nodes = nodes + found.merged[3]
    else:
        partial = partial_form(graph, found)
        if partial is not None:
            found.partial, found.nodes = partial[:2], nodes + partial[2]
    return found


def partial_form(graph, found: Rotary):
    """(src, the Concat, the Slices and Concat) when the rotary is a partial one (module docstring):
    x = ``src[..., :R]`` (R = 2·half, step 1) and the only reader of the rotated x is
    ``Concat(rotated, src[..., R:], axis=-1)``, src [B, H, S, D] with D static and larger than R, the
    Slices read only by the pattern; else None."""
    r = 2 * found.half
    head = producer_of(found.x)
    if not is_op(head, "Slice") or _slice_bounds(graph, head) != (0, r):
        return None
    src = head.inputs[0]
    shape = shape_of(graph, src)
    if shape is None or len(shape) != 4 or not isinstance(shape[3], int) or shape[3] <= r:
        return None
    after = consumers(found.root.outputs[0])
    if len(after) != 1 or is_graph_output(graph, found.root.outputs[0]):
        return None
    concat = after[0]
    if (not is_op(concat, "Concat") or len(concat.inputs) != 2 or concat.inputs[0] is not found.root.outputs[0]
            or int(concat.attrs.get("axis", 0)) not in (-1, 3)):
        return None
    tail = producer_of(concat.inputs[1])
    bounds = _slice_bounds(graph, tail)
    if bounds is None or tail.inputs[0] is not src or bounds[0] != r or bounds[1] < shape[3]:
        return None
    extra = [head, tail, concat]
    if internal_problem(graph, found.nodes + extra, concat):
        return None
    return src, concat, extra


def _split(graph, x):
    """(src [B, S, E], H, the split's nodes) when x is ``Transpose(Reshape(src, [b, s, H, D]), perm=[0, 2, 1,
    3])`` read only by the rotary (its Muls and Slices), b and s copying src's dimensions; else None."""
    t = producer_of(x)
    r = producer_of(t.inputs[0]) if perm_of(t) == HEADS else None
    if not is_op(r, "Reshape") or int(r.attrs.get("allowzero", 0)) or len(r.inputs) != 2:
        return None
    target, src_shape = constant_value(graph, r.inputs[1]), shape_of(graph, r.inputs[0])
    if target is None or target.shape != (4,) or src_shape is None or len(src_shape) != 3:
        return None
    heads, size = int(target[2]), int(target[3])
    if heads == -1 and size > 0 and isinstance(src_shape[2], int) and src_shape[2] % size == 0:
        heads = src_shape[2] // size  # [b, s, -1, D]: H inferred from E
    if not (copies_dim(target[0], src_shape[0]) and copies_dim(target[1], src_shape[1]) and heads > 0
            and size > 0 and src_shape[2] == heads * size):
        return None
    return r.inputs[0], heads, [t, r]


def merged_form(graph, found: Rotary):
    """(src, H, the merging Reshape, the split and merge nodes) for the 3-D form (module docstring), or None."""
    split = _split(graph, found.x)
    if split is None:
        return None
    src, heads, split_nodes = split
    after = consumers(found.root.outputs[0])
    if len(after) != 1 or perm_of(after[0]) != HEADS or is_graph_output(graph, found.root.outputs[0]):
        return None
    merge_t = after[0]
    after = consumers(merge_t.outputs[0])
    if len(after) != 1 or not is_op(after[0], "Reshape") or is_graph_output(graph, merge_t.outputs[0]):
        return None
    merge_r = after[0]
    target, src_shape = constant_value(graph, merge_r.inputs[1]), shape_of(graph, src)
    if target is None or target.shape != (3,) or int(target[2]) != src_shape[2] or not (
            copies_dim(target[0], src_shape[0]) and copies_dim(target[1], src_shape[1])):
        return None
    inside = found.nodes + split_nodes
    # the split's outputs must be read only by the rotary (q's heads are not read elsewhere)
    if internal_problem(graph, inside + [merge_t], merge_t) or internal_problem(graph, inside, found.root):
        return None
    return src, heads, merge_r, split_nodes + [merge_t]
