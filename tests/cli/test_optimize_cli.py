"""CLI tests for `onnxfuse optimize`: every exit code and every bad input the foundation promises.

Each bad input must give exit 1 (2 for usage errors), one line on stderr naming the file and the
problem, no traceback, the input unchanged and no output left behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

from helpers import BreakConvWeights, conv_bn_model
from onnxfuse.cli import main
from onnxfuse.rewrites import RULES


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False, **kw)


def one_line_error(result, *needles):
    err = result.stderr.strip()
    assert "Traceback" not in result.output and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error:"), err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture
def model_path(tmp_path):
    p = tmp_path / "model.onnx"
    onnx.save(conv_bn_model(), p)
    return p


def test_optimize_folds_and_validates(model_path, tmp_path):
    out = tmp_path / "out.onnx"
    report = tmp_path / "report.json"
    before = digest(model_path)
    result = run(["optimize", model_path, out, "--json", report, "--target", "onnx"])
    assert result.exit_code == 0, result.output + result.stderr
    assert digest(model_path) == before
    optimized = onnx.load(out)
    onnx.checker.check_model(optimized)
    assert [n.op_type for n in optimized.graph.node] == ["Conv", "Relu"]
    # model-level fields survive the rewrite
    assert optimized.producer_name == "test-exporter"
    assert {p.key: p.value for p in optimized.metadata_props}["author"] == "tests"
    assert [(o.domain, o.version) for o in optimized.opset_import] == [("", 13)]
    data = json.loads(report.read_text())
    assert data["ok"] is True and data["exit_code"] == 0
    assert data["result"]["rewrites"]["counts"]["fold-batchnorm-conv"] == 1
    assert data["result"]["nodes"] == {"before": 3, "after": 2}
    assert data["result"]["validation"]["passed"] is True
    assert data["result"]["validation"]["outputs"][0]["name"] == "y"
    assert "dynamic dimension" in " ".join(data["result"]["validation"]["notes"])
    assert "Wrote" in result.output


def test_quiet_prints_nothing(model_path, tmp_path):
    result = run(["optimize", model_path, tmp_path / "o.onnx", "--quiet"])
    assert result.exit_code == 0
    assert result.output == "" and result.stderr == ""


def test_shape_option_and_no_validate(model_path, tmp_path):
    result = run(["optimize", model_path, tmp_path / "o.onnx", "--shape", "x:2,3,8,8", "--json", tmp_path / "r.json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["result"]["validation"]["outputs"][0]["shape"] == [2, 4, 8, 8]
    result = run(["optimize", model_path, tmp_path / "o2.onnx", "--no-validate", "--json", tmp_path / "r2.json"])
    assert result.exit_code == 0
    assert json.loads((tmp_path / "r2.json").read_text())["result"]["validation"] is None


def test_inputs_npz(model_path, tmp_path):
    npz = tmp_path / "in.npz"
    np.savez(npz, x=np.ones((2, 3, 8, 8), np.float32))
    result = run(["optimize", model_path, tmp_path / "o.onnx", "--inputs", npz, "--json", tmp_path / "r.json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["result"]["validation"]["outputs"][0]["shape"] == [2, 4, 8, 8]
    np.savez(npz, wrong=np.ones((2, 3, 8, 8), np.float32))
    result = run(["optimize", model_path, tmp_path / "o3.onnx", "--inputs", npz])
    assert result.exit_code == 1
    one_line_error(result, "in.npz", "'x'")
    assert not (tmp_path / "o3.onnx").exists()


def test_only_skip_and_unknown_rule(model_path, tmp_path):
    out = tmp_path / "o.onnx"
    result = run(["optimize", model_path, out, "--skip", "fold-batchnorm-conv"])
    assert result.exit_code == 0
    assert "BatchNormalization" in [n.op_type for n in onnx.load(out).graph.node]
    result = run(["optimize", model_path, out, "--only", "fold-batchnorm-conv,fold-scale-bias", "--force"])
    assert result.exit_code == 0
    assert "BatchNormalization" not in [n.op_type for n in onnx.load(out).graph.node]
    result = run(["optimize", model_path, tmp_path / "o9.onnx", "--only", "no-such-rule"])
    assert result.exit_code == 2
    one_line_error(result, "no-such-rule")
    assert not (tmp_path / "o9.onnx").exists()


def test_usage_errors_exit_2(model_path, tmp_path):
    assert run(["optimize", model_path]).exit_code == 2
    assert run(["optimize", model_path, tmp_path / "o.onnx", "--target", "tpu"]).exit_code == 2
    result = run(["optimize", model_path, tmp_path / "o.onnx", "--shape", "x=1,2"])
    assert result.exit_code == 2
    one_line_error(result, "--shape")


def test_validation_failure_names_culprit_and_writes_nothing(model_path, tmp_path, monkeypatch):
    monkeypatch.setattr("onnxfuse.rewrites.RULES", RULES + [BreakConvWeights()])
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    result = run(["optimize", model_path, out, "--json", report, "--target", "onnx"])
    assert result.exit_code == 3
    assert not out.exists()
    assert "test-break-conv" in result.stderr.strip().splitlines()[-1]
    data = json.loads(report.read_text())
    assert data["ok"] is False and data["result"]["culprit"] == "test-break-conv" and data["exit_code"] == 3
    assert data["result"]["validation"]["passed"] is False
    # the same model passes when the culprit is skipped
    assert run(["optimize", model_path, out, "--skip", "test-break-conv", "--target", "onnx"]).exit_code == 0


def test_tolerance_options_flip_the_verdict(model_path, tmp_path, monkeypatch):
    monkeypatch.setattr("onnxfuse.rewrites.RULES", RULES + [BreakConvWeights()])
    # doubling the weights is a huge change: even a loose tolerance rejects it, an absurd one accepts it
    onnx_only = ["--target", "onnx"]
    assert run(["optimize", model_path, tmp_path / "a.onnx", "--rtol", "0.5", *onnx_only]).exit_code == 3
    assert run(["optimize", model_path, tmp_path / "b.onnx", "--rtol", "10", "--atol", "1e6", *onnx_only]).exit_code == 0


def test_default_target_folds_and_fuses(model_path, tmp_path):
    out = tmp_path / "out.onnx"
    result = run(["optimize", model_path, out, "--quiet"])
    assert result.exit_code == 0, result.stderr
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert "BatchNormalization" not in ops and len(ops) <= 2


# --------------------------------------------------------------------------------------------------
# bad inputs: exit 1, one line, input unchanged, nothing written


def _bad_file(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / f"{kind}.onnx"
    good = conv_bn_model().SerializeToString()
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "random":
        p.write_bytes(np.random.default_rng(7).bytes(4096))
    elif kind == "truncated":
        p.write_bytes(good[: len(good) // 2])
    elif kind == "text":
        p.write_text("this is not a model\njust some text\n")
    elif kind == "undefined-tensor":
        m = conv_bn_model()
        m.graph.node[2].input[0] = "does_not_exist"
        p.write_bytes(m.SerializeToString())
    elif kind == "no-provider-op":
        m = conv_bn_model()
        m.graph.node.append(helper.make_node("Frobnicate", ["y"], ["z"], domain="com.example"))
        m.graph.output[0].name = "z"
        m.opset_import.append(helper.make_opsetid("com.example", 1))
        p.write_bytes(m.SerializeToString())
    return p


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("empty", "empty"),
        ("random", "not a valid ONNX model"),
        ("truncated", "not a valid ONNX model"),
        ("text", "not a valid ONNX model"),
        ("undefined-tensor", "invalid ONNX model"),
        ("no-provider-op", "Frobnicate"),
    ],
)
def test_bad_model_files(tmp_path, kind, needle):
    p = _bad_file(tmp_path, kind)
    before = digest(p)
    out = tmp_path / "out.onnx"
    result = run(["optimize", p, out])
    assert result.exit_code == 1, (kind, result.stderr)
    one_line_error(result, p.name, needle)
    assert digest(p) == before
    assert sorted(x.name for x in tmp_path.iterdir()) == [p.name]


def test_missing_file(tmp_path):
    result = run(["optimize", tmp_path / "nope.onnx", tmp_path / "out.onnx"])
    assert result.exit_code == 1
    one_line_error(result, "nope.onnx", "no such file")


def test_missing_external_data(tmp_path):
    m = conv_bn_model()
    p = tmp_path / "ext.onnx"
    onnx.save_model(m, p, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data",
                    size_threshold=0)
    (tmp_path / "ext.data").unlink()
    result = run(["optimize", p, tmp_path / "out.onnx"])
    assert result.exit_code == 1
    one_line_error(result, "ext.onnx", "external data")
    assert not (tmp_path / "out.onnx").exists()


def test_external_data_model_loads(tmp_path):
    m = conv_bn_model()
    p = tmp_path / "ext.onnx"
    onnx.save_model(m, p, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.data",
                    size_threshold=0)
    result = run(["optimize", p, tmp_path / "out.onnx", "--quiet"])
    assert result.exit_code == 0, result.stderr
    assert "BatchNormalization" not in [n.op_type for n in onnx.load(tmp_path / "out.onnx").graph.node]


def test_output_equal_to_input(model_path):
    before = digest(model_path)
    result = run(["optimize", model_path, model_path])
    assert result.exit_code == 1
    one_line_error(result, "same file as the input", "--force")
    assert digest(model_path) == before
    # through another spelling of the same path
    other = model_path.parent / "." / model_path.name
    assert run(["optimize", model_path, other]).exit_code == 1
    # --force allows it, and the result is the optimized model
    assert run(["optimize", model_path, model_path, "--force", "--quiet"]).exit_code == 0
    assert "BatchNormalization" not in [n.op_type for n in onnx.load(model_path).graph.node]


@pytest.mark.parametrize("where", ["missing-dir", "dir-is-file", "output-is-dir"])
def test_unwritable_output(model_path, tmp_path, where):
    if where == "missing-dir":
        out = tmp_path / "no" / "such" / "dir" / "out.onnx"
    elif where == "dir-is-file":
        (tmp_path / "afile").write_text("x")
        out = tmp_path / "afile" / "out.onnx"
    else:
        (tmp_path / "adir").mkdir()
        out = tmp_path / "adir"
    result = run(["optimize", model_path, out])
    assert result.exit_code == 1
    one_line_error(result, "out" if where != "output-is-dir" else "adir")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to read-only directories")
def test_readonly_output_dir(model_path, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        result = run(["optimize", model_path, ro / "out.onnx"])
        assert result.exit_code == 1
        one_line_error(result, "not writable")
    finally:
        ro.chmod(0o755)


def test_help_has_examples_and_exit_codes():
    result = run(["optimize", "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and "Exit codes:" in result.output
    assert "onnxfuse optimize resnet.onnx" in result.output


def test_rules_command_lists_registry():
    result = run(["rules", "--json"])
    assert result.exit_code == 0
    names = [r["name"] for r in json.loads(result.output)]
    assert names == [r.name for r in RULES]
    assert "fold-batchnorm-conv" in names


# --------------------------------------------------------------------------------------------------
# reports for CI, timing without a GPU, --fail-on-slowdown


def test_markdown_and_junit_reports(model_path, tmp_path):
    md, xml = tmp_path / "summary.md", tmp_path / "junit.xml"
    result = run(["optimize", model_path, tmp_path / "o.onnx", "--markdown", md, "--junit", xml, "--quiet"])
    assert result.exit_code == 0, result.stderr
    text = md.read_text()
    assert "onnxfuse optimize: ✅ ok" in text and "fold-batchnorm-conv ×1" in text and "`y`" in text
    import xml.etree.ElementTree as ET

    root = ET.parse(xml).getroot()
    cases = root.findall(".//testcase")
    assert [c.get("name") for c in cases][:1] == ["y"]
    assert root.get("failures") == "0"


def test_markdown_appends_to_github_step_summary(model_path, tmp_path, monkeypatch):
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert run(["optimize", model_path, tmp_path / "o.onnx", "--markdown", summary, "-q"]).exit_code == 0
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "onnxfuse optimize" in text


def test_failed_validation_reports_fail_in_junit(model_path, tmp_path, monkeypatch):
    monkeypatch.setattr("onnxfuse.rewrites.RULES", RULES + [BreakConvWeights()])
    xml = tmp_path / "junit.xml"
    result = run(["optimize", model_path, tmp_path / "o.onnx", "--junit", xml, "--target", "onnx"])
    assert result.exit_code == 3
    import xml.etree.ElementTree as ET

    root = ET.parse(xml).getroot()
    assert root.get("failures") == "1"
    assert root.find(".//testcase/failure") is not None


@pytest.mark.skipif(__import__("onnxfuse.runtime.session", fromlist=["x"]).cuda_available(),
                    reason="checks the CPU-only behaviour")
def test_timing_without_gpu_is_a_note_and_exit_0(model_path, tmp_path):
    report = tmp_path / "r.json"
    result = run(["optimize", model_path, tmp_path / "o.onnx", "--json", report, "--fail-on-slowdown", "1.0"])
    assert result.exit_code == 0, result.stderr
    assert "timing needs a CUDA GPU" in result.output
    data = json.loads(report.read_text())
    assert data["result"]["timing"]["status"] == "no-gpu"
    result = run(["optimize", model_path, tmp_path / "o2.onnx", "--json", report, "--no-bench"])
    assert result.exit_code == 0 and "timing needs" not in result.output
    assert json.loads(report.read_text())["result"]["timing"] is None


def test_fail_on_slowdown_decision():
    from types import SimpleNamespace as NS

    from onnxfuse.errors import SlowerThanAllowed
    from onnxfuse.pipeline import check_slowdown

    def result(before, after):
        timing = NS(status="ok", original=NS(stats=NS(median_ms=before)), optimized=NS(stats=NS(median_ms=after)))
        return NS(timing=timing)

    check_slowdown(result(1.0, 0.9), 1.0)
    check_slowdown(result(1.0, 1.04), 1.05)
    check_slowdown(result(1.0, 5.0), None)
    check_slowdown(NS(timing=NS(status="no-gpu")), 1.0)
    with pytest.raises(SlowerThanAllowed) as info:
        check_slowdown(result(1.0, 1.2), 1.05)
    assert info.value.exit_code == 4 and "1.200" in str(info.value)
    assert run(["optimize", "x.onnx", "y.onnx", "--fail-on-slowdown", "0"]).exit_code == 2


def test_models_over_the_protobuf_limit_take_the_external_data_path(model_path, tmp_path, monkeypatch):
    """Pretend the 2 GB limit is tiny: the model must be saved with external data and validated through
    a file (ONNX Runtime cannot take such a model as bytes), with the same verdict."""
    monkeypatch.setattr("onnxfuse.model_io._EXTERNAL_THRESHOLD", 64)
    monkeypatch.setattr("onnxfuse.model_io._EXTERNAL_MIN_TENSOR", 0)
    out = tmp_path / "big.onnx"
    result = run(["optimize", model_path, out, "--target", "onnx", "--json", tmp_path / "r.json"])
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "big.onnx.data").exists()
    assert json.loads((tmp_path / "r.json").read_text())["result"]["validation"]["passed"] is True
    reloaded = onnx.load(out)  # loads the external data back
    assert "BatchNormalization" not in [n.op_type for n in reloaded.graph.node]


def test_unwritable_report_path_is_one_line_not_a_traceback(model_path, tmp_path):
    result = run(["optimize", model_path, tmp_path / "o.onnx", "--json", tmp_path / "no" / "r.json"])
    assert result.exit_code == 1
    one_line_error(result, "r.json", "does not exist")


def test_onnx_runtime_log_is_silenced_unless_verbose(tmp_path, monkeypatch):
    """The command line reports ONNX Runtime's failures itself; ONNX Runtime's default log (cuDNN's engine
    search printed hundreds of red lines over a report) is set to fatal only, unless --verbose."""
    import onnxruntime as ort
    from click.testing import CliRunner

    from onnxfuse import ort_runtime
    from onnxfuse.cli import main, render

    calls = []
    monkeypatch.setattr(ort, "set_default_logger_severity", calls.append)
    ort_runtime.check_runtime()
    assert calls == [ort_runtime.COMMAND_LINE_LOG_SEVERITY] == [4]
    calls.clear()
    ort_runtime.check_runtime(runtime_log=True)
    assert calls == []

    asked = []
    real = ort_runtime.check_runtime
    monkeypatch.setattr(ort_runtime, "check_runtime", lambda runtime_log=False: asked.append(runtime_log) or real(runtime_log))
    src = Path(__file__).resolve().parents[2] / "testdata" / "conv_bn_relu.onnx"
    for flags, want in ((["-q"], False), ([], False), (["-v"], True)):
        r = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "out.onnx"), "--no-bench", "--force", *flags])
        assert r.exit_code == 0, r.output
        assert asked[-1] is want, flags
    render.set_verbose(False)
