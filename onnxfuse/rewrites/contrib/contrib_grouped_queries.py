"""contrib-grouped-queries (opt-in): MultiHeadAttention over repeated key/value heads → MultiHeadAttention
over the key/value heads themselves, each one's n query heads taken as n times the query rows.

Why
---
Grouped-query models (Llama, Qwen2, Mistral: H query heads sharing H_kv = H / n key/value heads) reach
contrib-attention's MultiHeadAttention with K and V repeated n times (``Gather(x, [h // n], axis=1)``,
repeat-heads-gather). With a KV cache of L tokens that is n·B·H_kv·L·D elements written and read again
per layer and step: on the Qwen2-0.5B-shaped decoder (n = 7) at batch 8 with 4096 cached tokens,
onnxfuse's output took 8.09 ms per token against 3.36 ms for onnxruntime-genai's GroupQueryAttention
graph (docs/benchmarks.md 5.17), while at batch 1 it was within 1.16x.

What (exact)
------------
Attention is independent per (head, query row): row s of head h is ``softmax(s·q_{h,s}·Kᵀ_{h//n} +
M_s)·V_{h//n}``. So the n query heads h = g·n + j (j < n) of key/value head g can be stacked as n·S
query rows of one head g, row j·S + s holding q_{g·n+j, s}, against the un-repeated K_g, V_g, with the
mask row of row j·S + s being M_s:

* query ``[B, S, H·D]`` → Reshape ``[B, S, H_kv, n, D]`` (head h = g·n + j at column h·D, as the op
  split it) → Transpose (0, 3, 1, 2, 4) → ``[B, n, S, H_kv, D]`` → Reshape ``[B, n·S, H_kv·D]``;
* ``attention_bias`` [B or 1, 1 or H, S, L] (the op's own contract) → ``Expand(·, [1, H, 1, 1])`` (heads
  spelled out, whichever of the two it was) → ``Reshape(·, [0, H_kv, -1, 0])``: row-major, head g·n + j's
  row s lands at group g, row j·S + s (two nodes for every layer once duplicates merge);
* ``MultiHeadAttention(num_heads = H_kv)`` over the Gathers' inputs x [B, H_kv, L, D];
* output ``[B, n·S, H_kv·D]`` → Reshape ``[B, n, S, H_kv, D]`` → Transpose (0, 2, 3, 1, 4) →
  ``[B, S, H_kv, n, D]`` → Reshape ``[B, S, H·D]``: head g·n + j at column (g·n + j)·D again.

Pure data movement around the same per-row arithmetic (the kernel may order its sums differently:
rounding). **Opt-in** (``--only +contrib-grouped-queries`` adds it to the default rules): it adds six small nodes per layer to save
the repeat, which pays where B·L is large and costs where the step is launch-bound (batch 1); the
choice depends on shapes the graph does not know, which is issue 32's measured selection, not yet a
default. Refused: no repeated K/V (Gathers along axis 1 with index [h // n]), a bias input, a
key_padding_mask, past inputs, a query that is not 3-D.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.heads import plain_mha_inputs, repeated_heads
from onnxfuse.rewrites.contrib.matching import ContribRule
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import is_ms_op, shape_of


class ContribGroupedQueries(ContribRule):
    name = "contrib-grouped-queries"
    description = ("MultiHeadAttention over repeated K/V heads → over the K/V heads, each one's query heads as "
                   "more query rows (opt-in: pays at large batch × cache length)")
    opt_in = True

    def match(self, graph):
        return [n for n in graph.nodes if is_ms_op(n, "MultiHeadAttention")]

    def analyze(self, graph, node):
        found = plain_mha_inputs(graph, node)
        if isinstance(found, Refuse):
            return found
        inputs = found[0]
        found_k, found_v = repeated_heads(graph, inputs[1]), repeated_heads(graph, inputs[2])
        if found_k is None or found_v is None or found_k[1] != found_v[1]:
            return Refuse("key and value are not the same n-fold repeat of [B, H_kv, L, D] heads")
        (k, n), (v, _) = found_k, found_v
        heads = int(node.attrs.get("num_heads", 0))
        size = shape_of(graph, k)[3]
        kv_heads = shape_of(graph, k)[1]
        query_shape = shape_of(graph, inputs[0])
        if (not isinstance(size, int) or heads != kv_heads * n or query_shape is None or len(query_shape) != 3
                or query_shape[2] != heads * size):
            return Refuse("the query is not [B, S, H·D] for the repeated heads")
        # attention_bias is [B or 1, H or 1, S, L] by the op's contract (it fails otherwise): no check needed
        return (k, v, n, kv_heads, size, inputs[5])

    def apply(self, graph, node, found):
        k, v, n, kv_heads, size, bias = found
        names = NameAllocator(graph)
        base = node.name or "grouped_queries"
        dtype = node.outputs[0].dtype

        def chain(tensor, steps, tag):
            for op, value in steps:
                out = gs.Variable(names(f"{base}/{tag}"), dtype=dtype)
                if op == "Transpose":
                    graph.nodes.append(gs.Node("Transpose", names(f"{base}/{tag}_transpose"), {"perm": value},
                                               inputs=[tensor], outputs=[out]))
                else:
                    graph.nodes.append(gs.Node("Reshape", names(f"{base}/{tag}_reshape"), inputs=[
                        tensor, new_constant(graph, f"{base}/{tag}_shape", np.array(value, np.int64))], outputs=[out]))
                tensor = out
            return tensor

        query = chain(node.inputs[0], [("Reshape", [0, 0, kv_heads, n, size]), ("Transpose", [0, 3, 1, 2, 4]),
                                       ("Reshape", [0, -1, kv_heads * size])], "grouped_query")
        inputs = [query, k, v]
        if not bias.is_empty():
            every_head = gs.Variable(names(f"{base}/grouped_bias_heads"), dtype=bias.dtype)
            graph.nodes.append(gs.Node("Expand", names(f"{base}/grouped_bias_expand"), inputs=[
                bias, new_constant(graph, f"{base}/grouped_bias_heads_shape",
                                   np.array([1, kv_heads * n, 1, 1], np.int64))], outputs=[every_head]))
            tiled = gs.Variable(names(f"{base}/grouped_bias"), dtype=bias.dtype)
            graph.nodes.append(gs.Node("Reshape", names(f"{base}/grouped_bias_reshape"), inputs=[
                every_head, new_constant(graph, f"{base}/grouped_bias_shape", np.array([0, kv_heads, -1, 0], np.int64))],
                outputs=[tiled]))
            inputs += [gs.Variable.empty(), gs.Variable.empty(), tiled]
        grouped = gs.Variable(names(f"{base}/grouped_output"), dtype=dtype)
        attrs = dict(node.attrs)
        attrs["num_heads"] = kv_heads
        graph.nodes.append(gs.Node("MultiHeadAttention", names(f"{base}/grouped"), attrs, inputs=inputs,
                                   outputs=[grouped], domain="com.microsoft"))
        out = node.outputs[0]
        merged = chain(grouped, [("Reshape", [0, n, -1, kv_heads, size]), ("Transpose", [0, 2, 3, 1, 4])], "grouped_out")
        node.inputs.clear()
        node.outputs.clear()
        graph.nodes.append(gs.Node("Reshape", names(f"{base}/grouped_merge"), inputs=[
            merged, new_constant(graph, f"{base}/grouped_merge_shape", np.array([0, 0, kv_heads * n * size], np.int64))],
            outputs=[out]))
        return {"kv_heads": kv_heads, "query_heads_per_kv": n, "masked": not bias.is_empty()}
