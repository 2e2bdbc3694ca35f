"""contrib-mask-lengths: under ``--right-padded NAME``, Attention's raw [B, L] mask becomes 1-D lengths,
with the same outputs as the original on right-padded masks (ONNX Runtime CPU, the original as the
reference) and different ones on a left-padded mask (the promise is what makes it exact, so the test
shows it is needed). Without the promise nothing changes; the refusals say why; and the pipeline names
the rule when a model's mask is not its input's rows.
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

RULE = "contrib-mask-lengths"
B, S, E, HEADS = 3, 6, 8, 2


def prefix_mask(lengths, length, dtype=np.int64):
    return (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(dtype)


def attention_model(mask_steps=None, other_input=False, unidirectional=0, keep_value=1) -> onnx.ModelProto:
    """x [B, S, E] → com.microsoft Attention with a raw mask_index computed from input ``mask`` (int64
    [B, S]) by ``mask_steps`` (nodes from "mask" to "mask_index"; default Cast to int32)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((E, 3 * E)).astype(np.float32) * 0.5, "w"),
             numpy_helper.from_array(rng.standard_normal(3 * E).astype(np.float32) * 0.1, "b")]
    nodes = list(mask_steps or [h.make_node("Cast", ["mask"], ["mask_index"], to=T.INT32)])
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [B, S, E]), h.make_tensor_value_info("mask", T.INT64, [B, S])]
    if other_input:
        inputs.append(h.make_tensor_value_info("other", T.INT64, [B, S]))
    if keep_value != 1:
        inits.append(numpy_helper.from_array(np.array(keep_value, np.int32), "keep_value"))
    nodes.append(h.make_node("Attention", ["x", "w", "b", "mask_index"], ["y"], domain="com.microsoft",
                             num_heads=HEADS, unidirectional=unidirectional))
    graph = h.make_graph(nodes, "attention", inputs, [h.make_tensor_value_info("y", T.FLOAT, [B, S, E])], inits)
    return h.make_model(graph, ir_version=8, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])


def rewrite(model, only=None, right_padded=(), target="contrib"):
    """The pipeline's rewrite (shapes inferred first), under the promise ``right_padded``; target contrib
    (no FusedElementwise: plain ONNX Runtime runs the result)."""
    from onnxfuse.pipeline import rewrite_model
    from onnxfuse.rewrites import Assumptions, select_rules

    rules = select_rules(target, only=only, assumptions=Assumptions(right_padded=frozenset(right_padded)))
    return rewrite_model(model, rules)


def feeds(mask, seed=1, **extra):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((B, S, E)).astype(np.float32), "mask": mask, **extra}


def close(a, b):
    return np.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lengths_equal_the_raw_mask_on_right_padded_rows_and_not_on_left_padded_ones():
    model = attention_model()
    optimized, report = rewrite(model, only=[RULE], right_padded=["mask"])
    assert report.counts[RULE] == 1
    assert "ReduceSum" in helpers.op_types(optimized)
    right = prefix_mask([S, 2, 1], S)
    want, got = run_ort(model, feeds(right))["y"], run_ort(optimized, feeds(right))["y"]
    assert close(got, want), np.abs(got - want).max()
    left = right[:, ::-1].copy()  # the same counts, padded on the left: lengths keep the wrong keys
    want, got = run_ort(model, feeds(left))["y"], run_ort(optimized, feeds(left))["y"]
    assert not close(got[1:], want[1:])


def test_nonzero_keep_values_are_counted_as_ones():
    # A raw mask keeps a key wherever it is nonzero: a mask of 0 and 2 must give the same lengths.
    steps = [h.make_node("Cast", ["mask"], ["mask32"], to=T.INT32),
             h.make_node("Mul", ["mask32", "keep_value"], ["mask_index"])]
    model = attention_model(steps, keep_value=2)
    optimized, report = rewrite(model, only=[RULE], right_padded=["mask"])
    assert report.counts[RULE] == 1
    assert helpers.op_types(optimized).count("Cast") == 3  # the model's own, then to bool and back to int32
    right = prefix_mask([4, S, 1], S)
    want, got = run_ort(model, feeds(right))["y"], run_ort(optimized, feeds(right))["y"]
    assert close(got, want), np.abs(got - want).max()


def test_without_the_promise_nothing_changes():
    model = attention_model()
    optimized, report = rewrite(model, only=[RULE])
    assert report.counts.get(RULE, 0) == 0
    assert helpers.op_types(optimized) == helpers.op_types(model)


@pytest.mark.parametrize("kind, reason", [
    ("other-input", "also reads input(s) other"),
    ("causal", "unidirectional"),
    ("not-promised", "does not derive from an input promised right-padded"),
    ("three-d", "not a raw [B, L] mask (rank 3)"),
])
def test_refusals_say_why(kind, reason):
    promised = ["mask"]
    if kind == "other-input":
        model = attention_model([h.make_node("Mul", ["mask", "other"], ["both"]),
                                 h.make_node("Cast", ["both"], ["mask_index"], to=T.INT32)], other_input=True)
    elif kind == "causal":
        model = attention_model(unidirectional=1)
    elif kind == "not-promised":
        model, promised = attention_model(), ["x"]
    else:
        model = attention_model([h.make_node("Unsqueeze", ["mask", "one"], ["mask3"]),
                                 h.make_node("Expand", ["mask3", "shape3"], ["mask3_full"]),
                                 h.make_node("Cast", ["mask3_full"], ["mask_index"], to=T.INT32)])
        model.graph.initializer.extend([numpy_helper.from_array(np.array([1], np.int64), "one"),
                                        numpy_helper.from_array(np.array([B, S, S], np.int64), "shape3")])
    optimized, report = rewrite(model, only=[RULE], right_padded=promised)
    assert report.counts.get(RULE, 0) == 0
    reasons = [r.reason for r in report.refusals if r.rule == RULE]
    assert reasons and reason in reasons[0], reasons
    assert helpers.op_types(optimized) == helpers.op_types(model)


def test_shape_reads_of_another_input_do_not_count():
    # The mask may be sized from another tensor (a Shape read): only values matter.
    steps = [h.make_node("Shape", ["other"], ["other_shape"]),
             h.make_node("Reshape", ["mask", "other_shape"], ["mask_same"]),
             h.make_node("Cast", ["mask_same"], ["mask_index"], to=T.INT32)]
    model = attention_model(steps, other_input=True)
    optimized, report = rewrite(model, only=[RULE], right_padded=["mask"])
    assert report.counts[RULE] == 1
    right = prefix_mask([1, 3, S], S)
    extra = {"other": np.zeros((B, S), np.int64)}
    want, got = run_ort(model, feeds(right, **extra))["y"], run_ort(optimized, feeds(right, **extra))["y"]
    assert close(got, want)


def test_distilbert_export_reads_lengths_and_matches_on_right_padded_masks():
    model = load_testdata("distilbert_tiny_opset14")
    optimized, report = rewrite(model, right_padded=["attention_mask"])
    assert report.counts[RULE] == 2
    attention = [n for n in optimized.graph.node if n.op_type == "Attention"]
    reduce_sums = {o for n in optimized.graph.node if n.op_type == "ReduceSum" for o in n.output}
    assert attention and all(n.input[3] in reduce_sums for n in attention)
    shape = [d.dim_value or 4 for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, shape[1] + 1, size=shape[0])
    lengths[0] = shape[1]
    inputs = {"input_ids": rng.integers(0, 100, size=shape).astype(np.int64),
              "attention_mask": prefix_mask(lengths, shape[1])}
    want, got = run_ort(model, inputs), run_ort(optimized, inputs)
    for name, a in want.items():
        np.testing.assert_allclose(got[name], a, rtol=1e-4, atol=1e-4 * float(np.abs(a).max()))


def test_pipeline_names_the_rule_when_the_mask_is_not_the_inputs_rows(tmp_path):
    # The model reverses the mask along the keys: right-padded input rows become left-padded mask rows.
    from onnxfuse import api
    from onnxfuse.errors import ValidationFailed

    steps = [h.make_node("Slice", ["mask", "start", "end", "axis", "step"], ["reversed"]),
             h.make_node("Cast", ["reversed"], ["mask_index"], to=T.INT32)]
    model = attention_model(steps)
    model.graph.initializer.extend([numpy_helper.from_array(np.array([v], np.int64), n) for n, v in
                                    (("start", -1), ("end", -(2 ** 62)), ("axis", 1), ("step", -1))])
    with pytest.raises(ValidationFailed) as caught:
        api.optimize(model, right_padded="mask", provider="cpu")
    assert caught.value.culprit == RULE
    result = api.optimize(model, provider="cpu")  # no promise: nothing relies on one, validation passes
    assert result.applied.counts.get(RULE, 0) == 0 and result.validation.passed


def test_without_a_promise_float16_attention_on_a_raw_mask_is_refused_naming_the_input_and_float32_is_not():
    """No promise: nothing changes. A float16 Attention whose raw mask derives from one input alone is
    refused with a reason naming ``--right-padded`` of that input (the output's "not fused" line); a
    float32 one is not looked at (the lengths measured 0-0.4% faster there)."""
    import onnxfuse

    fp32 = load_testdata("distilbert_tiny_opset14")
    plain = onnxfuse.optimize(fp32, provider="cpu", validate=False)
    assert any(n.op_type == "Attention" and len(n.input) > 3 and n.input[3] for n in plain.model.graph.node)
    assert not [r for r in plain.applied.refusals if r.rule == "contrib-mask-lengths"] and not plain.unfused
    half = onnxfuse.optimize(fp32, provider="cpu", precision="fp16", validate=False)
    refusals = [r for r in half.applied.refusals if r.rule == "contrib-mask-lengths"]
    assert len(refusals) == 2 and all("--right-padded attention_mask" in r.reason for r in refusals)
    assert half.applied.counts.get("contrib-mask-lengths", 0) == 0
    attention = [n for n in half.model.graph.node if n.op_type == "Attention"]
    assert all(n.input[3].endswith("mask_index") for n in attention)  # the raw mask, unchanged
