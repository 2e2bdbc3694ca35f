"""Fold a constant per-channel Mul / Add / Sub / Div into the Conv, ConvTranspose or Gemm before it.

The maths. With ``y`` the producer's output and ``c`` a constant that broadcasts per output channel
(its value on channel ``o`` written ``c[o]``), each op is an affine map ``y·s + t`` per channel:

    Mul  y·c   : s = c,   t = 0            Add  y + c  (or c + y): s = 1,  t = c
    Sub  y − c : s = 1,   t = −c           Sub  c − y  : s = −1, t = c
    Div  y / c : s = 1/c, t = 0            (c / y is not affine: refused)

and folding it is the same float64 computation as for BatchNormalization (see
:mod:`onnxfuse.rewrites.fold.batchnorm`): ``W'[o] = W[o]·s[o]``, ``b' = b·s + t`` for Conv (ConvTranspose with
its (C_in, C_out/g, k...) layout), and ``B'' = B'·diag(s)``, ``C' = β·C·s + t``, ``β = 1`` for Gemm.

Which constants broadcast per channel: the output has rank r (Conv/ConvTranspose: the weight's rank,
Gemm: 2) and channels on axis 1. Aligning ``c``'s shape to the right, every axis must be 1 except the
channel axis, which may be 1 or C — so ``()``, ``(1,)``, ``(C,1,1)`` and ``(1,C,1,1)`` fold into a 2-D
Conv, ``(C,)`` and ``(1,C)`` into a Gemm. A constant of higher rank than the output (it would broadcast the
output to a bigger shape) or one that varies along batch or spatial axes is refused, as is a constant
whose dtype differs from the weight's.

Div: folded for any finite, non-zero ``c``, as a multiplication by ``1/c`` computed in float64; the folded
weight ``W·(1/c)`` is then rounded once to the weight dtype, which is the same single rounding every Mul
fold has, so the result is within the tolerance of any fold (not bit-exact: neither is a Mul fold, since
``(W·x)·c`` and ``(W·c)·x`` round differently). Division by zero or by a non-finite constant is refused.

Chains (Conv → Mul → Add → Mul …) fold one op per pass: after a fold the producer writes the folded op's
output, so the next op in the chain matches on the next pass.
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.engine.edit import bypass
from onnxfuse.rewrites.engine.rule import Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, is_alive, is_default_domain, producer_of, sole_consumer_problem
from onnxfuse.rewrites.fold.affine import (
    AFFINE_PRODUCERS, broadcast_channel_problem, per_channel_vector, plan_affine, producer_geometry,
)

_OPS = ("Mul", "Add", "Sub", "Div")


def _foldable_producer(tensor):
    p = producer_of(tensor)
    if p is not None and p.op in AFFINE_PRODUCERS and is_default_domain(p):
        return p
    return None


class FoldScaleBias(Rule):
    name = "fold-scale-bias"
    description = "Fold a constant per-channel Mul/Add/Sub/Div into the preceding Conv, ConvTranspose or Gemm"

    def match(self, graph):
        for node in graph.nodes:
            if node.op not in _OPS or not is_default_domain(node) or len(node.inputs) != 2:
                continue
            # Only a constant operand makes the op a scale or bias; Add(conv, residual) is not a candidate.
            for idx in (0, 1):
                if _foldable_producer(node.inputs[idx]) is not None and constant_value(graph, node.inputs[1 - idx]) is not None:
                    yield (node, idx)
                    break

    def anchor_name(self, match):
        node = match[0]
        return node.name or node.op

    def check(self, graph, match):
        node, idx = match
        if len(node.inputs) != 2:
            return Refuse(f"{node.op} does not have two inputs")
        y, other = node.inputs[idx], node.inputs[1 - idx]
        p = _foldable_producer(y)
        if p is None or not is_alive(p):
            return Refuse(f"the {node.op} input is no longer produced by Conv/ConvTranspose/Gemm")
        problem = sole_consumer_problem(graph, y, node)
        if problem:
            return problem
        c = constant_value(graph, other)
        if c is None:
            return Refuse(f"the other operand of {node.op} ({other.name!r}) is not a constant")
        geometry = producer_geometry(graph, p)
        if isinstance(geometry, Refuse):
            return geometry
        w, rank, channels = geometry
        if c.dtype != w.dtype:
            return Refuse(f"dtype mismatch: the {node.op} constant is {c.dtype.name}, the {p.op} weight is {w.dtype.name}")
        problem = broadcast_channel_problem(c.shape, rank, channels)
        if problem:
            return problem
        v = per_channel_vector(c, rank, channels)
        if not np.all(np.isfinite(v)):
            return Refuse(f"the {node.op} constant is not finite")
        ones, zeros = np.ones(channels), np.zeros(channels)
        if node.op == "Mul":
            scale, shift = v, zeros
        elif node.op == "Add":
            scale, shift = ones, v
        elif node.op == "Sub":
            scale, shift = (ones, -v) if idx == 0 else (-ones, v)
        else:  # Div
            if idx == 1:
                return Refuse("the constant is divided by the output (c / y is not affine)")
            if np.any(v == 0):
                return Refuse("division by zero in the Div constant")
            scale, shift = 1.0 / v, zeros
        plan = plan_affine(graph, p, scale, shift)
        if isinstance(plan, Refuse):
            return plan
        return Plan(node, plan)

    def rewrite(self, graph, plan: Plan):
        node, fold = plan.anchor, plan.found
        modes = fold.apply(graph)
        bypass(graph, fold.node, node)
        detail = {"node": fold.node.name, "op": fold.node.op, "folded": node.name or node.op, "kind": node.op}
        if "copy" in modes.values():
            detail["copied"] = sorted(k for k, v in modes.items() if v == "copy")
        return detail
