"""The rule contract every graph rewrite follows.

A rule is a small class with three steps, after onnxscript's rewriter:

* ``match(graph)`` yields candidate anchors (usually a node) cheaply, without judging them;
* ``check(graph, match)`` judges one candidate and returns either a :class:`Refuse` (the one refusal
  type in ``rewrites/``) carrying the one-line *reason* it declines (the reason is what ``--explain``
  prints and what the JSON report carries), or a *plan*: whatever ``rewrite`` needs, with the analysis
  ``check`` already did (a :class:`Plan`, the rule's own object, or by default the match itself).
  Nothing is analysed twice and nothing is kept on the rule instance or on the graph between the two
  steps;
* ``rewrite(graph, plan)`` performs it, and may return a dict describing what it did (for reports).

The apply loop (:mod:`.apply`) calls ``rewrite`` right after the ``check`` that produced the plan, so
the plan describes the graph as it is. But ``match`` results are collected before any rewrite of the
same pass: the loop skips a match whose anchor (a node) an earlier rewrite disconnected, and ``check``
must re-verify the rest of the structure it relies on (a neighbour it expects may already have been
folded away): :func:`~onnxfuse.rewrites.facts.graph.is_alive` helps with that.

A :class:`GraphPass` is the other kind: a whole-graph transformation (constant folding) that runs once
per ``apply_rules`` and reports how many nodes it changed, instead of emitting one match per node.

Rules run on onnx-graphsurgeon graphs. A rewrite disconnects what it replaced (clears the old nodes'
outputs); dead nodes and unused tensors are swept by the cleanup pass that runs between rule passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

#: The three optimization targets (see ``onnxfuse optimize --help``).
TARGETS = ("cuda", "contrib", "onnx")


def unnamed_label(op: str, first_output: str) -> str:
    """How a node without a name is named in refusals and reports: ``<op → first output>``."""
    return f"<{op} → {first_output}>"


@dataclass(frozen=True)
class Refusal:
    """A candidate a rule looked at and declined, with the reason."""

    rule: str
    node: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "node": self.node, "reason": self.reason}


class RuleFailed(Exception):
    """A rule raised while matching, checking or rewriting (or the cleanup after its pass did).

    Not the user's fault and not the model's: the pipeline drops the rule, applies the others and
    reports it (``ApplyReport.dropped``)."""

    def __init__(self, rule: str, error: BaseException):
        super().__init__(f"rule {rule} raised {type(error).__name__}: {error}")
        self.rule = rule
        self.error = error


@dataclass
class ApplyReport:
    """What applying a list of rules did: a count per rule, refusals, per-rewrite details, and the
    rules that were dropped because they broke (raised, or produced a model the ONNX checker rejects)."""

    counts: dict[str, int] = field(default_factory=dict)
    refusals: list[Refusal] = field(default_factory=list)
    details: list[dict[str, Any]] = field(default_factory=list)
    cleanup: dict[str, int] = field(default_factory=dict)
    dropped: list[dict[str, str]] = field(default_factory=list)  # {"rule": name, "reason": one line}
    #: subgraph bodies (onnxfuse.bodies): {"node", "attribute", "rewrites": count} for each body the rules
    #: ran in, with "left": the reason instead where it was left as it was
    bodies: list[dict[str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def applied_rules(self) -> list[str]:
        return [name for name, n in self.counts.items() if n > 0]

    def bytes_added(self) -> dict[str, tuple[int, int]]:
        """Per rule whose rewrites stored more weight bytes than they replaced (their details'
        ``bytes_added``, e.g. fold-weight-upcast's float32 copies): (bytes, rewrites). A user who sees
        the output file larger than the input should be told which rule did it."""
        grown: dict[str, tuple[int, int]] = {}
        for detail in self.details:
            added = detail.get("bytes_added")
            if added:
                total, count = grown.get(detail["rule"], (0, 0))
                grown[detail["rule"]] = (total + int(added), count + 1)
        return grown

    def absorb(self, other: "ApplyReport") -> None:
        """Add what ``other`` did (a subgraph body's rewrite) to this report: counts, cleanup, refusals and
        details; its own ``bodies`` and ``dropped`` stay its own."""
        for name, n in other.counts.items():
            self.counts[name] = self.counts.get(name, 0) + n
        for name, n in other.cleanup.items():
            self.cleanup[name] = self.cleanup.get(name, 0) + n
        self.refusals.extend(r for r in other.refusals if r not in self.refusals)
        self.details.extend(other.details)

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "cleanup": dict(self.cleanup),
            "refusals": [r.to_dict() for r in self.refusals],
            "details": list(self.details),
            "dropped": [dict(d) for d in self.dropped],
            **({"bodies": [dict(b) for b in self.bodies]} if self.bodies else {}),
        }


@dataclass(frozen=True)
class Refuse:
    """*The* refusal: "declined, because ``reason``", about ``node`` where one is known.

    One type for every "no" in ``rewrites/`` (issue 36): what ``check`` returns, what a contrib rule's
    ``analyze``, a shared pattern helper (``dtype_problem``, the attention pattern's steps) and the
    elementwise regions code return or record instead of a plan. A caller tells it from a plan with
    ``isinstance(x, Refuse)``, never by asking whether a value is a ``str``: a plan or a found value
    may well be a string or a tuple of them, and a bare string carries no node. The apply loop turns
    the ``Refuse`` a ``check`` returns into the report's :class:`Refusal` (rule, anchor's name, reason).

    ``reason`` is one line, what ``--explain`` prints and what the JSON report carries. ``node`` is
    the node the reason is about, when the code that declined knows it (it may be a neighbour of the
    rule's anchor); the report still names the anchor, as it always has. Two refusals are equal (and
    hash alike) by their reason and ``once_per_anchor`` alone: the node is a pointer into the graph,
    not part of what was said (and onnx-graphsurgeon's nodes are unhashable).

    ``once_per_anchor``: report this anchor's refusal the first time only, whatever the reason says
    later. fuse-elementwise uses it: a later pass sees the ops it refused again, often with less
    context since their neighbours are fused by then. Such a repeat is neither reported nor counted
    as a refusal (so it does not make the apply loop run a round again)."""

    reason: str
    node: Any = field(default=None, compare=False)
    once_per_anchor: bool = field(default=False, kw_only=True)


class Refused(Exception):
    """Carries a :class:`Refuse` out of an analysis nested too deep to return it step by step (the
    elementwise regions' lowering of one node); the code that started the analysis catches it and
    keeps ``refusal``. Never escapes ``rewrites/``: the apply loop only ever sees the value."""

    def __init__(self, refusal: Refuse):
        super().__init__(refusal.reason)
        self.refusal = refusal


@dataclass
class Plan:
    """A plan for rules that need no class of their own: the anchor and what ``check`` found."""

    anchor: Any
    found: Any = None


class Rule:
    """Base class for rewrite rules. Subclasses set ``name``, ``description`` and implement the three steps."""

    #: Short kebab-case identifier used by ``--only`` / ``--skip``.
    name: ClassVar[str] = ""
    #: One line, shown by ``onnxfuse rules``.
    description: ClassVar[str] = ""
    #: The optimization targets that include this rule.
    targets: ClassVar[frozenset[str]] = frozenset(TARGETS)
    #: Opt-in rules run only when named in ``--only`` (correct, but measured slower on the GPU).
    opt_in: ClassVar[bool] = False
    #: Shapes are inferred again after a run of this rule that changed the graph
    #: (:func:`~onnxfuse.rewrites.facts.shapes.refresh_shapes`): set by rules whose rewrites let ONNX infer dimensions it could
    #: not before (a computed Reshape target made constant), so that later rules can prove them.
    makes_shapes_inferable: ClassVar[bool] = False

    def match(self, graph) -> Iterable[Any]:
        raise NotImplementedError

    def check(self, graph, match) -> Any:
        """A plan for ``rewrite`` (by default the match itself), or a :class:`Refuse`."""
        return match

    def rewrite(self, graph, plan) -> dict[str, Any] | None:
        raise NotImplementedError

    def under(self, assumptions) -> Rule:
        """This rule configured with what the user promises about the inputs (:mod:`.assumptions`):
        itself, for the rules that rely on no promise (all but a few)."""
        return self

    def anchor(self, match):
        """The node a match is about (its first element by default)."""
        return match[0] if isinstance(match, (tuple, list)) else match

    def anchor_name(self, match) -> str:
        """The name shown for a match in refusals (a node's name by default)."""
        node = self.anchor(match)
        if getattr(node, "name", None):
            return node.name
        outputs = getattr(node, "outputs", None)
        if outputs:  # an unnamed node: its op and first output (str(node) is a multi-line dump)
            return unnamed_label(node.op, outputs[0].name)
        return str(node)

    def __repr__(self) -> str:
        return f"<Rule {self.name}>"


class GraphPass(Rule):
    """A whole-graph pass: ``run(graph)`` once per ``apply_rules``, no matches.

    Returns ``(count, detail)``: how many nodes it removed or changed (the report's count for the pass)
    and an optional dict for the report's details. A pass is selected and skipped like any rule."""

    def run(self, graph) -> tuple[int, dict[str, Any] | None]:
        raise NotImplementedError

    def pending(self, graph) -> bool:
        """True when a later rule left work this pass would do (the engine then runs it once more in
        the same ``apply_rules``, so that a second optimize finds nothing). A cheap look, no run."""
        return False
