"""contrib-attention: scaled dot-product attention as exporters write it → com.microsoft MultiHeadAttention.

Anchor: a ``Softmax`` over the last axis of a rank-4 tensor. The rule walks back and forward from it
and accepts exactly this dataflow (every intermediate read only inside it)::

    q [B,S,E] ─ Reshape [·,·,H,D] ─ Transpose(0,2,1,3) ─ (×/÷ sq) ─┐
    k [B,L,E] ─ Reshape [·,·,H,D] ─ Transpose(0,2,3,1) ─ (×/÷ sk) ─ MatMul ─ (×/÷ s) ─ (+ M) ─ Softmax ─┐
                (or Transpose(0,2,1,3) then Transpose(0,1,3,2))                                          │
    v [B,L,E] ─ Reshape [·,·,H,D] ─ Transpose(0,2,1,3) ──────────────────────────────────────── MatMul ─ Transpose(0,2,1,3) ─ Reshape ─ out

and writes ``Reshape(MultiHeadAttention(q, k, v, bias, , attention_bias))`` with ``num_heads = H`` and
``scale = sq·sk·s`` (the scalar constants, each a Mul or a Div; none gives 1). The maths is the same
sum in the same order up to the point where ONNX Runtime's kernel fuses it: ``softmax(s·QKᵀ + M)·V``
per head; validation bounds the rounding difference like any contrib rule.

* **The merging Reshape stays**, now reading MultiHeadAttention's ``[B, S, E]``: row-major, that holds
  the same elements in the same order as the ``[B, S, H, D]`` it read, so its result is unchanged
  whatever its target (a target computed from shapes included) and nothing about it must be proved.
* **Heads** H and head size D come from the Reshape targets (constants after fold-constants and
  constant-reshape-target): the last two entries, positive and equal for q and k (v: same H and D).
  E = H·D must be q's, k's and v's static last dimension. Never a model type, never a head count asked.
* **Projection biases**: when q, k and v are each ``Add(MatMul(·), b)`` with ``b`` a 1-D constant of E
  values, the three biases become MultiHeadAttention's ``bias`` input ([3E]) and the kernel adds them
  (one pass fewer per projection). Otherwise q, k and v are taken as they are.
* **Mask** M (the Add's other operand), however it was built (``(1 - mask)·c``, ``Where(…, 0, min)``,
  a constant causal triangle): any tensor that broadcasts against the scores ``[B,H,S,L]`` (the
  original model could not run otherwise). MultiHeadAttention wants ``attention_bias`` shaped
  ``[B or 1, H or 1, S, L]``, so M is unsqueezed to rank 4 and, unless its last two dimensions are
  provably S and L, expanded with ``Expand(M, [1, 1, S, L])`` (S and L read from q and k at run time).
  Expand is exact: it copies values, and M's dimensions 2 and 3 can only be 1 or S and L.
* **Refused**, with the reason: a Softmax not on the last axis or of unknown rank; any piece of the
  pattern missing or shaped otherwise (a Transpose with another perm, a Reshape target that is not
  constant or not [·,·,H,D]); an intermediate read
  outside the pattern or a graph output; element types other than float32/float16 or mixed; a mask of
  another element type or rank above 4; a scale that is not a finite non-zero scalar.

Why MultiHeadAttention and not Attention (which also packs the Q/K/V projections into one GEMM): it
takes the projections as they are, whatever the exporter did with them (separate MatMuls, a shared
input or not, cross-attention where q and k/v come from different tensors), and it runs on the CPU too,
so validation needs no GPU.

**Opt-in** (``--only contrib-attention,...``) until it is measured on a GPU: it was written in a
session with no GPU lent, validated on the CPU only (tests/rewrites/test_contrib_attention.py, BERT
and synthetic patterns). The rule's speed against ONNX Runtime's own kernels, fp32 and fp16, at batch
1 and 16, and the choice between MultiHeadAttention and the packed ``Attention`` op, are for the
next GPU session (issue 15); until then the default output stays the one measured in
docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.facts import (
    constant_value,
    consumers,
    dtype_of,
    internal_problem,
    is_op,
    producer_of,
    scalar_constant,
    shape_of,
)
from onnxfuse.rewrites.engine.rule import Refuse, Rule

DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
#: perm of the Transpose that splits heads: [B, S, H, D] → [B, H, S, D]
HEADS = [0, 2, 1, 3]
#: perm that gives Kᵀ in one step: [B, L, H, D] → [B, H, D, L]
HEADS_T = [0, 2, 3, 1]
SWAP_LAST = [0, 1, 3, 2]


@dataclass
class _Head:
    """One of q/k/v split into heads: the tensor before the split, its H and D, the split's nodes."""

    source: gs.Tensor
    heads: int
    size: int
    nodes: list


@dataclass
class AttentionPlan:
    softmax: gs.Node
    nodes: list  # every node the MultiHeadAttention replaces
    q: gs.Tensor
    k: gs.Tensor
    v: gs.Tensor
    heads: int
    scale: float
    mask: gs.Tensor | None
    mask_rank: int
    mask_tail_known: bool  # M's last two dims are provably S and L
    biases: tuple | None  # (q source, k source, v source, [3E] bias values) when the biases fold in
    merge: gs.Node  # the Reshape that merged the heads: it now reads MultiHeadAttention's [B, S, E]
    dtype: np.dtype


def _perm(node) -> list[int] | None:
    return list(node.attrs.get("perm", [])) if is_op(node, "Transpose") else None


def _scalar_factor(graph, node, operand) -> tuple[float, gs.Tensor] | None:
    """(factor, other input) when ``node`` is Mul/Div of ``operand``'s partner by a scalar constant, i.e.
    node = x·c or x/c with x the non-constant input."""
    if not (is_op(node, "Mul") or is_op(node, "Div")) or len(node.inputs) != 2:
        return None
    x, c = node.inputs
    value = scalar_constant(graph, c)
    if value is None and is_op(node, "Mul"):
        x, c = c, x
        value = scalar_constant(graph, c)
    if value is None:
        return None
    f = float(np.asarray(value, dtype=np.float64).reshape(()))
    if not np.isfinite(f) or f == 0.0:
        return None
    return (f if is_op(node, "Mul") else 1.0 / f), x


def _strip_scale(graph, tensor, nodes, factors):
    """Follow Mul/Div-by-scalar producers back from ``tensor``; collects their nodes and factors."""
    while True:
        p = producer_of(tensor)
        found = _scalar_factor(graph, p, tensor) if p is not None else None
        if found is None:
            return tensor
        factors.append(found[0])
        nodes.append(p)
        tensor = found[1]


def _split_heads(graph, tensor, transposed: bool) -> _Head | str:
    """``tensor`` = Transpose(Reshape(source, [·,·,H,D])) with the heads perm (Kᵀ's perm when
    ``transposed``); also Kᵀ written as heads-Transpose then a swap of the last two axes."""
    nodes = []
    t = producer_of(tensor)
    perm = _perm(t) if t is not None else None
    if transposed and perm == SWAP_LAST:
        nodes.append(t)
        inner = producer_of(t.inputs[0])
        if inner is None or _perm(inner) != HEADS:
            return "Kᵀ is not a Transpose of the split heads"
        t, perm = inner, HEADS_T
    if t is None or perm != (HEADS_T if transposed else HEADS):
        return f"expected a Transpose(perm={HEADS_T if transposed else HEADS}) splitting heads"
    nodes.append(t)
    r = producer_of(t.inputs[0])
    if r is None or not is_op(r, "Reshape") or len(r.inputs) != 2 or int(r.attrs.get("allowzero", 0)):
        return "heads are not split by a Reshape"
    target = constant_value(graph, r.inputs[1])
    if target is None or target.ndim != 1 or target.size != 4:
        return "the head-splitting Reshape's target is not a constant [·, ·, H, D]"
    source = r.inputs[0]
    shape = shape_of(graph, source)
    if shape is None or len(shape) != 3 or not isinstance(shape[2], int):
        return f"{source.name!r} is not [batch, sequence, hidden] with a static hidden size"
    hidden = shape[2]
    heads, size = int(target[2]), int(target[3])
    if heads == -1 and size > 0 and hidden % size == 0:  # [·, ·, -1, D]: H inferred
        heads = hidden // size
    elif size == -1 and heads > 0 and hidden % heads == 0:  # [·, ·, H, -1]: D inferred
        size = hidden // heads
    if heads <= 0 or size <= 0 or heads * size != hidden:
        return f"the head-splitting Reshape's target {target.tolist()} does not split {hidden} into H x D"
    for i in (0, 1):  # 0 copies the dimension; a positive value must be the static one
        if target[i] not in (0,) and not (isinstance(shape[i], int) and shape[i] == target[i]):
            return "the head-splitting Reshape changes the batch or sequence dimension"
    nodes.append(r)
    return _Head(source, heads, size, nodes)


def _bias_of(graph, tensor):
    """(MatMul output, bias values) when ``tensor`` = Add(MatMul(...), b) with b a 1-D constant."""
    p = producer_of(tensor)
    if p is None or not is_op(p, "Add") or len(p.inputs) != 2:
        return None
    for x, b in (p.inputs, p.inputs[::-1]):
        value = constant_value(graph, b)
        mm = producer_of(x)
        if value is not None and value.ndim == 1 and mm is not None and is_op(mm, "MatMul"):
            return x, value, p
    return None


class ContribAttention(Rule):
    name = "contrib-attention"
    description = ("softmax(s·QKᵀ + mask)·V over Reshape/Transpose-split heads → com.microsoft "
                   "MultiHeadAttention (heads read from the graph)")
    targets = frozenset({"contrib", "cuda"})
    opt_in = True  # not yet measured on a GPU (see the module docstring)

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "Softmax")]

    def check(self, graph, softmax):
        found = self._analyze(graph, softmax)
        return Refuse(found) if isinstance(found, str) else found

    def _analyze(self, graph, softmax) -> AttentionPlan | str:
        if not softmax.outputs or len(softmax.inputs) != 1:
            return "Softmax already rewritten"
        scores_shape = shape_of(graph, softmax.inputs[0])
        if scores_shape is None or len(scores_shape) != 4:
            return "Softmax input is not known to be rank 4 [batch, heads, query, key]"
        if int(softmax.attrs.get("axis", -1)) not in (-1, 3):
            return "Softmax is not over the last axis"
        dtype = dtype_of(graph, softmax.inputs[0])
        if dtype not in DTYPES:
            return f"element type {dtype} (MultiHeadAttention: float32, float16)"
        nodes = [softmax]
        # after: MatMul(P, V_heads) → Transpose(0,2,1,3) → Reshape [B, S, E]
        readers = consumers(softmax.outputs[0])
        if len(readers) != 1 or not is_op(readers[0], "MatMul") or readers[0].inputs[0] is not softmax.outputs[0]:
            return "Softmax output is not read by exactly one MatMul (× V)"
        pv = readers[0]
        nodes.append(pv)
        v = _split_heads(graph, pv.inputs[1], transposed=False)
        if isinstance(v, str):
            return "V: " + v
        after = consumers(pv.outputs[0])
        if len(after) != 1 or _perm(after[0]) != HEADS:
            return "the attention output is not merged back by Transpose(perm=[0, 2, 1, 3])"
        merge_t = after[0]
        after = consumers(merge_t.outputs[0])
        if len(after) != 1 or not is_op(after[0], "Reshape") or after[0].inputs[0] is not merge_t.outputs[0]:
            return "the attention output is not merged back by a Reshape"
        merge_r = after[0]
        nodes.append(merge_t)
        # before: (+ M) ← (×/÷ s) ← MatMul(Q_heads, Kᵀ)
        x = softmax.inputs[0]
        mask = None
        factors: list[float] = []
        p = producer_of(x)
        if p is not None and is_op(p, "Add") and len(p.inputs) == 2:
            for a, b in (p.inputs, p.inputs[::-1]):
                stripped_nodes: list = []
                inner = _strip_scale(graph, a, stripped_nodes, [])
                q_mm = producer_of(inner)
                if q_mm is not None and is_op(q_mm, "MatMul"):
                    mask, x = b, a
                    nodes.append(p)
                    break
            else:
                return "the Softmax input is an Add with no Q·Kᵀ MatMul behind it"
        x = _strip_scale(graph, x, nodes, factors)
        qk = producer_of(x)
        if qk is None or not is_op(qk, "MatMul") or len(qk.inputs) != 2:
            return "no Q·Kᵀ MatMul before the Softmax"
        nodes.append(qk)
        qt = _strip_scale(graph, qk.inputs[0], nodes, factors)
        kt = _strip_scale(graph, qk.inputs[1], nodes, factors)
        q = _split_heads(graph, qt, transposed=False)
        if isinstance(q, str):
            return "Q: " + q
        k = _split_heads(graph, kt, transposed=True)
        if isinstance(k, str):
            return "K: " + k
        if not (q.heads == k.heads == v.heads and q.size == k.size == v.size):
            return f"Q, K and V split into different heads ({q.heads}x{q.size}, {k.heads}x{k.size}, {v.heads}x{v.size})"
        nodes += q.nodes + k.nodes + v.nodes
        types = {dtype_of(graph, t) for t in (q.source, k.source, v.source)}
        if types != {dtype}:
            return "Q, K, V and the scores have different element types"
        q_shape = shape_of(graph, q.source)
        problem = internal_problem(graph, nodes + [merge_r], merge_r)
        if problem:
            return problem
        mask_rank, tail_known = 0, False
        if mask is not None:
            if dtype_of(graph, mask) != dtype:
                return "the mask's element type differs from the scores'"
            m_shape = shape_of(graph, mask)
            if m_shape is None or len(m_shape) > 4:
                return "the mask's rank is unknown or above 4"
            mask_rank = len(m_shape)
            k_shape = shape_of(graph, k.source)
            tail = [1] * (2 - mask_rank) + list(m_shape[-2:]) if mask_rank < 2 else list(m_shape[-2:])
            tail_known = mask_rank >= 2 and _same_dim(tail[0], q_shape[1]) and _same_dim(tail[1], k_shape[1])
        scale = float(np.prod(factors)) if factors else 1.0
        biases = None
        found = [_bias_of(graph, t) for t in (q.source, k.source, v.source)]
        if all(f is not None and f[1].shape == (q.heads * q.size,) for f in found) and \
                all(len(consumers(t)) == 1 for t in (q.source, k.source, v.source)):
            biases = (found[0][0], found[1][0], found[2][0],
                      np.concatenate([f[1] for f in found]).astype(dtype, copy=False), [f[2] for f in found])
        return AttentionPlan(softmax, nodes, q.source, k.source, v.source, q.heads, scale, mask, mask_rank,
                             tail_known, biases, merge_r, dtype)

    def rewrite(self, graph, plan: AttentionPlan):
        names = NameAllocator(graph)
        base = plan.softmax.name or "attention"
        inputs = [plan.q, plan.k, plan.v]
        bias_input = gs.Variable.empty()
        if plan.biases is not None:
            q_mm, k_mm, v_mm, values, adds = plan.biases
            inputs = [q_mm, k_mm, v_mm]
            bias_input = new_constant(graph, f"{base}/qkv_bias", values)
            for add in adds:
                add.outputs.clear()
                add.inputs.clear()
        attention_bias = gs.Variable.empty()
        if plan.mask is not None:
            attention_bias = self._attention_bias(graph, plan, names, base, inputs[0], inputs[1])
        for n in plan.nodes:
            n.outputs.clear()
            n.inputs.clear()
        attrs = {"num_heads": plan.heads, "scale": plan.scale}
        inputs += [bias_input, gs.Variable.empty(), attention_bias]
        while inputs and inputs[-1].is_empty():  # optional inputs left out at the end
            inputs.pop()
        # The Reshape that merged [B, S, H, D] stays: row-major [B, S, E] holds the same elements in the
        # same order, so it gives the same result from MultiHeadAttention's output.
        out = gs.Variable(names(f"{base}/attention_output"), dtype=plan.dtype)
        graph.nodes.append(gs.Node("MultiHeadAttention", names(f"{base}/MultiHeadAttention"), attrs,
                                   inputs=inputs, outputs=[out], domain="com.microsoft"))
        plan.merge.inputs[0] = out
        return {"op": "com.microsoft.MultiHeadAttention", "num_heads": plan.heads, "scale": plan.scale,
                "mask": plan.mask is not None, "qkv_bias": plan.biases is not None}

    def _attention_bias(self, graph, plan, names, base, query, key):
        """M as [·, ·, S, L]: unsqueezed to rank 4, expanded to S and L (read from ``query`` and ``key``,
        the tensors MultiHeadAttention gets) unless they are provably there."""
        mask = plan.mask
        if plan.mask_rank < 4:
            axes = new_constant(graph, f"{base}/mask_axes", np.arange(4 - plan.mask_rank, dtype=np.int64))
            out = gs.Variable(names(f"{base}/mask_rank4"), dtype=plan.dtype)
            graph.nodes.append(gs.Node("Unsqueeze", names(f"{base}/mask_unsqueeze"), inputs=[mask, axes], outputs=[out]))
            mask = out
        if plan.mask_tail_known:
            return mask
        dims = []
        for source, index in ((query, 1), (key, 1)):
            shape = gs.Variable(names(f"{base}/shape"), dtype=np.int64)
            graph.nodes.append(gs.Node("Shape", names(f"{base}/Shape"), inputs=[source], outputs=[shape]))
            dim = gs.Variable(names(f"{base}/dim"), dtype=np.int64)
            graph.nodes.append(gs.Node("Slice", names(f"{base}/Slice"), inputs=[
                shape, new_constant(graph, f"{base}/start", np.array([index], np.int64)),
                new_constant(graph, f"{base}/end", np.array([index + 1], np.int64))], outputs=[dim]))
            dims.append(dim)
        target = gs.Variable(names(f"{base}/bias_shape"), dtype=np.int64)
        graph.nodes.append(gs.Node("Concat", names(f"{base}/Concat"), {"axis": 0}, inputs=[
            new_constant(graph, f"{base}/ones", np.array([1, 1], np.int64)), *dims], outputs=[target]))
        out = gs.Variable(names(f"{base}/attention_bias"), dtype=plan.dtype)
        graph.nodes.append(gs.Node("Expand", names(f"{base}/mask_expand"), inputs=[mask, target], outputs=[out]))
        return out


def _same_dim(a, b) -> bool:
    """Two dimensions provably equal: the same static value or the same symbolic name."""
    return a is not None and b is not None and a == b and not (isinstance(a, int) and a < 0)
