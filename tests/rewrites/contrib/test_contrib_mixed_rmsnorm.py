"""contrib-mixed-rmsnorm: a float32 RMSNorm (and its residual Add) cast to float16 before γ → ai.onnxfuse
MixedRMSNorm.

Two levels, each against an independent reference: the op itself (ONNX Runtime's CPU provider running
the library's CPU kernel) against NumPy computing the contract (float32 sum and statistics, the result
rounded to γ's type before γ multiplies) over float32, float16 and bfloat16 x and γ, with and without
skip and sum; and the rule on graphs of the sdpa export's forms (a residual Add of a float16 Cast and
the float32 stream, the stream's float32 start from the float16 embeddings, no γ) against the original
graph on ONNX Runtime, plus its refusals. The CUDA kernel runs the same op cases in
tests/gpu/test_mixed_rmsnorm_gpu.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

import helpers
from contrib_testlib import fuse, ops, parse, refusals
from onnxfuse.custom_ops import DOMAIN, session_options
from onnxfuse.rewrites.contrib.contrib_mixed_rmsnorm import ContribMixedRmsNorm
from onnxfuse.rewrites.contrib.contrib_rmsnorm import ContribRmsNorm
from onnxfuse.rewrites.contrib.contrib_skip_rmsnorm import ContribSkipRmsNorm
from test_contrib_rmsnorm import EPS, rms_body

MIXED, SKIP, RMS = ContribMixedRmsNorm(), ContribSkipRmsNorm(), ContribRmsNorm()
MIXED_OP = f"{DOMAIN}:MixedRMSNorm"
D = 8
GAMMA16 = (np.random.default_rng(1).random(D) + 0.5).astype(np.float16)
NP = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16}


def run_with_library(model, feeds, provider="CPUExecutionProvider"):
    sess = ort.InferenceSession(model.SerializeToString(), session_options(), providers=[provider])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


# --- the op ----------------------------------------------------------------------------------------------


def op_model(x_type, gamma_type, skip: bool, with_sum: bool, eps=EPS):
    """One MixedRMSNorm node; bfloat16 x or γ (which numpy cannot hand to ONNX Runtime) behind float32 Casts,
    y cast back to float32."""
    nodes, inputs = [], []

    def typed(name, t):
        if t != TP.BFLOAT16:
            inputs.append(h.make_tensor_value_info(name, t, None))
            return name
        inputs.append(h.make_tensor_value_info(name, TP.FLOAT, None))
        nodes.append(h.make_node("Cast", [name], [f"{name}_bf16"], to=TP.BFLOAT16))
        return f"{name}_bf16"

    names = [typed("x", x_type)] + ([typed("skip", TP.FLOAT)] if skip else []) + [typed("gamma", gamma_type)]
    y = "y_bf16" if gamma_type == TP.BFLOAT16 else "y"
    nodes.append(h.make_node("MixedRMSNorm", names, [y] + (["sum"] if with_sum else []), domain=DOMAIN,
                             spec=f"epsilon={eps!r}"))
    if gamma_type == TP.BFLOAT16:
        nodes.append(h.make_node("Cast", ["y_bf16"], ["y"], to=TP.FLOAT))
    outputs = [h.make_tensor_value_info("y", TP.FLOAT if gamma_type == TP.BFLOAT16 else gamma_type, None)]
    outputs += [h.make_tensor_value_info("sum", TP.FLOAT, None)] if with_sum else []
    graph = h.make_graph(nodes, "g", inputs, outputs)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)], ir_version=8)


def round_to(values, t):
    """float32 values rounded to element type t (to nearest even), as float32."""
    v = np.asarray(values, np.float32)
    if t == TP.FLOAT16:
        return v.astype(np.float16).astype(np.float32)
    if t == TP.BFLOAT16:
        u = v.view(np.uint32).astype(np.uint64)
        return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return v


def op_feeds(x_type, gamma_type, skip, shape, seed=0, scale=1.0):
    """Inputs holding values representable in their types (bfloat16 ones fed as float32)."""
    rng = np.random.default_rng(seed)
    feeds = {"x": round_to(rng.standard_normal(shape) * scale, x_type).astype(NP.get(x_type, np.float32))}
    if skip:
        feeds["skip"] = (rng.standard_normal(shape) * scale).astype(np.float32)
    feeds["gamma"] = round_to(rng.random(shape[-1]) + 0.5, gamma_type).astype(NP.get(gamma_type, np.float32))
    return feeds


def contract(feeds, gamma_type, eps=EPS):
    """(y, sum) as the op's contract states them, in NumPy: s = float(x) + skip in float32, the mean of the
    float32 squares (summed in float64), 1/√(mean + ε) in float32, y = round(round(s · r) · γ)."""
    s = feeds["x"].astype(np.float32) + (feeds["skip"] if "skip" in feeds else np.float32(0))
    mean = (s * s).astype(np.float64).mean(axis=-1, keepdims=True).astype(np.float32)
    inv = np.float32(1) / np.sqrt(mean + np.float32(eps))
    y = round_to(round_to(s * inv, gamma_type) * feeds["gamma"].astype(np.float32), gamma_type)
    return y, s


TYPES = [(TP.FLOAT16, TP.FLOAT16), (TP.FLOAT, TP.FLOAT16), (TP.FLOAT, TP.FLOAT), (TP.FLOAT16, TP.FLOAT),
         (TP.BFLOAT16, TP.BFLOAT16), (TP.FLOAT, TP.BFLOAT16)]


def type_id(pair):
    return "-".join(TP.DataType.Name(t).lower() for t in pair)


@pytest.mark.parametrize("types", TYPES, ids=[type_id(t) for t in TYPES])
@pytest.mark.parametrize("skip", [True, False], ids=["skip", "no-skip"])
@pytest.mark.parametrize("with_sum", [True, False], ids=["sum", "no-sum"])
def test_op_computes_its_contract(types, skip, with_sum):
    x_type, gamma_type = types
    shape = (2, 3, 896)
    feeds = op_feeds(x_type, gamma_type, skip, shape)
    got = run_with_library(op_model(x_type, gamma_type, skip, with_sum), feeds)
    y, s = contract(feeds, gamma_type)
    # y: at most one unit of γ's type in the last place from the contract (the mean's float32 rounding)
    ulp = np.spacing(np.abs(y).astype(NP.get(gamma_type, np.float32))).astype(np.float32)
    if gamma_type == TP.BFLOAT16:
        ulp = np.abs(y) * 2.0 ** -7
    assert np.all(np.abs(got["y"].astype(np.float32) - y) <= ulp), np.abs(got["y"] - y).max()
    assert np.mean(got["y"].astype(np.float32) != y) < 0.01
    if with_sum:
        np.testing.assert_array_equal(got["sum"], s)
    # and the normalization itself, against float64
    exact = s.astype(np.float64) / np.sqrt((s.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS)
    exact *= feeds["gamma"].astype(np.float64)
    tol = {TP.FLOAT: 1e-5, TP.FLOAT16: 2e-3, TP.BFLOAT16: 2e-2}[gamma_type]
    np.testing.assert_allclose(got["y"].astype(np.float64), exact, rtol=tol, atol=tol)


def test_op_rejects_a_gamma_of_another_length_in_one_line():
    feeds = op_feeds(TP.FLOAT16, TP.FLOAT16, True, (2, 8))
    feeds["gamma"] = feeds["gamma"][:5]
    with pytest.raises(Exception, match=r"MixedRMSNorm node.*gamma is \[5\], expected \[8\]"):
        run_with_library(op_model(TP.FLOAT16, TP.FLOAT16, True, True), feeds)


def test_op_rejects_a_spec_without_epsilon():
    m = op_model(TP.FLOAT16, TP.FLOAT16, False, False)
    m.graph.node[0].attribute[0].s = b"eps=1e-6"
    with pytest.raises(Exception, match="unknown spec key 'eps'"):
        run_with_library(m, op_feeds(TP.FLOAT16, TP.FLOAT16, False, (2, 8)))


# --- the rule ----------------------------------------------------------------------------------------------

TAIL = "c = Cast <to = 10> (n)\ny = Mul(c, gamma)"


def sdpa_layer(opset=17, tail=TAIL, extra=""):
    """The sdpa export's RMSNorm after the MLP: the float16 MLP output cast to float, added to the float32
    residual stream (read on by the next residual Add, z), normalized in float32, cast to float16, γ."""
    body = f"""
        a32 = Cast <to = 1> (a)
        s = Add(res, a32)
        {rms_body(x="s", tail=tail, opset=opset)}
        z = Add(s, res)
        {extra}
    """
    return parse(f"g (float16[2,5,{D}] a, float[2,5,{D}] res) => (float16[2,5,{D}] y, float[2,5,{D}] z) {{\n{body}\n}}",
                 opset=opset, inits={"gamma": GAMMA16})


def assert_like_original(original, fused, feeds, exact=("z",)):
    want, got = helpers.run_ort(original, feeds), run_with_library(fused, feeds)
    for name in exact:  # the residual stream: the Add's own value
        np.testing.assert_array_equal(got[name], want[name])
    y, ref = got["y"].astype(np.float32), want["y"].astype(np.float32)
    assert np.all(np.abs(y - ref) <= np.spacing(np.abs(ref).astype(np.float16)).astype(np.float32)), np.abs(y - ref).max()


@pytest.mark.parametrize("opset", [14, 17])
def test_residual_rmsnorm_cast_to_float16_becomes_one_kernel(opset):
    m = sdpa_layer(opset)
    out, report = fuse(m, MIXED, SKIP, RMS)
    assert report.counts[MIXED.name] == 1, refusals(report)
    assert ops(out) == {MIXED_OP: 1, "Add": 1}, ops(out)
    node = next(n for n in out.graph.node if n.op_type == "MixedRMSNorm")
    assert list(node.input) == ["a", "res", node.input[2]] and list(node.output) == ["y", "s"]  # the Cast absorbed
    assert node.domain == DOMAIN
    feeds = {"a": np.random.default_rng(0).standard_normal((2, 5, D)).astype(np.float16),
             "res": np.random.default_rng(1).standard_normal((2, 5, D)).astype(np.float32)}
    assert_like_original(m, out, feeds)


def test_the_float32_stream_starting_at_a_cast_becomes_the_sum_output():
    # The first layer: the float16 embeddings cast to float start the residual stream (read by the first
    # residual Add) and are normalized: the op reads the float16 tensor and writes the float32 start.
    body = f"""
        x32 = Cast <to = 1> (e)
        {rms_body(x="x32", tail=TAIL)}
        z = Add(x32, res)
    """
    m = parse(f"g (float16[2,5,{D}] e, float[2,5,{D}] res) => (float16[2,5,{D}] y, float[2,5,{D}] z) {{\n{body}\n}}",
              inits={"gamma": GAMMA16})
    out, report = fuse(m, MIXED, SKIP, RMS)
    assert report.counts[MIXED.name] == 1, refusals(report)
    assert ops(out) == {MIXED_OP: 1, "Add": 1}, ops(out)
    node = next(n for n in out.graph.node if n.op_type == "MixedRMSNorm")
    assert list(node.input)[0] == "e" and len(node.input) == 2 and list(node.output) == ["y", "x32"]
    feeds = {"e": np.random.default_rng(2).standard_normal((2, 5, D)).astype(np.float16),
             "res": np.random.default_rng(3).standard_normal((2, 5, D)).astype(np.float32)}
    assert_like_original(m, out, feeds)


def test_a_float16_result_read_by_no_gamma_gets_ones():
    m = parse(f"g (float[2,5,{D}] x) => (float16[2,5,{D}] y) {{\n{rms_body(x='x', tail='y = Cast <to = 10> (n)')}\n}}",
              inits={})
    out, report = fuse(m, MIXED, SKIP, RMS)
    assert report.counts[MIXED.name] == 1, refusals(report)
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 5, D)).astype(np.float32)}
    assert_like_original(m, out, feeds, exact=())


def test_refusals_leave_the_other_rules_their_patterns():
    # γ inside the float32 island (multiplied before the cast): another rounding, refused
    island_gamma = "g32 = Mul(n, gamma32)\ny = Cast <to = 10> (g32)"
    m = parse(f"g (float[2,5,{D}] x) => (float16[2,5,{D}] y) {{\n{rms_body(x='x', tail=island_gamma)}\n}}",
              inits={"gamma32": GAMMA16.astype(np.float32)})
    _, report = fuse(m, MIXED)
    assert report.counts[MIXED.name] == 0
    assert any("inside the float32 island" in r for r in refusals(report, MIXED)), refusals(report)
    # a cast to bfloat16: refused (no bfloat16 constants in the rewrite engine)
    m = parse(f"g (float[2,5,{D}] x) => (bfloat16[2,5,{D}] y) {{\n{rms_body(x='x', tail='y = Cast <to = 16> (n)')}\n}}",
              inits={})
    _, report = fuse(m, MIXED)
    assert any("one Cast to float16" in r for r in refusals(report, MIXED)), refusals(report)
    # the eager export's float16 island (float16 residual stream): contrib-skip-rmsnorm's
    body = f"s = Add(a, b)\n{rms_body(x='s', island=True, tail=TAIL)}\nz = Add(s, a)"
    m = parse(f"g (float16[2,5,{D}] a, float16[2,5,{D}] b) => (float16[2,5,{D}] y, float16[2,5,{D}] z) {{\n{body}\n}}",
              inits={"gamma": GAMMA16})
    out, report = fuse(m, MIXED, SKIP, RMS)
    assert report.counts[MIXED.name] == 0 and report.counts[SKIP.name] == 1, refusals(report)
    assert any("float16 island" in r for r in refusals(report, MIXED)), refusals(report)


def test_the_sdpa_export_takes_one_kernel_per_norm_and_only_on_cuda():
    """The float16 sdpa decoder (float32 residual stream): all five RMSNorms (two per layer and the final one)
    become MixedRMSNorm, none is left to SkipSimplifiedLayerNormalization or a ReduceMean, and the target
    ``contrib`` (no ai.onnxfuse ops) keeps ONNX Runtime's ops. The outputs against a float64 reference:
    tests/rewrites/contrib/test_kv_cache_float64.py."""
    import onnxfuse

    model = helpers.load_testdata("qwen2_sdpa_kv_opset14_fp16")
    cuda = onnxfuse.optimize(model, validate=False)
    found = ops(cuda.model)
    assert found[MIXED_OP] == 5 and found["com.microsoft:SkipSimplifiedLayerNormalization"] == 0, found
    assert found["ReduceMean"] == 0
    contrib = onnxfuse.optimize(model, target="contrib", validate=False)
    assert ops(contrib.model)[MIXED_OP] == 0 and MIXED.name not in contrib.applied.counts
