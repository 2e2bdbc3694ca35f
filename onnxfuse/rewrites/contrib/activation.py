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
ONNX Runtime's ``k·x·(1+0.044715·x·x)``). How close a coefficient must be: :func:`close_to`
(the argument's constants within :data:`CONSTANT_RTOL` of the exact value, e.g. BERT's divisor
1.41421 = √2·(1 − 2.6e-6); the outer 0.5 and 1 to the constants' rounding only).

Casts inside (Gelu and FastGelu): a float16 model may compute its GELU in float32,
``Cast(x16, float) → GELU in float32 → Cast(float16)``, and exporters leave Casts to the type a tensor
already has. The argument and outer expressions are walked through Casts that change no value (to the
same or a wider float type); a Cast that rounds inside the pattern (a narrower type) is refused, except
the one Cast reading the pattern's result back to x's own type, which is the rounding the fused op makes
itself. The fused op then reads x in its own type and writes the result's type (:func:`match_activation`
says when a Cast of x stays and what it reads). How close the fused op comes to the island: on CUDA,
ONNX Runtime's float16 ``Gelu`` computes in float32 and rounds once (``OP_Gelu<half>`` is
``half(_Gelu(float(a)))``, core/providers/cuda/tensor/gelu_impl.cu), as the island does, so the two are
equal up to float32 rounding; float16 ``FastGelu`` on CUDA computes in half precision
(``FastGeluKernel2`` on ``half2``, core/providers/cuda/tensor/gelu_approximate_impl.cu), as every float16
FastGelu onnxfuse writes does: within float16's tolerance, not exact. On the CPU (ONNX Runtime 1.32.0,
measured over every float16 in [-10, 10]) the fused float16 op differs from the island in 17% of
values for Gelu and 9% for FastGelu, by at most two (Gelu) or one (FastGelu) float16 steps wherever
|y| ≥ 0.01 (largest difference 0.00195 at y ≈ 2.1, resp. 0.00098) and at most 1.6e-5 absolute below:
inside float16's validation tolerance (rtol 1e-2, atol 1e-3) with room to spare, though not bit-equal.
QuickGelu keeps its Casts outside (not checked for this).

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
from onnxfuse.rewrites.engine.polynomial import POLY_OPS, cast_target, eval_expression, exact_cast_problem
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    FP32, consumers, constant_value, dtype_of, float_eps, internal_problem, is_float_dtype, is_graph_output, is_op,
    last_dim, only_read_by, producer_of, shape_of,
)

SQRT_HALF = 1.0 / math.sqrt(2.0)
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
FAST_GELU_CUBIC = 0.044715

#: How far (relative) a constant in the argument of Erf/Tanh may be from its exact value: see close_to.
CONSTANT_RTOL = 5e-6


def close_to(value: float, exact: float, dtype, rel: float = CONSTANT_RTOL) -> bool:
    """Whether a coefficient ``value`` read from constants of element type ``dtype`` stands for ``exact``:
    ``|value − exact| ≤ (rel + 2·eps(dtype))·|exact|``.

    ``2·eps`` is the constants' own rounding: each is written rounded to its type (half a step, eps/2
    relative) and a coefficient is a product of a few of them (float32: 2.4e-7; float16: 2.0e-3, which a
    float16 model is validated at: rtol 1e-2, atol 1e-3; bfloat16: 1.6e-2, where ``--precision bf16``
    writes √(2/π) as 0.796875, 1.3e-3 below it, and the tanh form's bound below gives at most 3.8e-3
    absolute, under half a bfloat16 step of any |gelu(x)| ≥ 1).

    ``rel`` is how far the *written* value may be from the exact one, for the constants inside the
    argument of Erf or Tanh (√2 or 1/√2, √(2/π), 0.044715·√(2/π)); :data:`CONSTANT_RTOL` = 5e-6, so the
    divisor 1.41421 ("some Bert model uses this approximation", ONNX Runtime's gelu_fusion.cc; its
    gelu_format2 test models; written 1.4142099618911743, 2.6e-6 below √2) and 0.7071068 match, and
    1.4142 (9.6e-5 off) or 0.7978 (1.1e-4) do not. Why the error stays small whatever x is: a relative
    error δ in the argument's constant changes ``gelu(x) = 0.5·x·(1 + erf(x/(√2(1+δ))))`` by at most
    ``max_x x²·e^(−x²/2)/√(2π)·|δ| = (2/e)/√(2π)·|δ| = 0.294·|δ|`` (at x = ±√2; Erf's saturation damps it
    for large |x|), and the tanh form by at most ``0.24·|δ₁| + 0.026·|δ₃|`` for errors δ₁ in √(2/π) and δ₃
    in its cubic coefficient (maxima taken numerically over x; tests/rewrites/contrib/test_gelu_tolerance_casts.py
    checks both). At δ = 5e-6 (plus float32's 2.4e-7) the fused op differs from the original by at most
    about 1.5e-6 absolute, on any input: 0.15 of float32 validation's atol (1e-5) and, where
    |gelu(x)| ≥ 0.1, 1.5e-5 relative, 0.15 of its rtol (1e-4); beside float16's rtol 1e-2 it is nothing.
    ONNX Runtime's graph optimizer (``IsInitializerWithExpectedValue``: rtol 1e-5 around √2 and around
    1.41421) accepts a window about twice as wide; its transformers optimizer compares with absolute
    deltas of 1e-3 to 1e-2 (1.4142 ± 0.001), far wider. A constant just outside (√2·(1 + 6e-6)) is refused.

    The outer coefficients (the 0.5s and the 1 of ``0.5·x·(1+T)``) take ``rel=0``: they are exact binary
    numbers every exporter writes exactly, and an error there is not damped: ``0.5·x·(δ₁ − δ₂·T)`` grows
    with |x| where the output goes to 0.
    """
    eps = float_eps(dtype)
    return abs(float(value) - exact) <= (rel + 2.0 * eps) * max(abs(exact), 1e-30)


class ActivationPlan:
    def __init__(self, x, nodes, root, alpha=None, dtype=None):
        self.x, self.nodes, self.root, self.alpha = x, nodes, root, alpha
        self.dtype = dtype  # the fused op's element type (x's), when known


def _exact_cast(graph, node) -> bool:
    return is_op(node, "Cast") and len(node.inputs) == 1 and exact_cast_problem(graph, node) is None


def _readers_through_casts(graph, t, depth=0) -> int:
    """How many nodes read ``t``'s value, counting the readers of an exact Cast of it instead of the Cast."""
    n = 0
    for c in consumers(t):
        n += _readers_through_casts(graph, c.outputs[0], depth + 1) if _exact_cast(graph, c) and depth < 4 else 1
    return n


def match_activation(graph, anchor, inner_check, outer_target, max_outer_steps=4, through_casts=False):
    """Match ``outer(x, T)`` around ``T = anchor(inner(x))``; returns the plan or a ``Refuse``.

    ``inner_check(poly, dtype) -> (ok, alpha)`` judges the argument polynomial in x.

    With ``through_casts``, Casts that change no value are part of the expressions (x is then the tensor
    before them), and one Cast of the result to x's type ends the pattern when the expressions compute in
    a wider type. A Cast of x read outside the pattern as well stays (the fused op reads x, the Cast still
    feeds its other readers); any other Cast must be read only inside the pattern, as every intermediate.
    Where the result keeps the wider type (no Cast back), the fused op reads the Cast of x to that type.
    """
    if len(anchor.inputs) != 1 or len(anchor.outputs) != 1:
        return Refuse(f"{anchor.op} has an unexpected number of inputs or outputs")

    def is_leaf(t):
        p = producer_of(t)
        if through_casts and _exact_cast(graph, p):
            return None  # eval_expression walks through it; x is the tensor before it
        if (
            p is None
            or not is_op(p, *POLY_OPS)
            or (_readers_through_casts(graph, t) if through_casts else len(consumers(t))) != 1
            or is_graph_output(graph, t)
            or any(t is i for i in graph.inputs)
        ):
            return 0
        return None

    inner_poly, inner = eval_expression(graph, anchor.inputs[0], {}, 1, is_leaf=is_leaf, through_casts=through_casts)
    if inner_poly is None:
        return Refuse(f"argument of {anchor.op}: {inner.problem.reason}", inner.problem.node)
    if len(inner.leaves) != 1:
        return Refuse(f"argument of {anchor.op} depends on {len(inner.leaves)} tensors, expected one")
    x = inner.leaves[0]
    dtype = inner.const_dtype or dtype_of(graph, x)
    ok, alpha = inner_check(inner_poly, dtype if dtype is not None else FP32)
    if not ok:
        return Refuse(f"argument of {anchor.op} is {inner_poly} in x={x.name!r}, not the expected form")

    t = anchor.outputs[0]
    cur = t
    root, outer, poly = None, None, None
    for _ in range(max_outer_steps):
        readers = consumers(cur)
        if len(readers) != 1 or is_graph_output(graph, cur):
            if poly is None:
                return Refuse(f"{anchor.op} output {cur.name!r} is read more than once or is a graph output")
            break
        nxt = readers[0]
        if not (is_op(nxt, *POLY_OPS) or (through_casts and is_op(nxt, "Cast"))):
            return Refuse(f"{anchor.op} result flows into {nxt.op}, not the expected product")
        poly, expr = eval_expression(graph, nxt.outputs[0], {id(x): 0, id(t): 1}, 2, through_casts=through_casts)
        if poly is None:
            return Refuse(f"expression around {anchor.op}: {expr.problem.reason}", expr.problem.node)
        d = expr.const_dtype or dtype
        if poly.matches(outer_target, lambda v, e: close_to(v, e, d, rel=0.0)):
            root, outer = nxt, expr
            dtype = dtype or expr.const_dtype
            break
        cur = nxt.outputs[0]
    if root is None:
        return Refuse(f"no expression of the expected form around {anchor.op} up to {cur.name!r} "
                      f"(last seen: {poly})")

    nodes = []
    for n in inner.nodes + [anchor] + outer.nodes:
        if all(n is not m for m in nodes):
            nodes.append(n)
    op_dtype = dtype
    casts = inner.casts + [c for c in outer.casts if all(c is not i for i in inner.casts)]
    if casts:
        settled = _settle_casts(graph, x, root, nodes, casts, dtype)
        if isinstance(settled, Refuse):
            return settled
        x, root, nodes, op_dtype = settled
    problem = internal_problem(graph, nodes, root) or constants_rank_problem(graph, nodes, x)
    if problem:
        return problem
    return ActivationPlan(x, nodes, root, alpha, op_dtype)


def _settle_casts(graph, x, root, nodes, casts, const_dtype):
    """The fused op's input, root, nodes and element type for a pattern holding exact ``casts``.

    Returns ``(x, root, nodes, dtype)`` or a ``Refuse``. The casts of x (x → Cast → Cast …) read outside the
    pattern stay out of ``nodes``; the result computed in a type wider than x's must be read by one Cast
    back to x's type (then the root), else the fused op reads the Cast of x to the result's type.
    """
    x_type = dtype_of(graph, x)
    if x_type is None:
        return Refuse(f"element type of {x.name!r} unknown")
    inside = {id(n) for n in nodes}
    of_x, frontier = [], [x]
    while frontier:
        t = frontier.pop()
        for c in consumers(t):
            if any(c is k for k in casts) and all(c is not k for k in of_x):
                of_x.append(c)
                frontier.append(c.outputs[0])
    kept = [c for c in of_x
            if is_graph_output(graph, c.outputs[0]) or any(id(r) not in inside for r in consumers(c.outputs[0]))]
    nodes = [n for n in nodes if all(n is not k for k in kept)]
    result = root.outputs[0]
    result_type = dtype_of(graph, result) or const_dtype
    if result_type is None:
        return Refuse(f"element type of {result.name!r} unknown")
    if result_type == x_type:
        return x, root, nodes, x_type
    readers = consumers(result)
    back = readers[0] if len(readers) == 1 and not is_graph_output(graph, result) else None
    if back is not None and is_op(back, "Cast") and cast_target(back) == x_type:
        return x, back, nodes + [back], x_type  # the fused op's own rounding to x's type
    for c in of_x:
        if c.inputs[0] is x and cast_target(c) == result_type:
            return c.outputs[0], root, [n for n in nodes if n is not c], result_type
    return Refuse(f"the pattern computes in {result_type.name} from {x.name!r} of {x_type.name} and its result "
                  f"is not cast back to {x_type.name}")


def scaled_x(expected):
    """An inner check accepting ``expected·x`` (coefficient within :func:`close_to`)."""

    def check(poly, dtype):
        return poly.matches({(1,): expected}, lambda v, e: close_to(v, e, dtype)), None

    return check


def fast_gelu_inner(poly, dtype):
    k = SQRT_2_OVER_PI
    return poly.matches({(1,): k, (3,): k * FAST_GELU_CUBIC}, lambda v, e: close_to(v, e, dtype)), None


def any_scaled_x(poly, dtype):
    keys = set(poly.terms)
    if keys != {(1,)}:
        return False, None
    return True, poly.terms[(1,)]


#: 0.5·x + 0.5·x·T  (= 0.5·x·(1+T))
HALF_X_ONE_PLUS_T = {(1, 0): 0.5, (1, 1): 0.5}


def activation_dtype(graph, plan):
    if getattr(plan, "dtype", None) is not None:
        return plan.dtype
    consts = [constant_value(graph, t) for n in plan.nodes for t in n.inputs]
    for c in consts:
        if c is not None and is_float_dtype(c.dtype):
            return c.dtype
    return dtype_of(graph, plan.x)


def fused_name(root, op):
    return f"{root.name}/{op}" if root.name else None


def native_gelu(node):
    """The plan, or a ``Refuse``, for ONNX's own ``Gelu`` (opset 20; torch's exporters write it from
    ``opset_version=20``):
    ``approximate="none"`` is 0.5·x·(1 + erf(x/√2)), ``"tanh"`` the tanh form, exactly com.microsoft
    Gelu's and FastGelu's definitions (each rule's ``match`` picks its mode: :func:`gelu_mode`). Mapping it
    lets contrib-bias-gelu absorb the bias Add before it (BiasGelu measured 27-42% faster than a
    FusedElementwise Add+Gelu, docs/benchmarks.md section 2), where fuse-elementwise would otherwise take
    the pair."""
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        return Refuse("not a one-input Gelu")
    return ActivationPlan(node.inputs[0], [node], node)


def gelu_mode(node) -> str:
    """An ONNX ``Gelu``'s ``approximate`` attribute ("none" by default, or "tanh")."""
    mode = node.attrs.get("approximate", "none")
    return mode.decode() if isinstance(mode, bytes) else str(mode)


def _bias_and_x(graph, add):
    """``(bias, x, entries, dtype)`` for the Add's 1-D operand: a constant first, else a run-time tensor of
    known shape ``[n]`` (n static) beside a non-constant x; ``None`` when neither operand is one."""
    for i in (1, 0):
        bias_t, x = add.inputs[i], add.inputs[1 - i]
        b = constant_value(graph, bias_t)
        if b is not None and b.ndim == 1 and constant_value(graph, x) is None:
            return bias_t, x, b.shape[0], b.dtype
    for i in (1, 0):
        bias_t, x = add.inputs[i], add.inputs[1 - i]
        shape = shape_of(graph, bias_t)
        if (constant_value(graph, bias_t) is None and constant_value(graph, x) is None and shape is not None
                and len(shape) == 1 and isinstance(shape[0], int)):
            return bias_t, x, shape[0], dtype_of(graph, bias_t)
    return None


def bias_add(graph, tensor, readers, what: str):
    """``(add, x, bias, bias dtype)`` when ``tensor`` is ``Add(x, b)`` with ``b`` a 1-D vector over x's last
    axis, read only by ``readers``; else a ``Refuse``. ``b`` is a constant, or a tensor computed at run time
    (a graph input, as in ONNX Runtime's bias_gelu_fusion*.onnx test models) whose shape is known to be
    ``[d]`` with d the static last dimension of x: ONNX Runtime checks a graph input's declared static
    dimensions when it runs, and an inferred shape of an intermediate holds whenever the model runs. The
    contrib ops' kernels add ``b`` along the last axis as the Add broadcast it. ``what`` names the reader
    in the refusals."""
    add = producer_of(tensor)
    if not is_op(add, "Add") or len(add.inputs) != 2:
        return Refuse(f"{what} input is not produced by an Add")
    problem = only_read_by(graph, add.outputs[0], readers)
    if problem:
        return problem
    found = _bias_and_x(graph, add)
    if found is None:
        return Refuse("the Add has no 1-D bias operand (a constant, or a tensor of known shape [d])")
    bias_t, x, n, bias_dtype = found
    d = last_dim(graph, x)
    if d is None:
        return Refuse(f"last dimension of {x.name!r} unknown; cannot prove the bias covers it")
    if n != d:
        return Refuse(f"bias has {n} entries, {x.name!r} has last dimension {d}")
    return add, x, bias_t, bias_dtype
