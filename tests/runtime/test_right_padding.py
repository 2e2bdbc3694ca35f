"""``--right-padded NAME``: random inputs keep the promise (every row n >= 1 ones, then zeros, with
varied n), given inputs are held to it with one line naming the row that breaks it, and bad names are
usage errors (exit 2) in optimize and diff alike."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from onnxfuse.cli import main
from onnxfuse.errors import InputsError, UsageError
from onnxfuse.runtime.inputs import input_specs, make_samples
from onnxfuse.runtime.right_padding import RightPadded, check_given, first_break

from helpers import load_testdata

MODEL = "distilbert_tiny_opset14"


def is_prefix_rows(a: np.ndarray) -> bool:
    """An independent check: each row's nonzeros are exactly its first count(nonzero) entries, count >= 1."""
    rows = a.reshape(-1, a.shape[-1]) != 0
    return all(r.sum() >= 1 and r[: r.sum()].all() and not r[r.sum():].any() for r in rows)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_, np.float32])
def test_draws_are_right_padded_rows_with_varied_lengths(dtype):
    rng = np.random.default_rng(0)
    a = RightPadded().draw(rng, np.dtype(dtype), [4, 3, 50])
    assert a.dtype == np.dtype(dtype) and a.shape == (4, 3, 50)
    assert is_prefix_rows(a)
    counts = (a != 0).sum(axis=-1).ravel()
    assert len(set(counts.tolist())) > 3 and counts.min() >= 1 and counts.max() <= 50


@pytest.mark.parametrize("row, broken", [
    ([1, 1, 0, 0], False),
    ([1, 1, 1, 1], False),
    ([2, 7, 0, 0], False),  # kernels keep a key wherever the mask is nonzero
    ([0, 0, 1, 1], True),  # left padding
    ([1, 0, 1, 0], True),  # a hole
    ([0, 0, 0, 0], True),  # nothing kept: no tokenizer writes it
])
def test_first_break_finds_the_row_that_breaks_the_promise(row, broken):
    a = np.array([[1, 1, 1, 0], row, [1, 0, 0, 0]])
    assert first_break(a) == ((1,) if broken else None)


def test_make_samples_draws_the_promised_input_and_notes_it():
    model = load_testdata(MODEL)
    samples = make_samples(model, {"input_ids": [5, 16]}, seed=4, count=3, right_padded=["attention_mask"])
    for s in samples:
        assert is_prefix_rows(s.feeds["attention_mask"])
    assert any("right-padded" in n for n in samples[0].notes)
    plain = make_samples(model, {"input_ids": [5, 16]}, seed=4)
    assert not is_prefix_rows(plain[0].feeds["attention_mask"])  # fair 0/1 draws without the promise


def test_given_inputs_must_keep_the_promise():
    model = load_testdata(MODEL)
    spec = {s.name: s for s in input_specs(model)}
    ids = np.zeros((2, 8), spec["input_ids"].dtype)
    good = {"input_ids": ids, "attention_mask": np.array([[1] * 8, [1] * 3 + [0] * 5], spec["attention_mask"].dtype)}
    make_samples(model, given=good, right_padded=["attention_mask"])
    bad = dict(good, attention_mask=good["attention_mask"][:, ::-1].copy())
    with pytest.raises(InputsError, match=r"--right-padded attention_mask: sample 0, row \[1\]"):
        make_samples(model, given=bad, right_padded=["attention_mask"])
    check_given([], ["attention_mask"])  # no samples: nothing to hold


def test_unknown_name_and_clash_with_input_range_are_usage_errors():
    from onnxfuse.runtime.input_ranges import ValueRange

    model = load_testdata(MODEL)
    with pytest.raises(UsageError, match="unknown input 'mask'"):
        make_samples(model, right_padded=["mask"])
    with pytest.raises(UsageError, match="both name attention_mask"):
        make_samples(model, ranges={"attention_mask": ValueRange(0, 1, "--input-range")}, right_padded=["attention_mask"])


def test_cli_optimize_and_diff(tmp_path):
    src = tmp_path / "m.onnx"
    src.write_bytes(load_testdata(MODEL).SerializeToString())
    out = tmp_path / "m.opt.onnx"
    runner = CliRunner()
    bad = runner.invoke(main, ["optimize", str(src), str(out), "--right-padded", "nope", "--no-bench", "-q"])
    assert bad.exit_code == 2 and "unknown input 'nope'" in bad.output and not out.exists()
    ok = runner.invoke(main, ["optimize", str(src), str(out), "--right-padded", "attention_mask", "--no-bench",
                              "--json", str(tmp_path / "r.json"), "-q"])
    assert ok.exit_code == 0, ok.output
    import json

    document = json.loads((tmp_path / "r.json").read_text())
    jsonschema = pytest.importorskip("jsonschema")
    from onnxfuse.reports import load_schema

    jsonschema.validate(document, load_schema(), cls=jsonschema.Draft202012Validator)
    report = document["result"]
    assert report["assumptions"] == {"right_padded": ["attention_mask"]}
    assert report["rewrites"]["counts"]["contrib-mask-lengths"] == 2
    promised = runner.invoke(main, ["diff", str(src), str(out), "--right-padded", "attention_mask", "-q",
                                    "--shape", "input_ids:4,16"])
    assert promised.exit_code == 0, promised.output
    broken = runner.invoke(main, ["diff", str(src), str(out), "-q", "--shape", "input_ids:4,16"])
    assert broken.exit_code == 3  # random 0/1 masks break the promise the model was optimized under
