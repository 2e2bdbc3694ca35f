"""A stdout that cannot encode UTF-8 (``PYTHONIOENCODING=ascii``, a C locale in a CI container) changes
neither the exit code nor the files (issue 29: on 93e2115 optimize wrote the model and a report saying
``ok: true``, then died on the "→" of its last line and exited 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import onnx
from onnx import TensorProto, helper


def _model(path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def _optimize(tmp_path, encoding, name):
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    out = tmp_path / f"{name}.onnx"
    report = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(tmp_path / "in.onnx"), str(out),
                           "--explain-all", "--json", str(report), "--no-bench"],
                          env=env, capture_output=True, timeout=300)
    return proc, out, report


def test_ascii_stdout_gives_the_same_exit_code_and_files(tmp_path):
    _model(tmp_path / "in.onnx")
    utf8, out8, rep8 = _optimize(tmp_path, "utf-8", "utf8")
    ascii_, outa, repa = _optimize(tmp_path, "ascii", "ascii")
    assert utf8.returncode == 0, utf8.stderr.decode()
    assert "→".encode() in utf8.stdout  # the line that used to crash is there in UTF-8 ...
    assert ascii_.returncode == 0, ascii_.stderr.decode()
    ascii_.stdout.decode("ascii")  # ... and plain ASCII here
    assert b"->" in ascii_.stdout
    assert b"UnicodeEncodeError" not in ascii_.stderr
    assert out8.read_bytes() == outa.read_bytes()
    assert json.loads(repa.read_text())["ok"] is True
