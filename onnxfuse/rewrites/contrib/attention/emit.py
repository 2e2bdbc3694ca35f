"""Writing the fused op: com.microsoft ``Attention`` over packed projections, or ``MultiHeadAttention``
over q, k and v as the graph has them; the nodes the plan names are removed.

**The merging Reshape stays**, now reading MultiHeadAttention's [B,S,E] (or its [S,B,E] transpose): row-
major, that holds the same elements in the same order as the [B,S,H,D] ([S,B,H,D]) it read, so its
result is unchanged whatever its target (a target computed from shapes included).

**Not** ``unidirectional``: probed on ONNX Runtime 1.32 CPU, MultiHeadAttention's ``unidirectional=1``
equals the causal triangle when S = L but matched neither the top-left nor the bottom-right triangle
when S < L, and proving that GPT-2's ``Slice`` of its causal buffer (bounds computed from shapes) is the
triangle needs shape arithmetic the rule does not do; the Where form above is exact without it.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.bias import (build_all_keys_mask, build_attention_bias, build_keep_bias,
                                                      build_mask_index, build_row_keep_factor)
from onnxfuse.rewrites.contrib.attention.layout import AXES, GIVEN, HEADS, SEQ_FIRST
from onnxfuse.rewrites.contrib.attention.plan import AttentionPlan
from onnxfuse.rewrites.contrib.attention.shape_reads import replace_shape
from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.facts.graph import declared_shape, perm_of, producer_of

def emit(graph, plan: AttentionPlan):
    names = NameAllocator(graph)
    base = plan.anchor.name or "attention"
    if plan.packed is not None:
        return _emit_packed(graph, plan, names, base)
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
        inputs = [_swap01(graph, names, base, t, plan.dtype) for t in inputs]
    if plan.layout == GIVEN:  # q given [B, H, S, D] → [B, S, H, D] → [B, S, E]: data movement and a view
        inputs[0] = _merged_heads(graph, names, base, plan)
    attrs = {"num_heads": plan.heads, "scale": plan.scale}
    attention_bias, key_padding, raw = gs.Variable.empty(), gs.Variable.empty(), None
    if plan.key_mask is not None:
        raw = build_mask_index(graph, names, base, plan.key_mask, inputs[0], inputs[1], AXES[plan.key_layout][2])
        if plan.keep_as_bias:  # the raw mask only feeds the row factor
            attention_bias = build_keep_bias(graph, names, base, plan.key_mask, inputs[0], inputs[1],
                                             AXES[plan.key_layout][2], plan.dtype)
        else:
            key_padding = raw
            attrs["mask_filter_value"] = plan.key_mask.fill
    elif plan.terms:
        attention_bias = build_attention_bias(graph, plan, names, base, inputs[0], inputs[1])
    for shape_node, letters in plan.shape_reads:
        replace_shape(graph, plan, names, base, shape_node, letters, inputs[0], inputs[1])
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
    _connect_output(graph, names, base, plan, out, raw)
    return {"op": "com.microsoft.MultiHeadAttention", "num_heads": plan.heads, "scale": plan.scale,
            "mask": bool(plan.terms), "qkv_bias": plan.biases is not None, "layout": plan.layout,
            "kv_layout": "BNSH" if plan.kv_heads else "BSD", "mask_terms": [t.kind for t in plan.terms],
            "mask_form": ("keep attention_bias" if plan.keep_as_bias else "key_padding_mask"
                          if plan.key_mask is not None else "attention_bias" if plan.terms else "none")}

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

def _emit_packed(graph, plan: AttentionPlan, names, base):
    """``Attention(x, [W_q | W_k | W_v], [b_q | b_k | b_v], , , attention_bias)``: the projections move
    into the op (see :func:`~onnxfuse.rewrites.contrib.attention.projections.packed_projections`); S and L
    are both x's sequence dimension."""
    packed = plan.packed
    x = packed.x
    if plan.layout == SEQ_FIRST:  # [S, B, E_in] → [B, S, E_in]; out comes back to [S, B, E] below
        x = _batch_first_source(graph, names, base, x, plan.dtype)
    weight = new_constant(graph, f"{base}/qkv_weight", packed.weight)
    bias = new_constant(graph, f"{base}/qkv_bias", packed.bias)
    attrs = {"num_heads": plan.heads, "scale": plan.scale}
    attention_bias, mask_index, raw = gs.Variable.empty(), None, None
    if plan.key_mask is not None:
        raw = build_mask_index(graph, names, base, plan.key_mask, x, x, 1)
        if plan.keep_as_bias:  # the raw mask only feeds the row factor
            attention_bias = build_keep_bias(graph, names, base, plan.key_mask, x, x, 1, plan.dtype)
        else:
            mask_index = raw
            attrs["mask_filter_value"] = plan.key_mask.fill
    elif plan.all_keys_mask:
        mask_index = build_all_keys_mask(graph, names, base, x)
    elif plan.terms:
        attention_bias = build_attention_bias(graph, plan, names, base, x, x)
    for shape_node, letters in plan.shape_reads:
        replace_shape(graph, plan, names, base, shape_node, letters, x, x)
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
    _connect_output(graph, names, base, plan, out, raw if raw is not None else mask_index)
    return {"op": "com.microsoft.Attention", "num_heads": plan.heads, "scale": plan.scale,
            "mask": bool(plan.terms), "qkv_packed": True, "layout": plan.layout,
            "mask_terms": [t.kind for t in plan.terms], "empty_rows_zeroed": plan.zero_empty_rows,
            "mask_form": ("keep attention_bias" if plan.keep_as_bias else "all-keys mask_index" if plan.all_keys_mask
                          else "mask_index" if mask_index is not None else "attention_bias" if plan.terms
                          else "none")}

def _batch_first_source(graph, names, base, x, dtype):
    """[B, S, E] for the sequence-first x [S, B, E]: the tensor x was transposed from when x is
    ``Transpose(perm=[1, 0, 2])`` of it (torch.nn.MultiheadAttention with batch_first=True transposes
    its input first: the fused op then reads the original and that Transpose goes), else a new
    Transpose of x."""
    p = producer_of(x)
    if perm_of(p) == [1, 0, 2]:
        return p.inputs[0]
    return _swap01(graph, names, base, x, dtype)

def _connect_output(graph, names, base, plan: AttentionPlan, out, raw_mask) -> None:
    """The fused op's [B, S, E] output into the merging Reshape: times the row-keep factor first when the
    plan emulates a NaN guard (``zero_empty_rows``, batch-first only: rows with no key kept become 0),
    transposed back to [S, B, E] for the sequence-first layout."""
    if plan.zero_empty_rows:
        factor = build_row_keep_factor(graph, names, base, raw_mask, plan.key_mask.rank, plan.dtype)
        scaled = gs.Variable(names(f"{base}/attention_output_guarded"), dtype=plan.dtype, shape=out.shape)
        graph.nodes.append(gs.Node("Mul", names(f"{base}/empty_rows_to_zero"), inputs=[out, factor],
                                   outputs=[scaled]))
        out = scaled
    if plan.float32_output:  # every float16 value is a float32 value: the Cast only widens
        wide = gs.Variable(names(f"{base}/attention_output_float"), dtype=np.float32, shape=out.shape)
        graph.nodes.append(gs.Node("Cast", names(f"{base}/attention_output_cast"), {"to": 1}, inputs=[out],
                                   outputs=[wide]))
        out = wide
    if plan.layout == SEQ_FIRST:
        out = _swap01(graph, names, base, out, out.dtype)
    plan.merge.inputs[0] = out


def _swap01(graph, names, base, tensor, dtype):
    shape = declared_shape(tensor)
    out = gs.Variable(names(f"{base}/swap01"), dtype=dtype,
                      shape=[shape[1], shape[0], shape[2]] if shape is not None and len(shape) == 3 else None)
    graph.nodes.append(gs.Node("Transpose", names(f"{base}/Transpose"), {"perm": [1, 0, 2]},
                               inputs=[tensor], outputs=[out]))
    return out


def _output_shape(query, hidden: int):
    """The attention op's output shape, [B, S, H·D] with B and S the query's (``query``: x for ``Attention``,
    q for MultiHeadAttention, both [B, S, ·]), or None when the query's rank is not known to be 3. ONNX
    has no schema for contrib ops, so without it every shape after the op would be unknown (the merge
    Reshape then cannot be seen to be an identity, nor the residual Add's operands to be equal)."""
    shape = declared_shape(query)
    return None if shape is None or len(shape) != 3 else [shape[0], shape[1], hidden]
