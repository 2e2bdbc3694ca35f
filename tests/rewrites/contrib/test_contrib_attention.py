"""contrib-attention: attention as exporters write it becomes one com.microsoft Attention (self-attention
whose q, k, v are constant-weight projections of one tensor: packed) or MultiHeadAttention (otherwise),
with the same outputs as the original (ONNX Runtime CPU, the original model as the reference).

Synthetic models cover the forms the rule accepts (Kᵀ in one Transpose or two, the scale on the scores
or split over Q and K, projection biases or not, a padding mask broadcast over queries, a constant
causal mask of rank 2, a full [B, 1, S, L] mask, cross-attention with L != S, the head count inferred
from a -1), the committed BERT export, and the refusals.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import helpers
from helpers import load_testdata, run_ort
from onnxfuse.rewrites.contrib.attention.keep_masks import promised_zero_one

B, S, L, H, D = 2, 5, 7, 2, 4
E = H * D
RULE = "contrib-attention"
FUSED = ("Attention", "MultiHeadAttention")


def fused(model) -> list[str]:
    return [op for op in helpers.op_types(model) if op in FUSED]


def initializer(model, name):
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name))


def attention_model(kt="one", scale="scores", mask=None, bias=True, cross=False, v_target=(0, 0, -1, D),
                    softmax_axis=-1, dtype=np.float32, seed=0, fill=None, casts=False, shape_reads=False,
                    qk_target=(0, 0, H, D), q_prescale=False, k_bias=True, kv_len=L, seq=None) -> onnx.ModelProto:
    S = seq or globals()["S"]  # noqa: N806 (the query length; long only for the all-keys mask test)
    rng = np.random.default_rng(seed)
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    inputs = [h.make_tensor_value_info("x", elem, ["B", S, E])]
    src = "x"
    if cross:
        inputs.append(h.make_tensor_value_info("y", elem, ["B", kv_len, E]))
        src = "y"
    for name, source in (("q", "x"), ("k", src), ("v", src)):
        w = const(f"W{name}", (rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype))
        has_bias = bias and (k_bias or name != "k")
        out = f"{name}_mm" if has_bias else name
        if name == "q" and q_prescale:
            out, final = (f"{name}_mm", "q_b") if has_bias else ("q_mm", "q_b")
        nodes.append(h.make_node("MatMul", [source, w], [out]))
        if name == "q" and q_prescale:
            if has_bias:
                nodes.append(h.make_node("Add", [out, const("bq", (rng.standard_normal(E) * 0.1).astype(dtype))],
                                         ["q_b"]))
            else:
                final = out
            nodes.append(h.make_node("Mul", [final, const("q_scale", np.array(D ** -0.5, dtype))], ["q"]))
            continue
        if has_bias:
            b = const(f"b{name}", (rng.standard_normal(E) * 0.1).astype(dtype))
            nodes.append(h.make_node("Add", [out, b], [name]))
    targets = {"q": qk_target, "k": qk_target, "v": v_target}
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
    if casts:  # element-type-preserving Casts, as GPT-2's export writes them
        nodes.append(h.make_node("Cast", [x], ["x_cast"], to=elem))
        x = "x_cast"
    if mask in ("where", "where_swapped", "where_add"):  # masked_fill: Where(c, s, f) or Where(c, f, s)
        f = np.finfo(dtype).min if fill is None else fill
        inputs.append(h.make_tensor_value_info("c", T.BOOL, ["B", 1, 1, L if cross else S]))
        branches = [x, const("fill", np.array(f, dtype))]
        nodes.append(h.make_node("Where", ["c", *(branches if mask != "where_swapped" else branches[::-1])],
                                 ["where_out"]))
        x = "where_out"
        if mask == "where_add":  # then an additive padding mask, GPT-2's order
            inputs.append(h.make_tensor_value_info("madd", elem, ["B", 1, 1, L if cross else S]))
    if mask in ("padding", "causal", "full", "where_add"):
        nodes.append(h.make_node("Add", [x, "madd"], ["masked"]))
        x = "masked"
    nodes.append(h.make_node("Softmax", [x], ["probs"], axis=softmax_axis))
    if casts:
        nodes.append(h.make_node("Cast", ["probs"], ["probs_cast"], to=elem))
    nodes.append(h.make_node("MatMul", ["probs_cast" if casts else "probs", "vh"], ["ctx"]))
    nodes.append(h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]))
    nodes.append(h.make_node("Reshape", ["ctx_t", const("out_shape", np.array([0, 0, E], np.int64))], ["att"]))
    nodes.append(h.make_node("MatMul", ["att", const("Wo", (rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype))],
                             ["out"]))
    outputs = [h.make_tensor_value_info("out", elem, ["B", S, E])]
    if shape_reads:  # the exporter reads shapes of the scores and of the heads (GPT-2, DistilBERT)
        for t in ("scores", "qh", "kt", "vh"):
            nodes.append(h.make_node("Shape", [t], [f"{t}_shape"]))
            outputs.append(h.make_tensor_value_info(f"{t}_shape", T.INT64, [4]))
    graph = h.make_graph(nodes, "attention", inputs, outputs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def feeds_for(model, seed=1):
    numeric = onnx.ModelProto()
    numeric.CopyFrom(model)
    bools = [i for i in numeric.graph.input if i.type.tensor_type.elem_type == T.BOOL]
    for i in bools:
        numeric.graph.input.remove(i)
    feeds = helpers.random_feeds(numeric, seed=seed, dim=B)
    for i in bools:
        feeds[i.name] = np.ones([d.dim_value or B for d in i.type.tensor_type.shape.dim], bool)
    if "m" in feeds:  # a padding mask: 0/1, with padding in one row
        m = np.ones_like(feeds["m"])
        m[0, -2:] = 0
        feeds["m"] = m
    if "c" in feeds:  # a bool keep-mask with padding in one row (then padding by an additive mask)
        c = np.ones(feeds["c"].shape, bool)
        c[0, ..., -2:] = False
        feeds["c"] = c
        if "madd" in feeds:
            m = np.zeros_like(feeds["madd"])
            m[1, ..., -1:] = np.finfo(m.dtype).min
            m[0, ..., -3:] = np.finfo(m.dtype).min  # a column masked twice: f + f = -inf in both models
            feeds["madd"] = m
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
def test_forms_become_one_packed_attention_with_the_same_outputs(kt, scale, mask):
    model = attention_model(kt=kt, scale=scale, mask=mask)
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = helpers.op_types(out)
    assert fused(out) == ["Attention"] and "Softmax" not in ops and "Transpose" not in ops
    assert ops.count("MatMul") == 1  # the three projections went into the Attention (the output one stays)
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["num_heads"] == H and detail["qkv_packed"] is True and detail["mask"] is (mask is not None)
    expected_scale = 1.0 if scale == "none" else D ** -0.5
    assert detail["scale"] == pytest.approx(expected_scale, rel=1e-6)
    assert_same(model, out)


@pytest.mark.parametrize("mask", [None, "padding", "full"])
def test_cross_attention_with_another_length(mask):
    """k and v project another tensor than q: nothing to pack, MultiHeadAttention with the biases."""
    model = attention_model(cross=True, mask=mask)
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    assert fused(out) == ["MultiHeadAttention"]
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["qkv_bias"] is True
    assert_same(model, out)


def test_cross_attention_without_projection_biases_q_k_v_are_taken_as_they_are():
    model = attention_model(bias=False, mask="padding", cross=True)
    out, report = apply(model)
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["qkv_bias"] is False
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    assert list(mha.input[:3]) == ["q", "k", "v"] and mha.input[3] == ""
    assert_same(model, out)


def test_packed_weight_is_the_three_projections_side_by_side():
    """Attention's weight is [W_q | W_k | W_v] along the columns and its bias [b_q | b_k | b_v] (E zeros
    for a projection without one): compared with the original initializers, not only by the outputs."""
    for bias in (True, False):
        model = attention_model(bias=bias, mask="padding")
        out, report = apply(model)
        att = next(n for n in out.graph.node if n.op_type == "Attention")
        assert att.input[0] == "x"
        want_w = np.concatenate([initializer(model, f"W{t}") for t in "qkv"], axis=1)
        np.testing.assert_array_equal(initializer(out, att.input[1]), want_w)
        want_b = (np.concatenate([initializer(model, f"b{t}") for t in "qkv"]) if bias
                  else np.zeros(3 * E, np.float32))
        np.testing.assert_array_equal(initializer(out, att.input[2]), want_b)
        assert_same(model, out)


def test_linear_weights_behind_a_transpose_are_packed_transposed():
    """torch's nn.Linear exports ``MatMul(x, Transpose(W, perm=[1, 0]))`` and fold-constants leaves large
    transposes unfolded: the packed weight is ``[W_qᵀ | W_kᵀ | W_vᵀ]``, with the same outputs."""
    model = attention_model(mask="padding")
    g = model.graph
    for t in "qkv":
        init = next(i for i in g.initializer if i.name == f"W{t}")
        init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).T.copy(), f"W{t}_stored"))
        g.node.insert(0, h.make_node("Transpose", [f"W{t}_stored"], [f"W{t}"], perm=[1, 0]))
    out, report = apply(model)
    att = next(n for n in out.graph.node if n.op_type == "Attention")
    want = np.concatenate([initializer(model, f"W{t}_stored").T for t in "qkv"], axis=1)
    np.testing.assert_array_equal(initializer(out, att.input[1]), want)
    assert "Transpose" not in helpers.op_types(out)
    assert_same(model, out)


def split_projection_model(batch=B):
    """GPT-2's Conv1D projection: Reshape(x, [-1, E]) → Gemm(W [E, 3E], b) → Reshape(back) → Split into
    q, k, v (the rest as :func:`attention_model` with a padding mask), x of static shape [B, S, E]."""
    model = attention_model(mask="padding")
    g = model.graph
    w = np.concatenate([initializer(model, f"W{t}") for t in "qkv"], axis=1)
    b = np.concatenate([initializer(model, f"b{t}") for t in "qkv"])
    drop = [n for n in g.node if any(o in ("q_mm", "k_mm", "v_mm", "q", "k", "v") for o in n.output)]
    for n in drop:
        g.node.remove(n)
    g.initializer.extend([numpy_helper.from_array(w, "W_attn"), numpy_helper.from_array(b, "b_attn"),
                          numpy_helper.from_array(np.array([-1, E], np.int64), "flat"),
                          numpy_helper.from_array(np.array([B, S, 3 * E], np.int64), "back"),
                          numpy_helper.from_array(np.array([E] * 3, np.int64), "thirds")])
    for i, n in enumerate([h.make_node("Reshape", ["x", "flat"], ["x2"]),
                           h.make_node("Gemm", ["x2", "W_attn", "b_attn"], ["qkv2"]),
                           h.make_node("Reshape", ["qkv2", "back"], ["qkv"]),
                           h.make_node("Split", ["qkv", "thirds"], ["q", "k", "v"], axis=2)]):
        g.node.insert(i, n)
    x = next(i for i in g.input if i.name == "x")
    if isinstance(batch, str):
        x.type.tensor_type.shape.dim[0].dim_param = batch
    else:
        x.type.tensor_type.shape.dim[0].dim_value = batch
    del g.value_info[:]
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def test_gpt2_split_projection_is_packed():
    """q, k, v cut by Split from one Gemm between Reshapes: packed Attention with the Gemm's W and b."""
    model = split_projection_model()
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    assert fused(out) == ["Attention"] and not {"Gemm", "Split"} & set(helpers.op_types(out))
    att = next(n for n in out.graph.node if n.op_type == "Attention")
    np.testing.assert_array_equal(initializer(out, att.input[1]), initializer(model, "W_attn"))
    np.testing.assert_array_equal(initializer(out, att.input[2]), initializer(model, "b_attn"))
    assert_same(model, out)


def test_split_projection_back_to_dims_not_provably_x_s_is_not_packed():
    """x [B (named), S, E] reshaped back to a constant [2, S, 3E]: right only when B is 2 at run time,
    which the graph does not prove. Not packed (MultiHeadAttention takes the Split outputs as they are);
    the outputs are still the original's."""
    model = split_projection_model(batch="B")
    out, report = apply(model)
    assert "Attention" not in fused(out)
    assert_same(model, out)


def test_projections_not_packed_when_a_projection_is_read_elsewhere():
    """k's projection also feeds a graph output: the MatMuls must stay, so MultiHeadAttention takes them."""
    model = attention_model(mask="padding")
    model.graph.output.append(h.make_tensor_value_info("k", T.FLOAT, ["B", S, E]))
    out, report = apply(model)
    assert fused(out) == ["MultiHeadAttention"], [r.reason for r in report.refusals]
    assert_same(model, out)


def test_float16():
    model = attention_model(dtype=np.float16, mask="padding")
    out, report = apply(model)
    assert report.counts[RULE] == 1 and fused(out) == ["Attention"]
    assert_same(model, out, rtol=2e-2, atol=2e-3)


def test_float32_over_many_keys_is_left_unfused_and_float16_is_not():
    """ONNX Runtime's fp32 attention kernel for >= 256 keys was slower than the unfused graph (Whisper,
    L = 1500): refused in float32 with the measured reason; one key fewer, and float16, fuse."""
    from onnxfuse.rewrites.contrib.attention.policy import FP32_LONG_KEYS

    long_fp32 = attention_model(cross=True, kv_len=FP32_LONG_KEYS)
    out, report = apply(long_fp32)
    assert report.counts[RULE] == 0 and not fused(out)
    assert any(f"float32 attention over {FP32_LONG_KEYS} keys is left unfused" in r.reason
               for r in report.refusals if r.rule == RULE), report.refusals
    for model in (attention_model(cross=True, kv_len=FP32_LONG_KEYS - 1),
                  attention_model(cross=True, kv_len=FP32_LONG_KEYS, dtype=np.float16)):
        out, report = apply(model)
        assert report.counts[RULE] == 1, [r.reason for r in report.refusals]


def test_float32_self_attention_over_many_keys_packs_with_a_mask_of_ones():
    """Packed self-attention over >= 256 keys fuses in float32 with a raw mask_index of ones [B, L],
    computed from x on the device: a raw mask keeps ONNX Runtime on its unfused kernel (the
    memory-efficient one it would pick was the slow part) and masks nothing. Checked against the
    original at two batch sizes, and the mask's values directly: all ones, whatever x holds (NaN too)."""
    from onnxfuse.rewrites.contrib.attention.policy import FP32_LONG_KEYS

    model = attention_model(seq=FP32_LONG_KEYS)
    out, report = apply(model)
    assert report.counts[RULE] == 1 and fused(out) == ["Attention"], [r.reason for r in report.refusals]
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_form"] == "all-keys mask_index"
    (att,) = [n for n in out.graph.node if n.op_type == "Attention"]
    assert len(att.input) == 4 and att.input[3]
    assert_same(model, out)
    probe = onnx.ModelProto()
    probe.CopyFrom(out)
    probe.graph.output.append(h.make_tensor_value_info(att.input[3], T.INT32, None))
    x = np.random.default_rng(1).standard_normal((2, FP32_LONG_KEYS, E)).astype(np.float32)
    x[1, 5, :] = np.nan
    mask = run_ort(probe, {"x": x})[att.input[3]]
    assert mask.shape == (2, FP32_LONG_KEYS) and mask.dtype == np.int32 and (mask == 1).all()


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
        assert not fused(out)


def test_an_intermediate_read_elsewhere_is_refused():
    model = attention_model()
    model.graph.output.append(h.make_tensor_value_info("probs", T.FLOAT, None))
    out, report = apply(model)
    assert report.counts[RULE] == 0
    assert any("'probs' is also a graph output" in r.reason for r in report.refusals if r.rule == RULE)


def test_bert_export_attention_is_fused_and_validates():
    """The committed BERT (transformers, opset 14, legacy exporter): its mask is a computed [B, 1, S, L]
    Where; both layers become packed Attention (projections and biases inside the op), and the optimized
    model (all default rules plus this one) matches the original with real padding in the mask."""
    import onnxfuse
    from onnxfuse.rewrites import RULES

    model = load_testdata("bert_tiny_opset14")
    assert RULE in [r.name for r in RULES if not r.opt_in]
    result = onnxfuse.optimize(model, provider="cpu", samples=3)  # the default rules
    assert result.applied.counts[RULE] == 2 and result.validation.passed
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("Attention") == 2 and "Softmax" not in ops
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


def test_on_by_default_since_measured_on_a_gpu():
    from onnxfuse.rewrites import select_rules

    assert RULE in [r.name for r in select_rules("cuda")]
    assert RULE in [r.name for r in select_rules("contrib")]
    assert RULE not in [r.name for r in select_rules("cuda", skip=RULE)]


# --- issue 15: more exporters' forms --------------------------------------------------------------------


@pytest.mark.parametrize("mask", ["where", "where_swapped", "where_add"])
@pytest.mark.parametrize("casts", [False, True])
def test_where_masks_with_an_absorbing_fill_become_the_attention_bias(mask, casts):
    """masked_fill (DistilBERT: Where(c, f, s)), GPT-2's Where(causal, s, finfo.min) then + padding, with
    the element-type-preserving Casts GPT-2's export has around the Softmax."""
    model = attention_model(mask=mask, casts=casts)
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = helpers.op_types(out)
    assert len(fused(out)) == 1 and "Softmax" not in ops
    # the no-op Casts are gone; the one Cast left makes the key padding mask's int32 mask_index
    casts = [n for n in out.graph.node if n.op_type == "Cast"]
    assert all(h.get_attribute_value(n.attribute[0]) == T.INT32 for n in casts)
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_terms"] == (["add", "where"] if mask == "where_add" else ["where"])
    # one Where of a [B, 1, 1, L] condition is a key padding mask; a causal term makes it query-dependent
    assert detail["mask_form"] == ("attention_bias" if mask == "where_add" else "mask_index")
    assert len(casts) == (0 if mask == "where_add" else 1)
    assert_same(model, out)


def test_shape_reads_of_removed_tensors_are_recomputed():
    """GPT-2 and DistilBERT read Shape(scores) / Shape(heads) to build their masks: those Shapes are
    computed from the fused op's inputs' shapes and H, D instead, with the same values."""
    model = attention_model(mask="padding", shape_reads=True, cross=True)  # L != S: each dim from its source
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    assert "Softmax" not in helpers.op_types(out) and "Transpose" not in helpers.op_types(out)
    assert_same(model, out)


@pytest.mark.parametrize("target", [(0, -1, H, D), (-1, S, H, D)])
def test_head_targets_with_an_inferred_sequence_or_batch(target):
    model = attention_model(qk_target=target, v_target=target)
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    assert_same(model, out)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cross", [False, True])
def test_q_scaled_before_the_split_and_k_without_bias(bias, cross):
    """Whisper: q = q_proj(x)·D^-1/2 before the heads split, k_proj without bias. The scale joins the
    attention scale; the missing k bias is E zeros (x + 0 == x) in the packed bias (self-attention) or in
    MultiHeadAttention's folded bias (cross-attention, when q or v has one)."""
    model = attention_model(scale="none", q_prescale=True, k_bias=False, bias=bias, mask="padding", cross=cross)
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["scale"] == pytest.approx(D ** -0.5, rel=1e-6)
    op, bias_index = ("MultiHeadAttention", 3) if cross else ("Attention", 2)
    node = next(n for n in out.graph.node if n.op_type == op)
    if cross:
        assert detail["qkv_bias"] is bias
    if bias:
        values = initializer(out, node.input[bias_index])
        assert not values[E:2 * E].any() and values[:E].any() and values[2 * E:].any()
    assert_same(model, out)


def sequence_first_model(merge=(2, 0, 1, 3), t3=(S, -1, D), t4=(-1, H, S, D), seed=0, seq=S, dtype=np.float32,
                         kv="x"):
    """torch.nn.MultiheadAttention's export: x [S, B, E], heads by Reshape [S, B·H, D] → Transpose(1, 0, 2)
    → Reshape [B, H, S, D], the scale split over q and k, output merged by Transpose(2, 0, 1, 3) →
    Reshape [S·B, E]. ``kv``: the input k and v are projected from (another one: cross-attention)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    for name in "qkv":
        w = const(f"W{name}", (rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype))
        nodes.append(h.make_node("MatMul", ["x" if name == "q" else kv, w], [f"{name}_mm"]))
        nodes.append(h.make_node("Add", [f"{name}_mm", const(f"b{name}", (rng.standard_normal(E) * 0.1).astype(
            dtype))], [name]))
        nodes.append(h.make_node("Reshape", [name, const(f"{name}_t3", np.array(t3, np.int64))], [f"{name}3"]))
        nodes.append(h.make_node("Transpose", [f"{name}3"], [f"{name}3t"], perm=[1, 0, 2]))
        nodes.append(h.make_node("Reshape", [f"{name}3t", const(f"{name}_t4", np.array(t4, np.int64))], [f"{name}h"]))
    s = const("s4", np.array(D ** -0.25, dtype))
    nodes.append(h.make_node("Mul", ["qh", s], ["qs"]))
    nodes += [h.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]), h.make_node("Mul", ["kt", s], ["ks"])]
    nodes += [h.make_node("MatMul", ["qs", "ks"], ["scores"]),
              h.make_node("Softmax", ["scores"], ["probs"], axis=-1),
              h.make_node("MatMul", ["probs", "vh"], ["ctx"]),
              h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=list(merge)),
              h.make_node("Reshape", ["ctx_t", const("out_shape", np.array([-1, E], np.int64))], ["out"])]
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = [h.make_tensor_value_info(name, elem, [seq, "B", E]) for name in dict.fromkeys(["x", kv])]
    graph = h.make_graph(nodes, "mha", inputs, [h.make_tensor_value_info("out", elem, ["SB", E])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def test_sequence_first_heads_of_torch_multihead_attention():
    """In float16 the sequence-first self-attention becomes the packed Attention between Transposes to
    [B, S, E] (x is a graph input here, not a Transpose whose source the op could read)."""
    model = sequence_first_model(dtype=np.float16)
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    # the product of the two float16 factors D^-1/4 (each rounded to float16), as the original multiplies
    assert detail["layout"] == "sequence-first" and detail["scale"] == pytest.approx(
        float(np.float16(D ** -0.25)) ** 2, rel=1e-6)
    assert helpers.op_types(out) == ["Transpose", "Attention", "Transpose", "Reshape"]
    assert_same(model, out, rtol=2e-2, atol=2e-3)


def test_float32_sequence_first_self_attention_packs():
    """Packed, the float32 sequence-first attention fuses: one Transpose in, one out."""
    model = sequence_first_model()
    out, report = apply(model)
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    assert helpers.op_types(out) == ["Transpose", "Attention", "Transpose", "Reshape"]
    assert_same(model, out, rtol=1e-4, atol=1e-5)


def test_float32_sequence_first_cross_attention_is_left_unfused_with_the_measured_reason():
    """Not packed (k and v from another input), it would be MultiHeadAttention between four Transposes,
    which cost more than the fusion saves in float32 (ViT-B/16, H200): refused; float16 fuses it."""
    out, report = apply(sequence_first_model(kv="memory"))
    assert report.counts[RULE] == 0 and not fused(out)
    assert any("float32 sequence-first attention is left unfused" in r.reason
               for r in report.refusals if r.rule == RULE), report.refusals
    model16 = sequence_first_model(kv="memory", dtype=np.float16)
    out16, report16 = apply(model16)
    assert report16.counts[RULE] == 1 and fused(out16) == ["MultiHeadAttention"]
    assert_same(model16, out16, rtol=2e-2, atol=2e-3)


def test_new_refusals_carry_their_reason():
    unknown_cond = attention_model(mask="where")  # the condition reshaped by a target of unknown length
    g = unknown_cond.graph
    where = next(n for n in g.node if n.op_type == "Where")
    where.input[0] = "c_any"
    g.node.insert(0, h.make_node("Reshape", ["c", "c_target"], ["c_any"]))
    g.input.append(h.make_tensor_value_info("c_target", T.INT64, ["n"]))
    assert any(v.name == "where_out" for v in g.value_info)  # the scores keep their inferred rank 4
    mask_from_matmul = attention_model(mask="full")  # the "mask" is computed from another MatMul
    g = mask_from_matmul.graph
    g.input.remove(next(i for i in g.input if i.name == "madd"))
    g.input.append(h.make_tensor_value_info("other", T.FLOAT, ["B", 1, S, S]))
    g.node.insert(0, h.make_node("MatMul", ["other", "eye"], ["madd"]))
    g.initializer.append(numpy_helper.from_array(np.eye(S, dtype=np.float32), "eye"))
    scale_after_mask = attention_model(mask="padding", scale="none")
    g = scale_after_mask.graph
    add = next(n for n in g.node if n.op_type == "Add" and "madd" in n.input)
    add.output[0] = "masked0"
    g.node.insert(list(g.node).index(add) + 1, h.make_node("Mul", ["masked0", "half"], ["masked"]))
    g.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    no_inner_reshape = sequence_first_model()  # V: [S, B·H, D] from a Transpose-only path
    g = no_inner_reshape.graph
    r3 = next(n for n in g.node if n.output[0] == "v3")
    g.node.remove(r3)
    g.node.insert(0, h.make_node("Identity", ["v_pre3"], ["v3"]))
    g.input.append(h.make_tensor_value_info("v_pre3", T.FLOAT, [S, "BH", D]))
    untransposed = sequence_first_model()  # V: Reshape [S, B·H, D] → [B, H, S, D] without the Transpose
    next(n for n in untransposed.graph.node if n.output[0] == "vh").input[0] = "v3"
    computed_t3 = sequence_first_model()
    g = computed_t3.graph
    g.initializer.remove(next(i for i in g.initializer if i.name == "q_t3"))
    g.input.append(h.make_tensor_value_info("q_t3", T.INT64, [3]))
    cases = {
        "Where-mask fill -10000 (float32) is not absorbing": attention_model(mask="where", fill=-10000.0),
        "Where-mask fill -65504 (float16) is not absorbing": attention_model(mask="where_add", dtype=np.float16,
                                                                             cross=True),
        "not a bool tensor of known rank": unknown_cond,
        "both operands of the mask Add are computed from a MatMul": mask_from_matmul,
        "or a scale applied after the mask": scale_after_mask,
        "the sequence-first head split's target [5, 4, 4] is not [S, -1, D]": sequence_first_model(t3=(S, 4, D)),
        "the sequence-first head merge's target [2, -1, 5, 4] is not [-1, 2, 5, 4]":
            sequence_first_model(t4=(H, -1, S, D)),
        "the attention output is not merged back by Transpose(perm=[2, 0, 1, 3])":
            sequence_first_model(merge=(0, 2, 1, 3)),
        "is not [sequence, batch, hidden] with a static sequence and hidden size":
            sequence_first_model(seq="S", t3=(0, -1, D)),
        "the [S, B·H, D] heads are not made by a Reshape": no_inner_reshape,
        "nor by Reshape(Transpose(perm=[1, 0, 2]))": untransposed,
        "the sequence-first head split's Reshape targets are not constants": computed_t3,
    }
    for reason, model in cases.items():
        out, report = apply(model)
        assert report.counts[RULE] == 0, reason
        assert any(reason in r.reason for r in report.refusals if r.rule == RULE), (reason, report.refusals)
        assert not fused(out)


def test_where_mask_that_does_not_select_a_scalar_fill_is_refused():
    model = attention_model(mask="where")
    g = model.graph
    fill = next(i for i in g.initializer if i.name == "fill")
    g.initializer.remove(fill)
    g.input.append(h.make_tensor_value_info("fill", T.FLOAT, ["B", H, S, S]))
    out, report = apply(model)
    assert report.counts[RULE] == 0
    assert any("does not select between the scores and a scalar fill" in r.reason
               for r in report.refusals if r.rule == RULE), report.refusals


def test_q_k_v_from_different_layouts_are_refused():
    """q and v batch-first ([2, S, E], [2, L, E]), k sequence-first ([L, 2, E]): valid cross-attention, but
    MultiHeadAttention takes one layout."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    nodes += [h.make_node("Reshape", ["x", const("qt", np.array([0, 0, H, D], np.int64))], ["q4"]),
              h.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["y", const("k3", np.array([L, -1, D], np.int64))], ["k3o"]),
              h.make_node("Transpose", ["k3o"], ["k3t"], perm=[1, 0, 2]),
              h.make_node("Reshape", ["k3t", const("k4", np.array([-1, H, L, D], np.int64))], ["kh"]),
              h.make_node("Transpose", ["kh"], ["kt"], perm=[0, 1, 3, 2]),
              h.make_node("Reshape", ["z", const("vt", np.array([0, 0, H, D], np.int64))], ["v4"]),
              h.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
              h.make_node("MatMul", ["qh", "kt"], ["scores"]),
              h.make_node("Softmax", ["scores"], ["probs"], axis=-1),
              h.make_node("MatMul", ["probs", "vh"], ["ctx"]),
              h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ctx_t", const("out_shape", np.array([0, 0, E], np.int64))], ["att"]),
              h.make_node("MatMul", ["att", const("Wo", rng.standard_normal((E, E)).astype(np.float32))], ["out"])]
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [2, S, E]), h.make_tensor_value_info("y", T.FLOAT, [L, 2, E]),
              h.make_tensor_value_info("z", T.FLOAT, [2, L, E])]
    graph = h.make_graph(nodes, "mixed", inputs, [h.make_tensor_value_info("out", T.FLOAT, [2, S, E])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    model = onnx.shape_inference.infer_shapes(model)
    run_ort(model, helpers.random_feeds(model))  # the original runs
    out, report = apply(model)
    assert report.counts[RULE] == 0
    assert any("Q, K and V are split from different layouts" in r.reason
               for r in report.refusals if r.rule == RULE), report.refusals


# --- one mask expansion for all layers ------------------------------------------------------------------


def two_blocks(seq1, seq2):
    """Two attention blocks (x: [B, seq1, E], b_x: [B, seq2, E]) adding one shared mask input
    ``madd`` [B, 1, 1, L]: what every transformer layer does with its padding mask."""
    first = attention_model(mask="full")
    second = onnx.compose.add_prefix(attention_model(mask="full", seed=1), "b_")
    g = first.graph
    for n in second.graph.node:
        n.input[:] = ["madd" if i == "b_madd" else i for i in n.input]
        g.node.append(n)
    g.initializer.extend(second.graph.initializer)
    g.input.extend(i for i in second.graph.input if i.name != "b_madd")
    g.output.extend(second.graph.output)
    del g.value_info[:]

    def dims(name, values):
        vi = next(i for i in g.input if i.name == name)
        for d, v in zip(vi.type.tensor_type.shape.dim, values):
            if isinstance(v, str):
                d.dim_param = v
            else:
                d.dim_value = v
    dims("x", ["B", seq1, E])
    dims("b_x", ["B", seq2, E])
    dims("madd", ["B", 1, 1, "L"])
    for name, seq in (("out", seq1), ("b_out", seq2)):
        dims_of = next(o for o in g.output if o.name == name).type.tensor_type.shape.dim
        dims_of[1].dim_param = seq
    onnx.checker.check_model(first)
    return onnx.shape_inference.infer_shapes(first)


def test_layers_adding_the_same_mask_share_one_expansion():
    """Both blocks' sequence dims are the same named dim: one Unsqueeze-free Expand serves both (the
    second layer reuses the first's), with the same outputs as the original."""
    model = two_blocks("S", "S")
    out, report = apply(model)
    assert report.counts[RULE] == 2, [r.reason for r in report.refusals]
    ops = helpers.op_types(out)
    assert ops.count("Expand") == 1 and ops.count("Attention") == 2
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((B, S, E)).astype(np.float32),
             "b_x": rng.standard_normal((B, S, E)).astype(np.float32),
             "madd": np.where(rng.random((B, 1, 1, S)) < 0.3, -10000.0, 0.0).astype(np.float32)}
    want, got = run_ort(model, feeds), run_ort(out, feeds)
    for name, a in want.items():
        np.testing.assert_allclose(got[name], a, rtol=1e-5, atol=1e-6)


def test_expansion_not_shared_between_sequence_dims_not_provably_equal():
    """Sequence dims S1 and S2 may differ at run time (the mask then has L = 1, which broadcasts in
    both): each layer expands the mask to its own [S, L]. Sharing would give the second layer a
    [5, 5] bias for 7 queries."""
    model = two_blocks("S1", "S2")
    out, report = apply(model)
    assert report.counts[RULE] == 2, [r.reason for r in report.refusals]
    assert helpers.op_types(out).count("Expand") == 2
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((B, 5, E)).astype(np.float32),
             "b_x": rng.standard_normal((B, 7, E)).astype(np.float32),
             "madd": np.array([0.0, -10000.0], np.float32).reshape(B, 1, 1, 1)}
    want, got = run_ort(model, feeds), run_ort(out, feeds)
    for name, a in want.items():
        np.testing.assert_allclose(got[name], a, rtol=1e-5, atol=1e-6)


# --- key padding masks as Attention's raw mask_index (float32) -----------------------------------------


def sdpa_mask_model(keep_shape=("B", 1, 1, S), true_shape=(1, 1, S, 1), true_value=True, dtype=np.float32,
                    negate=False, grid=None):
    """transformers 5's ``sdpa_mask`` form: ``scores + Where(Expand(And(keep, t), shape), 0, finfo.min)``
    with ``keep`` a bool input and ``t`` a constant (all True: the And only broadcasts). ``negate``:
    ``Where(drop, finfo.min, 0)`` instead. ``grid`` (an op and a bound): t is computed at run time as
    ``op(Range(0, B, 1) as [B, 1, 1, 1], bound)`` over keep's dynamic batch B, as transformers 5 writes
    ``q_idx >= 0`` over a dynamic sequence (``("GreaterOrEqual", 0)`` is always true); a third entry
    True writes it as transformers 5.17 exports it, ``And(all-True constant, Cast(op(...), bool))``."""
    model = attention_model(mask="full", dtype=dtype)
    graph = model.graph
    (madd,) = [i for i in graph.input if i.name == "madd"]
    graph.input.remove(madd)
    graph.input.append(h.make_tensor_value_info("keep", T.BOOL, list(keep_shape)))
    fill = np.array(np.finfo(dtype).min, dtype)
    graph.initializer.extend([
        numpy_helper.from_array(np.full(true_shape, true_value), "all_true"),
        numpy_helper.from_array(np.array([1, 1, S, S], np.int64), "mask_shape"),
        numpy_helper.from_array(np.array(0, dtype), "zero"), numpy_helper.from_array(fill, "min")])
    branches = ["min", "zero"] if negate else ["zero", "min"]
    mask_nodes = []
    if grid is not None:
        op, bound, *wrapped = grid
        graph.initializer.extend([numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
                                  (("zero_i", 0), ("one_i", 1), ("grid_axes", [1, 2, 3]), ("bound", bound))])
        mask_nodes = [h.make_node("Shape", ["keep"], ["keep_shape"], end=1),
                      h.make_node("Squeeze", ["keep_shape"], ["batch"]),
                      h.make_node("Range", ["zero_i", "batch", "one_i"], ["rows"]),
                      h.make_node("Unsqueeze", ["rows", "grid_axes"], ["rows4"]),
                      h.make_node(op, ["rows4", "bound"], ["compared" if wrapped and wrapped[0] else "all_true"])]
        graph.initializer.remove(next(i for i in graph.initializer if i.name == "all_true"))
        if wrapped and wrapped[0]:
            graph.initializer.append(numpy_helper.from_array(np.ones((1, 1, 1, 1), bool), "ones"))
            mask_nodes += [h.make_node("Cast", ["compared"], ["compared_bool"], to=T.BOOL),
                           h.make_node("And", ["ones", "compared_bool"], ["all_true"])]
    mask_nodes += [h.make_node("And", ["keep", "all_true"], ["both"]),
                  h.make_node("Expand", ["both", "mask_shape"], ["cond"]),
                  h.make_node("Where", ["cond", *branches], ["madd"])]
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(mask_nodes + nodes)
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("op, bound, proven, wrapped", [
    ("GreaterOrEqual", 0, True, False), ("Greater", -1, True, False), ("GreaterOrEqual", 1, False, False),
    ("Greater", 0, False, False), ("GreaterOrEqual", 0, True, True), ("GreaterOrEqual", 1, False, True)])
def test_a_run_time_always_true_grid_is_seen_through(op, bound, proven, wrapped):
    """``And(keep, Range(0, B) >= 0)`` over a dynamic batch is ``keep`` broadcast: the key padding mask
    becomes a raw mask_index, also when the comparison is cast to bool and anded with all-True ones
    (``wrapped``). ``>= 1`` and ``> 0`` are False at row 0, so the comparison stays: the keep mask is then
    the And itself, [B, 1, 1, L] by length (``Range(0, B)`` is B long: ``shape_values.axis_length``,
    where inference invents the And's batch), still a raw mask_index; both forms give the original's
    outputs."""
    model = sdpa_mask_model(grid=(op, bound, wrapped))
    out, report = apply(model)
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_form"] == "mask_index"
    assert ("GreaterOrEqual" in helpers.op_types(out) or "Greater" in helpers.op_types(out)) is not proven
    feeds = holey_feeds(model)
    want, got = run_ort(model, feeds), run_ort(out, feeds)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)


def holey_feeds(model, seed=2):
    """Random x and a keep mask with holes (not only right padding): the raw mask must be read entry by entry."""
    feeds = feeds_for(model, seed=seed)
    keep = np.ones(feeds["keep"].shape, bool)
    keep[0, ..., 1] = False
    keep[0, ..., -1] = False
    keep[-1, ..., 0] = False
    feeds["keep"] = keep
    return feeds


def mask_index_of(out):
    (att,) = [n for n in out.graph.node if n.op_type == "Attention"]
    return att, (att.input[3] if len(att.input) > 3 else "")


@pytest.mark.parametrize("negate", [False, True])
def test_a_key_padding_mask_becomes_a_raw_mask_index_with_the_same_outputs(negate):
    model = sdpa_mask_model(negate=negate)
    out, report = apply(model)
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_form"] == "mask_index"
    att, mask_index = mask_index_of(out)
    assert mask_index and len(att.input) == 4  # no attention_bias
    filter_value = [a.f for a in att.attribute if a.name == "mask_filter_value"]
    assert filter_value == [pytest.approx(float(np.finfo(np.float32).min), rel=1e-7)]
    assert {"Expand", "Where", "And"}.isdisjoint(helpers.op_types(out))  # the [B, 1, S, L] bias is gone
    feeds = holey_feeds(model)
    want, got = run_ort(model, feeds), run_ort(out, feeds)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)
    # the mask reached the kernel: every batch item's keys differ, so masking nothing would differ too
    unmasked = dict(feeds, keep=np.ones_like(feeds["keep"]))
    assert np.max(np.abs(run_ort(out, unmasked)["out"] - got["out"])) > 1e-3


def fully_masked_feeds(model, seed=2):
    """``holey_feeds`` plus rows with every key masked: batch item 0 masks all keys of query 1 (all of
    them when the mask does not depend on the query). There the original adds the absorbing fill to every
    score, so its softmax is uniform; a kernel that added a smaller fill would weight by the scores."""
    feeds = holey_feeds(model, seed)
    keep = feeds["keep"]
    if keep.shape[-2] == 1:
        keep[0] = False
    else:
        keep[0, ..., 1, :] = False
    return feeds


def assert_raw_mask_with_float32_fill(out, report):
    """One packed Attention whose mask went raw (``mask_index``) with finfo(float32).min as its fill."""
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_form"] == "mask_index" and fused(out) == ["Attention"]
    att, _ = mask_index_of(out)
    filter_value = [a.f for a in att.attribute if a.name == "mask_filter_value"]
    assert filter_value == [pytest.approx(float(np.finfo(np.float32).min), rel=1e-7)]


def with_filter_value(model, value):
    """A copy of ``model`` whose Attention adds ``value`` where the mask is 0."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    att, _ = mask_index_of(changed)
    for a in att.attribute:
        if a.name == "mask_filter_value":
            a.f = value
    return changed


@pytest.mark.parametrize("case,rank", [("key_padding", 2), ("shared_across_batch", 2), ("query_dependent", 3),
                                       ("and_not_all_true", 3), ("causal_shared_across_batch", 3)])
def test_keep_masks_become_a_raw_2d_or_3d_mask_index_with_the_same_outputs(case, rank):
    """A 0/fill mask of [B|1, 1, 1, L] (key padding) or [B|1, 1, S, L] (per query: causal, or padding
    And-ed with a pattern) reaches ``Attention`` as a raw [B, L] or [B, S, L] mask of 0 and 1 (a
    broadcast batch spelled out by Expand); rows with every key masked stay uniform as in the original."""
    kwargs = {"key_padding": {}, "shared_across_batch": dict(keep_shape=(1, 1, 1, S)),
              "query_dependent": dict(keep_shape=("B", 1, S, S)),
              "and_not_all_true": dict(true_value=np.array([True, False, True, True, True])[None, None, :, None]),
              "causal_shared_across_batch": dict(keep_shape=(1, 1, S, S))}[case]
    model = sdpa_mask_model(**kwargs)
    out, report = apply(model)
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_form"] == "mask_index"
    att, mask_index = mask_index_of(out)
    assert mask_index and len(att.input) == 4  # no attention_bias
    producers = {o: n for n in out.graph.node for o in n.output}
    flat = producers[producers[mask_index].input[0]]  # Cast(Flatten | Squeeze (| Not))
    assert flat.op_type == {2: "Flatten", 3: "Squeeze"}[rank]
    assert ("Expand" in helpers.op_types(out)) == ("shared" in case)
    one_row = case == "shared_across_batch"  # one keep row for everything: masking it all would hide holes
    feeds = holey_feeds(model) if one_row else fully_masked_feeds(model)
    want, got = run_ort(model, feeds), run_ort(out, feeds)
    np.testing.assert_allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)
    # what the comparison would catch: the mask not reaching the kernel, or (with fully masked rows) a
    # fill that does not absorb, which weights those rows by their scores instead of uniformly
    wrong = (run_ort(out, dict(feeds, keep=np.ones_like(feeds["keep"]))) if one_row
             else run_ort(with_filter_value(out, -10000.0), feeds))["out"]
    assert np.max(np.abs(wrong - want["out"])) > 1e-3


def test_float16_keeps_the_attention_bias():
    """float16 scores and mask: the raw mask was measured slower than ``attention_bias`` (benchmarks.md
    5.7), so the additive form stays."""
    model = sdpa_mask_model(dtype=np.float16)
    out, report = apply(model)
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_form"] == "attention_bias"
    att, mask_index = mask_index_of(out)
    assert mask_index == "" and len(att.input) == 6
    feeds = holey_feeds(model)
    want, got = run_ort(model, feeds), run_ort(out, feeds)
    np.testing.assert_allclose(got["out"].astype(np.float64), want["out"].astype(np.float64), rtol=1e-2, atol=1e-2)


def island_model(mask="keep", cross=False):
    """GPT-2's float16 export: float16 projections and heads, the scaled scores cast up to float32, a
    float32 mask ``Where(Not(And(causal, keep)), finfo(float32).min, ConstantOfShape(zeros))`` added
    there, a float32 Softmax, and its result cast back to float16 for ×V. ``mask``: "keep" (that form),
    "float" (a float32 mask input added as it is), "one_minus" (transformers 4's ``(1 - m)·finfo.min`` of
    an int64 [B, S] input m) or None. ``cross``: keys and values from a second input
    of L positions (MultiHeadAttention, not packed), the mask ``Where(Not(keep), ...)`` of keep [B,1,1,L]."""
    model = attention_model(mask="full", dtype=np.float16, cross=cross)
    graph = model.graph
    del graph.value_info[:]
    (madd,) = [i for i in graph.input if i.name == "madd"]
    graph.input.remove(madd)
    nodes = list(graph.node)
    add = next(n for n in nodes if n.op_type == "Add" and n.output[0] == "masked")
    softmax = next(n for n in nodes if n.op_type == "Softmax")
    pv = next(n for n in nodes if n.op_type == "MatMul" and n.input[0] == "probs")
    add.input[0] = "scaled32"
    pv.input[0] = "probs16"
    up, down = (h.make_node("Cast", ["scaled"], ["scaled32"], to=T.FLOAT),
                h.make_node("Cast", ["probs"], ["probs16"], to=T.FLOAT16))
    nodes.insert(nodes.index(add), up)
    nodes.insert(nodes.index(softmax) + 1, down)
    extra = []
    if mask == "keep" and cross:
        graph.input.append(h.make_tensor_value_info("keep", T.BOOL, ["B", 1, 1, L]))
        graph.initializer.append(numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "min32"))
        extra += [h.make_node("Not", ["keep"], ["dropped"]),
                  h.make_node("Shape", ["keep"], ["allowed_shape"]),
                  h.make_node("ConstantOfShape", ["allowed_shape"], ["zeros"],
                              value=numpy_helper.from_array(np.zeros(1, np.float32))),
                  h.make_node("Where", ["dropped", "min32", "zeros"], ["madd"])]
    elif mask == "keep":
        graph.input.append(h.make_tensor_value_info("keep", T.BOOL, ["B", 1, 1, S]))
        graph.initializer.extend([
            numpy_helper.from_array(np.tril(np.ones((S, S), bool))[None, None], "causal"),
            numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "min32")])
        extra += [h.make_node("And", ["causal", "keep"], ["allowed"]),
                  h.make_node("Not", ["allowed"], ["dropped"]),
                  h.make_node("Shape", ["allowed"], ["allowed_shape"]),
                  h.make_node("ConstantOfShape", ["allowed_shape"], ["zeros"],
                              value=numpy_helper.from_array(np.zeros(1, np.float32))),
                  h.make_node("Where", ["dropped", "min32", "zeros"], ["madd"])]
    elif mask == "float":
        graph.input.append(h.make_tensor_value_info("madd", T.FLOAT, ["B", 1, S, S]))
    elif mask in ("one_minus", "one_minus_half"):  # transformers 4: (1 - m[:, None, None, :].to(float)) * finfo.min
        # "one_minus_half": the Sub in float16 and cast up, as --precision fp16 leaves it
        graph.input.append(h.make_tensor_value_info("m", T.INT64, ["B", S]))
        sub_type, sub_np = (T.FLOAT16, np.float16) if mask == "one_minus_half" else (T.FLOAT, np.float32)
        graph.initializer.extend([numpy_helper.from_array(np.array([1, 2], np.int64), "m_axes"),
                                  numpy_helper.from_array(np.array(1.0, sub_np), "one"),
                                  numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "min32")])
        extra += [h.make_node("Unsqueeze", ["m", "m_axes"], ["m4"]),
                  h.make_node("Cast", ["m4"], ["m4f"], to=sub_type),
                  h.make_node("Sub", ["one", "m4f"], ["dropped_sub"]),
                  h.make_node("Cast", ["dropped_sub"], ["dropped_f"], to=T.FLOAT),
                  h.make_node("Mul", ["dropped_f", "min32"], ["madd"])]
    else:
        add.op_type, add.input[:] = "Identity", ["scaled32"]
    del graph.node[:]
    graph.node.extend(extra + nodes)
    softmax.input[0] = "masked"
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def test_float16_attention_with_a_float32_softmax_becomes_attention_with_a_3d_mask_index():
    """The float32 softmax island fuses into a float16 ``Attention``: its kernel adds ``mask_filter_value``
    in float32 as the graph does, so the causal-and-padding mask goes in as a raw [B, S, L] mask with the
    float32 fill, and rows with every key masked (left padding) stay uniform as in the original."""
    model = island_model()
    out, report = apply(model)
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_form"] == "mask_index" and fused(out) == ["Attention"]
    assert "Softmax" not in helpers.op_types(out)
    att, mask_index = mask_index_of(out)
    filter_value = [a.f for a in att.attribute if a.name == "mask_filter_value"]
    assert filter_value == [pytest.approx(float(np.finfo(np.float32).min), rel=1e-7)]
    producers = {o: n for n in out.graph.node for o in n.output}
    assert producers[producers[mask_index].input[0]].op_type == "Squeeze"  # [B, 1, S, L] → [B, S, L]
    feeds = holey_feeds(model)
    feeds["keep"][0, ..., :2] = False  # left padding: queries 0 and 1 of item 0 see no key
    want, got = run_ort(model, feeds), run_ort(out, feeds)
    np.testing.assert_allclose(got["out"].astype(np.float64), want["out"].astype(np.float64), rtol=1e-2, atol=1e-2)
    # float16's -65504 (a float16 attention_bias could hold no more) would weight those rows by their scores
    weaker = run_ort(with_filter_value(out, -65504.0), feeds)["out"].astype(np.float64)
    assert np.max(np.abs(weaker - want["out"].astype(np.float64))) > 5e-2


def test_float16_masked_fill_becomes_a_raw_mask_with_the_float32_fill():
    """A float16 masked_fill with finfo(float16).min (-65504, not absorbing: s - 65504 != -65504 for |s| >=
    16) fuses only as a raw keep mask, whose fill the kernel adds in float32: with finfo(float32).min a
    masked score becomes that (absorbing), a row with every key masked is uniform as in the original
    (-65504 everywhere), and elsewhere masked weights are 0 in both. An item with no key kept shows it;
    the fill -65504 itself would weight that row by its scores."""
    model = attention_model(mask="where", dtype=np.float16)
    out, report = apply(model)
    assert_raw_mask_with_float32_fill(out, report)
    feeds = feeds_for(model)
    feeds["x"] = (feeds["x"] * 8).astype(np.float16)  # scores well beyond 16
    feeds["c"][1] = False  # item 1: every key masked
    want, got = run_ort(model, feeds)["out"].astype(np.float64), run_ort(out, feeds)["out"].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    weaker = run_ort(with_filter_value(out, -65504.0), feeds)["out"].astype(np.float64)
    assert np.max(np.abs(weaker[1] - want[1])) > 5e-2


def test_always_false_sees_the_contradiction_and_nothing_less():
    """always_false: And(x, Not(x)) whatever x is, an all-False constant, Or of two such, Not of an
    all-True constant; not And(x, Not(y)) for another y, nor a plain input."""
    from onnxfuse.rewrites.contrib.attention.keep_masks import always_false

    x, y = gs.Variable("x", dtype=np.bool_, shape=[2, 3]), gs.Variable("y", dtype=np.bool_, shape=[2, 3])
    graph = gs.Graph(inputs=[x, y])

    def node(op, *inputs):
        out = gs.Variable(f"t{len(graph.nodes)}", dtype=np.bool_)
        graph.nodes.append(gs.Node(op, inputs=list(inputs), outputs=[out]))
        return out

    never = node("And", x, node("Not", x))
    assert always_false(graph, never) and always_false(graph, node("And", node("Not", y), y))
    assert always_false(graph, node("Or", never, gs.Constant("f", np.zeros((1, 3), np.bool_))))
    assert always_false(graph, node("Not", gs.Constant("t", np.ones((2, 1), np.bool_))))
    assert not always_false(graph, node("And", x, node("Not", y)))
    assert not always_false(graph, x) and not always_false(graph, node("Or", never, y))


def test_zero_where_false_needs_the_condition_to_be_the_cast_of_the_same_tensor():
    """zero_where_false: Where(Cast(t, bool), f, Cast*(t)) adds 0 where the condition is False (t is 0
    there, and so is any Cast of it); not for another tensor, nor for a condition that is not a bool Cast."""
    from onnxfuse.rewrites.contrib.attention.keep_masks import zero_where_false

    t = gs.Variable("t", dtype=np.float16, shape=[2, 3])
    u = gs.Variable("u", dtype=np.float16, shape=[2, 3])
    graph = gs.Graph(inputs=[t, u])

    def cast(x, to, dtype):
        out = gs.Variable(f"c{len(graph.nodes)}", dtype=dtype)
        graph.nodes.append(gs.Node("Cast", attrs={"to": to}, inputs=[x], outputs=[out]))
        return out

    cond = cast(t, 9, np.bool_)
    assert zero_where_false(graph, cond, t) and zero_where_false(graph, cond, cast(cast(t, 1, np.float32), 10, np.float16))
    assert not zero_where_false(graph, cond, cast(u, 1, np.float32))
    assert not zero_where_false(graph, cast(t, 1, np.float32), t)


def test_constant_along_proves_a_mask_the_same_for_every_query_and_nothing_that_varies():
    """constant_along(., ., 2): a [B, 1, 1, L] mask expanded to [B, 1, S, L] (as Expand or as
    expand-by-broadcast's Where(c, x, x)), then pointwise steps with constants (transformers 4's sdpa
    mask: 1 - m, Cast to bool, Not) is the same for every query; a constant is by its values; a causal
    grid (a per-query input, a constant whose rows differ) is not, and an op that is not pointwise is not
    proved (Softmax over the keys)."""
    from onnxfuse.rewrites.contrib.attention.keep_masks import constant_along

    m = gs.Variable("m", dtype=np.float32, shape=["B", 1, 1, 8])
    per_query = gs.Variable("q", dtype=np.float32, shape=["B", 1, 4, 8])
    graph = gs.Graph(inputs=[m, per_query])

    def node(op, *inputs, dtype=np.float32, shape=None, **attrs):
        out = gs.Variable(f"t{len(graph.nodes)}", dtype=dtype, shape=shape)
        graph.nodes.append(gs.Node(op, attrs=attrs, inputs=list(inputs), outputs=[out]))
        return out

    full = ["B", 1, 4, 8]
    expanded = node("Expand", m, gs.Constant("s", np.array([1, 1, 4, 8], np.int64)), shape=full)
    where = node("Where", gs.Constant("c", np.ones((1, 1, 4, 1), np.bool_)), m, m, shape=full)
    for spread in (expanded, where):
        inverted = node("Sub", gs.Constant("one", np.array(1.0, np.float32)), spread, shape=full)
        keep = node("Not", node("Cast", inverted, dtype=np.bool_, shape=full, to=9), dtype=np.bool_, shape=full)
        assert constant_along(graph, keep, 2)
    rows_alike = gs.Constant("alike", np.tile(np.array([1.0, 0.0] * 4, np.float32), (1, 1, 4, 1)))
    rows_differ = gs.Constant("differ", np.tril(np.ones((4, 8), np.float32))[None, None])
    assert constant_along(graph, node("Add", expanded, rows_alike, shape=full), 2)
    assert not constant_along(graph, node("Add", expanded, rows_differ, shape=full), 2)
    assert not constant_along(graph, node("Add", expanded, per_query, shape=full), 2)
    assert not constant_along(graph, node("Softmax", expanded, shape=full, axis=-1), 2)


def test_float32_softmax_island_without_a_mask_fuses_and_with_a_float_mask_is_refused():
    out, _ = apply(island_model(mask=None))
    assert fused(out) == ["Attention"]
    feeds = feeds_for(island_model(mask=None))
    np.testing.assert_allclose(run_ort(out, feeds)["out"].astype(np.float64),
                               run_ort(island_model(mask=None), feeds)["out"].astype(np.float64), rtol=1e-2, atol=1e-2)
    out, report = apply(island_model(mask="float"))
    assert fused(out) == []
    (refusal,) = [r for r in report.refusals if r.rule == RULE]
    assert "float32 Softmax" in refusal.reason and "not a 0/fill keep mask" in refusal.reason


@pytest.mark.parametrize("form", ["one_minus", "one_minus_half"])
def test_transformers_4_mask_in_a_float32_island_fuses_under_the_right_padded_promise(form):
    """transformers 4's extended mask (1 - m)·finfo(float32).min is a keep mask only where m holds 0 and
    1: without a promise the island is refused, naming --right-padded; with ``--right-padded m`` (0/1,
    right-padded) it fuses with the raw mask Cast(m, int32) and the float32 fill, equal to the original on
    right-padded rows (an item with no key kept too: uniform in both). An m holding 2 (outside the
    promise) shows why the promise is needed: the original then adds -finfo.min."""
    model = island_model(mask=form)
    out, report = apply(model)
    assert fused(out) == []
    (refusal,) = [r for r in report.refusals if r.rule == RULE]
    assert "(1 - m)·c" in refusal.reason and "--right-padded NAME" in refusal.reason
    out, report = helpers.optimize(model, only=[RULE], right_padded=["m"])
    onnx.checker.check_model(out, full_check=True)
    assert_raw_mask_with_float32_fill(out, report)
    feeds = feeds_for(model)
    feeds["x"] = (feeds["x"] * 4).astype(np.float16)
    lengths = [S, S - 2, 1, 0][:len(feeds["m"])]
    feeds["m"] = (np.arange(S)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    want, got = run_ort(model, feeds)["out"].astype(np.float64), run_ort(out, feeds)["out"].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    feeds["m"][0, 0] = 2  # outside the promise: key 0 of item 0 takes every weight in the original
    want, got = run_ort(model, feeds)["out"].astype(np.float64), run_ort(out, feeds)["out"].astype(np.float64)
    assert np.max(np.abs(got[0] - want[0])) > 5e-2


def test_a_float32_one_minus_mask_over_a_promised_input_becomes_a_raw_mask():
    """In float32 (packed Attention) the (1 - m)·c padding mask over an input promised right-padded goes
    raw like a keep mask (measured faster in float32, keep_masks) and then to 1-D key lengths
    (contrib-mask-lengths); without the promise it stays an additive attention_bias."""
    model = attention_model(mask="padding")
    out, _ = apply(model)
    att, mask_index = mask_index_of(out)
    assert not mask_index and len(att.input) > 5 and att.input[5]  # attention_bias
    out, report = helpers.optimize(model, only=[RULE, "contrib-mask-lengths"], right_padded=["m"])
    assert report.counts["contrib-mask-lengths"] == 1
    feeds = feeds_for(model)  # m right-padded 0/1
    np.testing.assert_allclose(run_ort(out, feeds)["out"], run_ort(model, feeds)["out"], rtol=1e-5, atol=1e-6)


def test_float16_where_fill_on_multihead_attention_becomes_a_key_padding_mask():
    """Cross-attention (MultiHeadAttention, not packed) whose float16 masked_fill writes finfo(float16).min:
    not absorbing as a bias, so the keep mask goes in as the op's raw key_padding_mask with
    mask_filter_value finfo(float32).min, which the kernel adds to float32 scores. The graph's masked
    entries are exactly -65504, so both give 0 weight there, and a row with every key masked averages V
    in both (all its scores equal): checked with such a row."""
    model = attention_model(mask="where", dtype=np.float16, cross=True)
    out, report = apply(model)
    assert fused(out) == ["MultiHeadAttention"], [r.reason for r in report.refusals]
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_form"] == "key_padding_mask"
    (mha,) = [n for n in out.graph.node if n.op_type == "MultiHeadAttention"]
    assert mha.input[4] and len(mha.input) == 5
    assert onnx.helper.get_attribute_value(next(a for a in mha.attribute if a.name == "mask_filter_value")) == \
        pytest.approx(float(np.finfo(np.float32).min))
    feeds = feeds_for(model)
    feeds["c"][1] = False  # every key of item 1 masked
    want, got = run_ort(model, feeds), run_ort(out, feeds)
    for name, a in want.items():
        np.testing.assert_allclose(got[name].astype(np.float64), a.astype(np.float64), rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("mask", ["keep", None])
def test_float32_softmax_island_of_a_cross_attention_becomes_multihead_attention(mask):
    """The island over keys that are not x's (MultiHeadAttention, no packed op): the keep mask goes in as
    the raw key_padding_mask [B, L] with mask_filter_value finfo(float32).min, which the kernel adds to
    float32 scores, so an item with every key masked averages V as the float32 Softmax does; without a
    mask the op computes the scores in float32 as the island does after its Cast."""
    model = island_model(mask=mask, cross=True)
    out, report = apply(model)
    assert fused(out) == ["MultiHeadAttention"], [r.reason for r in report.refusals]
    (detail,) = [d for d in report.details if d["rule"] == RULE]
    assert detail["mask_form"] == ("key_padding_mask" if mask else "none")
    feeds = feeds_for(model)
    if mask:
        feeds["keep"] = np.ones(feeds["keep"].shape, bool)
        feeds["keep"][0, ..., -3:] = False
        feeds["keep"][1] = False  # item 1: no key kept
    want, got = run_ort(model, feeds)["out"].astype(np.float64), run_ort(out, feeds)["out"].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def _mask_path(ops: list[str]):
    """A graphsurgeon graph: int64 input m [2, 8] through ``ops`` in turn (each reading the previous value
    first), then Cast to float; returns (graph, the cast's output)."""
    m = gs.Variable("m", dtype=np.int64, shape=[2, 8])
    graph = gs.Graph(inputs=[m])
    value = m
    for k, op in enumerate(ops):
        out = gs.Variable(f"v{k}", dtype=np.int64)
        extra = {"Gather": [gs.Constant(f"i{k}", np.array([1, 0], np.int64))],
                 "Tile": [gs.Constant(f"r{k}", np.array([1, 2], np.int64))],
                 "Mul": [gs.Constant(f"two{k}", np.array(2, np.int64))],
                 "Unsqueeze": [gs.Constant(f"a{k}", np.array([1], np.int64))]}.get(op, [])
        graph.nodes.append(gs.Node(op, inputs=[value] + extra, outputs=[out]))
        value = out
    cast = gs.Variable("keep", dtype=np.float32)
    graph.nodes.append(gs.Node("Cast", inputs=[value], outputs=[cast], attrs={"to": T.FLOAT}))
    return graph, cast


@pytest.mark.parametrize("ops, promised", [
    (["Unsqueeze"], True),
    (["Gather", "Unsqueeze"], True),  # rows picked: each element is one of m's (facts.graph.REARRANGING)
    (["Tile"], True),
    (["Mul"], False),  # 2·m holds 2: not a 0/1 mask whatever the promise
])
def test_a_promised_mask_stays_zero_one_through_ops_that_only_rearrange_it(ops, promised):
    graph, keep = _mask_path(ops)
    assert promised_zero_one(graph, keep, frozenset({"m"})) is promised
    assert promised_zero_one(graph, keep, frozenset({"other"})) is False  # no promise for m
