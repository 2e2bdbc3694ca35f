"""repeat-heads-gather: transformers' repeat_kv (Unsqueeze → Expand → Reshape) → one Gather, bitwise equal;
Expands and Reshapes that do something else stay."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_testlib import fuse, ops, parse, refusals

import helpers
from onnxfuse.rewrites.fold.repeat_heads_gather import RepeatHeadsGather

RULE = RepeatHeadsGather()


def repeat_model(expand_target="dyn", reshape_target="[0, 6, -1, 4]", axis=2, dims="B,2,L,4", out="B,6,L,4"):
    """x [B, 2, L, 4] with each head repeated 3 times; the Expand's target read from x's Shape (as the
    exporter writes it) or a given constant."""
    if expand_target == "dyn":
        target = """
            s = Shape(x)
            b = Gather <axis = 0> (s, i0)
            l = Gather <axis = 0> (s, i2)
            bu = Unsqueeze(b, ax0)
            lu = Unsqueeze(l, ax0)
            t = Concat <axis = 0> (bu, c2, c3, lu, c4)
        """
    else:
        target = f"t = Constant <value = int64[5] {expand_target}> ()"
    body = f"""
        u = Unsqueeze(x, ua)
        {target}
        e = Expand(u, t)
        r = Constant <value = int64[4] {reshape_target.replace('[', '{').replace(']', '}')}> ()
        y = Reshape(e, r)
    """
    return parse(f"g (float[{dims}] x) => (float[{out}] y) {{\n{body}\n}}",
                 inits={"ua": np.array([axis], np.int64), "i0": np.array(0, np.int64), "i2": np.array(2, np.int64),
                        "ax0": np.array([0], np.int64), "c2": np.array([2], np.int64),
                        "c3": np.array([3], np.int64), "c4": np.array([4], np.int64)})


def _x(b=2, length=5):
    return np.random.default_rng(b * length).standard_normal((b, 2, length, 4)).astype(np.float32)


def test_repeat_kv_becomes_one_gather():
    m = repeat_model()
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report)
    assert ops(out)["Gather"] >= 1 and "Expand" not in ops(out) and "Reshape" not in ops(out), ops(out)
    x = _x()
    want, got = helpers.run_ort(m, {"x": x})["y"], helpers.run_ort(out, {"x": x})["y"]
    assert np.array_equal(want, got)
    assert np.array_equal(got[:, 4], x[:, 1])  # head 4 is key/value head 4 // 3


@pytest.mark.parametrize("reshape_target", ["[2, 6, 5, 4]", "[-1, 6, 5, 4]", "[0, 6, 5, -1]"])
def test_constant_expand_target(reshape_target):
    m = repeat_model(expand_target="{2, 2, 3, 5, 4}", reshape_target=reshape_target, dims="2,2,5,4", out="2,6,5,4")
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report)
    x = _x()
    assert np.array_equal(helpers.run_ort(m, {"x": x})["y"], helpers.run_ort(out, {"x": x})["y"])


@pytest.mark.parametrize("kwargs, reason", [
    (dict(expand_target="{2, 2, 5, 3, 4}", reshape_target="[0, 2, -1, 4]", axis=3), "does not merge"),
    (dict(expand_target="{2, 2, 3, 5, 4}", reshape_target="[0, 2, -1, 4]"), "does not merge"),
    (dict(expand_target="{2, 2, 3, 5, 4}", reshape_target="[0, 6, 0, 4]"), "changes another dimension"),
    (dict(expand_target="{2, 2, 3, 5, 4}", reshape_target="[0, 6, -1, 4]", dims="2,2,1,4"), "another axis"),
], ids=["length-repeated", "not-merged", "copies-the-repeat", "broadcasts-length"])
def test_other_expands_and_reshapes_stay(kwargs, reason):
    kwargs.setdefault("dims", "2,2,5,4")
    m = repeat_model(out="a,b,c,d", **kwargs)  # the refused cases compute other shapes
    out, report = fuse(m, RULE, infer=False)
    assert report.counts[RULE.name] == 0
    assert any(reason in r for r in refusals(report, RULE)), refusals(report, RULE)
    assert "Expand" in ops(out)


def cache_repeat_model(length_terms=("pk", "ids"), dims="B,2,P,4", new="B,2,S,4"):
    """The dynamo KV-cache export's repeat_kv: x = Concat(past, new) along the length, the Expand's target
    length ``Shape(a)[2] + Shape(b)[1]`` read from other inputs (another layer's past, the ids)."""
    a, b = length_terms
    body = f"""
        x = Concat <axis = 2> (past, fresh)
        u = Unsqueeze(x, ua)
        s = Shape(past)
        bt = Gather <axis = 0> (s, i0)
        pl = Shape <start = 2, end = 3> ({a})
        sl = Shape <start = 1, end = 2> ({b})
        tl = Add(pl, sl)
        bu = Unsqueeze(bt, ax0)
        t = Concat <axis = 0> (bu, c2, c3, tl, c4)
        e = Expand(u, t)
        r = Concat <axis = 0> (bu, c6, tl, c4)
        y = Reshape(e, r)
    """
    return parse(f"g (float[{dims}] past, float[{new}] fresh, float[B,2,P,4] pk, int64[B,S] ids) => "
                 f"(float[B,6,T,4] y) {{\n{body}\n}}",
                 inits={"ua": np.array([2], np.int64), "i0": np.array(0, np.int64), "ax0": np.array([0], np.int64),
                        "c2": np.array([2], np.int64), "c3": np.array([3], np.int64),
                        "c4": np.array([4], np.int64), "c6": np.array([6], np.int64)})


def test_a_cache_length_summed_from_shapes_is_proved_by_the_concat():
    m = cache_repeat_model()
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report, RULE)
    rng = np.random.default_rng(7)
    feeds = {"past": rng.standard_normal((2, 2, 3, 4)).astype(np.float32),
             "fresh": rng.standard_normal((2, 2, 5, 4)).astype(np.float32),
             "pk": np.zeros((2, 2, 3, 4), np.float32), "ids": np.zeros((2, 5), np.int64)}
    want, got = helpers.run_ort(m, feeds)["y"], helpers.run_ort(out, feeds)["y"]
    assert np.array_equal(want, got)


@pytest.mark.parametrize("kwargs", [
    dict(length_terms=("pk", "pk")),  # P + P: not the Concat's P + S
    dict(new="B,2,Q,4"),  # the new part's length is not the ids' S
], ids=["wrong-sum", "other-name"])
def test_a_summed_length_that_is_not_the_concats_is_refused(kwargs):
    out, report = fuse(cache_repeat_model(**kwargs), RULE, infer=False)
    assert report.counts[RULE.name] == 0, refusals(report, RULE)
    assert "Expand" in ops(out)
