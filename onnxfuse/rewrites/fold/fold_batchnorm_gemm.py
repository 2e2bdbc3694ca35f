"""fold-batchnorm-gemm: an inference BatchNormalization folded into the Gemm (or 2-D MatMul) before it.

    Gemm:           Y = α·A'·B' + β_g·C  →  B'' = B'·diag(s) (columns of B, rows when transB=1),
                    C' = β_g·C·s + t (C broadcast with the channel vector; C = 0 when absent), β_g' = 1
    MatMul:         A·B with A of rank 2 and B a constant (K, N): rewritten to Gemm(A, B·diag(s), t)
                    with α = β_g = 1, which is A·B'' + t by definition of Gemm — one node and exactly the
                    folded formula. When A's rank is not 2, BatchNormalization's channel axis (1) is not
                    MatMul's feature axis (the last), so the fold is refused.

The rest of the maths, the refusals and the copy-on-write of shared weights:
:mod:`onnxfuse.rewrites.fold.batchnorm`.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import set_param
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import constant_value, declared_shape, producer_of
from onnxfuse.rewrites.fold.affine import cast_back, f64, float_dtype_problem, plan_affine
from onnxfuse.rewrites.fold.batchnorm import FoldBatchNorm


class _MatMulPlan:
    """Replace a 2-D MatMul by Gemm(A, B·diag(s), t): computed by check, written by apply."""

    def __init__(self, matmul, new_b, new_c):
        self.node = matmul
        self.new_b = new_b
        self.new_c = new_c

    def apply(self, graph):
        mm = self.node
        a, b, out = mm.inputs[0], mm.inputs[1], mm.outputs[0]
        mm.inputs.clear()
        mm.outputs.clear()
        gemm = gs.Node("Gemm", name=mm.name, attrs={"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0},
                       inputs=[a, b], outputs=[out])
        graph.nodes.append(gemm)
        self.node = gemm
        return {"B": set_param(graph, gemm, 1, self.new_b, role="B"),
                "C": set_param(graph, gemm, 2, self.new_c, role="C")}


def rank_of_input(tensor):
    """The rank of a MatMul input: declared, or 2 after a Flatten or Gemm."""
    shape = declared_shape(tensor)
    if shape is not None:
        return len(shape)
    p = producer_of(tensor)
    if p is not None and p.op in ("Flatten", "Gemm"):
        return 2
    return None


class FoldBatchNormIntoGemm(FoldBatchNorm):
    name = "fold-batchnorm-gemm"
    description = "Fold an inference BatchNormalization into the Gemm (or 2-D MatMul with constant weight) before it"
    producers = ("Gemm", "MatMul")

    def plan_fold(self, graph, p, scale, shift):
        if p.op == "Gemm":
            return plan_affine(graph, p, scale, shift)
        if len(p.inputs) != 2:
            return Refuse("MatMul has an unexpected number of inputs")
        w = constant_value(graph, p.inputs[1])
        if w is None:
            return Refuse(f"MatMul weight {p.inputs[1].name!r} is not a constant")
        if w.ndim != 2:
            return Refuse(f"MatMul weight has rank {w.ndim}; only a constant 2-D weight is folded")
        problem = float_dtype_problem(("MatMul weight", w.dtype))
        if problem:
            return problem
        rank = rank_of_input(p.inputs[0])
        if rank is None:
            return Refuse("MatMul input rank is unknown; BatchNormalization's channel axis may not be the feature axis")
        if rank != 2:
            return Refuse(f"MatMul input has rank {rank}: BatchNormalization normalizes axis 1, "
                          f"not MatMul's feature axis (the last)")
        channels = int(w.shape[1])
        if scale.shape != (channels,):
            return Refuse(f"BatchNormalization has {scale.size} channels but MatMul produces {channels}")
        new_b = cast_back(f64(w) * scale.reshape(1, channels), w.dtype)
        new_c = cast_back(shift, w.dtype)
        if new_b is None or new_c is None:
            return Refuse(f"folded MatMul weight or bias overflows {w.dtype.name}")
        return _MatMulPlan(p, new_b, new_c)
