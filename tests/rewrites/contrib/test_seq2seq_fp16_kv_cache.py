"""optimum's float16 T5 and BART decoders with their KV cache: ``optimum-cli export onnx --task
text2text-generation-with-past --dtype fp16`` of the same tiny seeded T5 and BART as test_t5_kv_cache.py
(testdata ``optimum_{t5,bart}_decoder[_with_past]_fp16`` and ``optimum_t5_decoder_merged_fp16``,
``export_optimum.py --t5 --bart --fp16``: transformers 4.57, torch's legacy exporter at opset 18, on the CPU).

Their weights are the float32 exports' rounded to float16, so the float32 exports evaluated in float64
(``run_float64``) are the reference: every output within float16's tolerance (2e-2 relative to
max(1, |reference|)) at the first step (prefill: 5 new tokens, no cache) and at later steps (decode: one
new token over 6 cached, and 3 over 4), each with padded encoder rows (row 0 right-padded, row 1
left-padded); and within twice the float16 export's own error there.

* BART: every attention becomes one MultiHeadAttention (its Softmax runs in float16 like the rest), as in
  float32: 2 self- and 2 cross-attentions per decoder, the mask as ``attention_bias``, scale 1/√16.
* T5: transformers' T5 attention adds the position bias and mask to the float16 scores and only then
  takes ``softmax(scores.float()).type_as(scores)``: the export reads ``Cast(float16 Q·Kᵀ + bias,
  float32) → Softmax → Cast(float16) → ·V``. contrib-attention peels the float16 mask steps behind the
  upcast too (``half_terms``, attention/plan.py) and fuses every attention, the bias and mask as a float16
  ``attention_bias``, scale 1 (the merged decoder's inside its If, onnxfuse/bodies.py).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import onnxfuse
from onnxfuse import model_io
from helpers import load_testdata, op_types_within, run_float64, run_ort
from test_attention_exports import run_optimized
from test_t5_kv_cache import seq2seq_feeds

LAYERS, HEADS = 2, 4
#: float16 against the float64 evaluation of the float32 twin, relative to max(1, |reference|)
TOLERANCE = 2e-2
#: the most the optimized model's error may exceed the float16 export's own (measured at most 1.4; both ~1e-3)
FP16_ERROR_FACTOR = 2.0

FIRST_STEP = [(2, 5, 0, 7), (3, 1, 0, 4)]  # (batch, new tokens, cached tokens, encoder length)
LATER_STEPS = [(3, 1, 6, 7), (2, 3, 4, 5)]
#: float16 testdata name: (its float32 twin (the merged decoder: None, each branch's twin), the steps,
#: MultiHeadAttention's scale)
MODELS = {
    "optimum_bart_decoder_fp16": ("optimum_bart_decoder", FIRST_STEP, 0.25),
    "optimum_bart_decoder_with_past_fp16": ("optimum_bart_decoder_with_past", LATER_STEPS, 0.25),
    "optimum_t5_decoder_fp16": ("optimum_t5_decoder", FIRST_STEP, 1.0),
    "optimum_t5_decoder_with_past_fp16": ("optimum_t5_decoder_with_past", LATER_STEPS, 1.0),
    "optimum_t5_decoder_merged_fp16": (None, FIRST_STEP + LATER_STEPS, 1.0),
}


def _reference(twin, feeds):
    """The float32 twin evaluated in float64 on the same (float16-valued) inputs, its own inputs only."""
    names = {i.name for i in twin.graph.input}
    return run_float64(twin, {k: v.astype(np.float32) if v.dtype == np.float16 else v
                              for k, v in feeds.items() if k in names})


@pytest.fixture(scope="module", params=list(MODELS))
def optimized(request):
    name = request.param
    model = load_testdata(name)
    return name, model, onnxfuse.optimize(model, provider="cpu", samples=2)


def test_every_attention_is_fused(optimized):
    name, model, result = optimized
    assert result.validation.passed, result.validation
    _, _, scale = MODELS[name]
    softmaxes = Counter(op_types_within(model))["Softmax"]
    assert softmaxes == 2 * LAYERS * (2 if "merged" in name else 1)
    ops = Counter(op_types_within(result.model))
    refusals = {r.reason for r in result.applied.refusals if r.rule == "contrib-attention"}
    assert ops["MultiHeadAttention"] == softmaxes and ops["Softmax"] == 0, (ops, result.unfused)
    assert not refusals, refusals
    for graph in model_io.proto_graphs(result.model.graph):
        for node in graph.node:
            if node.op_type == "MultiHeadAttention":
                attrs = {a.name: a for a in node.attribute}
                assert attrs["num_heads"].i == HEADS and attrs["scale"].f == scale
                assert len(node.input) == 6 and node.input[5], "the mask is the attention_bias"


def test_outputs_match_the_float32_export_in_float64(optimized):
    name, model, result = optimized
    twin_name, steps, _ = MODELS[name]
    merged = twin_name is None
    rng = np.random.default_rng(1607)
    for batch, new, past, source in steps:
        with_past = past > 0 if merged else name.endswith("with_past_fp16")
        twin = load_testdata(twin_name or ("optimum_t5_decoder_with_past" if with_past else "optimum_t5_decoder"))
        feeds = seq2seq_feeds(rng, batch, new, past, source, with_past, merged, np.float16)
        exact = _reference(twin, feeds)
        got = dict(zip([o.name for o in result.model.graph.output], run_optimized(result.model, feeds)))
        own = run_ort(model, feeds)
        where = f"{name} at batch {batch}, {new} new, {past} cached, {source} encoder positions"
        for out, want in exact.items():
            assert got[out].dtype == np.float16 and got[out].shape == want.shape, (out, where)
            err, own_err = (float(np.abs(x[out].astype(np.float64) - want).max()) / max(1.0, float(np.abs(want).max()))
                            for x in (got, own))
            assert err <= TOLERANCE, f"{out}, {where}: {err:.2e}"
            assert err <= FP16_ERROR_FACTOR * own_err, f"{out}, {where}: {err:.2e} against the export's {own_err:.2e}"
