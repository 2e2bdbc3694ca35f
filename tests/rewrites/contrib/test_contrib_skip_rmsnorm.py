"""contrib-skip-rmsnorm: a residual Add and the RMSNorm after it → com.microsoft SkipSimplifiedLayerNormalization
(float32 islands included; the residual stream as the op's fourth output); broadcast or constant operands refused."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from contrib_testlib import fuse, ops, parse, refusals
import helpers
from test_contrib_rmsnorm import GAMMA, RMS, SKIP, SKIP_OP, feeds_for, reference, rms_body, run, skip_model


@pytest.mark.parametrize("island", [False, True], ids=["float32", "float16-island"])
@pytest.mark.parametrize("opset", [14, 17])
def test_skip_rmsnorm(island, opset):
    m = skip_model(island=island, opset=opset)
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[SKIP.name] == 1, refusals(report)
    assert ops(out) == {SKIP_OP: 1}, ops(out)
    node = next(n for n in out.graph.node if n.op_type == "SkipSimplifiedLayerNormalization")
    assert list(node.input) == ["a", "b", node.input[2]] and len(node.output) == 1
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds_for(m)
    got = run(out, feeds)["y"].astype(np.float64)
    s = feeds["a"].astype(np.float64) + feeds["b"].astype(np.float64)
    if island:
        s = (feeds["a"] + feeds["b"]).astype(np.float64)  # the Add in float16, as the original computes it
    tol = 2e-3 if island else 1e-5
    np.testing.assert_allclose(got, reference(s), rtol=tol, atol=tol)

@pytest.mark.parametrize("island", [False, True], ids=["float32", "float16-island"])
def test_skip_rmsnorm_residual_stream_is_the_fourth_output(island):
    # A pre-norm decoder reads the residual sum again (the next residual Add; here also a graph output):
    # it becomes the op's input_skip_bias_sum output, the Add's own value.
    t = "float16" if island else "float"
    m = skip_model(island=island, extra_out=f", {t}[2,5,8] z, {t}[2,5,8] s", after="z = Add(s, y)")
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[SKIP.name] == 1, refusals(report)
    node = next(n for n in out.graph.node if n.op_type == "SkipSimplifiedLayerNormalization")
    assert len(node.output) == 4 and node.output[3] == "s" and node.output[1] == node.output[2] == ""
    feeds = feeds_for(m)
    got = run(out, feeds)
    want = run(m, feeds)
    np.testing.assert_array_equal(got["s"], want["s"])  # the residual stream is the Add's own value
    s = (feeds["a"] + feeds["b"]).astype(np.float64)
    tol = 2e-3 if island else 1e-5
    np.testing.assert_allclose(got["y"].astype(np.float64), reference(s), rtol=tol, atol=tol)
    np.testing.assert_allclose(got["z"].astype(np.float64), s + reference(s), rtol=tol, atol=tol)

def test_skip_rmsnorm_refuses_a_broadcast_add_and_rmsnorm_takes_it_alone():
    m = skip_model(shapes=("float[2,5,8] a", "float[1,5,8] b"), opset=23)
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[SKIP.name] == 0 and report.counts[RMS.name] == 1
    assert any("not provably equal" in r for r in refusals(report, SKIP)), refusals(report)
    feeds = feeds_for(m)
    np.testing.assert_allclose(run(out, feeds)["y"], reference(feeds["a"] + feeds["b"]), rtol=1e-5, atol=1e-5)

def test_skip_rmsnorm_refuses_a_constant_operand():
    m = parse("g (float[2,5,8] a) => (float[2,5,8] y) {\ns = Add(a, gamma)\n" + rms_body(x="s") + "\n}",
              opset=17, inits={"gamma": GAMMA})
    out, report = fuse(m, SKIP)
    assert report.counts[SKIP.name] == 0
    assert any("adds a constant" in r for r in refusals(report, SKIP)), refusals(report)

@pytest.mark.parametrize("name", ["llama_kv_opset14", "qwen2_kv_opset17_fp16", "llama_tiny_dynamo_fp16"])
def test_decoder_exports_fuse_four_residual_rmsnorms(name):
    # Per layer: input_layernorm and post_attention_layernorm, then the final norm: 5. Every one but the
    # first (on the embeddings, no residual Add) follows a residual Add → 4 SkipSimplifiedLayerNormalization;
    # the first becomes RMSNormalization: its own ReduceMean was all that kept the opset from 23 (and
    # Cast-19's saturate changes nothing below 19).
    m = helpers.load_testdata(name)
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[SKIP.name] == 4, refusals(report)
    assert report.counts[RMS.name] == 1 and ops(out)["RMSNormalization"] == 1 and ops(out)["ReduceMean"] == 0
    assert [o.version for o in out.opset_import if o.domain in ("", "ai.onnx")] == [23]
    assert ops(out)[SKIP_OP] == 4
    sums = [n for n in out.graph.node if n.op_type == "SkipSimplifiedLayerNormalization" and len(n.output) == 4]
    assert len(sums) == 3  # the last one (the final norm) has no residual stream after it
    onnx.checker.check_model(out, full_check=True)
