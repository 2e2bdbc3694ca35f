"""contrib-skip-rmsnorm and contrib-rmsnorm: decomposed RMSNorm → com.microsoft
SkipSimplifiedLayerNormalization / ONNX RMSNormalization, checked against a float64 numpy reference on
ONNX Runtime's CPU provider."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from contrib_testlib import fuse, ops, parse, refusals

import helpers
import onnxfuse
from onnxfuse.rewrites.contrib.contrib_rmsnorm import ContribRmsNorm
from onnxfuse.rewrites.contrib.contrib_skip_rmsnorm import ContribSkipRmsNorm

RMS, SKIP = ContribRmsNorm(), ContribSkipRmsNorm()
SKIP_OP, RMS_OP = "com.microsoft:SkipSimplifiedLayerNormalization", "RMSNormalization"
D = 8
RNG = np.random.default_rng(0)
GAMMA = (RNG.random(D) + 0.5).astype(np.float32)
EPS = 1e-6

SQUARES = {"pow": "two = Constant <value = float {2.0}> ()\nsq = Pow(x32, two)", "mul": "sq = Mul(x32, x32)"}
NORMS = {
    "reciprocal": "r = Reciprocal(sd)\nn = Mul(x32, r)",  # torch's dynamo exporter
    "div-one": "one = Constant <value = float {1.0}> ()\nr = Div(one, sd)\nn = Mul(r, x32)",  # TorchScript's rsqrt
    "div": "n = Div(x32, sd)",
}


def rms_body(x="x", square=SQUARES["pow"], norm=NORMS["reciprocal"], tail="y = Mul(gamma, n)",
             axes=(-1,), island=False, opset=17):
    """The RMSNorm of ``x``; ``island``: x is float16, computed in float32 (``x32 = Cast(x)``). The
    reduction axes as an attribute below opset 18, as a constant input from 18 on."""
    if not island:  # x itself is the float32 operand
        square, norm = square.replace("x32", x), norm.replace("x32", x)
    head = f"x32 = Cast <to = 1> ({x})" if island else ""
    listed = ", ".join(str(a) for a in axes)
    reduce = (f"var = ReduceMean <axes = [{listed}]> (sq)" if opset < 18 else
              f"ax = Constant <value = int64[{len(axes)}] {{{listed}}}> ()\nvar = ReduceMean(sq, ax)")
    return f"""
        {head}
        {square}
        {reduce}
        eps = Constant <value = float {{{EPS}}}> ()
        ve = Add(var, eps)
        sd = Sqrt(ve)
        {norm}
        {tail}
    """


def model(body, opset=17, inputs="float[2,5,8] x", outputs="float[2,5,8] y", inits=None):
    return parse(f"g ({inputs}) => ({outputs}) {{\n{body}\n}}", opset=opset,
                 inits={"gamma": GAMMA} if inits is None else inits)


def reference(x, gamma=GAMMA, eps=EPS):
    """x / √(mean(x²) + ε) · γ over the last axis, in float64."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(gamma, np.float64)


def run(m, feeds):
    return helpers.run_ort(m, feeds)


def feeds_for(m, seed=0, scale=1.0):
    return {k: (v * scale).astype(v.dtype) for k, v in helpers.random_feeds(m, seed=seed, dim=3).items()}


# --- standalone: RMSNormalization at opset 23 -----------------------------------------------------------


@pytest.mark.parametrize("square", SQUARES)
@pytest.mark.parametrize("norm", NORMS)
def test_rmsnorm_forms_become_rmsnormalization(square, norm):
    m = model(rms_body(square=SQUARES[square], norm=NORMS[norm], opset=23), opset=23)
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 1, refusals(report)
    assert ops(out) == {RMS_OP: 1}, ops(out)
    node = next(n for n in out.graph.node if n.op_type == RMS_OP)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -1 and attrs["stash_type"] == 1 and attrs["epsilon"] == pytest.approx(EPS, rel=1e-6)
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds_for(m)
    np.testing.assert_allclose(run(out, feeds)["y"], reference(feeds["x"]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tail", ["y = Mul(n, gamma)", "y = Identity(n)"], ids=["gamma-swapped", "no-gamma"])
def test_rmsnorm_gamma_order_and_absent_gamma(tail):
    m = model(rms_body(tail=tail, opset=23), opset=23)
    out, report = fuse(m, RMS)
    assert ops(out)[RMS_OP] == 1, refusals(report)
    feeds = feeds_for(m)
    gamma = GAMMA if "gamma" in tail else np.ones(D)
    np.testing.assert_allclose(run(out, feeds)["y"], reference(feeds["x"], gamma), rtol=1e-5, atol=1e-5)


def test_rmsnorm_opset18_axes_input_raises_the_opset_to_23():
    # ReduceMean's axes as an input (opset 18); every op of the model means the same at 23, so the
    # opset is raised and the model stays valid for onnx.checker.
    m = model(rms_body(opset=18), opset=18)
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 1, refusals(report)
    assert {o.domain: o.version for o in out.opset_import}[""] == 23
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds_for(m)
    np.testing.assert_allclose(run(out, feeds)["y"], reference(feeds["x"]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma_inside", [False, True], ids=["gamma-after-cast", "gamma-in-island"])
def test_rmsnorm_float16_with_float32_island(gamma_inside):
    # Llama / T5: Cast(x, float) ... Cast(·, half) then γ (float16); or γ (float32) inside the island.
    if gamma_inside:
        tail, gamma = "g = Mul(gamma, n)\ny = Cast <to = 10> (g)", GAMMA
    else:
        tail, gamma = "c = Cast <to = 10> (n)\ny = Mul(gamma, c)", GAMMA.astype(np.float16)
    m = model(rms_body(island=True, tail=tail, opset=23), opset=23, inputs="float16[2,5,8] x",
              outputs="float16[2,5,8] y", inits={"gamma": gamma})
    out, report = fuse(m, SKIP, RMS)
    assert ops(out) == {RMS_OP: 1}, refusals(report)
    assert out.graph.node[0].input[0] == "x"  # reads the float16 input: no Cast left
    feeds = feeds_for(m)
    got = run(out, feeds)["y"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), reference(feeds["x"], GAMMA), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("opset", [17, 23])
def test_t5_form_with_its_own_upcast_for_the_product(opset):
    # T5LayerNorm: v from x.to(float32), then x * rsqrt(v + ε) with x float16: the product reads a second
    # Cast(x, float); the result is cast back and γ applied in float16. As the residual-free first norm
    # (opset 23) and after a residual Add (opset 17, SkipSimplifiedLayerNormalization).
    norm = "one = Constant <value = float {1.0}> ()\nr = Div(one, sd)\nxb = Cast <to = 1> (x)\nn = Mul(xb, r)"
    tail = "c = Cast <to = 10> (n)\ny = Mul(gamma, c)"
    body = rms_body(island=True, norm=norm, tail=tail, opset=opset)
    inits = {"gamma": GAMMA.astype(np.float16)}
    if opset == 23:
        m = model(body, opset=23, inputs="float16[2,5,8] x", outputs="float16[2,5,8] y", inits=inits)
    else:
        m = parse("g (float16[2,5,8] a, float16[2,5,8] b) => (float16[2,5,8] y) {\nx = Add(a, b)\n" + body + "\n}",
                  opset=opset, inits=inits)
    out, report = fuse(m, SKIP, RMS)
    assert ops(out) == ({RMS_OP: 1} if opset == 23 else {SKIP_OP: 1}), refusals(report)
    feeds = feeds_for(m)
    x = feeds["x"] if opset == 23 else feeds["a"] + feeds["b"]
    np.testing.assert_allclose(run(out, feeds)["y"].astype(np.float64), reference(x, GAMMA.astype(np.float16)),
                               rtol=2e-3, atol=2e-3)


def test_rmsnorm_below_opset23_raises_when_only_its_own_nodes_would_change():
    # Opset 17: the pattern's own ReduceMean (axes moved to an input at 18) goes with the rewrite, so the
    # raise to 23 changes no node that stays.
    m = model(rms_body(), opset=17)
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 1 and ops(out)["RMSNormalization"] == 1 and ops(out)["ReduceMean"] == 0
    assert [o.version for o in out.opset_import if o.domain in ("", "ai.onnx")] == [23]
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    np.testing.assert_allclose(run(out, {"x": x})["y"], reference(x), rtol=1e-5, atol=1e-5)


def test_rmsnorm_below_opset23_is_refused_when_another_node_would_change():
    # A Split with no sizes (equal parts) means something else from 18 (it then needs num_outputs): the
    # raise is refused, the norm stays, and SimplifiedLayerNormalization would make a checker-valid model
    # invalid.
    body = rms_body() + "\n        left, right = Split <axis = -1> (x)"
    m = model(body, opset=17, outputs="float[2,5,8] y, float[2,5,4] left, float[2,5,4] right")
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 0
    assert any("RMSNormalization needs opset 23" in r and "Split" in r and "onnx.checker" in r
               for r in refusals(report, RMS)), refusals(report)
    assert ops(out)["ReduceMean"] == 1


def test_rmsnorm_below_opset23_raises_past_another_reducemean_by_moving_its_axes():
    # Another ReduceMean (not the norm's) takes its axes as an input from 18 (engine/opset.py): the raise
    # moves them there, so the norm fuses and the other mean still reduces the last axis.
    body = rms_body() + "\n        other = ReduceMean <axes = [-1]> (x)"
    m = model(body, opset=17, outputs="float[2,5,8] y, float[2,5,1] other")
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 1 and ops(out)["ReduceMean"] == 1
    assert [o.version for o in out.opset_import if o.domain in ("", "ai.onnx")] == [23]
    (mean,) = [n for n in out.graph.node if n.op_type == "ReduceMean"]
    assert len(mean.input) == 2 and not any(a.name == "axes" for a in mean.attribute)
    onnx.checker.check_model(out, full_check=True)
    x = np.random.default_rng(2).standard_normal((2, 5, 8)).astype(np.float32)
    got = run(out, {"x": x})
    np.testing.assert_allclose(got["y"], reference(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["other"], x.mean(-1, keepdims=True), rtol=1e-6, atol=1e-6)


def _second_norm(x="z", tail="w = Mul(gamma, n)"):
    """Another RMSNorm, of ``x`` into ``w``, its intermediates renamed (``_b``)."""
    import re
    body = rms_body(x=x, tail=tail)
    return re.sub(r"\b(two|sq|var|eps|ve|sd|r|n)\b", r"\1_b", body)


def test_rmsnorm_several_below_opset23_raise_together():
    # Qwen3's per-head q/k RMSNorms beside the layer norms: alone, each one's raise to 23 is blocked by the
    # others' ReduceMeans; all of them go in the same pass, so together they block nothing. Here a norm
    # over [B, S, E] and a per-head one over [B, S, H, D], opset 17, against a float64 reference.
    body = rms_body() + _second_norm()
    m = model(body, opset=17, inputs="float[2,5,8] x, float[2,5,3,8] z", outputs="float[2,5,8] y, float[2,5,3,8] w")
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 2 and ops(out)["RMSNormalization"] == 2 and ops(out)["ReduceMean"] == 0
    assert [o.version for o in out.opset_import if o.domain in ("", "ai.onnx")] == [23]
    onnx.checker.check_model(out, full_check=True)
    rng = np.random.default_rng(1)
    x, z = rng.standard_normal((2, 5, 8)).astype(np.float32), rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    got = run(out, {"x": x, "z": z})
    np.testing.assert_allclose(got["y"], reference(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["w"], reference(z), rtol=1e-5, atol=1e-5)


def test_rmsnorm_several_below_opset23_one_refused_the_other_raises():
    # The second norm's γ varies outside the last axis (refused): its ReduceMean stays and takes its axes
    # as an input at 23, so the first norm fuses; both outputs as before.
    gamma2 = (RNG.random((5, D)) + 0.5).astype(np.float32)
    body = rms_body() + _second_norm(tail="w = Mul(gamma2, n)")
    m = model(body, opset=17, inputs="float[2,5,8] x, float[2,5,8] z", outputs="float[2,5,8] y, float[2,5,8] w",
              inits={"gamma": GAMMA, "gamma2": gamma2})
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 1 and ops(out)["ReduceMean"] == 1
    assert any("varies outside the last axis" in r for r in refusals(report, RMS)), refusals(report, RMS)
    rng = np.random.default_rng(3)
    x, z = rng.standard_normal((2, 5, 8)).astype(np.float32), rng.standard_normal((2, 5, 8)).astype(np.float32)
    got = run(out, {"x": x, "z": z})
    np.testing.assert_allclose(got["y"], reference(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["w"], reference(z, gamma=gamma2), rtol=1e-5, atol=1e-5)


def test_rmsnorm_simplified_layernorm_only_where_the_model_already_has_ort_onnx_domain_ops():
    # An onnxruntime-genai-style model already holds SimplifiedLayerNormalization in the ONNX domain (it
    # fails onnx.checker that way already): the RMSNorm becomes one too, checked as ONNX Runtime reads it.
    from onnxfuse import repair
    from onnxfuse.model_io import to_graph, to_model
    from onnxfuse.rewrites import apply_rules

    text = ("g (float[2,5,8] x) => (float[2,5,8] z) {\n" + rms_body() +
            "\nz = SimplifiedLayerNormalization <axis = -1, epsilon = 1e-6> (y, gamma)\n}")
    m = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : 17]>\n{text}')
    m.graph.initializer.append(onnx.numpy_helper.from_array(GAMMA, "gamma"))
    graph = to_graph(onnx.shape_inference.infer_shapes(m))
    report = apply_rules(graph, [SKIP, RMS])
    out = to_model(graph, m)
    assert report.counts[RMS.name] == 1, refusals(report)
    assert [n.op_type for n in out.graph.node].count("SimplifiedLayerNormalization") == 2
    assert repair.validity_problem(out) is None
    feeds = feeds_for(m)
    y = reference(feeds["x"])
    np.testing.assert_allclose(run(out, feeds)["z"], reference(y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs,why",
    [
        ({"axes": (1,)}, "not the last axis only"),
        ({"square": "three = Constant <value = float {3.0}> ()\nsq = Pow(x32, three)"}, "not x²"),
        ({"norm": "n = Div(sd, x32)"}, "is divided, not the divisor"),
    ],
    ids=["axes-not-last", "cube", "division-reversed"],
)
def test_rmsnorm_near_misses_are_refused(kwargs, why):
    m = model(rms_body(**kwargs, opset=23), opset=23)
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 0
    assert any(why in r for r in refusals(report, RMS)), refusals(report)


def test_rmsnorm_intermediate_read_elsewhere_is_refused():
    m = model(rms_body(opset=23), opset=23, outputs="float[2,5,8] y, float[2,5,1] var")
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 0
    assert any("graph output" in r or "read" in r for r in refusals(report, RMS)), refusals(report)


def test_rmsnorm_gamma_varying_outside_the_last_axis_is_refused():
    gamma = (RNG.random((5, D)) + 0.5).astype(np.float32)
    m = model(rms_body(opset=23), opset=23, inits={"gamma": gamma})
    out, report = fuse(m, SKIP, RMS)
    assert report.counts[RMS.name] == 0
    assert any("varies outside the last axis" in r for r in refusals(report, RMS)), refusals(report)


def test_rmsnorm_runtime_gamma_stays_outside_the_fused_op():
    # γ given at run time is no constant: the normalization fuses alone and the Mul stays after it.
    m = parse("g (float[2,5,8] x, float[8] gamma) => (float[2,5,8] y) {\n" + rms_body(opset=23) + "\n}", opset=23)
    out, report = fuse(m, RMS)
    assert report.counts[RMS.name] == 1, refusals(report)
    assert ops(out)["Mul"] == 1 and ops(out)[RMS_OP] == 1
    feeds = feeds_for(m)
    np.testing.assert_allclose(run(out, feeds)["y"], reference(feeds["x"], feeds["gamma"]), rtol=1e-5, atol=1e-5)


# --- residual: SkipSimplifiedLayerNormalization --------------------------------------------------------------


def skip_model(island=False, extra_out="", shapes=("a", "b"), opset=17, tail=None, after=""):
    t = "float16" if island else "float"
    if tail is None:
        tail = "c = Cast <to = 10> (n)\ny = Mul(gamma, c)" if island else "y = Mul(gamma, n)"
    inputs = ", ".join(f"{t}[2,5,8] {s}" if s in ("a", "b") else s for s in shapes)
    gamma = GAMMA.astype(np.float16) if island else GAMMA
    return parse(f"g ({inputs}) => ({t}[2,5,8] y{extra_out}) {{\ns = Add(a, b)\n"
                 + rms_body(x="s", island=island, tail=tail, opset=opset) + f"\n{after}\n}}", opset=opset, inits={"gamma": gamma})


# --- real exports (testdata: 2-layer Llama / Qwen2 decoders, 5 RMSNorms each) ------------------------------


@pytest.mark.parametrize("name", ["llama_kv_opset14", "qwen2_kv_opset17_fp16"])
def test_decoder_exports_optimize_and_validate(name):
    result = onnxfuse.optimize(helpers.load_testdata(name), provider="cpu", samples=1)
    assert result.validation.passed
    found = [n.op_type for n in result.model.graph.node]
    assert found.count("SkipSimplifiedLayerNormalization") == 4, result.applied.refusals
    onnx.checker.check_model(result.model, full_check=True)
