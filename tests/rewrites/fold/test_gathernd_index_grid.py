"""gathernd-index-grid: GatherND over a stack of Range grids (transformers 5's ``mask[batch_idx, kv_idx]``
as torch's dynamo exporter writes it) becomes Unsqueeze(Slice(data)).

Every rewrite is compared with the original on ONNX Runtime, exactly, at several sizes (more mask rows
than the batch included); past the mask's rows both fail; the look-alikes are refused.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from contrib_testlib import fuse, parse, refusals

import helpers
from onnxfuse.rewrites.fold.gathernd_index_grid import GatherndIndexGrid

RULE = GatherndIndexGrid()

#: BERT's padding mask from the dynamo export: b = arange(B) on axis 0, l = arange(L) on axis 3 of
#: [B, 1, 1, L], B read from the ids, L from the mask itself
BERT = """
g (int64[b,s] ids, int64[m,s] mask) => (bool[b,1,1,s] y) {
    keep = Cast <to = 9> (mask)
    sb = Shape <start = 0, end = 1> (ids)
    nb = Squeeze(sb)
    sl = Shape <start = 1, end = 2> (mask)
    nl = Squeeze(sl)
    zero = Constant <value = int64 {0}> ()
    one = Constant <value = int64 {1}> ()
    rb = Range(zero, nb, one)
    rl = Range(zero, nl, one)
    a12 = Constant <value = int64[2] {1, 2}> ()
    a01 = Constant <value = int64[2] {0, 1}> ()
    a3 = Constant <value = int64[1] {3}> ()
    a0 = Constant <value = int64[1] {0}> ()
    ub = Unsqueeze(rb, a12)
    ub4 = Unsqueeze(ub, a3)
    ul = Unsqueeze(rl, a01)
    ul4 = Unsqueeze(ul, a0)
    mx = Max(ub4, ul4)
    shp = Shape(mx)
    eb = Expand(ub4, shp)
    el = Expand(ul4, shp)
    last = Constant <value = int64[1] {-1}> ()
    ib = Unsqueeze(eb, last)
    il = Unsqueeze(el, last)
    idx = Concat <axis = -1> (ib, il)
    y = GatherND(keep, idx)
}
"""

#: GPT-2's: a [B, L] grid, b by Reshape(arange(B), [-1, 1]), l a rank-1 arange(L) that the Expand broadcasts;
#: both limits read from the ids, the data a reshaped mask
GPT2 = """
g (int64[b,s] ids, int64[m,s] mask) => (int64[b,s] y) {
    sb = Shape <start = 0, end = 1> (ids)
    nb = Squeeze(sb)
    sl = Shape <start = 1, end = 2> (ids)
    nl = Squeeze(sl)
    t = Constant <value = int64[2] {0, -1}> ()
    flat = Reshape(mask, t)
    zero = Constant <value = int64 {0}> ()
    one = Constant <value = int64 {1}> ()
    rb = Range(zero, nb, one)
    rl = Range(zero, nl, one)
    col = Constant <value = int64[2] {-1, 1}> ()
    vb = Reshape(rb, col)
    mx = Max(vb, rl)
    shp = Shape(mx)
    eb = Expand(vb, shp)
    el = Expand(rl, shp)
    last = Constant <value = int64[1] {-1}> ()
    ib = Unsqueeze(eb, last)
    il = Unsqueeze(el, last)
    idx = Concat <axis = -1> (ib, il)
    y = GatherND(flat, idx)
}
"""


def _feeds(batch, rows, seq, seed=0):
    rng = np.random.default_rng(seed)
    return {"ids": rng.integers(0, 100, (batch, seq)).astype(np.int64),
            "mask": rng.integers(0, 2, (rows, seq)).astype(np.int64)}


def _ops(model) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


@pytest.mark.parametrize("text", [BERT, GPT2], ids=["bert", "gpt2"])
def test_grid_gather_becomes_a_slice(text):
    m = parse(text)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report, RULE)
    ops = _ops(out)
    assert "GatherND" not in ops and "Range" not in ops and "Max" not in ops and ops["Slice"] == 1
    for batch, rows, seq in ((2, 2, 5), (2, 4, 3), (1, 3, 1), (3, 3, 7)):
        feeds = _feeds(batch, rows, seq, seed=batch + rows + seq)
        want, got = helpers.run_ort(m, feeds)["y"], helpers.run_ort(out, feeds)["y"]
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)


def test_the_masks_own_length_is_not_sliced():
    out, report = fuse(parse(BERT), RULE)
    detail = next(d for d in report.details if d["rule"] == RULE.name)
    assert detail["sliced_axes"] == [0] and detail["inserted_axes"] == [1, 2]
    detail = next(d for d in fuse(parse(GPT2), RULE)[1].details if d["rule"] == RULE.name)
    assert detail["sliced_axes"] == [0, 1]  # the reshaped mask's length is not provably the ids'


def test_more_ids_rows_than_mask_rows_fails_in_both():
    m = parse(BERT)
    out, _ = fuse(m, RULE)
    feeds = _feeds(3, 2, 4)
    for model in (m, out):
        with pytest.raises(Exception):
            helpers.run_ort(model, feeds)


def test_grids_in_the_other_order_are_refused():
    # idx = stack(l, b): data[l, b], a transposed read, not a slice in order
    m = parse(BERT.replace("idx = Concat <axis = -1> (ib, il)", "idx = Concat <axis = -1> (il, ib)"))
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0 and _ops(out)["GatherND"] == 1
    assert any("not increasing" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_batch_dims_and_other_indices_are_refused():
    m = parse(BERT.replace("y = GatherND(keep, idx)", "y = GatherND <batch_dims = 1> (keep, idx)")
              .replace("bool[b,1,1,s] y", "bool[b,1,1] y"))
    out, report = fuse(m, RULE, infer=False)
    assert report.counts[RULE.name] == 0
    m = parse(BERT.replace("rl = Range(zero, nl, one)", "two = Constant <value = int64 {2}> ()\n    rl = Range(zero, nl, two)"))
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0 and _ops(out)["GatherND"] == 1
    assert any("not Range(0, n, 1)" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_a_limit_that_may_be_negative_is_refused():
    # n read from an input's values, not a shape: -1 would make the Slice drop the last row, where the
    # original's Range(0, -1) is empty
    m = parse(BERT.replace("g (int64[b,s] ids, int64[m,s] mask)", "g (int64[b,s] ids, int64[m,s] mask, int64 n)")
              .replace("rb = Range(zero, nb, one)", "rb = Range(zero, n, one)"))
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert any("provably a size" in r for r in refusals(report, RULE)), refusals(report, RULE)

