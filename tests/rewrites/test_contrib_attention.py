"""contrib-attention: attention as exporters write it becomes one com.microsoft MultiHeadAttention, with
the same outputs as the original (ONNX Runtime CPU, the original model as the reference).

Synthetic models cover the forms the rule accepts (Kᵀ in one Transpose or two, the scale on the scores
or split over Q and K, projection biases or not, a padding mask broadcast over queries, a constant
causal mask of rank 2, a full [B, 1, S, L] mask, cross-attention with L != S, the head count inferred
from a -1), the committed BERT export, and the refusals.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import helpers
from helpers import load_testdata, run_ort

B, S, L, H, D = 2, 5, 7, 2, 4
E = H * D
RULE = "contrib-attention"


def attention_model(kt="one", scale="scores", mask=None, bias=True, cross=False, v_target=(0, 0, -1, D),
                    softmax_axis=-1, dtype=np.float32, seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    inputs = [h.make_tensor_value_info("x", elem, ["B", S, E])]
    src = "x"
    if cross:
        inputs.append(h.make_tensor_value_info("y", elem, ["B", L, E]))
        src = "y"
    for name, source in (("q", "x"), ("k", src), ("v", src)):
        w = const(f"W{name}", (rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype))
        out = f"{name}_mm" if bias else name
        nodes.append(h.make_node("MatMul", [source, w], [out]))
        if bias:
            b = const(f"b{name}", (rng.standard_normal(E) * 0.1).astype(dtype))
            nodes.append(h.make_node("Add", [out, b], [name]))
    targets = {"q": (0, 0, H, D), "k": (0, 0, H, D), "v": v_target}
    for name in "qkv":
        nodes.append(h.make_node("Reshape", [name, const(f"{name}_shape", np.array(targets[name], np.int64))],
                                 [f"{name}4"]))
    nodes.append(h.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]))
    nodes.append(h.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]))
    if kt == "one":
        nodes.append(h.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]))
    else:
        nodes.append(h.make_node("Transpose", ["k4"], ["kh"], perm=[0, 2, 1, 3]))
        nodes.append(h.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]))
    qa, ka = "qh", "kt"
    if scale == "qk":  # torch's nn.MultiheadAttention style: both sides scaled by D^-1/4
        s = const("s4", np.array(D ** -0.25, dtype))
        nodes += [h.make_node("Mul", ["qh", s], ["qs"]), h.make_node("Mul", [s, "kt"], ["ks"])]
        qa, ka = "qs", "ks"
    nodes.append(h.make_node("MatMul", [qa, ka], ["scores"]))
    x = "scores"
    if scale == "scores":
        nodes.append(h.make_node("Div", ["scores", const("sqrt_d", np.array(np.sqrt(D), dtype))], ["scaled"]))
        x = "scaled"
    if mask == "padding":  # [B, 1, 1, L] from a float 0/1 mask, as (1 - m) * -10000
        inputs.append(h.make_tensor_value_info("m", elem, ["B", L if cross else S]))
        nodes += [h.make_node("Unsqueeze", ["m", const("ax12", np.array([1, 2], np.int64))], ["m4"]),
                  h.make_node("Sub", [const("one", np.array(1.0, dtype)), "m4"], ["inv"]),
                  h.make_node("Mul", ["inv", const("big", np.array(-10000.0, dtype))], ["madd"])]
    elif mask == "causal":  # a constant [S, S] triangle (rank 2)
        tri = np.triu(np.full((S, S), np.finfo(dtype).min, dtype), 1)
        const("madd", tri)
    elif mask == "full":
        inputs.append(h.make_tensor_value_info("madd", elem, ["B", 1, S, L if cross else S]))
    if mask is not None:
        nodes.append(h.make_node("Add", [x, "madd"], ["masked"]))
        x = "masked"
    nodes.append(h.make_node("Softmax", [x], ["probs"], axis=softmax_axis))
    nodes.append(h.make_node("MatMul", ["probs", "vh"], ["ctx"]))
    nodes.append(h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]))
    nodes.append(h.make_node("Reshape", ["ctx_t", const("out_shape", np.array([0, 0, E], np.int64))], ["att"]))
    nodes.append(h.make_node("MatMul", ["att", const("Wo", (rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype))],
                             ["out"]))
    graph = h.make_graph(nodes, "attention", inputs, [h.make_tensor_value_info("out", elem, ["B", S, E])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def feeds_for(model, seed=1):
    feeds = helpers.random_feeds(model, seed=seed, dim=B)
    if "m" in feeds:  # a padding mask: 0/1, with padding in one row
        m = np.ones_like(feeds["m"])
        m[0, -2:] = 0
        feeds["m"] = m
    return feeds


def apply(model):
    out, report = helpers.optimize(model, only=[RULE])
    onnx.checker.check_model(out, full_check=True)
    return out, report


def assert_same(original, optimized, rtol=1e-5, atol=1e-6):
    feeds = feeds_for(original)
    want, got = run_ort(original, feeds), run_ort(optimized, feeds)
    for name, a in want.items():
        np.testing.assert_allclose(got[name].astype(np.float64), a.astype(np.float64), rtol=rtol, atol=atol)


@pytest.mark.parametrize("kt", ["one", "two"])
@pytest.mark.parametrize("scale", ["scores", "qk", "none"])
@pytest.mark.parametrize("mask", [None, "padding", "causal", "full"])
def test_forms_become_one_multihead_attention_with_the_same_outputs(kt, scale, mask):
    model = attention_model(kt=kt, scale=scale, mask=mask)
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = helpers.op_types(out)
    assert ops.count("MultiHeadAttention") == 1 and "Softmax" not in ops and "Transpose" not in ops
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["num_heads"] == H and detail["qkv_bias"] is True and detail["mask"] is (mask is not None)
    expected_scale = 1.0 if scale == "none" else D ** -0.5
    assert detail["scale"] == pytest.approx(expected_scale, rel=1e-6)
    assert_same(model, out)


@pytest.mark.parametrize("mask", [None, "padding", "full"])
def test_cross_attention_with_another_length(mask):
    model = attention_model(cross=True, mask=mask)
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    assert_same(model, out)


def test_without_projection_biases_q_k_v_are_taken_as_they_are():
    model = attention_model(bias=False, mask="padding")
    out, report = apply(model)
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["qkv_bias"] is False
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    assert list(mha.input[:3]) == ["q", "k", "v"] and mha.input[3] == ""
    assert_same(model, out)


def test_float16():
    model = attention_model(dtype=np.float16, mask="padding")
    out, report = apply(model)
    assert report.counts[RULE] == 1
    assert_same(model, out, rtol=2e-2, atol=2e-3)


def test_refusals_carry_their_reason():
    computed_target = attention_model()  # Q's head split reads its target from a graph input
    init = next(i for i in computed_target.graph.initializer if i.name == "q_shape")
    computed_target.graph.initializer.remove(init)
    computed_target.graph.input.append(h.make_tensor_value_info("q_shape", T.INT64, [4]))
    cases = {
        "Softmax is not over the last axis": attention_model(softmax_axis=2),
        "Q: the head-splitting Reshape's target is not a constant": computed_target,
    }
    for reason, model in cases.items():
        out, report = apply(model)
        assert report.counts[RULE] == 0
        assert any(reason in r.reason for r in report.refusals if r.rule == RULE), report.refusals
        assert "MultiHeadAttention" not in helpers.op_types(out)


def test_an_intermediate_read_elsewhere_is_refused():
    model = attention_model()
    model.graph.output.append(h.make_tensor_value_info("probs", T.FLOAT, None))
    out, report = apply(model)
    assert report.counts[RULE] == 0
    assert any("'probs' is also a graph output" in r.reason for r in report.refusals if r.rule == RULE)


def test_bert_export_attention_is_fused_and_validates():
    """The committed BERT (transformers, opset 14, legacy exporter): its mask is a computed [B, 1, S, L]
    Where; both layers become MultiHeadAttention with the projection biases folded in, and the optimized
    model (all default rules plus this one) matches the original with real padding in the mask."""
    import onnxfuse
    from onnxfuse.rewrites import RULES

    model = load_testdata("bert_tiny_opset14")
    names = [r.name for r in RULES if "cuda" in r.targets and not r.opt_in] + [RULE]
    result = onnxfuse.optimize(model, only=names, provider="cpu", samples=3)
    assert result.applied.counts[RULE] == 2 and result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("MultiHeadAttention") == 2 and "Softmax" not in ops
    from onnxfuse.custom_ops import session_options
    import onnxruntime as ort

    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, (3, 16)).astype(np.int64)
    mask = np.ones((3, 16), np.int64)
    mask[0, 10:] = 0
    mask[2, 1:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    want = run_ort(model, feeds)
    got = ort.InferenceSession(result.model.SerializeToString(), session_options(),
                               providers=["CPUExecutionProvider"]).run(None, feeds)
    for (name, a), b in zip(want.items(), got):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg=name)


def test_opt_in_until_measured_on_a_gpu():
    from onnxfuse.rewrites import select_rules

    assert RULE not in [r.name for r in select_rules("cuda")]
    assert RULE in [r.name for r in select_rules("cuda", only=RULE)]
