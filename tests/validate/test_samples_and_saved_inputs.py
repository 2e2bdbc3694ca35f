"""optimize validates on several seeded samples (default 2) plus the second size; --save-inputs writes
them all to one .npz that --inputs replays exactly (several samples in one file)."""

from __future__ import annotations

import numpy as np
import onnx
from click.testing import CliRunner

import onnxfuse
from helpers import TESTDATA
from onnxfuse.cli import main
from onnxfuse.runtime.inputs import input_specs, load_npz_samples

MODEL = TESTDATA / "conv_bn_relu.onnx"


def test_saved_inputs_hold_every_sample_and_replay_exactly(tmp_path):
    saved = tmp_path / "inputs.npz"
    first = onnxfuse.optimize(onnx.load(MODEL), target="onnx", samples=3, save_inputs=saved)
    specs = input_specs(onnx.load(MODEL))
    samples = load_npz_samples(specs, saved)
    assert len(samples) == 4  # three seeded draws and the second size
    assert samples[0].feeds[specs[0].name].shape != samples[3].feeds[specs[0].name].shape
    assert not np.array_equal(samples[0].feeds[specs[0].name], samples[1].feeds[specs[0].name])
    again = onnxfuse.optimize(onnx.load(MODEL), target="onnx", inputs=saved)
    assert [c.max_abs for c in again.validation.outputs] == [c.max_abs for c in first.validation.outputs]


def test_cli_samples_option(tmp_path):
    saved = tmp_path / "in.npz"
    res = CliRunner().invoke(main, ["optimize", str(MODEL), str(tmp_path / "o.onnx"), "--no-bench", "--samples", "1",
                                    "--save-inputs", str(saved)], catch_exceptions=False)
    assert res.exit_code == 0
    assert len(load_npz_samples(input_specs(onnx.load(MODEL)), saved)) == 2
    bad = CliRunner().invoke(main, ["optimize", str(MODEL), str(tmp_path / "p.onnx"), "--samples", "0"],
                             catch_exceptions=False)
    assert bad.exit_code == 2
