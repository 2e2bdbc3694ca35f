"""KV-cache decoders on CUDA (issue 31): testdata's float16 Llama and Qwen2 with ``past_key_values``
optimized with validation on the GPU, every attention a MultiHeadAttention whose inputs (rotations,
presents, repeated heads) one AttentionInputs kernel makes from the packed q/k/v projection; then prefill (empty cache) and decode
(one new token over a cache) on ONNX Runtime's CUDA provider, the optimized model's logits and presents
equal to the original's at every real token, with left padding in the batch."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata, op_types_within
from onnxfuse.custom_ops import session_options
from onnxfuse.runtime.session import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]
LAYERS, KV_HEADS, HEAD = 2, 2, 16


def _session(model, options=None):
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    return session


def _feeds(batch, new, past, rng, pad=2, kv_heads=KV_HEADS, head=HEAD, dtype=np.float16):
    total = past + new
    mask = np.ones((batch, total), np.int64)
    mask[0, :pad] = 0  # left padding of the first sequence
    position = np.cumsum(mask, axis=1)[:, past:] - 1
    position[position < 0] = 1
    feeds = {"input_ids": rng.integers(0, 128, (batch, new)).astype(np.int64), "attention_mask": mask,
             "position_ids": position.astype(np.int64)}
    for i in range(LAYERS):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = rng.standard_normal((batch, kv_heads, past, head)).astype(dtype)
    return feeds, mask.astype(bool)


def _assert_equal_at_real_tokens(original, optimized, cases, rng):
    """For each (batch, new tokens, cached tokens): the logits at every new token that is not padding and
    the presents at every real position equal the original session's, within float16's rounding (float32
    models: 1e-3)."""
    names = [o.name for o in original.get_outputs()]
    inputs = {i.name for i in original.get_inputs()}
    cache = next(i for i in original.get_inputs() if i.name.startswith("past_key_values"))  # [B, G, P, D]
    dtype = np.float16 if cache.type == "tensor(float16)" else np.float32
    tol = 2e-2 if dtype == np.float16 else 1e-3
    for batch, new, past in cases:
        feeds, real = _feeds(batch, new, past, rng, kv_heads=cache.shape[1], head=cache.shape[3], dtype=dtype)
        feeds = {k: v for k, v in feeds.items() if k in inputs}
        want = dict(zip(names, original.run(None, feeds)))
        got = dict(zip(names, optimized.run(None, feeds)))
        rows = real[:, past:]  # the new tokens that are not padding
        np.testing.assert_allclose(got["logits"][rows].astype(np.float64), want["logits"][rows].astype(np.float64),
                                   rtol=tol, atol=tol, err_msg=f"logits {batch}x{new} past {past}")
        keep = real[:, None, :, None]  # presents: the cache as given plus the new keys/values, at real positions
        for out in names[1:]:
            np.testing.assert_allclose(np.where(keep, got[out], 0).astype(np.float64),
                                       np.where(keep, want[out], 0).astype(np.float64), rtol=tol, atol=tol,
                                       err_msg=f"{out} {batch}x{new} past {past}")


@pytest.mark.parametrize("name", ["llama_kv_opset17_fp16", "qwen2_kv_opset14_fp16", "llama_kv_opset17", "qwen2_kv_opset14",
                                  "llama_sdpa_kv_opset17_fp16", "qwen2_sdpa_kv_opset14_fp16", "qwen2_sdpa_kv_opset17",
                                  "mistral_kv_opset17"])
def test_kv_cache_decoder_fused_and_equal_on_cuda(name):
    model = load_testdata(name)
    result = onnxfuse.optimize(model, provider="cuda", samples=2)
    assert result.validation.passed and result.validation.provider == "cuda", result.validation
    ops = op_types_within(result.model)  # MultiHeadAttention may be an If's prefill branch (contrib-decode-attention)
    assert ops.count("MultiHeadAttention") == LAYERS and "Softmax" not in ops, result.applied.refusals
    # the packed projection's Split, the rotations, the cache Concats and repeat_kv: one AttentionInputs
    assert ops.count("AttentionInputs") == LAYERS and "Neg" not in ops, ops
    assert ops.count("RotaryEmbedding") == ops.count("Split") == 0, ops
    original, optimized = _session(model), _session(result.model, session_options())
    _assert_equal_at_real_tokens(original, optimized, ((2, 6, 0), (2, 1, 9), (1, 1, 30), (3, 1, 4)), np.random.default_rng(3))


@pytest.mark.parametrize("half", [True, False], ids=["fp16", "fp32"])
@pytest.mark.parametrize("batch,new,past", [(2, 5, 0), (3, 1, 6)], ids=["prefill", "decode"])
def test_optimum_export_fuses_and_matches_on_cuda(batch, new, past, half):
    """optimum's Llama export, float16 (float32 Softmax and P·V: the fused op takes them as a float16
    island, tests/rewrites/contrib/test_optimum_kv_cache.py) and float32 (its NaN-guarded mask as a keep
    bias, so DecodeAttention takes decode steps): validated on CUDA, and its logits and presents equal
    the original's on CUDA at prefill and decode with a left-padded row, within float16's rounding."""
    from helpers import kv_cache_feeds

    original = load_testdata("optimum_llama_kv_fp16" if half else "optimum_llama_kv")
    result = onnxfuse.optimize(original, provider="cuda", bench=False)
    assert result.validation.passed
    ops = op_types_within(result.model)
    assert ops.count("MultiHeadAttention") == ops.count("DecodeAttention") == 2, ops
    feeds = kv_cache_feeds(batch, new, past, np.float16 if half else np.float32, np.random.default_rng(4))
    names = [o.name for o in original.graph.output]
    want = dict(zip(names, _session(original).run(None, feeds)))
    got = dict(zip(names, _session(result.model, session_options()).run(None, feeds)))
    for name in names:
        a, b = want[name].astype(np.float32), got[name].astype(np.float32)
        assert np.isfinite(b).all(), name
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2 * max(1.0, float(np.abs(a).max())), err_msg=name)


@pytest.mark.parametrize("name", ["qwen2_kv_opset14_fp16", "llama_kv_opset17_fp16", "mistral_kv_opset17_fp16"])
def test_kv_cache_attention_as_group_query_attention_on_cuda(name):
    """contrib-kv-cache-attention (opt-in): each layer's attention and cache append is one
    GroupQueryAttention on CUDA; at prefill (empty cache), decode (one new token, batch 3) and a
    batch-1 chunk over a cache, logits and presents equal the original's at every real token with a
    left-padded row; a batch of several new tokens over a cache is what ONNX Runtime refuses (the rule's
    documented limit), seen here as the error it is."""
    model = load_testdata(name)
    result = onnxfuse.optimize(model, validate=False, only=["+contrib-kv-cache-attention"])
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("GroupQueryAttention") == LAYERS and "MultiHeadAttention" not in ops, result.applied.refusals
    original, optimized = _session(model), _session(result.model, session_options())
    rng = np.random.default_rng(5)
    _assert_equal_at_real_tokens(original, optimized, ((2, 6, 0), (3, 1, 9), (1, 1, 30), (1, 3, 4)), rng)
    feeds, _ = _feeds(2, 3, 4, rng)
    with pytest.raises(Exception, match="batch_size must be 1"):
        optimized.run(None, feeds)


@pytest.mark.parametrize("name", ["qwen2_kv_opset14_fp16", "llama_kv_opset17_fp16", "llama_kv_dynamo_fp16",
                                  "phi3_kv_opset17_fp16"])
@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "repeated"])
def test_attention_inputs_kernel_on_cuda(name, grouped):
    """contrib-attention-inputs: each layer's Split, rotations, head transposes, cache Concats and
    repeated heads are one AttentionInputs node whose CUDA kernel (compiled with NVRTC) writes the
    rotated query, the presents and the repeated heads, or with contrib-grouped-attention-inputs the
    query as n rows per key/value head for an attention over the presents themselves; validated on
    CUDA, and at prefill, decode and a batch-2 chunk over a cache the logits and presents equal the
    original's on CUDA at every real token with a left-padded row."""
    model = load_testdata(name)
    result = onnxfuse.optimize(model, provider="cuda", samples=2, bench=False,
                               skip=None if grouped else ["contrib-grouped-attention-inputs"])
    assert result.validation.passed and result.validation.provider == "cuda", result.validation
    assert result.applied.counts.get("contrib-grouped-attention-inputs", 0) == (LAYERS if grouped else 0)
    assert result.applied.counts.get("contrib-decode-attention", 0) == (LAYERS if grouped else 0)
    ops = op_types_within(result.model)  # with DecodeAttention, the MultiHeadAttention is an If's prefill branch
    assert ops.count("AttentionInputs") == LAYERS and ops.count("MultiHeadAttention") == LAYERS, result.applied.refusals
    assert "Concat" not in [n.op_type for n in result.model.graph.node if n.output and n.output[0].startswith("present")]
    original, optimized = _session(model), _session(result.model, session_options())
    # prefill of 6 and 20 tokens: with grouped rows, 12 rows per head take DecodeAttention, 40 MultiHeadAttention
    _assert_equal_at_real_tokens(original, optimized, ((2, 6, 0), (1, 20, 0), (3, 1, 9), (1, 1, 30), (2, 3, 4)),
                                 np.random.default_rng(9))
