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
