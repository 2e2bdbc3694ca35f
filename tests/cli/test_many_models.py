"""`onnxfuse optimize a.onnx b.onnx ... --out-dir DIR` (issue 35, item 5): every model's output equals a
one-model run's byte for byte, one report covers them all (valid against the schema), a failing model
does not stop the others, the exit code is the worst of theirs (2 > 5 > 3 > 4 > 1 > 0), and the console fits
80 columns in a pipe."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from helpers import TESTDATA, BreakConvWeights, conv_bn_model
from onnxfuse.cli import main
from onnxfuse.errors import worst_exit_code
from onnxfuse.reports import load_schema
from onnxfuse.rewrites import RULES

jsonschema = pytest.importorskip("jsonschema")

GOOD = ("conv_bn_relu.onnx", "bert_tiny_opset14.onnx")
BAD = "bad_unknown_op.onnx"


def run(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(result, *needles):
    """The one error line, after the progress lines (``[k/n] ...``)."""
    err = [line for line in result.stderr.strip().splitlines() if not line.startswith("[")]
    assert "Traceback" not in result.output + result.stderr
    assert len(err) == 1 and err[0].startswith("error:"), result.stderr
    for needle in needles:
        assert needle in err[0], (needle, err[0])


@pytest.fixture
def models(tmp_path):
    """Two good models and the invalid one, in a folder of their own."""
    folder = tmp_path / "models"
    folder.mkdir()
    for name in (*GOOD, BAD):
        shutil.copy(TESTDATA / name, folder / name)
    return folder


def validate(doc):
    jsonschema.validate(doc, load_schema(), cls=jsonschema.Draft202012Validator)
    return doc


def test_outputs_equal_one_model_runs_byte_for_byte(models, tmp_path):
    out = tmp_path / "out"
    result = run(["optimize", *(models / n for n in GOOD), "--out-dir", out, "--json", tmp_path / "r.json"])
    assert result.exit_code == 0, result.output + result.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(GOOD)
    for name in GOOD:
        single = tmp_path / f"single_{name}"
        assert run(["optimize", models / name, single, "--quiet"]).exit_code == 0
        assert (out / name).read_bytes() == single.read_bytes(), name
    doc = validate(json.loads((tmp_path / "r.json").read_text()))
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["error"] is None
    body = doc["result"]
    assert [m["input"] for m in body["models"]] == [str(models / n) for n in GOOD]
    assert [m["output"] for m in body["models"]] == [str(out / n) for n in GOOD]
    assert body["summary"] == {**body["summary"], "models": 2, "ok": 2, "failed": 0, "exit_code": 0}
    assert body["models"][0]["result"]["nodes"] == {"before": 12, "after": 8}
    assert body["models"][1]["result"]["nodes"] == {"before": 332, "after": 37}  # 39 before its two Casts to their own type went (cancel-cast-roundtrip)


def test_a_bad_model_does_not_stop_the_others_and_sets_the_exit_code(models, tmp_path):
    out, report = tmp_path / "out", tmp_path / "r.json"
    junit, markdown = tmp_path / "r.xml", tmp_path / "r.md"
    result = run(["optimize", models, "--out-dir", out, "--json", report, "--junit", junit, "--markdown", markdown])
    assert result.exit_code == 1
    one_line_error(result, "1 of 3 models failed", BAD)
    # the folder expands in sorted order; the good models are written
    assert sorted(p.name for p in out.iterdir()) == sorted(GOOD)
    doc = validate(json.loads(report.read_text()))
    assert doc["ok"] is False and doc["exit_code"] == 1 and doc["error"].startswith("1 of 3 models failed")
    entries = doc["result"]["models"]
    assert [Path(m["input"]).name for m in entries] == sorted((*GOOD, BAD))
    assert [m["exit_code"] for m in entries] == [1, 0, 0]
    assert entries[0]["output"] is None and entries[0]["result"] is None and "Frobnicate" in entries[0]["error"]
    assert doc["result"]["summary"] == {**doc["result"]["summary"], "models": 3, "ok": 2, "failed": 1, "exit_code": 1}
    # JUnit: one testsuite per model, the bad one an error
    suites = ET.parse(junit).getroot().findall("testsuite")
    assert [s.get("name") for s in suites] == [f"onnxfuse.optimize.{n}" for n in sorted((*GOOD, BAD))]
    assert [s.get("errors") for s in suites] == ["1", "0", "0"]
    assert ET.parse(junit).getroot().get("errors") == "1"
    # Markdown: a summary table, then one section per model
    text = markdown.read_text()
    assert text.startswith("## onnxfuse optimize: 3 models, ❌ 1 failed (exit 1)")
    for name in (*GOOD, BAD):
        assert f"## `{name}`: " in text
    assert "| `conv_bn_relu.onnx` | 12 → 8 | ✅ ok |" in text


def test_exit_code_is_the_worst_validation_beats_a_bad_file(tmp_path, monkeypatch):
    monkeypatch.setattr("onnxfuse.rewrites.RULES", RULES + [BreakConvWeights()])
    folder = tmp_path / "models"
    folder.mkdir()
    onnx.save(conv_bn_model(), folder / "conv.onnx")  # its Conv weights doubled: validation fails (3)
    for name in ("bert_tiny_opset14.onnx", BAD):
        shutil.copy(TESTDATA / name, folder / name)
    report = tmp_path / "r.json"
    result = run(["optimize", folder, "--out-dir", tmp_path / "out", "--json", report])
    assert result.exit_code == 3
    doc = validate(json.loads(report.read_text()))
    codes = {Path(m["input"]).name: m["exit_code"] for m in doc["result"]["models"]}
    assert codes == {BAD: 1, "bert_tiny_opset14.onnx": 0, "conv.onnx": 3}
    conv = next(m for m in doc["result"]["models"] if m["exit_code"] == 3)
    assert conv["output"] is None and conv["result"]["culprit"] == "test-break-conv"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bert_tiny_opset14.onnx"]


def test_a_usage_error_of_one_model_is_the_worst(models, tmp_path):
    # --shape names conv_bn_relu's input: the BERT model has no such input (a usage error, exit 2)
    result = run(["optimize", models / GOOD[0], models / GOOD[1], models / BAD, "--out-dir", tmp_path / "out",
                  "--shape", "input:1,8,16,16"])
    assert result.exit_code == 2
    assert (tmp_path / "out" / GOOD[0]).exists()


def test_worst_exit_code_order():
    assert worst_exit_code([]) == 0
    assert worst_exit_code([0, 0]) == 0
    assert worst_exit_code([0, 1, 0]) == 1
    assert worst_exit_code([1, 4]) == 4
    assert worst_exit_code([4, 3, 1]) == 3
    assert worst_exit_code([3, 2, 4]) == 2
    assert worst_exit_code([3, 5, 1]) == 5 and worst_exit_code([5, 2]) == 2
    assert worst_exit_code([2, 130]) == 130


def test_glob_pattern_and_duplicates(models, tmp_path):
    out = tmp_path / "out"
    pattern = str(models / "*_opset14.onnx")
    result = run(["optimize", pattern, models / "bert_tiny_opset14.onnx", models / "conv_bn_relu.onnx",
                  "--out-dir", out, "--json", tmp_path / "r.json", "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert result.output == "" and result.stderr == ""
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [Path(m["input"]).name for m in doc["result"]["models"]] == ["bert_tiny_opset14.onnx", "conv_bn_relu.onnx"]


@pytest.mark.parametrize("case", ["two-args-no-out-dir", "three-args", "clash", "own-folder", "save-inputs",
                                  "explain", "empty-folder", "no-match"])
def test_refused_in_one_line_exit_2_nothing_written(models, tmp_path, case):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(TESTDATA / "conv_bn_relu.onnx", other / "conv_bn_relu.onnx")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    args, needle = {
        "two-args-no-out-dir": ([models / GOOD[0]], "expected INPUT OUTPUT, got 1 path"),
        "three-args": ([models / GOOD[0], models / GOOD[1], tmp_path / "x.onnx"], "--out-dir DIR"),
        "clash": ([models / GOOD[0], other / GOOD[0], "--out-dir", out], "would both be written to"),
        "own-folder": ([models / GOOD[0], "--out-dir", models], "would overwrite its input"),
        "save-inputs": ([models / GOOD[0], "--out-dir", out, "--save-inputs", tmp_path / "s.npz"], "--save-inputs"),
        "explain": ([models / GOOD[0], "--out-dir", out, "--explain"], "--explain"),
        "empty-folder": ([empty, "--out-dir", out], "holds no .onnx file"),
        "no-match": ([str(tmp_path / "nothing*.onnx"), "--out-dir", out], "matches no file"),
    }[case]
    before = {p: p.read_bytes() for p in models.iterdir()}
    result = run(["optimize", *args])
    assert result.exit_code == 2, result.stderr
    one_line_error(result, needle)
    assert not out.exists() and not (tmp_path / "x.onnx").exists()
    assert {p: p.read_bytes() for p in models.iterdir()} == before


def test_force_allows_the_inputs_own_folder(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(TESTDATA / "conv_bn_relu.onnx", folder / "conv_bn_relu.onnx")
    single = tmp_path / "single.onnx"
    assert run(["optimize", TESTDATA / "conv_bn_relu.onnx", single, "--quiet"]).exit_code == 0
    assert run(["optimize", folder, "--out-dir", folder, "--force", "--quiet"]).exit_code == 0
    assert (folder / "conv_bn_relu.onnx").read_bytes() == single.read_bytes()


def test_piped_output_fits_80_columns_with_a_line_per_model(models, tmp_path):
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(models), "--out-dir", str(tmp_path / "o")],
                          capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 1
    err = proc.stderr.splitlines()
    assert err[-1].startswith("error: 1 of 3 models failed")  # the one error line, whole
    progress = [line for line in err[:-1] if line.startswith("[")]
    assert [line.split(" ... ")[0] for line in progress if " ... " in line] == \
        ["[1/3] bad_unknown_op.onnx", "[2/3] bert_tiny_opset14.onnx", "[3/3] conv_bn_relu.onnx"]
    verdicts = [line.split(" ... ")[1].rsplit(" (", 1)[0] for line in progress if " ... " in line]
    assert verdicts[0] == "error, exit 1"
    assert all(v == "ok, no GPU" or v.startswith("ok, ") and v.endswith("×") for v in verdicts[1:]), verdicts
    lines = proc.stdout.splitlines() + err[:-1]
    assert lines and max(len(line) for line in lines) <= 80, max(lines, key=len)
    table = proc.stdout
    assert "conv_bn_relu" in table and "12 → 8" in table and "bad_unknown_op" in table
    assert "2 of 3 ok; exit code 1 (the worst)" in table


def test_api_optimize_many_returns_every_outcome(models, tmp_path):
    import onnxfuse

    batch = onnxfuse.api.optimize_many([models], tmp_path / "out", target="onnx")
    assert [(r.name, r.exit_code) for r in batch.runs] == [(BAD, 1), ("bert_tiny_opset14.onnx", 0),
                                                            ("conv_bn_relu.onnx", 0)]
    assert batch.exit_code == 1 and batch.runs[2].result.ops_after == {"Conv": 4, "Relu": 4}
    with pytest.raises(onnxfuse.errors.ModelsFailed) as info:
        batch.raise_for_failure()
    assert info.value.exit_code == 1 and info.value.report is batch
    validate(batch.to_json())


def test_long_words_fold_at_a_slash_when_asked():
    from onnxfuse.cli.layout import wrap_prose

    text = "cannot load /very/long/folder/name/that/goes/on/model.onnx: bad"
    assert wrap_prose(text, 20) == ["cannot load", "/very/long/folder/name/that/goes/on/model.onnx:", "bad"]
    assert wrap_prose(text, 20, fold=True) == ["cannot load", "/very/long/folder", "/name/that/goes/on", "/model.onnx:", "bad"]


def test_unfused_patterns_and_dropped_rules_are_said_per_model(tmp_path, monkeypatch):
    from test_rule_isolation import RaisingRule

    models = [TESTDATA / "llama_kv_opset14.onnx", TESTDATA / "conv_bn_relu.onnx"]
    # without repeat-heads-gather the float32 cache is not read as one (policy.cache_key): left, as measured
    result = run(["optimize", *models, "--out-dir", tmp_path / "out", "--no-bench", "--skip", "repeat-heads-gather"])
    assert result.exit_code == 0, result.stderr
    assert "not fused: llama_kv_opset14.onnx: 2 Softmax left by contrib-attention" in result.output
    assert "not fused: conv_bn_relu" not in result.output

    monkeypatch.setattr("onnxfuse.rewrites.RULES", [*RULES, RaisingRule()])  # raises on a Relu
    shutil.copy(TESTDATA / "conv_bn_relu.onnx", tmp_path / "second.onnx")
    result = run(["optimize", TESTDATA / "conv_bn_relu.onnx", tmp_path / "second.onnx", "--out-dir",
                  tmp_path / "out2", "--target", "onnx", "--no-bench"])
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert [w.split(" was dropped")[0] for w in warnings] == ["warning: conv_bn_relu.onnx: rule test-raises",
                                                               "warning: second.onnx: rule test-raises"]
