"""GELU-family activations → ONNX Runtime contrib ops (domain ``com.microsoft``): the matcher the
contrib-gelu, contrib-fast-gelu, contrib-quick-gelu and contrib-bias-gelu rules share (one file each).

The maths each rule recognises (x is any tensor; constants are size-1 float constants):

* **Gelu** (exact, erf form):   ``gelu(x) = 0.5·x·(1 + erf(x/√2))``  →  ``com.microsoft.Gelu(x)``
* **FastGelu** (tanh form):     ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``  →  ``com.microsoft.FastGelu(x)``
* **BiasGelu / FastGelu+bias**: ``Gelu(x + b)`` with ``b`` a constant 1-D vector over x's last axis
  →  ``com.microsoft.BiasGelu(x, b)`` / ``com.microsoft.FastGelu(x, b)``
* **QuickGelu**:                ``x·sigmoid(α·x)`` (α = 1 is SiLU/Swish)  →  ``com.microsoft.QuickGelu(x, alpha=α)``

How matching works: the argument of the Erf/Tanh/Sigmoid and the expression that consumes its result
are evaluated as polynomials over the symbols x and T (T = erf/tanh/sigmoid output) by
:func:`~onnxfuse.rewrites.engine.polynomial.eval_expression`. Gelu needs argument ``x/√2`` (a Div by 1.4142… or
a Mul by 0.7071… alike) and outer expression ``0.5·x + 0.5·x·T``; so ``0.5·x·(1+T)``, ``x·0.5·(1+T)``,
``(x·(1+T))·0.5`` (PyTorch's export) and ``x·(0.5+0.5·T)`` all match, and a wrong constant does not.
FastGelu needs argument ``k·x + 0.044715·k·x³`` with k = √(2/π) (x³ as Pow(x,3), x·x·x, or
ONNX Runtime's ``k·x·(1+0.044715·x·x)``). Coefficients are compared to the constants' precision.

Conditions, as ONNX Runtime's own fusions (gelu_fusion.cc, fast_gelu_fusion.cc, bias_gelu_fusion.cc,
quick_gelu_fusion.cc): every intermediate node is read only inside the pattern and is not a graph
output (the last node's output, kept by name, may be); a rank>0 constant must not broadcast x to a
higher rank; element types: Gelu float16/float/double, FastGelu float16/float (its CUDA kernel; ONNX
Runtime's CPU fusion only fuses float), BiasGelu's bias must be 1-D with x's last dimension (known from
shape information or a MatMul/Gemm with constant weights).
"""

from __future__ import annotations

import math

from onnxfuse.rewrites.contrib.matching import constants_rank_problem
from onnxfuse.rewrites.engine.facts import (
    FP32, consumers, constant_value, dtype_of, internal_problem, is_graph_output, is_op, producer_of,
)
from onnxfuse.rewrites.engine.polynomial import POLY_OPS, eval_expression

SQRT_HALF = 1.0 / math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
FAST_GELU_CUBIC = 0.044715


class ActivationPlan:
    def __init__(self, x, nodes, root, alpha=None):
        self.x, self.nodes, self.root, self.alpha = x, nodes, root, alpha


def match_activation(graph, anchor, inner_check, outer_target, max_outer_steps=4):
    """Match ``outer(x, T)`` around ``T = anchor(inner(x))``; returns ``(reason, plan)``.

    ``inner_check(poly, dtype) -> (ok, alpha)`` judges the argument polynomial in x.
    """
    if len(anchor.inputs) != 1 or len(anchor.outputs) != 1:
        return f"{anchor.op} has an unexpected number of inputs or outputs", None

    def is_leaf(t):
        p = producer_of(t)
        if (
            p is None
            or not is_op(p, *POLY_OPS)
            or len(consumers(t)) != 1
            or is_graph_output(graph, t)
            or any(t is i for i in graph.inputs)
        ):
            return 0
        return None

    inner_poly, inner = eval_expression(graph, anchor.inputs[0], {}, 1, is_leaf=is_leaf)
    if inner_poly is None:
        return f"argument of {anchor.op}: {inner.problem}", None
    if len(inner.leaves) != 1:
        return f"argument of {anchor.op} depends on {len(inner.leaves)} tensors, expected one", None
    x = inner.leaves[0]
    dtype = inner.const_dtype or dtype_of(graph, x)
    ok, alpha = inner_check(inner_poly, dtype if dtype is not None else FP32)
    if not ok:
        return f"argument of {anchor.op} is {inner_poly} in x={x.name!r}, not the expected form", None

    t = anchor.outputs[0]
    cur = t
    root, outer, poly = None, None, None
    for _ in range(max_outer_steps):
        readers = consumers(cur)
        if len(readers) != 1 or is_graph_output(graph, cur):
            if poly is None:
                return f"{anchor.op} output {cur.name!r} is read more than once or is a graph output", None
            break
        nxt = readers[0]
        if not is_op(nxt, *POLY_OPS):
            return f"{anchor.op} result flows into {nxt.op}, not the expected product", None
        poly, expr = eval_expression(graph, nxt.outputs[0], {id(x): 0, id(t): 1}, 2)
        if poly is None:
            return f"expression around {anchor.op}: {expr.problem}", None
        d = expr.const_dtype or dtype
        if poly.matches(outer_target, d if d is not None else FP32):
            root, outer = nxt, expr
            dtype = dtype or expr.const_dtype
            break
        cur = nxt.outputs[0]
    if root is None:
        return (f"no expression of the expected form around {anchor.op} up to {cur.name!r} "
                f"(last seen: {poly})"), None

    nodes = []
    for n in inner.nodes + [anchor] + outer.nodes:
        if all(n is not m for m in nodes):
            nodes.append(n)
    problem = internal_problem(graph, nodes, root) or constants_rank_problem(graph, nodes, x)
    if problem:
        return problem, None
    return None, ActivationPlan(x, nodes, root, alpha)


def scaled_x(expected):
    """An inner check accepting exactly ``expected·x``."""

    def check(poly, dtype):
        return poly.matches({(1,): expected}, dtype), None

    return check


def fast_gelu_inner(poly, dtype):
    k = SQRT_2_OVER_PI
    return poly.matches({(1,): k, (3,): k * FAST_GELU_CUBIC}, dtype), None


def any_scaled_x(poly, dtype):
    keys = set(poly.terms)
    if keys != {(1,)}:
        return False, None
    return True, poly.terms[(1,)]


#: 0.5·x + 0.5·x·T  (= 0.5·x·(1+T))
HALF_X_ONE_PLUS_T = {(1, 0): 0.5, (1, 1): 0.5}


def activation_dtype(graph, plan):
    consts = [constant_value(graph, t) for n in plan.nodes for t in n.inputs]
    for c in consts:
        if c is not None and c.dtype.kind == "f":
            return c.dtype
    return dtype_of(graph, plan.x)


def fused_name(root, op):
    return f"{root.name}/{op}" if root.name else None


def native_gelu(node):
    """(reason, plan) for ONNX's own ``Gelu`` (opset 20; torch's exporters write it from ``opset_version=20``):
    ``approximate="none"`` is 0.5·x·(1 + erf(x/√2)), ``"tanh"`` the tanh form, exactly com.microsoft
    Gelu's and FastGelu's definitions (each rule's ``match`` picks its mode: :func:`gelu_mode`). Mapping it
    lets contrib-bias-gelu absorb the bias Add before it (BiasGelu measured 27-42% faster than a
    FusedElementwise Add+Gelu, docs/benchmarks.md section 2), where fuse-elementwise would otherwise take
    the pair."""
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        return "not a one-input Gelu", None
    return None, ActivationPlan(node.inputs[0], [node], node)


def gelu_mode(node) -> str:
    """An ONNX ``Gelu``'s ``approximate`` attribute ("none" by default, or "tanh")."""
    mode = node.attrs.get("approximate", "none")
    return mode.decode() if isinstance(mode, bytes) else str(mode)
