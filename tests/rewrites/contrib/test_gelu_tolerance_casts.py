"""Issue 30 item 4: GELU constants within a stated tolerance of their exact values, and Casts inside.

Every accepted form is checked against an independent float64 numpy reference of the function (not
against the original model), run on ONNX Runtime's CPU provider, at validation's tolerances for the
element type (float32: rtol 1e-4, atol 1e-5; float16: rtol 1e-2, atol 1e-3).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from contrib_testlib import fuse, ops, parse, refusals

import helpers
from onnxfuse.rewrites.contrib.activation import CONSTANT_RTOL, close_to
from onnxfuse.rewrites.contrib.contrib_bias_gelu import ContribBiasGelu
from onnxfuse.rewrites.contrib.contrib_fast_gelu import ContribFastGelu
from onnxfuse.rewrites.contrib.contrib_gelu import ContribGelu

GELU, FAST, BIAS = ContribGelu(), ContribFastGelu(), ContribBiasGelu()
SQRT2 = math.sqrt(2.0)
K = math.sqrt(2.0 / math.pi)
TOL = {"float": (1e-4, 1e-5), "float16": (1e-2, 1e-3)}


def gelu64(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / SQRT2))


def fast_gelu64(x):
    x = np.asarray(x, np.float64)
    return 0.5 * x * (1.0 + np.tanh(K * (x + 0.044715 * x**3)))


def check_against(model, reference, dtype="float"):
    """The model's output ``y`` on ONNX Runtime (CPU) equals ``reference(x)`` in float64 within tolerance."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((2, 5, 8)) * 3).astype(np.float16 if dtype == "float16" else np.float32)
    x.flat[:5] = [-6.0, -3.0, -1.4142, 0.0, 4.0]
    got = helpers.run_ort(model, {"x": x})["y"]
    assert got.dtype == x.dtype
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(got.astype(np.float64), reference(x.astype(np.float64)), rtol=rtol, atol=atol)


def head(dtype="float", out=None):
    return f"g ({dtype}[2,5,8] x) => ({out or dtype}[2,5,8] y) {{\n"


def erf_gelu(divide="Div(x, s)", s="1.4142099", half_first=True, one_first=False, dtype="float"):
    """0.5·x·(1 + erf(x/s)) with the operand orders chosen by the arguments."""
    add = "a = Add(one, e)" if one_first else "a = Add(e, one)"
    mul = "xh = Mul(h, x)\ny = Mul(a, xh)" if half_first else "xa = Mul(x, a)\ny = Mul(xa, h)"
    return head(dtype) + f"""
        s = Constant <value = {dtype} {{{s}}}> ()
        d = {divide}
        e = Erf(d)
        one = Constant <value = {dtype} {{1.0}}> ()
        {add}
        h = Constant <value = {dtype} {{0.5}}> ()
        {mul}
    }}"""


# --- tolerant constants ----------------------------------------------------------------------------------


@pytest.mark.parametrize("divide,s,half_first,one_first", [
    ("Div(x, s)", "1.4142099", True, False),     # BERT (TensorFlow) and ONNX Runtime's gelu_format2 models
    ("Div(x, s)", "1.4142099", False, True),     # constants on the other side of the commutative ops
    ("Mul(s, x)", "0.70710856", True, True),     # the same approximation as a multiplier: 1/1.4142099
    ("Mul(x, s)", "0.70710856", False, False),
])
def test_approximate_sqrt2_fuses_and_matches_float64(divide, s, half_first, one_first):
    model = parse(erf_gelu(divide, s, half_first, one_first))
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 1, refusals(report)
    assert ops(out) == {"com.microsoft:Gelu": 1}
    check_against(out, gelu64)


def test_sqrt2_just_outside_the_tolerance_is_refused():
    outside = SQRT2 * (1 + 1.2 * CONSTANT_RTOL)  # 6e-6 above √2
    model = parse(erf_gelu(s=f"{outside:.9f}"))
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 0
    assert "Erf" in ops(out)
    assert any("argument of Erf is" in r and "not the expected form" in r for r in refusals(report, GELU)), \
        refusals(report)


def test_sqrt2_just_inside_the_tolerance_fuses():
    inside = SQRT2 * (1 - 0.8 * CONSTANT_RTOL)
    out, report = fuse(parse(erf_gelu(s=f"{inside:.9f}")), GELU)
    assert report.counts[GELU.name] == 1, refusals(report)
    check_against(out, gelu64)


FAST_BODY = """
        three = Constant <value = float {{3.0}}> ()
        p = Pow(xi, three)
        c = Constant <value = float {{{c}}}> ()
        pc = Mul(c, p)
        s = Add(xi, pc)
        k = Constant <value = float {{{k}}}> ()
        inner = Mul(k, s)
        t = Tanh(inner)
        one = Constant <value = float {{1.0}}> ()
        a = Add(one, t)
        h = Constant <value = float {{0.5}}> ()
        xh = Mul(h, xi)
        gl = Mul(a, xh)
"""


@pytest.mark.parametrize("k,fuses", [("0.7978846", True),   # √(2/π) rounded to 7 digits: 5e-8 off
                                     ("0.79788", False),     # to 5 digits: 5.7e-6 below, just outside
                                     (f"{K * (1 + 1.2 * CONSTANT_RTOL):.10f}", False)])
def test_fast_gelu_constant_tolerance(k, fuses):
    body = FAST_BODY.format(c="0.044715", k=k).replace("xi", "x").replace("gl = ", "y = ")
    out, report = fuse(parse(head() + body + "}"), FAST)
    assert report.counts[FAST.name] == int(fuses), refusals(report)
    if fuses:
        check_against(out, fast_gelu64)
    else:
        assert any("argument of Tanh" in r for r in refusals(report, FAST)), refusals(report)


def test_tolerance_bound_holds_numerically():
    """The docstring's bound: a relative error CONSTANT_RTOL in √2 moves gelu by at most 0.294·δ ≤ 1.5e-6."""
    x = np.linspace(-12, 12, 240001)
    moved = 0.5 * x * (1.0 + np.vectorize(math.erf)(x / (SQRT2 * (1 + CONSTANT_RTOL))))
    assert np.max(np.abs(moved - gelu64(x))) <= 0.2936 * CONSTANT_RTOL <= 1.5e-6
    kx = K * (1 + CONSTANT_RTOL)
    moved = 0.5 * x * (1.0 + np.tanh(kx * (x + 0.044715 * x**3)))
    assert np.max(np.abs(moved - fast_gelu64(x))) <= 0.2543 * CONSTANT_RTOL  # √(2/π) moves both terms


def test_close_to_keeps_outer_constants_exact():
    assert close_to(1.4142099618911743, SQRT2, np.float32)
    assert not close_to(1.4142, SQRT2, np.float32)
    assert not close_to(0.5 * (1 + 1e-6), 0.5, np.float32, rel=0.0)  # the outer 0.5: rounding only
    assert close_to(float(np.float16(SQRT2)), SQRT2, np.float16)  # float16's own rounding


# --- Casts inside ----------------------------------------------------------------------------------------

#: float16 x, GELU in float32 between Casts (ONNX Runtime's float16 converter with the activation kept in
#: float32; torch autocast exports).
ISLAND = """
        x32 = Cast <to = 1> (x)
        {body}
        y = Cast <to = 10> (gl)
"""


def test_fast_gelu_float32_island_in_float16_becomes_float16_fast_gelu():
    body = FAST_BODY.format(c="0.044715", k="0.7978845608").replace("xi", "x32")
    model = parse(head("float16") + ISLAND.format(body=body) + "}")
    out, report = fuse(model, FAST)
    assert report.counts[FAST.name] == 1, refusals(report)
    assert ops(out) == {"com.microsoft:FastGelu": 1}  # no Cast left: the op takes float16 x
    assert out.graph.node[0].input[0] == "x" and out.graph.node[0].output[0] == "y"
    check_against(out, fast_gelu64, "float16")


def test_gelu_float32_island_in_float16_becomes_float16_gelu():
    body = (erf_gelu(divide="Div(x32, s)", s="1.4142099", half_first=False).split("{\n", 1)[1]
            .rsplit("}", 1)[0].replace("Mul(x, a)", "Mul(x32, a)").replace("y = Mul(xa, h)", "gl = Mul(xa, h)"))
    model = parse(head("float16") + ISLAND.format(body=body) + "}")
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 1, refusals(report)
    assert ops(out) == {"com.microsoft:Gelu": 1}
    check_against(out, gelu64, "float16")
    # against the island itself: within float16's tolerance with 5x to spare (ONNX Runtime's CPU float16
    # Gelu is at most one float16 step from the island on normal values; see activation.py)
    x = np.linspace(-8, 8, 80, dtype=np.float16).reshape(2, 5, 8)
    want, got = helpers.run_ort(model, {"x": x})["y"], helpers.run_ort(out, {"x": x})["y"]
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("scale", ["Mul(m, x32)", "Mul(x32, m)"])
def test_gelu_multiplier_0_70710677_in_a_float32_island(scale):
    """ONNX Runtime's transformers-optimizer form (x·0.7071067690849304), computed in float32 in a float16
    model, the constants on either side of the commutative ops."""
    model = parse(head("float16") + f"""
        x32 = Cast <to = 1> (x)
        m = Constant <value = float {{0.70710677}}> ()
        d = {scale}
        e = Erf(d)
        one = Constant <value = float {{1.0}}> ()
        a = Add(one, e)
        xa = Mul(a, x32)
        h = Constant <value = float {{0.5}}> ()
        r = Mul(h, xa)
        y = Cast <to = 10> (r)
    }}""")
    out, report = fuse(model, GELU)
    assert ops(out) == {"com.microsoft:Gelu": 1}, refusals(report)
    check_against(out, gelu64, "float16")


def test_same_type_casts_inside_fast_gelu():
    """ONNX Runtime's fast_gelu3_with_casts.onnx: Casts to the type x already has, on several branches."""
    model = parse(head() + """
        c1 = Cast <to = 1> (x)
        three = Constant <value = float {3.0}> ()
        p = Pow(c1, three)
        c = Constant <value = float {0.044715}> ()
        pc = Mul(p, c)
        c2 = Cast <to = 1> (x)
        s = Add(pc, c2)
        k = Constant <value = float {0.7978846}> ()
        inner = Mul(s, k)
        t = Tanh(inner)
        one = Constant <value = float {1.0}> ()
        a = Add(t, one)
        h = Constant <value = float {0.5}> ()
        xh = Mul(x, h)
        c3 = Cast <to = 1> (xh)
        y = Mul(c3, a)
    }""")
    out, report = fuse(model, FAST)
    assert report.counts[FAST.name] == 1, refusals(report)
    assert ops(out) == {"com.microsoft:FastGelu": 1}
    check_against(out, fast_gelu64)


def test_island_then_bias_gelu_in_float16():
    """The float16 Gelu an island becomes joins its bias Add like any other (BiasGelu in float16)."""
    body = (erf_gelu(divide="Div(x32, s)", s="1.4142135").split("{\n", 1)[1].rsplit("}", 1)[0]
            .replace("Mul(h, x)", "Mul(h, x32)").replace("y = Mul(a, xh)", "gl = Mul(a, xh)"))
    bias = np.array([0.1, -0.2, 0.3, 0.0, 1.0, -1.5, 0.25, 2.0], np.float16)
    text = head("float16").replace("x) =>", "v) =>") + "    x = Add(v, b)\n" + ISLAND.format(body=body) + "}"
    model = parse(text, inits={"b": bias})
    out, report = fuse(model, GELU, BIAS)
    assert ops(out) == {"com.microsoft:BiasGelu": 1}, refusals(report)
    v = np.linspace(-4, 4, 80, dtype=np.float16).reshape(2, 5, 8)
    got = helpers.run_ort(out, {"v": v})["y"].astype(np.float64)
    np.testing.assert_allclose(got, gelu64((v + bias).astype(np.float64)), rtol=1e-2, atol=1e-3)


def test_island_without_a_cast_back_reads_the_cast_of_x():
    """Result kept in float32: the fused op computes in float32 from the Cast of x, which stays."""
    body = FAST_BODY.format(c="0.044715", k="0.7978845608").replace("xi", "x32").replace("gl = ", "y = ")
    model = parse(head("float16", out="float") + "    x32 = Cast <to = 1> (x)\n" + body + "}")
    out, report = fuse(model, FAST)
    assert report.counts[FAST.name] == 1, refusals(report)
    assert ops(out) == {"Cast": 1, "com.microsoft:FastGelu": 1}
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 5, 8)) * 3).astype(np.float16)
    got = helpers.run_ort(out, {"x": x})["y"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, fast_gelu64(x.astype(np.float64)), rtol=1e-4, atol=1e-5)


def test_cast_of_x_read_elsewhere_stays():
    body = FAST_BODY.format(c="0.044715", k="0.7978845608").replace("xi", "x32")
    text = ("g (float16[2,5,8] x) => (float16[2,5,8] y, float[2,5,8] z) {\n"
            + ISLAND.format(body=body) + "    z = Neg(x32)\n}")
    out, report = fuse(parse(text), FAST)
    assert report.counts[FAST.name] == 1, refusals(report)
    assert ops(out) == {"Cast": 1, "Neg": 1, "com.microsoft:FastGelu": 1}
    fast = [n for n in out.graph.node if n.op_type == "FastGelu"][0]
    assert list(fast.input) == ["x"] and list(fast.output) == ["y"]


def test_narrowing_cast_inside_is_refused():
    """float32 x whose Erf argument is rounded to float16 and back: the fused op would not round it."""
    model = parse(head() + """
        s = Constant <value = float {1.4142135}> ()
        d = Div(x, s)
        d16 = Cast <to = 10> (d)
        d32 = Cast <to = 1> (d16)
        e = Erf(d32)
        one = Constant <value = float {1.0}> ()
        a = Add(e, one)
        h = Constant <value = float {0.5}> ()
        xh = Mul(h, x)
        y = Mul(a, xh)
    }""")
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 0
    assert any("argument of Erf is" in r for r in refusals(report, GELU)), refusals(report)  # x would be d16


def test_narrowing_cast_in_the_outer_expression_is_refused():
    """float16 model computing erf and 1+erf in float32, rounding 1+erf to float16 before the product."""
    model = parse(head("float16") + """
        x32 = Cast <to = 1> (x)
        s = Constant <value = float {1.4142135}> ()
        d = Div(x32, s)
        e = Erf(d)
        one = Constant <value = float {1.0}> ()
        a = Add(e, one)
        a16 = Cast <to = 10> (a)
        xh = Mul(x, h16)
        y = Mul(a16, xh)
    }""", inits={"h16": np.array(0.5, np.float16)})
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 0
    assert any("narrower float16 inside the pattern" in r for r in refusals(report, GELU)), refusals(report)


def test_cast_inside_read_outside_is_refused():
    """An intermediate Cast (of 0.5·x) that another node reads cannot be removed."""
    text = ("g (float16[2,5,8] x) => (float16[2,5,8] y, float[2,5,8] z) {\n" + """
        x32 = Cast <to = 1> (x)
        xh16 = Mul(x, h16)
        xh = Cast <to = 1> (xh16)
        s = Constant <value = float {1.4142135}> ()
        d = Div(x32, s)
        e = Erf(d)
        one = Constant <value = float {1.0}> ()
        a = Add(e, one)
        r = Mul(xh, a)
        y = Cast <to = 10> (r)
        z = Neg(xh)
    }""")
    half = {"h16": np.array(0.5, np.float16)}
    model = parse(text, inits=half)
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 0
    assert any("also read by" in r for r in refusals(report, GELU)), refusals(report)
    # without the other reader the same island fuses
    out, report = fuse(parse(text.replace(", float[2,5,8] z", "").replace("z = Neg(xh)", ""), inits=half), GELU)
    assert ops(out) == {"com.microsoft:Gelu": 1}, refusals(report)
    check_against(out, gelu64, "float16")


def test_cast_to_integer_inside_is_refused():
    model = parse(head() + """
        i = Cast <to = 7> (x)
        f = Cast <to = 1> (i)
        s = Constant <value = float {1.4142135}> ()
        d = Div(f, s)
        e = Erf(d)
        one = Constant <value = float {1.0}> ()
        a = Add(e, one)
        h = Constant <value = float {0.5}> ()
        xh = Mul(h, x)
        y = Mul(a, xh)
    }""")
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 0


# --- a bias computed at run time (ONNX Runtime's bias_gelu_fusion*.onnx, bias_onnx_*gelu_fusion.onnx) ----


@pytest.mark.parametrize("approximate,op,reference", [("none", "BiasGelu", gelu64), ("tanh", "FastGelu", fast_gelu64)])
def test_run_time_bias_of_known_length(approximate, op, reference):
    model = parse("g (float[2,5,8] v, float[8] b) => (float[2,5,8] y) {\n    x = Add(v, b)\n"
                  f'    y = Gelu <approximate = "{approximate}"> (x)\n}}', opset=20)
    rule = GELU if approximate == "none" else FAST
    out, report = fuse(model, rule, BIAS)
    assert ops(out) == {f"com.microsoft:{op}": 1}, refusals(report)
    assert list(out.graph.node[0].input) == ["v", "b"]
    rng = np.random.default_rng(5)
    v, b = (rng.standard_normal((2, 5, 8)) * 3).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    got = helpers.run_ort(out, {"v": v, "b": b})["y"].astype(np.float64)
    np.testing.assert_allclose(got, reference(v.astype(np.float64) + b), rtol=1e-4, atol=1e-5)


def test_run_time_bias_of_unknown_length_is_refused():
    model = parse("g (float[2,5,8] v, float[n] b) => (float[2,5,8] y) {\n    x = Add(v, b)\n    y = Gelu(x)\n}",
                  opset=20)
    out, report = fuse(model, GELU, BIAS)
    assert ops(out) == {"Add": 1, "com.microsoft:Gelu": 1}
    assert any("no 1-D bias operand" in r for r in refusals(report, BIAS)), refusals(report)
