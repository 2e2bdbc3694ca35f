"""contrib-kv-cache-attention (opt-in): a KV-cache decoder's attention, MultiHeadAttention over
``Concat(past, new)`` keys and values, → one GroupQueryAttention that appends to the cache itself.

Why
---
contrib-attention fuses a Llama/Qwen2-family decoder's attention core into MultiHeadAttention but leaves
the cache around it: per layer, for each of k and v, ``Reshape`` [B, S, H_kv·D] → [B, S, H_kv, D],
``Transpose(0, 2, 1, 3)``, ``Concat(past, ·, axis=2)`` (the ``present`` output) and, for grouped queries,
``Gather`` repeating each key/value head n = H / H_kv times: 8 nodes beside the attention, 192 on a
24-layer decoder, where a decode step is launch-bound (docs/benchmarks.md 5.17: 21 nodes per layer
against onnxruntime-genai's 12). ONNX Runtime's ``GroupQueryAttention`` takes k and v as [B, S, H_kv·D],
the past cache as [B, H_kv, P, D], writes the present cache itself and reads each key/value head for its
n query heads without repeating it.

What (exact)
------------
``GroupQueryAttention(q, k_rot, v, past_k, past_v, seqlens_k, total_sequence_length,
attention_bias=M)`` with ``causal = 0``, ``num_heads = H``, ``kv_num_heads = H_kv`` and the
MultiHeadAttention's ``scale``:

* ``total_sequence_length`` = T = P + S, read as the attention bias's last dimension (MultiHeadAttention's
  contract: [B or 1, H or 1, S, T]), so every layer shares one computation; ``seqlens_k`` = T − 1 for every
  batch entry. The op then takes all P past positions of every entry and appends the S new ones after
  them: ``present = Concat(past, new, axis=2)`` exactly, as the graph computed it, whatever the padding;
* the mask is the graph's own additive bias M (padding and causality as the export computed them), and
  ``causal = 0`` adds nothing to it, so each row's softmax is the original's;
* a rotated key ``RotaryEmbedding(Transpose(Reshape(k)))`` becomes ``RotaryEmbedding(k, num_heads = H_kv)``
  on the [B, S, H_kv·D] source: the same rotation of each (b, s, head) with the same caches (ONNX's
  RotaryEmbedding takes both layouts); the op's own rotary (``do_rotary``) is not used: it needs a cache
  table indexed by position, whose length the graph does not bound.

Pure data movement around the same per-row arithmetic (the kernel may order its sums differently:
rounding).

Refused
-------
* no additive ``attention_bias`` (seqlens_k would have to come from somewhere else), a ``bias`` or
  ``key_padding_mask`` input, or past inputs of its own;
* keys and values that are not ``Concat(past [B, H_kv, P, D], Transpose(0, 2, 1, 3)(Reshape(x [B, S,
  H_kv·D])))`` along the sequence axis (the key possibly rotated), repeated n times or not at all;
* float32: GroupQueryAttention's CUDA kernels are float16/bfloat16 (a float32 one ran off them,
  0.5–8 ms per op against 0.07 ms, benchmarks/gqa_kv_cache.py, docs/benchmarks.md 5.17).

**Opt-in**, and why: onnxruntime-gpu 1.31 refuses a batch above 1 with several new tokens over a
non-empty cache ("batch_size must be 1 when sequence_length > 1 and past context is given"): prefill
(empty cache) and one token at a time (any batch) run, as in onnxruntime-genai's models, which have the
same limit; batched chunked prefill does not. ``--only +contrib-kv-cache-attention`` opts in.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from onnxfuse.rewrites.contrib.attention.heads import cache_append, plain_mha_inputs, repeated_heads
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import BF16, FP16, computed_from, dtype_of, is_ms_op, is_op, producer_of, shape_of

#: Element types GroupQueryAttention's CUDA kernels take.
GQA_DTYPES = (FP16,) + BF16


class ContribKvCacheAttention(ContribRule):
    name = "contrib-kv-cache-attention"
    description = ("MultiHeadAttention over Concat(past, new) K/V → GroupQueryAttention writing the cache "
                   "(opt-in: prefill or one token at a time)")
    opt_in = True

    def match(self, graph):
        return [n for n in graph.nodes if is_ms_op(n, "MultiHeadAttention")]

    def analyze(self, graph, node):
        found = plain_mha_inputs(graph, node)
        if isinstance(found, Refuse):
            return found
        inputs, heads, size = found
        bias = inputs[5]
        if bias.is_empty():
            return Refuse("no attention_bias to read the total sequence length from")
        problem = dtype_problem(dtype_of(graph, node.outputs[0]), GQA_DTYPES, "attention output")
        if problem:
            return problem
        kv = []
        for which, tensor in (("key", inputs[1]), ("value", inputs[2])):
            repeat = repeated_heads(graph, tensor)
            cache, n = repeat if repeat else (tensor, 1)
            kv_heads = heads // n
            if kv_heads * n != heads:
                return Refuse(f"the {which}'s {n}-fold repeat does not divide {heads} heads")
            found = cache_append(graph, cache, kv_heads, size, rotated=which == "key")
            if found is None and which == "key":
                found = cache_append(graph, cache, kv_heads, size, rotated=False)
            if found is None:
                return Refuse(f"the {which} is not Concat(past [B, {kv_heads}, P, {size}], heads of [B, S, "
                              f"{kv_heads * size}]) along the sequence axis")
            kv.append((cache, kv_heads, *found))
        if kv[0][1] != kv[1][1]:
            return Refuse("key and value have different head counts")
        caches = {id(t) for t in (kv[0][0], kv[1][0], inputs[1], inputs[2])}
        if computed_from([inputs[0], bias, kv[0][2], kv[0][3], kv[1][2], kv[1][3]], caches, except_shape_reads=True):
            return Refuse("the query or mask reads the cache's values (only its shape can be re-derived)")
        return kv, heads, size, bias

    def apply(self, graph, node, found):
        kv, heads, size, bias = found
        (k_cache, kv_heads, past_k, k_source, rotary), (v_cache, _, past_v, v_source, _) = kv
        names = NameAllocator(graph)
        base = node.name or "kv_cache_attention"
        if rotary is not None:  # the same rotation on the [B, S, H_kv·D] source
            rotated = gs.Variable(names(f"{base}/key_rotated"), dtype=rotary.outputs[0].dtype)
            attrs = dict(rotary.attrs)
            attrs["num_heads"] = kv_heads
            graph.nodes.append(gs.Node("RotaryEmbedding", names(f"{base}/key_rotary"), attrs,
                                       inputs=[k_source, *rotary.inputs[1:]], outputs=[rotated]))
            k_source = rotated
        query = node.inputs[0]
        for tensor, tensor_heads in ((k_cache, kv_heads), (v_cache, kv_heads), (node.inputs[1], heads),
                                     (node.inputs[2], heads)):  # the mask's shape reads, made before the op
            _shape_from_parts(graph, names, tensor, tensor_heads, size, past_k, k_source)
        seqlens, total = _sequence_lengths(graph, bias, query)
        for cache in (k_cache, v_cache):  # the op writes the presents: their Concats lose their outputs
            producer_of(cache).outputs.clear()
        out = node.outputs[0]
        attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "causal": 0,
                 "scale": float(node.attrs.get("scale", 1.0 / np.sqrt(size)))}  # MultiHeadAttention's default
        inputs = [query, k_source, v_source, past_k, past_v, seqlens, total,
                  gs.Variable.empty(), gs.Variable.empty(), gs.Variable.empty(), bias]
        node.inputs.clear()
        node.outputs.clear()
        graph.nodes.append(gs.Node("GroupQueryAttention", names(f"{base}/GroupQueryAttention"), attrs,
                                   inputs=inputs, outputs=[out, k_cache, v_cache], domain="com.microsoft"))
        return {"num_heads": heads, "kv_num_heads": kv_heads, "rotary": rotary is not None}


def _appended(graph, names, base: str, op: str, inputs, dtype, tag: str, **attrs):
    """The output of a new ``op`` node on ``inputs``, named ``{base}/{tag}`` (the exact name when free)."""
    out = gs.Variable(names(f"{base}/{tag}"), dtype=dtype)
    graph.nodes.append(gs.Node(op, names(f"{base}/{tag}_{op}"), attrs, inputs=inputs, outputs=[out]))
    return out


def _dim(graph, names, base: str, tensor, axis: int, tag: str):
    """``Shape(tensor)[axis]`` as an int64 [1] tensor."""
    shape = _appended(graph, names, base, "Shape", [tensor], np.int64, f"{tag}_shape")
    return _appended(graph, names, base, "Gather", [shape, new_constant(graph, f"{base}/{tag}_axis",
                                                                        np.array([axis], np.int64))],
                     np.int64, tag, axis=0)


def _shape_from_parts(graph, names, tensor, heads: int, size: int, past, source) -> None:
    """Every ``Shape(tensor)``, ``tensor`` a cache [B, H_kv, P + S, D] or its repeat [B, H, P + S, D],
    reads the same vector made from the past [B, H_kv, P, D] and the new keys [B, S, E] instead: the op
    that now writes the cache reads the mask, which may have been cut to the key length so."""
    readers = [n for n in list(tensor.outputs) if is_op(n, "Shape")]
    if not readers:
        return
    base = f"{tensor.name}/shape_from_parts"
    length = _appended(graph, names, base, "Add", [_dim(graph, names, base, past, 2, "past_length"),
                                                   _dim(graph, names, base, source, 1, "new_length")],
                       np.int64, "length")
    full = _appended(graph, names, base, "Concat", [
        _dim(graph, names, base, past, 0, "batch"), new_constant(graph, f"{base}/heads", np.array([heads], np.int64)),
        length, new_constant(graph, f"{base}/size", np.array([size], np.int64))], np.int64, "shape", axis=0)
    for reader in readers:
        start, end = reader.attrs.get("start"), reader.attrs.get("end")
        if start is None and end is None:
            out = full
        else:
            out = _appended(graph, names, base, "Slice", [
                full, new_constant(graph, f"{base}/start", np.array([start or 0], np.int64)),
                new_constant(graph, f"{base}/end", np.array([4 if end is None else end], np.int64))],
                np.int64, "shape_part")
        reader.op, reader.attrs = "Identity", {}
        reader.inputs[0] = out


def _sequence_lengths(graph, bias, query):
    """(seqlens_k int32 [B], total_sequence_length int32 scalar): T = P + S read from ``bias`` [B or 1, ·,
    S, T], every entry's last valid position T − 1, B read from ``query`` [B, S, E]. Made once for every
    layer reading the same mask with a batch of the same name (a named dimension is one value, as
    :func:`~onnxfuse.rewrites.facts.graph.dims_equal` holds), found again by name: per layer, a Shape →
    Gather → Expand on the CPU and a copy of seqlens_k to the device would add four steps to each layer
    of a launch-bound decode step."""
    query_shape = shape_of(graph, query)
    batch = query_shape[0] if query_shape else None
    key = f"{bias.name}/kv_cache/" + (f"batch_{batch}" if isinstance(batch, str) else query.name)
    known = graph.tensors()
    if f"{key}/seqlens_k" in known and f"{key}/total_sequence_length" in known:
        return known[f"{key}/seqlens_k"], known[f"{key}/total_sequence_length"]
    names = NameAllocator(graph)  # exact names where free: found again by the next layer
    total = _appended(graph, names, key, "Cast", [_dim(graph, names, key, bias, 3, "total_int64")], np.int32,
                      "total", to=int(TensorProto.INT32))
    last = _appended(graph, names, key, "Sub", [total, new_constant(graph, f"{key}/one", np.array([1], np.int32))],
                     np.int32, "last")
    seqlens = _appended(graph, names, key, "Expand", [last, _dim(graph, names, key, query, 0, "batch")], np.int32,
                        "seqlens_k")
    scalar = _appended(graph, names, key, "Reshape", [total, new_constant(graph, f"{key}/scalar", np.zeros(0, np.int64))],
                       np.int32, "total_sequence_length")
    return seqlens, scalar
