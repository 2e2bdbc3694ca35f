"""SkipLayerNormalization forms from ONNX Runtime's test corpus (docs/ort-corpus.md): a broadcast skip
(GPT-2's token + position embeddings), a Cast between the Add and the LayerNorm, and tf2onnx's opset-11
BERT, whose shapes only proven_dims recovers. Each accepted form is compared with a float64 numpy
reference; each one's non-exact neighbour is refused with its reason."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import pytest
from contrib_testlib import fuse, ops, parse, refusals

import helpers
from onnxfuse import model_io
from onnxfuse.rewrites import apply_rules
from onnxfuse.rewrites.contrib.contrib_layernorm import ContribLayerNorm
from onnxfuse.rewrites.contrib.contrib_skip_layernorm import ContribSkipLayerNorm
from onnxfuse.rewrites.facts.proven_dims import prove_dims

LN, SKIP = ContribLayerNorm(), ContribSkipLayerNorm()
B, S, H = 3, 5, 8
RNG = np.random.default_rng(30)
GAMMA = (RNG.random(H) + 0.5).astype(np.float32)
BETA = RNG.standard_normal(H).astype(np.float32)
BIAS = RNG.standard_normal(H).astype(np.float32)
INITS = {"gamma": GAMMA, "beta": BETA, "bias": BIAS}
DIMS = {"batch": B, "seq": S}


def reference(x, eps=1e-5):
    """LayerNorm over the last axis in float64."""
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * GAMMA.astype(np.float64) + BETA.astype(np.float64)


def feeds_for(model, dtype=np.float32):
    out = {}
    for inp in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else DIMS[d.dim_param] for d in inp.type.tensor_type.shape.dim]
        out[inp.name] = RNG.standard_normal(shape).astype(dtype)
    return out


def close(got, want):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-5)


DECOMPOSED = """
    mu = ReduceMean <axes = [-1]> (x)
    d = Sub(x, mu)
    two = Constant <value = float {2.0}> ()
    sq = Pow(d, two)
    var = ReduceMean <axes = [-1]> (sq)
    eps = Constant <value = float {1e-5}> ()
    ve = Add(var, eps)
    sd = Sqrt(ve)
    n = Div(d, sd)
    m = Mul(n, gamma)
    y = Add(m, beta)
"""
STANDARD = "y = LayerNormalization <axis = -1, epsilon = 1e-5> (x, gamma, beta)"


def model(inputs, pre, outputs=f"float[batch,seq,{H}] y", norm=STANDARD, opset=17):
    return parse(f"g ({inputs}) => ({outputs}) {{\n{pre}\n{norm}\n}}", opset=opset, inits=INITS)


# --- a broadcast skip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("norm, opset", [(STANDARD, 17), (DECOMPOSED, 14)])
@pytest.mark.parametrize("skip", [f"float[1,seq,{H}]", f"float[seq,{H}]"])
@pytest.mark.parametrize("full_first", [True, False])
def test_a_broadcast_skip_becomes_skip_layernorm(norm, opset, skip, full_first):
    """x = a[B, S, H] + p[1, S, H] (or p[S, H]): the op's input is a, its skip p, which the kernel reads at
    offset % (S·H), the element numpy's broadcast adds."""
    pre = "x = Add(a, p)" if full_first else "x = Add(p, a)"
    m = model(f"float[batch,seq,{H}] a, {skip} p", pre, norm=norm, opset=opset)
    out, report = fuse(m, SKIP)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1}, refusals(report)
    assert list(out.graph.node[0].input[:2]) == ["a", "p"]
    feeds = feeds_for(m)
    want = reference(feeds["a"].astype(np.float64) + feeds["p"])
    close(helpers.run_ort(m, feeds)["y"], want)
    close(helpers.run_ort(out, feeds)["y"], want)


def test_a_broadcast_skip_with_the_bias_on_the_full_side_and_the_sum_read():
    m = model(f"float[batch,seq,{H}] a, float[1,seq,{H}] p", "ab = Add(a, bias)\nx = Add(ab, p)",
              outputs=f"float[batch,seq,{H}] y, float[batch,seq,{H}] x")
    out, report = fuse(m, SKIP)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1}, refusals(report)
    node = out.graph.node[0]
    assert list(node.input) == ["a", "p", "gamma", "beta", "bias"] and list(node.output) == ["y", "", "", "x"]
    feeds = feeds_for(m)
    total = feeds["a"].astype(np.float64) + BIAS + feeds["p"]
    got = helpers.run_ort(out, feeds)
    close(got["y"], reference(total))
    close(got["x"], total)


@pytest.mark.parametrize("skip", [
    f"float[batch,1,{H}]",  # broadcast over the sequence: the kernel needs the last two dims equal
    f"float[{H}]",          # a 1-D addend is a bias, not a skip
    f"float[2,seq,{H}]",    # a batch of 2 against batch: not provably 1, nor equal
    f"float[1,other,{H}]",  # another name: may be 1 at run time (then it broadcasts over S)
])
def test_a_skip_that_is_not_provably_the_kernels_broadcast_is_refused(skip):
    m = model(f"float[batch,seq,{H}] a, {skip} p", "x = Add(a, p)")
    out, report = fuse(m, SKIP)
    assert report.counts[SKIP.name] == 0
    assert any("neither provably equal" in r for r in refusals(report, SKIP)), refusals(report)


# --- a Cast between the Add and the LayerNorm -------------------------------------------------------------


def test_a_cast_to_the_adds_own_type_is_absorbed():
    m = model(f"float[batch,seq,{H}] a, float[batch,seq,{H}] b", "s = Add(a, b)\nx = Cast <to = 1> (s)")
    out, report = fuse(m, SKIP)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1}, refusals(report)
    feeds = feeds_for(m)
    close(helpers.run_ort(out, feeds)["y"], reference(feeds["a"].astype(np.float64) + feeds["b"]))


def _float16_sum_bound(s, gamma, rounded=None):
    """contrib-skip-layernorm's stated tolerance for a float16 sum normalized in float32: each float16
    rounding moves an element of the sum by at most 2⁻¹¹ of the value rounded (``rounded``: the sum of
    those values' magnitudes, |s| for one Add), the normalization scales that by about 1/σ of its row
    (twice: the element and the mean), times |γ| — per row, with 10% for second-order terms."""
    s = np.asarray(s, np.float64)
    magnitude = np.abs(s) if rounded is None else np.asarray(rounded, np.float64)
    return 1.1 * 2 * 2.0 ** -11 * magnitude.max(-1, keepdims=True) / s.std(-1, keepdims=True) * np.abs(gamma).max()


def test_a_float16_sum_cast_to_float_is_written_in_float32_within_the_stated_tolerance():
    """ONNX Runtime's skip_layer_norm_format*_with_cast: the sum is rounded to float16, the LayerNorm runs
    in float32. The op is written in float32 over Cast(a), Cast(b) (as ORT-T writes it): the sum is no
    longer rounded to float16. The output then equals the unrounded LayerNorm, which is also what ONNX
    Runtime's CPU provider gives for the original (it has no float16 Add: it adds in float32 and drops the
    Cast pair), and differs from ONNX's value of the original (the reference evaluator: a float16 Add
    rounds, as CUDA's) by no more than the rule's stated bound — but it does differ: a tolerance, not an
    identity."""
    m = model(f"float16[batch,seq,{H}] a, float16[batch,seq,{H}] b", "s = Add(a, b)\nx = Cast <to = 1> (s)")
    out, report = fuse(m, SKIP)
    assert ops(out) == {"com.microsoft:SkipLayerNormalization": 1, "Cast": 2}, refusals(report, SKIP)
    assert [d for d in report.details if d["rule"] == SKIP.name][0]["float16_sum_in_float32"]
    feeds = feeds_for(m, np.float16)
    got = helpers.run_ort(out, feeds)["y"]
    unrounded = reference(feeds["a"].astype(np.float64) + feeds["b"])
    close(got, unrounded)
    close(helpers.run_ort(m, feeds)["y"], unrounded)  # ORT CPU on the original
    s16 = (feeds["a"] + feeds["b"]).astype(np.float64)  # numpy's float16 Add rounds, as ONNX's
    rounded = reference(s16)
    close(onnx.reference.ReferenceEvaluator(m).run(None, feeds)[0], rounded)
    assert not np.allclose(got, rounded, rtol=1e-4, atol=1e-5)
    assert (np.abs(got - rounded) <= _float16_sum_bound(s16, GAMMA)).all()


def test_a_float16_sum_with_a_bias_read_elsewhere_keeps_its_add_for_the_other_reader():
    """The bias Add's result is a graph output too (format*_graph_output_with_cast): that Add stays, in
    float16, for it; the op reads Cast(a + bias) and Cast(b)."""
    m = model(f"float16[batch,seq,{H}] a, float16[batch,seq,{H}] b", "bias16 = Cast <to = 10> (bias)\n"
              "ab = Add(a, bias16)\ns = Add(ab, b)\nx = Cast <to = 1> (s)",
              outputs=f"float[batch,seq,{H}] y, float16[batch,seq,{H}] ab")
    out, report = fuse(m, SKIP)
    assert ops(out).get("com.microsoft:SkipLayerNormalization") == 1, refusals(report, SKIP)
    feeds = feeds_for(m, np.float16)
    got, want = helpers.run_ort(out, feeds), helpers.run_ort(m, feeds)
    np.testing.assert_array_equal(got["ab"], want["ab"])  # the same float16 Add, kept
    close(got["y"], want["y"])  # ONNX Runtime's CPU provider adds in float32 in the original too
    ab16 = feeds["a"] + BIAS.astype(np.float16)  # ONNX's value: each float16 Add rounds
    s16 = (ab16 + feeds["b"]).astype(np.float64)
    bound = _float16_sum_bound(s16, GAMMA, rounded=np.abs(ab16).astype(np.float64) + np.abs(s16))  # two Adds
    assert (np.abs(got["y"] - reference(s16)) <= bound).all()


def test_a_cast_between_other_float_types_is_refused():
    """A float32 sum normalized in float64: no op of one element type computes it, and only the float16
    sum has a stated tolerance."""
    norm = ("g64 = Cast <to = 11> (gamma)\nb64 = Cast <to = 11> (beta)\n"
            "y64 = LayerNormalization <axis = -1, epsilon = 1e-5> (x, g64, b64)\ny = Cast <to = 1> (y64)")
    m = model(f"float[batch,seq,{H}] a, float[batch,seq,{H}] b", "s = Add(a, b)\nx = Cast <to = 11> (s)", norm=norm)
    out, report = fuse(m, SKIP)
    assert report.counts[SKIP.name] == 0
    assert any("Cast(float32 → float64)" in r for r in refusals(report, SKIP)), refusals(report, SKIP)


# --- tf2onnx opset 11: shapes lost after a computed Reshape target ----------------------------------------


def tensordot_model(lead_from="x"):
    """tf2onnx's Dense (``Tensordot``) + residual + Keras LayerNorm over ``axes=[2]``: the dense output is
    ``Reshape(MatMul(Reshape(x, [B·S, H]), W), Concat(Gather(Shape(·), [0, 1]), [H]))`` through int32
    Casts, which ONNX inference leaves of unknown rank."""
    body = f"""
        shp = Shape(x)
        shp32 = Cast <to = 6> (shp)
        lead_src = Shape({lead_from})
        lead_src32 = Cast <to = 6> (lead_src)
        lead = Gather <axis = 0> (lead_src32, free)
        rows = ReduceProd <axes = [0], keepdims = 0> (lead)
        rows1 = Unsqueeze <axes = [0]> (rows)
        flat32 = Concat <axis = 0> (rows1, h32)
        flat_t = Cast <to = 7> (flat32)
        flat = Reshape(x, flat_t)
        mm = MatMul(flat, w)
        tgt32 = Concat <axis = 0> (lead, h32)
        tgt = Cast <to = 7> (tgt32)
        dense = Reshape(mm, tgt)
        biased = Add(dense, bias)
        s = Add(biased, x)
        mean = ReduceMean <axes = [2], keepdims = 1> (s)
        dev = Sub(s, mean)
        sq = Mul(dev, dev)
        var = ReduceMean <axes = [2], keepdims = 1> (sq)
        eps = Constant <value = float {{1e-12}}> ()
        ve = Add(var, eps)
        sd = Sqrt(ve)
        r = Reciprocal(sd)
        sc = Mul(r, gamma)
        xs = Mul(s, sc)
        ms = Mul(mean, sc)
        bm = Sub(beta, ms)
        y = Add(xs, bm)
    """
    inputs = f"float[batch,seq,{H}] x" + (", float[batch,other] z" if lead_from == "z" else "")
    inits = dict(INITS, w=RNG.standard_normal((H, H)).astype(np.float32) / 3,
                 free=np.asarray([0, 1], np.int64), h32=np.asarray([H], np.int32))
    return parse(f"g ({inputs}) => (float[batch,seq,{H}] y) {{\n{body}\n}}", opset=11, inits=inits)


def fuse_proved(m, *rules):
    """As the pipeline does: inference, then proven_dims, then the rules."""
    graph = model_io.to_graph(model_io.infer_shapes(m))
    prove_dims(graph)
    report = apply_rules(graph, list(rules))
    return model_io.to_model(graph, m), report


def test_tf2onnx_dense_residual_layernorm_becomes_skip_layernorm_once_its_shapes_are_proved():
    m = tensordot_model()
    _, unproved = fuse(m, SKIP)  # inference alone: the Add's rank is unknown
    assert unproved.counts[SKIP.name] == 0
    assert any("not the trailing axes" in r for r in refusals(unproved, SKIP)), refusals(unproved)
    out, report = fuse_proved(m, SKIP)
    assert report.counts[SKIP.name] == 1, refusals(report)
    assert ops(out)["com.microsoft:SkipLayerNormalization"] == 1 and "ReduceMean" not in ops(out)
    feeds = feeds_for(m)
    x = feeds["x"].astype(np.float64)
    w = next(onnx.numpy_helper.to_array(i) for i in m.graph.initializer if i.name == "w")
    dense = x @ w.astype(np.float64) + BIAS
    want = reference(dense + x, eps=1e-12)
    close(helpers.run_ort(m, feeds)["y"], want)
    close(helpers.run_ort(out, feeds)["y"], want)


def test_tf2onnx_dense_whose_target_is_read_from_another_tensor_is_refused():
    """The dense output's [B, S] read from z[batch, other]: [batch, other, H] + [batch, seq, H] may
    broadcast (other = 1), so the sum's shape is not proved, nor the ReduceMean's axis 2 its last."""
    m = tensordot_model(lead_from="z")
    out, report = fuse_proved(m, SKIP)
    assert report.counts[SKIP.name] == 0
    assert any("not the trailing axes" in r for r in refusals(report, SKIP)), refusals(report)
    graph = model_io.to_graph(model_io.infer_shapes(m))
    prove_dims(graph)
    assert graph.tensors()["dense"].shape == ["batch", "other", H] and graph.tensors()["s"].shape is None
