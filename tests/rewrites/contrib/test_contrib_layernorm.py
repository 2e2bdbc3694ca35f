"""LayerNormalization / SkipLayerNormalization rules from decomposed forms."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from contrib_testlib import fuse, ops, parse, refusals, same_outputs, to_dtype

from onnxfuse.rewrites.contrib.contrib_layernorm import ContribLayerNorm
from onnxfuse.rewrites.contrib.contrib_skip_layernorm import ContribSkipLayerNorm

LN, SKIP = ContribLayerNorm(), ContribSkipLayerNorm()
RNG = np.random.default_rng(0)
GB = {"gamma": (RNG.random(8) + 0.5).astype(np.float32), "beta": RNG.standard_normal(8).astype(np.float32)}


def ln_body(x="x", axes="<axes = [-1]>", axes_input="", square="sq = Pow(d, two)", divide="n = Div(d, sd)",
            affine="m = Mul(n, gamma)\ny = Add(m, beta)", eps="1e-5"):
    return f"""
        mu = ReduceMean {axes} ({x}{axes_input})
        d = Sub({x}, mu)
        two = Constant <value = float {{2.0}}> ()
        {square}
        var = ReduceMean {axes} (sq{axes_input})
        eps = Constant <value = float {{{eps}}}> ()
        ve = Add(var, eps)
        sd = Sqrt(ve)
        {divide}
        {affine}
    """


def model(body, opset=17, inputs="float[2,5,8] x", outputs="float[2,5,8] y", inits=GB):
    return parse(f"g ({inputs}) => ({outputs}) {{\n{body}\n}}", opset=opset, inits=inits)


# --- LayerNormalization ---------------------------------------------------------------------------


def assert_one_layernorm(m, eps: float):
    """``m`` becomes one LayerNormalization over the last axis with epsilon ``eps``, same outputs."""
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 1, refusals(report)
    assert set(ops(out)) == {"LayerNormalization"}
    attrs = {a.name: a for a in out.graph.node[0].attribute}
    assert attrs["axis"].i == -1
    assert attrs["epsilon"].f == pytest.approx(eps, rel=1e-6)
    same_outputs(m, out)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"square": "sq = Mul(d, d)"},
        {"divide": "r = Reciprocal(sd)\nn = Mul(d, r)"},  # tf2onnx style
        {"affine": "m = Mul(gamma, n)\ny = Add(beta, m)"},
        {"affine": "y = Mul(n, gamma)"},  # no β
        {"affine": "y = Identity(n)"},  # neither γ nor β
        {"eps": "1e-12"},
    ],
    ids=["pow", "mul-square", "reciprocal", "swapped", "no-beta", "no-affine", "eps"],
)
def test_layernorm_forms(kwargs):
    assert_one_layernorm(model(ln_body(**kwargs)), float(kwargs.get("eps", "1e-5")))


def test_layernorm_two_trailing_axes():
    gamma = (RNG.random((5, 8)) + 0.5).astype(np.float32)
    m = model(ln_body(axes="<axes = [1, 2]>", affine="y = Mul(n, gamma)"), inits={"gamma": gamma})
    out, report = fuse(m, LN)
    assert ops(out) == {"LayerNormalization": 1}, refusals(report)
    assert {a.name: a.i for a in out.graph.node[0].attribute}["axis"] == -2
    same_outputs(m, out)


def test_layernorm_opset18_axes_input():
    body = 'ax = Constant <value = int64[1] {-1}> ()\n' + ln_body(axes="", axes_input=", ax")
    m = model(body, opset=18)
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 1, refusals(report)
    same_outputs(m, out)


def test_layernorm_float16():
    m = to_dtype(model(ln_body()), np.float16)
    out, report = fuse(m, LN)
    assert ops(out) == {"LayerNormalization": 1}, refusals(report)
    same_outputs(m, out, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("opset", [13, 14, 16])
def test_layernorm_below_opset17_raises_the_opset(opset):
    # Pow (13 → 15) and Identity (14 → 16) only gained element types on the way to 17: the raise
    # changes no node's meaning, so the rule emits ONNX LayerNormalization and declares opset 17.
    m = model(ln_body() + "\nz = Identity(y)", opset=opset, outputs="float[2,5,8] z")
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 1, refusals(report)
    assert {o.domain: o.version for o in out.opset_import}[""] == 17
    assert ops(out)["LayerNormalization"] == 1
    onnx.checker.check_model(out, full_check=True)
    same_outputs(m, out)


def test_layernorm_below_opset17_refused_when_the_raise_changes_an_op():
    # BatchNormalization-15 regrouped its type constraints: declaring 17 would re-read the node
    # under another schema, so the rule refuses and names the op.
    bn = """
        s = Constant <value = float[5] {1, 1, 1, 1, 1}> ()
        b = Constant <value = float[5] {0, 0, 0, 0, 0}> ()
        z = BatchNormalization(y, s, b, b, s)
    """
    m = model(ln_body() + bn, opset=14, outputs="float[2,5,8] z")
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 0
    assert any("opset 14 → 17 would change the meaning of BatchNormalization" in r
               for r in refusals(report, LN)), refusals(report)
    assert {o.domain: o.version for o in out.opset_import}[""] == 14


@pytest.mark.parametrize(
    "kwargs,why",
    [
        ({"axes": "<axes = [1]>"}, "trailing axes"),  # middle axis
        ({"square": "three = Constant <value = float {3.0}> ()\nsq = Pow(d, three)"}, "mean)²"),
        ({"divide": "n = Div(sd, d)"}, "division"),
    ],
)
def test_layernorm_near_misses(kwargs, why):
    m = model(ln_body(**kwargs))
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 0
    assert any(why in r for r in refusals(report, LN)), refusals(report)


def test_layernorm_refuses_shared_intermediate():
    m = model(ln_body(), outputs="float[2,5,8] y, float[2,5,1] var")
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 0
    assert any("graph output" in r or "only" in r for r in refusals(report, LN)), refusals(report)


def test_layernorm_different_reduce_axes_refused():
    body = ln_body().replace("var = ReduceMean <axes = [-1]>", "var = ReduceMean <axes = [-2, -1]>")
    m = model(body)
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 0


# --- SkipLayerNormalization --------------------------------------------------------------------------------


def skip_model(opset=17, bias=False, shapes=("float[2,5,8] a", "float[2,5,8] b"), extra_out=""):
    inits = dict(GB)
    pre = "x = Add(a, b)"
    if bias:
        inits["bias"] = RNG.standard_normal(8).astype(np.float32)
        pre = "ab = Add(a, bias)\nx = Add(ab, b)"
    return model(pre + ln_body(), opset=opset, inputs=", ".join(shapes), outputs="float[2,5,8] y" + extra_out,
                 inits=inits)


@pytest.mark.parametrize("opset", [14, 17])
def test_skip_layernorm(opset):
    m = skip_model(opset=opset)
    out, report = fuse(m, SKIP, LN)
    assert report.counts[SKIP.name] == 1, refusals(report)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1}
    same_outputs(m, out)


def test_skip_layernorm_with_bias():
    m = skip_model(bias=True)
    out, report = fuse(m, SKIP)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1}, refusals(report)
    node = out.graph.node[0]
    assert list(node.input) == ["a", "b", "gamma", "beta", "bias"]
    same_outputs(m, out)


def test_skip_layernorm_on_standard_layernorm():
    m = parse("g (float[2,5,8] a, float[2,5,8] b) => (float[2,5,8] y) {\nx = Add(a, b)\n"
              "y = LayerNormalization <axis = -1, epsilon = 1e-6> (x, gamma, beta)\n}", inits=GB)
    out, report = fuse(m, SKIP)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1}, refusals(report)
    same_outputs(m, out)


def test_skip_layernorm_refuses_broadcast_add():
    # a [1, S, H] skip is the kernel's own broadcast (test_contrib_skip_layernorm.py); [B, 1, H] is not
    m = skip_model(shapes=("float[2,5,8] a", "float[2,1,8] b"))
    out, report = fuse(m, SKIP, LN)
    assert report.counts[SKIP.name] == 0
    assert report.counts[LN.name] == 1  # the plain LayerNorm still applies
    assert any("neither provably equal" in r for r in refusals(report, SKIP)), refusals(report)
    same_outputs(m, out)


@pytest.mark.parametrize("bias", [False, True])
def test_skip_layernorm_shared_sum_is_the_fourth_output(bias):
    """The Add's result also a graph output (or read again, as a pre-norm residual stream is): the op
    writes it as input_skip_bias_sum, with its bias absorbed, and both outputs match the original."""
    m = skip_model(bias=bias, extra_out=", float[2,5,8] x")
    out, report = fuse(m, SKIP)
    assert report.counts[SKIP.name] == 1, refusals(report)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1}
    node = out.graph.node[0]
    assert len(node.input) == (5 if bias else 4)
    assert list(node.output) == ["y", "", "", "x"]
    same_outputs(m, out)


def test_skip_layernorm_residual_stream_read_by_the_next_block():
    m = model("x = Add(a, b)" + ln_body() + "z = Add(x, y)\n", inputs="float[2,5,8] a, float[2,5,8] b",
              outputs="float[2,5,8] z", inits=dict(GB))
    out, report = fuse(m, SKIP)
    assert report.counts[SKIP.name] == 1, refusals(report)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1, "Add": 1}
    same_outputs(m, out)


def test_skip_layernorm_refuses_rank4():
    m = parse("g (float[1,2,5,8] a, float[1,2,5,8] b) => (float[1,2,5,8] y) {\nx = Add(a, b)\n" + ln_body() + "}",
              inits=GB)
    out, report = fuse(m, SKIP)
    assert report.counts[SKIP.name] == 0


def test_skip_layernorm_refuses_double():
    m = to_dtype(skip_model(), np.float64)
    out, report = fuse(m, SKIP)
    assert report.counts[SKIP.name] == 0
    assert any("float64" in r for r in refusals(report, SKIP)), refusals(report)


# --- TensorFlow / Keras form: γ folded into the reciprocal, mean subtracted after scaling ----------


def keras_body(x="x", scale="s = Mul(r, gamma)", tail="xs = Mul(x, s)\nms = Mul(mu, s)\nb = Sub(beta, ms)\ny = Add(xs, b)"):
    return f"""
        mu = ReduceMean <axes = [-1]> ({x})
        d = Sub({x}, mu)
        sq = Mul(d, d)
        var = ReduceMean <axes = [-1]> (sq)
        eps = Constant <value = float {{1e-3}}> ()
        ve = Add(var, eps)
        sd = Sqrt(ve)
        r = Reciprocal(sd)
        {scale}
        {tail.replace("Mul(x, s)", f"Mul({x}, s)")}
    """


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"tail": "xs = Mul(s, x)\nms = Mul(s, mu)\nb = Sub(beta, ms)\ny = Add(b, xs)"},  # operands swapped
        {"tail": "xs = Mul(x, s)\nms = Mul(mu, s)\ny = Sub(xs, ms)"},  # no β
        {"scale": "s = Identity(r)"},  # no γ
    ],
    ids=["keras", "swapped", "no-beta", "no-gamma"],
)
def test_keras_folded_scale_form(kwargs):
    assert_one_layernorm(model(keras_body(**kwargs)), 1e-3)


@pytest.mark.parametrize(
    "tail,why",
    [
        # the mean is also a graph output... here: read by a third op
        ("xs = Mul(x, s)\nms = Mul(mu, s)\nb = Sub(beta, ms)\ny0 = Add(xs, b)\ny = Add(y0, mu)", "mean"),
        # x is scaled by something else than s
        ("s2 = Mul(s, s)\nxs = Mul(x, s2)\nms = Mul(mu, s)\nb = Sub(beta, ms)\ny = Add(xs, b)", "scale"),
        # β − μ·s added to something other than x·s
        ("xs = Mul(x, s)\nms = Mul(mu, s)\nb = Sub(beta, ms)\ny = Add(x, b)", "scale"),
    ],
    ids=["mean-reused", "other-scale", "not-x-times-s"],
)
def test_keras_form_near_misses(tail, why):
    m = model(keras_body(tail=tail))
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 0
    assert "LayerNormalization" not in ops(out)
    same_outputs(m, out)


def test_keras_form_after_residual_add_becomes_skip_layernorm():
    body = "x = Add(a, b0)\n" + keras_body()
    m = model(body, inputs="float[2,5,8] a, float[2,5,8] b0")
    out, report = fuse(m, SKIP)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1}, refusals(report)
    same_outputs(m, out)


# --- PyTorch's float16 export: variance in float (double on the CPU), cast back before γ/β ------------

GB16 = {k: v.astype(np.float16) for k, v in GB.items()}


def cast_form(up=1, down="y0 = Cast <to = 10> (n)"):
    t = {1: "float", 11: "double"}[up]
    return f"""
        mu = ReduceMean <axes = [-1]> (x)
        d = Sub(x, mu)
        d32 = Cast <to = {up}> (d)
        two = Constant <value = {t} {{2.0}}> ()
        sq = Pow(d32, two)
        var = ReduceMean <axes = [-1]> (sq)
        eps = Constant <value = {t} {{1e-6}}> ()
        ve = Add(var, eps)
        sd = Sqrt(ve)
        n = Div(d32, sd)
        {down}
        m = Mul(y0, gamma)
        y = Add(m, beta)
    """


@pytest.mark.parametrize("up", [1, 11], ids=["float", "double"])
def test_float16_layernorm_with_casts(up):
    m = model(cast_form(up), opset=14, inputs="float16[2,5,8] x", outputs="float16[2,5,8] y", inits=GB16)
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 1, refusals(report)
    assert ops(out) == {"LayerNormalization": 1}
    node = out.graph.node[0]
    assert list(node.input) == ["x", "gamma", "beta"]
    assert {a.name: a.i for a in node.attribute if a.name == "stash_type"} == {"stash_type": 1}
    # The decomposed form takes its mean and difference in float16, the op in float: they agree to
    # float16's rounding, not bit for bit.
    same_outputs(m, out, rtol=1e-2, atol=2e-3)


def test_float16_layernorm_without_the_cast_back_is_refused():
    # The normalized value stays in float (γ/β in float32, a float32 output): no float16
    # LayerNormalization computes that, so the rule must not match.
    m = model(cast_form(down="y0 = Identity(n)"), opset=14, inputs="float16[2,5,8] x",
              outputs="float[2,5,8] y", inits=GB)
    out, report = fuse(m, LN)
    assert report.counts[LN.name] == 0
    assert "the float division is not cast back to x's type" in refusals(report, LN)


# --- a SkipLayerNormalization written before its bias Add became adjacent ------------------------


def late_bias_model(sum_read=True, bias_add_out=False):
    """``SkipLayerNormalization(Add(MatMul(a, W), bias), b)`` with no bias input, as contrib-skip-layernorm
    writes it while a Transpose still stands between the projection's bias Add and the residual Add
    (ViT: cancel-row-transposes removes it in a later round)."""
    from onnx import TensorProto as T
    from onnx import helper as h

    w = RNG.standard_normal((8, 8)).astype(np.float32)
    inits = {**GB, "W": w, "bias": RNG.standard_normal(8).astype(np.float32)}
    outputs = ["y"] + (["", "", "s"] if sum_read else [])
    nodes = [h.make_node("MatMul", ["a", "W"], ["p"]), h.make_node("Add", ["p", "bias"], ["pb"]),
             h.make_node("SkipLayerNormalization", ["pb", "b", "gamma", "beta"], outputs, domain="com.microsoft",
                         epsilon=1e-5)]
    vi = lambda n: h.make_tensor_value_info(n, T.FLOAT, [2, 5, 8])  # noqa: E731
    graph_outputs = [vi("y")] + ([vi("s")] if sum_read else []) + ([vi("pb")] if bias_add_out else [])
    graph = h.make_graph(nodes, "g", [vi("a"), vi("b")], graph_outputs,
                         [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("sum_read", [False, True])
def test_an_existing_skip_layernorm_absorbs_a_late_bias_add(sum_read):
    m = late_bias_model(sum_read)
    out, report = fuse(m, SKIP)
    assert report.counts[SKIP.name] == 1, refusals(report)
    assert ops(out) == {"MatMul": 1, "com.microsoft:SkipLayerNormalization": 1}
    (node,) = [n for n in out.graph.node if n.op_type == "SkipLayerNormalization"]
    assert list(node.input) == ["p", "b", "gamma", "beta", "bias"]
    same_outputs(m, out)  # the normalized output and the sum (its bias included)


def test_a_late_bias_add_read_elsewhere_stays():
    out, report = fuse(late_bias_model(bias_add_out=True), SKIP)
    assert report.counts[SKIP.name] == 0
    assert any("no 1-D bias Add" in r for r in refusals(report, SKIP)), refusals(report)


def test_vit_attention_projection_bias_goes_into_its_skip_layernorm():
    """The ViT blocks in testdata: every block's SkipLayerNormalization takes its projection's bias (no
    bias Add left in front of one), with the original's outputs; the first block's ln_1 reads the class
    token + patches [B, N, H] plus the position embedding [1, N, H], a broadcast skip, without a bias."""
    import helpers
    from onnxfuse.pipeline import rewrite_model
    from onnxfuse.rewrites import select_rules
    from onnxfuse.runtime.inputs import make_inputs
    from onnxfuse.runtime.session import run_model

    model = onnx.load(helpers.TESTDATA / "vit_blocks_opset14.onnx")
    out, _ = rewrite_model(model, select_rules("cuda"))
    producers = {o: n for n in out.graph.node for o in n.output}
    skips = [n for n in out.graph.node if n.op_type == "SkipLayerNormalization"]
    embed = [n for n in skips if n.input[1] == "pos_embedding"]
    assert len(embed) == 1 and (len(embed[0].input) < 5 or not embed[0].input[4])
    skips = [n for n in skips if n not in embed]
    assert len(skips) == 4 and all(len(n.input) == 5 and n.input[4] for n in skips)
    vectors = {i.name for i in out.graph.initializer if len(i.dims) == 1}
    bias_adds = [i for n in skips for i in n.input[:2]
                 if i in producers and producers[i].op_type == "Add" and set(producers[i].input) & vectors]
    assert not bias_adds
    feeds = make_inputs(model, {"input": [2, 3, 32, 32]}, seed=3)
    np.testing.assert_allclose(run_model(out, feeds, "cpu")["output"], run_model(model, feeds, "cpu")["output"],
                               rtol=1e-4, atol=1e-5)
