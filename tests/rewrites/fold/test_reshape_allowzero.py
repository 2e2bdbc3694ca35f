"""reshape-allowzero: allowzero=1 dropped where a constant target has no 0 (the attribute then means nothing).

The rewritten Reshape is run on ONNX Runtime against the original; a target with a 0 and a computed
target are refused with the graph unchanged.
"""

from __future__ import annotations

import numpy as np
from contrib_testlib import fuse, parse, refusals

import helpers
from onnxfuse.rewrites.fold.reshape_allowzero import ReshapeAllowzero

RULE = ReshapeAllowzero()


def _allowzero(model) -> int:
    node = next(n for n in model.graph.node if n.op_type == "Reshape")
    return next((a.i for a in node.attribute if a.name == "allowzero"), 0)


def _model(target: str, out: str):
    return parse(f"""
    g (float[batch,6,8] x) => (float[{out}] y) {{
        shp = Constant <value = int64[3] {{{target}}}> ()
        y = Reshape <allowzero = 1> (x, shp)
    }}
    """)


def test_constant_target_without_zero_drops_allowzero():
    m = _model("-1, 12, 4", "b,12,4")
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1 and _allowzero(out) == 0
    for batch in (1, 3):
        feeds = {"x": np.random.default_rng(batch).standard_normal((batch, 6, 8)).astype(np.float32)}
        np.testing.assert_array_equal(helpers.run_ort(out, feeds)["y"], helpers.run_ort(m, feeds)["y"])


def test_constant_target_with_zero_keeps_allowzero():
    # Under allowzero=1 the 0 is a zero-size axis; under 0 it would copy x's 6.
    m = parse("""
    g (float[0,6,8] x) => (float[0,48] y) {
        shp = Constant <value = int64[2] {0, 48}> ()
        y = Reshape <allowzero = 1> (x, shp)
    }
    """)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0 and _allowzero(out) == 1
    assert any("0 entry" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_computed_target_is_left_to_constant_reshape_target():
    m = parse("""
    g (float[batch,6,8] x) => (float[batch,48] y) {
        s = Shape <end = 1> (x)
        rest = Constant <value = int64[1] {48}> ()
        shp = Concat <axis = 0> (s, rest)
        y = Reshape <allowzero = 1> (x, shp)
    }
    """)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0 and _allowzero(out) == 1
    assert any("computed" in r for r in refusals(report, RULE)), refusals(report, RULE)
