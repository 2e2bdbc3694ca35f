"""unpack-qkv-heads: q, k, v cut from one packed [B, N, 3, H, D] tensor (timm's Attention) become a Split
and three BERT-style head splits, value for value."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from contrib_testlib import fuse, parse, refusals, same_at

from helpers import TESTDATA
from test_fuse_elementwise import assert_same
from onnxfuse.rewrites.fold.unpack_qkv_heads import UnpackQkvHeads

RULE = UnpackQkvHeads()

# [batch, 5, 24] packed q|k|v of 2 heads of 4 each; the three parts are read by one op each so every
# head value reaches an output (Q·Kᵀ, then P·V would hide nothing, but a plain sum per part is simpler)
GATHERED = """
g (float[batch,5,24] x) => (float[batch,2,5,4] q, float[batch,2,5,4] k, float[batch,2,5,4] v) {
    t = Constant <value = int64[5] {0, 0, 3, 2, 4}> ()
    r = Reshape(x, t)
    p = Transpose <perm = [2, 0, 3, 1, 4]> (r)
    i0 = Constant <value = int64 {0}> ()
    i1 = Constant <value = int64 {1}> ()
    i2 = Constant <value = int64 {2}> ()
    q = Gather <axis = 0> (p, i0)
    k = Gather <axis = 0> (p, i1)
    v = Gather <axis = 0> (p, i2)
}
"""

UNBOUND = """
g (float[batch,5,24] x) => (float[batch,2,5,4] q, float[batch,2,5,4] k, float[batch,2,5,4] v) {
    t = Constant <value = int64[5] {-1, 5, 3, 2, 4}> ()
    r = Reshape(x, t)
    p = Transpose <perm = [2, 0, 3, 1, 4]> (r)
    ones = Constant <value = int64[3] {1, 1, 1}> ()
    a, b, c = Split <axis = 0> (p, ones)
    ax = Constant <value = int64[1] {0}> ()
    q = Squeeze(a, ax)
    k = Squeeze(b, ax)
    v = Squeeze(c, ax)
}
"""


SLICED = """
g (float[batch,5,24] x) => (float[batch,2,5,4] q, float[batch,2,5,4] k, float[batch,2,5,4] v) {
    t = Constant <value = int64[5] {0, 0, 3, 2, 4}> ()
    r = Reshape(x, t)
    p = Transpose <perm = [2, 0, 3, 1, 4]> (r)
    ax = Constant <value = int64[1] {0}> ()
    s0 = Constant <value = int64[1] {0}> ()
    s1 = Constant <value = int64[1] {1}> ()
    s2 = Constant <value = int64[1] {2}> ()
    s3 = Constant <value = int64[1] {3}> ()
    a = Slice(p, s0, s1, ax)
    b = Slice(p, s1, s2, ax)
    c = Slice(p, s2, s3, ax)
    q = Squeeze(a, ax)
    k = Squeeze(b, ax)
    v = Squeeze(c, ax)
}
"""


def _ops(model) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize("text", [GATHERED, UNBOUND, SLICED], ids=["indexed", "unbind", "dynamo-unbind"])
def test_packed_heads_become_a_split_and_three_head_splits(text):
    m = parse(text)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report, RULE)
    assert _ops(out) == Counter({"Split": 1, "Reshape": 3, "Transpose": 3})
    assert all(n.attribute[0].ints == [0, 2, 1, 3] for n in out.graph.node if n.op_type == "Transpose")
    for batch in (1, 3):
        same_at(m, out, {"batch": batch})


def test_a_fourth_reader_of_the_packed_heads_is_refused():
    m = parse(GATHERED.replace("=> (float[batch,2,5,4] q,", "=> (float[3,batch,2,5,4] p2, float[batch,2,5,4] q,")
              .replace("v = Gather <axis = 0> (p, i2)", "v = Gather <axis = 0> (p, i2)\n    p2 = Neg(p)"))
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert any("also read by Neg" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_two_parts_only_are_refused():
    m = parse(GATHERED.replace(", float[batch,2,5,4] v)", ")").replace("    v = Gather <axis = 0> (p, i2)\n", ""))
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert any("exactly q, k and v" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_a_target_that_is_not_three_parts_is_refused():
    m = parse(GATHERED.replace("{0, 0, 3, 2, 4}", "{0, 0, 2, 3, 4}")
              .replace("    v = Gather <axis = 0> (p, i2)\n", "").replace(", float[batch,2,5,4] v)", ")")
              .replace("float[batch,2,5,4] q, float[batch,2,5,4] k", "float[batch,3,5,4] q, float[batch,3,5,4] k"))
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert any("[·, ·, 3, H, D]" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_timm_blocks_get_packed_attention():
    """Two timm ViT blocks (q, k, v by indexing, then by unbind): every attention becomes ONNX Runtime's
    packed ``Attention`` with the qkv Linear's weight; before this rule contrib-attention took the heads
    only "as given" and left them decomposed in float32."""
    import onnxfuse

    path = TESTDATA / "timm_vit_blocks_opset17.onnx"
    if not path.exists():
        pytest.skip("timm_vit_blocks_opset17.onnx not in testdata/ (testdata/export_fusion_models.py)")
    model = onnx.load(str(path))
    out = onnxfuse.optimize(model, validate=False, bench=False, target="contrib").model
    ops = _ops(out)
    assert ops["Attention"] == 2 and "Softmax" not in ops and "Gather" not in ops, ops
    for batch in (1, 3):  # the fused kernel sums in its own order: float32 rounding, not exact
        assert_same(model, out, rtol=1e-4, atol=1e-5, dims={"batch": batch})
    skipped = onnxfuse.optimize(model, validate=False, bench=False, target="contrib", skip=RULE.name).model
    assert "Attention" not in _ops(skipped)  # what the rule makes possible
