"""contrib-grouped-attention-inputs: an ``AttentionInputs`` node that repeats each key/value head for its n
query heads → the same node writing the query as n·S rows of each key/value head, and the
MultiHeadAttention reading the un-repeated presents.

Why
---
With grouped queries (H query heads sharing G = H / n key/value heads; Qwen2-0.5B: 14 and 2),
contrib-attention-inputs writes ``key_heads`` / ``value_heads`` [B, H, T, D], the presents with each
head repeated n times, because MultiHeadAttention wants one key/value head per query head. That is
2·B·H·T·D elements written and read again per layer and step: at batch 8 with 4096 cached tokens, 117 MB
per layer, and the step was GPU-bound there at 7.09 ms against 3.47 ms for onnxruntime-genai's
GroupQueryAttention graph (H100, docs/benchmarks.md 5.31). Attention reads each key/value head once
per query row, so its n query heads can be n times as many rows of one head instead.

What (exact)
------------
Attention is independent per (head, query row): row s of head h is softmax(c·q_{h,s}·K_{h//n}ᵀ +
M_s)·V_{h//n}. So:

* the op (spec ``grouped=1``, docs/custom-ops.md) writes ``query`` [B, S·n, G·D] with row s·n + j of head
  g holding q_{g·n+j, s} (rotated as before), and only its three outputs;
* MultiHeadAttention gets ``num_heads = G``, the presents [B, G, T, D] themselves as key and value;
* its ``attention_bias`` [b, 1, S, T] gets each row repeated n times in place, row s·n + j = row s
  (:func:`~onnxfuse.rewrites.contrib.attention.bias.grouped_rows_bias`: one Expand per step, shared by
  the layers);
* its output [B, S·n, G·D] is viewed (Reshape, no copy) as [B, S, H·D], where head slot j·G + g holds
  head g·n + j: the out-projection MatMul's constant weight rows are permuted to match,
  W'[(j·G + g)·D + d] = W[(g·n + j)·D + d], so no Transpose runs.

The same products and sums per row (the kernels may order them differently: rounding only). ``Shape``
reads of the query and of the repeated heads move to tensors with the same lengths on the axes read
(B and S of the packed projection; B, T and D of the presents).

Refused (the node keeps its repeated heads): no repeat (n = 1); a MultiHeadAttention that does not read
the op's query, key_heads and value_heads as its query, key and value, or has a ``unidirectional``
attribute (rows would no longer be tokens), read present outputs, a bias that is not [b, 1, S, T]; an
attention output read by anything but one MatMul with a constant [H·D, E] weight; other readers of the
replaced tensors than Shapes of axes that keep their length.

Measured: docs/benchmarks.md 5.32 (the decode table, with and without this rule in one run).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.custom_ops import DOMAIN
from onnxfuse.rewrites.contrib.attention.bias import grouped_rows_bias
from onnxfuse.rewrites.contrib.attention.heads import plain_mha_inputs
from onnxfuse.rewrites.contrib.attention.inputs_op import OP_TYPE, read_spec, spec_text
from onnxfuse.rewrites.contrib.matching import ContribRule
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (constant_value, dtype_of, int_attr, is_graph_output, is_ms_op, is_op,
                                           sole_reader)
from onnxfuse.rewrites.facts.shape_values import axis_length, move_shape_reads, positions_read, proved_rank

#: The axes of the query [B, S, H·D] that the packed projection [B, S, (H + 2G)·D] shares, and of the
#: repeated heads [B, H, T, D] that the presents [B, G, T, D] share.
QUERY_AXES, HEADS_AXES = (0, 1), (0, 2, 3)
#: ONNX elementwise ops (numpy broadcasting) seen between an attention and its out-projection.
_ELEMENTWISE = ("Cast", "Identity", "Mul", "Add", "Sub", "Div")


def _other_readers_problem(graph, tensor, attention, axes) -> str | None:
    """Why ``tensor`` cannot stop being written: a reader other than ``attention`` and Shapes read only at
    ``axes``, or a graph output."""
    if is_graph_output(graph, tensor):
        return f"{tensor.name!r} is a graph output"
    for reader in tensor.outputs:
        if reader is attention:
            continue
        read = positions_read(graph, reader) if is_op(reader, "Shape") else None
        if read is None or not read <= set(axes):
            return f"{tensor.name!r} is also read by {reader.name or reader.op!r}"
    return None


def _out_projection(graph, out):
    """The MatMul that projects attention output ``out`` [B, S, H·D] with a constant weight, reached
    through elementwise ops whose other inputs are scalars or 1 long on the last axis (optimum's row
    guard multiplies each row by one factor; a Cast; the FusedElementwise made of them): such an op
    computes column c from column c alone, so it commutes with permuting the columns. Each is the only
    reader of what it reads. None when there is none."""
    tensor = out
    for _ in range(6):
        reader = sole_reader(graph, tensor)
        if is_op(reader, "MatMul") and reader.inputs[0] is tensor:
            weight = constant_value(graph, reader.inputs[1])
            return reader if weight is not None and weight.ndim == 2 else None
        elementwise = is_op(reader, *_ELEMENTWISE) or (reader.op == "FusedElementwise" and reader.domain == DOMAIN)
        others = [t for t in reader.inputs if t is not tensor]
        if not elementwise or len(reader.outputs) != 1 or len(others) != len(reader.inputs) - 1 or not all(
                axis_length(graph, t, -1) == 1 or proved_rank(graph, t) == 0 for t in others):
            return None
        tensor = reader.outputs[0]
    return None


def _attention_problem(graph, attention, inputs, heads, size) -> str | None:
    """Why this MultiHeadAttention cannot read grouped rows (see the module docstring), or None."""
    if int_attr(attention, "unidirectional", 0):
        return "a unidirectional attention"
    if any(out.outputs or is_graph_output(graph, out) for out in attention.outputs[1:]):
        return "the attention's present outputs are read"
    matmul = _out_projection(graph, attention.outputs[0])
    if matmul is None or constant_value(graph, matmul.inputs[1]).shape[0] != heads * size:
        return ("the attention's output is not read only by a MatMul with a constant [H·D, E] weight (through "
                "per-token factors)")
    bias = inputs[5]
    if not bias.is_empty() and (proved_rank(graph, bias) != 4 or axis_length(graph, bias, 1) != 1
                                or dtype_of(graph, bias) is None):
        return "the attention bias is not [b, 1, S, T]"
    return None


class ContribGroupedAttentionInputs(ContribRule):
    name = "contrib-grouped-attention-inputs"
    description = ("AttentionInputs' repeated key/value heads → the query as more rows of each key/value head, "
                   "the attention over the presents themselves")
    targets = frozenset({"cuda"})  # it rewrites an ai.onnxfuse op, written for cuda only

    def match(self, graph):
        return [n for n in graph.nodes if n.op == OP_TYPE and n.domain == DOMAIN and len(n.outputs) == 5]

    def analyze(self, graph, node):
        spec = read_spec(node)
        if spec is None or spec.get("grouped", 0):
            return Refuse("an AttentionInputs spec this rule does not read")
        n = spec["num_heads"] // spec["kv_num_heads"]
        readers = node.outputs[3].outputs
        attention = next((r for r in readers if is_ms_op(r, "MultiHeadAttention")), None)
        if n <= 1 or attention is None:
            return Refuse("no repeated heads read by a MultiHeadAttention")
        found = plain_mha_inputs(graph, attention)
        if isinstance(found, Refuse):
            return found
        inputs, heads, size = found
        reads = (inputs[0], inputs[1], inputs[2])
        if any(a is not b for a, b in zip(reads, (node.outputs[0], node.outputs[3], node.outputs[4]))) or \
                heads != spec["num_heads"] or size != spec["head_size"]:
            return Refuse("the attention does not read the op's query and repeated heads, with its heads")
        problem = _attention_problem(graph, attention, inputs, heads, size)
        problem = problem or _other_readers_problem(graph, node.outputs[0], attention, QUERY_AXES)
        for tensor in node.outputs[3:]:
            problem = problem or _other_readers_problem(graph, tensor, attention, HEADS_AXES)
        if problem:
            return Refuse(problem)
        return dict(attention=attention, spec=spec, n=n)

    def apply(self, graph, node, found):
        names = NameAllocator(graph)
        attention, spec, n = found["attention"], found["spec"], found["n"]
        heads, kv_heads, size = spec["num_heads"], spec["kv_num_heads"], spec["head_size"]
        base = attention.name or "attention"
        old_query, old_heads, presents = node.outputs[0], list(node.outputs[3:]), list(node.outputs[1:3])
        move_shape_reads(graph, old_query, node.inputs[0], QUERY_AXES)
        for old, present in zip(old_heads, presents):
            move_shape_reads(graph, old, present, HEADS_AXES)
        batch = old_query.shape[0] if old_query.shape else None  # [B, S·n, G·D]: the rows' count unnamed
        query = gs.Variable(names(f"{base}/grouped_query"), dtype=old_query.dtype, shape=[batch, None, kv_heads * size])
        node.outputs[0] = query
        node.outputs.pop(), node.outputs.pop()  # the repeated heads: not written any more
        node.attrs["spec"] = spec_text(**{**spec, "grouped": 1})
        attention.inputs[0], attention.inputs[1], attention.inputs[2] = query, *presents
        if len(attention.inputs) > 5 and not attention.inputs[5].is_empty():
            attention.inputs[5] = grouped_rows_bias(graph, names, f"{base}/grouped", attention.inputs[5], n)
        attention.attrs["num_heads"] = kv_heads
        out = attention.outputs[0]
        matmul = _out_projection(graph, out)
        rows = gs.Variable(names(f"{base}/grouped_output"), dtype=out.dtype)
        attention.outputs[0] = rows
        graph.nodes.append(gs.Node("Reshape", names(f"{base}/grouped_output_view"), inputs=[
            rows, new_constant(graph, f"{base}/output_view", np.array([0, -1, heads * size], np.int64))], outputs=[out]))
        weight = constant_value(graph, matmul.inputs[1])
        permuted = weight.reshape(kv_heads, n, size, -1).transpose(1, 0, 2, 3).reshape(weight.shape)
        matmul.inputs[1] = new_constant(graph, f"{matmul.inputs[1].name}/grouped_rows", permuted)
        return {"kv_num_heads": kv_heads, "query_heads_per_kv": n, "masked": len(attention.inputs) > 5
                and not attention.inputs[5].is_empty()}
