"""When fusing pays: the speed decisions of contrib-attention, each with the measurement behind it, in
one place (:func:`speed_policy`, :func:`raw_mask_pays`). Exactness is decided elsewhere (the mask and
heads steps); this module only says whether an exact fusion would make the model slower.

**When it pays** (:func:`slower_than_unfused`): every float16 attention fuses; in float32 the
sequence-first layout and key lengths known to be >= :data:`FP32_LONG_KEYS` are refused as
MultiHeadAttention or with an ``attention_bias``, each with the measurement that showed the fused model
slower; as the packed ``Attention`` with a raw mask (a keep mask, or none) both fuse: sequence-first
without the extra Transposes, long keys with a ``mask_index`` of ones
(:func:`~onnxfuse.rewrites.contrib.attention.bias.build_all_keys_mask`), which keeps ONNX Runtime off its
slow float32 memory-efficient kernel (ViT-B/16 fp32 1.56× / 1.15× and Whisper-base 1.05× / 1.05×
over this code without them at batch 1 / 16, docs/benchmarks.md 5.9). On by default since those measurements
(issue 15; docs/benchmarks.md).

What :func:`speed_policy` does not look at (every other attention fuses): float16 (always fuses), a
key length that is not a static size (dynamic L is never "long"), and the packed ``Attention`` with a
raw mask (a keep mask, or none): float32 sequence-first and long keys included, the latter with the
mask of ones it asks for (:attr:`Verdict.all_keys_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxfuse.rewrites.contrib.attention.heads import repeated_heads
from onnxfuse.rewrites.contrib.attention.layout import GIVEN, SEQ_FIRST, sequence_of
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import LOW_FLOATS, int_attr, is_op, producer_of

#: float32 key length from which ONNX Runtime's CUDA attention runs its float32 memory-efficient kernel
#: (its ``kMinSeqLenForMemoryEfficientAttentionFp32``); there that kernel was slower than the unfused GEMMs
#: it replaces (Whisper-base encoder, L = 1500, H200, 2026-11-23: 0.88× / 0.90× over the original at batch
#: 1 / 16 with the fusion, 1.02× / 1.05× without).
FP32_LONG_KEYS = 256


def long_keys(graph, key, layout) -> bool:
    """The key length is known to be >= :data:`FP32_LONG_KEYS`."""
    length = sequence_of(graph, key, layout)
    return isinstance(length, int) and length >= FP32_LONG_KEYS


def cache_key(graph, key) -> bool:
    """``key`` is a decoder's KV cache: ``Concat(past, new, axis=2)``, possibly with each head repeated
    for its query heads (repeat-heads-gather's ``Gather(present, [0]*n + …, axis=1)``)."""
    repeated = repeated_heads(graph, key)
    concat = producer_of(repeated[0] if repeated else key)
    return is_op(concat, "Concat") and len(concat.inputs) == 2 and int_attr(concat, "axis", 0) in (2, -2)


def slower_than_unfused(graph, dtype, layout, key, raw_mask: bool, cache_heads: bool = False) -> Refuse | None:
    """Why fusing this attention would make the model slower on the GPU (measured), or None.

    Float16 always fuses: every fp16 row gained (BERT-base 1.68-1.70×, ViT-B/16 1.40-1.65×, Whisper-base
    2.25× at batch 16, against 1.06-1.51× without). Float32 has no flash kernel; two cases measured
    slower than leaving the attention to ONNX Runtime's own GEMMs and Softmax are refused unless the
    packed ``Attention`` op with a raw mask (``raw_mask``: a keep mask, or none, which becomes a mask of
    ones) avoids what made them slow:

    * the sequence-first layout as MultiHeadAttention: the four Transposes into and out of [B, S, E] cost
      more than the fusion saves (ViT-B/16 fp32, H200: 0.99× with vs 1.13× without at batch 16, 1.32× vs
      1.39× at batch 1). Packed, the op reads the [B, S, E] tensor the projection's input was transposed
      from, and only its output is transposed back;
    * a key length known to be >= :data:`FP32_LONG_KEYS`, where ONNX Runtime picks its memory-efficient
      kernel unless the mask is raw.

    Given heads are refused in float32 only where the query is given too (rotated: Llama, Qwen2, Mistral,
    the exports that measurement was of). ``cache_heads``: the query was split from [B, S, E] and only
    key and value are given, because they are a KV cache (T5's and BART's cross-attention over the cached
    encoder keys and values, a graph input) or joined to one (``Concat(past, new)``, self-attention with
    past). Those fuse in float32 too: **not measured** on a GPU yet (issue 31 item 2 asked for them fused;
    the measurement above was of rotated, repeated heads at prefill), and the cross-attention's heads have
    no other layout the op could read without transposing the whole cache back.

    Rotated, given heads over a KV cache (:func:`cache_key`: a decoder with past) fuse in float32 too:
    the decoder rules after contrib-attention then make each layer one AttentionInputs kernel, decode
    steps DecodeAttention (reading the cache once, no repeated heads) and prefill this MultiHeadAttention
    over the grouped rows. The whole float32 Qwen2-0.5B-shaped decoder measured faster that way than
    with the attention left unfused in every cell (H100, docs/benchmarks.md 5.34): decode 1.26-2.72x
    (batch 1 and 8, 128-4096 cached tokens), prefill of 512 tokens 1.07-1.08x. The measurement that
    refused given heads above was of MultiHeadAttention alone over repeated heads, without those rules.
    """
    if dtype != np.float32 or raw_mask:
        return None
    if layout == GIVEN and not cache_heads and not cache_key(graph, key):
        return Refuse("float32 attention over given (rotated or repeated) heads is left unfused: MultiHeadAttention "
                      "with [B, H, L, D] key and value measured 0.82-1.04x the decomposed graph in float32 "
                      "(benchmarks/gqa_attention.py, H100), 1.4-2.7x in float16: a float16 export (model.half()) fuses it")
    if layout == SEQ_FIRST:
        return Refuse("float32 sequence-first attention is left unfused unless its q, k, v are packed projections "
                      "with no mask or a keep mask: the Transposes into [B, S, E] and back cost more than the fusion "
                      "saves (measured: ViT-B/16 fp32); fp16 (--precision fp16) fuses it")
    if long_keys(graph, key, layout):
        return Refuse(f"float32 attention over {sequence_of(graph, key, layout)} keys is left unfused unless its q, k, v are "
                      f"packed projections with no mask or a keep mask: ONNX Runtime's fp32 memory-efficient kernel "
                      f"is slower than its unfused GEMMs from {FP32_LONG_KEYS} keys on (measured: Whisper-base, "
                      f"L=1500); fp16 (--precision fp16) fuses it")
    return None


def raw_mask_pays(dtype, packed: bool) -> bool:
    """Whether a keep mask goes to packed ``Attention`` as a raw ``mask_index`` for speed alone (where the
    bias would be exact too): in float32, measured faster (one BERT-base layer, H100: 0.069 against
    0.076 ms at batch 1); not in float16, where the raw mask was slower (0.096 against 0.079 ms at batch
    16) than an ``attention_bias``, which reaches the memory-efficient kernel
    (:mod:`~onnxfuse.rewrites.contrib.attention.keep_masks`)."""
    return packed and dtype == np.dtype(np.float32)


def keep_bias_pays(dtype, zero_empty_rows: bool, over_cache: bool = False) -> bool:
    """Whether a keep mask that must zero its empty rows (the NaN guard after an sdpa export's -inf mask)
    goes to the op as an ``attention_bias`` ``Where(keep, 0, fill)`` (:func:`keep_bias_fill`) rather than
    a raw mask.

    Float16, always:
    in float16 the raw mask takes ONNX Runtime's unfused kernel, measured slower than the bias's
    memory-efficient one (0.096 against 0.079 ms, one BERT-base layer at batch 16, H100; BERT-base under
    ``--precision fp16``, whose islands took the raw mask, ran 1.523 ms against 0.949 ms for the float16
    export's optimized model, H200, docs/benchmarks.md 5.20). Exact there: a masked score plus -65504
    weighs exp(-65504 + s - max) = 0 in the kernel's float32 softmax, as exp(-inf) does in the graph,
    wherever a row keeps a key; a row that keeps none is zeroed after the op by the row factor, as the
    guard zeroes it (:func:`~onnxfuse.rewrites.contrib.attention.plan.plan_attention`). Bfloat16 is taken as
    float16 is (not timed on its own: its raw mask takes the same unfused kernel path).

    Float32, where the keys are a KV cache (``over_cache``, :func:`cache_key`): the decoder rules after
    contrib-attention (AttentionInputs, DecodeAttention) take an additive bias and no raw mask, and the
    float32 decoder measured faster through them in every cell (docs/benchmarks.md 5.34). Elsewhere in
    float32 the raw mask stays (MultiHeadAttention's ``key_padding_mask``)."""
    return zero_empty_rows and (np.dtype(dtype) in LOW_FLOATS or over_cache)


def keep_bias_fill(dtype) -> float:
    """The masked keys' value in a keep bias: -65504 (float16's lowest) in float16; half float32's lowest
    in float32 and bfloat16 (which holds it as -2¹²⁷, finite), so that a score plus the fill never overflows to -inf (|score| < 1.7e38), a row that keeps
    no key stays finite (the row factor then zeroes it: 0 times a finite value), and a masked key still
    weighs exp(fill + s - max) = 0 beside any kept one."""
    return float(np.finfo(np.float16).min) if np.dtype(dtype) == np.float16 else float(np.finfo(np.float32).min) / 2


@dataclass(frozen=True)
class Verdict:
    """Fuse; ``all_keys_mask``: packed float32 self-attention over long keys, given a raw ``mask_index``
    of ones (:func:`~onnxfuse.rewrites.contrib.attention.bias.build_all_keys_mask`), which keeps ONNX
    Runtime off its float32 memory-efficient kernel."""

    all_keys_mask: bool = False


def speed_policy(graph, *, dtype, layout, key, packed: bool, key_mask: bool, masked: bool,
                 cache_heads: bool = False) -> Verdict | Refuse:
    """Whether this attention, once proved exact, fuses: a ``Refuse`` with the measured reason it would
    be slower (:func:`slower_than_unfused`), or a :class:`Verdict`. ``layout``: how the op reads ``key``;
    ``packed``: q, k, v go into ``Attention``; ``key_mask``: the mask is a raw keep mask; ``masked``:
    there are mask steps; ``cache_heads``: only key and value are given heads (a KV cache,
    :func:`slower_than_unfused`). The packed op with a raw mask (a keep mask, or none) avoids both slow cases."""
    raw_mask = packed and (key_mask or not masked)
    slower = slower_than_unfused(graph, dtype, layout, key, raw_mask, cache_heads)
    if slower:
        return slower
    return Verdict(all_keys_mask=raw_mask and not key_mask and dtype == np.dtype(np.float32)
                   and long_keys(graph, key, layout))
