"""The checks every anchor's form shares once q, k and v are split and the mask steps peeled, and the
:class:`AttentionPlan` they make (built by keyword): which op, which mask form, what the rewrite removes.

**Which op** (measured, benchmarks/attention_ops.py, one BERT-base layer on an H200, 2026-11-23, ms:
decomposed / three MatMuls + MultiHeadAttention / packed ``Attention``: fp32 b1 0.110 / 0.091 / 0.050,
fp32 b16 0.147 / 0.143 / 0.120, fp16 b1 0.107 / 0.078 / 0.053, fp16 b16 0.117 / 0.086 / 0.086):

* ``Attention`` when q, k and v are constant-weight projections of one tensor x (self-attention:
  BERT, RoBERTa, DistilBERT, Whisper; GPT-2's one Gemm cut by a Split; torch.nn.MultiheadAttention's
  in_proj cut by its unflatten): the three MatMuls and bias Adds go into the op, whose weight is
  ``[W_q | W_k | W_v]`` and bias ``[b_q | b_k | b_v]``
  (:func:`~onnxfuse.rewrites.contrib.attention.projections.packed_projections`), one GEMM instead of three;
  the additive mask is its ``attention_bias`` (input 5), built as for MultiHeadAttention, with S = L =
  x's sequence dimension. Sequence-first (x [S, B, E_in]), the op reads ``Transpose(1, 0, 2)(x)``, or
  the [B, S, E_in] tensor x was transposed from (torch's ``batch_first=True``), and its output is
  transposed back for the merge Reshape; ``cancel-row-transposes`` then removes that Transpose and the
  one after the output projection (docs/benchmarks.md 5.9);
* ``MultiHeadAttention`` otherwise: it takes the projections as they are, whatever the exporter did
  with them (cross-attention, a projection also read elsewhere, weights that are not constants).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.facts import strip_scale
from onnxfuse.rewrites.contrib.attention.heads import shared_splits
from onnxfuse.rewrites.contrib.attention.keep_masks import KeepMask, keep_mask, one_minus_mask
from onnxfuse.rewrites.contrib.attention.layout import AXES, BATCH_FIRST, GIVEN, SEQ_FIRST, batch_of, sequence_of
from onnxfuse.rewrites.contrib.attention.masks import FP16_MIN
from onnxfuse.rewrites.contrib.attention.policy import cache_key, keep_bias_pays, raw_mask_pays, speed_policy
from onnxfuse.rewrites.contrib.attention.projections import PackedProjections, fold_biases, packed_projections
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import dims_equal, dtype_of, internal_problem, rank_of, shape_of

@dataclass(kw_only=True)
class AttentionPlan:
    anchor: gs.Node  # the Softmax, or ONNX's own Attention
    nodes: list  # every node the MultiHeadAttention replaces
    q: gs.Tensor
    k: gs.Tensor
    v: gs.Tensor
    heads: int
    scale: float
    terms: list  # MaskTerm, outermost (next to the Softmax) first
    mask_rank: int  # rank of the one additive mask when it is the only term
    mask_tail_known: bool  # that mask's last two dims are provably S and L
    biases: tuple | None  # (q, k, v MatMul outputs, [3E] bias values, the Adds) when the biases fold in
    merge: gs.Node  # the Reshape that merged the heads: it now reads MultiHeadAttention's output
    layout: str  # how q is read: BATCH_FIRST, SEQ_FIRST or GIVEN
    dtype: np.dtype
    head_size: int
    shape_reads: list  # (Shape node outside the pattern, the dims it reads, e.g. "BHSL")
    packed: PackedProjections | None  # q, k, v projections of one tensor: emit Attention, not MHA
    key_mask: KeepMask | None = None  # packed only: the mask as Attention's raw mask_index
    island: bool = False  # a float16 attention whose scores, mask and Softmax are float32
    all_keys_mask: bool = False  # packed float32 over long keys: a raw mask of ones keeps the unfused kernel
    kv_heads: bool = False  # k and v are given [B, H, L, D] heads, the op's "past" layout (q: ``layout``)
    zero_empty_rows: bool = False  # the NaN guard after a -inf mask: rows with no key kept become 0
    keep_as_bias: bool = False  # zero_empty_rows, policy.keep_bias_pays: key_mask goes in as Where(keep, 0, fill) attention_bias
    float32_output: bool = False  # island whose P·V is float32 (V cast up): the op's float16 output is cast up

    @property
    def key_layout(self) -> str:
        """How the fused op reads k (and v): given [B, H, L, D] heads, or [B, L, E]."""
        return GIVEN if self.kv_heads else BATCH_FIRST


def plan_attention(graph, anchor, nodes, q, k, v, factors, terms, dtype, island, merge_r, shape_reads_of,
                   zero_empty_rows: bool = False, float32_output: bool = False, half_terms: bool = False,
                   zero_one_inputs: frozenset[str] = frozenset()):
    """The checks and the plan both forms share once q, k, v are split and the mask steps peeled:
    ``shape_reads_of`` finds the Shape readers the rewrite can recompute (None: none allowed).

    ``zero_empty_rows``: a NaN guard ``Where(IsNaN(p), 0, p)`` follows a Softmax whose mask may hold -inf
    (torch's legacy export of ``scaled_dot_product_attention``: transformers' default sdpa attention adds
    ``Where(keep, 0, -inf)``). Fused only when that mask is a keep mask the op takes raw: a row keeping
    at least one key gets exactly the original's weights with the fill finfo(float32).min in place of
    -inf (every masked weight exp(s + fill - max) is 0 in float32, as exp(-inf) is), and a row keeping
    none, NaN in the original and zeroed by the guard, is the fused op's output times
    ``max(keep over the keys)``: 0 there, 1 elsewhere (x·1 = x exactly; x·0 = 0 for finite x, and an
    infinite or NaN value of V gives NaN in both models). Refused otherwise, with the guard's reason.

    ``half_terms``: an island whose mask steps come before the upcast, added to the float16 scores
    (transformers' float16 T5 adds its position bias and mask in float16, then runs the Softmax in
    float32): the mask is float16 in the original too, so it goes to the op as a float16
    ``attention_bias`` like any float16 attention's, not as a raw mask; the op then differs from the graph
    only by not rounding the scores to float16 before the Softmax, as every float16 fusion does."""
    if not (q.heads == k.heads == v.heads and q.size == k.size == v.size):
        return Refuse(f"Q, K and V split into different heads ({q.heads}x{q.size}, {k.heads}x{k.size}, {v.heads}x{v.size})")
    given = k.layout == GIVEN  # heads.query_key_value: then v too; q given or batch-first
    if not given and not (q.layout == k.layout == v.layout):
        return Refuse("Q, K and V are split from different layouts (batch-first and sequence-first)")
    if given:  # MatMul broadcasts a batch of 1 against B; MultiHeadAttention wants B everywhere
        batches = [batch_of(graph, head.source, head.layout) for head in (q, k, v)]
        if not (dims_equal(batches[0], batches[1]) and dims_equal(batches[1], batches[2])):
            return Refuse(f"given Q, K and V heads not provably of one batch size ({batches}: MatMul broadcasts it)")
    nodes += q.nodes + k.nodes + v.nodes
    # a scalar factor on q or k before the split (q_proj(x)·c) scales the scores just the same
    q_source = strip_scale(graph, q.source, nodes, factors)
    k_source = strip_scale(graph, k.source, nodes, factors)
    v_source = v.source
    types = {dtype_of(graph, t) for t in (q_source, k_source, v_source)}
    if types != {dtype}:
        return Refuse("Q, K, V and the scores have different element types")
    shape_reads, kept = [], set()
    problem = internal_problem(graph, nodes + [merge_r], merge_r)
    if problem:
        shape_reads = shape_reads_of() if shape_reads_of is not None else None
        if shape_reads is None:
            kept = shared_splits(graph, (q, k, v), nodes, merge_r)
            nodes = [n for n in nodes if id(n) not in kept]
            if not kept or internal_problem(graph, nodes + [merge_r], merge_r):
                return problem
            shape_reads = []
    mask_rank, tail_known = 0, False
    if len(terms) == 1 and terms[0].kind == "add":
        m_shape = shape_of(graph, terms[0].mask)
        mask_rank = len(m_shape)
        tail = [1] * (2 - mask_rank) + list(m_shape[-2:]) if mask_rank < 2 else list(m_shape[-2:])
        tail_known = (q.layout in (BATCH_FIRST, GIVEN) and mask_rank >= 2
                      and dims_equal(tail[0], sequence_of(graph, q_source, q.layout))
                      and dims_equal(tail[1], sequence_of(graph, k_source, k.layout)))
    scale = float(np.prod(factors)) if factors else 1.0
    biases = None
    # splits kept for other readers read the projections: neither packed nor their biases folded
    packed = None if given or kept else packed_projections(graph, (q_source, k_source, v_source), q.heads * q.size,
                                                           dtype)
    if packed is None and q.layout == BATCH_FIRST and not given and not kept:
        biases = fold_biases(graph, (q_source, k_source, v_source), q.heads * q.size, dtype)
    key_mask = None
    fp16_fill = any(not t.absorbing for t in terms)  # a float16 masked_fill with finfo(float16).min
    # a raw 0/1 mask: packed Attention's mask_index (float32 too: measured faster there), or
    # MultiHeadAttention's key_padding_mask where a float16 bias would not be exact; both kernels add
    # mask_filter_value to float32 scores. Packed: B and S = L are x's; else q's B and S, k's L.
    if ((island and not half_terms) or fp16_fill or zero_empty_rows or raw_mask_pays(dtype, packed is not None)) and (
            packed is not None or q.layout != SEQ_FIRST):
        (qx, q_layout), (kx, k_layout) = ([(packed.x, q.layout)] * 2 if packed is not None
                                          else [(q_source, q.layout), (k_source, k.layout)])
        if rank_of(graph, qx) == AXES[q_layout][0] and rank_of(graph, kx) == AXES[k_layout][0]:
            key_mask = keep_mask(graph, terms, batch_of(graph, qx, q_layout), sequence_of(graph, qx, q_layout),
                                 sequence_of(graph, kx, k_layout), infinite_fill=zero_empty_rows,
                                 zero_one_inputs=zero_one_inputs,
                                 inverted=(island and not half_terms) or fp16_fill or zero_empty_rows,
                                 lengths=((qx, AXES[q_layout][1]), (qx, AXES[q_layout][2]), (kx, AXES[k_layout][2])))
    if zero_empty_rows:
        if key_mask is None or q.layout == SEQ_FIRST:
            return Refuse("the Softmax's NaN guard Where(IsNaN(p), 0, p) zeroes rows whose every score is -inf; the "
                          "mask here is not provably finite and not a keep mask of [B, 1, S or 1, L] the fused op "
                          "could take raw (then rows with no key kept are zeroed after it), so the fused op's rows "
                          "could differ")
        key_mask = replace(key_mask, fill=float(np.finfo(np.float32).min))
    if fp16_fill:
        if key_mask is None:
            return Refuse(f"Where-mask fill {FP16_MIN:g} (float16) is not absorbing (s + f != f for |s| >= 16): fused "
                          "only with the mask as a raw keep mask (Attention's mask_index, MultiHeadAttention's "
                          "key_padding_mask); the mask is not a keep mask of [B, 1, S or 1, L]")
        key_mask = replace(key_mask, fill=float(np.finfo(np.float32).min))
    keep_as_bias = key_mask is not None and not key_mask.zero_one and keep_bias_pays(dtype, zero_empty_rows, given and cache_key(graph, k_source))
    # k's layout is q's unless k is given (then packed is None: no all-keys mask either way)
    verdict = speed_policy(graph, dtype=dtype, layout=k.layout if given else q.layout, key=k_source,
                           packed=packed is not None, key_mask=key_mask is not None and not keep_as_bias,
                           masked=bool(terms), cache_heads=given and q.layout == BATCH_FIRST)
    if isinstance(verdict, Refuse):
        return verdict
    if island and terms and key_mask is None and not half_terms:
        one_minus = len(terms) == 1 and terms[0].kind == "add" and one_minus_mask(graph, terms[0].mask) is not None
        return Refuse(f"{np.dtype(dtype).name} attention with a float32 Softmax: fused only with the mask as a raw 0/1 mask "
                      "(Attention's mask_index, MultiHeadAttention's key_padding_mask: the kernel adds "
                      "mask_filter_value in float32, as the graph does); "
                      + ("the sequence-first layout takes no raw mask unless packed" if q.layout == SEQ_FIRST
                         and packed is None else "the mask is not a 0/fill keep mask of [B, 1, S or 1, L] (a "
                      f"{np.dtype(dtype).name} attention_bias would round the float32 mask)")
                      + ("; it is (1 - m)·c, a keep mask only where m holds 0 and 1: --right-padded NAME promises "
                         "that of input NAME (transformers 4's attention_mask)" if one_minus else ""))
    return AttentionPlan(anchor=anchor, nodes=nodes, q=q_source, k=k_source, v=v_source, heads=q.heads,
                         head_size=q.size, scale=scale, layout=q.layout, dtype=dtype, merge=merge_r, terms=terms,
                         mask_rank=mask_rank, mask_tail_known=tail_known, biases=biases, shape_reads=shape_reads,
                         packed=packed, key_mask=key_mask, island=island, all_keys_mask=verdict.all_keys_mask,
                         kv_heads=given, zero_empty_rows=zero_empty_rows, keep_as_bias=keep_as_bias,
                         float32_output=float32_output)
