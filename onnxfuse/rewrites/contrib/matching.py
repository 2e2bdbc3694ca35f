"""Helpers shared by the ONNX Runtime contrib-op rules (the ``contrib`` family); not a rule itself.

* :class:`ContribRule`: the contrib rules' ``analyze(graph, node)`` returns what it found or a
  :class:`~onnxfuse.rewrites.engine.rule.Refuse`, the one refusal type; it runs once, in ``check``, which
  hands what it found to ``rewrite`` as a :class:`~onnxfuse.rewrites.engine.rule.Plan`
  (``apply(graph, node, found)``). ``check`` runs right before the rewrite, so the structure is
  re-verified after the earlier rewrites of the same pass.
* :func:`scalar_rank_problem` refuses a size-1 constant that would *broadcast* its partner up to a
  higher rank (dropping the op would then change the shape); :func:`dtype_problem` names the element
  types ONNX Runtime's kernel takes. Each returns a ``Refuse`` or None, so a rule hands it on as is.

Constants, shapes and dtypes are read with :mod:`onnxfuse.rewrites.facts.graph`, the same readers
every rule uses; the polynomial matcher is :mod:`onnxfuse.rewrites.engine.polynomial`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxfuse.rewrites.engine.rule import Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import rank_of, scalar_constant


class ContribRule(Rule):
    """A contrib rule: ``check`` runs ``analyze`` once and ``rewrite`` applies what it found."""

    targets = frozenset({"cuda", "contrib"})

    def analyze(self, graph, node) -> Any | Refuse:
        """What ``apply`` needs (any value, None included), or a :class:`Refuse` saying why not."""
        raise NotImplementedError

    def apply(self, graph, node, found) -> dict[str, Any] | None:
        raise NotImplementedError

    def check(self, graph, match):
        found = self.analyze(graph, match)
        return found if isinstance(found, Refuse) else Plan(match, found)

    def rewrite(self, graph, plan: Plan):
        return self.apply(graph, plan.anchor, plan.found)


def dtype_problem(dtype, allowed, what: str) -> Refuse | None:
    """A refusal unless ``dtype`` is one of ``allowed`` (``None`` = unknown, refused too)."""
    names = "/".join(np.dtype(d).name for d in allowed)
    if dtype is None:
        return Refuse(f"{what}: element type unknown; {names} required")
    if np.dtype(dtype) not in allowed:
        return Refuse(f"{what} is {np.dtype(dtype).name}; ONNX Runtime's kernel takes {names}")
    return None


def scalar_rank_problem(graph, scalar: np.ndarray, partner) -> Refuse | None:
    """Refuse a size-1 constant of rank r>0 unless ``partner`` is known to have rank >= r."""
    if scalar.ndim == 0:
        return None
    r = rank_of(graph, partner)
    if r is None:
        return Refuse(f"constant of shape {scalar.shape} may broadcast {partner.name!r} (rank unknown) to a higher rank")
    if scalar.ndim > r:
        return Refuse(f"constant of shape {scalar.shape} broadcasts the rank-{r} {partner.name!r} to rank {scalar.ndim}")
    return None


def constants_rank_problem(graph, nodes, partner) -> Refuse | None:
    """Refuse when a size-1 constant operand of ``nodes`` could broadcast ``partner`` to a higher rank."""
    for n in nodes:
        for t in n.inputs:
            c = scalar_constant(graph, t)
            if c is not None:
                problem = scalar_rank_problem(graph, c, partner)
                if problem:
                    return problem
    return None
