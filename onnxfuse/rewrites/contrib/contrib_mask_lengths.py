"""contrib-mask-lengths: ``Attention``'s raw [B, L] ``mask_index`` → 1-D key lengths [B], under the
user's promise that the mask input is right-padded (``--right-padded NAME``).

Why
---
ONNX Runtime's ``Attention`` takes its key padding mask in several forms (``attention.cc``): a raw
[B, L] 0/1 mask, which contrib-attention writes because it is exact for any mask, or 1-D lengths [B]
("keep the first n keys"), which is what ONNX Runtime's transformers optimizer writes
(``ReduceSum(Cast(attention_mask, int32), axes=[1])``), assuming every mask is right-padded, silently:
its model is 0.18 off the original for a left-padded row. Measured on an H100 (onnxruntime-gpu 1.31.1,
docs/benchmarks.md 5.10), BERT-base fp32 at batch 16 with this rule against without it, same rounds:
0–0.4% faster in three runs. (5.9's 3.7%, ``benchmarks/mask_index_forms.py``, also dropped the mask's
whole preparation chain, which this rule keeps: it is what keeps the model exact when the mask and the
ids have different batch sizes.)

What
----
With ``--right-padded NAME``, every packed ``Attention`` whose ``mask_index`` the promise covers
(:func:`~onnxfuse.rewrites.contrib.attention.promised_masks.promised_mask`: a 2-D int32 tensor computed
from input NAME and from no other input's values, shape reads aside; bidirectional, no ``past``, no
``attention_bias``) reads ``ReduceSum(mask_index, axes=[1])`` instead. When the mask is ``Cast(to=int32)``
of a bool tensor (what contrib-attention writes), it holds only 0 and 1; otherwise it is first made 0/1
by ``Cast(Cast(mask_index, bool), int32)`` (the kernels keep a key where the mask is nonzero).

Exact when each mask row is n ≥ 1 ones followed by zeros: keeping "the first n keys" then keeps the same
keys (validation draws such rows for NAME, and fails, naming this rule, if the mask is not NAME's rows).

Float16 ``Attention`` takes the promise through contrib-promised-keep-bias first, which runs before this
rule and writes the mask as a keep ``attention_bias`` (ONNX Runtime's memory-efficient kernel; measured
faster there than the lengths, which take its fused runner: docs/benchmarks.md 5.63); this rule then
writes lengths for the others (float32, bfloat16) and for float16 where that rule is skipped. Without a
promise it changes nothing.

Refused: a mask the promise does not cover (above, with the reason).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.promised_masks import bool_keep_source, promised_mask, raw_mask_attentions
from onnxfuse.rewrites.contrib.matching import ContribRule
from onnxfuse.rewrites.engine.edit import NameAllocator, append_axes_op
from onnxfuse.rewrites.facts.graph import declared_shape

class ContribMaskLengths(ContribRule):
    name = "contrib-mask-lengths"
    description = ("Attention's raw [B, L] mask → 1-D key lengths, when it derives from an input promised "
                   "right-padded (--right-padded NAME)")
    right_padded: frozenset[str] = frozenset()

    def under(self, assumptions):
        rule = copy.copy(self)
        rule.right_padded = assumptions.right_padded
        return rule

    def match(self, graph):
        return raw_mask_attentions(graph) if self.right_padded else []

    def analyze(self, graph, node):
        return promised_mask(graph, node, self.right_padded)

    def apply(self, graph, node, found):
        mask, promised = found
        names = NameAllocator(graph)
        base = node.name or "attention"
        counted = mask if bool_keep_source(mask) is not None else _as_zero_one(graph, names, base, mask)
        batch = (declared_shape(mask) or (None,))[0]
        lengths = gs.Variable(names(f"{base}/key_lengths"), dtype=np.int32, shape=[batch])
        append_axes_op(graph, "ReduceSum", names(f"{base}/key_lengths"), counted, [1], lengths, {"keepdims": 0})
        node.inputs[3] = lengths
        return {"op": "com.microsoft.Attention", "mask_form": "1-D key lengths", "right_padded": promised}


def _as_zero_one(graph, names, base, mask):
    """``Cast(Cast(mask, bool), int32)``: 1 where the kernels keep a key (nonzero), else 0."""
    kept = gs.Variable(names(f"{base}/key_kept"), dtype=np.bool_)
    graph.nodes.append(gs.Node("Cast", names(f"{base}/key_kept"), {"to": 9}, inputs=[mask], outputs=[kept]))
    ones = gs.Variable(names(f"{base}/key_kept_int32"), dtype=np.int32)
    graph.nodes.append(gs.Node("Cast", names(f"{base}/key_kept_int32"), {"to": 6}, inputs=[kept], outputs=[ones]))
    return ones
