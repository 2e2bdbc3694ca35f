"""rewrites._opset: when declaring a higher default-domain opset changes no node's meaning."""

from __future__ import annotations

import onnx
import onnx.parser
import pytest

from onnxfuse.model_io import to_graph
from onnxfuse.rewrites.engine.opset import _same_meaning, opset_raise_problem, raise_opset


def graph_of(body: str, opset: int):
    return to_graph(onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]>\n{body}'))


@pytest.mark.parametrize("op,old", [
    ("Add", 14),  # same schema at 14 and 17
    ("Pow", 13),  # 15 only added bfloat16
    ("Identity", 14),  # 16 only added optional types
    ("Where", 9),  # 16 only added bfloat16
    ("Shape", 13),  # 15 added start/end, whose absence means the whole shape
])
def test_type_widenings_and_listed_attributes_keep_meaning(op, old):
    assert _same_meaning(op, old, 17)


@pytest.mark.parametrize("op,old", [
    ("BatchNormalization", 14),  # 15 regrouped its type constraints
    ("RoiAlign", 10),  # 16 added coordinate_transformation_mode with a different default behaviour
    ("Resize", 11),  # 13 changed inputs and attribute defaults
    ("NoSuchOp", 14),
])
def test_other_changes_block(op, old):
    assert not _same_meaning(op, old, 17)


def test_problem_names_the_blocking_ops_including_subgraph_bodies():
    g = graph_of("""
        g (float[2] x, bool c) => (float[2] y) {
            y = If (c) <then_branch = t () => (float[2] a) { a = Identity(x) },
                        else_branch = e () => (float[2] b) {
                            s = Constant <value = float[2] {1, 1}> ()
                            b = BatchNormalization(x, s, s, s, s)
                        }>
        }
    """, opset=14)
    assert opset_raise_problem(g, 17).reason == "raising the model's opset 14 → 17 would change the meaning of BatchNormalization"


def test_no_problem_and_raise():
    g = graph_of("g (float[2] x) => (float[2] y) { y = Pow(x, x) }", opset=13)
    assert opset_raise_problem(g, 17) is None
    raise_opset(g, 17)
    assert g.opset == 17
    raise_opset(g, 15)  # never lowers
    assert g.opset == 17
    assert opset_raise_problem(g, 17) is None
