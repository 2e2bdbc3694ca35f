"""Integer polynomials over dimension symbols: the sizes :mod:`.dim_symbols` follows through a graph.

A dimension is a polynomial with integer coefficients over symbols that stand for dynamic input
dimensions (``input_ids[1]``): Concat adds, a flattened ``[B, M]`` multiplies (``B*M``), a Reshape's
``-1`` divides where the division is exact. Every symbol is a size, so >= 0: a polynomial whose
coefficients are all >= 0 is >= 0 (:attr:`Poly.nonneg`), which is what lets ``Equal(size, -1)`` be
decided. Nothing here rounds or guesses: an operation that is not exact returns None.
"""

from __future__ import annotations


class Poly:
    """An integer polynomial over dimension symbols: ``{(sym, sym, ...): coefficient}``."""

    __slots__ = ("terms",)

    def __init__(self, terms=None):
        self.terms = {k: v for k, v in (terms or {}).items() if v}

    @staticmethod
    def const(c: int) -> Poly:
        return Poly({(): int(c)})

    @staticmethod
    def sym(name: str) -> Poly:
        return Poly({(name,): 1})

    def __add__(self, other: Poly) -> Poly:
        out = dict(self.terms)
        for k, v in other.terms.items():
            out[k] = out.get(k, 0) + v
        return Poly(out)

    def __neg__(self) -> Poly:
        return Poly({k: -v for k, v in self.terms.items()})

    def __sub__(self, other: Poly) -> Poly:
        return self + (-other)

    def __mul__(self, other: Poly) -> Poly:
        out: dict = {}
        for k1, v1 in self.terms.items():
            for k2, v2 in other.terms.items():
                k = tuple(sorted(k1 + k2))
                out[k] = out.get(k, 0) + v1 * v2
        return Poly(out)

    def __eq__(self, other) -> bool:
        return isinstance(other, Poly) and self.terms == other.terms

    def __hash__(self) -> int:
        return hash(frozenset(self.terms.items()))

    @property
    def is_const(self) -> bool:
        return all(k == () for k in self.terms)

    @property
    def value(self) -> int:
        return self.terms.get((), 0)

    @property
    def nonneg(self) -> bool:
        """Every coefficient >= 0, so >= 0 for any sizes."""
        return all(v >= 0 for v in self.terms.values())

    @property
    def linear(self) -> bool:
        return all(len(k) <= 1 for k in self.terms)

    def symbols(self) -> set:
        return {s for k in self.terms for s in k}

    def substitute(self, defs: dict) -> Poly:
        """Each symbol with a definition in ``defs`` (symbol → Poly) replaced by it."""
        out = Poly()
        for k, v in self.terms.items():
            term = Poly.const(v)
            for s in k:
                term = term * (defs[s] if s in defs else Poly.sym(s))
            out = out + term
        return out

    def evaluate(self, values: dict) -> int:
        total = 0
        for k, v in self.terms.items():
            p = v
            for s in k:
                p *= values[s]
            total += p
        return total

    def __repr__(self) -> str:
        return self.render()

    def render(self, order: dict | None = None) -> str:
        """The polynomial as text, terms in ``order`` (symbol → rank; default: by name), constant last."""
        if not self.terms:
            return "0"
        parts = []
        rank = (lambda k: tuple(order.get(s, len(order)) for s in k)) if order else (lambda k: k)
        for k, v in sorted(self.terms.items(), key=lambda kv: (len(kv[0]) == 0, rank(kv[0]), kv[0])):
            name = "*".join(k)
            if not k:
                parts.append(str(v))
            elif v == 1:
                parts.append(name)
            elif v == -1:
                parts.append("-" + name)
            else:
                parts.append(f"{v}*{name}")
        return " + ".join(parts).replace("+ -", "- ")


def poly_sum(dims: list):
    """The sum of ``dims`` (a Concat's axis), None if one is unknown."""
    total = Poly()
    for d in dims:
        if d is None:
            return None
        total = total + d
    return total


def poly_product(dims):
    """The product of ``dims`` (an element count, a Flatten), None if one is unknown."""
    if dims is None:
        return None
    total = Poly.const(1)
    for d in dims:
        if d is None:
            return None
        total = total * d
    return total


def poly_divide(total: Poly | None, part: Poly | None) -> Poly | None:
    """``total / part`` where exact: constants, or a monomial factor ``part`` of every term of ``total``."""
    if total is None or part is None:
        return None
    if part.is_const:
        if part.value and all(v % part.value == 0 for v in total.terms.values()):
            return Poly({k: v // part.value for k, v in total.terms.items()})
        return None
    if len(part.terms) != 1:
        return None
    ((mono, coef),) = part.terms.items()
    out = {}
    for k, v in total.terms.items():
        rest = list(k)
        for s in mono:
            if s not in rest:
                return None
            rest.remove(s)
        if v % coef:
            return None
        out[tuple(rest)] = v // coef
    return Poly(out)


__all__ = ["Poly", "poly_divide", "poly_product", "poly_sum"]
