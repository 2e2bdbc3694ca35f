"""contrib-embed-layernorm: a transformer's embeddings, ``LayerNorm(Gather(W, ids) + Σ other Gathers)``,
→ one com.microsoft ``EmbedLayerNormalization``.

Why
---
BERT-style encoders start with three table lookups (words, token types, positions), two Adds and a
LayerNorm: six GPU kernels and three full passes over a [B, S, H] tensor before the first layer. ONNX
Runtime's ``EmbedLayerNormalization`` does it in one kernel; its transformers optimizer emits it (for
BERT, given the model type), and that is one of the places its BERT-base graph was ahead of ours
(docs/benchmarks.md 5.8: fp32 batch 1 1.0% behind, batch 16 1.2%). Measured with
``benchmarks/embed_layernorm.py`` (BERT-base's embeddings alone, float32, H100, 2026-11-23): 0.0409 →
0.0294 ms at batch 1, 0.0473 → 0.0344 ms at batch 16, about 12 µs per inference, 1% of BERT-base's
1.12 ms at batch 1.

What
----
The anchor is an ONNX ``LayerNormalization`` over the last axis of a float32 [B, S, H] tensor x (after
contrib-layernorm, which writes that op), with constant γ and β (β absent: zeros), x read only by it.
x must be an Add tree (Adds read only inside it) whose leaves are ``Gather(T_i, idx_i, axis=0)`` of
constant float32 tables [V_i, H]:

* exactly one leaf, the **words**, has a run-time index ``ids`` of shape [B, S] (integers): it becomes
  the op's ``input_ids`` (cast to int32: token ids are below 2³¹);
* at most one more leaf with a run-time [B, S] index, the **token types**: ``segment_ids`` and its table;
* every other leaf has a constant index (positions ``arange(S)``, token type 0 for every token), given
  as a constant or as ``Where(c, k, k)`` of one constant k (what expand-by-broadcast makes of
  ``buffer.expand(B, S)``): it contributes the constant rows ``T_i[k]``, and their sum over those leaves,
  broadcast to [S, H], becomes the op's ``position_embedding`` table, indexed by position s = 0..S-1
  (no ``position_ids``: the kernel then uses s). S must be static for that.

Maths: the op computes ``LayerNorm(W[ids] + C[s] (+ T_seg[seg]))`` with the same γ, β and epsilon.
Exact but for the order of the additions (``(W[ids] + T[0]) + P[s]`` becomes ``W[ids] + (P[s] +
T[0])``): one float32 rounding of a sum, well inside validation's tolerance.

Not the same for invalid ids: ONNX ``Gather`` accepts negative indices (counted from the end) and
rejects ids ≥ V; ONNX Runtime's kernel rejects negative ids too (CPU) or does not check them (CUDA).
Token ids from a tokenizer are never negative. float32 only: ONNX Runtime's CPU kernel (the one
validation may run on) has no float16 version.

Refused, with the reason: LayerNorm not over the last axis of a rank-3 tensor, γ/β not constants,
another element type; a leaf that is not a Gather of a constant [V, H] table, an Add tree read
elsewhere, no run-time word index or more than two, constant indices whose rows do not broadcast to
[S, H] with S static.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.facts import (
    constant_value, consumers, dims_equal, dtype_of, is_alive, is_graph_output, is_op, producer_of, shape_of,
)
from onnxfuse.rewrites.engine.rule import Plan, Refuse, Rule


def _constant_index(graph, tensor):
    """The constant value of an index tensor: a constant, or ``Where(c, k, k)`` with the same constant k in
    both branches (every element is k's at the broadcast index, whatever c is), broadcast to the Where's
    shape when that is known; else None."""
    value = constant_value(graph, tensor)
    if value is not None:
        return value
    p = producer_of(tensor)
    if is_op(p, "Where") and len(p.inputs) == 3 and p.inputs[1] is p.inputs[2]:
        return constant_value(graph, p.inputs[1])
    return None


def _leaves(graph, tensor, adds, depth=0):
    """The addends of the Add tree behind ``tensor`` (its Adds collected in ``adds``); None when an inner
    Add is read outside the tree."""
    p = producer_of(tensor)
    if is_op(p, "Add") and len(p.inputs) == 2 and depth < 4:
        if adds and (len(consumers(tensor)) != 1 or is_graph_output(graph, tensor)):
            return None
        adds.append(p)
        found = []
        for t in p.inputs:
            sub = _leaves(graph, t, adds, depth + 1)
            if sub is None:
                return None
            found += sub
        return found
    return [tensor]


class ContribEmbedLayerNorm(Rule):
    name = "contrib-embed-layernorm"
    description = "LayerNorm(Gather(words) + Gather(positions) [+ Gather(token types)]) → com.microsoft EmbedLayerNormalization"
    targets = frozenset({"contrib", "cuda"})

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "LayerNormalization")]

    def check(self, graph, ln):
        if not is_alive(ln):
            return Refuse("node was already rewritten by an earlier match")
        x = ln.inputs[0]
        shape = shape_of(graph, x)
        if shape is None or len(shape) != 3 or int(ln.attrs.get("axis", -1)) not in (-1, 2):
            return Refuse("LayerNorm is not over the last axis of a rank-3 tensor")
        if dtype_of(graph, x) != np.dtype(np.float32):
            return Refuse("not float32 (ONNX Runtime's CPU EmbedLayerNormalization is float32 only)")
        hidden = shape[2]
        gamma = constant_value(graph, ln.inputs[1]) if len(ln.inputs) > 1 else None
        beta = constant_value(graph, ln.inputs[2]) if len(ln.inputs) > 2 and ln.inputs[2].name else np.zeros(
            hidden if isinstance(hidden, int) else 0, np.float32)
        if gamma is None or beta is None or gamma.shape != (hidden,) or beta.shape != (hidden,):
            return Refuse("γ or β is not a constant of H values")
        if len(consumers(x)) != 1 or is_graph_output(graph, x):
            return Refuse("the LayerNorm input is read elsewhere too")
        if any(consumers(t) or is_graph_output(graph, t) for t in ln.outputs[1:]):
            return Refuse("the LayerNorm's mean or inverse standard deviation is read")
        adds: list = []
        leaves = _leaves(graph, x, adds)
        if not adds or leaves is None:
            return Refuse("the LayerNorm input is not an Add tree read only by it")
        batch, seq = shape[0], shape[1]
        runtime, constant_rows = [], []
        for leaf in leaves:
            gather = producer_of(leaf)
            if not is_op(gather, "Gather") or int(gather.attrs.get("axis", 0)) != 0 or len(consumers(leaf)) != 1:
                return Refuse("an addend is not a Gather (axis 0) read only by the Add")
            table = constant_value(graph, gather.inputs[0])
            if table is None or table.ndim != 2 or table.shape[1] != hidden or table.dtype != np.float32:
                return Refuse("an addend gathers from something other than a constant float32 [V, H] table")
            index = _constant_index(graph, gather.inputs[1])
            if index is not None:
                if not np.issubdtype(index.dtype, np.integer) or np.any(index < -table.shape[0]) \
                        or np.any(index >= table.shape[0]):
                    return Refuse("a constant index is not an integer within its table")
                constant_rows.append(table[index])  # [..., H]
                continue
            idx_shape = shape_of(graph, gather.inputs[1])
            if (dtype_of(graph, gather.inputs[1]) not in (np.dtype(np.int64), np.dtype(np.int32))
                    or idx_shape is None or len(idx_shape) != 2
                    or not (dims_equal(idx_shape[0], batch) and dims_equal(idx_shape[1], seq))):
                return Refuse("a run-time index is not an integer tensor of the input's [B, S]")
            runtime.append((gather, table))
        if not 1 <= len(runtime) <= 2:
            return Refuse(f"{len(runtime)} run-time lookups (the op takes words and at most token types)")
        if not isinstance(seq, int):
            return Refuse("the sequence length is not static (the constant rows become a position table)")
        rows = np.zeros((seq, hidden), np.float32)
        for contribution in constant_rows:
            try:
                rows = rows + np.broadcast_to(contribution, (1, seq, hidden) if contribution.ndim == 3 else (seq, hidden)
                                              ).reshape(seq, hidden)
            except ValueError:
                return Refuse(f"constant rows of shape {contribution.shape} do not broadcast to [S, H] = [{seq}, {hidden}]")
        epsilon = float(ln.attrs.get("epsilon", 1e-5))
        return Plan(ln, (runtime, rows.astype(np.float32), gamma, beta, epsilon, adds, leaves))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        ln = plan.anchor
        runtime, rows, gamma, beta, epsilon, adds, leaves = plan.found
        names = NameAllocator(graph)
        base = ln.name or "embed"

        def ids32(index):
            if dtype_of(graph, index) == np.dtype(np.int32):
                return index
            out = gs.Variable(names(f"{base}/ids_int32"), dtype=np.int32, shape=index.shape)
            graph.nodes.append(gs.Node("Cast", names(f"{base}/ids_cast"), {"to": 6}, inputs=[index], outputs=[out]))
            return out

        (words, word_table), *segment = runtime
        empty = gs.Variable.empty()
        inputs = [ids32(words.inputs[1]), ids32(segment[0][0].inputs[1]) if segment else empty,
                  words.inputs[0], new_constant(graph, f"{base}/position_table", rows),
                  segment[0][0].inputs[0] if segment else empty,
                  new_constant(graph, f"{base}/gamma", gamma), new_constant(graph, f"{base}/beta", beta)]
        out = ln.outputs[0]
        mask_index = gs.Variable(names(f"{base}/mask_index"), dtype=np.int32)
        for n in adds + [producer_of(leaf) for leaf in leaves] + [ln]:
            n.outputs.clear()
            n.inputs.clear()
        graph.nodes.append(gs.Node("EmbedLayerNormalization", names(f"{base}/EmbedLayerNormalization"),
                                   {"epsilon": epsilon}, inputs=inputs, outputs=[out, mask_index],
                                   domain="com.microsoft"))
        return {"node": ln.name, "segment": bool(segment), "constant_rows": list(rows.shape)}
