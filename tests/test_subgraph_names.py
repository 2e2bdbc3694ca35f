"""Subgraphs that reuse tensor names: optimum's merged T5 decoder (testdata/optimum_t5_decoder_merged.onnx,
testdata/export_optimum.py --t5) holds its first-step and with-past decoders as the two branches of an
``If``, and both branches write tensors of the same names. ONNX's data propagation keys shape values by
name across subgraphs, so with it one branch's values were declared on the other's tensors and ONNX
Runtime refused the optimized model ("Incompatible dimensions") even with no rule applied: exit 5.
``model_io`` now infers such models without data propagation."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxfuse
from helpers import load_testdata
from onnxfuse import model_io
from onnxfuse.custom_ops import session_options

MERGED = "optimum_t5_decoder_merged"


def test_names_written_by_two_graphs_are_found():
    assert model_io.names_defined_twice(load_testdata(MERGED).graph)
    assert not model_io.names_defined_twice(load_testdata("optimum_t5_decoder_with_past").graph)


def test_the_inferred_merged_decoder_still_loads():
    inferred = model_io.infer_shapes(load_testdata(MERGED))
    ort.InferenceSession(inferred.SerializeToString(), providers=["CPUExecutionProvider"])


def _feeds(use_cache: bool, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    batch, encoded, new, past = 2, 5, 1 if use_cache else 3, 4
    mask = np.ones((batch, encoded), np.int64)
    mask[1, 3:] = 0  # a padded encoder row
    feeds = {"encoder_attention_mask": mask,
             "input_ids": rng.integers(0, 128, (batch, new)).astype(np.int64),
             "encoder_hidden_states": rng.standard_normal((batch, encoded, 64)).astype(np.float32),
             "use_cache_branch": np.array([use_cache])}
    for layer in (0, 1):
        for kind, length in (("decoder", past), ("encoder", encoded)):
            for part in ("key", "value"):
                feeds[f"past_key_values.{layer}.{kind}.{part}"] = rng.standard_normal(
                    (batch, 4, length, 16)).astype(np.float32)
    return feeds


def both_runs(model, optimized, feeds, provider="CPUExecutionProvider"):
    """The original's and the optimized model's outputs on ``feeds`` (our custom ops registered for the
    second), on ONNX Runtime's ``provider``."""
    want = ort.InferenceSession(model.SerializeToString(), providers=[provider]).run(None, feeds)
    got = ort.InferenceSession(optimized.SerializeToString(), session_options(), providers=[provider]).run(None, feeds)
    return want, got


@pytest.mark.parametrize("use_cache", [False, True])
def test_the_merged_decoder_optimizes_and_both_branches_stay_equal(use_cache):
    model = load_testdata(MERGED)
    result = onnxfuse.optimize(model, bench=False)
    assert result.validation.passed and result.applied.counts.get("fuse-elementwise", 0) > 0
    want, got = both_runs(model, result.model, _feeds(use_cache))
    for a, b in zip(want, got):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("use_cache", [False, True])
def test_the_merged_decoder_converts_to_float16_branch_by_branch(use_cache):
    """--precision fp16: the two branches give some names different types (an int64 in one, a float in the
    other), so the conversion types each graph by its own scope (precision.float32_scopes); it used to cast
    an int64 Range input to float16 in one branch and write a model ONNX Runtime refused. Both branches
    match the float32 original within float16's rounding."""
    model = load_testdata(MERGED)
    result = onnxfuse.optimize(model, bench=False, precision="fp16")
    assert result.validation.passed
    want, got = both_runs(model, result.model, _feeds(use_cache))
    for a, b in zip(want, got):
        assert a.shape == b.shape and b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=2e-2, atol=2e-2 * max(1.0, float(np.abs(a).max(initial=0.0))))
