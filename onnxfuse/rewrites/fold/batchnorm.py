"""Fold an inference-mode BatchNormalization into the Conv, ConvTranspose, Gemm or MatMul feeding it.

The fold family's shared part of fold-batchnorm-conv, fold-batchnorm-convtranspose and
fold-batchnorm-gemm (one file each): :func:`batchnorm_affine` and the :class:`FoldBatchNorm` base.

The maths. In inference, BatchNormalization is a per-channel affine map over axis 1:

    BN(y) = (y − μ)·γ/√(σ²+ε) + β = y·s + t,   s = γ/√(σ²+ε),   t = β − μ·s

and every producer below is linear in its weight, with a bias added per output channel, so the map
folds into the weight and bias (the formulas for each producer are in its rule's file: ``fold_batchnorm_conv.py``,
``fold_batchnorm_convtranspose.py``, ``fold_batchnorm_gemm.py`` for Gemm and MatMul).

All arithmetic is done in float64 and cast back once to the weight's dtype (so an fp16 model with fp32
BatchNorm statistics folds as exactly as fp16 allows); see :mod:`onnxfuse.rewrites.fold.affine`.

Refused, each with a reason: BatchNormalization in training mode (``training_mode=1``, ``is_test=0`` or
more than one output), ``spatial=0``, parameters or weights that are not constants, the intermediate
tensor read by another node or being a graph output, channel counts that disagree, non-float or
mismatched dtypes, σ²+ε ≤ 0, and results that overflow the weight dtype. A weight shared with another
node is folded into a copy: the other node keeps the original.
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.engine.edit import bypass
from onnxfuse.rewrites.engine.rule import Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, is_alive, is_default_domain, producer_of, sole_consumer_problem
from onnxfuse.rewrites.fold.affine import f64, float_dtype_problem, plan_affine

_BN_PARAMS = ("scale", "B", "mean", "var")


def batchnorm_affine(graph, bn):
    """``(scale, shift)`` for an inference BatchNormalization, ``BN(y) = y·scale + shift``; or a ``Refuse``."""
    if not is_default_domain(bn):
        return Refuse(f"BatchNormalization is in domain {bn.domain!r}")
    if len(bn.inputs) != 5:
        return Refuse(f"BatchNormalization has {len(bn.inputs)} inputs; expected 5")
    if int(bn.attrs.get("training_mode", 0)) != 0:
        return Refuse("BatchNormalization is in training mode (training_mode=1)")
    if "is_test" in bn.attrs and int(bn.attrs["is_test"]) == 0:
        return Refuse("BatchNormalization is in training mode (is_test=0)")
    outputs = [t for t in bn.outputs if not t.is_empty()]
    if len(outputs) != 1 or bn.outputs[0].is_empty():
        return Refuse(f"BatchNormalization has {len(outputs)} outputs (training statistics)")
    if int(bn.attrs.get("spatial", 1)) != 1:
        return Refuse("BatchNormalization has spatial=0 (per-element statistics)")
    values = {}
    for name, tensor in zip(_BN_PARAMS, bn.inputs[1:]):
        v = constant_value(graph, tensor)
        if v is None:
            return Refuse(f"BatchNormalization {name} {tensor.name!r} is not a constant")
        problem = float_dtype_problem((f"BatchNormalization {name}", v.dtype))
        if problem:
            return problem
        values[name] = v
    shapes = {v.shape for v in values.values()}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        return Refuse(f"BatchNormalization parameters have shapes {sorted(shapes)}; unknown channel count")
    denom = f64(values["var"]) + float(bn.attrs.get("epsilon", 1e-5))
    if not np.all(denom > 0):
        return Refuse("BatchNormalization has var + epsilon <= 0")
    scale = f64(values["scale"]) / np.sqrt(denom)
    shift = f64(values["B"]) - f64(values["mean"]) * scale
    return scale, shift


class FoldBatchNorm(Rule):
    """A BatchNormalization folded into its producer, one of ``producers``; the plan is computed by check."""

    producers: tuple[str, ...] = ()

    def match(self, graph):
        for node in graph.nodes:
            if node.op != "BatchNormalization" or not node.inputs:
                continue
            p = producer_of(node.inputs[0])
            if p is not None and p.op in self.producers and is_default_domain(p):
                yield node

    def check(self, graph, bn):
        x = bn.inputs[0]
        p = producer_of(x)
        if p is None or p.op not in self.producers or not is_alive(p):
            return Refuse("the input is no longer produced by " + "/".join(self.producers))
        problem = sole_consumer_problem(graph, x, bn)
        if problem:
            return problem
        affine = batchnorm_affine(graph, bn)
        if isinstance(affine, Refuse):
            return affine
        fold = self.plan_fold(graph, p, *affine)
        if isinstance(fold, Refuse):
            return fold
        return Plan(bn, fold)

    def plan_fold(self, graph, p, scale, shift):
        """A ``Refuse``, or a plan whose ``apply(graph)`` writes the folded parameters."""
        return plan_affine(graph, p, scale, shift)

    def rewrite(self, graph, plan: Plan):
        bn, fold = plan.anchor, plan.found
        modes = fold.apply(graph)
        producer = fold.node
        bypass(graph, producer, bn)
        detail = {"node": producer.name, "op": producer.op, "folded": bn.name}
        if "copy" in modes.values():
            detail["copied"] = sorted(k for k, v in modes.items() if v == "copy")
        return detail
