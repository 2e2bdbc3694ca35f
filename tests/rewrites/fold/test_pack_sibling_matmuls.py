"""pack-sibling-matmuls: q, k, v projections of one tensor → one MatMul (+ one Add) + Split, outputs equal to
a float64 reference; packing that would not remove a kernel, or would copy a shared weight, is refused."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from contrib_testlib import fuse, ops, parse, refusals

import helpers
from onnxfuse.rewrites.fold.pack_sibling_matmuls import PackSiblingMatmuls

RULE = PackSiblingMatmuls()
RNG = np.random.default_rng(0)
K, WIDTHS = 8, (8, 4, 4)
WEIGHTS = [RNG.standard_normal((K, n)).astype(np.float32) for n in WIDTHS]
BIASES = [RNG.standard_normal(n).astype(np.float32) for n in WIDTHS]


def projections(count=3, biased=True, opset=17, shared_weight=False):
    lines, inits, outs = [], {}, []
    for i in range(count):
        w = "w0" if shared_weight and i else f"w{i}"
        inits[f"w{i}"] = WEIGHTS[i]
        if biased:
            inits[f"b{i}"] = BIASES[i]
            lines += [f"m{i} = MatMul(x, {w})", f"y{i} = Add(m{i}, b{i})"]
        else:
            lines.append(f"y{i} = MatMul(x, {w})")
        outs.append(f"float[B,S,{WIDTHS[0] if shared_weight else WIDTHS[i]}] y{i}")
    body = "\n".join(lines)
    return parse(f"g (float[B,S,{K}] x) => ({', '.join(outs)}) {{\n{body}\n}}", opset=opset, inits=inits)


def reference(x, count, biased, shared_weight=False):
    out = []
    for i in range(count):
        w = WEIGHTS[0] if shared_weight and i else WEIGHTS[i]
        y = x.astype(np.float64) @ w.astype(np.float64)
        out.append(y + BIASES[i] if biased else y)
    return out


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("count, biased, kernels", [(3, True, 3), (3, False, 2), (2, True, 3)],
                         ids=["qkv-biased", "qkv", "two-biased"])
def test_projections_pack_into_one_matmul_and_split(opset, count, biased, kernels):
    m = projections(count, biased, opset)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report)
    assert ops(out)["MatMul"] == 1 and ops(out)["Split"] == 1 and sum(ops(out).values()) == kernels, ops(out)
    x = RNG.standard_normal((2, 3, K)).astype(np.float32)
    got = helpers.run_ort(out, {"x": x})
    for i, want in enumerate(reference(x, count, biased)):
        np.testing.assert_allclose(got[f"y{i}"], want, rtol=1e-5, atol=1e-5)
    onnx.checker.check_model(out, full_check=True)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(count=2, biased=False), "would not remove a kernel"),
    (dict(count=3, biased=False, shared_weight=True), "fewer than two"),
], ids=["two-unbiased", "shared-weight"])
def test_packing_refused(kwargs, reason):
    m = projections(**kwargs)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert any(reason in r for r in refusals(report, RULE)), refusals(report, RULE)
    assert "Split" not in ops(out)


def test_biases_shared_with_other_adds_pack_too():
    # random-init exports share equal (zero) biases between layers: each group still packs its biases
    inits = {f"w{i}": WEIGHTS[i] for i in range(3)} | {f"v{i}": WEIGHTS[i] * 2 for i in range(3)}
    inits |= {f"b{i}": BIASES[i] for i in range(3)}
    lines = [f"m{i} = MatMul(x, w{i})\ny{i} = Add(m{i}, b{i})\nn{i} = MatMul(x2, v{i})\nz{i} = Add(n{i}, b{i})"
             for i in range(3)]
    outs = ", ".join(f"float[B,S,{WIDTHS[i]}] {v}{i}" for v in "yz" for i in range(3))
    m = parse(f"g (float[B,S,{K}] x, float[B,S,{K}] x2) => ({outs}) {{\n" + "\n".join(lines) + "\n}", inits=inits)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 2 and ops(out)["Add"] == 2 and ops(out)["Split"] == 2, ops(out)
    feeds = {"x": RNG.standard_normal((2, 3, K)).astype(np.float32), "x2": RNG.standard_normal((2, 3, K)).astype(np.float32)}
    got = helpers.run_ort(out, feeds)
    for i in range(3):
        np.testing.assert_allclose(got[f"z{i}"], feeds["x2"].astype(np.float64) @ (WEIGHTS[i] * 2) + BIASES[i], rtol=1e-5, atol=1e-5)
