"""Usage errors are one line on stderr with exit 2, like every other error (click prints four)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import TESTDATA

MODEL = str(TESTDATA / "conv_bn_relu.onnx")


@pytest.mark.parametrize("args", [["optimize", MODEL, "o.onnx", "--target", "tpu"], ["optimize", MODEL],
                                  ["optimize", "--bogus"], ["diff", MODEL], ["nonsense"]])
def test_usage_errors_are_one_line(tmp_path, args):
    r = subprocess.run([sys.executable, "-m", "onnxfuse", *args], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--help" in lines[0], r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("args, code, error", [
    # --shape is read before the output path is checked, --input-range after (where the API is called)
    (["--shape", "a:-1"], 2, "error: --shape 'a:-1': dimensions must be non-negative"),
    (["--input-range", "x:5,1"], 1, "output is the same file as the input"),
    (["--seed", "-1", "--samples", "0", "--force"], 2, "error: --seed -1: the seed must be an integer >= 0"),
    (["--samples", "0", "--no-bench", "--fail-on-slowdown", "1", "--force"], 2,
     "error: fail_on_slowdown needs the models timed"),
])
def test_of_several_mistakes_the_first_checked_is_reported(tmp_path, args, code, error):
    """Which of several mistakes a command line reports, and so its exit code, does not depend on where its
    options are declared (onnxfuse/options.py: the API checks them in the declarations' order)."""
    model = tmp_path / "m.onnx"
    model.write_bytes(open(MODEL, "rb").read())
    r = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(model), str(model), "--provider", "cpu",
                        "-q", *args], cwd=tmp_path, capture_output=True, text=True)
    assert (r.returncode, len(r.stderr.strip().splitlines())) == (code, 1), r.stderr
    assert error in r.stderr
