"""The realistic validation sample of token models (onnxfuse/runtime/realistic.py, issue 35): three rows at
the longest of 128, 64, 32, 16 tokens the original runs at, masks with a full, a right-padded and a
left-padded row; none for KV-cache decoders, static sequences, or a user's --shape."""

from __future__ import annotations

import numpy as np

import onnxfuse
from helpers import load_testdata
from onnxfuse.runtime.realistic import realistic_sample


def _realistic(result):
    return [n for n in result.validation.notes if n.startswith("a realistic sample")]


def test_bert_is_validated_at_its_position_tables_length_with_padded_rows():
    model = load_testdata("bert_tiny_sdpa_opset14")  # 64 positions: 128 cannot run, 64 can
    result = onnxfuse.optimize(model, provider="cpu", samples=1)
    assert result.validation.passed
    assert _realistic(result) == ["a realistic sample: input_ids 3x64 tokens, attention_mask with a full, a "
                                  "right-padded and a left-padded row"]
    sample = realistic_sample(model, 64, seed=0)
    mask = sample.feeds["attention_mask"]
    assert mask.shape == (3, 64) and mask[0].all()
    assert mask[1, :48].all() and not mask[1, 48:].any()  # right-padded: the last quarter dropped
    assert not mask[2, :16].any() and mask[2, 16:].all()  # left-padded: the first quarter dropped
    ids = sample.feeds["input_ids"]
    assert ids.shape == (3, 64) and ids.min() >= 0 and ids.max() <= 999


def test_right_padded_promise_keeps_every_row_right_padded():
    model = load_testdata("bert_tiny_sdpa_opset14")
    mask = realistic_sample(model, 32, seed=0, right_padded=["attention_mask"]).feeds["attention_mask"]
    for row in mask:  # ones, then zeros
        ones = int(row.sum())
        assert row[:ones].all() and not row[ones:].any()
    assert int(mask[2].sum()) == 16


def test_no_realistic_sample_without_token_inputs_for_decoders_or_given_sizes():
    assert realistic_sample(load_testdata("conv_bn_relu"), 128, seed=0) is None  # no token input
    bert = load_testdata("bert_tiny_sdpa_opset14")
    assert realistic_sample(bert, 128, seed=0, shapes={"input_ids": [2, 5], "attention_mask": [2, 5]}) is None
    decoder = onnxfuse.optimize(load_testdata("llama_kv_opset17"), provider="cpu", samples=1)
    assert not _realistic(decoder)  # its prefill and decode samples come from the dimension relations
    given = onnxfuse.optimize(bert, provider="cpu", samples=1, shapes={"input_ids": [2, 6], "attention_mask": [2, 6]})
    assert not _realistic(given)


def test_the_realistic_sample_is_among_those_validated(tmp_path):
    """--save-inputs writes every sample validation ran: the realistic one is there, padded."""
    saved = tmp_path / "samples.npz"
    result = onnxfuse.optimize(load_testdata("gpt2_tiny_sdpa_opset17"), provider="cpu", samples=1,
                               save_inputs=str(saved))
    assert result.validation.passed and _realistic(result)
    arrays = dict(np.load(saved))
    masks = [v for k, v in arrays.items() if k.endswith("attention_mask") and v.shape == (3, 64)]
    assert len(masks) == 1 and masks[0][0].all() and not masks[0][2, :16].any()
