"""contrib-decode-attention: a decoder's MultiHeadAttention over the presents becomes
If(few query rows: ai.onnxfuse DecodeAttention, else: the MultiHeadAttention).

Two levels, each against an independent reference: the op itself (ONNX Runtime's CPU provider running
the library's CPU kernel) against a float64 NumPy softmax attention, over float32, float16 and
bfloat16, one or several rows per key/value head and token, no bias, a bias broadcast over tokens and
a per-token bias with masked keys and a fully masked row; and the rule on the float16 testdata
decoders, whose logits and presents equal the original's at prefill (long enough to take the
MultiHeadAttention branch), decode and a batch of several new tokens over a cache, with a left-padded
row. The CUDA kernel runs the same cases in tests/gpu/test_decode_attention_gpu.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

import onnxfuse
from contrib_testlib import fuse
from helpers import float_types, load_testdata
from onnxfuse.custom_ops import DOMAIN, session_options
from onnxfuse.rewrites import RULES as RULE_LIST
from onnxfuse.rewrites.contrib.contrib_decode_attention import MAX_ROWS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
from test_kv_cache_gpu import LAYERS, _assert_equal_at_real_tokens  # noqa: E402  (the same checks, on the CPU here)

RULE = "contrib-decode-attention"
RULES = {r.name: r for r in RULE_LIST}
MASKED = float(np.finfo(np.float16).min)  # what the exporters' masks add


def op_model(elem, heads, kv_heads, size, bias: str, scale: float, max_rows: int = 32):
    """One DecodeAttention node; bfloat16 (which numpy cannot hand to ONNX Runtime) between float32 Casts."""
    names = ["query", "key", "value"] + (["bias"] if bias != "none" else [])
    cast = elem == TP.BFLOAT16
    nodes = [h.make_node("Cast", [n], [f"{n}_bf16"], to=TP.BFLOAT16) for n in names] if cast else []
    nodes.append(h.make_node("DecodeAttention", [f"{n}_bf16" for n in names] if cast else names,
                             ["out_bf16" if cast else "out", "scratch"], domain=DOMAIN,
                             spec=f"num_heads={heads} kv_num_heads={kv_heads} head_size={size} scale={float(scale)!r} "
                                  f"max_rows={max_rows}"))
    nodes += [h.make_node("Cast", ["out_bf16"], ["out"], to=TP.FLOAT)] if cast else []
    io = TP.FLOAT if cast else elem
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info(n, io, None) for n in names],
                         [h.make_tensor_value_info("out", io, None)])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)], ir_version=8)


def op_feeds(dtype, batch, tokens, n, kv_heads, size, keys, bias: str, seed=0):
    """Query [B, S·n, G·D] (grouped rows), key and value [B, G, T, D], and the bias: none, [1, 1, 1, T]
    (keys 0-1 masked for every row) or [B, 1, S, T] (a causal-looking mask, and row 0 of batch 0 fully
    masked). Values representable in ``dtype``, fed as float32 where it is bfloat16."""
    rng = np.random.default_rng(seed)
    feeds = {"query": rng.standard_normal((batch, tokens * n, kv_heads * size)),
             "key": rng.standard_normal((batch, kv_heads, keys, size)),
             "value": rng.standard_normal((batch, kv_heads, keys, size))}
    if bias == "keys":
        feeds["bias"] = np.zeros((1, 1, 1, keys))
        feeds["bias"][..., :2] = MASKED
    elif bias == "tokens":
        grid = np.arange(keys)[None, :] > (keys - tokens + np.arange(tokens))[:, None]
        feeds["bias"] = np.where(grid, MASKED, rng.uniform(-1, 1, (batch, 1, tokens, keys)))
        feeds["bias"][0, 0, 0, :] = -np.inf
    store = np.float32 if dtype.__name__ == "bfloat16" else dtype
    return {k: v.astype(np.float32).astype(dtype).astype(store) for k, v in feeds.items()}


def reference(feeds, n, kv_heads, size, scale):
    """float64 softmax(c·q·Kᵀ + bias)·V per row r of head g (token r // n); a row with no finite score: 0."""
    q, k, v = (feeds[x].astype(np.float64) for x in ("query", "key", "value"))
    batch, rows = q.shape[:2]
    qh = q.reshape(batch, rows, kv_heads, size).transpose(0, 2, 1, 3)  # [B, G, R, D]
    scores = scale * qh @ k.transpose(0, 1, 3, 2)  # [B, G, R, T]
    if "bias" in feeds:
        bias = feeds["bias"].astype(np.float64)
        scores = scores + np.repeat(bias, n, axis=2) if bias.shape[2] > 1 else scores + bias
    top = scores.max(axis=-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0)
    p = np.where(np.isfinite(top), np.exp(scores - safe), 0)
    total = p.sum(axis=-1, keepdims=True)
    out = np.where(total > 0, (p @ v) / np.where(total > 0, total, 1), 0)
    return out.transpose(0, 2, 1, 3).reshape(batch, rows, kv_heads * size)


def types():
    return float_types(1e-5, 4e-3, 3e-2)


#: (batch, tokens, n, kv_heads, head size, keys, bias)
CASES = [(2, 1, 7, 2, 16, 40, "tokens"), (1, 3, 2, 2, 8, 9, "keys"), (3, 2, 1, 3, 8, 17, "none"),
         (1, 1, 4, 1, 32, 1, "none")]


@pytest.mark.parametrize("elem,dtype,tol", types(), ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}S{}n{}G{}D{}T{}-{}".format(*c))
def test_the_op_equals_softmax_attention_in_float64(elem, dtype, tol, case):
    batch, tokens, n, kv_heads, size, keys, bias = case
    scale = 1 / np.sqrt(size)
    feeds = op_feeds(dtype, batch, tokens, n, kv_heads, size, keys, bias)
    session = ort.InferenceSession(op_model(elem, n * kv_heads, kv_heads, size, bias, scale).SerializeToString(),
                                   session_options(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, feeds)
    want = reference(feeds, n, kv_heads, size, scale)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=tol, atol=tol)
    if bias == "tokens":
        assert np.all(got[0, :n] == 0)  # row 0 of batch 0 masked everywhere: no key to attend to


def test_a_bad_spec_or_shape_is_one_clear_error():
    model = op_model(TP.FLOAT, 4, 3, 8, "none", 0.5)
    with pytest.raises(Exception, match="DecodeAttention node.*divisible by kv_num_heads"):
        ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    session = ort.InferenceSession(op_model(TP.FLOAT, 4, 2, 8, "none", 0.5).SerializeToString(), session_options(),
                                   providers=["CPUExecutionProvider"])
    feeds = op_feeds(np.float32, 1, 1, 2, 2, 8, 5, "none")
    feeds["key"] = feeds["key"][:, :, :4]
    with pytest.raises(Exception, match="DecodeAttention node.*value is \\[1, 2, 5, 8\\]"):
        session.run(None, feeds)


def test_more_rows_than_max_rows_give_an_empty_output():
    """Prefill's rows are the MultiHeadAttention's work (the If picks it): the op computes nothing."""
    feeds = op_feeds(np.float32, 2, 3, 2, 2, 8, 9, "keys")
    session = ort.InferenceSession(op_model(TP.FLOAT, 4, 2, 8, "keys", 0.5, max_rows=5).SerializeToString(),
                                   session_options(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, feeds)
    assert got.shape == (2, 0, 16)


def test_the_kernel_row_limit_is_the_kernels():
    """csrc/decode_attention.cc's kMaxRows: 16 rows at every head size."""
    assert MAX_ROWS == 16


def _branches(model):
    ifs = [n for n in model.graph.node if n.op_type == "If"]
    ops = [[x.op_type for x in a.g.node] for n in ifs for a in n.attribute]
    return ifs, ops


@pytest.mark.parametrize("name", ["qwen2_kv_opset14_fp16", "mistral_kv_opset17_fp16", "llama_kv_dynamo_fp16",
                                  "optimum_llama_kv_fp16", "phi3_kv_opset17_fp16", "phi3_partial_kv_opset17_fp16"])
def test_decoders_equal_the_original_on_both_branches(name):
    """Prefill of 20 tokens (40 rows per key/value head: the MultiHeadAttention branch), decode and a
    3-token chunk over a cache (the DecodeAttention branch)."""
    model = load_testdata(name)
    result = onnxfuse.optimize(model, samples=2)
    assert result.validation.passed and result.applied.counts[RULE] == LAYERS, result.applied.refusals
    ifs, branches = _branches(result.model)
    assert len(ifs) == LAYERS and branches == [["DecodeAttention"], ["MultiHeadAttention"]] * LAYERS
    decodes = [a.g.node[0] for n in ifs for a in n.attribute if a.name == "then_branch"]  # prefill launches none
    assert [x.output[0] for x in decodes] == [a.g.output[0].name for n in ifs for a in n.attribute if a.name == "then_branch"]
    assert len({n.input[0] for n in ifs}) == len({x.input[3] for x in decodes})  # one condition for each bias (shared)
    original = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    fused = ort.InferenceSession(result.model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    _assert_equal_at_real_tokens(original, fused, ((2, 20, 0), (3, 1, 9), (2, 3, 4)), np.random.default_rng(23))


def test_not_without_the_grouped_rows_and_not_for_the_cpu_provider():
    skipped = onnxfuse.optimize(load_testdata("qwen2_kv_opset14_fp16"), validate=False,
                                skip=["contrib-grouped-attention-inputs"])
    assert skipped.applied.counts[RULE] == 0 and not _branches(skipped.model)[0]
    assert any(r.rule == RULE and "does not read the AttentionInputs' query and presents" in r.reason
               for r in skipped.applied.refusals)  # it reads the repeated heads
    cpu = onnxfuse.optimize(load_testdata("qwen2_kv_opset14_fp16"), validate=False, device="cpu")
    assert RULE not in cpu.rules and not any(n.op_type in ("If", "DecodeAttention") for n in cpu.model.graph.node)
    assert onnx.checker.check_model(skipped.model) is None


def _one_layer(bias_tokens: str):
    """One decoder layer's attention as contrib-attention leaves it (H 4, G 2, D 8, no rotation): the
    packed projection Split into q, k, v; k and v split into heads, appended to the cache (the presents)
    and repeated per query head by a Gather; MultiHeadAttention; a constant out-projection. The bias is
    a graph input [B, 1, ``bias_tokens``, T]: named like the projection's sequence axis or not."""
    heads, kv, size = 4, 2, 8
    rng = np.random.default_rng(3)
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((heads * size, 16)).astype(np.float32), "w_o"),
             onnx.numpy_helper.from_array(np.array([heads * size, kv * size, kv * size], np.int64), "parts"),
             onnx.numpy_helper.from_array(np.array([0, 0, kv, size], np.int64), "to_heads"),
             onnx.numpy_helper.from_array(np.array([0, 0, 1, 1], np.int64), "repeat")]
    nodes = [h.make_node("Split", ["qkv", "parts"], ["q", "k", "v"], axis=2)]
    for x in ("k", "v"):
        cache = "key" if x == "k" else "value"
        nodes += [h.make_node("Reshape", [x, "to_heads"], [f"{x}4"]),
                  h.make_node("Transpose", [f"{x}4"], [f"{x}_heads"], perm=[0, 2, 1, 3]),
                  h.make_node("Concat", [f"past_{cache}", f"{x}_heads"], [f"present_{cache}"], axis=2),
                  h.make_node("Gather", [f"present_{cache}", "repeat"], [f"{cache}_heads"], axis=1)]
    nodes += [h.make_node("MultiHeadAttention", ["q", "key_heads", "value_heads", "", "", "bias"], ["attended"],
                          domain="com.microsoft", num_heads=heads),
              h.make_node("MatMul", ["attended", "w_o"], ["y"])]
    inputs = [h.make_tensor_value_info("qkv", TP.FLOAT, ["B", "S", (heads + 2 * kv) * size]),
              h.make_tensor_value_info("past_key", TP.FLOAT, ["B", kv, "P", size]),
              h.make_tensor_value_info("past_value", TP.FLOAT, ["B", kv, "P", size]),
              h.make_tensor_value_info("bias", TP.FLOAT, ["B", 1, bias_tokens, "T"])]
    outputs = [h.make_tensor_value_info("y", TP.FLOAT, ["B", "S", 16]),
               h.make_tensor_value_info("present_key", TP.FLOAT, ["B", kv, "T", size]),
               h.make_tensor_value_info("present_value", TP.FLOAT, ["B", kv, "T", size])]
    attended = [h.make_tensor_value_info("attended", TP.FLOAT, ["B", "S", heads * size])]  # a contrib op: declared
    graph = h.make_graph(nodes, "layer", inputs, outputs, inits, value_info=attended)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)],
                        ir_version=8)


@pytest.mark.parametrize("bias_tokens,from_bias", [("S", True), ("S_mask", False)])
def test_the_condition_reads_the_bias_only_where_its_tokens_are_proved(bias_tokens, from_bias):
    """The If's condition reads the step's tokens from the bias's axis 2 only when that axis is provably the
    projection's sequence axis (then shared by every layer); else the query's own rows. Either way the
    rewritten layer equals the original at one token (the kernel) and at 20 (MultiHeadAttention)."""
    model = _one_layer(bias_tokens)  # the rules themselves: the pipeline sets a model's value_info aside
    rules = [RULES[name] for name in ("contrib-attention-inputs", "contrib-grouped-attention-inputs", RULE)]
    rewritten, report = fuse(model, *rules)
    assert report.counts[RULE] == 1, report.refusals
    shape_reader = {n.output[0]: n for n in rewritten.graph.node}
    condition = next(n for n in rewritten.graph.node if n.op_type == "If").input[0]
    gather = shape_reader[shape_reader[condition].input[0]]  # LessOrEqual(Gather(Shape(x), axis), limit)
    shape = shape_reader[gather.input[0]]
    assert (shape.input[0] == "bias") == from_bias
    original = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    fused = ort.InferenceSession(rewritten.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    for tokens, past in ((1, 9), (20, 0)):
        feeds = {"qkv": rng.standard_normal((2, tokens, 64)).astype(np.float32),
                 "past_key": rng.standard_normal((2, 2, past, 8)).astype(np.float32),
                 "past_value": rng.standard_normal((2, 2, past, 8)).astype(np.float32),
                 "bias": np.where(rng.random((2, 1, tokens, past + tokens)) < 0.2, MASKED, 0).astype(np.float32)}
        for want, got in zip(original.run(None, feeds), fused.run(None, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
