"""The rule contract every graph rewrite follows.

A rule is a small class with three steps, after onnxscript's rewriter:

* ``match(graph)`` yields candidate anchors (usually a node) cheaply, without judging them;
* ``check(graph, match)`` returns ``None`` when the rewrite is safe, or a one-line *reason* it refuses
  (the reason is what ``--explain`` prints and what the JSON report carries);
* ``rewrite(graph, match)`` performs it, and may return a dict describing what it did (for reports).

Rules run on onnx-graphsurgeon graphs. A rewrite disconnects what it replaced (clears the old nodes'
outputs); dead nodes and unused tensors are swept by the cleanup pass that runs between rule passes.
Because ``match`` results are collected before any rewrite of the same pass, ``check`` must re-verify
the structure it relies on (a node it expects may already have been folded away): :func:`is_alive`
helps with that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

#: The three optimization targets (see ``onnxfuse optimize --help``).
TARGETS = ("cuda", "contrib", "onnx")


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

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def applied_rules(self) -> list[str]:
        return [name for name, n in self.counts.items() if n > 0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "cleanup": dict(self.cleanup),
            "refusals": [r.to_dict() for r in self.refusals],
            "details": list(self.details),
            "dropped": [dict(d) for d in self.dropped],
        }


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

    def match(self, graph) -> Iterable[Any]:
        raise NotImplementedError

    def check(self, graph, match) -> str | None:
        return None

    def rewrite(self, graph, match) -> dict[str, Any] | None:
        raise NotImplementedError

    def anchor_name(self, match) -> str:
        """The name shown for a match in refusals (a node's name by default)."""
        node = match[0] if isinstance(match, (tuple, list)) else match
        return getattr(node, "name", None) or str(node)

    def __repr__(self) -> str:
        return f"<Rule {self.name}>"


def is_alive(node) -> bool:
    """A node is alive until a rewrite disconnects it (clears its outputs)."""
    return bool(node.outputs)


def single_consumer(tensor) -> bool:
    """True when exactly one node reads ``tensor`` (graph outputs are checked separately)."""
    return len(tensor.outputs) == 1


def graph_output_names(graph) -> set[str]:
    return {t.name for t in graph.outputs}


def subgraphs(node):
    """The graphs held in ``node``'s attributes (If branches, Loop and Scan bodies)."""
    import onnx_graphsurgeon as gs

    for value in node.attrs.values():
        for sub in (value if isinstance(value, list) else [value]):
            if isinstance(sub, gs.Graph):
                yield sub


def graphs_within(graph):
    """``graph`` and every subgraph below it, outermost first."""
    yield graph
    for node in graph.nodes:
        for sub in subgraphs(node):
            yield from graphs_within(sub)
