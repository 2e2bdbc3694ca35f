"""MatMul with scales / transposes → com.microsoft FusedMatMul; Add + Softmax → com.microsoft BiasSoftmax.

**FusedMatMul** computes ``Y = alpha · op(A) · op(B)`` where ``op`` transposes the last two axes when
``transA`` / ``transB`` is set (batch axes broadcast as in MatMul).

* ``contrib-fused-matmul-scale`` (matmul_scale_fusion.cc): ``MatMul(s·A, B)``, ``MatMul(A/s, B)``,
  ``MatMul(A, B)·s`` and ``MatMul(A, B)/s`` with s a size-1 float constant fold into alpha (products of all
  of them: ``(s₁A)(s₂B)·s₃ = s₁s₂s₃·AB``). A scaled input may have other readers (the Mul stays for
  them); a scaled output must be read by the Mul/Div only and not be a graph output. A rank>0 constant
  must not broadcast its partner to a higher rank. Also applies to an existing FusedMatMul (alpha
  multiplies).
* ``contrib-fused-matmul-transpose`` (matmul_transpose_fusion.cc): a Transpose whose perm swaps exactly
  the last two axes (identity elsewhere; rank ≥ 2) feeding input A or B sets transA / transB
  (``A·Bᵀ`` with B = Transpose(K) becomes FusedMatMul(A, K, transB=1)). The Transpose may have other
  readers; its output must not be a graph output.

Element types float16/float/double (FusedMatMul's CUDA kernel; bfloat16 has no numpy dtype here).

**BiasSoftmax** (bias_softmax_fusion.cc) computes ``softmax(x + bias)`` along ``axis`` with the bias
broadcast in one of two simple ways: ``is_inner_broadcast=1`` — bias shape = x's with ones on the axes
*between* the batch prefix and the softmax axis (BERT's ``[B,1,1,S]`` mask on ``[B,H,S,S]`` scores);
``is_inner_broadcast=0`` — bias shape = x's trailing axes with ones (or nothing) in front. Both shapes
must be known (dims equal as numbers or the same named dim-param), the Add read only by the Softmax,
and the Softmax over the last axis (since opset 13 that is the only axis where BiasSoftmax's
coerce-to-2-D semantics agree with Softmax).
ONNX Runtime 1.31 has **no CPU kernel** for BiasSoftmax (CUDA/ROCm only): a model rewritten by
``contrib-bias-softmax`` runs on the CUDA provider only. That is why the rule is *not* in the default
registry; it is importable for an explicit, CUDA-only pool (tests check its structure only).
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites._contrib import (
    FP16,
    FP32,
    FP64,
    ContribRule,
    dims_equal,
    dtype_problem,
    first_known_dtype,
    fuse,
    int_attr,
    is_ms_op,
    is_op,
    only_read_by,
    rank_of,
    scalar_constant,
    scalar_rank_problem,
    shape_of,
)
from onnxfuse.rewrites._contrib import consumers as _consumers
from onnxfuse.rewrites._weights import is_graph_output, producer_of

MATMUL_DTYPES = (FP16, FP32, FP64)


def _scale_of(graph, node, operand):
    """``(factor, source)`` when ``node`` is ``operand·s``, ``s·operand`` or ``operand/s``; else ``None``.

    ``operand`` is the tensor on the MatMul side (None = find it: the non-constant input).
    """
    if not is_op(node, "Mul", "Div") or len(node.inputs) != 2 or len(node.outputs) != 1:
        return None
    if node.op == "Div":
        s = scalar_constant(graph, node.inputs[1])
        if s is None or float(s.reshape(())) == 0.0 or scalar_constant(graph, node.inputs[0]) is not None:
            return None
        return 1.0 / float(s.reshape(())), node.inputs[0], s
    for j in (1, 0):
        s = scalar_constant(graph, node.inputs[j])
        if s is not None and scalar_constant(graph, node.inputs[1 - j]) is None:
            return float(s.reshape(())), node.inputs[1 - j], s
    return None


def _matmul_attrs(node):
    if node.op == "MatMul":
        return {}
    return dict(node.attrs)


def _is_matmul(node):
    return is_op(node, "MatMul") or is_ms_op(node, "FusedMatMul")


def _dtype(graph, node, extra=()):
    return first_known_dtype(graph, *extra, *node.inputs, *node.outputs)


class ContribFusedMatMulScale(ContribRule):
    name = "contrib-fused-matmul-scale"
    description = "MatMul with a constant scalar Mul/Div on an input or the output → com.microsoft FusedMatMul(alpha)"

    def match(self, graph):
        return [n for n in graph.nodes if _is_matmul(n)]

    def analyze(self, graph, node):
        if len(node.inputs) != 2 or len(node.outputs) != 1:
            return "MatMul has an unexpected number of inputs or outputs", None
        alpha = float(node.attrs.get("alpha", 1.0)) if node.op == "FusedMatMul" else 1.0
        new_inputs = list(node.inputs)
        consts = []
        merged_in = []
        for i, t in enumerate(node.inputs):
            p = producer_of(t)
            sc = _scale_of(graph, p, t) if p is not None else None
            if sc is None:
                continue
            factor, source, s = sc
            if scalar_rank_problem(graph, s, source) or rank_of(graph, source) == 0:
                continue
            alpha *= factor
            new_inputs[i] = source
            consts.append(s)
            merged_in.append(p)
        out = node.outputs[0]
        out_node = None
        readers = _consumers(out)
        if len(readers) == 1 and not is_graph_output(graph, out):
            sc = _scale_of(graph, readers[0], out)
            if sc is not None and sc[1] is out and not scalar_rank_problem(graph, sc[2], out):
                alpha *= sc[0]
                consts.append(sc[2])
                out_node = readers[0]
        if not merged_in and out_node is None:
            return "no constant scalar Mul/Div on the MatMul's inputs or output", None
        dtype = consts[0].dtype  # a Mul/Div constant has the data's element type
        problem = dtype_problem(dtype, MATMUL_DTYPES, "FusedMatMul input")
        if problem:
            return problem, None
        if not np.isfinite(np.float32(alpha)) or np.float32(alpha) == 0.0:
            return f"fused alpha {alpha} is not a finite non-zero float", None
        return None, (alpha, new_inputs, out_node, len(merged_in))

    def apply(self, graph, node, plan):
        alpha, new_inputs, out_node, n_in = plan
        attrs = _matmul_attrs(node)
        attrs["alpha"] = float(np.float32(alpha))
        out = out_node.outputs[0] if out_node is not None else node.outputs[0]
        nodes = [node] + ([out_node] if out_node is not None else [])
        fuse(graph, nodes, "FusedMatMul", new_inputs, out, attrs=attrs,
             name=f"{node.name}/FusedMatMul" if node.name and node.op == "MatMul" else node.name or None)
        return {"op": "com.microsoft.FusedMatMul", "alpha": attrs["alpha"], "scaled_inputs": n_in,
                "scaled_output": out_node is not None}


def _swap_last_two(graph, transpose):
    """True when ``transpose`` swaps exactly the last two axes of a rank ≥ 2 tensor."""
    perm = transpose.attrs.get("perm")
    if perm is None:
        return rank_of(graph, transpose.inputs[0]) == 2  # default perm reverses all axes
    perm = [int(p) for p in perm]
    r = len(perm)
    return r >= 2 and perm[: r - 2] == list(range(r - 2)) and perm[r - 2:] == [r - 1, r - 2]


class ContribFusedMatMulTranspose(ContribRule):
    name = "contrib-fused-matmul-transpose"
    description = "Transpose of the last two axes feeding a MatMul → com.microsoft FusedMatMul(transA/transB)"

    def match(self, graph):
        return [n for n in graph.nodes if _is_matmul(n)]

    def analyze(self, graph, node):
        if len(node.inputs) != 2 or len(node.outputs) != 1:
            return "MatMul has an unexpected number of inputs or outputs", None
        if node.op == "FusedMatMul" and (int_attr(node, "transBatchA", 0) or int_attr(node, "transBatchB", 0)):
            return "FusedMatMul already transposes batch axes", None
        new_inputs = list(node.inputs)
        flips = [False, False]
        for i, t in enumerate(node.inputs):
            p = producer_of(t)
            if is_op(p, "Transpose") and len(p.inputs) == 1 and not is_graph_output(graph, t) and _swap_last_two(graph, p):
                new_inputs[i] = p.inputs[0]
                flips[i] = True
        if not any(flips):
            return "no Transpose of the last two axes feeds the MatMul", None
        dtype = first_known_dtype(graph, node.inputs[0], node.inputs[1], new_inputs[0], new_inputs[1], node.outputs[0])
        problem = dtype_problem(dtype, MATMUL_DTYPES, "FusedMatMul input")
        if problem:
            return problem, None
        return None, (new_inputs, flips)

    def apply(self, graph, node, plan):
        new_inputs, flips = plan
        attrs = _matmul_attrs(node)
        attrs["transA"] = int(bool(int_attr(node, "transA", 0)) ^ flips[0])
        attrs["transB"] = int(bool(int_attr(node, "transB", 0)) ^ flips[1])
        attrs.setdefault("alpha", 1.0)
        fuse(graph, [node], "FusedMatMul", new_inputs, node.outputs[0], attrs=attrs,
             name=f"{node.name}/FusedMatMul" if node.name and node.op == "MatMul" else node.name or None)
        return {"op": "com.microsoft.FusedMatMul", "transA": attrs["transA"], "transB": attrs["transB"]}


def _broadcast_plan(graph, add, softmax):
    """``(reason, (input, bias, axis, is_inner_broadcast))`` following bias_softmax_fusion.cc."""
    t1, t2 = add.inputs
    s1, s2 = shape_of(graph, t1), shape_of(graph, t2)
    if s1 is None or s2 is None or not s1 or not s2:
        return "shapes of the Add's inputs unknown (run shape inference first)", None
    n1, n2 = len(s1), len(s2)
    rank = max(n1, n2)
    opset = int(getattr(graph, "opset", 13) or 13)
    axis = int_attr(softmax, "axis", -1 if opset >= 13 else 1)
    axis = axis + rank if axis < 0 else axis
    if axis != rank - 1:
        return f"Softmax axis {axis} is not the last axis of the rank-{rank} input", None
    single = rank - axis
    if single > n1 or single > n2:
        return "an Add input has lower rank than the softmax's trailing axes", None
    for i in range(1, single + 1):
        if not dims_equal(s1[n1 - i], s2[n2 - i]):
            return f"Add inputs differ on the softmax axis ({s1} vs {s2})", None

    def one(d):
        return isinstance(d, (int, np.integer)) and int(d) == 1

    if n1 == n2:
        pos = 0
        while pos < axis and dims_equal(s1[pos], s2[pos]):
            pos += 1
        lhs_input = pos == axis or not one(s1[pos])
        inp, bias, sb = (t1, t2, s2) if lhs_input else (t2, t1, s1)
        if all(one(sb[i]) for i in range(pos, axis)):
            return None, (inp, bias, axis, 1)
    p1, p2 = n1 - single - 1, n2 - single - 1
    while p1 >= 0 and p2 >= 0 and dims_equal(s1[p1], s2[p2]):
        p1 -= 1
        p2 -= 1
    lhs_input = p1 > p2 or (p1 == p2 and (p1 < 0 or not one(s1[p1])))
    inp, bias, sb, pb = (t1, t2, s2, p2) if lhs_input else (t2, t1, s1, p1)
    if not all(one(sb[i]) for i in range(pb, -1, -1)):
        return f"bias of shape {sb} does not broadcast in a way BiasSoftmax supports", None
    return None, (inp, bias, axis, 0)


class ContribBiasSoftmax(ContribRule):
    """CUDA only: ONNX Runtime 1.31 has no CPU kernel for BiasSoftmax (see module docstring)."""

    name = "contrib-bias-softmax"
    description = "Add + Softmax(last axis) → com.microsoft BiasSoftmax (CUDA provider only: no CPU kernel)"

    def match(self, graph):
        return [n for n in graph.nodes if is_op(n, "Softmax")]

    def analyze(self, graph, node):
        add = producer_of(node.inputs[0])
        if not is_op(add, "Add") or len(add.inputs) != 2:
            return "Softmax input is not produced by an Add", None
        problem = only_read_by(graph, add.outputs[0], [node])
        if problem:
            return problem, None
        reason, plan = _broadcast_plan(graph, add, node)
        if reason:
            return reason, None
        problem = dtype_problem(first_known_dtype(graph, *add.inputs, node.outputs[0]), MATMUL_DTYPES,
                                "BiasSoftmax input")
        if problem:
            return problem, None
        return None, (add, *plan)

    def apply(self, graph, node, plan):
        add, inp, bias, axis, inner = plan
        fuse(graph, [add, node], "BiasSoftmax", [inp, bias], node.outputs[0],
             attrs={"axis": int(axis), "is_inner_broadcast": int(inner)},
             name=f"{node.name}/BiasSoftmax" if node.name else None)
        return {"op": "com.microsoft.BiasSoftmax", "axis": int(axis), "is_inner_broadcast": int(inner)}


RULES = [ContribFusedMatMulTranspose(), ContribFusedMatMulScale()]
