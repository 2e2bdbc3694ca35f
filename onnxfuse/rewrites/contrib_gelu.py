"""GELU-family activations → ONNX Runtime contrib ops (domain ``com.microsoft``).

The maths each rule recognises (x is any tensor; constants are size-1 float constants):

* **Gelu** (exact, erf form):   ``gelu(x) = 0.5·x·(1 + erf(x/√2))``  →  ``com.microsoft.Gelu(x)``
* **FastGelu** (tanh form):     ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``  →  ``com.microsoft.FastGelu(x)``
* **BiasGelu / FastGelu+bias**: ``Gelu(x + b)`` with ``b`` a constant 1-D vector over x's last axis
  →  ``com.microsoft.BiasGelu(x, b)`` / ``com.microsoft.FastGelu(x, b)``
* **QuickGelu**:                ``x·sigmoid(α·x)`` (α = 1 is SiLU/Swish)  →  ``com.microsoft.QuickGelu(x, alpha=α)``

How matching works: the argument of the Erf/Tanh/Sigmoid and the expression that consumes its result
are evaluated as polynomials over the symbols x and T (T = erf/tanh/sigmoid output) by
:func:`~onnxfuse.rewrites._contrib.eval_expression`. Gelu needs argument ``x/√2`` (a Div by 1.4142… or
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

from onnxfuse.rewrites._contrib import (
    FP16,
    FP32,
    FP64,
    POLY_OPS,
    ContribRule,
    constants_rank_problem,
    consumers,
    dtype_of,
    dtype_problem,
    eval_expression,
    fuse,
    internal_problem,
    is_ms_op,
    is_op,
    last_dim,
    nodes_of,
    only_read_by,
)
from onnxfuse.rewrites._weights import constant_value, is_graph_output, producer_of

SQRT_HALF = 1.0 / math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
FAST_GELU_CUBIC = 0.044715


class _ActivationPlan:
    def __init__(self, x, nodes, root, alpha=None):
        self.x, self.nodes, self.root, self.alpha = x, nodes, root, alpha


def _match_activation(graph, anchor, inner_check, outer_target, max_outer_steps=4):
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
    return None, _ActivationPlan(x, nodes, root, alpha)


def _scaled_x(expected):
    """An inner check accepting exactly ``expected·x``."""

    def check(poly, dtype):
        return poly.matches({(1,): expected}, dtype), None

    return check


def _fast_gelu_inner(poly, dtype):
    k = SQRT_2_OVER_PI
    return poly.matches({(1,): k, (3,): k * FAST_GELU_CUBIC}, dtype), None


def _any_scaled_x(poly, dtype):
    keys = set(poly.terms)
    if keys != {(1,)}:
        return False, None
    return True, poly.terms[(1,)]


#: 0.5·x + 0.5·x·T  (= 0.5·x·(1+T))
_HALF_X_ONE_PLUS_T = {(1, 0): 0.5, (1, 1): 0.5}


class ContribGelu(ContribRule):
    name = "contrib-gelu"
    description = "0.5·x·(1+erf(x/√2)) → com.microsoft Gelu"

    def match(self, graph):
        return nodes_of(graph, "Erf")

    def analyze(self, graph, node):
        reason, plan = _match_activation(graph, node, _scaled_x(SQRT_HALF), _HALF_X_ONE_PLUS_T)
        if reason:
            return reason, None
        problem = dtype_problem(_dtype(graph, plan), (FP16, FP32, FP64), "Gelu input")
        return (problem, None) if problem else (None, plan)

    def apply(self, graph, node, plan):
        fuse(graph, plan.nodes, "Gelu", [plan.x], plan.root.outputs[0], name=_name(plan.root, "Gelu"))
        return {"op": "com.microsoft.Gelu", "input": plan.x.name, "replaced": len(plan.nodes)}


class ContribFastGelu(ContribRule):
    name = "contrib-fast-gelu"
    description = "0.5·x·(1+tanh(√(2/π)(x+0.044715x³))) → com.microsoft FastGelu"

    def match(self, graph):
        return nodes_of(graph, "Tanh")

    def analyze(self, graph, node):
        reason, plan = _match_activation(graph, node, _fast_gelu_inner, _HALF_X_ONE_PLUS_T)
        if reason:
            return reason, None
        problem = dtype_problem(_dtype(graph, plan), (FP16, FP32), "FastGelu input")
        return (problem, None) if problem else (None, plan)

    def apply(self, graph, node, plan):
        fuse(graph, plan.nodes, "FastGelu", [plan.x], plan.root.outputs[0], name=_name(plan.root, "FastGelu"))
        return {"op": "com.microsoft.FastGelu", "input": plan.x.name, "replaced": len(plan.nodes)}


class ContribQuickGelu(ContribRule):
    name = "contrib-quick-gelu"
    description = "x·sigmoid(α·x) (SiLU when α=1) → com.microsoft QuickGelu(alpha=α)"
    # On CUDA the same x·sigmoid(x) runs faster as a FusedElementwise region (H100, 2026-11-22:
    # 0.057 vs 0.059 ms fp32, 0.046 vs 0.053 ms fp16; benchmarks/patterns.py), so only --target contrib
    # maps it to QuickGelu.
    targets = frozenset({"contrib"})

    def match(self, graph):
        return nodes_of(graph, "Sigmoid")

    def analyze(self, graph, node):
        reason, plan = _match_activation(graph, node, _any_scaled_x, {(1, 1): 1.0}, max_outer_steps=1)
        if reason:
            return reason, None
        dtype = _dtype(graph, plan)
        if dtype is not None:  # Sigmoid only takes float types, all of which QuickGelu's kernels take
            problem = dtype_problem(dtype, (FP16, FP32, FP64), "QuickGelu input")
            if problem:
                return problem, None
        return None, plan

    def apply(self, graph, node, plan):
        fuse(graph, plan.nodes, "QuickGelu", [plan.x], plan.root.outputs[0], attrs={"alpha": float(plan.alpha)},
             name=_name(plan.root, "QuickGelu"))
        return {"op": "com.microsoft.QuickGelu", "input": plan.x.name, "alpha": float(plan.alpha),
                "replaced": len(plan.nodes)}


class ContribBiasGelu(ContribRule):
    name = "contrib-bias-gelu"
    description = "Add(x, constant 1-D bias) → Gelu/FastGelu becomes com.microsoft BiasGelu / FastGelu(x, bias)"

    def match(self, graph):
        return [n for n in graph.nodes if is_ms_op(n, "Gelu", "FastGelu")]

    def analyze(self, graph, node):
        live_inputs = [t for t in node.inputs if not t.is_empty()]
        if len(live_inputs) != 1:
            return f"{node.op} already has a bias", None
        add = producer_of(node.inputs[0])
        if not is_op(add, "Add") or len(add.inputs) != 2:
            return f"{node.op} input is not produced by an Add", None
        problem = only_read_by(graph, add.outputs[0], [node])
        if problem:
            return problem, None
        for i in (1, 0):
            bias_t, x = add.inputs[i], add.inputs[1 - i]
            b = constant_value(graph, bias_t)
            if b is not None and b.ndim == 1 and constant_value(graph, x) is None:
                break
        else:
            return "the Add has no constant 1-D bias operand", None
        d = last_dim(graph, x)
        if d is None:
            return f"last dimension of {x.name!r} unknown; cannot prove the bias covers it", None
        if b.shape[0] != d:
            return f"bias has {b.shape[0]} entries, {x.name!r} has last dimension {d}", None
        allowed = (FP16, FP32, FP64) if node.op == "Gelu" else (FP16, FP32)
        problem = dtype_problem(b.dtype, allowed, f"{node.op} bias")
        if problem:
            return problem, None
        return None, (add, x, bias_t)

    def apply(self, graph, node, plan):
        add, x, bias_t = plan
        op = "BiasGelu" if node.op == "Gelu" else "FastGelu"
        fuse(graph, [add, node], op, [x, bias_t], node.outputs[0], name=_name(node, op))
        return {"op": f"com.microsoft.{op}", "input": x.name, "bias": bias_t.name}


def _dtype(graph, plan):
    consts = [constant_value(graph, t) for n in plan.nodes for t in n.inputs]
    for c in consts:
        if c is not None and c.dtype.kind == "f":
            return c.dtype
    return dtype_of(graph, plan.x)


def _name(root, op):
    return f"{root.name}/{op}" if root.name else None


RULES = [ContribQuickGelu(), ContribGelu(), ContribFastGelu(), ContribBiasGelu()]
