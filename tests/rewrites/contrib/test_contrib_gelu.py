"""Gelu / FastGelu / BiasGelu / QuickGelu rules: positives in several export styles, near-misses, numerics."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_testlib import fuse, ops, parse, refusals, same_outputs, to_dtype

from onnxfuse.rewrites.contrib.contrib_bias_gelu import ContribBiasGelu
from onnxfuse.rewrites.contrib.contrib_fast_gelu import ContribFastGelu
from onnxfuse.rewrites.contrib.contrib_gelu import ContribGelu
from onnxfuse.rewrites.contrib.contrib_quick_gelu import ContribQuickGelu

GELU, FAST, BIAS, QUICK = ContribGelu(), ContribFastGelu(), ContribBiasGelu(), ContribQuickGelu()

HEAD = "g (float[2,5,8] x) => (float[2,5,8] y) {\n"

# --- Gelu (erf form) ---------------------------------------------------------------------------

GELU_FORMS = {
    # ONNX Runtime's documented form: (0.5·x)·(1 + erf(x/√2))
    "ort": """
        s = Constant <value = float {1.4142135}> ()
        d = Div(x, s)
        e = Erf(d)
        one = Constant <value = float {1.0}> ()
        a = Add(e, one)
        h = Constant <value = float {0.5}> ()
        xh = Mul(x, h)
        y = Mul(xh, a)
    """,
    # PyTorch's legacy export: (x·(erf(x/√2) + 1))·0.5
    "torch": """
        s = Constant <value = float {1.4142135}> ()
        d = Div(x, s)
        e = Erf(d)
        one = Constant <value = float {1.0}> ()
        a = Add(one, e)
        m = Mul(x, a)
        h = Constant <value = float {0.5}> ()
        y = Mul(m, h)
    """,
    # Mul by 1/√2 instead of Div by √2; 0.5 on the left of x
    "mul_sqrt_half": """
        s = Constant <value = float {0.70710678}> ()
        d = Mul(s, x)
        e = Erf(d)
        one = Constant <value = float {1.0}> ()
        a = Add(e, one)
        h = Constant <value = float {0.5}> ()
        hx = Mul(h, x)
        y = Mul(a, hx)
    """,
    # x·(0.5 + 0.5·erf(x/√2))
    "distributed": """
        s = Constant <value = float {1.4142135}> ()
        d = Div(x, s)
        e = Erf(d)
        h = Constant <value = float {0.5}> ()
        eh = Mul(e, h)
        a = Add(eh, h)
        y = Mul(x, a)
    """,
}


@pytest.mark.parametrize("form", sorted(GELU_FORMS))
def test_gelu_forms_fuse_and_match(form):
    model = parse(HEAD + GELU_FORMS[form] + "}")
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 1, refusals(report)
    assert ops(out) == {"com.microsoft:Gelu": 1}
    assert out.graph.node[0].input[0] == "x" and out.graph.node[0].output[0] == "y"
    same_outputs(model, out)


def test_gelu_float16_fuses():
    model = to_dtype(parse(HEAD + GELU_FORMS["torch"] + "}"), np.float16)
    out, report = fuse(model, GELU)
    assert ops(out) == {"com.microsoft:Gelu": 1}
    same_outputs(model, out, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize(
    "old,new,why",
    [
        ("float {1.4142135}", "float {1.5}", "argument of Erf"),  # wrong divisor
        ("h = Constant <value = float {0.5}>", "h = Constant <value = float {0.6}>", "no expression"),  # wrong 0.5
        ("h = Constant <value = float {0.5}> ()", "h = Constant <value = float[1,1,1,1] {0.5}> ()", "broadcasts"),
    ],
)
def test_gelu_near_misses(old, new, why):
    model = parse(HEAD + GELU_FORMS["torch"].replace(old, new) + "}" if "1,1,1,1" not in new else
                  "g (float[2,5,8] x) => (float[1,2,5,8] y) {\n" + GELU_FORMS["torch"].replace(old, new) + "}")
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 0
    assert "com.microsoft:Gelu" not in ops(out)
    assert any(why in r for r in refusals(report, GELU)), refusals(report)


def test_gelu_refuses_shared_intermediate():
    # erf(x/√2) is also a graph output: removing it would break the model
    model = parse("g (float[2,5,8] x) => (float[2,5,8] y, float[2,5,8] e) {\n" + GELU_FORMS["torch"] + "}")
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 0
    assert any("graph output" in r or "read more than once" in r for r in refusals(report, GELU)), refusals(report)


def test_gelu_refuses_two_different_inputs():
    body = GELU_FORMS["torch"].replace("m = Mul(x, a)", "m = Mul(z, a)")
    model = parse("g (float[2,5,8] x, float[2,5,8] z) => (float[2,5,8] y) {\n" + body + "}")
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 0


# --- FastGelu (tanh form) ---------------------------------------------------------------------------

FAST_TAIL = """
    t = Tanh(inner)
    one = Constant <value = float {1.0}> ()
    a = Add(t, one)
    h = Constant <value = float {0.5}> ()
    xh = Mul(x, h)
    y = Mul(xh, a)
"""

FAST_FORMS = {
    "pow": """
        three = Constant <value = float {3.0}> ()
        p = Pow(x, three)
        c = Constant <value = float {0.044715}> ()
        pc = Mul(p, c)
        s = Add(x, pc)
        k = Constant <value = float {0.7978845608}> ()
        inner = Mul(s, k)
    """,
    "mulmul": """
        xx = Mul(x, x)
        p = Mul(xx, x)
        c = Constant <value = float {0.044715}> ()
        pc = Mul(c, p)
        s = Add(pc, x)
        k = Constant <value = float {0.7978845608}> ()
        inner = Mul(k, s)
    """,
    # ONNX Runtime's first formula: (k·x)·(1 + 0.044715·x·x)
    "ort_first": """
        c = Constant <value = float {0.044715}> ()
        m1 = Mul(c, x)
        m2 = Mul(m1, x)
        one1 = Constant <value = float {1.0}> ()
        a1 = Add(m2, one1)
        k = Constant <value = float {0.7978845834732056}> ()
        m4 = Mul(x, k)
        inner = Mul(a1, m4)
    """,
}


# --- BiasGelu ----------------------------------------------------------------------------------------------

def _bias_model(act_body: str, bias_shape=(8,)):
    rng = np.random.default_rng(0)
    inits = {"W": rng.standard_normal((6, 8)).astype(np.float32),
             "b": rng.standard_normal(bias_shape).astype(np.float32)}
    body = "mm = MatMul(v, W)\nx = Add(mm, b)\n" + act_body
    return parse("g (float[2,5,6] v) => (float[2,5,8] y) {\n" + body + "}", inits=inits)


# --- QuickGelu ---------------------------------------------------------------------------------------------


# --- ONNX's own Gelu (opset 20) ------------------------------------------------------------------


@pytest.mark.parametrize("approximate, rule, op", [("none", GELU, "com.microsoft:Gelu"),
                                                   ("tanh", FAST, "com.microsoft:FastGelu")])
def test_native_gelu_maps_to_the_contrib_op(approximate, rule, op):
    model = parse(HEAD + f'    y = Gelu <approximate = "{approximate}"> (x)\n}}', opset=20)
    out, report = fuse(model, rule)
    assert report.counts[rule.name] == 1, refusals(report)
    assert ops(out) == {op: 1}
    same_outputs(model, out, rtol=1e-5, atol=1e-6)
    other = FAST if rule is GELU else GELU  # the other mode's rule leaves it alone, without a refusal
    assert fuse(model, other)[1].counts[other.name] == 0 and not refusals(fuse(model, other)[1], other)


def test_native_gelu_in_bfloat16_is_refused():
    # com.microsoft Gelu has no bfloat16 CUDA kernel: without a bias Add for BiasGelu, nothing to write
    model = parse("g (bfloat16[2,5,8] x) => (bfloat16[2,5,8] y) {\n    y = Gelu(x)\n}", opset=20)
    out, report = fuse(model, GELU)
    assert report.counts[GELU.name] == 0 and any(
        "no bfloat16 CUDA kernel" in r and "not produced by an Add" in r for r in refusals(report)), refusals(report)


def test_a_bfloat16_gelu_of_a_bias_add_becomes_bias_gelu():
    # BiasGelu has a bfloat16 CUDA kernel: Gelu(x + b) with b 1-D over x's last axis, the Add included;
    # the same Gelu of a bias read elsewhere too is refused (the Add must go with it)
    text = ("g (bfloat16[2,5,8] x, bfloat16[8] b) => (bfloat16[2,5,8] y) {\n    s = Add(x, b)\n"
            "    y = Gelu(s)\n}")
    out, report = fuse(parse(text, opset=20), GELU)
    assert report.counts[GELU.name] == 1 and dict(ops(out)) == {"com.microsoft:BiasGelu": 1}, refusals(report)
    node = out.graph.node[0]
    assert node.domain == "com.microsoft" and list(node.input) == ["x", "b"]
    shared = ("g (bfloat16[2,5,8] x, bfloat16[8] b) => (bfloat16[2,5,8] y, bfloat16[2,5,8] s) {\n"
              "    s = Add(x, b)\n    y = Gelu(s)\n}")
    out, report = fuse(parse(shared, opset=20), GELU)
    assert report.counts[GELU.name] == 0 and "com.microsoft:BiasGelu" not in ops(out)
