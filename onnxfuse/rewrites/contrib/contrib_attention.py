"""contrib-attention: scaled dot-product attention as exporters write it → com.microsoft Attention or MultiHeadAttention.

Anchor: a ``Softmax`` over the last axis of a rank-4 tensor. The rule walks back and forward from it
and accepts exactly this dataflow (every intermediate read only inside it, except by ``Shape``: below)::

    q [B,S,E] ─ (×c) ─ heads ─ (×/÷ sq) ─┐
    k [B,L,E] ─ (×c) ─ Kᵀ ──── (×/÷ sk) ─ MatMul ─ (×/÷ s) ─ mask steps ─ Softmax ─ (Cast) ─┐
    v [B,L,E] ─ heads ──────────────────────────────────────────────────────────────── MatMul ─ merge ─ Reshape ─ out

and writes ``Reshape(MultiHeadAttention(q, k, v, bias, , attention_bias))`` with ``num_heads = H`` and
``scale`` the product of every scalar factor on the way (none gives 1). The maths is the same up to the
point where ONNX Runtime's kernel fuses it: ``softmax(scale·QKᵀ + M)·V`` per head; validation bounds
the rounding difference (a product of factors instead of one Mul/Div each, one additive bias instead of
two Adds) like any contrib rule.

**Heads** (:func:`~onnxfuse.rewrites.contrib.attention_pattern.split_heads`), two layouts, H and D read
from the Reshape targets (constants after fold-constants and constant-reshape-target), never a model
type, never a head count asked; E = H·D must be the source's static last dimension; q, k and v must
agree on H, D and layout:

* *batch-first* (BERT, RoBERTa, DistilBERT, GPT-2, Whisper): ``Transpose(0,2,1,3)(Reshape(x [B,S,E],
  [b, s, H, D]))``; Kᵀ by perm (0,2,3,1) or the heads Transpose then (0,1,3,2). Each of b, s is 0 or
  the static dimension it keeps; or one of them is -1 while the other keeps its dimension and H, D are
  given: the element count then forces -1 to be the dimension it replaces. H or D may be -1 instead
  (inferred from E). The output is merged by Transpose(0,2,1,3) into [B,S,H,D].
* *sequence-first* (``torch.nn.MultiheadAttention``, torchvision's ViT): ``Reshape(Transpose(1,0,2)(
  Reshape(x [S,B,E], [S, -1, D])), [-1, H, S, D])`` with S static: element (s, b, h·D+d) goes to
  (s, b·H+h, d), to (b·H+h, s, d), and row-major to (b, h, s, d), the heads of x. MultiHeadAttention
  gets ``Transpose(1,0,2)(x)`` = [B,S,E] for each of q, k, v (pure data movement), and its output is
  transposed back to [S,B,E] for the Reshape that read the Transpose(2,0,1,3) merge [S,B,H,D].
* *given* (Llama, Qwen2, Mistral: :func:`~onnxfuse.rewrites.contrib.attention_pattern.given_heads`): when a
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

**The merging Reshape stays**, now reading MultiHeadAttention's [B,S,E] (or its [S,B,E] transpose): row-
major, that holds the same elements in the same order as the [B,S,H,D] ([S,B,H,D]) it read, so its
result is unchanged whatever its target (a target computed from shapes included).

**Scale**: scalar constants (finite, non-zero), each a Mul or a Div, on the scores, on the heads of q and
k (torch's D^-1/4 on each: constants once fold-constants evaluated the Shape→Sqrt chain), or on q or k
before the split (Whisper's ``q_proj(x)·D^-1/2``): all multiply the same QKᵀ, so their product is the
scale. A scale applied after a mask step is refused (it would scale the mask too).

**Projection biases** (batch-first only): when q, k and v are each ``Add(MatMul(·), b)`` with ``b`` a
1-D constant of E values, or a bare MatMul output (its bias is then E zeros, and ``x + 0 == x``:
Whisper's bias-free ``k_proj``), with at least one real bias and each read only by the attention, the
[3E] concatenation becomes MultiHeadAttention's ``bias`` input and the kernel adds it. Otherwise q, k
and v are taken as they are (when the projections are not packed into ``Attention``: below).

**Mask steps** (:func:`~onnxfuse.rewrites.contrib.attention_pattern.mask_terms`), between the scaled
scores x and the Softmax, outermost first, become one ``attention_bias`` built innermost first:

* ``x + M``, M any tensor of the scores' element type, rank ≤ 4, not computed from a MatMul (that tells
  it from the scores), however it was built (``(1 - mask)·c``, a constant causal triangle, ...): M is
  added to the bias. One Add alone is M itself; a second Add reassociates ``(x + b) + M`` as
  ``x + (b + M)``, exact for 0 / finfo.min-valued masks and a rounding difference otherwise.
* ``Where(c, x, f)`` or ``Where(c, f, x)`` (``masked_fill``; GPT-2's ``Where(causal, x, finfo.min)``,
  DistilBERT's ``Where(mask == 0, finfo.min, x)``), c a bool tensor of known rank ≤ 4, f a scalar
  constant: around an earlier bias b it is ``x + Where(c, b, f)`` (b = 0 when none). Exact where c
  keeps x; where c picks f it needs ``x + f == f``, true in float32 for every |x| < ulp(f)/2 when f is
  finite and ≤ -1e30 (≥ 3.7e22 for f = -1e30, 1.01e31 for finfo.min; a larger score would leave the
  masked entry a few of f's ulps away from f, not f). Otherwise refused with the reason: a float16 fill (finfo.min is -65504, which a score
  of 16 already moves), a fill like -10000 or -inf (``x + -inf`` is NaN where x = +inf). Two fills that
  meet (f + f = -inf after a Where and an Add of finfo.min) are -inf in both models.
* element-type-preserving Casts (GPT-2 exports ``.to(dtype)`` as Cast to float) are identities: removed.

**The NaN guard** ``Where(IsNaN(p), 0, p)`` on the Softmax's weights (torch's dynamo exporter writes it
after every masked scaled_dot_product_attention) turns a row whose every score is -inf, NaN after the
Softmax, into zeros. When every mask step adds finite values (a Where's finite fill, a constant without
±inf, or ``Where(c, a, b)`` of finite scalars: :func:`~onnxfuse.rewrites.contrib.attention_pattern.
finite_masks`), finite scores give finite masked scores, a Softmax row is never NaN and the guard is the
identity: it goes with the pattern. NaN or infinite scores (an overflow upstream) would be zeroed by the
guard and stay NaN in the fused op: outside what validation's finite inputs can reach, and no real
attention's. A mask that may hold -inf is refused with the guard, with that reason.

MultiHeadAttention wants ``attention_bias`` ``[B or 1, H or 1, S, L]``: one Add's mask of lower rank is
unsqueezed to rank 4, and unless its last two dimensions are provably S and L, the bias is expanded with
``Expand(M, [1, 1, S, L])`` (S and L read from q and k at run time). Expand is exact: it copies values,
and M's last two dimensions can only be 1 or S and L (it broadcast against the scores).

**Shape reads** of a tensor the rewrite removes (GPT-2 and DistilBERT read ``Shape`` of the scores and of
the heads to build their masks; GPT-2 also transposes the key heads only to read a Shape) are replaced,
batch-first only, by the same dims named from the pattern ([B,H,S,L] for the scores, [B,H,S,D] for the
q heads, ...): B and S read from q's shape, L from k's, H, D, E constants; a Transpose read only by such
Shapes permutes the names.

**Not** ``unidirectional``: probed on ONNX Runtime 1.32 CPU, MultiHeadAttention's ``unidirectional=1``
equals the causal triangle when S = L but matched neither the top-left nor the bottom-right triangle
when S < L, and proving that GPT-2's ``Slice`` of its causal buffer (bounds computed from shapes) is the
triangle needs shape arithmetic the rule does not do; the Where form above is exact without it.

**Refused**, with the reason: a Softmax not on the last axis or of unknown rank; any piece of the
pattern missing or shaped otherwise (a Transpose with another perm, a Reshape target that is not
constant, not [·,·,H,D] or [S,-1,D] / [-1,H,S,D], changing the batch or sequence dimension, two -1
entries); q, k, v of different heads or layouts; an intermediate read outside the pattern (other than
the Shape reads above) or a graph output; element types other than float32/float16 or mixed; a mask
of another element type or rank unknown or above 4; a mask Add whose both operands come from a MatMul;
a Where that does not select between the scores and a scalar fill, with a condition not bool of known
rank ≤ 4, or with a fill that is not absorbing; a scale after a mask step or not a finite non-zero
scalar.

**Which op** (measured, benchmarks/attention_ops.py, one BERT-base layer on an H200, 2026-11-23, ms:
decomposed / three MatMuls + MultiHeadAttention / packed ``Attention``: fp32 b1 0.110 / 0.091 / 0.050,
fp32 b16 0.147 / 0.143 / 0.120, fp16 b1 0.107 / 0.078 / 0.053, fp16 b16 0.117 / 0.086 / 0.086):

* ``Attention`` when q, k and v are constant-weight projections of one tensor x (self-attention:
  BERT, RoBERTa, DistilBERT, Whisper; GPT-2's one Gemm cut by a Split; torch.nn.MultiheadAttention's
  in_proj cut by its unflatten): the three MatMuls and bias Adds go into the op, whose weight is
  ``[W_q | W_k | W_v]`` and bias ``[b_q | b_k | b_v]``
  (:func:`~onnxfuse.rewrites.contrib.attention_pattern.packed_projections`), one GEMM instead of three;
  the additive mask is its ``attention_bias`` (input 5), built as for MultiHeadAttention, with S = L =
  x's sequence dimension. Sequence-first (x [S, B, E_in]), the op reads ``Transpose(1, 0, 2)(x)``, or
  the [B, S, E_in] tensor x was transposed from (torch's ``batch_first=True``), and its output is
  transposed back for the merge Reshape; ``cancel-row-transposes`` then removes that Transpose and the
  one after the output projection (docs/benchmarks.md 5.9);
* ``MultiHeadAttention`` otherwise: it takes the projections as they are, whatever the exporter did
  with them (cross-attention, a projection also read elsewhere, weights that are not constants).

**Keep masks as a raw ``mask_index``** (packed ``Attention``; float32, or a float32 softmax island
below): when the mask is one ``Where`` of a bool condition that is a broadcast of a tensor ``keep``
provably ``[B|1, 1, 1, L]`` or ``[B|1, 1, S, L]`` (B, S = L x's;
:func:`~onnxfuse.rewrites.contrib.attention_pattern.keep_mask`: transformers 5's ``sdpa_mask``,
``Where(keep, 0, finfo.min)``, its GPT-2 form ``Where(Not(And(causal, padding)), finfo.min, zeros)``,
or a ``masked_fill``), the op gets ``mask_index`` = ``Cast(Flatten(keep), int32)`` ([B, L], a key padding
mask) or ``Cast(Squeeze(keep, [1]), int32)`` ([B, S, L], a mask per query: causal and padding), with a
batch of 1 spelled out by ``Expand`` first and ``Not`` first when the Where fills where the condition is
True, and ``mask_filter_value`` = the fill, instead of the expanded [B, 1, S, L] ``attention_bias``. ONNX
Runtime's kernels add ``mask_filter_value`` in float32 to a score whose mask entry is 0 (CUDA ``mask ==
0``, CPU ``mask > 0`` keeps: the same for 0/1) and nothing otherwise, which is what the graph computes
(``s + fill`` or ``s + 0``): exact for any finite fill, rows with every key masked included (uniform for
finfo.min, as in the graph). A raw mask takes ONNX Runtime's unfused CUDA path (flash, memory-efficient
and TensorRT kernels take no raw mask; ``attention.cc``). Measured (one BERT-base layer, H100): 0.069
against 0.076 ms at fp32 batch 1. Not in float16: there the raw mask was slower (0.096 against 0.079 ms
at batch 16) than ``attention_bias``, which reaches the memory-efficient kernel. A ``(1 - m)·c`` float
mask is not converted: it equals a keep/drop mask only for m in {0, 1}. MultiHeadAttention (q, k, v not
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

**Float16 masked_fill** (DistilBERT's float16 export, and ``--precision fp16`` of its float32 one):
``Where(keep, s, -65504)``, float16's finfo.min, which is not absorbing (s - 65504 != -65504 for |s| >= 16),
fuses only as a raw keep ``mask_index`` with ``mask_filter_value`` = finfo(float32).min, which the
kernel adds in float32: a masked score becomes finfo(float32).min, so a row with every key masked is
uniform as in the original (-65504 everywhere), and where a row keeps a key with a score above -65487
(any a float16 model gives short of overflow) each masked weight exp(-65504 - max) < 2^-25 rounds to 0
in the original's float16 output, as it is 0 in the kernel. Slower than an ``attention_bias`` (0.096
against 0.079 ms, one BERT-base layer at batch 16, H100, above) and below the decomposed layer (0.117
ms, H200, "Which op"; not measured side by side), but the bias is not exact here. Refused otherwise (not packed, not a keep mask), with that reason.

Both run on ONNX Runtime's CPU provider, so validation needs no GPU.

**When it pays** (:func:`_slower_than_unfused`): every float16 attention fuses; in float32 the
sequence-first layout and key lengths known to be >= :data:`FP32_LONG_KEYS` are refused as
MultiHeadAttention or with an ``attention_bias``, each with the measurement that showed the fused model
slower; as the packed ``Attention`` with a raw mask (a keep mask, or none) both fuse: sequence-first
without the extra Transposes, long keys with a ``mask_index`` of ones (:meth:`ContribAttention.
_all_keys_mask`), which keeps ONNX Runtime off its slow float32 memory-efficient kernel (ViT-B/16 fp32
1.56× / 1.15× and Whisper-base 1.05× / 1.05× over this code without them at batch 1 / 16, docs/
benchmarks.md 5.9). On by default since those measurements (issue 15; docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention_pattern import (
    BATCH_FIRST,
    DTYPES,
    FP16_MIN,
    GIVEN,
    HEADS,
    SEQ_FIRST,
    SEQ_FIRST_MERGE,
    Head,
    KeepMask,
    PackedProjections,
    as_given,
    given_heads,
    is_downcast,
    is_noop_cast,
    is_upcast,
    finite_masks,
    keep_mask,
    mask_terms,
    nan_guard,
    packed_projections,
    projection_bias,
    single_reader,
    split_heads,
    strip_scale,
)
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.facts import (
    is_graph_output,
    rank_of,
    constant_value,
    consumers,
    declared_shape,
    dims_equal,
    dtype_of,
    internal_problem,
    is_op,
    opset_of,
    perm_of,
    producer_of,
    shape_of,
)
from onnxfuse.rewrites.engine.rule import Refuse, Rule


@dataclass
class AttentionPlan:
    softmax: gs.Node
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
    layout: str  # BATCH_FIRST or SEQ_FIRST
    dtype: np.dtype
    head_size: int
    shape_reads: list  # (Shape node outside the pattern, the dims it reads, e.g. "BHSL")
    packed: PackedProjections | None  # q, k, v projections of one tensor: emit Attention, not MHA
    key_mask: KeepMask | None = None  # packed only: the mask as Attention's raw mask_index
    island: bool = False  # a float16 attention whose scores, mask and Softmax are float32
    all_keys_mask: bool = False  # packed float32 over long keys: a raw mask of ones keeps the unfused kernel
    kv_heads: bool = False  # k and v are given [B, H, L, D] heads, the op's "past" layout (q: ``layout``)

    @property
    def key_layout(self) -> str:
        """How the fused op reads k (and v): given [B, H, L, D] heads, or [B, L, E]."""
        return GIVEN if self.kv_heads else BATCH_FIRST


def _heads(graph, tensor, transposed: bool, which: str) -> Head | str:
    """``tensor``'s heads split from the tensor they were cut from, else as the graph has them
    (:func:`~onnxfuse.rewrites.contrib.attention_pattern.given_heads`); or why neither."""
    head = split_heads(graph, tensor, transposed)
    if isinstance(head, str):
        given = given_heads(graph, tensor, transposed, why=f"{which}: {head}")
        if isinstance(given, str):
            return f"{which}: {head}; as given heads: {given}"
        head = given
    return head


def _values_and_merge(graph, v_heads, out):
    """(V's heads, Transpose, Reshape): V split into heads (or given) and the attention output ``out``
    [B, H, S, D] merged back by a Transpose read only by a Reshape, in V's layout; or why not."""
    v = _heads(graph, v_heads, False, "V")
    if isinstance(v, str):
        return v
    merge_perm = SEQ_FIRST_MERGE if v.layout == SEQ_FIRST else HEADS
    after = consumers(out)
    if len(after) != 1 or perm_of(after[0]) != merge_perm:
        why = f"{v.why}; as given heads: " if v.layout == GIVEN else ""
        return f"{why}the attention output is not merged back by Transpose(perm={merge_perm})"
    merge_t = after[0]
    after = consumers(merge_t.outputs[0])
    if len(after) != 1 or not is_op(after[0], "Reshape") or after[0].inputs[0] is not merge_t.outputs[0]:
        return "the attention output is not merged back by a Reshape"
    return v, merge_t, after[0]


def _query_key_value(graph, query, key, key_transposed: bool, v, v_heads, nodes, factors):
    """(Q's, K's and V's heads): Q and K split (or given) from the attention's q and k inputs (Kᵀ when
    ``key_transposed``), the scalar factors on each peeled into ``factors`` and their nodes into ``nodes``,
    then read together with ``v`` (split from ``v_heads``) by :func:`_given_kv`; or why not."""
    q = _heads(graph, strip_scale(graph, query, nodes, factors), False, "Q")
    if isinstance(q, str):
        return q
    k_heads = strip_scale(graph, key, nodes, factors)
    k = _heads(graph, k_heads, key_transposed, "K")
    if isinstance(k, str):
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
        return f"{why}; taken as given heads, beside heads split from a sequence-first [S, B, E] tensor"
    k_given, v_given = as_given(k, k_heads), as_given(v, v_heads)
    if k_given is None:
        return f"{why}; taken as given heads, but Kᵀ is made in one step from [B, S, E] (no [B, H, L, D] key to read)"
    return q, k_given, v_given


def _output_shape(query, hidden: int):
    """The attention op's output shape, [B, S, H·D] with B and S the query's (``query``: x for ``Attention``,
    q for MultiHeadAttention, both [B, S, ·]), or None when the query's rank is not known to be 3. ONNX
    has no schema for contrib ops, so without it every shape after the op would be unknown (the merge
    Reshape then cannot be seen to be an identity, nor the residual Add's operands to be equal)."""
    shape = declared_shape(query)
    return None if shape is None or len(shape) != 3 else [shape[0], shape[1], hidden]


class ContribAttention(Rule):
    name = "contrib-attention"
    description = ("softmax(s·QKᵀ + mask)·V over Reshape/Transpose-split heads → com.microsoft "
                   "Attention (packed q/k/v projections) or MultiHeadAttention (heads read from the graph)")
    targets = frozenset({"contrib", "cuda"})

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "Softmax", "Attention")]

    def check(self, graph, anchor):
        found = self._analyze_onnx(graph, anchor) if is_op(anchor, "Attention") else self._analyze(graph, anchor)
        return Refuse(found) if isinstance(found, str) else found

    def _analyze(self, graph, softmax) -> AttentionPlan | str:
        if len(softmax.inputs) != 1:
            return "Softmax does not have one input"
        scores_shape = shape_of(graph, softmax.inputs[0])
        if scores_shape is None or len(scores_shape) != 4:
            return "Softmax input is not known to be rank 4 [batch, heads, query, key]"
        if int(softmax.attrs.get("axis", -1)) not in (-1, 3):
            return "Softmax is not over the last axis"
        score_dtype = dtype = dtype_of(graph, softmax.inputs[0])
        if dtype not in DTYPES:
            return f"element type {dtype} (MultiHeadAttention: float32, float16)"
        nodes = [softmax]
        # after: (no-op Cast, or the float32 → float16 Cast that ends an island) → MatMul(P, V_heads)
        # → Transpose → Reshape
        probs = softmax.outputs[0]
        readers = consumers(probs)
        island = False
        guard = None  # the dynamo exporter's Where(IsNaN(p), 0, p)
        while True:
            if guard is None and (guard := nan_guard(graph, probs)) is not None:
                nodes += guard
                probs = guard[1].outputs[0]
            elif len(readers) == 1 and (is_noop_cast(graph, readers[0])
                                        or (not island and is_downcast(graph, readers[0]))):
                island = island or is_downcast(graph, readers[0])
                nodes.append(readers[0])
                probs = readers[0].outputs[0]
            else:
                break
            readers = consumers(probs)
        if island:
            dtype = np.dtype(np.float16)
        if len(readers) != 1 or not is_op(readers[0], "MatMul") or readers[0].inputs[0] is not probs:
            return "Softmax output is not read by exactly one MatMul (× V)"
        pv = readers[0]
        nodes.append(pv)
        found = _values_and_merge(graph, pv.inputs[1], pv.outputs[0])
        if isinstance(found, str):
            return found
        v, merge_t, merge_r = found
        nodes.append(merge_t)
        # before: mask steps (+ M, Where(c, ·, f)) ← (×/÷ s) ← MatMul(Q_heads, Kᵀ)
        found = mask_terms(graph, softmax.inputs[0], nodes, score_dtype)
        if isinstance(found, str):
            return found
        terms, x = found
        if guard is not None and not finite_masks(graph, terms):
            return ("the Softmax's NaN guard Where(IsNaN(p), 0, p) zeroes rows whose every score is -inf; the "
                    "mask here is not provably finite, so the fused op's rows could differ")
        factors: list[float] = []
        x = strip_scale(graph, x, nodes, factors)
        if island:  # the float16 scores enter float32 here, before any mask step
            upcast = producer_of(x)
            if not is_upcast(graph, upcast):
                return "a float32 Softmax read as float16 whose scores are not float16 cast up to float32"
            nodes.append(upcast)
            x = strip_scale(graph, upcast.inputs[0], nodes, factors)
        qk = producer_of(x)
        if qk is None or not is_op(qk, "MatMul") or len(qk.inputs) != 2:
            return "no Q·Kᵀ MatMul before the Softmax (or a scale applied after the mask)"
        nodes.append(qk)
        found = _query_key_value(graph, qk.inputs[0], qk.inputs[1], True, v, pv.inputs[1], nodes, factors)
        if isinstance(found, str):
            return found
        q, k, v = found
        return self._plan(graph, softmax, nodes, q, k, v, factors, terms, dtype, island, merge_r,
                          lambda: _shape_reads(graph, nodes, merge_r, q, k, v, qk, pv, merge_t))

    def _analyze_onnx(self, graph, op) -> AttentionPlan | str:
        """ONNX's own ``Attention`` (opset 23, which torch's dynamo exporter writes for scaled_dot_product_
        attention from ``opset_version=23`` on) over [B, H, S, D] heads: ``softmax(scale·Q·Kᵀ + mask)·V``
        with ``scale`` the attribute or 1/√D, K given untransposed: the same plan as the decomposed form
        without a mask step (ViT). Refused: a mask (ONNX Runtime 1.32's CPU kernel returns 0 for a row whose
        every key carries finfo.min, where the spec's arithmetic and com.microsoft Attention average the row:
        checked on a one-layer model), the causal flag, a softcap, past keys and values or sequence lengths,
        an output other than Y read, 3-D inputs."""
        inputs = list(op.inputs)
        if len(inputs) < 3 or any(t.name for t in inputs[4:]):
            return "ONNX Attention with past keys/values or sequence lengths (a KV cache)"
        if len(inputs) > 3 and inputs[3].name:
            return ("ONNX Attention with a mask: ONNX Runtime's CPU kernel gives 0 for a row whose every key is "
                    "masked (finfo.min), where com.microsoft Attention and the spec's arithmetic average the row")
        if any(o.name and consumers(o) for o in op.outputs[1:]) or any(is_graph_output(graph, o) for o in op.outputs[1:]):
            return "ONNX Attention's present keys/values or QK output are read"
        if int(op.attrs.get("is_causal", 0)) or float(op.attrs.get("softcap", 0.0)) != 0.0:
            return "ONNX Attention with is_causal or softcap"
        dtype = dtype_of(graph, op.outputs[0])
        if dtype not in DTYPES:
            return f"element type {dtype} (Attention: float32, float16)"
        if any(rank_of(graph, t) != 4 for t in inputs[:3]):
            return "ONNX Attention on 3-D (packed heads) inputs"
        nodes = [op]
        found = _values_and_merge(graph, inputs[2], op.outputs[0])
        if isinstance(found, str):
            return found
        v, merge_t, merge_r = found
        nodes.append(merge_t)
        factors: list[float] = []
        found = _query_key_value(graph, inputs[0], inputs[1], False, v, inputs[2], nodes, factors)
        if isinstance(found, str):
            return found
        q, k, v = found
        scale = op.attrs.get("scale")
        factors.append(float(scale) if scale is not None else float(q.size) ** -0.5)
        return self._plan(graph, op, nodes, q, k, v, factors, [], dtype, False, merge_r, None)

    def _plan(self, graph, anchor, nodes, q, k, v, factors, terms, dtype, island, merge_r, shape_reads_of):
        """The checks and the plan both forms share once q, k, v are split and the mask steps peeled:
        ``shape_reads_of`` finds the Shape readers the rewrite can recompute (None: none allowed)."""
        if not (q.heads == k.heads == v.heads and q.size == k.size == v.size):
            return f"Q, K and V split into different heads ({q.heads}x{q.size}, {k.heads}x{k.size}, {v.heads}x{v.size})"
        given = k.layout == GIVEN  # _given_kv: then v too; q given or batch-first
        if not given and not (q.layout == k.layout == v.layout):
            return "Q, K and V are split from different layouts (batch-first and sequence-first)"
        if given:  # MatMul broadcasts a batch of 1 against B; MultiHeadAttention wants B everywhere
            batches = [_batch_of(graph, head.source, head.layout) for head in (q, k, v)]
            if not (dims_equal(batches[0], batches[1]) and dims_equal(batches[1], batches[2])):
                return f"given Q, K and V heads not provably of one batch size ({batches}: MatMul broadcasts it)"
        nodes += q.nodes + k.nodes + v.nodes
        # a scalar factor on q or k before the split (q_proj(x)·c) scales the scores just the same
        q_source = strip_scale(graph, q.source, nodes, factors)
        k_source = strip_scale(graph, k.source, nodes, factors)
        v_source = v.source
        types = {dtype_of(graph, t) for t in (q_source, k_source, v_source)}
        if types != {dtype}:
            return "Q, K, V and the scores have different element types"
        shape_reads = []
        problem = internal_problem(graph, nodes + [merge_r], merge_r)
        if problem:
            if shape_reads_of is None:
                return problem
            shape_reads = shape_reads_of()
            if isinstance(shape_reads, str):
                return problem if shape_reads == "" else shape_reads
        mask_rank, tail_known = 0, False
        if len(terms) == 1 and terms[0].kind == "add":
            m_shape = shape_of(graph, terms[0].mask)
            mask_rank = len(m_shape)
            tail = [1] * (2 - mask_rank) + list(m_shape[-2:]) if mask_rank < 2 else list(m_shape[-2:])
            tail_known = (q.layout in (BATCH_FIRST, GIVEN) and mask_rank >= 2
                          and dims_equal(tail[0], _sequence_of(graph, q_source, q.layout))
                          and dims_equal(tail[1], _sequence_of(graph, k_source, k.layout)))
        scale = float(np.prod(factors)) if factors else 1.0
        biases = None
        packed = None if given else packed_projections(graph, (q_source, k_source, v_source), q.heads * q.size,
                                                       dtype)
        if packed is None and q.layout == BATCH_FIRST and not given:
            biases = _fold_biases(graph, (q_source, k_source, v_source), q.heads * q.size, dtype)
        key_mask = None
        fp16_fill = any(not t.absorbing for t in terms)  # a float16 masked_fill with finfo(float16).min
        # a raw 0/1 mask: packed Attention's mask_index (float32 too: measured faster there), or
        # MultiHeadAttention's key_padding_mask where a float16 bias would not be exact; both kernels add
        # mask_filter_value to float32 scores. Packed: B and S = L are x's; else q's B and S, k's L.
        if (island or fp16_fill or (packed is not None and dtype == np.dtype(np.float32))) and (
                packed is not None or q.layout != SEQ_FIRST):
            (qx, q_layout), (kx, k_layout) = ([(packed.x, q.layout)] * 2 if packed is not None
                                              else [(q_source, q.layout), (k_source, k.layout)])
            if rank_of(graph, qx) == _AXES[q_layout][0] and rank_of(graph, kx) == _AXES[k_layout][0]:
                key_mask = keep_mask(graph, terms, _batch_of(graph, qx, q_layout), _sequence_of(graph, qx, q_layout),
                                     _sequence_of(graph, kx, k_layout))
        if fp16_fill:
            if key_mask is None:
                return (f"Where-mask fill {FP16_MIN:g} (float16) is not absorbing (s + f != f for |s| >= 16): fused "
                        "only with the mask as a raw keep mask (Attention's mask_index, MultiHeadAttention's "
                        "key_padding_mask); the mask is not a keep mask of [B, 1, S or 1, L]")
            key_mask = replace(key_mask, fill=float(np.finfo(np.float32).min))
        raw_mask = packed is not None and (key_mask is not None or not terms)
        slower = _slower_than_unfused(graph, dtype, k.layout if given else q.layout, k_source, raw_mask)
        if slower:
            return slower
        all_keys = (raw_mask and key_mask is None and dtype == np.dtype(np.float32)
                    and _long_keys(graph, k_source, q.layout))
        if island and terms and key_mask is None:
            return ("float16 attention with a float32 Softmax: fused only with the mask as a raw 0/1 mask "
                    "(Attention's mask_index, MultiHeadAttention's key_padding_mask: the kernel adds "
                    "mask_filter_value in float32, as the graph does); "
                    + ("the sequence-first layout takes no raw mask unless packed" if q.layout == SEQ_FIRST
                       and packed is None else "the mask is not a 0/fill keep mask of [B, 1, S or 1, L] (a "
                       "float16 attention_bias would round the float32 mask)"))
        return AttentionPlan(anchor, nodes, q_source, k_source, v_source, q.heads, scale, terms, mask_rank,
                             tail_known, biases, merge_r, q.layout, dtype, q.size, shape_reads, packed, key_mask,
                             island, all_keys, kv_heads=given)

    def rewrite(self, graph, plan: AttentionPlan):
        names = NameAllocator(graph)
        base = plan.softmax.name or "attention"
        if plan.packed is not None:
            return self._rewrite_packed(graph, plan, names, base)
        inputs = [plan.q, plan.k, plan.v]
        bias_input = gs.Variable.empty()
        if plan.biases is not None:
            q_mm, k_mm, v_mm, values, adds = plan.biases
            inputs = [q_mm, k_mm, v_mm]
            bias_input = new_constant(graph, f"{base}/qkv_bias", values)
            for add in adds:
                add.outputs.clear()
                add.inputs.clear()
        if plan.layout == SEQ_FIRST:  # [S, B, E] → [B, S, E]: a pure data movement
            inputs = [self._swap01(graph, names, base, t, plan.dtype) for t in inputs]
        if plan.layout == GIVEN:  # q given [B, H, S, D] → [B, S, H, D] → [B, S, E]: data movement and a view
            inputs[0] = self._merged_heads(graph, names, base, plan)
        attrs = {"num_heads": plan.heads, "scale": plan.scale}
        attention_bias, key_padding = gs.Variable.empty(), gs.Variable.empty()
        if plan.key_mask is not None:
            key_padding = self._mask_index(graph, names, base, plan.key_mask, inputs[0], inputs[1],
                                           _AXES[plan.key_layout][2])
            attrs["mask_filter_value"] = plan.key_mask.fill
        elif plan.terms:
            attention_bias = self._attention_bias(graph, plan, names, base, inputs[0], inputs[1])
        for shape_node, letters in plan.shape_reads:
            self._replace_shape(graph, plan, names, base, shape_node, letters, inputs[0], inputs[1])
        for n in plan.nodes:
            n.outputs.clear()
            n.inputs.clear()
        inputs += [bias_input, key_padding, attention_bias]
        while inputs and inputs[-1].is_empty():  # optional inputs left out at the end
            inputs.pop()
        # The Reshape that merged [B, S, H, D] stays: row-major [B, S, E] holds the same elements in the
        # same order, so it gives the same result from MultiHeadAttention's output ([S, B, E] after a
        # Transpose for the sequence-first layout, whose merge read [S, B, H, D]).
        out = gs.Variable(names(f"{base}/attention_output"), dtype=plan.dtype,
                          shape=_output_shape(inputs[0], plan.heads * plan.head_size))
        graph.nodes.append(gs.Node("MultiHeadAttention", names(f"{base}/MultiHeadAttention"), attrs,
                                   inputs=inputs, outputs=[out], domain="com.microsoft"))
        if plan.layout == SEQ_FIRST:
            out = self._swap01(graph, names, base, out, plan.dtype)
        plan.merge.inputs[0] = out
        return {"op": "com.microsoft.MultiHeadAttention", "num_heads": plan.heads, "scale": plan.scale,
                "mask": bool(plan.terms), "qkv_bias": plan.biases is not None, "layout": plan.layout,
                "kv_layout": "BNSH" if plan.kv_heads else "BSD", "mask_terms": [t.kind for t in plan.terms],
                "mask_form": ("key_padding_mask" if plan.key_mask is not None else "attention_bias" if plan.terms
                              else "none")}

    @staticmethod
    def _merged_heads(graph, names, base, plan):
        """``Reshape(Transpose(q, perm=[0, 2, 1, 3]), [0, 0, E])``: the query as MultiHeadAttention reads it
        ([B, S, E], head h's values at h·D + d), from q given as [B, H, S, D] heads."""
        shape = declared_shape(plan.q)
        hidden = plan.heads * plan.head_size
        moved = gs.Variable(names(f"{base}/query_bshd"), dtype=plan.dtype,
                            shape=[shape[0], shape[2], shape[1], shape[3]] if shape is not None and len(shape) == 4
                            else None)
        graph.nodes.append(gs.Node("Transpose", names(f"{base}/query_transpose"), {"perm": HEADS},
                                   inputs=[plan.q], outputs=[moved]))
        out = gs.Variable(names(f"{base}/query"), dtype=plan.dtype,
                          shape=[shape[0], shape[2], hidden] if shape is not None and len(shape) == 4 else None)
        graph.nodes.append(gs.Node("Reshape", names(f"{base}/query_merge"), inputs=[
            moved, new_constant(graph, f"{base}/query_shape", np.array([0, 0, hidden], np.int64))], outputs=[out]))
        return out

    def _rewrite_packed(self, graph, plan: AttentionPlan, names, base):
        """``Attention(x, [W_q | W_k | W_v], [b_q | b_k | b_v], , , attention_bias)``: the projections move
        into the op (see :func:`~onnxfuse.rewrites.contrib.attention_pattern.packed_projections`); S and L
        are both x's sequence dimension."""
        packed = plan.packed
        x = packed.x
        if plan.layout == SEQ_FIRST:  # [S, B, E_in] → [B, S, E_in]; out comes back to [S, B, E] below
            x = self._batch_first(graph, names, base, x, plan.dtype)
        weight = new_constant(graph, f"{base}/qkv_weight", packed.weight)
        bias = new_constant(graph, f"{base}/qkv_bias", packed.bias)
        attrs = {"num_heads": plan.heads, "scale": plan.scale}
        attention_bias, mask_index = gs.Variable.empty(), None
        if plan.key_mask is not None:
            mask_index = self._mask_index(graph, names, base, plan.key_mask, x, x, 1)
            attrs["mask_filter_value"] = plan.key_mask.fill
        elif plan.all_keys_mask:
            mask_index = self._all_keys_mask(graph, names, base, x)
        elif plan.terms:
            attention_bias = self._attention_bias(graph, plan, names, base, x, x)
        for shape_node, letters in plan.shape_reads:
            self._replace_shape(graph, plan, names, base, shape_node, letters, x, x)
        for n in plan.nodes + packed.nodes:
            n.outputs.clear()
            n.inputs.clear()
        inputs = [x, weight, bias]
        if mask_index is not None:
            inputs.append(mask_index)
        elif not attention_bias.is_empty():
            inputs += [gs.Variable.empty(), gs.Variable.empty(), attention_bias]
        out = gs.Variable(names(f"{base}/attention_output"), dtype=plan.dtype,
                          shape=_output_shape(x, plan.heads * plan.head_size))
        graph.nodes.append(gs.Node("Attention", names(f"{base}/Attention"), attrs, inputs=inputs, outputs=[out],
                                   domain="com.microsoft"))
        if plan.layout == SEQ_FIRST:
            out = self._swap01(graph, names, base, out, plan.dtype)
        plan.merge.inputs[0] = out
        return {"op": "com.microsoft.Attention", "num_heads": plan.heads, "scale": plan.scale,
                "mask": bool(plan.terms), "qkv_packed": True, "layout": plan.layout,
                "mask_terms": [t.kind for t in plan.terms],
                "mask_form": ("all-keys mask_index" if plan.all_keys_mask else "mask_index" if mask_index is not None
                              else "attention_bias" if plan.terms else "none")}

    def _mask_index(self, graph, names, base, mask: KeepMask, query, key, key_axis: int):
        """``Attention``'s raw ``mask_index`` (MultiHeadAttention's ``key_padding_mask``) of 0 and 1 from the
        bool ``keep``: 2-D [B, L] as
        ``Cast(Flatten(keep, axis=1), int32)`` for a key padding mask, 3-D [B, S, L] as ``Cast(Squeeze(keep,
        [1]), int32)`` for one per query (``Not`` first when the mask drops where ``keep`` is True). A
        broadcast dimension of ``keep`` (a causal mask shared across the batch, [1, 1, S, L]) is spelled out
        first by ``Expand`` to [B, 1, S or 1, L], B and S read from ``query`` ([B, S, ·]) and L from ``key``'s
        axis ``key_axis`` at run time (packed self-attention: both x, S = L): Expand only copies values.
        Every layer builds the same nodes from the same ``keep``; cleanup's duplicate merge leaves one set."""
        keep = mask.keep
        if mask.expand:
            one = new_constant(graph, f"{base}/one", np.array([1], np.int64))
            batch, seq = self._dim(graph, names, base, query, 0), self._dim(graph, names, base, query, 1)
            length = seq if key is query and key_axis == 1 else self._dim(graph, names, base, key, key_axis)
            pieces = [batch, one, seq if mask.rank == 3 else one, length]
            target = gs.Variable(names(f"{base}/keep_shape"), dtype=np.int64)
            graph.nodes.append(gs.Node("Concat", names(f"{base}/keep_shape"), {"axis": 0}, inputs=pieces,
                                       outputs=[target]))
            full = gs.Variable(names(f"{base}/keep_full"), dtype=np.bool_)
            graph.nodes.append(gs.Node("Expand", names(f"{base}/keep_expand"), inputs=[keep, target], outputs=[full]))
            keep = full
        flat = gs.Variable(names(f"{base}/key_keep"), dtype=np.bool_)
        if mask.rank == 2:
            graph.nodes.append(gs.Node("Flatten", names(f"{base}/key_keep_flatten"), {"axis": 1},
                                       inputs=[keep], outputs=[flat]))
        elif opset_of(graph) >= 13:
            graph.nodes.append(gs.Node("Squeeze", names(f"{base}/keep_squeeze"), inputs=[
                keep, new_constant(graph, f"{base}/head_axis", np.array([1], np.int64))], outputs=[flat]))
        else:
            graph.nodes.append(gs.Node("Squeeze", names(f"{base}/keep_squeeze"), {"axes": [1]}, inputs=[keep],
                                       outputs=[flat]))
        if mask.negate:
            kept = gs.Variable(names(f"{base}/key_keep_not"), dtype=np.bool_)
            graph.nodes.append(gs.Node("Not", names(f"{base}/key_keep_not"), inputs=[flat], outputs=[kept]))
            flat = kept
        out = gs.Variable(names(f"{base}/mask_index"), dtype=np.int32)
        graph.nodes.append(gs.Node("Cast", names(f"{base}/mask_index_cast"), {"to": 6}, inputs=[flat],
                                   outputs=[out]))
        return out

    @staticmethod
    def _all_keys_mask(graph, names, base, x):
        """A raw ``mask_index`` of ones, [B, L] int32 with B and L = S x's (self-attention), computed on the
        device from x itself: ``Where(Equal(c, c), 1, 1)`` of ``c = Flatten(Slice(x, [0:1] on the last
        axis))`` is 1 everywhere (NaN in c only changes the condition, and both branches are 1). A raw mask
        keeps ONNX Runtime's float32 Attention on its unfused kernel (GEMM, softmax, GEMM) instead of the
        memory-efficient one it picks from 256 keys on (``attention.cc``: that kernel takes no raw mask),
        and a mask of ones masks nothing: the kernel adds ``mask_filter_value`` only where the mask is 0."""
        piece = gs.Variable(names(f"{base}/all_keys_slice"), dtype=x.dtype)
        graph.nodes.append(gs.Node("Slice", names(f"{base}/all_keys_slice"), inputs=[
            x, new_constant(graph, f"{base}/start", np.array([0], np.int64)),
            new_constant(graph, f"{base}/end", np.array([1], np.int64)),
            new_constant(graph, f"{base}/last_axis", np.array([2], np.int64))], outputs=[piece]))
        flat = gs.Variable(names(f"{base}/all_keys_rows"), dtype=x.dtype)
        graph.nodes.append(gs.Node("Flatten", names(f"{base}/all_keys_flatten"), {"axis": 1}, inputs=[piece],
                                   outputs=[flat]))
        cond = gs.Variable(names(f"{base}/all_keys_cond"), dtype=np.bool_)
        graph.nodes.append(gs.Node("Equal", names(f"{base}/all_keys_equal"), inputs=[flat, flat], outputs=[cond]))
        one = new_constant(graph, f"{base}/one_int32", np.array(1, np.int32))
        out = gs.Variable(names(f"{base}/all_keys_mask"), dtype=np.int32)
        graph.nodes.append(gs.Node("Where", names(f"{base}/all_keys_mask"), inputs=[cond, one, one], outputs=[out]))
        return out

    def _batch_first(self, graph, names, base, x, dtype):
        """[B, S, E] for the sequence-first x [S, B, E]: the tensor x was transposed from when x is
        ``Transpose(perm=[1, 0, 2])`` of it (torch.nn.MultiheadAttention with batch_first=True transposes
        its input first: the fused op then reads the original and that Transpose goes), else a new
        Transpose of x."""
        p = producer_of(x)
        if perm_of(p) == [1, 0, 2]:
            return p.inputs[0]
        return self._swap01(graph, names, base, x, dtype)

    @staticmethod
    def _swap01(graph, names, base, tensor, dtype):
        shape = declared_shape(tensor)
        out = gs.Variable(names(f"{base}/swap01"), dtype=dtype,
                          shape=[shape[1], shape[0], shape[2]] if shape is not None and len(shape) == 3 else None)
        graph.nodes.append(gs.Node("Transpose", names(f"{base}/Transpose"), {"perm": [1, 0, 2]},
                                   inputs=[tensor], outputs=[out]))
        return out

    @staticmethod
    def _dim(graph, names, base, source, index):
        """Dimension ``index`` of ``source`` at run time, as a 1-element int64 tensor (Shape, then Slice)."""
        shape = gs.Variable(names(f"{base}/shape"), dtype=np.int64)
        graph.nodes.append(gs.Node("Shape", names(f"{base}/Shape"), inputs=[source], outputs=[shape]))
        dim = gs.Variable(names(f"{base}/dim"), dtype=np.int64)
        graph.nodes.append(gs.Node("Slice", names(f"{base}/Slice"), inputs=[
            shape, new_constant(graph, f"{base}/start", np.array([index], np.int64)),
            new_constant(graph, f"{base}/end", np.array([index + 1], np.int64))], outputs=[dim]))
        return dim

    def _replace_shape(self, graph, plan, names, base, node, letters, query, key):
        """``Shape(t)`` of a tensor the rewrite removes, computed instead from the dims it is made of: B and
        S from ``query``'s shape, L from ``key``'s ([B, S, E] and [B, L, E]), H, D and E constants."""
        dims = {}
        for source, letter, index in ((query, "B", 0), (query, "S", 1), (key, "L", 1)):
            if letter in letters:
                dims[letter] = self._dim(graph, names, base, source, index)
        constants = {"H": plan.heads, "D": plan.head_size, "E": plan.heads * plan.head_size}
        pieces = [dims[c] if c in dims else new_constant(graph, f"{base}/{c}", np.array([constants[c]], np.int64))
                  for c in letters]
        out = node.outputs[0]
        node.outputs.clear()
        node.inputs.clear()
        graph.nodes.append(gs.Node("Concat", names(f"{base}/shape_of_removed"), {"axis": 0}, inputs=pieces,
                                   outputs=[out]))

    def _combined_mask(self, graph, plan, names, base):
        """One additive mask from the terms, innermost first: ``x + M`` adds M; ``Where(c, x, f)`` is
        ``x + Where(c, 0, f)`` (f absorbing), and around an earlier bias b, ``Where(c, x + b, f)`` is
        ``x + Where(c, b, f)``."""
        bias = None
        for term in reversed(plan.terms):
            if term.kind == "add":
                if bias is None:
                    bias = term.mask
                else:
                    out = gs.Variable(names(f"{base}/mask_sum"), dtype=plan.dtype)
                    graph.nodes.append(gs.Node("Add", names(f"{base}/mask_add"), inputs=[bias, term.mask],
                                               outputs=[out]))
                    bias = out
                continue
            kept = bias if bias is not None else new_constant(graph, f"{base}/zero", np.zeros((), plan.dtype))
            fill = new_constant(graph, f"{base}/fill", np.array(term.fill, plan.dtype))
            out = gs.Variable(names(f"{base}/mask_where"), dtype=plan.dtype)
            graph.nodes.append(gs.Node("Where", names(f"{base}/mask_where"), inputs=[
                term.cond, *((kept, fill) if term.scores_if_true else (fill, kept))], outputs=[out]))
            bias = out
        return bias

    @staticmethod
    def _unsqueeze(graph, names, base, mask, axes_values, dtype):
        axes = new_constant(graph, f"{base}/mask_axes", axes_values)
        out = gs.Variable(names(f"{base}/mask_rank4"), dtype=dtype)
        graph.nodes.append(gs.Node("Unsqueeze", names(f"{base}/mask_unsqueeze"), inputs=[mask, axes], outputs=[out]))
        return out

    def _attention_bias(self, graph, plan, names, base, query, key):
        """The mask as [·, ·, S, L]: unsqueezed to rank 4 when it is one Add's of known lower rank, expanded
        to S and L (read from ``query`` and ``key``, the tensors the fused op gets; a constant target when
        both are static sizes, so no Shape, Slice and Concat run on the CPU at every inference) unless
        they are provably there. Every layer of a transformer adds the same mask: the Unsqueeze and the Expand an
        earlier layer's rewrite made are reused when they provably give the same tensor
        (:func:`_shared_unsqueeze`, :func:`_shared_expansion`), instead of one Shape, Slice, Concat and
        Expand per layer."""
        mask = self._combined_mask(graph, plan, names, base)
        if plan.mask_rank and plan.mask_rank < 4:
            axes_values = np.arange(4 - plan.mask_rank, dtype=np.int64)
            mask = _shared_unsqueeze(graph, mask, axes_values) or self._unsqueeze(graph, names, base, mask,
                                                                                   axes_values, plan.dtype)
        if plan.mask_tail_known:
            return mask
        key_layout = plan.key_layout  # L of [B, L, E], or of [B, H, L, D] heads
        key_axis = _AXES[key_layout][2]
        s_dim, l_dim = _sequence_of(graph, query), _sequence_of(graph, key, key_layout)
        if isinstance(s_dim, int) and isinstance(l_dim, int):  # static: a constant target, no shape ops
            target = new_constant(graph, f"{base}/bias_shape", np.array([1, 1, s_dim, l_dim], np.int64))
        else:
            shared = _shared_expansion(graph, mask, query, key, key_layout)
            if shared is not None:
                return shared
            dims = [self._dim(graph, names, base, query, 1), self._dim(graph, names, base, key, key_axis)]
            target = gs.Variable(names(f"{base}/bias_shape"), dtype=np.int64)
            graph.nodes.append(gs.Node("Concat", names(f"{base}/Concat"), {"axis": 0}, inputs=[
                new_constant(graph, f"{base}/ones", np.array([1, 1], np.int64)), *dims], outputs=[target]))
        out = gs.Variable(names(f"{base}/attention_bias"), dtype=plan.dtype)
        graph.nodes.append(gs.Node("Expand", names(f"{base}/mask_expand"), inputs=[mask, target], outputs=[out]))
        return out


def _shared_unsqueeze(graph, mask, axes_values):
    """An existing ``Unsqueeze(mask, axes)`` with these constant axes (same input, same axes: the same
    tensor), or None."""
    for node in consumers(mask):
        if is_op(node, "Unsqueeze") and len(node.inputs) == 2 and node.inputs[0] is mask:
            axes = constant_value(graph, node.inputs[1])
            if axes is not None and np.array_equal(axes, axes_values):
                return node.outputs[0]
    return None


#: (rank, batch axis, sequence axis) of q, k or v as the fused op reads them, by layout
_AXES = {BATCH_FIRST: (3, 0, 1), SEQ_FIRST: (3, 1, 0), GIVEN: (4, 0, 2)}


def _dim_of(graph, tensor, layout, index: int):
    shape = shape_of(graph, tensor)
    rank = _AXES[layout][0]
    return shape[_AXES[layout][index]] if shape is not None and len(shape) == rank else None


def _sequence_of(graph, tensor, layout=BATCH_FIRST):
    """The sequence dimension of q, k or v as the fused op reads it: [B, S, E], the sequence-first
    [S, B, E], or given [B, H, S, D] heads; None if unknown."""
    return _dim_of(graph, tensor, layout, 2)


def _batch_of(graph, tensor, layout=BATCH_FIRST):
    """The batch dimension of q, k or v, read as :func:`_sequence_of` reads the sequence."""
    return _dim_of(graph, tensor, layout, 1)


def _expansion_sources(graph, expand):
    """((q, layout), (k, layout)) when ``expand`` is ``Expand(m, Concat([1, 1], Slice(Shape(q), [1], [2]),
    Slice(Shape(k), [a], [a + 1])))``, the form :meth:`ContribAttention._attention_bias` writes (a = 1:
    k is [B, L, E]; a = 2: given [B, H, L, D] heads); else None."""
    target = producer_of(expand.inputs[1]) if len(expand.inputs) == 2 else None
    if target is None or not is_op(target, "Concat") or len(target.inputs) != 3:
        return None
    ones = constant_value(graph, target.inputs[0])
    if ones is None or ones.tolist() != [1, 1]:
        return None
    sources = []
    for dim in target.inputs[1:]:
        sl = producer_of(dim)
        if sl is None or not is_op(sl, "Slice") or len(sl.inputs) != 3:
            return None
        start, end = constant_value(graph, sl.inputs[1]), constant_value(graph, sl.inputs[2])
        shape = producer_of(sl.inputs[0])
        if (start is None or end is None or start.size != 1 or end.size != 1 or int(start[0]) not in (1, 2)
                or int(end[0]) != int(start[0]) + 1 or shape is None or not is_op(shape, "Shape")
                or shape.attrs.get("start", 0) or "end" in shape.attrs):
            return None
        sources.append((shape.inputs[0], BATCH_FIRST if int(start[0]) == 1 else GIVEN))
    return tuple(sources)


def _shared_expansion(graph, mask, query, key, key_layout=BATCH_FIRST):
    """The output of an existing ``Expand(mask, [1, 1, S', L'])`` whose S' and L' (read at run time from an
    earlier layer's query and key) are provably this attention's S and L (equal static sizes, or the same
    named dimension), or None. Same input, same target values: the same tensor."""
    for node in consumers(mask):
        if not is_op(node, "Expand") or node.inputs[0] is not mask:
            continue
        sources = _expansion_sources(graph, node)
        if sources and dims_equal(_sequence_of(graph, *sources[0]), _sequence_of(graph, query)) and dims_equal(
                _sequence_of(graph, *sources[1]), _sequence_of(graph, key, key_layout)):
            return node.outputs[0]
    return None


#: float32 key length from which ONNX Runtime's CUDA attention runs its float32 memory-efficient kernel
#: (its ``kMinSeqLenForMemoryEfficientAttentionFp32``); there that kernel was slower than the unfused GEMMs
#: it replaces (Whisper-base encoder, L = 1500, H200, 2026-11-23: 0.88× / 0.90× over the original at batch
#: 1 / 16 with the fusion, 1.02× / 1.05× without).
FP32_LONG_KEYS = 256


def _long_keys(graph, key, layout) -> bool:
    """The key length is known to be >= :data:`FP32_LONG_KEYS`."""
    length = _sequence_of(graph, key, layout)
    return isinstance(length, int) and length >= FP32_LONG_KEYS


def _slower_than_unfused(graph, dtype, layout, key, raw_mask: bool) -> str | None:
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
    """
    if dtype != np.float32 or raw_mask:
        return None
    if layout == GIVEN:
        return ("float32 attention over given (rotated or repeated) heads is left unfused: MultiHeadAttention "
                "with [B, H, L, D] key and value measured 0.82-1.04x the decomposed graph in float32 "
                "(benchmarks/gqa_attention.py, H100), 1.4-2.7x in float16: a float16 export (model.half()) fuses it")
    if layout == SEQ_FIRST:
        return ("float32 sequence-first attention is left unfused unless its q, k, v are packed projections "
                "with no mask or a keep mask: the Transposes into [B, S, E] and back cost more than the fusion "
                "saves (measured: ViT-B/16 fp32); fp16 (--precision fp16) fuses it")
    if _long_keys(graph, key, layout):
        return (f"float32 attention over {_sequence_of(graph, key, layout)} keys is left unfused unless its q, k, v are "
                f"packed projections with no mask or a keep mask: ONNX Runtime's fp32 memory-efficient kernel "
                f"is slower than its unfused GEMMs from {FP32_LONG_KEYS} keys on (measured: Whisper-base, "
                f"L=1500); fp16 (--precision fp16) fuses it")
    return None


def _shape_reads(graph, nodes, merge_r, q, k, v, qk, pv, merge_t):
    """The readers outside the pattern when all are ``Shape`` of a batch-first pattern tensor whose dims
    are known by name ([B, H, S, L] for the scores...), as (node, dims); "" when some other reader (or a
    graph output) is the problem; a reason when they are Shapes the rewrite cannot recompute."""
    if not (q.layout == k.layout == v.layout == BATCH_FIRST):
        return ""
    roles = {}

    def tag(node, letters):
        roles[id(node.outputs[0])] = letters

    tag(q.nodes[1], "BSHD"), tag(q.nodes[0], "BHSD")
    if len(k.nodes) == 3:
        tag(k.nodes[0], "BHDL"), tag(k.nodes[1], "BHLD"), tag(k.nodes[2], "BLHD")
    else:
        tag(k.nodes[0], "BHDL"), tag(k.nodes[1], "BLHD")
    tag(v.nodes[0], "BHLD"), tag(v.nodes[1], "BLHD")
    tag(qk, "BHSL"), tag(pv, "BHSD"), tag(merge_t, "BSHD")
    inside = {id(n) for n in nodes} | {id(merge_r)}
    for _ in range(len(nodes)):  # scalar scales, no-op Casts, mask steps and the Softmax keep their input's dims
        for n in nodes:
            if id(n.outputs[0]) not in roles and n.inputs and id(n.inputs[0]) in roles:
                roles[id(n.outputs[0])] = roles[id(n.inputs[0])]
            elif id(n.outputs[0]) not in roles and len(n.inputs) > 1 and any(id(t) in roles for t in n.inputs[1:]):
                if not is_op(n, "Where"):
                    roles[id(n.outputs[0])] = next(roles[id(t)] for t in n.inputs if id(t) in roles)
                elif id(n.inputs[1]) in roles or id(n.inputs[2]) in roles:
                    roles[id(n.outputs[0])] = roles.get(id(n.inputs[1])) or roles[id(n.inputs[2])]
    reads = []
    for n in nodes:
        if n is merge_r:
            continue
        for out in n.outputs:
            if any(t is out for t in graph.outputs):
                return ""
            for c in out.outputs:
                if id(c) in inside:
                    continue
                if id(out) not in roles:
                    return ""
                letters = roles[id(out)]
                readers = [c]
                if is_op(c, "Transpose") and sorted(perm_of(c)) == list(range(len(letters))) and not any(
                        t is c.outputs[0] for t in graph.outputs):  # a Transpose read only for its shape
                    letters = "".join(letters[i] for i in perm_of(c))
                    readers = consumers(c.outputs[0])
                for r in readers:
                    if not is_op(r, "Shape") or r.attrs.get("start", 0) or "end" in r.attrs:
                        return ""
                    reads.append((r, letters))
    return reads


def _fold_biases(graph, sources, hidden, dtype):
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
