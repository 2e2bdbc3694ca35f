"""optimum's Whisper decoders with their KV cache (issue 31): ``optimum-cli export onnx --task
automatic-speech-recognition-with-past`` of a tiny random Whisper (testdata ``optimum_whisper_decoder[_with_past]``,
``export_optimum.py --whisper``; transformers 4.57, torch's legacy exporter at opset 18).

transformers' Whisper decoder tiles its position ids to the batch (``Tile(positions [1, S], [B, 1])``), so
ONNX's inference left the embeddings' batch invented (``unk__``), every head split's batch with it, and
contrib-attention refused all four attentions ("given Q, K and V heads not provably of one batch size"),
the first step's self-attention also its NaN-guarded mask. ``facts/proven_dims.py`` now proves a Tile's
output dims (x's dimension times the repeat where one is 1). Every attention becomes one
MultiHeadAttention; the outputs match the original on ONNX Runtime and the original evaluated in float64,
at the first step, at decode (one new token over 6 cached) and with several new tokens over a cache."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import onnxfuse
from helpers import load_testdata, run_ort
from test_t5_kv_cache import assert_equal_to_original_and_float64

LAYERS, HEADS, HEAD_SIZE, HIDDEN = 2, 4, 16, 64
#: testdata name: the steps it is run at, (batch, new tokens, cached tokens, encoder frames)
MODELS = {"optimum_whisper_decoder": [(2, 5, 0, 7), (3, 1, 0, 4)],
          "optimum_whisper_decoder_with_past": [(3, 1, 6, 7), (2, 3, 4, 5), (2, 1, 1, 3)]}


def whisper_feeds(model, rng, batch, new, past, frames):
    """One step's inputs, read off the model's own input list."""
    feeds = {}
    for i in model.graph.input:
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 128, (batch, new)).astype(np.int64)
        elif i.name == "encoder_hidden_states":
            feeds[i.name] = rng.standard_normal((batch, frames, HIDDEN)).astype(np.float32)
        else:  # past_key_values.N.{decoder,encoder}.{key,value}
            length = past if ".decoder." in i.name else frames
            feeds[i.name] = rng.standard_normal((batch, HEADS, length, HEAD_SIZE)).astype(np.float32)
    return feeds


@pytest.fixture(scope="module", params=list(MODELS))
def optimized(request):
    model = load_testdata(request.param)
    return request.param, model, onnxfuse.optimize(model, provider="cpu", samples=2)


def test_every_whisper_attention_is_one_multihead_attention(optimized):
    name, model, result = optimized
    assert result.validation.passed, result.validation
    assert Counter(n.op_type for n in model.graph.node)["Softmax"] == 2 * LAYERS
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["MultiHeadAttention"] == 2 * LAYERS and ops["Softmax"] == 0, (ops, result.unfused)
    assert not [r for r in result.applied.refusals if r.rule == "contrib-attention"]


def test_whisper_decoder_outputs_equal_the_original_and_a_float64_reference(optimized):
    name, model, result = optimized
    rng = np.random.default_rng(415)
    for batch, new, past, frames in MODELS[name]:
        feeds = whisper_feeds(model, rng, batch, new, past, frames)
        assert_equal_to_original_and_float64(model, result.model, feeds,
                                             f"{name} at batch {batch}, {new} new, {past} cached, {frames} frames")


def test_the_tiled_positions_and_the_cache_reach_the_logits():
    """The test above can fail: the cached self-attention keys and the encoder's keys change the logits."""
    model = load_testdata("optimum_whisper_decoder_with_past")
    feeds = whisper_feeds(model, np.random.default_rng(5), 3, 1, 6, 7)
    base = run_ort(model, feeds)["logits"]
    for name in ("past_key_values.0.decoder.key", "past_key_values.1.encoder.value"):
        other = dict(feeds, **{name: feeds[name][::-1].copy()})
        assert np.abs(run_ort(model, other)["logits"] - base).max() > 1e-2, name
