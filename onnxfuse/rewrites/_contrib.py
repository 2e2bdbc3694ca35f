"""Helpers shared by the ONNX Runtime contrib-op rules (``contrib_*.py``).

* :class:`ContribRule` runs one ``analyze(graph, node) -> (reason, plan)`` for both ``check`` and
  ``rewrite``, so the structure is re-verified right before it is changed (matches are collected
  before any rewrite of the same pass).
* :func:`scalar_constant` reads a size-1 constant operand; :func:`scalar_rank_problem` refuses one that
  would *broadcast* its partner up to a higher rank (dropping the op would then change the shape).
* :class:`Poly` and :func:`eval_expression` evaluate a small elementwise subgraph (Add/Sub/Mul/Div/Pow
  with scalar constants) as a polynomial over symbolic leaves. The activation rules use it to recognise
  ``0.5·x·(1+erf(x/√2))`` in every operand order and association with one comparison of coefficients
  instead of one hand-written matcher per export style.
* :func:`fuse` replaces a set of nodes by one new node writing the last node's output tensor, so
  downstream names (graph outputs included) are kept.

Constants are read with ``_weights.constant_value`` (initializers and ``Constant`` nodes, never graph
inputs), the same reader the folding rules use.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites._weights import constant_value, is_default_domain, is_graph_output, producer_of
from onnxfuse.rewrites.base import Rule, is_alive

#: Domain of ONNX Runtime's contrib operators.
MS_DOMAIN = "com.microsoft"

FP16, FP32, FP64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


class ContribRule(Rule):
    """A rule whose ``check`` and ``rewrite`` share one analysis of the anchor node."""

    targets = frozenset({"cuda", "contrib"})

    def analyze(self, graph, node) -> tuple[str | None, Any]:
        raise NotImplementedError

    def apply(self, graph, node, plan) -> dict[str, Any] | None:
        raise NotImplementedError

    def check(self, graph, match):
        if not is_alive(match):
            return "node was already rewritten by an earlier match"
        reason, _ = self.analyze(graph, match)
        return reason

    def rewrite(self, graph, match):
        reason, plan = self.analyze(graph, match)
        if reason:  # check() passed a moment ago; this only guards against misuse
            raise RuntimeError(f"{self.name}: rewrite called on a refused match: {reason}")
        return self.apply(graph, match, plan)


# --- reading nodes ---------------------------------------------------------------------------------


def is_op(node, *ops: str) -> bool:
    return node is not None and node.op in ops and is_default_domain(node)


def is_ms_op(node, *ops: str) -> bool:
    return node is not None and node.op in ops and node.domain == MS_DOMAIN


def nodes_of(graph, *ops: str):
    return [n for n in graph.nodes if is_op(n, *ops)]


def consumers(tensor) -> list:
    """Distinct nodes reading ``tensor`` (a node reading it twice appears once)."""
    seen, out = set(), []
    for n in tensor.outputs:
        if id(n) not in seen:
            seen.add(id(n))
            out.append(n)
    return out


def only_read_by(graph, tensor, allowed) -> str | None:
    """A refusal reason unless every reader of ``tensor`` is in ``allowed`` and it is not a graph output."""
    if is_graph_output(graph, tensor):
        return f"intermediate tensor {tensor.name!r} is also a graph output"
    ids = {id(n) for n in allowed}
    for n in tensor.outputs:
        if id(n) not in ids:
            return f"intermediate tensor {tensor.name!r} is also read by {n.name or n.op!r}"
    return None


def other_input(node, tensor):
    """The input of a binary ``node`` that is not ``tensor`` (``None`` when both are)."""
    a, b = node.inputs[0], node.inputs[1]
    if a is tensor and b is not tensor:
        return b
    if b is tensor and a is not tensor:
        return a
    return None


def int_attr(node, name, default):
    return int(node.attrs.get(name, default))


# --- shapes and dtypes ---------------------------------------------------------------------------------


def shape_of(graph, tensor):
    """The shape as a tuple of ints / dim-param strings / ``None``, or ``None`` when the rank is unknown."""
    value = constant_value(graph, tensor)
    if value is not None:
        return tuple(int(d) for d in value.shape)
    shape = getattr(tensor, "shape", None)
    if shape is None:
        return None
    return tuple(d if isinstance(d, (int, np.integer)) and d >= 0 else (d if isinstance(d, str) and d else None)
                 for d in shape)


def rank_of(graph, tensor) -> int | None:
    s = shape_of(graph, tensor)
    return None if s is None else len(s)


def dims_equal(a, b) -> bool:
    """True when two dimensions are provably equal (same value, or the same named dim-param)."""
    if a is None or b is None:
        return False
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    return int(a) == int(b)


def shapes_equal(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b))


def last_dim(graph, tensor) -> int | None:
    """The last dimension of ``tensor`` when known: from its shape, else from a MatMul/Gemm with constant B."""
    s = shape_of(graph, tensor)
    if s and isinstance(s[-1], (int, np.integer)):
        return int(s[-1])
    p = producer_of(tensor)
    if is_op(p, "MatMul"):
        b = constant_value(graph, p.inputs[1])
        if b is not None and b.ndim >= 2:
            return int(b.shape[-1])
    if is_op(p, "Gemm"):
        b = constant_value(graph, p.inputs[1])
        if b is not None and b.ndim == 2:
            return int(b.shape[0] if int_attr(p, "transB", 0) else b.shape[1])
    return None


def dtype_of(graph, tensor) -> np.dtype | None:
    value = constant_value(graph, tensor)
    if value is not None:
        return value.dtype
    dtype = getattr(tensor, "dtype", None)
    if dtype is None:
        return None
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def dtype_problem(dtype, allowed, what: str) -> str | None:
    """A refusal reason unless ``dtype`` is one of ``allowed`` (``None`` = unknown, refused too)."""
    names = "/".join(np.dtype(d).name for d in allowed)
    if dtype is None:
        return f"{what}: element type unknown; {names} required"
    if np.dtype(dtype) not in allowed:
        return f"{what} is {np.dtype(dtype).name}; ONNX Runtime's kernel takes {names}"
    return None


def first_known_dtype(graph, *tensors):
    for t in tensors:
        d = dtype_of(graph, t)
        if d is not None:
            return d
    return None


# --- scalar constants --------------------------------------------------------------------------------------


def scalar_constant(graph, tensor) -> np.ndarray | None:
    """The value of a size-1 float constant (any rank), else ``None``."""
    value = constant_value(graph, tensor)
    if value is None or value.size != 1 or value.dtype.kind != "f":
        return None
    return value


def scalar_rank_problem(graph, scalar: np.ndarray, partner) -> str | None:
    """Refuse a size-1 constant of rank r>0 unless ``partner`` is known to have rank >= r."""
    if scalar.ndim == 0:
        return None
    r = rank_of(graph, partner)
    if r is None:
        return f"constant of shape {scalar.shape} may broadcast {partner.name!r} (rank unknown) to a higher rank"
    if scalar.ndim > r:
        return f"constant of shape {scalar.shape} broadcasts the rank-{r} {partner.name!r} to rank {scalar.ndim}"
    return None


def close(value: float, target: float, dtype) -> bool:
    """``value`` equals ``target`` to the precision of ``dtype`` (constants are written rounded)."""
    tol = 2e-3 if np.dtype(dtype) == FP16 else 1e-6
    return abs(float(value) - target) <= tol * max(abs(target), 1e-30)


# --- polynomial evaluation of small elementwise subgraphs --------------------------------------------------


class Poly:
    """A polynomial over a few symbols: {exponent tuple: float64 coefficient}."""

    def __init__(self, terms: dict[tuple[int, ...], float], nsym: int):
        self.nsym = nsym
        self.terms = {k: v for k, v in terms.items() if v != 0.0}

    @classmethod
    def const(cls, c: float, nsym: int) -> "Poly":
        return cls({(0,) * nsym: float(c)}, nsym)

    @classmethod
    def symbol(cls, i: int, nsym: int) -> "Poly":
        e = [0] * nsym
        e[i] = 1
        return cls({tuple(e): 1.0}, nsym)

    def __add__(self, other: "Poly") -> "Poly":
        t = dict(self.terms)
        for k, v in other.terms.items():
            t[k] = t.get(k, 0.0) + v
        return Poly(t, self.nsym)

    def scale(self, c: float) -> "Poly":
        return Poly({k: v * c for k, v in self.terms.items()}, self.nsym)

    def __mul__(self, other: "Poly") -> "Poly":
        t: dict[tuple[int, ...], float] = {}
        for k1, v1 in self.terms.items():
            for k2, v2 in other.terms.items():
                k = tuple(a + b for a, b in zip(k1, k2))
                t[k] = t.get(k, 0.0) + v1 * v2
        return Poly(t, self.nsym)

    def constant_term(self) -> float | None:
        """The value when this polynomial is a constant, else ``None``."""
        if not self.terms:
            return 0.0
        if set(self.terms) == {(0,) * self.nsym}:
            return self.terms[(0,) * self.nsym]
        return None

    def matches(self, target: dict[tuple[int, ...], float], dtype) -> bool:
        if set(self.terms) != set(target):
            return False
        return all(close(self.terms[k], v, dtype) for k, v in target.items())

    def __repr__(self) -> str:
        return " + ".join(f"{v:.6g}*{k}" for k, v in sorted(self.terms.items())) or "0"


#: Elementwise ops :func:`eval_expression` understands.
POLY_OPS = ("Add", "Sub", "Mul", "Div", "Pow")


class Expression:
    """Result of :func:`eval_expression`: the polynomial, the nodes it spans, the constants it read."""

    def __init__(self):
        self.nodes: list = []
        self.leaves: list = []  # non-constant tensors that became symbols, in discovery order
        self.problem: str | None = None
        self.const_dtype = None


def eval_expression(graph, tensor, symbols, nsym: int, is_leaf=None, max_nodes: int = 16):
    """Evaluate ``tensor`` as a polynomial whose leaves are ``symbols`` ({id(tensor): index}).

    ``is_leaf(tensor) -> index | None`` may name further leaves on the fly (used to *discover* the input
    of an activation). Every other tensor must be a size-1 float constant or the output of an
    Add/Sub/Mul/Div/Pow (default domain); Div only by a constant, Pow only by the integer constants 2
    or 3. Returns ``(poly | None, Expression)``; on failure ``Expression.problem`` says why.
    """
    expr = Expression()
    seen_nodes: set[int] = set()

    def walk(t):
        if expr.problem:
            return None
        if id(t) in symbols:
            return Poly.symbol(symbols[id(t)], nsym)
        c = scalar_constant(graph, t)
        if c is not None:
            expr.const_dtype = expr.const_dtype or c.dtype
            return Poly.const(float(c.reshape(())), nsym)
        if is_leaf is not None:
            idx = is_leaf(t)
            if idx is not None:
                symbols[id(t)] = idx
                expr.leaves.append(t)
                return Poly.symbol(idx, nsym)
        p = producer_of(t)
        if not is_op(p, *POLY_OPS) or len(p.inputs) != 2 or len(p.outputs) != 1:
            expr.problem = f"tensor {t.name!r} is not part of the pattern (produced by {p.op if p else 'nothing'})"
            return None
        if id(p) not in seen_nodes:
            seen_nodes.add(id(p))
            expr.nodes.append(p)
            if len(expr.nodes) > max_nodes:
                expr.problem = "expression too large"
                return None
        a, b = p.inputs
        if p.op == "Pow":
            e = scalar_constant(graph, b)
            if e is None or float(e.reshape(())) not in (2.0, 3.0):
                expr.problem = f"{p.name or 'Pow'} exponent is not the constant 2 or 3"
                return None
            base = walk(a)
            if base is None:
                return None
            out = base
            for _ in range(int(float(e.reshape(()))) - 1):
                out = out * base
            return out
        if p.op == "Div":
            d = scalar_constant(graph, b)
            if d is None or float(d.reshape(())) == 0.0:
                expr.problem = f"{p.name or 'Div'} divides by something other than a non-zero constant"
                return None
            num = walk(a)
            return None if num is None else num.scale(1.0 / float(d.reshape(())))
        pa, pb = walk(a), walk(b)
        if pa is None or pb is None:
            return None
        if p.op == "Add":
            return pa + pb
        if p.op == "Sub":
            return pa + pb.scale(-1.0)
        return pa * pb

    poly = walk(tensor)
    return (None if expr.problem else poly), expr


def constants_rank_problem(graph, nodes, partner) -> str | None:
    """Refuse when a size-1 constant operand of ``nodes`` could broadcast ``partner`` to a higher rank."""
    for n in nodes:
        for t in n.inputs:
            c = scalar_constant(graph, t)
            if c is not None:
                problem = scalar_rank_problem(graph, c, partner)
                if problem:
                    return problem
    return None


def internal_problem(graph, nodes, root) -> str | None:
    """Every node in ``nodes`` except ``root`` must be read only from inside ``nodes`` (and not be an output)."""
    inside = {id(n) for n in nodes}
    for n in nodes:
        if n is root:
            continue
        for out in n.outputs:
            if is_graph_output(graph, out):
                return f"intermediate tensor {out.name!r} is also a graph output"
            for c in out.outputs:
                if id(c) not in inside:
                    return f"intermediate tensor {out.name!r} is also read by {c.name or c.op!r}"
    return None


# --- rewriting ------------------------------------------------------------------------------------------------


def fuse(graph, nodes, op: str, inputs, output, attrs=None, domain: str = MS_DOMAIN, name: str | None = None):
    """Replace ``nodes`` by one ``op`` node reading ``inputs`` and writing ``output`` (an existing tensor).

    The replaced nodes are disconnected; cleanup removes them. Returns the new node.
    """
    for n in nodes:
        n.outputs.clear()
    for n in nodes:
        n.inputs.clear()
    node = gs.Node(op=op, name=name, attrs=dict(attrs or {}), inputs=list(inputs), outputs=[output], domain=domain)
    graph.nodes.append(node)
    return node


def empty_input():
    return gs.Variable.empty()


def new_constant(graph, base: str, values: np.ndarray) -> gs.Constant:
    from onnxfuse.rewrites._weights import NameAllocator

    return gs.Constant(NameAllocator(graph)(base), np.ascontiguousarray(values))
