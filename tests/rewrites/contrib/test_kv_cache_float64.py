"""KV-cache decoders against an independent float64 reference (issue 31): the legacy exports
(``llama_kv_opset{14,17}``, ``qwen2_kv_opset{14,17}``, float32 and float16) and a decoder through torch's
dynamo exporter (issue 31's dynamo row): testdata
``llama_kv_dynamo[_fp16]`` (``export_transformers.py --kv-dynamo``: tiny Llama, 4 query heads sharing 2
key/value heads, 2 layers, sdpa, opset 18, dynamic batch, sequence and past). The exporter computes
repeat_kv's Expand target as ``Shape(past)[2] + Shape(input_ids)[1]``: repeat-heads-gather proves that
sum equal to the length of ``Concat(past, new)`` term by term (``shape_values.concat_length``), so each
repeat becomes one Gather. Every attention is fused, float32 (a cache's rotated heads: policy.cache_key)
as float16, each layer AttentionInputs, DecodeAttention for decode steps and MultiHeadAttention for
prefill (docs/benchmarks.md 5.34 measured the float32 decoder faster so in every cell). Both validate with no ``--shape`` and match the float32 export evaluated in float64 (onnx's
reference evaluator) at prefill (empty cache) and decode (one new token) with left padding."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import onnxfuse
from helpers import kv_cache_feeds, load_testdata, op_types_within, run_float64
from test_attention_exports import run_optimized

LAYERS = 2


def assert_matches_float64(model, reference, steps, half: bool, rng, original=None, tol: float | None = None,
                           **feed_options) -> None:
    """``model``'s outputs at each (batch, new tokens, cached tokens) of ``steps`` (kv_cache_feeds, the first
    row left-padded) within float16's (2e-2) or float32's (1e-4) tolerance of ``reference`` (a float32
    model) evaluated in float64 by onnx's reference evaluator, relative to max(1, |reference|); with
    ``original`` (the float16 export ``model`` was optimized from), within twice that export's own error
    where the export itself is further off (a float16 export's padded rows can be: Qwen3's are 0.17).
    ``tol`` overrides the tolerance (float32 feeds to a model computing in float16: ``--precision fp16``)."""
    tol = tol if tol is not None else 2e-2 if half else 1e-4
    for batch, new, past in steps:
        feeds = kv_cache_feeds(batch, new, past, np.float16 if half else np.float32, rng, **feed_options)
        exact = run_float64(reference, {k: v.astype(np.float32) if v.dtype == np.float16 else v
                                        for k, v in feeds.items()})
        got = dict(zip([o.name for o in model.graph.output], run_optimized(model, feeds)))
        own = dict(zip([o.name for o in original.graph.output], run_optimized(original, feeds))) if original else {}
        for out, want in exact.items():
            scale = max(1.0, float(np.abs(want).max()))
            err = float(np.abs(got[out].astype(np.float64) - want).max()) / scale
            allowed = max(tol, 2 * float(np.abs(own[out].astype(np.float64) - want).max()) / scale) if own else tol
            assert err <= allowed, f"{out} at batch {batch}, {new} new, {past} cached: {err:.2e} (allowed {allowed:.2e})"


@pytest.mark.parametrize("name", ["llama_kv_dynamo_fp16", "llama_kv_dynamo"])
def test_dynamo_kv_cache_decoder_fuses_and_matches_a_float64_reference(name):
    half = name.endswith("fp16")
    result = onnxfuse.optimize(load_testdata(name), samples=2)
    assert result.validation.passed, result.validation
    ops = Counter(op_types_within(result.model))
    assert result.applied.counts.get("repeat-heads-gather") == 2 * LAYERS, result.applied.refusals
    assert ops["ReduceMean"] == 0 and ops["SkipSimplifiedLayerNormalization"] == 2 * LAYERS, ops
    assert ops["RotaryEmbedding"] + 2 * ops["AttentionInputs"] == 2 * LAYERS, ops  # or inside AttentionInputs
    assert ops["MultiHeadAttention"] == ops["DecodeAttention"] == LAYERS and ops["Softmax"] == 0, result.unfused
    reference = load_testdata("llama_kv_dynamo")  # the float32 export: the weights of both, unrounded
    assert_matches_float64(result.model, reference, ((2, 5, 0), (3, 1, 6)), half, np.random.default_rng(31))


@pytest.mark.parametrize("name", [f"{arch}_kv_opset{opset}{suffix}" for arch in ("llama", "qwen2")
                                  for opset in (14, 17) for suffix in ("", "_fp16")])
def test_legacy_kv_cache_decoders_match_a_float64_reference(name):
    """The legacy exports (``export_transformers.py --kv-cache``) on the same prefill and decode inputs:
    each float16 model against its float32 twin (same seed, same weights) evaluated in float64."""
    half = name.endswith("_fp16")
    result = onnxfuse.optimize(load_testdata(name), samples=2)
    assert result.validation.passed, result.validation
    ops = Counter(op_types_within(result.model))
    assert ops["MultiHeadAttention"] == ops["DecodeAttention"] == LAYERS and ops["Softmax"] == 0, result.unfused
    reference = load_testdata(name.removesuffix("_fp16"))
    assert_matches_float64(result.model, reference, ((2, 5, 0), (3, 1, 6)), half, np.random.default_rng(17))



SDPA = ["llama_sdpa_kv_opset14", "llama_sdpa_kv_opset17_fp16", "qwen2_sdpa_kv_opset14_fp16", "qwen2_sdpa_kv_opset17"]


@pytest.mark.parametrize("name", SDPA)
def test_sdpa_kv_cache_decoders_fuse_and_match_a_float64_reference(name):
    """transformers' default (sdpa) attention through the legacy exporter (``export_transformers.py
    --kv-cache --sdpa``): torch's symbolic scales q and k by √scale each, repeats the key/value heads
    itself and reshapes P·V to [B, -1, S, D] (read from P·V's, q's and V's shapes) before the merge.
    contrib-attention proves that Reshape an identity (heads.rows_reshape_problem), and each layer then
    takes AttentionInputs and DecodeAttention as the eager exports do; the outputs match the sdpa float32
    export of the same weights evaluated in float64 at prefill (both If branches) and decode (not the
    eager one: with left padding their fully masked query rows differ, an average of V against zeros)."""
    half = name.endswith("_fp16")
    result = onnxfuse.optimize(load_testdata(name), samples=2)
    assert result.validation.passed, result.validation
    ops = Counter(op_types_within(result.model))
    assert ops["MultiHeadAttention"] == ops["DecodeAttention"] == ops["AttentionInputs"] == LAYERS, result.unfused
    assert ops["Softmax"] == 0 and ops["RotaryEmbedding"] == 0, ops
    # a float16 export's residual stream is float32 (the symbolic's float32 mask constants): each norm one kernel
    assert ops["MixedRMSNorm"] == (2 * LAYERS + 1 if half else 0), ops
    reference = load_testdata(next(n for n in SDPA if n.startswith(name.split("_")[0]) and not n.endswith("_fp16")))
    assert_matches_float64(result.model, reference, ((2, 12, 0), (2, 5, 0), (3, 1, 6)), half, np.random.default_rng(23))


def test_the_rows_reshape_must_read_each_dimension_where_it_is_known():
    """The sdpa export's Reshape(P·V, [B, -1, S, D]) reads S from the query heads: without them among the
    tensors known to hold the score rows, the proof fails at dimension 2 (and contrib-attention refuses)."""
    from onnxfuse import model_io
    from onnxfuse.rewrites.contrib.attention.heads import rows_reshape_problem
    from onnxfuse.rewrites.facts.graph import consumers
    from onnxfuse.rewrites.facts.inference import inferred_and_proven

    graph = inferred_and_proven(load_testdata("llama_sdpa_kv_opset14"), model_io.to_graph)
    softmax = next(n for n in graph.nodes if n.op == "Softmax")
    guard = next(c for c in consumers(softmax.outputs[0]) if c.op == "Where")  # the NaN guard: Where(IsNaN(p), 0, p)
    pv = consumers(guard.outputs[0])[0]
    rows = next(c for c in consumers(pv.outputs[0]) if c.op == "Reshape")
    qk = softmax.inputs[0].inputs[0].inputs[0].inputs[0]  # Softmax ← Add (the mask) ← MatMul(q·√s, kᵀ·√s)
    query = qk.inputs[0].inputs[0].inputs[0]  # the √scale Mul's input: the rotated query heads
    assert rows_reshape_problem(graph, rows, pv.outputs[0], [query], pv.inputs[1]) is None
    problem = rows_reshape_problem(graph, rows, pv.outputs[0], [], pv.inputs[1])
    assert problem is not None and "dimension 2" in problem.reason


@pytest.mark.parametrize("name", ["llama_kv_opset17", "qwen2_kv_opset14", "qwen2_sdpa_kv_opset17", "llama_kv_dynamo"])
def test_precision_fp16_of_a_float32_decoder_fuses_its_attention(name):
    """``--precision fp16`` of a float32 KV-cache export (issue 33): the conversion keeps the finfo(float32).min
    mask and each Softmax in float32 (a softmax island, precision.py), and contrib-attention takes the island
    as a float16 MultiHeadAttention with the mask raw (key_padding_mask, mask_filter_value added in float32:
    fully masked rows stay uniform as in the original). That needs the keep mask's key length proved equal
    to the cache ``Concat(past, new)``, whose length the conversion's Cast leaves to inference to invent
    (``unk__N``): ``shape_values`` now proves such a dimension from how the tensor is made, and the
    dynamo export's padding lookup (a GatherND by an index grid) along the key axis. Before, every Softmax
    stayed. The output matches the float32 export evaluated in float64 at prefill and decode with
    a left-padded row, within float16's tolerance."""
    model = load_testdata(name)
    result = onnxfuse.optimize(model, precision="fp16", samples=2)
    assert result.validation.passed, result.validation
    ops = Counter(op_types_within(result.model))
    assert ops["MultiHeadAttention"] == LAYERS and ops["Softmax"] == 0, result.unfused
    assert_matches_float64(result.model, model, ((2, 5, 0), (3, 1, 6)), False, np.random.default_rng(5), tol=2e-2)
