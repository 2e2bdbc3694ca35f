"""contrib-attention-inputs: the data movement in front of a KV-cache decoder's MultiHeadAttention →
one ``ai.onnxfuse.AttentionInputs`` node (one kernel).

Why
---
A decode step is bound by kernel launches, about 7 µs each on an H100 host, not by the GPU (busy 1.5 of
3.8 ms; docs/benchmarks.md 5.30). Per layer of a Llama/Qwen2-family decoder, between the packed q/k/v
projection and the fused attention, onnxfuse's output launched 9 kernels: the ``Split`` of the packed
projection, two ``RotaryEmbedding`` (q and k), the k and v head transposes (device copies), the two
cache ``Concat`` (the ``present`` outputs) and the two ``Gather`` that repeat each key/value head for
its query heads; onnxruntime-genai's hand-built GroupQueryAttention spends 7 there. ``AttentionInputs``
writes all of those tensors in one launch (csrc/attention_inputs.cc; its contract in
docs/custom-ops.md).

What (exact)
------------
From ``qkv`` [B, S, (H + 2G)·D], the projection the ``Split`` cut into q [H·D], k [G·D], v [G·D] along
its last axis, the op writes:

* ``query`` [B, S, H·D]: q, each of its H heads rotated as ONNX's ``RotaryEmbedding`` (opset 23, caches
  [B, S, R/2] without position ids, the node's ``interleaved`` and ``rotary_embedding_dim``) rotated it,
  or q itself when the graph rotates nothing. The query the attention reads is that RotaryEmbedding's
  3-D output, or its 4-D output over q's heads merged back to [B, S, H·D] (``Transpose`` and
  ``Reshape(·, [0, 0, H·D])``, where contrib-rotary-embedding kept the 4-D form: a partial rotation,
  Phi-3 with ``partial_rotary_factor`` < 1);
* ``present_key`` [B, G, P + S, D] = ``Concat(past_key, heads of k rotated, axis=2)`` and
  ``present_value`` likewise with v: the graph's presents, the same tensors, still its outputs;
* with grouped queries (n = H / G > 1), ``key_heads`` / ``value_heads`` [B, H, P + S, D]: head h is
  present head h // n, what repeat-heads-gather's ``Gather(present, [0]*n + [1]*n + …, axis=1)``
  computed; without (n = 1) MultiHeadAttention reads the presents themselves.

When the packed projection has a bias (``Add(MatMul(x, W), b)``, pack-sibling-matmuls' form of Qwen2's
q/k/v biases) read only by the Split (and by Shape nodes), the op reads the MatMul's output and b
(spec ``bias=1``) and adds it first, rounded to the type as the Add was (for float16 and bfloat16 the
float32 sum rounded once equals the narrow Add's result: float32 has more than twice their precision
plus two bits): one kernel less per layer.

Copies, and the rotation x·cos ± partner·sin computed in float32 and rounded once (ONNX Runtime's
RotaryEmbedding kernel rounds the same expression; within a float16 ulp). A ``Shape`` of the old query
(the mask's size, as exporters read it) reads the new one, which has its shape, so the Split and the
rotation do not stay alive for it.

Refused (the graph is left as it is):

* a MultiHeadAttention with a ``bias``, ``key_padding_mask`` or past inputs of its own;
* keys or values that are not the cache ``Concat`` of the heads of a projection part (possibly
  repeated by that Gather);
* q, k and v that are not, in order, the three parts of one Split or three Slices (Phi-3's fused
  ``qkv_proj``) of a [B, S, (H + 2G)·D] projection along its last axis;
* rotations of q and k that differ in caches or attributes, one rotated and not the other, or a
  RotaryEmbedding with position ids (Qwen3's per-head norms before the rotation are not this pattern);
* element types other than float16, bfloat16 and float32;
* a graph where the op's inputs would depend on what it writes.

Measured (docs/benchmarks.md 5.31, Qwen2-0.5B-shaped float16 decoder): 534 → 342 kernels per decode
step; one step at batch 1 with 1024 cached tokens 4.04 → 2.95 ms on an H100 (onnxruntime-genai's
builder model 3.46 ms in the same run), and faster in every other cell measured.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.custom_ops import DOMAIN
from onnxfuse.rewrites.contrib.attention.heads import cache_append, heads_source, plain_mha_inputs, repeated_heads
from onnxfuse.rewrites.contrib.attention.inputs_op import OP_TYPE, spec_text
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (BF16, FP16, FP32, computed_from, constant_value, consumers, dtype_of, int_attr,
                                           is_graph_output, is_ms_op, is_op, last_dim, perm_of, producer_of, rank_of,
                                           shape_of, slice_bounds)
from onnxfuse.rewrites.facts.shape_values import move_shape_reads

#: Element types its kernels take.
DTYPES = (FP16, FP32) + BF16


def _rotation(node):
    """(cos, sin, interleaved, rotary_dim or 0) of an ONNX RotaryEmbedding without position ids."""
    return (node.inputs[1], node.inputs[2], int_attr(node, "interleaved", 0), int_attr(node, "rotary_embedding_dim", 0))


def _merged_rotated_heads(graph, tensor, heads: int, size: int):
    """(the RotaryEmbedding, x) when ``tensor`` is ``Reshape(Transpose(RotaryEmbedding(heads of x),
    perm=[0, 2, 1, 3]), [0, 0, H·D])``: a rotation of [B, H, S, D] heads merged back to [B, S, H·D], as
    contrib-attention writes MultiHeadAttention's query from given heads where contrib-rotary-embedding
    kept the 4-D form (a partial rotation: Phi-3 with ``partial_rotary_factor`` < 1); else None. The op's
    query is that value: x's heads rotated, in x's layout."""
    merge = producer_of(tensor)
    if not is_op(merge, "Reshape") or len(merge.inputs) != 2:
        return None
    target = constant_value(graph, merge.inputs[1])
    if target is None or [int(v) for v in np.asarray(target).reshape(-1)] != [0, 0, heads * size]:
        return None
    move = producer_of(merge.inputs[0])
    if not is_op(move, "Transpose") or perm_of(move) != [0, 2, 1, 3]:
        return None
    rotary = producer_of(move.inputs[0])
    if not is_op(rotary, "RotaryEmbedding") or rotary.domain not in ("", "ai.onnx") or len(rotary.inputs) != 3:
        return None
    source = heads_source(graph, rotary.inputs[0], heads, size)
    return None if source is None else (rotary, source)


def _sliced_parts(graph, parts, sizes):
    """qkv when ``parts`` are three Slices of one qkv [B, S, Σ sizes] along its last axis at the offsets
    of ``sizes`` (Phi-3's fused qkv_proj, cut by the export), each covering its part exactly; else None."""
    slices = [producer_of(p) for p in parts]
    if not all(is_op(n, "Slice") for n in slices) or len({id(n.inputs[0]) for n in slices}) != 1:
        return None
    qkv = slices[0].inputs[0]
    shape = shape_of(graph, qkv)
    if shape is None or len(shape) != 3 or shape[2] != sum(sizes):
        return None
    offset = 0
    for node, size in zip(slices, sizes):
        bounds = slice_bounds(graph, node)
        if bounds is None or len(bounds[0]) != 1:
            return None
        (start,), (end,), (axis,), (step,) = bounds
        if axis not in (2, -1) or step != 1 or start != offset or min(end, sum(sizes)) != offset + size:
            return None
        offset += size
    return qkv


def _packed_split(graph, parts, sizes):
    """qkv when ``parts`` are the three outputs, in order, of one Split of qkv [B, S, Σ sizes] along its
    last axis into ``sizes``, or three Slices cutting it so; else None."""
    split = producer_of(parts[0])
    if is_op(split, "Slice"):
        return _sliced_parts(graph, parts, sizes)
    if not is_op(split, "Split") or list(split.outputs) != list(parts):
        return None
    shape = shape_of(graph, split.inputs[0])
    if shape is None or len(shape) != 3 or int_attr(split, "axis", 0) not in (2, -1):
        return None
    given = split.attrs.get("split")
    if given is None and len(split.inputs) > 1 and not split.inputs[1].is_empty():
        given = constant_value(graph, split.inputs[1])
    if given is None or [int(v) for v in np.asarray(given).reshape(-1)] != list(sizes) or shape[2] != sum(sizes):
        return None
    return split.inputs[0]


def _projection_bias(graph, qkv, parts, width: int):
    """``(x, b)`` when ``qkv`` is ``Add(x, b)`` with b a constant of ``width`` values along the last axis only
    (x's last dimension ``width``, so the Add does not broadcast x) and ``qkv`` is read only by ``parts``
    (the Split or Slices cutting it) and by Shape nodes; else None. b as a (width,) array of qkv's type."""
    add = producer_of(qkv)
    if not is_op(add, "Add") or len(add.inputs) != 2 or is_graph_output(graph, qkv):
        return None
    if any(r not in parts and not is_op(r, "Shape") for r in consumers(qkv)):
        return None
    for x, b in (add.inputs, add.inputs[::-1]):
        value = constant_value(graph, b)
        rank = rank_of(graph, x)
        if (value is None or value.size != width or value.ndim == 0 or value.shape[-1] != width or rank is None
                or value.ndim > rank or dtype_of(graph, x) != dtype_of(graph, qkv) or last_dim(graph, x) != width):
            continue
        return x, value.reshape(width)
    return None


class ContribAttentionInputs(ContribRule):
    name = "contrib-attention-inputs"
    description = ("the Split, rotations, head transposes, cache Concats and repeated heads in front of a "
                   "KV-cache MultiHeadAttention → one AttentionInputs kernel (ai.onnxfuse)")
    targets = frozenset({"cuda"})  # an ai.onnxfuse op, like FusedElementwise: not for ONNX Runtime's CPU provider

    def match(self, graph):
        return [n for n in graph.nodes if is_ms_op(n, "MultiHeadAttention")]

    def analyze(self, graph, node):
        found = plain_mha_inputs(graph, node)
        if isinstance(found, Refuse):
            return found
        inputs, heads, size = found
        problem = dtype_problem(dtype_of(graph, node.outputs[0]), DTYPES, "attention output")
        if problem:
            return problem
        repeats = [repeated_heads(graph, t) for t in (inputs[1], inputs[2])]
        if (repeats[0] is None) != (repeats[1] is None) or (repeats[0] and repeats[0][1] != repeats[1][1]):
            return Refuse("key and value are not repeated alike")
        caches = [r[0] for r in repeats] if repeats[0] else [inputs[1], inputs[2]]
        n = repeats[0][1] if repeats[0] else 1
        kv_heads = heads // n
        if kv_heads * n != heads:
            return Refuse(f"a {n}-fold repeat does not divide {heads} heads")
        key = cache_append(graph, caches[0], kv_heads, size, rotated=True) or \
            cache_append(graph, caches[0], kv_heads, size, rotated=False)
        value = cache_append(graph, caches[1], kv_heads, size, rotated=False)
        if key is None or value is None:
            return Refuse(f"key or value is not Concat(past [B, {kv_heads}, P, {size}], the heads of a [B, S, "
                          f"{kv_heads * size}] projection) along the sequence axis")
        (past_k, k_source, k_rotary), (past_v, v_source, _) = key, value
        q_rotary = producer_of(inputs[0])
        merged = None if is_op(q_rotary, "RotaryEmbedding") else _merged_rotated_heads(graph, inputs[0], heads, size)
        if merged is not None:
            q_rotary = merged[0]
        if is_op(q_rotary, "RotaryEmbedding"):
            if k_rotary is None or q_rotary.domain not in ("", "ai.onnx") or len(q_rotary.inputs) != 3:
                return Refuse("q is rotated but k is not, or by a RotaryEmbedding with position ids")
            if _rotation(q_rotary) != _rotation(k_rotary) or int_attr(q_rotary, "num_heads", heads) != heads:
                return Refuse("q and k are rotated by different caches or attributes")
            q_source = merged[1] if merged is not None else q_rotary.inputs[0]
        elif k_rotary is not None:
            return Refuse("k is rotated but q is not")
        else:
            q_source = inputs[0]
        qkv = _packed_split(graph, [q_source, k_source, v_source], [heads * size, kv_heads * size, kv_heads * size])
        if qkv is None:
            return Refuse("q, k and v are not the three parts, in order, of one Split or three Slices of the packed "
                          "projection")
        rotary = None
        if k_rotary is not None:
            cos, sin, interleaved, dim = _rotation(k_rotary)
            dim = dim or size
            if dim % 2 or dim > size:
                return Refuse(f"rotary dimension {dim} of head size {size}")
            if any(dtype_of(graph, t) != dtype_of(graph, qkv) for t in (cos, sin, past_k, past_v)):
                return Refuse("the caches and the past are not the projection's element type")
            rotary = (cos, sin, interleaved, dim)
        elif any(dtype_of(graph, t) != dtype_of(graph, qkv) for t in (past_k, past_v)):
            return Refuse("the past is not the projection's element type")
        written = {id(t) for t in (caches[0], caches[1], inputs[1], inputs[2])}
        if computed_from([qkv, past_k, past_v, *(rotary[:2] if rotary else ())], written):
            return Refuse("the projection, the past or the caches are computed from what the op would write")
        parts = [producer_of(t) for t in (q_source, k_source, v_source)]
        bias = _projection_bias(graph, qkv, parts, (heads + 2 * kv_heads) * size)
        return dict(qkv=qkv, past=(past_k, past_v), caches=caches, heads_in=(inputs[1], inputs[2]), n=n,
                    heads=heads, kv_heads=kv_heads, size=size, rotary=rotary, bias=bias)

    def apply(self, graph, node, found):
        names = NameAllocator(graph)
        base = node.name or "attention_inputs"
        rotary = found["rotary"]
        old_query = node.inputs[0]
        query = gs.Variable(names(f"{base}/query"), dtype=old_query.dtype, shape=old_query.shape)
        outputs = [query, *found["caches"]]
        if found["n"] > 1:
            outputs += list(found["heads_in"])
        for tensor in outputs[1:]:  # the op writes them now: their Concat / Gather producers lose them
            producer = producer_of(tensor)
            producer.outputs[producer.outputs.index(tensor)] = gs.Variable(names(f"{tensor.name}/replaced"))
        qkv, bias = found["qkv"], found["bias"]
        if bias is not None:  # the op adds the projection's bias itself; the mask's Shape reads read x
            move_shape_reads(graph, qkv, bias[0])
            qkv = bias[0]
        inputs = [qkv, *found["past"]] + ([rotary[0], rotary[1]] if rotary else [])
        if bias is not None:
            inputs.append(new_constant(graph, f"{base}/qkv_bias", bias[1]))
        spec = spec_text(found["heads"], found["kv_heads"], found["size"], rotary[3] if rotary else 0,
                         rotary[2] if rotary else 0, bias=int(bias is not None))
        graph.nodes.append(gs.Node(OP_TYPE, names(f"{base}/{OP_TYPE}"), {"spec": spec}, inputs=inputs,
                                   outputs=outputs, domain=DOMAIN))
        move_shape_reads(graph, old_query, query)  # the mask's shape reads: the same shape
        node.inputs[0] = query
        return {"num_heads": found["heads"], "kv_num_heads": found["kv_heads"], "head_size": found["size"],
                "rotary_dim": rotary[3] if rotary else 0, "outputs": len(outputs), "bias": bias is not None}
