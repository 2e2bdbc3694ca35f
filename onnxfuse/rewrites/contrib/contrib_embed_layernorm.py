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
The anchor is an ONNX ``LayerNormalization`` over the last axis of a float32 or float16 [B, S, H]
tensor x (after contrib-layernorm, which writes that op), with constant γ and β (β absent: zeros), x
read only by it. x must be an Add tree (Adds read only inside it) whose leaves are
``Gather(T_i, idx_i, axis=0)`` of constant tables [V_i, H] of x's type, or constant rows (a lookup with
a constant index that fold-constants already folded: the float16 export's positions):

* exactly one leaf, the **words**, has a run-time index ``ids`` of shape [B, S] (integers): it becomes
  the op's ``input_ids`` (cast to int32: token ids are below 2³¹);
* at most one more leaf with a run-time [B, S] index, the **token types**: ``segment_ids`` and its table;
* every other leaf has a constant index (positions ``arange(S)``, token type 0 for every token), given
  as a constant or as ``Where(c, k, k)`` of one constant k (what expand-by-broadcast makes of
  ``buffer.expand(B, S)``): it contributes the constant rows ``T_i[k]``, and their sum over those leaves,
  broadcast to [S, H], becomes the op's ``position_embedding`` table, indexed by position s = 0..S-1
  (no ``position_ids``: the kernel then uses s);
* or, whatever S is: an index whose every element is one constant's value (its values come through
  ops that only move or repeat them, ``Expand(GatherElements(zeros, ·), [B, S])``: transformers'
  token-type ids of a dynamic-sequence export) contributes one row to every token; and the
  **positions** ``Slice(arange buffer [1, M], 0, S)`` with S read by ``Shape`` from the ids (or from the
  looked-up words, DistilBERT) and M >= 2 give the table ``P[0:M]``: the sum is [B, S, H] (proved,
  facts/proven_dims.py), so ``min(S, M)`` is S whenever the model runs and position s reads row s.

* or the **positions** built at run time from the ids' own length, ``Expand(Unsqueeze(Range(0,
  Gather(Shape(ids), 1), 1), [0]), Shape(ids))`` (ONNX Runtime's embed_layer_norm_format8/9; an
  int32/int64 Cast of the length or of the ids allowed: both are below 2³¹): broadcast([1, S], [B, S])
  is exactly the ids' [B, S] and element [b, s] is s, so the lookup gives ``P[s]``, what the op reads
  without ``position_ids`` (:func:`_range_positions`). With ids [B, S] of an integer rank-2 tensor and
  every leaf a lookup by the ids or by that arange, the sum is [B, S, H] whatever shape inference knew
  (their tests declare the dims -1, no size to it: :func:`_lookup_shape`). Refused: an arange from
  another start, or of another tensor's length (an arange of length 1 would broadcast P[0]).

The anchor may also be a com.microsoft ``SkipLayerNormalization(input, skip, γ, β[, bias])``:
contrib-skip-layernorm runs first and makes the embeddings' last Add and LayerNorm one (it is also
what ONNX Runtime's transformers optimizer leaves). Its value is ``LayerNorm(input + skip (+ bias))``,
so input and skip are the two halves of the Add tree, the constant [H] bias one more constant row for
every token, epsilon its own (default 1e-12); refused when its mean, inverse standard deviation or
``input_skip_bias_sum`` output is read (GPT-2's residual stream: the sum is read again).

Not taken: an attention-mask ``ReduceSum(Cast(mask, int32), axis=1)`` beside the embeddings is left as
it is (the op is written without ``mask``). The op's ``mask_index`` is not that sum: ONNX Runtime's
CPU kernel counts the elements equal to 1, its CUDA kernel gives the last nonzero position + 1; the
three agree only for a 0/1 right-padded mask, which a run-time int64 input does not promise. Nor
``position_ids`` (a run-time position index: three run-time lookups are refused).

A run-time lookup whose ``Shape`` is also read (DistilBERT reads S from its words) is allowed: the
Shape then reads ``Concat(Shape(ids), [H])``, the lookup's shape by Gather's definition.

Maths: the op computes ``LayerNorm(W[ids] + C[s] (+ T_seg[seg]))`` with the same γ, β and epsilon.
float32: exact but for the order of the additions (``(W[ids] + T[0]) + P[s]`` becomes ``W[ids] +
(P[s] + T[0])``, C summed in float32): one float32 rounding of a sum, well inside validation's
tolerance. float16 (C summed in float32, rounded once): the sums are float16 as in the original, but
ONNX Runtime's CUDA kernel also accumulates the LayerNorm's mean and mean square in float16 (its CPU
kernel, reached through a float32 Cast, and the original's LayerNormalization in float32), and its
epsilon is rounded to float16 (BERT's 1e-12 becomes 0): float16 rounding, not exactness. Measured on
BERT-base's float16 export (benchmarks/bert_gap.py, H100, docs/benchmarks.md 5.12): the whole model's
output 0.0097 max abs from the float32 original with this op, 0.0101 with the embeddings decomposed
(the float16 export's own drift); 0.0156 and 0.0176 from the float16 original. It is ONNX Runtime's
transformers optimizer's float16 BERT graph too, and it took batch 16 from 1.486 to 1.370 ms.

Not the same for invalid ids: ONNX ``Gather`` accepts negative indices (counted from the end) and
rejects ids ≥ V; ONNX Runtime's kernel rejects negative ids too (CPU) or does not check them (CUDA).
Token ids from a tokenizer are never negative.

Refused, with the reason: LayerNorm not over the last axis of a rank-3 tensor (nor provably [B, S, H]
from its lookups), γ/β (or a SkipLayerNormalization's bias) not constants, its extra outputs read,
an element type other than float32/float16; float16 rows whose variance is tiny or swamped by their
mean (:func:`_float16_statistics_problem`: the CUDA kernel's float16 statistics would lose it); a leaf that is not a Gather of a constant [V, H] table, an Add tree read
elsewhere, no run-time word index or more than two, constant indices whose rows do not broadcast to
[S, H] with S static; with S dynamic, not exactly one position Slice, one ending elsewhere than the
ids' length, or constant rows that depend on the position.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import (
    declared_shape,
    axes_of, constant_value, consumers, dims_equal, dtype_of, is_graph_output, is_ms_op, is_op, is_whole_shape_read,
    producer_of, shape_of, unit_range_limit,
)
from onnxfuse.rewrites.facts.shape_values import SourcedDim, known_name, shape_value


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


#: Ops whose output holds only values of their first input (rearranged, repeated or fewer).
VALUE_KEEPING = ("Expand", "GatherElements", "Gather", "Slice", "Reshape", "Squeeze", "Unsqueeze", "Flatten",
                 "Identity", "Tile", "Transpose")


def _uniform_index(graph, tensor, depth=0):
    """The one value every element of an index tensor holds, when its values all come from a constant whose
    elements are all equal (through ops that only move or repeat values: ``buffer[:, :S].expand(B, S)``,
    transformers' token-type ids of zeros, whatever S and B are at run time); else None."""
    value = _constant_index(graph, tensor)
    if value is not None:
        return value.reshape(-1)[0] if value.size and np.all(value == value.reshape(-1)[0]) else None
    p = producer_of(tensor)
    if depth < 8 and is_op(p, *VALUE_KEEPING) and p.inputs:
        return _uniform_index(graph, p.inputs[0], depth + 1)
    return None


def _position_slice(graph, tensor):
    """``(length, ends)`` when ``tensor`` is ``Slice(arange, 0, ends)`` along the last axis of a constant
    whose rows along that axis are 0, 1, 2, ... (torch's ``position_ids[:, :S]`` from the registered
    buffer): its values are then 0..n-1 with n = min(ends, length). None otherwise."""
    p = producer_of(tensor)
    if not is_op(p, "Slice") or len(p.inputs) < 4:
        return None
    buffer = constant_value(graph, p.inputs[0])
    if buffer is None or buffer.ndim < 1 or not np.issubdtype(buffer.dtype, np.integer) or buffer.shape[-1] == 0:
        return None
    if np.any(buffer.reshape(-1, buffer.shape[-1]) != np.arange(buffer.shape[-1])):
        return None
    starts, axes = constant_value(graph, p.inputs[1]), constant_value(graph, p.inputs[3])
    steps = constant_value(graph, p.inputs[4]) if len(p.inputs) > 4 and p.inputs[4].name else np.ones(1, np.int64)
    if starts is None or axes is None or steps is None or starts.size != 1 or axes.size != 1 or steps.size != 1:
        return None
    if int(starts.reshape(-1)[0]) != 0 or int(steps.reshape(-1)[0]) != 1 \
            or int(axes.reshape(-1)[0]) % buffer.ndim != buffer.ndim - 1:
        return None
    return buffer.shape[-1], p.inputs[2]


def _ids_source(graph, tensor):
    """The integer rank-2 tensor that ``tensor`` is, or is an integer Cast of (a Cast between int32 and
    int64 of token ids or of a dimension keeps every value: both are below 2³¹); else None."""
    p = producer_of(tensor)
    if is_op(p, "Cast") and int(p.attrs.get("to", 0)) in (6, 7):
        tensor = p.inputs[0]
    shape = declared_shape(tensor)
    if dtype_of(graph, tensor) not in (np.dtype(np.int64), np.dtype(np.int32)) or shape is None or len(shape) != 2:
        return None
    return tensor


def _range_positions(graph, index):
    """The ids tensor when ``index`` is ``Expand(Unsqueeze(Range(0, S, 1), [0]), Shape(ids))`` with S
    ``Gather(Shape(ids), 1)`` (through an integer Cast or not) and ids an integer rank-2 tensor [B, S]
    (ORT's embed_layer_norm_format8/9: positions built at run time from the ids' own length): its
    shape is then broadcast([1, S], [B, S]) = [B, S], exactly the ids', and element [b, s] is s.
    None otherwise."""
    expand = producer_of(index)
    if not is_op(expand, "Expand") or len(expand.inputs) != 2:
        return None
    unsqueeze, shape = producer_of(expand.inputs[0]), producer_of(expand.inputs[1])
    if not is_op(unsqueeze, "Unsqueeze") or axes_of(graph, unsqueeze) != [0] or not is_op(shape, "Shape") \
            or not is_whole_shape_read(shape):
        return None
    ids = _ids_source(graph, shape.inputs[0])
    rng = producer_of(unsqueeze.inputs[0])
    limit = unit_range_limit(graph, rng)
    if ids is None or limit is None:
        return None
    length = producer_of(limit)
    if is_op(length, "Cast") and int(length.attrs.get("to", 0)) in (6, 7):  # a dimension is below 2³¹
        length = producer_of(length.inputs[0])
    if not is_op(length, "Gather") or int(length.attrs.get("axis", 0)) != 0:
        return None
    dim_shape, axis = producer_of(length.inputs[0]), constant_value(graph, length.inputs[1])
    if not is_op(dim_shape, "Shape") or not is_whole_shape_read(dim_shape) or axis is None or axis.shape != () \
            or int(axis) not in (1, -1) or _ids_source(graph, dim_shape.inputs[0]) is not ids:
        return None
    return ids


def _lookup_shape(graph, leaves):
    """``(ids, H)`` when the Add tree's shape is provable from its leaves alone, whatever shape inference
    knew (dimensions ONNX Runtime's tests declare as -1 are not sizes to it): every leaf is ``Gather(T,
    idx, axis=0)`` of a constant [V, H] table with idx the integer rank-2 ids [B, S] (or their Cast) or
    :func:`_range_positions` of those ids ([B, S] too), so every leaf, and their sum, is [B, S, H]; else
    None."""
    ids, hidden = None, None
    for leaf in leaves:
        gather = producer_of(leaf)
        if not is_op(gather, "Gather") or int(gather.attrs.get("axis", 0)) != 0:
            return None
        table = constant_value(graph, gather.inputs[0])
        source = _range_positions(graph, gather.inputs[1]) or _ids_source(graph, gather.inputs[1])
        if table is None or table.ndim != 2 or source is None or (hidden is not None and table.shape[1] != hidden) \
                or (ids is not None and source is not ids):
            return None
        ids, hidden = source, int(table.shape[1])
    return None if ids is None else (ids, hidden)


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


def _is_sequence_length(graph, ends, words, seq) -> bool:
    """``ends`` (a Slice's 1-element bound) is the word ids' dimension 1 at run time: read by a Shape chain
    from the ids themselves (or the tensor they were cast from), or from the looked-up words ``Gather(W,
    ids)`` (DistilBERT: its dimension 1 is the ids'), or the same static size."""
    value = shape_value(graph, ends)
    if value is None or len(value) != 1:
        return False
    (dim,) = value
    if isinstance(dim, (int, np.integer)):
        return isinstance(seq, int) and int(dim) == seq
    if not isinstance(dim, SourcedDim) or dim.axis != 1:
        return False
    words_index = words.inputs[1]
    source = producer_of(words_index)
    ids = source.inputs[0] if is_op(source, "Cast") else words_index
    return (dim.tensor is words_index or dim.tensor is words.outputs[0] or dim.tensor is ids
            or _declared_alike(graph, dim.tensor, ids, 1))


def _declared_alike(graph, a, b, axis: int) -> bool:
    """``a`` and ``b`` are graph inputs that the model declares with the same name for dimension ``axis``
    (ONNX: the same ``dim_param`` is the same size). torch's dynamo exporter reads the sequence length from
    whichever input it meets first, ``attention_mask`` [s43, s53] beside ``input_ids`` [s72, s53]; inputs
    that break the declaration are outside the model's contract (validation draws them equal only where
    the original cannot run them unequal)."""
    inputs = {id(t) for t in graph.inputs}
    if id(a) not in inputs or id(b) not in inputs:
        return False
    sa, sb = declared_shape(a), declared_shape(b)
    if sa is None or sb is None or len(sa) <= axis or len(sb) <= axis:
        return False
    return known_name(sa[axis]) and sa[axis] == sb[axis]


#: float16 only: the smallest variance, relative to the mean square, of an embedding row that ONNX
#: Runtime's CUDA kernel normalizes with statistics summed in float16 (variance = E[x²] - mean², where
#: float16 keeps about 2^-11 of E[x²]: a row dominated by its mean loses its variance to that rounding,
#: or goes negative, NaN after the square root; epsilon, 1e-12 in BERT, is 0 in float16).
FLOAT16_MIN_RELATIVE_VARIANCE = 1 / 16
#: float16 only: the smallest variance itself (float16's smallest normal is 6.1e-5; BERT-base's
#: random-weight embedding rows have about 1.2e-3, trained ones more).
FLOAT16_MIN_VARIANCE = 1e-6


def _float16_statistics_problem(runtime, rows) -> Refuse | None:
    """For float16 tables: why the CUDA kernel's float16 statistics would not hold for these embeddings,
    or None. Checked on the rows the op can form with every row of each table in turn and the first row
    of the others (every word with position 0, every position with word 0, ...), in float32: a row
    whose variance is tiny or swamped by its mean is refused (the original's LayerNormalization
    computes in float32 and would not lose it)."""
    (_, words), *segment = runtime
    if words.dtype != np.float16:
        return None
    tables = [words.astype(np.float32), rows.astype(np.float32)] + [t.astype(np.float32) for _, t in segment]
    base = sum(t[0] for t in tables)
    worst_relative, worst = np.inf, np.inf
    for t in tables:
        x = t - t[0] + base  # each row of t with the first rows of the others
        mean = x.mean(axis=1)
        square = (x * x).mean(axis=1)
        var = square - mean * mean
        worst = min(worst, float(var.min()))
        worst_relative = min(worst_relative, float((var / np.maximum(square, np.finfo(np.float32).tiny)).min()))
    if worst < FLOAT16_MIN_VARIANCE or worst_relative < FLOAT16_MIN_RELATIVE_VARIANCE:
        return Refuse(f"float16 embeddings whose rows have a variance of {worst:.2g} ({worst_relative:.2g} of their mean "
                      "square): ONNX Runtime's CUDA EmbedLayerNormalization sums its statistics in float16 and would "
                      "lose it (the original normalizes in float32)")
    return None


def _static_rows(positions, constant_rows, seq: int, hidden: int):
    """The [S, H] position table for a static S (float32: summed once, rounded to the tables' type in
    rewrite): the first S rows of each position lookup plus every constant contribution broadcast to
    [S, H]; or a ``Refuse`` saying why not."""
    parts = list(constant_rows)
    for table, *_ in positions:
        if table.shape[0] < seq:
            return Refuse(f"the position table has {table.shape[0]} rows, fewer than S = {seq}")
        parts.append(table[:seq])
    rows = np.zeros((seq, hidden), np.float32)
    for contribution in parts:
        try:
            rows = rows + np.broadcast_to(contribution, (1, seq, hidden) if contribution.ndim == 3 else (seq, hidden)
                                          ).reshape(seq, hidden)
        except ValueError:
            return Refuse(f"constant rows of shape {contribution.shape} do not broadcast to [S, H] = [{seq}, {hidden}]")
    return rows


def _dynamic_rows(positions, constant_rows, hidden: int):
    """The table for a dynamic sequence length: one position lookup ``P[0:S]`` (a Slice of the arange
    buffer) gives its rows, every other constant contribution must be one row for all tokens (added to
    each of them); the op reads row s for token s, as the original does. Or a ``Refuse`` saying why not."""
    if len(positions) != 1:
        return Refuse("the sequence length is not static and there is not exactly one position lookup (P[0:S]) to "
                      "make the position table from")
    (table, *_), = positions
    rows = table.astype(np.float32)  # summed in float32, rounded once to the tables' type in rewrite
    for contribution in constant_rows:
        if contribution.ndim > 1 and np.prod(contribution.shape[:-1]) != 1:
            return Refuse(f"constant rows of shape {contribution.shape} depend on the position and the sequence "
                          "length is not static")
        rows = rows + contribution.reshape(-1, hidden)
    return rows


class ContribEmbedLayerNorm(Rule):
    name = "contrib-embed-layernorm"
    description = "LayerNorm(Gather(words) + Gather(positions) [+ Gather(token types)]) → com.microsoft EmbedLayerNormalization"
    targets = frozenset({"contrib", "cuda"})

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "LayerNormalization") or is_ms_op(n, "SkipLayerNormalization")]

    def check(self, graph, ln):
        skip = is_ms_op(ln, "SkipLayerNormalization")  # LayerNorm(input + skip (+ bias)), written earlier
        x = ln.inputs[0]
        if skip and (len(ln.inputs) < 3 or ln.inputs[1] is x):
            return Refuse("a SkipLayerNormalization without γ, or adding its input to itself")
        roots = [x, ln.inputs[1]] if skip else [x]
        if any(consumers(r) != [ln] or is_graph_output(graph, r) for r in roots if is_op(producer_of(r), "Add")) \
                or (not skip and (len(consumers(x)) != 1 or is_graph_output(graph, x))):
            return Refuse("the LayerNorm input is read elsewhere too")
        if any(consumers(t) or is_graph_output(graph, t) for t in ln.outputs[1:]):
            return Refuse("the LayerNorm's mean, inverse standard deviation or sum is read")
        adds: list = []
        leaves = []
        for root in roots:
            found = _leaves(graph, root, adds)
            if found is None:
                return Refuse("the LayerNorm input is not an Add tree read only by it")
            leaves += found
        if not skip and not adds:
            return Refuse("the LayerNorm input is not an Add tree read only by it")
        shape = shape_of(graph, x)
        proven_ids = None
        if shape is None or len(shape) != 3 or None in shape:
            found = _lookup_shape(graph, leaves)  # dimensions declared -1 (ONNX Runtime's tests)
            if found is not None:
                proven_ids, hidden = found
                shape = (None, None, hidden)
        if shape is None or len(shape) != 3 or (not skip and int(ln.attrs.get("axis", -1)) not in (-1, 2)):
            return Refuse("LayerNorm is not over the last axis of a rank-3 tensor")
        dtype = dtype_of(graph, x)
        if dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
            return Refuse(f"element type {dtype} (the op takes float32 or float16)")
        hidden = shape[2]
        params = ln.inputs[2:] if skip else ln.inputs[1:]  # γ, β (, bias: SkipLayerNormalization)
        gamma = constant_value(graph, params[0]) if params else None
        beta = constant_value(graph, params[1]) if len(params) > 1 and params[1].name else np.zeros(
            hidden if isinstance(hidden, int) else 0, np.float32)
        if gamma is None or beta is None or gamma.shape != (hidden,) or beta.shape != (hidden,):
            return Refuse("γ or β is not a constant of H values")
        constant_rows = []
        if skip and len(params) > 2 and params[2].name:  # the bias: one more constant row for every token
            bias = constant_value(graph, params[2])
            if bias is None or bias.shape != (hidden,) or bias.dtype != dtype:
                return Refuse("the SkipLayerNormalization's bias is not a constant of H values")
            constant_rows.append(bias)
        batch, seq = shape[0], shape[1]
        runtime, positions = [], []
        shape_reads = []
        for leaf in leaves:
            folded = constant_value(graph, leaf)  # a lookup with a constant index, already folded
            if folded is not None and folded.dtype == dtype and folded.ndim >= 1 and folded.shape[-1] == hidden:
                constant_rows.append(folded)
                continue
            gather = producer_of(leaf)
            readers = [n for n in consumers(leaf) if n not in adds and n is not ln]
            if not is_op(gather, "Gather") or int(gather.attrs.get("axis", 0)) != 0 or is_graph_output(graph, leaf) \
                    or any(not is_whole_shape_read(n) for n in readers):
                return Refuse("an addend is not a Gather (axis 0) read only by the Add (and whole-shape Shape nodes)")
            table = constant_value(graph, gather.inputs[0])
            if table is None or table.ndim != 2 or table.shape[1] != hidden or table.dtype != dtype:
                return Refuse(f"an addend gathers from something other than a constant {dtype} [V, H] table")
            index = _constant_index(graph, gather.inputs[1])
            if index is None:
                uniform = _uniform_index(graph, gather.inputs[1])
                index = None if uniform is None else np.asarray(uniform)  # one row, broadcast to every token
            sliced = _position_slice(graph, gather.inputs[1])
            ranged = _range_positions(graph, gather.inputs[1])
            if readers and (index is not None or sliced is not None or ranged is not None):
                return Refuse("a constant or position lookup's shape is read too")
            if index is not None:
                if not np.issubdtype(index.dtype, np.integer) or np.any(index < -table.shape[0]) \
                        or np.any(index >= table.shape[0]):
                    return Refuse("a constant index is not an integer within its table")
                constant_rows.append(table[index])  # [..., H]
                continue
            # M >= 2: a one-row slice would broadcast P[0] to every position, which the op's table cannot say
            if sliced is not None and 2 <= sliced[0] <= table.shape[0]:
                positions.append((table[: sliced[0]], sliced[1], None))
                continue
            if ranged is not None:  # arange(S) of the ids' own S: position s reads row s of the whole table
                positions.append((table, None, ranged))
                continue
            idx_shape = shape_of(graph, gather.inputs[1])
            if proven_ids is not None and _ids_source(graph, gather.inputs[1]) is proven_ids:
                pass  # [B, S], the shape the whole tree has (_lookup_shape)
            elif (dtype_of(graph, gather.inputs[1]) not in (np.dtype(np.int64), np.dtype(np.int32))
                    or idx_shape is None or len(idx_shape) != 2
                    or not (dims_equal(idx_shape[0], batch) and dims_equal(idx_shape[1], seq))):
                return Refuse("a run-time index is not an integer tensor of the input's [B, S]")
            runtime.append((gather, table))
            shape_reads += readers
        if not 1 <= len(runtime) <= 2:
            return Refuse(f"{len(runtime)} run-time lookups (the op takes words and at most token types)")
        sources = [_ids_source(graph, g.inputs[1]) for g, _ in runtime]  # each proved [B, S] above
        for _, ends, ids in positions:
            if ids is not None:
                if not any(ids is t for t in sources):
                    return Refuse("a position arange is not of a looked-up index's length")
            elif not _is_sequence_length(graph, ends, runtime[0][0], seq):
                return Refuse("a position Slice does not end at the word ids' sequence length")
        rows = _static_rows(positions, constant_rows, seq, hidden) if isinstance(seq, int) else \
            _dynamic_rows(positions, constant_rows, hidden)
        if isinstance(rows, Refuse):
            return rows
        problem = _float16_statistics_problem(runtime, rows)
        if problem:
            return problem
        epsilon = float(ln.attrs.get("epsilon", 1e-12 if skip else 1e-5))  # each op's own default
        return Plan(ln, (runtime, rows, gamma, beta, epsilon, adds, leaves, shape_reads))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        ln = plan.anchor
        runtime, rows, gamma, beta, epsilon, adds, leaves, shape_reads = plan.found
        names = NameAllocator(graph)
        base = ln.name or "embed"
        hidden = new_constant(graph, f"{base}/hidden", np.array([rows.shape[1]], np.int64)) if shape_reads else None
        for reader in shape_reads:  # Shape(Gather(T, idx)) = Concat(Shape(idx), [H]): the lookup goes away
            gather = producer_of(reader.inputs[0])
            index_shape = gs.Variable(names(f"{base}/index_shape"), dtype=np.int64, shape=[2])
            graph.nodes += [gs.Node("Shape", names(f"{base}/index_shape"), inputs=[gather.inputs[1]], outputs=[index_shape]),
                            gs.Node("Concat", names(f"{base}/lookup_shape"), {"axis": 0},
                                    inputs=[index_shape, hidden], outputs=list(reader.outputs))]
            reader.outputs.clear()
            reader.inputs.clear()

        def ids32(index):
            if dtype_of(graph, index) == np.dtype(np.int32):
                return index
            out = gs.Variable(names(f"{base}/ids_int32"), dtype=np.int32, shape=index.shape)
            graph.nodes.append(gs.Node("Cast", names(f"{base}/ids_cast"), {"to": 6}, inputs=[index], outputs=[out]))
            return out

        (words, word_table), *segment = runtime
        empty = gs.Variable.empty()
        inputs = [ids32(words.inputs[1]), ids32(segment[0][0].inputs[1]) if segment else empty,
                  words.inputs[0], new_constant(graph, f"{base}/position_table", rows.astype(word_table.dtype)),
                  segment[0][0].inputs[0] if segment else empty,
                  new_constant(graph, f"{base}/gamma", gamma.astype(word_table.dtype)),
                  new_constant(graph, f"{base}/beta", beta.astype(word_table.dtype))]
        out = ln.outputs[0]
        mask_index = gs.Variable(names(f"{base}/mask_index"), dtype=np.int32)
        lookups = [producer_of(leaf) for leaf in leaves if is_op(producer_of(leaf), "Gather")]  # not folded rows
        for n in adds + lookups + [ln]:
            n.outputs.clear()
            n.inputs.clear()
        graph.nodes.append(gs.Node("EmbedLayerNormalization", names(f"{base}/EmbedLayerNormalization"),
                                   {"epsilon": epsilon}, inputs=inputs, outputs=[out, mask_index],
                                   domain="com.microsoft"))
        return {"node": ln.name, "segment": bool(segment), "constant_rows": list(rows.shape)}
