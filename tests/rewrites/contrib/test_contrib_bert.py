"""A real model: tiny BERT (testdata/bert_tiny_opset14.onnx, made by testdata/export_transformers.py).

Every decomposed GELU and LayerNorm must become a contrib op (LayerNorm: SkipLayerNormalization after a
residual Add; a plain LayerNormalization needs opset ≥ 17, so the opset-14 file keeps its embedding
LayerNorm decomposed and the same model converted to opset 17 covers that), and outputs must match the
original within 1e-4 relative on ONNX Runtime CPU.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from contrib_testlib import fuse, ops

import helpers
from onnxfuse.rewrites import RULES

CONTRIB_RULES = [r for r in RULES if r.name.startswith("contrib-")]


@pytest.fixture(scope="module")
def bert14():
    return helpers.load_testdata("bert_tiny_opset14.onnx")


def _feeds(batch=3, seq=7):
    rng = np.random.default_rng(0)
    mask = np.ones((batch, seq), np.int64)
    mask[0, -2:] = 0
    return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask}


def _compare(original, optimized):
    feeds = _feeds()
    want, got = helpers.run_ort(original, feeds), helpers.run_ort(optimized, feeds)
    for name, a in want.items():
        np.testing.assert_allclose(got[name], a, rtol=1e-4, atol=1e-5, err_msg=name)


def _decomposed(model):
    c = Counter(n.op_type for n in model.graph.node)
    return {"Erf": c["Erf"], "ReduceMean": c["ReduceMean"], "Sqrt": c["Sqrt"]}


def test_bert_opset14(bert14):
    assert _decomposed(bert14) == {"Erf": 2, "ReduceMean": 10, "Sqrt": 5}
    out, report = fuse(bert14, *CONTRIB_RULES)
    counts = ops(out)
    assert counts["com.microsoft:BiasGelu"] == 2 and counts["Erf"] == 0
    assert counts["com.microsoft:SkipLayerNormalization"] == 4
    # the embedding LayerNorm: its Add broadcasts (position embeddings), so no SkipLayerNorm; it becomes
    # ONNX LayerNormalization, the model's opset raised 14 → 17 (no op in it changes meaning)
    assert _decomposed(out) == {"Erf": 0, "ReduceMean": 0, "Sqrt": 0}
    assert counts["LayerNormalization"] == 1
    assert {o.domain: o.version for o in out.opset_import}[""] == 17
    assert counts["com.microsoft:FusedMatMul"] == 2  # attention scores · 1/√d
    _compare(bert14, out)


def test_bert_opset17_all_layernorms(bert14):
    m17 = onnx.version_converter.convert_version(bert14, 17)
    out, report = fuse(m17, *CONTRIB_RULES)
    counts = ops(out)
    assert _decomposed(out) == {"Erf": 0, "ReduceMean": 0, "Sqrt": 0}
    assert counts["com.microsoft:BiasGelu"] == 2
    assert counts["LayerNormalization"] + counts["com.microsoft:SkipLayerNormalization"] == 5
    _compare(m17, out)
