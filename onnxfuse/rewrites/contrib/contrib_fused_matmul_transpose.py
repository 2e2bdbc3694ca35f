"""contrib-fused-matmul-transpose: Transpose of the last two axes feeding a MatMul →
com.microsoft FusedMatMul(transA/transB).

``contrib-fused-matmul-transpose`` (matmul_transpose_fusion.cc): a Transpose whose perm swaps exactly
the last two axes (identity elsewhere; rank ≥ 2) feeding input A or B sets transA / transB
(``A·Bᵀ`` with B = Transpose(K) becomes FusedMatMul(A, K, transB=1)). The Transpose may have other
readers; its output must not be a graph output.

FusedMatMul and the element types: :mod:`onnxfuse.rewrites.contrib.matmul`.
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.contrib.matmul import MATMUL_DTYPES, is_matmul, matmul_attrs
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import first_known_dtype, int_attr, is_graph_output, is_op, producer_of, rank_of


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
        return [n for n in graph.nodes if is_matmul(n)]

    def analyze(self, graph, node):
        if len(node.inputs) != 2 or len(node.outputs) != 1:
            return Refuse("MatMul has an unexpected number of inputs or outputs")
        if node.op == "FusedMatMul" and (int_attr(node, "transBatchA", 0) or int_attr(node, "transBatchB", 0)):
            return Refuse("FusedMatMul already transposes batch axes")
        new_inputs = list(node.inputs)
        flips = [False, False]
        for i, t in enumerate(node.inputs):
            p = producer_of(t)
            if is_op(p, "Transpose") and len(p.inputs) == 1 and not is_graph_output(graph, t) and _swap_last_two(graph, p):
                new_inputs[i] = p.inputs[0]
                flips[i] = True
        if not any(flips):
            return Refuse("no Transpose of the last two axes feeds the MatMul")
        dtype = first_known_dtype(graph, node.inputs[0], node.inputs[1], new_inputs[0], new_inputs[1], node.outputs[0])
        problem = dtype_problem(dtype, MATMUL_DTYPES, "FusedMatMul input")
        if problem:
            return problem
        return (new_inputs, flips)

    def apply(self, graph, node, plan):
        new_inputs, flips = plan
        attrs = matmul_attrs(node)
        attrs["transA"] = int(bool(int_attr(node, "transA", 0)) ^ flips[0])
        attrs["transB"] = int(bool(int_attr(node, "transB", 0)) ^ flips[1])
        attrs.setdefault("alpha", 1.0)
        fuse(graph, [node], "FusedMatMul", new_inputs, node.outputs[0], attrs=attrs,
             name=f"{node.name}/FusedMatMul" if node.name and node.op == "MatMul" else node.name or None)
        return {"op": "com.microsoft.FusedMatMul", "transA": attrs["transA"], "transB": attrs["transB"]}
