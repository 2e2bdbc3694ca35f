"""Validation that cannot be switched off by accident: nan/negative tolerances, bad seeds, unknown
names and --shape beside --inputs are usage errors (exit 2, one line); integer outputs compare
exactly (through float64, 2**60 + 1 equals 2**60)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from onnxfuse.cli import main
from onnxfuse.runtime.compare import compare_arrays

from helpers import TESTDATA

MODEL = str(TESTDATA / "conv_bn_relu.onnx")


def test_int64_outputs_compare_exactly():
    ref = np.array([2**60, 5], np.int64)
    got = np.array([2**60 + 1, 5], np.int64)
    assert not compare_arrays("y", ref, got).passed
    assert compare_arrays("y", ref, ref.copy()).passed
    assert not compare_arrays("b", np.array([True, False]), np.array([True, True])).passed


@pytest.mark.parametrize("args", [["--rtol", "nan"], ["--atol", "nan", "--rtol", "nan"], ["--rtol", "-1"],
                                  ["--atol", "inf"], ["--seed", "-1"], ["--shape", "nope:1,2"]])
@pytest.mark.parametrize("command", ["optimize", "diff"])
def test_bad_numbers_and_names_are_usage_errors(tmp_path, args, command):
    second = str(tmp_path / "o.onnx") if command == "optimize" else MODEL
    extra = ["--no-bench"] if command == "optimize" else []
    res = CliRunner().invoke(main, [command, MODEL, second, *extra, *args], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.onnx").exists()


def test_shape_beside_inputs_is_refused_not_ignored(tmp_path):
    feeds = tmp_path / "in.npz"
    model = onnx.load(MODEL)
    shape = [d.dim_value or 1 for d in model.graph.input[0].type.tensor_type.shape.dim]
    np.savez(feeds, **{model.graph.input[0].name: np.zeros(shape, np.float32)})
    res = CliRunner().invoke(main, ["optimize", MODEL, str(tmp_path / "o.onnx"), "--no-bench", "--inputs", str(feeds),
                                    "--shape", f"{model.graph.input[0].name}:{','.join(map(str, shape))}"],
                             catch_exceptions=False)
    assert res.exit_code == 2 and "--inputs" in res.stderr
