"""contrib-promised-keep-bias: under ``--right-padded NAME``, a float16 Attention's raw [B, L] mask becomes
a keep ``attention_bias`` (-65504 where a key is masked), with the outputs of the float32 original within
what float16 allows on right-padded masks (ONNX Runtime CPU, the float32 original as the reference), and
different ones on a row that keeps no key (the promise, n >= 1 ones per row, is what makes it exact, so
the test shows it is needed). Float32 is left to contrib-mask-lengths; without the promise nothing
changes and the refusal names it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from helpers import load_testdata, run_ort
from onnxfuse import custom_ops

RULE = "contrib-promised-keep-bias"
B, S, E, HEADS = 3, 6, 8, 2
MODEL = "distilbert_tiny_opset14"  # transformers' DistilBERT: masked_fill(mask == 0, finfo(float32).min)


def prefix_mask(lengths, length):
    return (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)


def token_feeds(model, lengths, seed=4):
    batch, seq = len(lengths), [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim][1] or 8
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 100, size=(batch, seq)).astype(np.int64),
            "attention_mask": prefix_mask(lengths, seq)}


def normalized_error(want: np.ndarray, got: np.ndarray, rows=slice(None)) -> float:
    want, got = want[rows].astype(np.float64), got[rows].astype(np.float64)
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


def run(model: onnx.ModelProto, feeds: dict) -> dict:
    """ONNX Runtime CPU with onnxfuse's custom ops registered; outputs by name."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), custom_ops.session_options(),
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def attention_nodes(model: onnx.ModelProto):
    return [n for n in model.graph.node if n.op_type == "Attention"]


def test_float16_mask_becomes_a_keep_bias_and_matches_the_float32_original_on_right_padded_rows():
    model = load_testdata(MODEL)
    result = onnxfuse.optimize(model, provider="cpu", precision="fp16", right_padded=["attention_mask"])
    assert result.validation.passed and not result.unfused
    assert result.applied.counts[RULE] == 2 and result.applied.counts.get("contrib-mask-lengths", 0) == 0
    attention = attention_nodes(result.model)
    assert len(attention) == 2
    assert all(not n.input[3] and n.input[5] for n in attention)  # no mask_index; an attention_bias
    assert len({n.input[5] for n in attention}) == 1  # one bias for both layers
    where = [n for n in result.model.graph.node if attention[0].input[5] in n.output]
    assert where and where[0].op_type == "Where"
    branches = [onnx.numpy_helper.to_array(i) for i in result.model.graph.initializer if i.name in where[0].input[1:]]
    assert sorted(float(b.reshape(-1)[0]) for b in branches) == [-65504.0, 0.0]
    assert all(b.dtype == np.float16 and b.size == 1 for b in branches)
    feeds = token_feeds(model, [8, 5, 1])
    want, got = run_ort(model, feeds), run(result.model, feeds)
    for name, ref in want.items():
        assert normalized_error(ref, got[name]) <= 2e-2, name
    # the same model with the raw mask (both promised forms skipped) gives the same values within float16
    raw = onnxfuse.optimize(model, provider="cpu", precision="fp16", right_padded=["attention_mask"],
                            skip=[RULE, "contrib-mask-lengths"], validate=False)
    assert all(n.input[3] for n in attention_nodes(raw.model))
    raw_out = run(raw.model, feeds)
    for name, ref in raw_out.items():
        assert normalized_error(ref, got[name]) <= 1e-2, name


def attention16_model() -> onnx.ModelProto:
    """x [B, S, E] float16 → com.microsoft Attention with the raw mask contrib-attention writes:
    ``Cast(Cast(mask, bool), int32)`` of input ``mask`` (int64 [B, S]) and mask_filter_value
    finfo(float32).min, so a row that keeps no key is uniform. Weights large enough for peaked scores."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((E, 3 * E)) * 1.5).astype(np.float16), "w"),
             numpy_helper.from_array((rng.standard_normal(3 * E) * 0.1).astype(np.float16), "b")]
    nodes = [h.make_node("Cast", ["mask"], ["keep"], to=T.BOOL),
             h.make_node("Cast", ["keep"], ["mask_index"], to=T.INT32),
             h.make_node("Attention", ["x", "w", "b", "mask_index"], ["y"], domain="com.microsoft", num_heads=HEADS,
                         mask_filter_value=float(np.finfo(np.float32).min))]
    graph = h.make_graph(nodes, "attention", [h.make_tensor_value_info("x", T.FLOAT16, [B, S, E]),
                                              h.make_tensor_value_info("mask", T.INT64, [B, S])],
                         [h.make_tensor_value_info("y", T.FLOAT16, [B, S, E])], inits)
    return h.make_model(graph, ir_version=8, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])


def rewrite(model, right_padded=()):
    from onnxfuse.pipeline import rewrite_model
    from onnxfuse.rewrites import Assumptions, select_rules

    rules = select_rules("contrib", only=[RULE], assumptions=Assumptions(right_padded=frozenset(right_padded)))
    return rewrite_model(model, rules)


def test_a_row_that_keeps_no_key_is_what_the_promise_rules_out():
    """The op as contrib-attention writes it, rewritten under the promise: right-padded rows match the raw
    mask's outputs (float16 rounding); an item whose mask is all zeros (n = 0, outside the promise) does
    not: the raw mask weighs every key alike (finfo(float32).min on each), the bias by the scores."""
    model = attention16_model()
    out, report = rewrite(model, right_padded=["mask"])
    assert report.counts[RULE] == 1
    (node,) = attention_nodes(out)
    assert not node.input[3] and node.input[5]
    x = np.random.default_rng(1).standard_normal((B, S, E)).astype(np.float16)
    right = {"x": x, "mask": prefix_mask([6, 2, 1], S)}
    np.testing.assert_allclose(run_ort(out, right)["y"].astype(np.float32), run_ort(model, right)["y"].astype(np.float32),
                               rtol=1e-2, atol=1e-2)
    empty = {"x": x, "mask": prefix_mask([6, 0, 3], S)}
    want, got = run_ort(model, empty)["y"].astype(np.float64), run_ort(out, empty)["y"].astype(np.float64)
    assert np.allclose(got[[0, 2]], want[[0, 2]], rtol=1e-2, atol=1e-2)
    assert np.max(np.abs(got[1] - want[1])) > 0.5
    unchanged, report = rewrite(model)  # no promise: nothing changes, the refusal names it
    assert report.counts.get(RULE, 0) == 0 and attention_nodes(unchanged)[0].input[3]
    assert any("--right-padded mask" in r.reason for r in report.refusals if r.rule == RULE)


def test_skipped_it_leaves_float16_to_lengths_and_float32_is_never_its_own():
    model = load_testdata(MODEL)
    lengths = onnxfuse.optimize(model, provider="cpu", precision="fp16", right_padded=["attention_mask"],
                                skip=[RULE], validate=False)
    assert lengths.applied.counts["contrib-mask-lengths"] == 2
    fp32 = onnxfuse.optimize(model, provider="cpu", right_padded=["attention_mask"], validate=False)
    assert fp32.applied.counts.get(RULE, 0) == 0 and fp32.applied.counts["contrib-mask-lengths"] == 2
    assert not [r for r in fp32.applied.refusals if r.rule == RULE]


def test_without_a_promise_float16_attention_on_a_raw_mask_is_refused_naming_the_input_and_float32_is_not():
    """No promise: nothing changes. A float16 Attention whose raw mask derives from one input alone is
    refused with a reason naming ``--right-padded`` of that input (the output's "not fused" line); a
    float32 one is not looked at (its raw mask measured faster than the bias)."""
    fp32 = load_testdata(MODEL)
    plain = onnxfuse.optimize(fp32, provider="cpu", validate=False)
    assert any(n.op_type == "Attention" and len(n.input) > 3 and n.input[3] for n in plain.model.graph.node)
    assert not [r for r in plain.applied.refusals if r.rule == RULE] and not plain.unfused
    half = onnxfuse.optimize(fp32, provider="cpu", precision="fp16", validate=False)
    refusals = [r for r in half.applied.refusals if r.rule == RULE]
    assert len(refusals) == 2 and all("--right-padded attention_mask" in r.reason for r in refusals)
    assert half.applied.counts.get(RULE, 0) == 0
    assert all(n.input[3].endswith("mask_index") for n in attention_nodes(half.model))  # the raw mask, unchanged
    (hint,) = [u for u in half.unfused if u.rule == RULE]
    assert hint.op == "Attention" and hint.count == 2
