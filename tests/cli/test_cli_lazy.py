"""`onnxfuse optimize` holds models lazily from ``lazy_weights.CLI_LAZY_MODEL_BYTES`` of weights (issue 35
item 8: BERT-base went from 21 s to 3 s, docs/benchmarks.md 5.23): the same output bytes and report as
the in-memory path, the API's threshold restored afterwards, and never with ``--precision fp16``."""

from __future__ import annotations

import json

from click.testing import CliRunner

import large_models as lm
from onnxfuse.cli import main


def _run(src, out, report, *extra):
    return CliRunner().invoke(main, ["optimize", str(src), str(out), "--provider", "cpu", "--no-bench", "--quiet",
                                     "--json", str(report), *extra], catch_exceptions=False)


def _without_timings(report: dict) -> dict:
    return {**report, "result": {k: v for k, v in report["result"].items() if k != "timings"}}


def test_lazy_and_in_memory_write_the_same_bytes_and_report(tmp_path, monkeypatch):
    from onnxfuse import lazy_weights as lw
    from onnxfuse import model_io

    src = tmp_path / "in.onnx"
    weights = lm.build(src, layers=2, inline=True)  # 2 × 1.6 MB MatMul weights inline, BatchNorms to fold
    held_lazily = []
    load = model_io.load_model

    def spy(path, check=True):
        model = load(path, check)
        held_lazily.append(lw.has_lazy(model))
        return model

    monkeypatch.setattr(model_io, "load_model", spy)
    out, report = tmp_path / "out.onnx", tmp_path / "report.json"
    seen = {}
    for threshold in (weights, weights + 1):  # at the threshold: lazy; one byte under it: in memory
        monkeypatch.setattr(lw, "CLI_LAZY_MODEL_BYTES", threshold)
        result = _run(src, out, report)
        assert result.exit_code == 0, result.output
        seen[threshold] = (out.read_bytes(), _without_timings(json.loads(report.read_text())))
        assert lw.LAZY_MODEL_BYTES == 1 << 30  # the API's threshold, restored
    assert held_lazily == [True, False]
    assert seen[weights] == seen[weights + 1]
    assert seen[weights][1]["result"]["nodes"]["after"] < seen[weights][1]["result"]["nodes"]["before"]


def test_precision_fp16_is_held_in_memory(tmp_path, monkeypatch):
    """``--precision fp16`` converts weights held in memory only: the CLI threshold does not apply."""
    from onnxfuse import lazy_weights as lw

    src = tmp_path / "in.onnx"
    lm.build(src, layers=1, inline=True)
    monkeypatch.setattr(lw, "CLI_LAZY_MODEL_BYTES", 0)
    result = _run(src, tmp_path / "out.onnx", tmp_path / "report.json", "--precision", "fp16")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "report.json").read_text())["result"]["precision"]["precision"] == "fp16"
