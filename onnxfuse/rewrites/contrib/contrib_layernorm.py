"""contrib-layernorm: decomposed layer normalization → ONNX LayerNormalization.

``contrib-layernorm``: the remaining decomposed forms become ONNX ``LayerNormalization`` (axis = −k,
epsilon = ε, stash_type = 1, i.e. float32 statistics) — the op ONNX Runtime's own LayerNormFusion
emits. This needs default-domain opset ≥ 17: ONNX Runtime also registers the op in the ONNX domain for
opsets 1–16, but ``onnx.checker`` rejects it there, and ``com.microsoft.LayerNormalization`` is not a
registered op in ONNX Runtime 1.31. Below opset 17 the rule raises the model's opset to 17 when that
changes no node's meaning (:mod:`onnxfuse.rewrites.engine.opset`), and refuses, naming the ops, otherwise.
Leaving the decomposed form to ONNX Runtime's LayerNormFusion is not enough: in ConvNeXt its
transpose optimizer moves the channels-last Transpose into the pattern first, and the LayerNorm then
runs as ReduceMean + Sub + SimplifiedLayerNormalization (docs/benchmarks.md).

The maths, the accepted decomposed forms and the conditions: :mod:`onnxfuse.rewrites.contrib.layernorm_pattern`.
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.layernorm_pattern import layernorm_params, match_any_decomposed, mean_candidate
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.opset import opset_raise_problem, raise_opset
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import BF16, FP16, FP32, FP64

#: Default-domain opset that introduced LayerNormalization.
LAYERNORM_OPSET = 17


class ContribLayerNorm(ContribRule):
    name = "contrib-layernorm"
    description = "decomposed ReduceMean/Sub/Pow/…/Div(/Mul γ/Add β) → LayerNormalization (raises opset to 17)"

    def match(self, graph):
        return [n for n in graph.nodes if mean_candidate(n)]

    def analyze(self, graph, node):
        m = match_any_decomposed(graph, node)
        if isinstance(m, Refuse):
            return m
        problem = opset_raise_problem(graph, LAYERNORM_OPSET)
        if problem:
            return Refuse(f"ONNX LayerNormalization needs opset {LAYERNORM_OPSET}, and {problem.reason}")
        # bfloat16: ONNX Runtime's CUDA kernel takes it (its CPU kernel does not; a bfloat16 model is one for CUDA:
        # --precision bf16 validates there only, and the CPU provider runs no bfloat16 MatMul either)
        problem = dtype_problem(m.dtype, (FP16, FP32, FP64) + BF16, "LayerNormalization input")
        if problem:
            return problem
        params = layernorm_params(graph, m, m.dtype)
        if isinstance(params, Refuse):
            return params
        return (m, *params)

    def apply(self, graph, node, plan):
        m, gamma, beta = plan
        raise_opset(graph, LAYERNORM_OPSET)
        inputs = [m.x, gamma] + ([beta] if beta is not None else [])
        fuse(graph, m.nodes, "LayerNormalization", inputs, m.root.outputs[0],
             attrs={"axis": -m.k, "epsilon": m.eps, "stash_type": 1}, domain="",
             name=f"{m.root.name}/LayerNorm" if m.root.name else None)
        return {"op": "LayerNormalization", "input": m.x.name, "axis": -m.k, "epsilon": m.eps,
                "replaced": len(m.nodes)}
