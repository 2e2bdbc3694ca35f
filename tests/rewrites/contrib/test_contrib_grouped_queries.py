"""contrib-grouped-queries (opt-in): MultiHeadAttention over repeated key/value heads regrouped over the
key/value heads themselves; the float16 KV-cache decoders' logits and presents equal the original's at
prefill and decode with left padding (ONNX Runtime's CPU provider), and without repeated heads it refuses."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata
from onnxfuse.custom_ops import session_options
from onnxfuse.rewrites import RULES, select_rules

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
from test_kv_cache_gpu import LAYERS, _assert_equal_at_real_tokens  # noqa: E402  (the same prefill/decode checks, run on the CPU here)

RULE = "contrib-grouped-queries"


def _with_rule(model):
    return onnxfuse.optimize(model, samples=2, only=[f"+{RULE}"])  # the defaults plus this opt-in rule


@pytest.mark.parametrize("name", ["qwen2_kv_opset14_fp16", "mistral_kv_opset17_fp16"])
def test_grouped_queries_equal_the_original_at_prefill_and_decode(name):
    model = load_testdata(name)
    result = _with_rule(model)
    assert result.validation.passed and result.applied.counts[RULE] == LAYERS, result.applied.refusals
    mha = [n for n in result.model.graph.node if n.op_type == "MultiHeadAttention"]
    assert [next(a.i for a in n.attribute if a.name == "num_heads") for n in mha] == [2] * LAYERS  # H_kv, not H
    made_by = {o: n.op_type for n in result.model.graph.node for o in n.output}
    assert all(made_by.get(n.input[i]) != "Gather" for n in mha for i in (1, 2))  # K and V no longer repeated
    original = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    grouped = ort.InferenceSession(result.model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    _assert_equal_at_real_tokens(original, grouped, ((2, 6, 0), (3, 1, 9), (2, 3, 4)), rng)


def test_grouped_queries_is_opt_in_and_refuses_attention_without_repeats():
    default = onnxfuse.optimize(load_testdata("qwen2_kv_opset14_fp16"), validate=False)
    assert RULE not in default.applied.counts or default.applied.counts[RULE] == 0
    bert = _with_rule(load_testdata("bert_tiny_sdpa_opset14"))
    assert bert.applied.counts.get(RULE, 0) == 0


def test_plus_adds_an_opt_in_rule_to_the_defaults():
    defaults = [r.name for r in select_rules()]
    assert RULE not in defaults
    assert [r.name for r in select_rules(only=f"+{RULE}")] == [r.name for r in RULES if r.name in defaults + [RULE]]
    assert [r.name for r in select_rules(only=f"fold-constants,+{RULE}")] == ["fold-constants", RULE]
