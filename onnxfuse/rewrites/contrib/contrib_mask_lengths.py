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
With ``--right-padded NAME``, every packed ``Attention`` whose ``mask_index`` is a 2-D int32 tensor
computed from input NAME (and from no other input's values: shape reads do not count) reads
``ReduceSum(mask_index, axes=[1])`` instead. When the mask is ``Cast(to=int32)`` of a bool tensor (what
contrib-attention writes), it holds only 0 and 1; otherwise it is first made 0/1 by
``Cast(Cast(mask_index, bool), int32)`` (the kernels keep a key where the mask is nonzero).

Exact when each mask row is n ≥ 1 ones followed by zeros: keeping "the first n keys" then keeps the same
keys. The promise is about input NAME; the rule does not prove that the mask's rows are NAME's rows,
and it need not: validation draws right-padded values for NAME (:mod:`onnxfuse.runtime.right_padding`),
so a model whose mask rearranges NAME's rows fails validation, and this rule is named.

Without a promise the rule changes nothing: it refuses each float16 ``Attention`` whose
mask derives from one input alone and would take key lengths under that input's promise, with a reason
naming it, which the output's "not fused" line shows (the promise is the user's to give: a
left-padded mask breaks it). Measured there, not here: the BERT-base rows of docs/benchmarks.md 5.61,
eager BERT with 1-D lengths at 1.03-1.07x its optimized ``.half()`` export against sdpa BERT's raw mask at
1.20-1.29x (ONNX Runtime runs float16 attention with a raw mask on its unfused kernel); and 5.63, sdpa
BERT, RoBERTa and DistilBERT with the lengths at 1.05-1.06x at batch 16 (1.09-1.12x at batch 1, host-bound).
The ``.half()`` export's own form, a -65504 ``attention_bias``, exact under the promise, was tried in its
place (5.63): no faster than the lengths (1.058 against 1.051 at batch 16), five nodes more; backed out.

Refused: no promise given (above); a ``mask_index`` that is not 2-D int32 (3-D
causal masks: lengths cannot say which query sees which key); one that also reads another input's values,
or passes through control flow; a causal (``unidirectional``) or ``past`` Attention, or one with an
``attention_bias`` (lengths are verified without them).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.matching import ContribRule
from onnxfuse.rewrites.engine.edit import NameAllocator, append_axes_op
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    FP16, declared_shape, dtype_of, int_attr, is_ms_op, is_op, value_sources,
)
from onnxfuse.rewrites.facts.shape_values import proved_rank

class ContribMaskLengths(ContribRule):
    name = "contrib-mask-lengths"
    description = ("Attention's raw [B, L] mask → 1-D key lengths, when it derives from an input promised "
                   "right-padded (--right-padded NAME; without it, names the float16 ones it would change)")
    right_padded: frozenset[str] = frozenset()

    def under(self, assumptions):
        rule = copy.copy(self)
        rule.right_padded = assumptions.right_padded
        return rule

    def match(self, graph):
        candidates = [n for n in graph.nodes if is_ms_op(n, "Attention") and len(n.inputs) > 3
                      and not n.inputs[3].is_empty() and proved_rank(graph, n.inputs[3]) != 1]  # 1-D: lengths already
        if self.right_padded:
            return candidates
        # no promise: only the float16 ops that the promise of their mask's one input would change, each
        # refused with a reason that names the promise (the output's "not fused" line)
        return [n for n in candidates if self._promisable(graph, n) is not None]

    def _promisable(self, graph, node) -> str | None:
        """The one input whose values ``node``'s mask derives from, where ``node`` computes in float16 and
        would take 1-D key lengths under ``--right-padded`` of that input; else None. Float32 is left out:
        there the lengths measured 0-0.4% faster (module docstring); bfloat16 too, not measured with them."""
        if dtype_of(graph, node.inputs[0]) != FP16:
            return None
        sources = value_sources(node.inputs[3])
        if sources is None or len(sources) != 1:
            return None
        promised = copy.copy(self)
        promised.right_padded = frozenset(sources)
        return None if isinstance(promised.analyze(graph, node), Refuse) else next(iter(sources))

    def analyze(self, graph, node):
        mask = node.inputs[3]
        if not self.right_padded:  # match kept only the ops the promise of their mask's one input changes
            (name,) = value_sources(mask)
            return Refuse(f"no promise about input {name}: in float16 a raw mask takes ONNX Runtime's unfused attention "
                          f"kernel; if {name} holds right-padded rows (n >= 1 ones, then zeros), --right-padded {name} "
                          "makes it 1-D key lengths, which the fused kernels take (BERT-base, H200: 1.03-1.07x its "
                          ".half() export's time with them at batch 16, 1.20-1.29x with a raw mask; docs/benchmarks.md "
                          "5.61, 5.63)")
        if int_attr(node, "unidirectional", 0):
            return Refuse("causal (unidirectional) Attention: lengths are verified only for bidirectional attention")
        if any(not t.is_empty() for t in node.inputs[4:]):
            return Refuse("Attention also has past or attention_bias inputs: lengths are verified without them")
        rank = proved_rank(graph, mask)
        if rank != 2:
            return Refuse(f"mask_index is not a raw [B, L] mask (rank {rank if rank is not None else 'unknown'})")
        cast = mask.inputs[0] if mask.inputs else None
        if dtype_of(graph, mask) != np.dtype(np.int32) and not (is_op(cast, "Cast") and int_attr(cast, "to", 0) == 6):
            return Refuse("mask_index is not int32")
        sources = value_sources(mask)
        if sources is None:
            return Refuse("mask_index is computed through control flow (If/Loop/Scan): its inputs are not traced")
        promised = sorted(sources & self.right_padded)
        others = sorted(sources - self.right_padded)
        if not promised:
            return Refuse(f"mask_index does not derive from an input promised right-padded "
                          f"(--right-padded {', '.join(sorted(self.right_padded))})")
        if others:
            return Refuse(f"mask_index also reads input(s) {', '.join(others)}, not promised right-padded")
        return (mask, promised)

    def apply(self, graph, node, found):
        mask, promised = found
        names = NameAllocator(graph)
        base = node.name or "attention"
        counted = mask if _zero_one(mask) else _as_zero_one(graph, names, base, mask)
        batch = (declared_shape(mask) or (None,))[0]
        lengths = gs.Variable(names(f"{base}/key_lengths"), dtype=np.int32, shape=[batch])
        append_axes_op(graph, "ReduceSum", names(f"{base}/key_lengths"), counted, [1], lengths, {"keepdims": 0})
        node.inputs[3] = lengths
        return {"op": "com.microsoft.Attention", "mask_form": "1-D key lengths", "right_padded": promised}


def _zero_one(mask) -> bool:
    """``mask`` is ``Cast(to=int32)`` of a bool tensor: it holds only 0 and 1."""
    cast = mask.inputs[0] if mask.inputs else None
    return (is_op(cast, "Cast") and int_attr(cast, "to", 0) == 6
            and cast.inputs[0].dtype is not None and np.dtype(cast.inputs[0].dtype) == np.bool_)


def _as_zero_one(graph, names, base, mask):
    """``Cast(Cast(mask, bool), int32)``: 1 where the kernels keep a key (nonzero), else 0."""
    kept = gs.Variable(names(f"{base}/key_kept"), dtype=np.bool_)
    graph.nodes.append(gs.Node("Cast", names(f"{base}/key_kept"), {"to": 9}, inputs=[mask], outputs=[kept]))
    ones = gs.Variable(names(f"{base}/key_kept_int32"), dtype=np.int32)
    graph.nodes.append(gs.Node("Cast", names(f"{base}/key_kept_int32"), {"to": 6}, inputs=[kept], outputs=[ones]))
    return ones
