"""Issue 33, item 3: onnxfuse's own failures are an internal error, exit 5 (:class:`onnxfuse.InternalError`),
never "user or model error" (exit 1)."""

from __future__ import annotations

from click.testing import CliRunner

import onnxfuse
from helpers import TESTDATA
from onnxfuse.cli import main

MODEL = TESTDATA / "conv_bn_relu.onnx"


def test_an_unexpected_exception_is_an_internal_error_exit_5(tmp_path, monkeypatch):
    def broken(*_args, **_kwargs):
        raise ZeroDivisionError("float division by zero\nsecond line")

    monkeypatch.setattr("onnxfuse.api.optimize", broken)
    r = CliRunner().invoke(main, ["optimize", str(MODEL), str(tmp_path / "o.onnx"), "--no-bench"])
    assert r.exit_code == 5
    assert r.stderr.strip() == ("error: internal error (ZeroDivisionError: float division by zero); rerun with "
                                "ONNXFUSE_DEBUG=1 for a traceback and please report it")


def test_exit_5_is_documented():
    r = CliRunner().invoke(main, ["optimize", "--help"])
    assert "5  internal error: onnxfuse wrote a model ONNX Runtime cannot load" in r.output
    assert onnxfuse.InternalError.exit_code == 5
    assert 5 in onnxfuse.reports.load_schema()["properties"]["exit_code"]["enum"]
