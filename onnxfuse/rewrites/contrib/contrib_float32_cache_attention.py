"""contrib-float32-cache-attention (opt-in): a float32 KV-cache decoder's attention over rotated heads →
MultiHeadAttention, which contrib-attention leaves unfused in float32, so that the decoder rules after it
(contrib-attention-inputs, contrib-grouped-attention-inputs, contrib-decode-attention) take the layer.

Why
---
contrib-attention refuses float32 attention over given (rotated or repeated) heads: as one op it measured
0.82-1.04x the decomposed graph at 128 and 512 tokens (docs/benchmarks.md 5.14, prefill shapes). That
refusal also keeps a float32 decoder's decode steps on the decomposed graph, which repeats each cached
key and value head for its query heads (a copy of the whole cache per layer and step) and launches every
piece separately; in float16 the same layer becomes one AttentionInputs kernel and, at decode, one
DecodeAttention kernel reading the cache once (every decode cell below onnxruntime-genai's builder model,
5.33). The op and both decoder kernels take float32 (their GPU tests cover it). Whether a float32 decoder
gains as a whole, with prefill on float32 MultiHeadAttention, is **not measured yet** (issue 31). So the
rule is opt-in (``--only +contrib-float32-cache-attention``) and a measured choice
(:data:`onnxfuse.selection.MEASURED`): wherever optimize times on a GPU, it is tried on top of an output
that still holds a Softmax, validated and timed, and kept only when faster there.

What (exact up to float32 rounding)
-----------------------------------
contrib-attention's own analysis and rewrite (:mod:`~onnxfuse.rewrites.contrib.attention`), with its
speed policy told that rotated, given heads over a KV cache (``Concat(past, new, axis=2)``, possibly
repeated per query head) fuse in float32 (:func:`~onnxfuse.rewrites.contrib.attention.policy.slower_than_unfused`).

Refused: everything contrib-attention refuses for other reasons; an attention that is not float32 with
given key and value heads over a KV cache (contrib-attention's own cases: this rule adds no other).
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.contrib.attention.emit import emit
from onnxfuse.rewrites.contrib.attention.pattern import analyze_softmax
from onnxfuse.rewrites.contrib.attention.plan import AttentionPlan
from onnxfuse.rewrites.contrib.attention.policy import cache_key
from onnxfuse.rewrites.engine.rule import Refuse, Rule
from onnxfuse.rewrites.facts.graph import is_op


class ContribFloat32CacheAttention(Rule):
    name = "contrib-float32-cache-attention"
    description = ("float32 attention over rotated heads and a KV cache → MultiHeadAttention, for the decoder "
                   "rules after it (opt-in; tried and kept when faster wherever optimize times on a GPU)")
    targets = frozenset({"contrib", "cuda"})
    opt_in = True

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "Softmax")]

    def check(self, graph, anchor):
        plan = analyze_softmax(graph, anchor, float32_cache=True)
        if isinstance(plan, Refuse):
            return plan
        if plan.dtype != np.dtype(np.float32) or not plan.kv_heads or not cache_key(graph, plan.k):
            return Refuse("not a float32 attention over given key and value heads of a KV cache (contrib-attention's case)")
        return plan

    def rewrite(self, graph, plan: AttentionPlan):
        return emit(graph, plan)
