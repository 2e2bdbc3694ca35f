"""contrib-rmsnorm: a decomposed RMSNorm without a residual Add → ONNX RMSNormalization (opset 23).

``contrib-rmsnorm`` (the maths, the accepted forms and the conditions:
:mod:`onnxfuse.rewrites.contrib.rmsnorm_pattern`) writes::

    y = RMSNormalization(x, γ, axis=-1, epsilon=ε, stash_type=1)      (default-domain opset 23)

i.e. x / √(mean(x²) + ε) · γ with float32 statistics, cast back to x's type once. Which op, and why:

* ``RMSNormalization`` is ONNX's own op from opset 23: ``onnx.checker`` accepts it, ONNX Runtime runs
  it on the CPU (float, double, float16) and on CUDA (float, double, float16, bfloat16:
  ``core/providers/cuda/nn/rms_norm.cc`` registers it for opset 23 and runs ONNX Runtime's LayerNorm
  kernel in its simplified form, statistics in float; onnxruntime-gpu 1.31.1's CUDA provider library
  carries that kernel's messages). Below opset 23 the rule raises the model's opset when that changes
  no node's meaning (:mod:`onnxfuse.rewrites.engine.opset`), and refuses, naming the ops, otherwise.
  Exports below 18 keep ``ReduceMean``'s axes as an attribute (changed at 18) and torch writes
  ``Cast`` (an attribute added at 19): such models stay as they are. Every RMSNorm's own ReduceMean
  goes with it, so the ReduceMeans of all the RMSNorms this rule takes (each passing every other check)
  block no raise together: Qwen3's per-head q and k norms beside the layer norms, where each one alone
  would be blocked by the others' ReduceMeans.
* ``SimplifiedLayerNormalization`` (what ONNX Runtime's own SimplifiedLayerNormFusion and
  onnxruntime-genai's builder write) exists only in the ONNX domain, where ``onnx.checker`` has no
  schema for it: a model the checker accepted would be refused after the rewrite. It is written only
  into a model that already holds ONNX Runtime's ONNX-domain ops (:data:`onnxfuse.repair.ORT_ONNX_DOMAIN_OPS`,
  an onnxruntime-genai model, say), which fails the checker that way already and is checked as ONNX
  Runtime reads it. ``com.microsoft.SimplifiedLayerNormalization`` is no registered ONNX Runtime op.
* Otherwise refused with the reason; a residual RMSNorm is contrib-skip-rmsnorm's (it runs first).

Exactness: float32 statistics, as the float32 island of Hugging Face's exports; against a float32
decomposed form, float32 rounding only (relative ~1e-6); a float16 output is rounded once, γ applied in
float32 before that rounding (≤ 2⁻¹¹ relative where the original rounded before γ).
"""

from __future__ import annotations

import onnx

from onnxfuse.repair import ORT_ONNX_DOMAIN_OPS
from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.contrib.rmsnorm_pattern import RMS_DTYPES, match_rmsnorm, rms_candidate, rmsnorm_gamma
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.opset import opset_raise_problem, raise_opset
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import graphs_within, is_default_domain, opset_of

#: Default-domain opset that introduced RMSNormalization.
RMSNORM_OPSET = 23


def ort_domain_ops_present(graph) -> bool:
    """The graph already holds ONNX Runtime's own ONNX-domain ops (no ONNX schema at its opset)."""
    opset = opset_of(graph, default=0)
    for g in graphs_within(graph):
        for n in g.nodes:
            span = ORT_ONNX_DOMAIN_OPS.get(n.op)
            if span is None or not is_default_domain(n):
                continue
            first, last = span
            if first <= opset and (last is None or opset <= last):
                try:
                    onnx.defs.get_schema(n.op, opset, "")
                except onnx.defs.SchemaError:
                    return True
    return False


def _fusable(graph, node):
    """``(match, γ)`` or a ``Refuse``: the RMSNorm anchored at ``node`` as this rule takes it, every check but the
    opset's."""
    m = match_rmsnorm(graph, node)
    if isinstance(m, Refuse):
        return m
    problem = dtype_problem(m.dtype, RMS_DTYPES, "RMSNormalization input")
    if problem:
        return problem
    gamma = rmsnorm_gamma(graph, m)
    if isinstance(gamma, Refuse):
        return gamma
    return (m, gamma)


def _fused_nodes(graph, node) -> list:
    """The nodes the RMSNorm anchored at ``node`` replaces when this rule takes it, else []."""
    found = _fusable(graph, node)
    return [] if isinstance(found, Refuse) else found[0].nodes


class ContribRmsNorm(ContribRule):
    name = "contrib-rmsnorm"
    description = "decomposed Pow/ReduceMean/Sqrt/…(/Mul γ) RMSNorm → RMSNormalization (raises opset to 23)"

    def match(self, graph):
        return [n for n in graph.nodes if rms_candidate(n)]

    def analyze(self, graph, node):
        found = _fusable(graph, node)
        if isinstance(found, Refuse):
            return found
        m, gamma = found
        # the pattern's own nodes go (its ReduceMean's axes attribute would otherwise block 14/17 → 23);
        # a leading Cast the residual stream still reads stays, and Cast's meaning is unchanged up to 23
        replaced = [n for n in m.nodes if n.op != "Cast"]
        raise_problem = opset_raise_problem(graph, RMSNORM_OPSET, replaced=replaced)
        if raise_problem is not None:
            # Several RMSNorms (Qwen3's per-head q/k norms beside the layer norms): each one's ReduceMean
            # blocks the raise for the others. Every one this rule takes goes in this same pass (the first
            # rewrite raises the opset, the rest then need no raise), so together they block nothing.
            # Only those that pass every other check here are counted: one refused would keep its
            # ReduceMean, whose axes attribute the raised opset would misread.
            replaced += [n for other in graph.nodes if other is not node and rms_candidate(other)
                         for n in _fused_nodes(graph, other) if n.op != "Cast"]
            raise_problem = opset_raise_problem(graph, RMSNORM_OPSET, replaced=replaced)
        if raise_problem is None:
            op = "RMSNormalization"
        elif ort_domain_ops_present(graph):
            op = "SimplifiedLayerNormalization"
        else:
            return Refuse(f"ONNX RMSNormalization needs opset {RMSNORM_OPSET}, and {raise_problem.reason}; "
                          "SimplifiedLayerNormalization would fail onnx.checker (ONNX domain, no schema)")
        return (m, gamma, op)

    def apply(self, graph, node, plan):
        m, gamma, op = plan
        if op == "RMSNormalization":
            raise_opset(graph, RMSNORM_OPSET)
        fuse(graph, m.nodes, op, [m.x, gamma], m.root.outputs[0],
             attrs={"axis": -1, "epsilon": m.eps, "stash_type": 1}, domain="",
             name=f"{m.root.name}/RMSNorm" if m.root.name else None)
        return {"op": op, "input": m.x.name, "epsilon": m.eps, "replaced": len(m.nodes)}
