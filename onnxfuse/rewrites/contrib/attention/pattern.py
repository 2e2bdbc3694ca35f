"""The dataflow walked from the anchor: a ``Softmax`` (the decomposed form every exporter writes) or ONNX's
own ``Attention`` (opset 23), back to q, k and v and forward to the merge, handed to
:func:`~onnxfuse.rewrites.contrib.attention.plan.plan_attention`."""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.contrib.attention.facts import cast_types, downcast_type, is_noop_cast, is_upcast, strip_scale
from onnxfuse.rewrites.contrib.attention.heads import query_key_value, rows_reshape_problem, rows_target_nodes, values_and_merge
from onnxfuse.rewrites.contrib.attention.layout import DTYPES
from onnxfuse.rewrites.contrib.attention.masks import finite_masks, mask_terms, nan_guard
from onnxfuse.rewrites.contrib.attention.plan import AttentionPlan, plan_attention
from onnxfuse.rewrites.contrib.attention.shape_reads import find_shape_reads
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import consumers, dtype_of, is_graph_output, is_op, producer_of, rank_of, shape_of

def analyze_softmax(graph, softmax, zero_one_inputs: frozenset[str] = frozenset()) -> AttentionPlan | Refuse:
    """The plan for the attention ending in ``softmax`` (contrib-attention's anchor), or why not.
    ``zero_one_inputs``: graph inputs the user promised to hold only 0 and 1 (``--right-padded``), which
    a ``(1 - m)·c`` mask may read (:func:`~onnxfuse.rewrites.contrib.attention.keep_masks.keep_mask`)."""
    if len(softmax.inputs) != 1:
        return Refuse("Softmax does not have one input")
    scores_shape = shape_of(graph, softmax.inputs[0])
    if scores_shape is None or len(scores_shape) != 4:
        return Refuse("Softmax input is not known to be rank 4 [batch, heads, query, key]")
    if int(softmax.attrs.get("axis", -1)) not in (-1, 3):
        return Refuse("Softmax is not over the last axis")
    score_dtype = dtype = dtype_of(graph, softmax.inputs[0])
    if dtype not in DTYPES:
        return Refuse(f"element type {dtype} (MultiHeadAttention: float32, float16, bfloat16)")
    nodes = [softmax]
    # after: (no-op Cast, or the float32 → float16 or bfloat16 Cast that ends an island) → MatMul(P, V_heads)
    # → Transpose → Reshape
    probs = softmax.outputs[0]
    readers = consumers(probs)
    island, low = False, None  # low: the island's narrow type, the fused op's
    guard = None  # the dynamo exporter's Where(IsNaN(p), 0, p)
    while True:
        down = downcast_type(graph, readers[0]) if len(readers) == 1 and not island else None
        if guard is None and (guard := nan_guard(graph, probs)) is not None:
            nodes += guard
            probs = guard[1].outputs[0]
        elif len(readers) == 1 and (is_noop_cast(graph, readers[0]) or down is not None):
            if down is not None:
                island, low = True, down
            nodes.append(readers[0])
            probs = readers[0].outputs[0]
        else:
            break
        readers = consumers(probs)
    if island:
        dtype = low
    if len(readers) != 1 or not is_op(readers[0], "MatMul") or readers[0].inputs[0] is not probs:
        return Refuse("Softmax output is not read by exactly one MatMul (× V)")
    pv = readers[0]
    nodes.append(pv)
    v_heads, wide = pv.inputs[1], False
    # float32 P·V over float16 (or bfloat16) values (keep_masks, "Float32 P·V"): the weights stay float32 up to ×V
    if not island and score_dtype == np.dtype(np.float32) and is_upcast(graph, producer_of(v_heads)):
        low = cast_types(graph, producer_of(v_heads))[0]
        wide, island, dtype = True, True, low
        nodes.append(producer_of(v_heads))
        v_heads = producer_of(v_heads).inputs[0]
    found = values_and_merge(graph, v_heads, pv.outputs[0])
    if isinstance(found, Refuse):
        return found
    v, merge_t, merge_r, rows = found
    nodes.append(merge_t)
    # before: mask steps (+ M, Where(c, ·, f)) ← (×/÷ s) ← MatMul(Q_heads, Kᵀ)
    found = mask_terms(graph, softmax.inputs[0], nodes, score_dtype)
    if isinstance(found, Refuse):
        return found
    terms, x = found
    # a guard after a mask that may hold -inf zeroes the rows with every key masked: emulated, or refused
    zero_empty_rows = guard is not None and not finite_masks(graph, terms)
    half_terms = False
    factors: list[float] = []
    x = strip_scale(graph, x, nodes, factors)
    if island:  # the low-precision scores enter float32 here, before any mask step (island or float32 P·V)
        upcast = producer_of(x)
        if not is_upcast(graph, upcast, low):
            return Refuse(f"a float32 Softmax of a {low.name} attention (its weights cast down, or its values cast up) "
                          f"whose scores are not {low.name} cast up to float32")
        nodes.append(upcast)
        inner = upcast.inputs[0]
        if not terms:  # mask steps before the upcast, on the float16 scores (T5's float16 export: plan.py)
            found = mask_terms(graph, inner, nodes, low)
            if isinstance(found, Refuse):
                return found
            terms, inner = found
            half_terms = bool(terms)
        x = strip_scale(graph, inner, nodes, factors)
    qk = producer_of(x)
    if qk is None or not is_op(qk, "MatMul") or len(qk.inputs) != 2:
        return Refuse("no Q·Kᵀ MatMul before the Softmax (or a scale applied after the mask)")
    nodes.append(qk)
    if rows is not None:  # the sdpa symbolic's Reshape(P·V, [B, -1, S, D]): an identity, or refused
        query = qk.inputs[0]  # the query heads, scaled or not (the sdpa symbolic scales q and k by √scale each)
        problem = rows_reshape_problem(graph, rows, pv.outputs[0], [query, strip_scale(graph, query, [], [])], v_heads)
        if problem is not None:
            return problem
        target = rows_target_nodes(rows, pv.outputs[0])
        if isinstance(target, Refuse):
            return target
        nodes += [*target, rows]
    found = query_key_value(graph, qk.inputs[0], qk.inputs[1], True, v, v_heads, nodes, factors)
    if isinstance(found, Refuse):
        return found
    q, k, v = found
    return plan_attention(graph, softmax, nodes, q, k, v, factors, terms, dtype, island, merge_r,
                          lambda: find_shape_reads(graph, nodes, merge_r, q, k, v, qk, pv, merge_t),
                          zero_empty_rows=zero_empty_rows, float32_output=wide, half_terms=half_terms,
                          zero_one_inputs=zero_one_inputs)

def analyze_onnx_attention(graph, op) -> AttentionPlan | Refuse:
    """ONNX's own ``Attention`` (opset 23, which torch's dynamo exporter writes for scaled_dot_product_
    attention from ``opset_version=23`` on) over [B, H, S, D] heads: ``softmax(scale·Q·Kᵀ + mask)·V``
    with ``scale`` the attribute or 1/√D, K given untransposed: the same plan as the decomposed form
    without a mask step (ViT). Refused: a mask (ONNX Runtime 1.32's CPU kernel returns 0 for a row whose
    every key carries finfo.min, where the spec's arithmetic and com.microsoft Attention average the row:
    checked on a one-layer model), the causal flag, a softcap, past keys and values or sequence lengths,
    an output other than Y read, 3-D inputs."""
    inputs = list(op.inputs)
    if len(inputs) < 3 or any(t.name for t in inputs[4:]):
        return Refuse("ONNX Attention with past keys/values or sequence lengths (a KV cache)")
    if len(inputs) > 3 and inputs[3].name:
        return Refuse("ONNX Attention with a mask: ONNX Runtime's CPU kernel gives 0 for a row whose every key is "
                      "masked (finfo.min), where com.microsoft Attention and the spec's arithmetic average the row")
    if any(o.name and consumers(o) for o in op.outputs[1:]) or any(is_graph_output(graph, o) for o in op.outputs[1:]):
        return Refuse("ONNX Attention's present keys/values or QK output are read")
    if int(op.attrs.get("is_causal", 0)) or float(op.attrs.get("softcap", 0.0)) != 0.0:
        return Refuse("ONNX Attention with is_causal or softcap")
    dtype = dtype_of(graph, op.outputs[0])
    if dtype not in DTYPES:
        return Refuse(f"element type {dtype} (Attention: float32, float16, bfloat16)")
    if any(rank_of(graph, t) != 4 for t in inputs[:3]):
        return Refuse("ONNX Attention on 3-D (packed heads) inputs")
    nodes = [op]
    found = values_and_merge(graph, inputs[2], op.outputs[0])
    if isinstance(found, Refuse):
        return found
    v, merge_t, merge_r, rows = found
    if rows is not None:
        return Refuse("the Attention output is reshaped before its heads are merged back")
    nodes.append(merge_t)
    factors: list[float] = []
    found = query_key_value(graph, inputs[0], inputs[1], False, v, inputs[2], nodes, factors)
    if isinstance(found, Refuse):
        return found
    q, k, v = found
    scale = op.attrs.get("scale")
    factors.append(float(scale) if scale is not None else float(q.size) ** -0.5)
    return plan_attention(graph, op, nodes, q, k, v, factors, [], dtype, False, merge_r, None)
