"""contrib-fused-matmul-scale: MatMul with constant scales → com.microsoft FusedMatMul(alpha).

``contrib-fused-matmul-scale`` (matmul_scale_fusion.cc): ``MatMul(s·A, B)``, ``MatMul(A/s, B)``,
``MatMul(A, B)·s`` and ``MatMul(A, B)/s`` with s a size-1 float constant fold into alpha (products of all
of them: ``(s₁A)(s₂B)·s₃ = s₁s₂s₃·AB``). A scaled input may have other readers (the Mul stays for
them); a scaled output must be read by the Mul/Div only and not be a graph output. A rank>0 constant
must not broadcast its partner to a higher rank. Also applies to an existing FusedMatMul (alpha
multiplies).

FusedMatMul and the element types: :mod:`onnxfuse.rewrites.contrib.matmul`.
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem, scalar_rank_problem
from onnxfuse.rewrites.contrib.matmul import MATMUL_DTYPES, is_matmul, matmul_attrs, scale_of
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import consumers, is_graph_output, producer_of, rank_of


class ContribFusedMatMulScale(ContribRule):
    name = "contrib-fused-matmul-scale"
    description = "MatMul with a constant scalar Mul/Div on an input or the output → com.microsoft FusedMatMul(alpha)"

    def match(self, graph):
        return [n for n in graph.nodes if is_matmul(n)]

    def analyze(self, graph, node):
        if len(node.inputs) != 2 or len(node.outputs) != 1:
            return Refuse("MatMul has an unexpected number of inputs or outputs")
        alpha = float(node.attrs.get("alpha", 1.0)) if node.op == "FusedMatMul" else 1.0
        new_inputs = list(node.inputs)
        consts = []
        merged_in = []
        for i, t in enumerate(node.inputs):
            p = producer_of(t)
            sc = scale_of(graph, p, t) if p is not None else None
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
        readers = consumers(out)
        if len(readers) == 1 and not is_graph_output(graph, out):
            sc = scale_of(graph, readers[0], out)
            if sc is not None and sc[1] is out and not scalar_rank_problem(graph, sc[2], out):
                alpha *= sc[0]
                consts.append(sc[2])
                out_node = readers[0]
        if not merged_in and out_node is None:
            return Refuse("no constant scalar Mul/Div on the MatMul's inputs or output")
        dtype = consts[0].dtype  # a Mul/Div constant has the data's element type
        problem = dtype_problem(dtype, MATMUL_DTYPES, "FusedMatMul input")
        if problem:
            return problem
        if not np.isfinite(np.float32(alpha)) or np.float32(alpha) == 0.0:
            return Refuse(f"fused alpha {alpha} is not a finite non-zero float")
        return (alpha, new_inputs, out_node, len(merged_in))

    def apply(self, graph, node, plan):
        alpha, new_inputs, out_node, n_in = plan
        attrs = matmul_attrs(node)
        attrs["alpha"] = float(np.float32(alpha))
        out = out_node.outputs[0] if out_node is not None else node.outputs[0]
        nodes = [node] + ([out_node] if out_node is not None else [])
        fuse(graph, nodes, "FusedMatMul", new_inputs, out, attrs=attrs,
             name=f"{node.name}/FusedMatMul" if node.name and node.op == "MatMul" else node.name or None)
        return {"op": "com.microsoft.FusedMatMul", "alpha": attrs["alpha"], "scaled_inputs": n_in,
                "scaled_output": out_node is not None}
