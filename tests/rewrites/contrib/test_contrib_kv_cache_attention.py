"""contrib-kv-cache-attention (opt-in): each KV-cache decoder layer's MultiHeadAttention over
Concat(past, new) keys and values becomes one GroupQueryAttention writing the presents; logits and
presents equal the original's at prefill, decode and a batch-1 chunk over a cache with left padding
(ONNX Runtime's CPU provider), the documented limit (a batch of several new tokens over a cache) is
ONNX Runtime's refusal, and float32 or attention without a cache is refused."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata
from onnxfuse.custom_ops import session_options

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
from test_kv_cache_gpu import LAYERS, _assert_equal_at_real_tokens, _feeds  # noqa: E402  (the same prefill/decode feeds, run on the CPU here)

RULE = "contrib-kv-cache-attention"


def _with_rule(model):
    return onnxfuse.optimize(model, validate=False, only=[f"+{RULE}"])


@pytest.mark.parametrize("name", ["qwen2_kv_opset14_fp16", "mistral_kv_opset17_fp16", "llama_kv_dynamo_fp16"])
def test_group_query_attention_equals_the_original(name):
    model = load_testdata(name)
    result = _with_rule(model)
    assert result.applied.counts[RULE] == LAYERS, result.applied.refusals
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("GroupQueryAttention") == LAYERS and "MultiHeadAttention" not in ops
    produced = {o: n.op_type for n in result.model.graph.node for o in n.output}
    assert {produced[o.name] for o in result.model.graph.output if o.name.startswith("present")} == {"GroupQueryAttention"}
    original = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    fused = ort.InferenceSession(result.model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    _assert_equal_at_real_tokens(original, fused, ((2, 6, 0), (3, 1, 9), (1, 3, 4)), rng)
    feeds, _ = _feeds(2, 3, 4, rng)
    with pytest.raises(Exception, match="batch_size must be 1"):
        fused.run(None, feeds)


def test_seqlens_are_computed_once_for_every_layer():
    result = _with_rule(load_testdata("qwen2_kv_opset14_fp16"))
    gqa = [n for n in result.model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len({n.input[5] for n in gqa}) == 1 and len({n.input[6] for n in gqa}) == 1


def test_refuses_float32_and_attention_without_a_cache():
    fp32 = _with_rule(load_testdata("qwen2_kv_opset14"))
    assert fp32.applied.counts.get(RULE, 0) == 0
    assert "GroupQueryAttention" not in [n.op_type for n in fp32.model.graph.node]  # float16/bfloat16 kernels only
    bert = _with_rule(load_testdata("bert_tiny_sdpa_opset14"))
    assert bert.applied.counts.get(RULE, 0) == 0


def test_is_opt_in():
    default = onnxfuse.optimize(load_testdata("qwen2_kv_opset14_fp16"), validate=False)
    assert default.applied.counts.get(RULE, 0) == 0
