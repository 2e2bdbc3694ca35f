"""optimum's T5 and BART decoders with their KV cache (issue 31 item 2): ``optimum-cli export onnx --task
text2text-generation-with-past`` of a tiny random T5 and BART (testdata ``optimum_{t5,bart}_decoder[_with_past]``,
``export_optimum.py --t5 --bart``; transformers 4.57, torch's legacy exporter at opset 18).

* ``optimum_t5_decoder`` (the first step) returns the head-split keys and values of every attention as
  ``present`` outputs, so the splits stay (contrib-attention's ``heads.shared_splits``) and
  MultiHeadAttention reads q, k and v as their [B, ·, E] projections: self-attention and the
  cross-attention over ``encoder_hidden_states``;
* ``optimum_t5_decoder_with_past`` (every later step): the self-attention's K and V are ``Concat(past,
  new)`` (the ``present`` outputs) and the cross-attention's are the cached encoder keys and values, a
  graph input; the op reads both as given [B, H, L, D] heads (float32 too: ``policy``'s cache heads).

T5 has no 1/√d scale (``scale`` = 1) and adds its relative position bias plus the causal/padding mask,
one tensor, which becomes ``attention_bias``; BART scales q by 1/√16 and adds only the mask, and its
projection biases stay where a kept split reads them. The outputs match the original on ONNX Runtime CPU and the
original evaluated in float64 by onnx's reference evaluator, on inputs with padded encoder rows: decode
(one new token, 6 cached), several new tokens over a cache, and the first step."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnxfuse
from helpers import load_testdata, run_float64, run_ort
from test_attention_exports import run_optimized

LAYERS, HEADS, HEAD_SIZE, HIDDEN = 2, 4, 16, 64
#: float32 fused against the original on ONNX Runtime, and against the float64 evaluation
RTOL = ATOL = 1e-4


def _encoder_mask(batch, length):
    """Encoder padding: row 0 right-padded (its last 3 positions), row 1 left-padded (its first 2)."""
    mask = np.ones((batch, length), np.int64)
    mask[0, length - 3:] = 0
    mask[1, :2] = 0
    return mask


def seq2seq_feeds(rng, batch, new, past, source, with_past, merged=False, dtype=np.float32):
    """Inputs of one decoder step (``dtype`` floats; also test_seq2seq_fp16_kv_cache.py's). The merged
    decoder takes every input: at the first step (``use_cache_branch`` false) a one-token dummy cache
    that its first-step branch does not read."""
    feeds = {"encoder_attention_mask": _encoder_mask(batch, source),
             "input_ids": rng.integers(0, 128, (batch, new)).astype(np.int64)}
    if merged or not with_past:
        feeds["encoder_hidden_states"] = rng.standard_normal((batch, source, HIDDEN)).astype(dtype)
    if merged or with_past:
        for i in range(LAYERS):
            for side, length in (("decoder", past if with_past else 1), ("encoder", source)):
                for kv in ("key", "value"):
                    feeds[f"past_key_values.{i}.{side}.{kv}"] = rng.standard_normal(
                        (batch, HEADS, length, HEAD_SIZE)).astype(dtype)
    if merged:
        feeds["use_cache_branch"] = np.array([with_past])
    return feeds


FIRST_STEP = [(2, 5, 0, 7), (3, 1, 0, 4)]  # (batch, new tokens, cached tokens, encoder length)
LATER_STEPS = [(3, 1, 6, 7), (2, 3, 4, 5), (2, 1, 1, 3)]
#: testdata name: (the steps it is run at, MultiHeadAttention's scale: T5 none, BART 1/√16 on q)
MODELS = {"optimum_t5_decoder": (FIRST_STEP, 1.0), "optimum_t5_decoder_with_past": (LATER_STEPS, 1.0),
          "optimum_bart_decoder": (FIRST_STEP, 0.25), "optimum_bart_decoder_with_past": (LATER_STEPS, 0.25)}


@pytest.fixture(scope="module", params=list(MODELS))
def optimized(request):
    name = request.param
    model = load_testdata(name)
    return name, model, onnxfuse.optimize(model, provider="cpu", samples=2)


def test_every_t5_attention_is_one_multihead_attention(optimized):
    name, model, result = optimized
    assert result.validation.passed, result.validation
    before = Counter(n.op_type for n in model.graph.node)
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert before["Softmax"] == 2 * LAYERS
    assert ops["MultiHeadAttention"] == 2 * LAYERS and ops["Softmax"] == 0, (ops, result.unfused)
    assert not [r for r in result.applied.refusals if r.rule == "contrib-attention"]
    for node in result.model.graph.node:
        if node.op_type == "MultiHeadAttention":
            attrs = {a.name: a for a in node.attribute}
            assert attrs["num_heads"].i == HEADS and attrs["scale"].f == MODELS[name][1]
            assert len(node.input) == 6 and node.input[5], "the (position bias +) mask is the attention_bias"
    if name.endswith("with_past"):  # the cache Concats stay: they are the present outputs the op reads
        assert ops["Concat"] >= 2 * LAYERS


def assert_equal_to_original_and_float64(model, fused, feeds, where: str):
    """``fused`` (run with the custom-op library) gives ``model``'s outputs on ONNX Runtime and the float64
    evaluation of ``model``, within RTOL/ATOL (also test_whisper_kv_cache.py's)."""
    want, exact = run_ort(model, feeds), run_float64(model, feeds)
    got = dict(zip(want, run_optimized(fused, feeds)))
    for out, value in want.items():
        np.testing.assert_allclose(got[out], value, rtol=RTOL, atol=ATOL, err_msg=f"{out}, {where}")
        np.testing.assert_allclose(got[out], exact[out], rtol=RTOL, atol=ATOL, err_msg=f"{out}, {where}, float64")


def test_t5_decoder_outputs_equal_the_original_and_a_float64_reference(optimized):
    name, model, result = optimized
    rng = np.random.default_rng(312)
    for batch, new, past, source in MODELS[name][0]:
        feeds = seq2seq_feeds(rng, batch, new, past, source, name.endswith("with_past"))
        assert_equal_to_original_and_float64(model, result.model, feeds,
                                             f"{name} at batch {batch}, {new} new, {past} cached, {source} encoder positions")


@pytest.mark.parametrize("name", ["optimum_t5_decoder_with_past", "optimum_bart_decoder_with_past"])
def test_the_encoder_padding_reaches_the_logits(name):
    """The test above can fail: the padded encoder positions change the logits (the cross-attention's
    mask is live), and the cached self-attention keys do too."""
    model = load_testdata(name)
    feeds = seq2seq_feeds(np.random.default_rng(5), 3, 1, 6, 7, True)
    base = run_ort(model, feeds)["logits"]
    unpadded = run_ort(model, {**feeds, "encoder_attention_mask": np.ones_like(feeds["encoder_attention_mask"])})
    assert np.abs(unpadded["logits"][:2] - base[:2]).max() > 1e-2
    other = dict(feeds, **{"past_key_values.0.decoder.key": feeds["past_key_values.0.decoder.key"][::-1].copy()})
    assert np.abs(run_ort(model, other)["logits"] - base).max() > 1e-2


def _with_scaled_query_read(model):
    """``model`` with layer 0's self-attention query scaled before its head split (``q_proj(x)·2``, as
    Whisper scales it) and the split's Reshape also a graph output: the split must stay, but it reads the
    scaled projection, which the fused op would take the scale out of."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    prefix = "/decoder/block.0/layer.0/SelfAttention/"
    split = next(n for n in graph.node if n.name == prefix + "Reshape")
    graph.initializer.append(numpy_helper.from_array(np.array(2.0, np.float32), "query_scale"))
    scaled = helper.make_node("Mul", [split.input[0], "query_scale"], ["query_scaled"], name="query_scale_mul")
    graph.node.insert(list(graph.node).index(split), scaled)
    split.input[0] = "query_scaled"
    graph.output.append(helper.make_tensor_value_info(split.output[0], onnx.TensorProto.FLOAT, None))
    return out


def test_a_kept_split_that_reads_a_removed_scale_keeps_the_refusal():
    """The split nodes kept for another reader must not read anything the rewrite removes: the form that
    would take the scale out of the kept split is refused with the pattern's own reason. Since
    cancel-cast-roundtrip removes the export's Casts to their input's own type, the attention then fuses
    in another form that leaves the split (and its scale) as it is; the model is right either way."""
    model = _with_scaled_query_read(load_testdata("optimum_t5_decoder"))
    result = onnxfuse.optimize(model, provider="cpu", samples=2)
    assert result.validation.passed
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["MultiHeadAttention"] + ops["Softmax"] == 2 * LAYERS
    reasons = {r.reason for r in result.applied.refusals
               if r.rule == "contrib-attention" and r.node == "/decoder/block.0/layer.0/SelfAttention/Softmax"}
    assert any("is also a graph output" in reason for reason in reasons), reasons
    split = "/decoder/block.0/layer.0/SelfAttention/Reshape_output_0"
    assert split in {o.name for o in result.model.graph.output}  # still computed, from the scaled query
    feeds = seq2seq_feeds(np.random.default_rng(3), 2, 4, 0, 5, False)
    want = run_ort(model, feeds)
    for (out, value), got in zip(want.items(), run_optimized(result.model, feeds)):
        np.testing.assert_allclose(got, value, rtol=RTOL, atol=ATOL, err_msg=out)
