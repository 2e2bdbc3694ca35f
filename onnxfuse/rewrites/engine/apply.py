"""The apply loop: rules in order, each pass after pass until it stops matching, rounds, cleanup.

* Cleanup runs first, after every pass that changed something, and last.
* A rule runs pass after pass (at most :data:`MAX_PASSES_PER_RULE`) until a pass rewrites nothing; a
  :class:`~.rule.GraphPass` runs once.
* A whole-graph pass whose work a later rule recreated (:meth:`~.rule.GraphPass.pending`) runs again.
* A rule that refused a candidate may accept it once a later rule has rewritten its surroundings, so
  the list runs again (at most :data:`MAX_ROUNDS` rounds) from the first rule that refused something
  before a later rule changed the graph; rules that saw no change since their last run are skipped.
* After a rule that ``makes_shapes_inferable`` changed the graph, shapes are inferred again
  (:mod:`onnxfuse.rewrites.facts.shapes`), and a whole-graph pass before it that has work again runs
  again at once, before the rules after it: fold-constants reads the new shapes from an ONNX model
  and ONNX's inference stops at the custom ops the fusions write (a YOLOv8 head's dynamic-batch
  ``Shape → Gather`` reads became static only after ``constant-reshape-target``, and folded only if
  fold-constants ran again before ``fuse-elementwise``).
* A candidate whose anchor an earlier match of the same pass rewrote (disconnected) is skipped, not
  refused: it is no candidate any more, and every rule would otherwise repeat that check.
* Refusals are reported once per (rule, node name, reason).
* Any exception inside a rule (but out of memory and onnxfuse's own errors) becomes
  :class:`~.rule.RuleFailed`, which the pipeline answers by dropping the rule.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxfuse.errors import OnnxfuseError
from onnxfuse.rewrites.engine.cleanup import cleanup
from onnxfuse.rewrites.engine.rule import ApplyReport, GraphPass, Refusal, Refuse, Rule, RuleFailed
from onnxfuse.rewrites.facts.graph import is_alive
from onnxfuse.rewrites.facts.inference import reinferred_and_proven

#: Safety net against a rule that keeps matching its own output.
MAX_PASSES_PER_RULE = 64
#: Rounds over the rule list (a later round starts at the first rule that refused something before a
#: later rule changed the graph).
MAX_ROUNDS = 4


def apply_rules(graph, rules: list[Rule]) -> ApplyReport:
    """Apply ``rules`` in order to ``graph`` (in place), each until it stops matching.

    Cleanup runs first, after every pass that changed something, and last. Returns a count per rule
    (every selected rule appears, zero included), the refusals (deduplicated) and rewrite details.
    """
    report = ApplyReport(counts={r.name: 0 for r in rules})
    run = _Run(graph, report)
    run.cleanup(count_dead=True)
    tail = list(rules)
    changes = 0  # rewrites made so far: a rule whose last run saw the same count sees the same graph
    seen_at: dict[str, int] = {}

    def reopened_pass() -> int | None:
        """The index in ``tail`` of the first whole-graph pass that a rule after it (this round) gave work
        again (:meth:`~.rule.GraphPass.pending`), made runnable again; None when there is none."""
        k = next((k for k, rule in enumerate(tail) if isinstance(rule, GraphPass) and any(applied[k + 1:])
                  and rule.pending(graph)), None)
        if k is not None:
            run.passes_run.discard(tail[k].name)
            seen_at.pop(tail[k].name, None)
        return k

    for _ in range(MAX_ROUNDS):
        applied, refused = [], set()
        restart = None
        for rule in tail:
            if seen_at.get(rule.name) == changes:  # nothing changed since this rule last ran
                applied.append(0)
                continue
            try:
                n, had_refusals = run.graph_pass(rule) if isinstance(rule, GraphPass) else run.rule(rule)
            except (MemoryError, RuleFailed, OnnxfuseError):  # out of memory or environment: not the rule's bug
                raise
            except Exception as e:  # a broken rule: the pipeline drops it and applies the others
                raise RuleFailed(rule.name, e) from e
            changes += n
            seen_at[rule.name] = changes
            applied.append(n)
            if had_refusals:
                refused.add(rule.name)
            if n and getattr(rule, "makes_shapes_inferable", False):
                restart = reopened_pass()  # one before this rule: it runs again before the fusions after it
                if restart is not None:
                    break
        if restart is not None:
            tail = tail[restart:]
            continue
        # A rule that refused a candidate may accept it once a later rule has rewritten its
        # surroundings (a Transpose absorbed into a FusedMatMul exposes the scale before it): run again
        # from the first such rule, so that a second optimize finds nothing (idempotence). Rules that
        # saw no change since their last run are skipped.
        again = next((k for k, rule in enumerate(tail) if rule.name in refused and any(applied[k + 1:])), None)
        # A whole-graph pass whose work a later rule recreated (contrib-attention's Expand of a constant
        # mask to a static [1, 1, S, L]: fold-constants' work) runs again from there too.
        rerun = reopened_pass()
        if rerun is not None:
            again = rerun if again is None else min(again, rerun)
        if again is None:
            break
        tail = tail[again:]
    run.cleanup()
    return report


class _Run:
    """The state of one ``apply_rules`` call: the report, refusals seen, anchors refused once."""

    def __init__(self, graph, report: ApplyReport):
        self.graph = graph
        self.report = report
        self.seen: set[Refusal] = set()
        self.refused_anchors: dict[tuple[str, int], object] = {}  # (rule, id(anchor)) -> anchor, kept alive
        self.passes_run: set[str] = set()

    def cleanup(self, count_dead: bool = False) -> None:
        # Only the first sweep's dead nodes were dead in the input; later sweeps remove what rules
        # bypassed, which the rule counts already report.
        for key, n in cleanup(self.graph).items():
            if key != "dead-node" or count_dead:
                self.report.cleanup[key] = self.report.cleanup.get(key, 0) + n

    def graph_pass(self, rule: GraphPass) -> tuple[int, bool]:
        """A whole-graph pass, once per run."""
        if rule.name in self.passes_run:
            return 0, False
        self.passes_run.add(rule.name)
        n, detail = rule.run(self.graph)
        self.report.counts[rule.name] += n
        if n:
            if detail:
                self.report.details.append({"rule": rule.name, **detail})
            self.cleanup()
        return n, False

    def rule(self, rule: Rule) -> tuple[int, bool]:
        """One rule, pass after pass until it stops matching, with a cleanup after every changing pass.
        Returns (rewrites made, whether any candidate was refused in its last pass)."""
        total = 0
        refused = False
        for _ in range(MAX_PASSES_PER_RULE):
            applied = 0
            refused = False
            for match in list(rule.match(self.graph)):
                anchor = rule.anchor(match)
                if isinstance(anchor, gs.Node) and not is_alive(anchor):  # an earlier match of this pass
                    continue  # rewrote it: no candidate any more
                plan = rule.check(self.graph, match)
                if isinstance(plan, Refuse):
                    if plan.once_per_anchor and not self._first_refusal_of(rule, match):
                        continue
                    refused = True
                    refusal = Refusal(rule.name, rule.anchor_name(match), plan.reason)
                    if refusal not in self.seen:
                        self.seen.add(refusal)
                        self.report.refusals.append(refusal)
                    continue
                if plan is None or isinstance(plan, str):  # neither: a refusal is a Refuse, never a bare reason
                    raise TypeError(f"{rule.name}.check returned {plan!r}: a plan or a Refuse(reason) is expected")
                detail = rule.rewrite(self.graph, plan)
                applied += 1
                if detail:
                    self.report.details.append({"rule": rule.name, **detail})
            self.report.counts[rule.name] += applied
            total += applied
            if not applied:
                break
            self.cleanup()
        if total and rule.makes_shapes_inferable:
            reinferred_and_proven(self.graph)
        return total, refused

    def _first_refusal_of(self, rule: Rule, match) -> bool:
        anchor = rule.anchor(match)
        key = (rule.name, id(anchor))
        if key in self.refused_anchors:
            return False
        self.refused_anchors[key] = anchor
        return True
