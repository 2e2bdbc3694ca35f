"""contrib-decode-attention: a KV-cache decoder's MultiHeadAttention over the presents → one
``ai.onnxfuse.DecodeAttention`` kernel (split along the cached keys) for steps with a few query rows per
key/value head, chosen by an ``If`` that runs the MultiHeadAttention as it was for the others.

Why
---
With the query grouped as n rows per key/value head (contrib-grouped-attention-inputs), ONNX Runtime's
MultiHeadAttention takes its unfused path at decode (a bias, fewer than 8 query rows): a batched GEMM
whose product with V has one block per (batch, key/value head) running over every cached key. At
batch 1 with 4096 cached tokens that made the Qwen2-0.5B-shaped decoder's step 5.07 ms against 3.16
ms with repeated heads (H100, docs/benchmarks.md 5.32); with repeated heads, batch 8 pays for the
copies instead (6.86 ms; onnxruntime-genai's GroupQueryAttention graph 3.13 ms). onnxruntime-genai
decodes with flash-decoding: the keys split over many blocks, the partial softmaxes merged.
``DecodeAttention`` (csrc/decode_attention.cc, contract in docs/custom-ops.md) does that for the
grouped rows, with the graph's own additive mask, so it reads each cached key and value once per
step and keeps the GPU full at any batch.

What (exact up to float32 rounding)
-----------------------------------
Row r of key/value head g, token s = r // n: softmax(c·q_r·Kᵀ + bias[s])·V, c the attention's scale,
in float32 with the running max subtracted (the same softmax; the kernel's sums run in another
order). The op reads the un-repeated bias [b, 1, S, T] (the input of the grouped rule's row repeat, or
the bias itself when n = 1), so the repeat only runs when the MultiHeadAttention does.

Prefill stays with MultiHeadAttention (its tensor-core kernels win with many rows). The rewrite is
``If(S ≤ L / n, then: DecodeAttention(q, K, V, bias), else: MultiHeadAttention)`` (spec ``max_rows=L``:
above L rows the op would compute nothing and give an empty output), S the step's
tokens read at run time from the bias's axis 2 where that is proved to be the projection's sequence
axis (the bias is shared by the layers: one condition for all of them), else R from the query, L the
kernel's limit (16 rows) rounded down to whole tokens. One model serves prefill, decode and chunks, each on the kernel
made for it. An If costs about 1.7 µs of host time (benchmarks/probes/if_overhead.py). The op sits in
the then branch, so a prefill launches none: ONNX Runtime 1.31 places it on the CUDA provider there
(its profile, H200), and the Qwen2-0.5B-shaped decoder's step was 2.57 against 2.80 ms at batch 8 with
1024 cached tokens, the same kernels (benchmarks/probes/if_variants.py, docs/benchmarks.md 5.39). It
used to sit before the If, its output read by an Identity, when an early version of it inside a branch
ran on the CPU provider (5.32).

Measured (docs/benchmarks.md 5.33, float16 Qwen2-0.5B-shaped decoder, H100, one run): every decode and
prefill cell below onnxruntime-genai's builder model (0.81-0.96x; batch 8 with 4096 cached tokens 4.31
against 5.08 ms), 1.9-3.2x faster than the export. The kernel at that cell: 29 µs per layer, 507 GB/s
(the first version 118 µs; 5.33 says what each change bought).

Refused: a MultiHeadAttention that does not read an AttentionInputs' query and presents with grouped
rows (spec ``grouped=1``) or n = 1, or has a ``unidirectional`` attribute, read present outputs, a
bias that is not [b, 1, S, T], a head size above 256.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.custom_ops import DOMAIN
from onnxfuse.rewrites.contrib.attention.bias import grouped_rows_source
from onnxfuse.rewrites.contrib.attention.heads import plain_mha_inputs
from onnxfuse.rewrites.contrib.attention.inputs_op import OP_TYPE as INPUTS_OP, read_spec
from onnxfuse.rewrites.contrib.matching import ContribRule
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import constant_value, dtype_of, int_attr, is_graph_output, is_ms_op, producer_of
from onnxfuse.rewrites.facts.shape_values import axis_length, proved_rank, same_length

#: The op this rule writes (csrc/decode_attention.cc).
OP_TYPE = "DecodeAttention"
#: The largest head size its CUDA kernel takes (32 lanes of at most 8 dims each).
MAX_HEAD_SIZE = 256


#: Query rows per key/value head the CUDA kernel takes, as ``kMaxRows`` in csrc/decode_attention.cc, at
#: every head size: its warps hold at most 16 (row, key subset) items of p · V, and it stages at most 16
#: bias rows per tile.
MAX_ROWS = 16


def _at_most(graph, names, base, tensor, axis: int, limit: int):
    """``LessOrEqual(Shape(tensor)[axis], limit)``, a bool scalar computed on the host at run time; an
    earlier layer's, when it read the same tensor's axis against the same limit (the same value)."""
    for shape in (n for n in tensor.outputs if n.op == "Shape" and not n.attrs):
        for gather in (n for n in shape.outputs[0].outputs if n.op == "Gather" and int(n.attrs.get("axis", 0)) == 0):
            index = constant_value(graph, gather.inputs[1])
            if index is None or index.shape != () or int(index) != axis:
                continue
            for test in (n for n in gather.outputs[0].outputs if n.op == "LessOrEqual" and n.inputs[0] is gather.outputs[0]):
                bound = constant_value(graph, test.inputs[1])
                if bound is not None and bound.shape == () and int(bound) == limit:
                    return test.outputs[0]
    shape = gs.Variable(names(f"{base}/shape"), dtype=np.int64)
    length = gs.Variable(names(f"{base}/length"), dtype=np.int64)
    few = gs.Variable(names(f"{base}/few_rows"), dtype=np.bool_)
    graph.nodes += [
        gs.Node("Shape", names(f"{base}/Shape"), inputs=[tensor], outputs=[shape]),
        gs.Node("Gather", names(f"{base}/length"), {"axis": 0},
                inputs=[shape, new_constant(graph, f"{base}/length_axis", np.array(axis, np.int64))], outputs=[length]),
        gs.Node("LessOrEqual", names(f"{base}/few"), inputs=[
            length, new_constant(graph, f"{base}/limit", np.array(limit, np.int64))], outputs=[few])]
    return few


def _float32_text(value: float) -> str:
    """``value`` as the shortest decimal that reads back as the same float32 (the kernel's scale)."""
    return repr(float(np.float32(value)))


class ContribDecodeAttention(ContribRule):
    name = "contrib-decode-attention"
    description = ("a decoder's MultiHeadAttention over the presents → If few query rows: one DecodeAttention kernel "
                   "(ai.onnxfuse, split along the keys), else the MultiHeadAttention")
    targets = frozenset({"cuda"})  # an ai.onnxfuse op, like AttentionInputs

    def match(self, graph):
        return [n for n in graph.nodes if is_ms_op(n, "MultiHeadAttention")]

    def analyze(self, graph, node):
        source = producer_of(node.inputs[0])
        if source is None or source.op != INPUTS_OP or source.domain != DOMAIN:
            return Refuse("the query is not an AttentionInputs output")
        spec = read_spec(source)
        found = plain_mha_inputs(graph, node)
        if isinstance(found, Refuse):
            return found
        inputs, heads, size = found
        if spec is None or len(source.outputs) != 3 or any(
                a is not b for a, b in zip(inputs[:3], source.outputs)):
            return Refuse("the attention does not read the AttentionInputs' query and presents")
        n = spec["num_heads"] // spec["kv_num_heads"]
        if not (spec["grouped"] or n == 1) or heads != spec["kv_num_heads"] or size != spec["head_size"]:
            return Refuse("the query is not grouped rows of the key/value heads")
        if int_attr(node, "unidirectional", 0):
            return Refuse("a unidirectional attention")
        if any(out.outputs or is_graph_output(graph, out) for out in node.outputs[1:]):
            return Refuse("the attention's present outputs are read")
        if size > MAX_HEAD_SIZE or MAX_ROWS < n:
            return Refuse(f"head size {size} with {n} query heads per key/value head: more than the kernel takes")
        bias = inputs[5]
        if not bias.is_empty():
            bias = grouped_rows_source(graph, bias, n) if n > 1 else bias
            if bias is None or proved_rank(graph, bias) != 4 or axis_length(graph, bias, 1) != 1:
                return Refuse("the attention bias is not [b, 1, S, T] (or its rows repeated by the grouped rule)")
        if dtype_of(graph, node.outputs[0]) is None:
            return Refuse("the attention output's element type is not known")
        scale = node.attrs.get("scale")
        # the step's tokens from the bias (one condition for every layer sharing it) only when its axis 2 is
        # provably the projection's sequence axis; else from this layer's query
        tokens_from_bias = not bias.is_empty() and same_length(axis_length(graph, bias, 2),
                                                               axis_length(graph, source.inputs[0], 1))
        return dict(spec=spec, n=n, size=size, bias=bias, scale=float(scale) if scale else 1.0 / float(np.sqrt(size)),
                    tokens_from_bias=tokens_from_bias)

    def apply(self, graph, node, found):
        names = NameAllocator(graph)
        spec, n, size, bias = found["spec"], found["n"], found["size"], found["bias"]
        base = node.name or "attention"
        out = node.outputs[0]
        dtype = dtype_of(graph, out)
        query, key, value = node.inputs[0], node.inputs[1], node.inputs[2]
        # the condition, read at run time: the tokens S at most the kernel's rows // n, S read from the
        # bias's axis 2 (shared by the layers) where it is proved to be S, else the query's rows S·n
        limit = MAX_ROWS // n
        few = (_at_most(graph, names, base, bias, 2, limit) if found["tokens_from_bias"]
               else _at_most(graph, names, base, query, 1, limit * n))
        decoded = gs.Variable(names(f"{base}/decoded"), dtype=dtype)
        scratch = gs.Variable(names(f"{base}/decode_scratch"), dtype=dtype)
        spec_text = (f"num_heads={spec['num_heads']} kv_num_heads={spec['kv_num_heads']} head_size={size} "
                     f"scale={_float32_text(found['scale'])} max_rows={limit * n}")
        decode = gs.Node(OP_TYPE, names(f"{base}/{OP_TYPE}"), {"spec": spec_text},
                         inputs=[query, key, value] + ([] if bias.is_empty() else [bias]),
                         outputs=[decoded, scratch], domain=DOMAIN)
        attended = gs.Variable(names(f"{base}/attended"), dtype=dtype)
        node.outputs[0] = attended
        graph.nodes.remove(node)
        then_branch = gs.Graph(nodes=[decode], outputs=[decoded], name=names(f"{base}/decode"))
        else_branch = gs.Graph(nodes=[node], outputs=[attended], name=names(f"{base}/prefill"))
        graph.nodes.append(gs.Node("If", names(f"{base}/If"), {"then_branch": then_branch, "else_branch": else_branch},
                                   inputs=[few], outputs=[out]))
        return {"kv_num_heads": spec["kv_num_heads"], "rows_per_token": n, "token_limit": limit,
                "masked": not bias.is_empty()}
