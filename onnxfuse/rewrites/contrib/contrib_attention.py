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

The steps live in :mod:`onnxfuse.rewrites.contrib.attention`, one job per module, each documenting what
it proves and why:

* **Heads** and their layouts (batch-first, sequence-first, given): :mod:`~.attention.heads`, with the
  layouts' dimensions in :mod:`~.attention.layout`;
* **Scale** (scalar factors, multiplied): :mod:`~.attention.facts`;
* **Projection biases** and packed projections: :mod:`~.attention.projections`;
* **Mask steps** and the dynamo exporter's **NaN guard**: :mod:`~.attention.masks`; **keep masks** as a raw
  ``mask_index`` / ``key_padding_mask``, **float32 softmax islands** and the **float16 masked_fill**:
  :mod:`~.attention.keep_masks`;
* **Shape reads** of removed tensors: :mod:`~.attention.shape_reads`;
* **When it pays** (the measured speed policy, in one place): :mod:`~.attention.policy`;
* the walk from the anchor (a Softmax, or ONNX's own ``Attention``): :mod:`~.attention.pattern`; the
  shared checks and **which op** (packed ``Attention`` or MultiHeadAttention): :mod:`~.attention.plan`;
* writing the op, the mask as it takes it, and why **the merging Reshape stays** and **not**
  ``unidirectional``: :mod:`~.attention.emit`, :mod:`~.attention.bias`.

**Refused**, with the reason: a Softmax not on the last axis or of unknown rank; any piece of the
pattern missing or shaped otherwise (a Transpose with another perm, a Reshape target that is not
constant, not [·,·,H,D] or [S,-1,D] / [-1,H,S,D], changing the batch or sequence dimension, two -1
entries); q, k, v of different heads or layouts; an intermediate read outside the pattern (other than
the Shape reads of :mod:`~.attention.shape_reads`, and head splits that stay for their other readers:
:func:`~.attention.heads.shared_splits`, T5's and BART's ``present`` outputs) or a graph output; element types other than float32/float16 or mixed; a mask
of another element type or rank unknown or above 4; a mask Add whose both operands come from a MatMul;
a Where that does not select between the scores and a scalar fill, with a condition not bool of known
rank ≤ 4, or with a fill that is not absorbing; a scale after a mask step or not a finite non-zero
scalar; a fusion measured slower than the decomposed graph (:mod:`~.attention.policy`).

Both ops run on ONNX Runtime's CPU provider, so validation needs no GPU.
"""

from __future__ import annotations

import copy

from onnxfuse.rewrites.contrib.attention.emit import emit
from onnxfuse.rewrites.contrib.attention.pattern import analyze_onnx_attention, analyze_softmax
from onnxfuse.rewrites.contrib.attention.plan import AttentionPlan
from onnxfuse.rewrites.engine.rule import Rule
from onnxfuse.rewrites.facts.graph import is_op


class ContribAttention(Rule):
    name = "contrib-attention"
    description = ("softmax(s·QKᵀ + mask)·V over Reshape/Transpose-split heads → com.microsoft "
                   "Attention (packed q/k/v projections) or MultiHeadAttention (heads read from the graph)")
    targets = frozenset({"contrib", "cuda"})
    #: inputs promised right-padded (``--right-padded``), hence 0/1: a ``(1 - m)·c`` mask over them is a keep mask
    right_padded: frozenset[str] = frozenset()

    def under(self, assumptions):
        rule = copy.copy(self)
        rule.right_padded = assumptions.right_padded
        return rule

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "Softmax", "Attention")]

    def check(self, graph, anchor):
        if is_op(anchor, "Attention"):
            return analyze_onnx_attention(graph, anchor)
        return analyze_softmax(graph, anchor, zero_one_inputs=self.right_padded)

    def rewrite(self, graph, plan: AttentionPlan):
        return emit(graph, plan)
