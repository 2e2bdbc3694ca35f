"""A rule that breaks is not the user's fault: when a rule raises, or its result fails the ONNX
checker, the pipeline names it, drops it, applies the others and reports it (terminal warning,
JSON, Markdown, JUnit), exiting 0 when everything else validates."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import onnx
import onnx_graphsurgeon as gs
import pytest
from click.testing import CliRunner

import onnxfuse
from helpers import TESTDATA
from onnxfuse.cli import main
from onnxfuse.rewrites import RULES
from onnxfuse.rewrites import Rule

MODEL = TESTDATA / "conv_bn_relu.onnx"


class RaisingRule(Rule):
    """Raises on its first match, after having changed nothing."""

    name = "test-raises"
    description = "test only"

    def match(self, graph):
        return [n for n in graph.nodes if n.op == "Relu"]

    def rewrite(self, graph, node):
        raise KeyError("no such tensor")


class InvalidatingRule(Rule):
    """Makes a Relu read a tensor nothing produces: the ONNX checker rejects the result."""

    name = "test-invalidates"
    description = "test only"

    def match(self, graph):
        return [n for n in graph.nodes if n.op == "Relu" and not n.inputs[0].name.startswith("ghost")]

    def rewrite(self, graph, node):
        node.inputs[0] = gs.Variable(f"ghost_{node.name}", dtype=node.inputs[0].dtype, shape=node.inputs[0].shape)
        return {"node": node.name}


@pytest.mark.parametrize("broken, reason", [(RaisingRule(), "raised KeyError"),
                                            (InvalidatingRule(), "fails the ONNX checker")])
def test_broken_rule_is_dropped_and_the_rest_applied(broken, reason):
    model = onnx.load(MODEL)
    result = onnxfuse.optimize(model, target="onnx", rules=[*RULES, broken])
    assert [d["rule"] for d in result.applied.dropped] == [broken.name]
    assert reason in result.applied.dropped[0]["reason"]
    assert result.applied.counts.get("fold-batchnorm-conv") == 4  # the others still ran (4 BatchNorms)
    assert broken.name not in result.applied.counts
    assert result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert "BatchNormalization" not in ops and "Relu" in ops
    assert result.to_json()["result"]["rewrites"]["dropped"][0]["rule"] == broken.name


def test_broken_rule_before_good_ones_is_found_by_bisection():
    # The invalidating rule runs first: the bisection over the rules that changed the model must
    # blame it, not the BatchNorm fold that ran after it.
    model = onnx.load(MODEL)
    result = onnxfuse.optimize(model, target="onnx", rules=[InvalidatingRule(), *RULES])
    assert [d["rule"] for d in result.applied.dropped] == ["test-invalidates"]
    assert result.applied.counts.get("fold-batchnorm-conv") == 4


def test_cli_warns_reports_and_exits_0(tmp_path, monkeypatch):
    monkeypatch.setattr("onnxfuse.rewrites.RULES", [*RULES, RaisingRule()])
    out, js, xml, md = tmp_path / "o.onnx", tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.md"
    res = CliRunner().invoke(main, ["optimize", str(MODEL), str(out), "--target", "onnx", "--no-bench",
                                    "--json", str(js), "--junit", str(xml), "--markdown", str(md)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    warning = [line for line in res.stderr.splitlines() if "test-raises" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: rule test-raises was dropped (raised KeyError")
    assert out.exists()
    data = json.loads(js.read_text())
    assert data["ok"] is True and data["result"]["rewrites"]["dropped"][0]["rule"] == "test-raises"
    cases = {c.get("name"): c for c in ET.parse(xml).getroot().iter("testcase")}
    assert cases["rule test-raises"].find("skipped") is not None
    assert "rule dropped" in md.read_text() and "test-raises" in md.read_text()
