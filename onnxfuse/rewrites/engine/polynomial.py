"""The polynomial matcher: a small elementwise subgraph evaluated as a polynomial over symbolic leaves.

:class:`Poly` and :func:`eval_expression` evaluate Add/Sub/Mul/Div/Pow with scalar constants as a
polynomial. The activation rules use it to recognise ``0.5·x·(1+erf(x/√2))`` in every operand order and
association with one comparison of coefficients instead of one hand-written matcher per export style.
How close a coefficient must be to its exact value is the caller's (``Poly.matches(target, close)``):
the activation rules' tolerance is ``contrib.activation.close_to``. With ``through_casts``,
:func:`eval_expression` also walks through ``Cast`` nodes that change no value (:func:`exact_cast_problem`).
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import dtype_of, is_op, producer_of, scalar_constant

#: (from, to) float element types a Cast converts without changing any value (every value of the first
#: is a value of the second), besides a Cast to the type it already has.
WIDENING_CASTS = {("float16", "float32"), ("float16", "float64"), ("float32", "float64"),
                  ("bfloat16", "float32"), ("bfloat16", "float64")}
FLOAT_NAMES = {"float16", "bfloat16", "float32", "float64"}


def cast_target(node):
    """The numpy dtype a ``Cast`` node converts to (``None`` when unknown)."""
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(node.attrs.get("to", 0))))
    except (KeyError, TypeError, ValueError):
        return None


def exact_cast_problem(graph, node) -> Refuse | None:
    """``None`` when the ``Cast`` ``node`` converts a float tensor to the same or a wider float type (exact:
    every value survives), else why not: a narrowing Cast rounds, a Cast from or to a non-float type is
    not arithmetic on the same numbers."""
    src, dst = dtype_of(graph, node.inputs[0]), cast_target(node)
    if src is None or dst is None:
        return Refuse(f"{node.name or 'Cast'}: element type of its input or output unknown", node)
    if src.name not in FLOAT_NAMES or dst.name not in FLOAT_NAMES:
        return Refuse(f"{node.name or 'Cast'} casts {src.name} to {dst.name}, not between float types", node)
    if src != dst and (src.name, dst.name) not in WIDENING_CASTS:
        return Refuse(f"{node.name or 'Cast'} casts {src.name} to the narrower {dst.name} inside the pattern (rounds)", node)
    return None


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

    def matches(self, target: dict[tuple[int, ...], float], close) -> bool:
        """The same terms as ``target``, each coefficient accepted by ``close(value, exact)``."""
        if set(self.terms) != set(target):
            return False
        return all(close(self.terms[k], v) for k, v in target.items())

    def __repr__(self) -> str:
        return " + ".join(f"{v:.6g}*{k}" for k, v in sorted(self.terms.items())) or "0"


#: Elementwise ops :func:`eval_expression` understands.
POLY_OPS = ("Add", "Sub", "Mul", "Div", "Pow")


class Expression:
    """Result of :func:`eval_expression`: the polynomial, the nodes it spans, the constants it read."""

    def __init__(self):
        self.nodes: list = []  # Casts walked through included
        self.casts: list = []  # the Cast nodes among them
        self.leaves: list = []  # non-constant tensors that became symbols, in discovery order
        self.problem: Refuse | None = None
        self.const_dtype = None


def eval_expression(graph, tensor, symbols, nsym: int, is_leaf=None, max_nodes: int = 16,
                    through_casts: bool = False):
    """Evaluate ``tensor`` as a polynomial whose leaves are ``symbols`` ({id(tensor): index}).

    ``is_leaf(tensor) -> index | None`` may name further leaves on the fly (used to *discover* the input
    of an activation). Every other tensor must be a size-1 float constant or the output of an
    Add/Sub/Mul/Div/Pow (default domain); Div only by a constant, Pow only by the integer constants 2
    or 3. With ``through_casts``, also of a ``Cast`` that changes no value (:func:`exact_cast_problem`;
    a narrowing one is a problem), evaluated as its input and listed in ``Expression.casts``.
    Returns ``(poly | None, Expression)``; on failure ``Expression.problem`` says why.
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
            # the type the constant is stored in (a bfloat16 one reads as float32: scalar_constant)
            expr.const_dtype = expr.const_dtype or dtype_of(graph, t)
            return Poly.const(float(c.reshape(())), nsym)
        if is_leaf is not None:
            idx = is_leaf(t)
            if idx is not None:
                symbols[id(t)] = idx
                expr.leaves.append(t)
                return Poly.symbol(idx, nsym)
        p = producer_of(t)
        if through_casts and is_op(p, "Cast") and len(p.inputs) == 1 and len(p.outputs) == 1:
            expr.problem = exact_cast_problem(graph, p)
            if expr.problem:
                return None
            if id(p) not in seen_nodes:
                seen_nodes.add(id(p))
                expr.nodes.append(p)
                expr.casts.append(p)
                if len(expr.nodes) > max_nodes:
                    expr.problem = Refuse("expression too large", p)
                    return None
            return walk(p.inputs[0])
        if not is_op(p, *POLY_OPS) or len(p.inputs) != 2 or len(p.outputs) != 1:
            expr.problem = Refuse(f"tensor {t.name!r} is not part of the pattern (produced by {p.op if p else 'nothing'})", p)
            return None
        if id(p) not in seen_nodes:
            seen_nodes.add(id(p))
            expr.nodes.append(p)
            if len(expr.nodes) > max_nodes:
                expr.problem = Refuse("expression too large", p)
                return None
        a, b = p.inputs
        if p.op == "Pow":
            e = scalar_constant(graph, b)
            if e is None or float(e.reshape(())) not in (2.0, 3.0):
                expr.problem = Refuse(f"{p.name or 'Pow'} exponent is not the constant 2 or 3", p)
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
                expr.problem = Refuse(f"{p.name or 'Div'} divides by something other than a non-zero constant", p)
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
