"""The mask written as the fused op takes it: an additive ``attention_bias`` [·, ·, S, L] (shared between
layers where provably the same tensor), a raw 0/1 ``mask_index`` / ``key_padding_mask`` from a keep
mask, or the all-keys ``mask_index`` of ones.

MultiHeadAttention wants ``attention_bias`` ``[B or 1, H or 1, S, L]``: one Add's mask of lower rank is
unsqueezed to rank 4, and unless its last two dimensions are provably S and L, the bias is expanded with
``Expand(M, [1, 1, S, L])`` (S and L read from q and k at run time). Expand is exact: it copies values,
and M's last two dimensions can only be 1 or S and L (it broadcast against the scores).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.keep_masks import KeepMask
from onnxfuse.rewrites.contrib.attention.layout import AXES, BATCH_FIRST, GIVEN, run_time_dim, sequence_of
from onnxfuse.rewrites.contrib.attention.policy import keep_bias_fill
from onnxfuse.rewrites.engine.edit import append_axes_op, new_constant
from onnxfuse.rewrites.facts.graph import (
    BF16, FP32, axes_of, constant_value, consumers, dims_equal, dtype_of, is_op, opset_of, producer_of, shape_of,
)
from onnxfuse.rewrites.facts.shape_values import axis_length, same_length

#: The default-domain opset from which ONNX's ``Where`` takes bfloat16 (Where-16).
WHERE_BFLOAT16_OPSET = 16


def _where_dtype(graph, dtype) -> np.dtype:
    """The type a ``Where`` of ``dtype`` values computes in: ``dtype``, or float32 for bfloat16 below opset
    16, whose ``Where`` takes no bfloat16 (:func:`_where`)."""
    return FP32 if np.dtype(dtype) in BF16 and opset_of(graph) < WHERE_BFLOAT16_OPSET else np.dtype(dtype)


def _where(graph, names, base, node_tag, out_tag, cond, a, b, dtype):
    """``Where(cond, a, b)`` of element type ``dtype``, its output. ONNX's ``Where`` takes bfloat16 only from
    opset 16: below it the ``Where`` runs in float32 (:func:`_where_dtype`; the callers make their constants
    in that type), on bfloat16 tensor inputs cast up (exact: every bfloat16 value is a float32 value), and its
    result is cast down to bfloat16 (each element is one of a's or b's, so the Cast rounds only a constant
    that bfloat16 does not hold, as a bfloat16 constant would)."""
    compute = _where_dtype(graph, dtype)
    operands = []
    for k, value in enumerate((a, b)):
        if compute != np.dtype(dtype) and dtype_of(graph, value) != compute:
            up = gs.Variable(names(f"{base}/{out_tag}_{'ab'[k]}_float"), dtype=compute)
            graph.nodes.append(gs.Node("Cast", names(f"{base}/{out_tag}_{'ab'[k]}_up"),
                                       {"to": onnx.TensorProto.FLOAT}, inputs=[value], outputs=[up]))
            value = up
        operands.append(value)
    out = gs.Variable(names(f"{base}/{out_tag}"), dtype=compute)
    graph.nodes.append(gs.Node("Where", names(f"{base}/{node_tag}"), inputs=[cond, *operands], outputs=[out]))
    if compute == np.dtype(dtype):
        return out
    down = gs.Variable(names(f"{base}/{out_tag}_{np.dtype(dtype).name}"), dtype=dtype)
    graph.nodes.append(gs.Node("Cast", names(f"{base}/{node_tag}_down"), {"to": onnx.helper.np_dtype_to_tensor_dtype(
        np.dtype(dtype))}, inputs=[out], outputs=[down]))
    return down


def _combined_mask(graph, plan, names, base):
    """One additive mask from the terms, innermost first: ``x + M`` adds M; ``Where(c, x, f)`` is
    ``x + Where(c, 0, f)`` (f absorbing), and around an earlier bias b, ``Where(c, x + b, f)`` is
    ``x + Where(c, b, f)``."""
    bias = None
    for term in reversed(plan.terms):
        if term.kind == "add":
            if bias is None:
                bias = term.mask
            else:
                out = gs.Variable(names(f"{base}/mask_sum"), dtype=plan.dtype)
                graph.nodes.append(gs.Node("Add", names(f"{base}/mask_add"), inputs=[bias, term.mask],
                                           outputs=[out]))
                bias = out
            continue
        compute = _where_dtype(graph, plan.dtype)
        kept = bias if bias is not None else new_constant(graph, f"{base}/zero", np.zeros((), compute))
        fill = new_constant(graph, f"{base}/fill", np.array(term.fill, compute))
        bias = _where(graph, names, base, "mask_where", "mask_where", term.cond,
                      *((kept, fill) if term.scores_if_true else (fill, kept)), plan.dtype)
    return bias

def _unsqueeze(graph, names, base, mask, axes_values, dtype):
    out = gs.Variable(names(f"{base}/mask_rank4"), dtype=dtype)
    append_axes_op(graph, "Unsqueeze", names(f"{base}/mask_unsqueeze"), mask, axes_values, out)
    return out

def build_attention_bias(graph, plan, names, base, query, key):
    """The mask as [·, ·, S, L]: unsqueezed to rank 4 when it is one Add's of known lower rank, expanded
    to S and L (read from ``query`` and ``key``, the tensors the fused op gets; a constant target when
    both are static sizes, so no Shape, Slice and Concat run on the CPU at every inference) unless
    they are provably there. Every layer of a transformer adds the same mask: the Unsqueeze and the Expand an
    earlier layer's rewrite made are reused when they provably give the same tensor
    (:func:`_shared_unsqueeze`, :func:`_shared_expansion`), instead of one Shape, Slice, Concat and
    Expand per layer."""
    mask = _combined_mask(graph, plan, names, base)
    if plan.mask_rank and plan.mask_rank < 4:
        axes_values = np.arange(4 - plan.mask_rank, dtype=np.int64)
        mask = _shared_unsqueeze(graph, mask, axes_values) or _unsqueeze(graph, names, base, mask,
                                                                               axes_values, plan.dtype)
    if plan.mask_tail_known:
        return mask
    key_layout = plan.key_layout  # L of [B, L, E], or of [B, H, L, D] heads
    key_axis = AXES[key_layout][2]
    s_dim, l_dim = sequence_of(graph, query), sequence_of(graph, key, key_layout)
    if isinstance(s_dim, int) and isinstance(l_dim, int):  # static: a constant target, no shape ops
        target = new_constant(graph, f"{base}/bias_shape", np.array([1, 1, s_dim, l_dim], np.int64))
    else:
        shared = _shared_expansion(graph, mask, query, key, key_layout)
        if shared is not None:
            return shared
        dims = [run_time_dim(graph, names, base, query, 1), run_time_dim(graph, names, base, key, key_axis)]
        target = gs.Variable(names(f"{base}/bias_shape"), dtype=np.int64)
        graph.nodes.append(gs.Node("Concat", names(f"{base}/Concat"), {"axis": 0}, inputs=[
            new_constant(graph, f"{base}/ones", np.array([1, 1], np.int64)), *dims], outputs=[target]))
    out = gs.Variable(names(f"{base}/attention_bias"), dtype=plan.dtype)
    graph.nodes.append(gs.Node("Expand", names(f"{base}/mask_expand"), inputs=[mask, target], outputs=[out]))
    return out


def grouped_rows_bias(graph, names, base, bias, n: int):
    """``bias`` [b, 1, S, L] for attention over key/value heads whose query rows are the n query heads
    of each group, row s·n + j for token s (contrib-attention-inputs' grouped query): [b, 1, S·n, L] with
    row s·n + j = row s, as ``Reshape(Expand(Unsqueeze(bias, 3), [1, 1, 1, n, 1]), [0, 0, -1, L])``, L
    read from ``bias`` at run time. Copies only: exact. Every layer adds the same bias, so an earlier
    layer's chain over the same tensor is reused (one Expand per step, not one per layer)."""
    for unsqueeze in consumers(bias):  # an earlier layer's chain: the tensor grouped_rows_source reads back
        for expand in consumers(unsqueeze.outputs[0]):
            for reshape in consumers(expand.outputs[0]):
                if grouped_rows_source(graph, reshape.outputs[0], n) is bias:
                    return reshape.outputs[0]
    dtype = bias.dtype
    rows = gs.Variable(names(f"{base}/bias_unsqueezed"), dtype=dtype)
    append_axes_op(graph, "Unsqueeze", names(f"{base}/bias_unsqueeze"), bias, [3], rows)
    repeated = gs.Variable(names(f"{base}/bias_repeated"), dtype=dtype)
    graph.nodes.append(gs.Node("Expand", names(f"{base}/bias_repeat"), inputs=[
        rows, new_constant(graph, f"{base}/bias_repeats", np.array([1, 1, 1, n, 1], np.int64))], outputs=[repeated]))
    length = run_time_dim(graph, names, base, bias, 3)
    target = gs.Variable(names(f"{base}/bias_rows_shape"), dtype=np.int64)
    graph.nodes.append(gs.Node("Concat", names(f"{base}/bias_rows_shape"), {"axis": 0}, inputs=[
        new_constant(graph, f"{base}/bias_rows_lead", np.array([0, 0, -1], np.int64)), length], outputs=[target]))
    out = gs.Variable(names(f"{base}/grouped_bias"), dtype=dtype)
    graph.nodes.append(gs.Node("Reshape", names(f"{base}/grouped_bias_rows"), inputs=[repeated, target], outputs=[out]))
    return out


def grouped_rows_source(graph, tensor, n: int):
    """The bias whose rows :func:`grouped_rows_bias` repeated n times into ``tensor``, or None when
    ``tensor`` is not that chain."""
    reshape = producer_of(tensor)
    expand = producer_of(reshape.inputs[0]) if is_op(reshape, "Reshape") else None
    unsqueeze = producer_of(expand.inputs[0]) if is_op(expand, "Expand") else None
    if not is_op(unsqueeze, "Unsqueeze") or axes_of(graph, unsqueeze) != [3]:
        return None
    target = constant_value(graph, expand.inputs[1])
    bias = unsqueeze.inputs[0]
    if target is None or target.tolist() != [1, 1, 1, n, 1] or not _rows_target_of(graph, reshape, bias):
        return None
    return bias


def _rows_target_of(graph, reshape, bias) -> bool:
    """``reshape``'s target is ``Concat([0, 0, -1], Slice(Shape(bias), [3], [4]))``, as
    :func:`grouped_rows_bias` writes it (allowzero 0)."""
    target = producer_of(reshape.inputs[1])
    if int(reshape.attrs.get("allowzero", 0)) or not is_op(target, "Concat") or len(target.inputs) != 2:
        return False
    lead = constant_value(graph, target.inputs[0])
    source = _run_time_dim_source(graph, target.inputs[1])
    return lead is not None and lead.tolist() == [0, 0, -1] and source is not None and source[0] is bias and source[1] == 3


def build_mask_index(graph, names, base, mask: KeepMask, query, key, key_axis: int):
    """``Attention``'s raw ``mask_index`` (MultiHeadAttention's ``key_padding_mask``) of 0 and 1 from the
    bool ``keep`` (or a 0/1 one of another type, ``zero_one``): 2-D [B, L] as
    ``Cast(Flatten(keep, axis=1), int32)`` for a key padding mask, 3-D [B, S, L] as ``Cast(Squeeze(keep,
    [1]), int32)`` for one per query (``Not`` first when the mask drops where ``keep`` is True). A
    broadcast dimension of ``keep`` (a causal mask shared across the batch, [1, 1, S, L]) is spelled out
    first by ``Expand`` to [B, 1, S or 1, L] (:func:`_spelled_out_keep`).
    A ``keep`` that is the same for every query (``first_query``: [·, 1, S, L], transformers 4's sdpa mask)
    gives its first query's row, ``Slice(keep, [0:1])`` on the query axis, as the [B, L] mask.
    Every layer builds the same nodes from the same ``keep``; cleanup's duplicate merge leaves one set."""
    keep = mask.keep
    if mask.first_query:
        row = gs.Variable(names(f"{base}/keep_first_query"), dtype=dtype_of(graph, keep) or (None if mask.zero_one else np.bool_))
        graph.nodes.append(gs.Node("Slice", names(f"{base}/keep_first_query"), inputs=[
            keep, new_constant(graph, f"{base}/first_query_start", np.array([0], np.int64)),
            new_constant(graph, f"{base}/first_query_end", np.array([1], np.int64)),
            new_constant(graph, f"{base}/query_axis", np.array([-2], np.int64))], outputs=[row]))
        keep = row
    if mask.expand:
        keep = _spelled_out_keep(graph, names, base, keep, query, key, key_axis, mask.rank == 3, "keep")
    # a 0/1 keep of another type (KeepMask.zero_one) is cast to int32 as it is: 1 keeps, 0 drops
    flat = gs.Variable(names(f"{base}/key_keep"), dtype=dtype_of(graph, mask.keep) if mask.zero_one else np.bool_)
    if mask.rank == 2:
        graph.nodes.append(gs.Node("Flatten", names(f"{base}/key_keep_flatten"), {"axis": 1},
                                   inputs=[keep], outputs=[flat]))
    else:
        append_axes_op(graph, "Squeeze", names(f"{base}/keep_squeeze"), keep, [1], flat)
    if mask.negate:
        kept = gs.Variable(names(f"{base}/key_keep_not"), dtype=np.bool_)
        graph.nodes.append(gs.Node("Not", names(f"{base}/key_keep_not"), inputs=[flat], outputs=[kept]))
        flat = kept
    out = gs.Variable(names(f"{base}/mask_index"), dtype=np.int32)
    graph.nodes.append(gs.Node("Cast", names(f"{base}/mask_index_cast"), {"to": 6}, inputs=[flat],
                               outputs=[out]))
    return out

def _spelled_out_keep(graph, names, base, keep, query, key, key_axis: int, per_query: bool, tag: str):
    """``Expand(keep, [B, 1, S or 1, L])``, B and S read from ``query`` ([B, S, ·]) and L from ``key``'s axis
    ``key_axis`` at run time (packed self-attention: both x, S = L); ``per_query``: S, else 1. Expand only
    copies values. New names start with ``tag``."""
    one = new_constant(graph, f"{base}/one", np.array([1], np.int64))
    batch, seq = run_time_dim(graph, names, base, query, 0), run_time_dim(graph, names, base, query, 1)
    length = seq if key is query and key_axis == 1 else run_time_dim(graph, names, base, key, key_axis)
    target = gs.Variable(names(f"{base}/{tag}_shape"), dtype=np.int64)
    graph.nodes.append(gs.Node("Concat", names(f"{base}/{tag}_shape"), {"axis": 0},
                               inputs=[batch, one, seq if per_query else one, length], outputs=[target]))
    full = gs.Variable(names(f"{base}/{tag}_full"), dtype=dtype_of(graph, keep) or np.bool_)
    graph.nodes.append(gs.Node("Expand", names(f"{base}/{tag}_expand"), inputs=[keep, target], outputs=[full]))
    return full


def build_keep_bias(graph, names, base, mask: KeepMask, query, key, key_axis: int, dtype):
    """``Where(keep, 0, fill)`` (:func:`~onnxfuse.rewrites.contrib.attention.policy.keep_bias_fill`) as the
    op's ``attention_bias`` [B, 1, S, L] (``Not``-ed keep
    read the other way round), ``keep`` spelled out to [B, 1, S, L] by ``Expand`` first (B and S read from
    ``query``, L from ``key``'s axis ``key_axis``): the op's bias needs S and L whole
    (:func:`~onnxfuse.rewrites.contrib.attention.policy.keep_bias_pays` says why and when it is exact).
    An earlier layer's bias is reused when it is provably the same tensor (:func:`_shared_keep_bias`):
    BERT-base under ``--precision fp16`` built one Shape, two Slices, a Concat, an Expand and a Where per
    layer, 72 nodes, two of them kernels, for one value."""
    shared = _shared_keep_bias(graph, mask, query, key, key_axis, dtype)
    if shared is not None:
        return shared
    full = _spelled_out_keep(graph, names, base, mask.keep, query, key, key_axis, True, "keep_bias")
    compute = _where_dtype(graph, dtype)
    zero = new_constant(graph, f"{base}/keep_bias_zero", np.zeros((), compute))
    fill = new_constant(graph, f"{base}/keep_bias_fill", np.array(keep_bias_fill(dtype), compute))
    return _where(graph, names, base, "keep_bias", "attention_bias", full,
                  *((fill, zero) if mask.negate else (zero, fill)), dtype)


def build_row_keep_factor(graph, names, base, mask_index, rank: int, dtype):
    """``max(mask_index over the keys)`` as ``dtype``, shaped to broadcast over the fused op's [B, S, E]
    output: [B, 1, 1] for a key padding mask ([B, L]), [B, S, 1] for one per query ([B, S, L]). 1 for a
    row that keeps a key, 0 for a row that keeps none: multiplying the output by it zeroes exactly the
    rows a NaN guard after the original's Softmax zeroed (:func:`~onnxfuse.rewrites.contrib.attention.
    plan.plan_attention`, ``zero_empty_rows``). The Cast comes first: ReduceMax over a float mask is in
    every provider's kernel list, but not for bfloat16 (ONNX Runtime 1.31.1 has no bfloat16 ReduceMax on
    CUDA nor on the CPU: a session refuses the model): there the maximum is taken in float32 and the 0/1
    factor cast to bfloat16 (exact)."""
    compute = FP32 if np.dtype(dtype) in BF16 else np.dtype(dtype)
    as_float = gs.Variable(names(f"{base}/row_keep_values"), dtype=compute)
    graph.nodes.append(gs.Node("Cast", names(f"{base}/row_keep_cast"),
                               {"to": onnx.helper.np_dtype_to_tensor_dtype(compute)},
                               inputs=[mask_index], outputs=[as_float]))
    kept = gs.Variable(names(f"{base}/row_keep"), dtype=compute)
    append_axes_op(graph, "ReduceMax", names(f"{base}/row_keep_max"), as_float, [-1], kept, {"keepdims": 1})
    if compute != np.dtype(dtype):
        low = gs.Variable(names(f"{base}/row_keep_{np.dtype(dtype).name}"), dtype=dtype)
        graph.nodes.append(gs.Node("Cast", names(f"{base}/row_keep_down"),
                                   {"to": onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))},
                                   inputs=[kept], outputs=[low]))
        kept = low
    if rank == 3:
        return kept
    factor = gs.Variable(names(f"{base}/row_keep_factor"), dtype=dtype)
    append_axes_op(graph, "Unsqueeze", names(f"{base}/row_keep_unsqueeze"), kept, [1], factor)
    return factor


def build_all_keys_mask(graph, names, base, x):
    """A raw ``mask_index`` of ones, [B, L] int32 with B and L = S x's (self-attention), computed on the
    device from x itself: ``Where(Equal(c, c), 1, 1)`` of ``c = Flatten(Slice(x, [0:1] on the last
    axis))`` is 1 everywhere (NaN in c only changes the condition, and both branches are 1). A raw mask
    keeps ONNX Runtime's float32 Attention on its unfused kernel (GEMM, softmax, GEMM) instead of the
    memory-efficient one it picks from 256 keys on (``attention.cc``: that kernel takes no raw mask),
    and a mask of ones masks nothing: the kernel adds ``mask_filter_value`` only where the mask is 0."""
    piece = gs.Variable(names(f"{base}/all_keys_slice"), dtype=x.dtype)
    graph.nodes.append(gs.Node("Slice", names(f"{base}/all_keys_slice"), inputs=[
        x, new_constant(graph, f"{base}/start", np.array([0], np.int64)),
        new_constant(graph, f"{base}/end", np.array([1], np.int64)),
        new_constant(graph, f"{base}/last_axis", np.array([2], np.int64))], outputs=[piece]))
    flat = gs.Variable(names(f"{base}/all_keys_rows"), dtype=x.dtype)
    graph.nodes.append(gs.Node("Flatten", names(f"{base}/all_keys_flatten"), {"axis": 1}, inputs=[piece],
                               outputs=[flat]))
    cond = gs.Variable(names(f"{base}/all_keys_cond"), dtype=np.bool_)
    graph.nodes.append(gs.Node("Equal", names(f"{base}/all_keys_equal"), inputs=[flat, flat], outputs=[cond]))
    one = new_constant(graph, f"{base}/one_int32", np.array(1, np.int32))
    out = gs.Variable(names(f"{base}/all_keys_mask"), dtype=np.int32)
    graph.nodes.append(gs.Node("Where", names(f"{base}/all_keys_mask"), inputs=[cond, one, one], outputs=[out]))
    return out


def _shared_unsqueeze(graph, mask, axes_values):
    """An existing ``Unsqueeze(mask, axes)`` with these constant axes (same input, same axes: the same
    tensor), or None."""
    for node in consumers(mask):
        if is_op(node, "Unsqueeze") and len(node.inputs) == 2 and node.inputs[0] is mask:
            axes = constant_value(graph, node.inputs[1])
            if axes is not None and np.array_equal(axes, axes_values):
                return node.outputs[0]
    return None


def _expansion_sources(graph, expand):
    """((q, layout), (k, layout)) when ``expand`` is ``Expand(m, Concat([1, 1], Slice(Shape(q), [1], [2]),
    Slice(Shape(k), [a], [a + 1])))``, the form :func:`build_attention_bias` writes (a = 1:
    k is [B, L, E]; a = 2: given [B, H, L, D] heads); else None."""
    target = producer_of(expand.inputs[1]) if len(expand.inputs) == 2 else None
    if target is None or not is_op(target, "Concat") or len(target.inputs) != 3:
        return None
    ones = constant_value(graph, target.inputs[0])
    if ones is None or ones.tolist() != [1, 1]:
        return None
    sources = []
    for dim in target.inputs[1:]:
        source = _run_time_dim_source(graph, dim)
        if source is None or source[1] not in (1, 2):
            return None
        sources.append((source[0], BATCH_FIRST if source[1] == 1 else GIVEN))
    return tuple(sources)


def _shared_expansion(graph, mask, query, key, key_layout=BATCH_FIRST):
    """The output of an existing ``Expand(mask, [1, 1, S', L'])`` whose S' and L' (read at run time from an
    earlier layer's query and key) are provably this attention's S and L (equal static sizes, or the same
    named dimension), or None. Same input, same target values: the same tensor."""
    for node in consumers(mask):
        if not is_op(node, "Expand") or node.inputs[0] is not mask:
            continue
        sources = _expansion_sources(graph, node)
        if sources and _same_dim(graph, sources[0][0], AXES[sources[0][1]][2], query, AXES[BATCH_FIRST][2]) and _same_dim(
                graph, sources[1][0], AXES[sources[1][1]][2], key, AXES[key_layout][2]):
            return node.outputs[0]
    return None


def _same_dim(graph, a, a_axis: int, b, b_axis: int) -> bool:
    """Dimension ``a_axis`` of ``a`` and ``b_axis`` of ``b`` are provably the same size: equal static sizes
    or the same named dimension as declared, or the same length proved from how both are made
    (:func:`~onnxfuse.rewrites.facts.shape_values.axis_length`: each layer's key is ``Concat(past, new)``,
    past + sequence long, where ONNX's inference names every layer's length anew)."""
    sa, sb = shape_of(graph, a), shape_of(graph, b)
    if sa is not None and sb is not None and a_axis < len(sa) and b_axis < len(sb) and dims_equal(sa[a_axis], sb[b_axis]):
        return True
    return same_length(axis_length(graph, a, a_axis), axis_length(graph, b, b_axis))


def _run_time_dim_source(graph, dim):
    """(tensor, axis) when ``dim`` is ``Slice(Shape(tensor), [axis], [axis + 1])``, the form
    :func:`~onnxfuse.rewrites.contrib.attention.layout.run_time_dim` writes; else None."""
    sl = producer_of(dim)
    if sl is None or not is_op(sl, "Slice") or len(sl.inputs) != 3:
        return None
    start, end = constant_value(graph, sl.inputs[1]), constant_value(graph, sl.inputs[2])
    shape = producer_of(sl.inputs[0])
    if (start is None or end is None or start.size != 1 or end.size != 1 or int(end[0]) != int(start[0]) + 1
            or shape is None or not is_op(shape, "Shape") or shape.attrs.get("start", 0) or "end" in shape.attrs):
        return None
    return shape.inputs[0], int(start[0])


def _same_run_time_dim(graph, dim, tensor, axis: int) -> bool:
    """``dim`` (a Shape-and-Slice read) is provably dimension ``axis`` of ``tensor``: the same tensor and
    axis, or a dimension of equal static size or the same named dim-param."""
    source = _run_time_dim_source(graph, dim)
    if source is None:
        return False
    if source[0] is tensor and source[1] == axis:
        return True
    return _same_dim(graph, source[0], source[1], tensor, axis)


def _shared_keep_bias(graph, mask: KeepMask, query, key, key_axis: int, dtype):
    """The output of an earlier layer's ``Where(Expand(keep, [B, 1, S, L]), 0, fill)`` (the form
    :func:`build_keep_bias` writes, same ``keep``, same branch order, same dtype) whose B, S and L are
    provably this attention's: B and S of ``query``, L of ``key``'s axis ``key_axis``. Same input, same
    target values, same constants: the same tensor. None when there is none."""
    want = [(query, 0), None, (query, 1), (key, key_axis)]
    for expand in consumers(mask.keep):
        if not is_op(expand, "Expand") or expand.inputs[0] is not mask.keep or len(expand.inputs) != 2:
            continue
        target = producer_of(expand.inputs[1])
        if target is None or not is_op(target, "Concat") or len(target.inputs) != 4:
            continue
        one = constant_value(graph, target.inputs[1])
        if one is None or one.tolist() != [1] or not all(
                _same_run_time_dim(graph, target.inputs[i], *want[i]) for i in (0, 2, 3)):
            continue
        for where in consumers(expand.outputs[0]):
            if not is_op(where, "Where") or len(where.inputs) != 3 or where.inputs[0] is not expand.outputs[0]:
                continue
            kept, dropped = (where.inputs[2], where.inputs[1]) if mask.negate else (where.inputs[1], where.inputs[2])
            zero, fill = constant_value(graph, kept), constant_value(graph, dropped)
            if not (zero is not None and fill is not None and fill.dtype == zero.dtype and zero.size == 1
                    and fill.size == 1 and float(zero.reshape(())) == 0.0):
                continue
            with np.errstate(over="ignore"):  # float32's fill in a float16 bias: -inf, which no fill equals
                wanted = float(np.array(keep_bias_fill(dtype), zero.dtype))
            if float(fill.reshape(())) != wanted:
                continue
            if zero.dtype == np.dtype(dtype):
                return where.outputs[0]
            down = [c for c in consumers(where.outputs[0]) if is_op(c, "Cast")  # _where's float32 Where, cast down
                    and dtype_of(graph, c.outputs[0]) == np.dtype(dtype)]
            if zero.dtype == FP32 and down:
                return down[0].outputs[0]
    return None
