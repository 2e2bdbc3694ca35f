"""Heads and their sources: q, k and v split into heads, traced back to the tensor each was cut from.

**Heads** (:func:`split_heads`), two layouts, H and D read
from the Reshape targets (constants after fold-constants and constant-reshape-target), never a model
type, never a head count asked; E = H·D must be the source's static last dimension; q, k and v must
agree on H, D and layout:

* *batch-first* (BERT, RoBERTa, DistilBERT, GPT-2, Whisper): ``Transpose(0,2,1,3)(Reshape(x [B,S,E],
  [b, s, H, D]))``; Kᵀ by perm (0,2,3,1) or the heads Transpose then (0,1,3,2). Each of b, s is 0 or
  the static dimension it keeps; or one of them is -1 while the other keeps its dimension and H, D are
  given: the element count then forces -1 to be the dimension it replaces. H or D may be -1 instead
  (inferred from E). The output is merged by Transpose(0,2,1,3) into [B,S,H,D], possibly after a
  Reshape of P·V to [B, -1, S, D] read from shapes (torch's scaled_dot_product_attention symbolic writes
  it), proved an identity by :func:`rows_reshape_problem`.
* *sequence-first* (``torch.nn.MultiheadAttention``, torchvision's ViT): ``Reshape(Transpose(1,0,2)(
  Reshape(x [S,B,E], [S, -1, D])), [-1, H, S, D])`` with S static: element (s, b, h·D+d) goes to
  (s, b·H+h, d), to (b·H+h, s, d), and row-major to (b, h, s, d), the heads of x. MultiHeadAttention
  gets ``Transpose(1,0,2)(x)`` = [B,S,E] for each of q, k, v (pure data movement), and its output is
  transposed back to [S,B,E] for the Reshape that read the Transpose(2,0,1,3) merge [S,B,H,D].
* *given* (Llama, Qwen2, Mistral: :func:`given_heads`): when a
  heads tensor cannot be traced to the tensor it was cut from (rotary embeddings rotate q and k after the
  split; ``repeat_kv`` repeats each key/value head H / H_kv times by Unsqueeze, Expand, Reshape), it is
  taken as the graph has it: [B, H, S, D] with H and D static (Kᵀ: ``Transpose(0,1,3,2)`` of [B, H, L,
  D]). MultiHeadAttention then reads key and value as those [B, H, L, D] heads (its "past" layout, which
  takes no ``bias`` input; a K or V that was split is re-read as its heads) and the query as
  ``Reshape(Transpose(0,2,1,3)(q), [0, 0, E])``, or q's [B, S, E] source when q was split: head h's values
  at h·D + d, as the op splits them. Whatever made the heads stays in the graph. Float16 only: measured on
  H100 (benchmarks/gqa_attention.py, the attention core of Llama-3-8B's and Qwen2-0.5B's shapes, S 128 and
  512) 1.4-2.7x faster in float16 and 0.82-1.04x in float32; on the whole Qwen2-0.5B-shaped zoo model
  (docs/benchmarks.md 5.14) 9-10% faster in float16, -2% / +0.5% (batch 1 / 16) in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.facts import strip_scale
from onnxfuse.rewrites.contrib.attention.layout import (
    BATCH_FIRST,
    GIVEN,
    HEADS,
    HEADS_T,
    SEQ_FIRST,
    SEQ_FIRST_MERGE,
    SWAP_LAST,
    copies_dim,
)
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import constant_value, consumers, int_attr, is_op, only_read_by, perm_of, producer_of, shape_of
from onnxfuse.rewrites.facts.shape_values import shape_read

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


def _batch_first(graph, r, t) -> Head | Refuse:
    """``Transpose(perm)(Reshape(source [B, S, E], [b, s, H, D]))``: every entry of [b, s] copies the
    source's dimension (0 or the same static value), or one of them is -1 while the other copies and
    H and D are given: the element count then forces -1 to be the remaining dimension."""
    if r is None or not is_op(r, "Reshape") or len(r.inputs) != 2 or int(r.attrs.get("allowzero", 0)):
        return Refuse("heads are not split by a Reshape")
    target = constant_value(graph, r.inputs[1])
    if target is None or target.ndim != 1 or target.size != 4:
        return Refuse("the head-splitting Reshape's target is not a constant [·, ·, H, D]")
    source = r.inputs[0]
    shape = shape_of(graph, source)
    if shape is None or len(shape) != 3 or not isinstance(shape[2], int):
        return Refuse(f"{source.name!r} is not [batch, sequence, hidden] with a static hidden size")
    hidden = shape[2]
    target = [int(v) for v in target]
    heads, size = target[2], target[3]
    if heads == -1 and size > 0 and hidden % size == 0:  # [·, ·, -1, D]: H inferred
        heads = hidden // size
        if -1 in target[:2]:
            return Refuse("the head-splitting Reshape's target has two -1 entries")
    elif size == -1 and heads > 0 and hidden % heads == 0:  # [·, ·, H, -1]: D inferred
        size = hidden // heads
        if -1 in target[:2]:
            return Refuse("the head-splitting Reshape's target has two -1 entries")
    if heads <= 0 or size <= 0 or heads * size != hidden:
        return Refuse(f"the head-splitting Reshape's target {target} does not split {hidden} into H x D")
    copies = [copies_dim(target[i], shape[i]) for i in (0, 1)]
    if not (all(copies) or (target[0] == -1 and copies[1]) or (target[1] == -1 and copies[0])):
        return Refuse("the head-splitting Reshape changes the batch or sequence dimension")
    return Head(source, heads, size, [t, r], BATCH_FIRST)


def _sequence_first(graph, r4) -> Head | Refuse:
    """torch.nn.MultiheadAttention's split: ``Reshape(Transpose(Reshape(x [S, B, E], [S, -1, D]),
    perm=[1, 0, 2]), [-1, H, S, D])``. Element (s, b, h·D + d) goes to (s, b·H + h, d), then to
    (b·H + h, s, d), then, row-major, to (b, h, s, d): the heads of the sequence-first x."""
    if len(r4.inputs) != 2 or int(r4.attrs.get("allowzero", 0)):
        return Refuse("heads are not split by a Reshape")
    t = producer_of(r4.inputs[0])
    if t is None or perm_of(t) != [1, 0, 2]:
        return Refuse("heads are not split by Transpose(perm=[0, 2, 1, 3]) nor by Reshape(Transpose(perm=[1, 0, 2]))")
    r3 = producer_of(t.inputs[0])
    if r3 is None or not is_op(r3, "Reshape") or len(r3.inputs) != 2 or int(r3.attrs.get("allowzero", 0)):
        return Refuse("the [S, B·H, D] heads are not made by a Reshape")
    t3, t4 = constant_value(graph, r3.inputs[1]), constant_value(graph, r4.inputs[1])
    if t3 is None or t4 is None or t3.shape != (3,) or t4.shape != (4,):
        return Refuse("the sequence-first head split's Reshape targets are not constants [S, -1, D] and [-1, H, S, D]")
    source = r3.inputs[0]
    shape = shape_of(graph, source)
    if shape is None or len(shape) != 3 or not isinstance(shape[2], int) or not isinstance(shape[0], int):
        return Refuse(f"{source.name!r} is not [sequence, batch, hidden] with a static sequence and hidden size")
    seq, hidden = shape[0], shape[2]
    size = int(t3[2])
    if not (copies_dim(t3[0], seq) and int(t3[1]) == -1 and size > 0 and hidden % size == 0):
        return Refuse(f"the sequence-first head split's target {t3.tolist()} is not [S, -1, D]")
    heads = hidden // size
    if [int(v) for v in t4] != [-1, heads, seq, size]:
        return Refuse(f"the sequence-first head merge's target {t4.tolist()} is not [-1, {heads}, {seq}, {size}]")
    return Head(source, heads, size, [r4, t, r3], SEQ_FIRST)


def split_heads(graph, tensor, transposed: bool) -> Head | Refuse:
    """``tensor`` [B, H, S, D] (Kᵀ [B, H, D, L] when ``transposed``) traced to the rank-3 tensor it was cut
    from. Kᵀ is the heads perm [0, 2, 3, 1] in one step, or any heads form followed by a swap of the last
    two axes."""
    t = producer_of(tensor)
    if t is None:
        return Refuse("no head-splitting producer")
    perm = perm_of(t)
    if transposed:
        if perm == SWAP_LAST:
            inner = split_heads(graph, t.inputs[0], transposed=False)
            if isinstance(inner, Refuse):
                return Refuse("Kᵀ is not a Transpose of the split heads: " + inner.reason)
            inner.nodes.insert(0, t)
            return inner
        if perm != HEADS_T:
            return Refuse(f"expected a Transpose(perm={HEADS_T}) splitting heads")
        return _batch_first(graph, producer_of(t.inputs[0]), t)
    if perm == HEADS:
        return _batch_first(graph, producer_of(t.inputs[0]), t)
    if is_op(t, "Reshape"):
        return _sequence_first(graph, t)
    return Refuse(f"expected a Transpose(perm={HEADS}) splitting heads")


def given_heads(graph, tensor, transposed: bool, why: str = "") -> Head | Refuse:
    """``tensor`` taken as heads the way the graph already has them, when it cannot be traced to the
    [B, S, E] tensor it was cut from: [B, H, S, D] with H and D static (Kᵀ: ``Transpose(perm=[0, 1, 3,
    2])`` of such a [B, H, L, D] k). This is how Llama-style models reach the scores: rotary embeddings
    rotate q and k after the head split (elementwise on [B, H, S, D]) and ``repeat_kv`` repeats each of
    the H_kv key/value heads H / H_kv times (Unsqueeze, Expand, Reshape) before QKᵀ and P·V. Whatever made
    the heads stays in the graph; MultiHeadAttention reads key and value in this layout (its [B, H, L, D]
    "past" form) and the query merged back to [B, S, E] (:mod:`~onnxfuse.rewrites.contrib.attention.emit`)."""
    nodes = []
    if transposed:
        t = producer_of(tensor)
        if t is None or perm_of(t) != SWAP_LAST:
            return Refuse(f"Kᵀ is not Transpose(perm={SWAP_LAST}) of [B, H, L, D] heads")
        nodes, tensor = [t], t.inputs[0]
    shape = shape_of(graph, tensor)
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) and d > 0 for d in (shape[1], shape[3])):
        return Refuse(f"{tensor.name!r} is not [B, H, S, D] heads with a static H and D")
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


def heads_of(graph, tensor, transposed: bool, which: str) -> Head | Refuse:
    """``tensor``'s heads split from the tensor they were cut from, else as the graph has them
    (:func:`given_heads`); or why neither."""
    head = split_heads(graph, tensor, transposed)
    if isinstance(head, Refuse):
        given = given_heads(graph, tensor, transposed, why=f"{which}: {head.reason}")
        if isinstance(given, Refuse):
            return Refuse(f"{which}: {head.reason}; as given heads: {given.reason}")
        head = given
    return head


def values_and_merge(graph, v_heads, out):
    """(V's heads, Transpose, Reshape, rows Reshape or None): V split into heads (or given) and the
    attention output ``out`` [B, H, S, D] merged back by a Transpose read only by a Reshape, in V's layout,
    possibly through a Reshape of ``out`` to [b, h, s, d] read from shapes first (torch's
    scaled_dot_product_attention symbolic writes ``Reshape(out, [B, -1, S, D])``; the caller proves it
    an identity with :func:`rows_reshape_problem` once q is known); or why not."""
    v = heads_of(graph, v_heads, False, "V")
    if isinstance(v, Refuse):
        return v
    merge_perm = SEQ_FIRST_MERGE if v.layout == SEQ_FIRST else HEADS
    after = consumers(out)
    rows = None
    reshapes = [n for n in after if not is_op(n, "Shape")]  # Shape readers: the shape reads of the rewrite
    if (len(reshapes) == 1 and is_op(reshapes[0], "Reshape") and reshapes[0].inputs[0] is out
            and int_attr(reshapes[0], "allowzero", 0) == 0):
        rows = reshapes[0]
        after = consumers(rows.outputs[0])
    if len(after) != 1 or perm_of(after[0]) != merge_perm:
        why = f"{v.why}; as given heads: " if v.layout == GIVEN else ""
        return Refuse(f"{why}the attention output is not merged back by Transpose(perm={merge_perm})")
    merge_t = after[0]
    after = consumers(merge_t.outputs[0])
    if len(after) != 1 or not is_op(after[0], "Reshape") or after[0].inputs[0] is not merge_t.outputs[0]:
        return Refuse("the attention output is not merged back by a Reshape")
    return v, merge_t, after[0], rows


def rows_reshape_problem(graph, reshape, out, rows_from, values) -> Refuse | None:
    """Why ``reshape`` (``Reshape(out, Concat(b, h, s, d))``, out the attention's [B, H, S, D] P·V) might
    not give ``out`` back, or None. Each entry must keep its dimension: a 0 or the static size there, one
    -1 (then inferred as the one dimension left), or that dimension read from a tensor that has it: ``out``
    itself at the same position, the query heads ``rows_from`` at position 2 (the score rows are the
    query's), ``values`` (V's heads) at position 3 (the output's columns are V's). The batch is read
    from ``out`` only (a broadcast MatMul may have another on its inputs)."""
    concat = producer_of(reshape.inputs[1])
    if not is_op(concat, "Concat") or len(concat.inputs) != 4:
        return Refuse("the Reshape after P·V has no 4-part Concat target")
    shape = shape_of(graph, out) or [None] * 4
    holders = {0: {id(out)}, 1: {id(out)}, 2: {id(out)} | {id(t) for t in rows_from}, 3: {id(out), id(values)}}
    inferred = 0
    for i, part in enumerate(concat.inputs):
        value = constant_value(graph, part)
        if value is not None:
            if value.size != 1:
                return Refuse("the Reshape after P·V has a multi-element constant part")
            entry = int(value.reshape(-1)[0])
            inferred += entry == -1
            if entry != -1 and not copies_dim(entry, shape[i] if i < len(shape) else None):
                return Refuse(f"the Reshape after P·V changes dimension {i} (to {entry})")
            continue
        read = shape_read(graph, part)
        if read is None or read[1] != [i] or id(read[0]) not in holders[i]:
            return Refuse(f"the Reshape after P·V reads dimension {i} from a tensor not known to have it")
    if inferred > 1:
        return Refuse("the Reshape after P·V infers more than one dimension")
    return None


def rows_target_nodes(reshape, out) -> list | Refuse:
    """The nodes computing ``reshape``'s target from ``out``'s own shape (``Shape(out)`` → Gather →
    Unsqueeze → the Concat): they go with the Reshape, so each must be read only by them and the Reshape;
    or why not."""
    concat = producer_of(reshape.inputs[1])
    chain, frontier = {id(concat): concat}, [n for n in consumers(out) if is_op(n, "Shape")]
    while frontier:
        node = frontier.pop()
        if id(node) in chain:
            continue
        chain[id(node)] = node
        frontier.extend(c for t in node.outputs for c in consumers(t) if c is not concat)
        if len(chain) > 16:
            return Refuse("the P·V output's shape feeds more than the Reshape after it")
    allowed = set(chain) | {id(reshape)}
    for node in chain.values():
        for t in node.outputs:
            if any(id(c) not in allowed for c in consumers(t)):
                return Refuse(f"the P·V output's shape is also read by {next(c for c in consumers(t) if id(c) not in allowed).name!r}")
    return list(chain.values())


def query_key_value(graph, query, key, key_transposed: bool, v, v_heads, nodes, factors):
    """(Q's, K's and V's heads): Q and K split (or given) from the attention's q and k inputs (Kᵀ when
    ``key_transposed``), the scalar factors on each peeled into ``factors`` and their nodes into ``nodes``,
    then read together with ``v`` (split from ``v_heads``) by :func:`_given_kv`; or why not."""
    q = heads_of(graph, strip_scale(graph, query, nodes, factors), False, "Q")
    if isinstance(q, Refuse):
        return q
    k_heads = strip_scale(graph, key, nodes, factors)
    k = heads_of(graph, k_heads, key_transposed, "K")
    if isinstance(k, Refuse):
        return k
    return _given_kv(q, k, v, None if key_transposed else k_heads, v_heads)


def _given_kv(q, k, v, k_heads, v_heads):
    """(q, k, v) with k and v re-read as given heads when any of the three is (MultiHeadAttention takes
    key and value in one layout; q stays split when it is: the op reads its [B, S, E] source); or why
    not. ``k_heads`` (None when the scores read Kᵀ), ``v_heads``: the [B, H, L, D] tensors read."""
    if GIVEN not in (q.layout, k.layout, v.layout):
        return q, k, v
    why = next(head.why for head in (q, k, v) if head.layout == GIVEN)
    if SEQ_FIRST in (q.layout, k.layout, v.layout):
        return Refuse(f"{why}; taken as given heads, beside heads split from a sequence-first [S, B, E] tensor")
    k_given, v_given = as_given(k, k_heads), as_given(v, v_heads)
    if k_given is None:
        return Refuse(f"{why}; taken as given heads, but Kᵀ is made in one step from [B, S, E] (no [B, H, L, D] key to read)")
    return q, k_given, v_given


def shared_splits(graph, heads, nodes, merge_r) -> set:
    """The ids of the head-splitting nodes of ``heads`` (q, k, v split batch-first) that must stay in the
    graph because something outside the attention (``nodes`` and the merging ``merge_r``) reads them, or
    they are graph outputs: each such node and every split node between it and the source it cuts.

    A T5 or BART decoder's first step (optimum's ``decoder_model``) returns its keys and values as
    ``present`` outputs: ``Transpose(perm=[0, 2, 1, 3])`` of the very Reshape whose ``Transpose(perm=[0, 2,
    3, 1])`` makes Kᵀ. The fused op reads k and v as their [B, L, E] sources, so the split the outputs
    need stays (it computes what it computed) and only the nodes the attention alone read are removed;
    the caller checks again that nothing removed is read outside."""
    inside = [*nodes, merge_r]
    kept = set()
    for head in heads:
        if head.layout != BATCH_FIRST:
            continue
        for i, node in enumerate(head.nodes):  # from the attention's side towards the source
            if any(only_read_by(graph, out, inside) for out in node.outputs):
                kept.update(id(n) for n in head.nodes[i:])
                break
    return kept


def repeated_heads(graph, tensor):
    """(x [B, H_kv, L, D], n) when ``tensor`` is ``Gather(x, [0]*n + [1]*n + …, axis=1)`` (repeat_kv as
    repeat-heads-gather leaves it: each key/value head n times, n > 1), else None."""
    node = producer_of(tensor)
    if not is_op(node, "Gather") or int(node.attrs.get("axis", 0)) != 1 or len(node.inputs) != 2:
        return None
    index = constant_value(graph, node.inputs[1])
    shape = shape_of(graph, node.inputs[0])
    if index is None or index.ndim != 1 or shape is None or len(shape) != 4 or not isinstance(shape[1], int):
        return None
    kv_heads = shape[1]
    if kv_heads <= 0 or index.size % kv_heads or index.size == kv_heads:
        return None
    n = index.size // kv_heads
    if not np.array_equal(index, np.repeat(np.arange(kv_heads), n)):
        return None
    return node.inputs[0], n


def heads_source(graph, tensor, kv_heads: int, size: int):
    """x [B, S, H_kv·D] when ``tensor`` is ``Transpose(0, 2, 1, 3)(Reshape(x, [0 or B, 0 or -1 or S,
    H_kv, D]))`` (H_kv or D may be the one -1: the element count forces it), else None: the heads of x's
    last axis moved before its sequence axis."""
    t = producer_of(tensor)
    if not is_op(t, "Transpose") or perm_of(t) != [0, 2, 1, 3]:
        return None
    r = producer_of(t.inputs[0])
    if not is_op(r, "Reshape") or int_attr(r, "allowzero", 0) != 0:
        return None
    target = constant_value(graph, r.inputs[1])
    source = r.inputs[0]
    shape = shape_of(graph, source)
    if target is None or target.shape != (4,) or shape is None or len(shape) != 3 or shape[2] != kv_heads * size:
        return None
    b, s, h, d = (int(v) for v in target)
    if list(target).count(-1) > 1 or b not in (0, shape[0]) or s not in (0, -1, shape[1]):
        return None
    if (h, d) not in ((kv_heads, size), (-1, size), (kv_heads, -1)):  # one -1 is forced by H_kv·D = E
        return None
    return source


def cache_append(graph, tensor, kv_heads: int, size: int, rotated: bool):
    """(past, x, rotary node or None) when ``tensor`` is ``Concat(past, new, axis=2)`` with ``new`` the
    heads of x [B, S, H_kv·D] (``rotated``: through one RotaryEmbedding), else None."""
    concat = producer_of(tensor)
    if not is_op(concat, "Concat") or len(concat.inputs) != 2 or int_attr(concat, "axis", 0) not in (2, -2):
        return None
    past, new = concat.inputs
    rotary = None
    if rotated:
        rotary = producer_of(new)
        if not is_op(rotary, "RotaryEmbedding") or rotary.domain not in ("", "ai.onnx") or len(rotary.inputs) != 3:
            return None  # ONNX's RotaryEmbedding with its caches, no position_ids
        new = rotary.inputs[0]
    source = heads_source(graph, new, kv_heads, size)
    past_shape = shape_of(graph, past)
    if source is None or past_shape is None or len(past_shape) != 4 or list(past_shape[1:2]) + list(past_shape[3:]) != [kv_heads, size]:
        return None
    return past, source, rotary


def plain_mha_inputs(graph, node):
    """(its 8 inputs, empty ones spelled out; H; D) for a MultiHeadAttention that the cache rules may
    rewrite: no ``bias``, ``key_padding_mask`` or past inputs, and a query [B, S, H·D] with H·D known;
    else a Refuse saying which."""
    inputs = list(node.inputs) + [gs.Variable.empty()] * (8 - len(node.inputs))
    if any(not t.is_empty() for t in (inputs[3], inputs[4], inputs[6], inputs[7])):
        return Refuse("MultiHeadAttention with a bias, key_padding_mask or past inputs")
    heads = int(node.attrs.get("num_heads", 0))
    query_shape = shape_of(graph, inputs[0])
    if query_shape is None or len(query_shape) != 3 or not isinstance(query_shape[2], int) or heads <= 0 \
            or query_shape[2] % heads:
        return Refuse("the query is not [B, S, H·D] with H·D known")
    return inputs, heads, query_shape[2] // heads

