"""Consistent sizes for tied dynamic dimensions: solve what :mod:`.dim_symbols` read from the graph.

Why
---
Validation used to set every dynamic dimension to 1 (and then one larger). A KV-cache decoder
(``input_ids [B, S]``, ``attention_mask [B, P + S]``, ``past_key_values.N.key [B, H, P, D]``) cannot run
like that: its mask has one column per key, past and new, so ``optimize`` failed unless the user
passed ``--shape`` or ``--inputs``. Here the relations are solved and sizes chosen that satisfy them.

The maths
---------
Every relation is a polynomial over the input symbols: ``p = 0`` (equalities) or ``p >= 0`` (bounds).

1. Equalities that are linear once the known definitions are substituted are eliminated one by one
   (Gaussian elimination over the integers, unit coefficients only): ``attention_mask[1] - P - S = 0``
   defines ``attention_mask[1] := P + S``. The symbol solved for is the one whose coefficient's sign is
   alone in the row when it has three terms or more (the total of a sum), else the one declared last
   (so ``input_ids[0]`` stays free and the other batches follow it). A row that reduces to a non-zero
   constant is a contradiction: then nothing is derived (:func:`derive` returns None).
2. A bound that is linear (after also equating dimensions that share a declared name, as a reading aid
   for products such as ``B_mask * M - B_ids * M``) with exactly one free symbol of positive
   coefficient 1 and at least one negative term, ``M - P - S >= 0``, is taken *tight*: ``M := P + S``.
   A mask longer than the keys it covers is legal for a lookup but not what any caller feeds; the tight
   choice is the one a generation loop makes. Other bounds are only checked.
3. Dimensions that share a declared name and are still both free are then made equal (the exporter's
   intent, never against a relation the graph proves).
4. Free symbols get values: those that add up in a definition (``P`` and ``S`` in ``P + S``) distinct
   values 2, 3, ... in input order, other tied ones 1, untied ones the default size; the dependents are
   computed, and every relation and bound is checked on the result (any negative size, unmet bound or
   equality refuses the assignment).

Sizes are derived only when every dimension at 1 breaks a strict relation or a bound, or a dimension
is a sum of others (:attr:`Relations.needed`): other models keep exactly the sizes they had. ``--shape`` sizes are fixed first and the rest solved around them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from onnxfuse.runtime.dim_poly import Poly
from onnxfuse.runtime.dim_symbols import walk

#: Groups of equal dimensions longer than this are shortened in the note.
NOTE_NAMES = 4


@dataclass
class Relations:
    """The solved relations of one model: ``defs`` (dependent symbol → linear Poly over free symbols),
    the free symbols in input order, which of them add up (``summed``) or are a cache the graph appends
    to (``cache``), the relations left to check, and the dimensions no relation ties."""

    symbols: dict  # symbol → (input name, axis, dim_param)
    defs: dict = field(default_factory=dict)
    free: list = field(default_factory=list)
    summed: list = field(default_factory=list)
    cache: list = field(default_factory=list)
    equalities: list = field(default_factory=list)  # Polys == 0 at the derived sizes
    strict: list = field(default_factory=list)  # Polys == 0 at any sizes the model runs at
    bounds: list = field(default_factory=list)  # Polys >= 0
    tied: set = field(default_factory=set)
    tight: set = field(default_factory=set)  # dependents defined by a tight bound
    named: set = field(default_factory=set)  # dependents tied only by a shared declared name

    @property
    def untied(self) -> list:
        return [s for s in self.symbols if s not in self.tied]

    def assign(self, free_values: dict) -> dict | None:
        """Every symbol's size from the free ones' (missing free symbols: 1), or None when a size is
        negative or a relation or bound fails."""
        values = {s: int(free_values.get(s, 1)) for s in self.free}
        for s, e in self.defs.items():
            if not e.symbols() <= set(values):
                return None
            values[s] = e.evaluate(values)
        if any(v < 0 for v in values.values()):
            return None
        if any(p.evaluate(values) != 0 for p in self.equalities) or any(p.evaluate(values) < 0 for p in self.bounds):
            return None
        return values

    @property
    def needed(self) -> bool:
        """Whether sizes must be derived: every dimension at 1 breaks a strict relation or a bound, or
        some dimension is a sum of others (``M = P + S``: at 1 a broadcast may let the model run, but no
        second size where each dimension grows on its own can). A loose equality alone (``N`` meeting a
        constant 3 in a broadcast, where N = 1 is as legal as 3) never is a reason."""
        ones = {s: 1 for s in self.symbols}
        return (bool(self.summed) or any(p.evaluate(ones) != 0 for p in self.strict)
                or any(p.evaluate(ones) < 0 for p in self.bounds))

    def primary(self, fixed: dict | None = None, default: int = 1) -> dict:
        """Values of the free symbols for the first validation size (module docstring, step 4)."""
        fixed = fixed or {}
        out, n = {}, 2
        for s in self.free:
            if s in fixed:
                out[s] = fixed[s]
            elif s in self.summed:
                out[s], n = n, n + 1
            elif s in self.tied:
                out[s] = 1
            else:
                out[s] = default
        return out

    def shapes(self, specs, values: dict) -> dict:
        """``{input: [sizes]}`` for ``specs`` (:class:`~onnxfuse.runtime.inputs.InputSpec`) at ``values``."""
        out = {}
        for spec in specs:
            out[spec.name] = [d if isinstance(d, int) else values[f"{spec.name}[{k}]"] for k, d in enumerate(spec.shape)]
        return out

    def describe(self) -> list[str]:
        """One note naming the relations (dependents grouped by what they equal), one naming the
        dimensions no relation ties (when there are any)."""
        groups: dict = {}
        order = _order(self.symbols)
        for s, e in self.defs.items():
            how = " (an index lookup covers it all)" if s in self.tight else " (same declared name)" if s in self.named else ""
            groups.setdefault((e.render(order), how), []).append(s)
        parts = []
        for (rhs, how), names in sorted(groups.items(), key=lambda kv: (-len(_poly_terms(kv[0][0])), kv[0])):
            shown = names if len(names) <= NOTE_NAMES else names[:NOTE_NAMES - 1] + [f"... ({len(names)} in all)"]
            parts.append(f"{', '.join(shown)} = {rhs}{how}")
        notes = ["dimension relations read from the graph: " + "; ".join(parts)] if parts else []
        if self.untied:
            notes.append("dimension(s) no relation ties (sized as before): " + ", ".join(self.untied))
        return notes


def _poly_terms(text: str) -> list:
    return [t for t in text.replace(" - ", " + ").split(" + ") if t]


def _order(symbols: dict) -> dict:
    return {s: k for k, s in enumerate(symbols)}


def _eliminate(row: Poly, defs: dict, order: dict) -> tuple[str, Poly] | None | bool:
    """Solve ``row = 0`` for one symbol after substituting ``defs``: (symbol, definition); True when the
    row already holds; False when it is a contradiction; None when it cannot be solved (not linear, no
    unit coefficient)."""
    p = row.substitute(defs)
    if not p.terms:
        return True
    if p.is_const:
        return False
    if not p.linear:
        return None
    units = [(k[0], v) for k, v in p.terms.items() if k and abs(v) == 1]
    if not units:
        return None
    lonely = [(s, v) for s, v in units if sum(1 for k, w in p.terms.items() if k and (w > 0) == (v > 0)) == 1]
    if len([k for k in p.terms if k]) >= 3 and lonely:
        sym, coef = lonely[0]
    else:
        sym, coef = max(units, key=lambda sv: order.get(sv[0], -1))
    rest = p - Poly({(sym,): coef})
    return sym, (rest if coef < 0 else -rest)


def _define(defs: dict, sym: str, expr: Poly) -> None:
    for s in list(defs):
        defs[s] = defs[s].substitute({sym: expr})
    defs[sym] = expr


def derive(model: onnx.ModelProto, fixed: dict | None = None) -> Relations | None:
    """The relations between ``model``'s dynamic input dimensions (module docstring). ``fixed``:
    symbol (``input[axis]``) → size the user chose. None when the relations contradict each other
    (or the chosen sizes)."""
    w = walk(model)
    rel = Relations(symbols=w.symbols)
    order = _order(w.symbols)
    rows = [a - b for a, b in w.equalities]
    rows = list(dict.fromkeys(r for r in rows if r.terms))
    bounds = list(dict.fromkeys(w.bounds))
    for p in rows + bounds:
        rel.tied |= p.symbols() & set(w.symbols)
    defs: dict = {}
    for sym, size in (fixed or {}).items():
        if sym in w.symbols:
            _define(defs, sym, Poly.const(size))
    pending = []
    for row in rows:
        solved = _eliminate(row, defs, order)
        if solved is False:
            return None
        if solved is None:
            pending.append(row)
        elif solved is not True:
            _define(defs, *solved)
    by_name = _name_defs(w.symbols)
    by_name_polys = {s: Poly.sym(r) for s, r in by_name.items()}
    checks = []
    for b in bounds:
        q = b.substitute(defs)
        if not q.linear:
            q = q.substitute(by_name_polys).substitute(defs)
        sym = _tight_symbol(q, defs) if q.linear else None
        if sym is None:
            checks.append(b)
            continue
        coef = q.terms[(sym,)]
        _define(defs, sym, -(q - Poly({(sym,): coef})))
        rel.tight.add(sym)
    for sym, rep in by_name.items():  # step 3: shared names, where nothing says otherwise
        if sym not in defs and sym not in (fixed or {}):
            target = Poly.sym(rep).substitute(defs)
            if sym not in target.symbols():
                _define(defs, sym, target)
                rel.named.add(sym)
                rel.tied.add(sym)
                rel.tied.add(rep)
    rel.defs = {s: e for s, e in sorted(defs.items(), key=lambda kv: order.get(kv[0], 0)) if s in w.symbols}
    rel.free = [s for s in w.symbols if s not in rel.defs]
    rel.tied |= set(rel.defs)
    rel.equalities = rows + pending
    rel.strict = list(dict.fromkeys(r for r in (a - b for a, b in w.strict) if r.terms))
    rel.bounds = bounds
    free = set(rel.free)
    rel.summed = [s for s in rel.free if any(s in e.symbols() and len(e.symbols() & free) >= 2 for e in rel.defs.values())]
    for sym, _total in w.appended:
        base = Poly.sym(sym).substitute(rel.defs).symbols()
        if len(base) == 1 and next(iter(base)) in free and next(iter(base)) not in rel.cache:
            rel.cache.append(next(iter(base)))
    return rel


def _tight_symbol(q: Poly, defs: dict) -> str | None:
    positive = [k[0] for k, v in q.terms.items() if k and v > 0]
    negative = [k[0] for k, v in q.terms.items() if k and v < 0]
    if len(positive) == 1 and negative and q.terms[(positive[0],)] == 1 and positive[0] not in defs:
        return positive[0]
    return None


def _name_defs(symbols: dict) -> dict:
    """symbol → the first symbol declared with the same dimension name (for symbols that have one)."""
    first: dict = {}
    out = {}
    for sym, (_inp, _axis, name) in symbols.items():
        if not name:
            continue
        if name in first:
            out[sym] = first[name]
        else:
            first[name] = sym
    return out


__all__ = ["Relations", "derive"]
