"""The rule contract the apply loop enforces: check returns a plan or a Refuse, a GraphPass runs once,
Refuse(once_per_anchor=True) is reported once per anchor."""

from __future__ import annotations

import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from onnxfuse.model_io import to_graph
from onnxfuse.rewrites import GraphPass, Plan, Refuse, Rule, RuleFailed, apply_rules


def _graph() -> gs.Graph:
    g = h.make_graph([h.make_node("Relu", ["x"], ["r"], name="relu"), h.make_node("Neg", ["r"], ["y"], name="neg")], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, [2])], [h.make_tensor_value_info("y", T.FLOAT, [2])])
    return to_graph(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))


class _ReasonAsString(Rule):
    name = "reason-as-string"

    def match(self, graph):
        return list(graph.nodes)

    def check(self, graph, node):
        return "an old-style reason"


def test_a_check_returning_a_bare_string_is_a_broken_rule():
    with pytest.raises(RuleFailed, match="a plan or a Refuse"):
        apply_rules(_graph(), [_ReasonAsString()])


class _CountingPass(GraphPass):
    name = "counting-pass"

    calls = 0

    def run(self, graph):
        self.calls += 1
        return 1, {"calls": self.calls}


class _RenameOnce(Rule):
    """Refuses Neg until Relu is renamed (by the rule after it), so the loop runs a second round."""

    name = "rename-neg"

    def match(self, graph):
        return [n for n in graph.nodes if n.op == "Neg" and n.name == "neg"]

    def check(self, graph, node):
        relu = node.inputs[0].inputs[0]
        return Plan(node) if relu.name == "relu2" else Refuse("Relu not renamed yet")

    def rewrite(self, graph, plan):
        plan.anchor.name = "neg2"


class _RenameRelu(Rule):
    name = "rename-relu"

    def match(self, graph):
        return [n for n in graph.nodes if n.name == "relu"]

    def rewrite(self, graph, node):
        node.name = "relu2"


def test_a_graph_pass_runs_once_per_apply_even_over_rounds():
    p = _CountingPass()
    report = apply_rules(_graph(), [p, _RenameOnce(), _RenameRelu()])
    assert p.calls == 1
    assert report.counts == {"counting-pass": 1, "rename-neg": 1, "rename-relu": 1}
    assert report.details[0] == {"rule": "counting-pass", "calls": 1}


class _RefuseOncePerAnchor(Rule):
    name = "refuse-once"

    passes = 0

    def match(self, graph):
        self.passes += 1
        return [n for n in graph.nodes if n.op == "Relu"] + ([n for n in graph.nodes if n.op == "Neg"] if self.passes == 1 else [])

    def check(self, graph, node):
        if node.op == "Neg":
            return Plan(node)
        return Refuse(f"refused in pass {self.passes}", once_per_anchor=True)

    def rewrite(self, graph, plan):
        plan.anchor.op = "Abs"


def test_refuse_once_per_anchor_reports_the_first_reason_only():
    report = apply_rules(_graph(), [_RefuseOncePerAnchor()])
    assert [r.reason for r in report.refusals] == ["refused in pass 1"]


class _MergeReluNeg(Rule):
    """Matches both nodes of Relu → Neg; the Relu's rewrite replaces the pair by one Abs (a made-up
    rewrite: only the bookkeeping matters), which disconnects the Neg before its own match is checked."""

    name = "merge-relu-neg"
    checked: list = []

    def match(self, graph):
        return [n for n in graph.nodes if n.op in ("Relu", "Neg")]

    def check(self, graph, node):
        self.checked.append(node.name)
        return Plan(node, None) if node.op == "Relu" else Refuse("the Neg is checked on its own")

    def rewrite(self, graph, plan):
        relu = plan.anchor
        (neg,) = [n for n in graph.nodes if n.op == "Neg"]
        out = neg.outputs[0]
        neg.outputs.clear()
        neg.inputs.clear()
        graph.nodes.append(gs.Node("Abs", "abs", inputs=[relu.inputs[0]], outputs=[out]))
        relu.outputs.clear()
        relu.inputs.clear()


def test_a_match_an_earlier_rewrite_disconnected_is_skipped_not_refused():
    rule = _MergeReluNeg()
    rule.checked = []
    report = apply_rules(_graph(), [rule])
    assert report.counts[rule.name] == 1
    assert rule.checked == ["relu"]  # the Neg, disconnected by then, never reaches check
    assert report.refusals == []
