"""``optimize --device cpu`` (issue 32 item 5): the model is for ONNX Runtime's CPU provider, so no
FusedElementwise (its CPU kernel is an interpreter), validation on the CPU provider and both models timed
on the CPU, where the never-slower ladder and ``--fail-on-slowdown`` decide. Timings are stand-ins (as in
tests/test_selection.py): these tests check which device is asked for and what is decided, never real speed
(that is benchmarks/cpu_device.py)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import Counter

import onnx
import pytest
from click.testing import CliRunner

import onnxfuse
import onnxfuse.pipeline as pipeline
from helpers import conv_bn_model, load_testdata
from onnxfuse.cli import main
from onnxfuse.errors import SlowerThanAllowed, UsageError
from onnxfuse.reports import load_schema
from onnxfuse.reports.optimize_report import optimize_junit, optimize_markdown
from onnxfuse.rewrites import target_for_device
from onnxfuse.timing.compare import ComparisonResult
from onnxfuse.timing.runner import NO_GPU_MESSAGE, BenchConfig, BenchResult
from onnxfuse.timing.stats import summarize

FUSED = "ai.onnxfuse"


def run(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _bench(name, ms, device):
    samples = [ms, ms, ms, ms * 1.01]
    return BenchResult(name=name, device=device, cuda_graph=False, optimization="all", stats=summarize(samples),
                       warmup=1, shapes={}, nodes=1, providers=[f"{device.upper()}ExecutionProvider"],
                       samples_ms=samples)


def _timing(before, after, device="cpu"):
    return ComparisonResult(status="ok", device=device, cuda_graph=False, original=_bench("original", before, device),
                            optimized=_bench("optimized", after, device))


def _stand_in(cost):
    """pipeline.time_both's stand-in: records the device asked for; the original takes 1 ms, a candidate
    ``cost(op counts)`` ms."""
    calls = []

    def time_both(original, candidate, inputs, options, progress=None, beside=None):
        device = options.bench_config.device if options.bench_config is not None else "cuda"
        calls.append((device, Counter(n.op_type for n in candidate.graph.node)))
        timing = _timing(1.0, cost(calls[-1][1]), device)
        if beside is None:
            return timing
        return timing, _timing(1.0, cost(Counter(n.op_type for n in beside.graph.node)), device)
    return time_both, calls


def _domains(model: onnx.ModelProto) -> set[str]:
    return {n.domain for n in model.graph.node}


def test_device_picks_the_target():
    assert target_for_device(None, "cuda") == "cuda"  # the default is unchanged
    assert target_for_device(None, "cpu") == "contrib"
    assert target_for_device("onnx", "cpu") == "onnx"
    with pytest.raises(UsageError, match="--target cuda writes FusedElementwise"):
        target_for_device("cuda", "cpu")
    with pytest.raises(UsageError, match="unknown device"):
        target_for_device(None, "tpu")


def test_cpu_writes_no_fused_elementwise_where_cuda_does():
    model = load_testdata("conv_bn_relu")
    cuda = onnxfuse.optimize(model, samples=1)
    assert FUSED in _domains(cuda.model) and cuda.device == "cuda" and cuda.target == "cuda"
    cpu = onnxfuse.optimize(model, device="cpu", samples=1)
    assert FUSED not in _domains(cpu.model) and cpu.custom_library is None
    assert cpu.device == "cpu" and cpu.target == "contrib"
    assert cpu.validation.provider == "cpu" and cpu.validation.passed
    assert cpu.applied.counts.get("fold-batchnorm-conv") == 4
    assert "fuse-elementwise" not in cpu.rules and "conv-bias-into-elementwise" not in cpu.rules


def test_cpu_keeps_the_contrib_ops_which_have_cpu_kernels():
    result = onnxfuse.optimize(load_testdata("bert_tiny_sdpa_opset14"), device="cpu", samples=1)
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert FUSED not in _domains(result.model)
    assert ops["Attention"] + ops["MultiHeadAttention"] == 2, ops  # two layers, fused, validated on the CPU
    assert ops["SkipLayerNormalization"] >= 2, ops
    assert result.validation.provider == "cpu" and result.validation.passed


def test_the_cuda_default_is_what_it_was():
    model = load_testdata("conv_bn_relu")
    default = onnxfuse.optimize(model, samples=1)
    explicit = onnxfuse.optimize(model, target="cuda", device="cuda", samples=1)
    assert default.model.SerializeToString() == explicit.model.SerializeToString()
    assert default.to_json()["result"]["device"] == "cuda"


def test_cpu_times_both_models_on_the_cpu(monkeypatch):
    asked = []

    def compare_models(original, optimized, inputs, config=None, **kw):
        asked.append(config.device)
        return _timing(1.0, 0.9, config.device)
    monkeypatch.setattr("onnxfuse.timing.compare_models", compare_models)
    result = onnxfuse.optimize(conv_bn_model(), device="cpu", bench=True, samples=1)
    assert asked == ["cpu"] and result.timing.device == "cpu" and result.timing.status == "ok"
    # a timing configuration for another device is refused, not silently used
    with pytest.raises(UsageError, match="times on the CPU"):
        onnxfuse.optimize(conv_bn_model(), device="cpu", bench=True, bench_config=BenchConfig(device="cuda"))
    with pytest.raises(UsageError, match="validates on the CPU provider"):
        onnxfuse.optimize(conv_bn_model(), device="cpu", provider="cuda")


def test_the_never_slower_ladder_runs_on_cpu_timings(monkeypatch):
    # fused attention "slow on this CPU": 1.5 ms with it, 0.8 ms without
    fake, calls = _stand_in(lambda ops: 1.5 if {"Attention", "MultiHeadAttention"} & set(ops) else 0.8)
    monkeypatch.setattr(pipeline, "time_both", fake)
    result = onnxfuse.optimize(load_testdata("bert_tiny_sdpa_opset14"), device="cpu", bench=True, samples=1)
    assert [device for device, _ in calls] == ["cpu", "cpu"]
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert not {"Attention", "MultiHeadAttention"} & set(ops) and FUSED not in _domains(result.model)
    selection = result.extra["selection"]
    assert selection["kept"] == "fused attention" and selection["first_slowdown"] == pytest.approx(0.5, abs=0.02)
    assert [t["candidate"] for t in selection["tried"]] == ["fused attention"]
    assert any("slower than the original on this CPU" in n for n in result.timing.notes)
    assert result.validation.passed and result.validation.provider == "cpu"


def test_the_report_says_the_device(monkeypatch):
    fake, _ = _stand_in(lambda ops: 0.9)
    monkeypatch.setattr(pipeline, "time_both", fake)
    result = onnxfuse.optimize(conv_bn_model(), device="cpu", bench=True, samples=1)
    doc = result.to_json()
    assert doc["result"]["device"] == "cpu" and doc["result"]["target"] == "contrib"
    assert doc["result"]["timing"]["device"] == "cpu"
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, load_schema(), cls=jsonschema.Draft202012Validator)
    markdown = optimize_markdown(result)
    assert "contrib for the CPU provider (--device cpu)" in markdown and "### Latency (CPU," in markdown
    (latency,) = [c for c in ET.fromstring(optimize_junit(result)).iter("testcase") if c.get("name") == "latency"]
    assert latency.find("system-out").text.startswith("CPU: original median 1.0000 ms, optimized 0.9000 ms")


def test_cli_device_cpu_fail_on_slowdown_exits_4(tmp_path, monkeypatch):
    fake, calls = _stand_in(lambda ops: 1.2)  # every candidate 20% slower, the graph as loaded too
    monkeypatch.setattr(pipeline, "time_both", fake)
    model = tmp_path / "m.onnx"
    onnx.save(conv_bn_model(), model)
    out, report, junit = tmp_path / "o.onnx", tmp_path / "r.json", tmp_path / "j.xml"
    result = run(["optimize", model, out, "--device", "cpu", "--fail-on-slowdown", "1.0", "--json", report,
                  "--junit", junit, "--samples", "1"])
    assert result.exit_code == 4, result.output + result.stderr
    assert not out.exists()
    assert result.stderr.strip().splitlines()[-1].startswith("error: optimized model is slower than allowed")
    assert "Latency (CPU, ORT_ENABLE_ALL on both)" in result.stderr
    assert {device for device, _ in calls} == {"cpu"}
    data = json.loads(report.read_text())
    assert data["exit_code"] == 4 and data["result"]["device"] == "cpu"
    assert data["result"]["selection"]["kept"] == "every rewrite"
    failure = ET.parse(junit).getroot().find(".//testcase[@name='latency']/failure")
    assert failure is not None and failure.text.startswith("CPU: original median 1.0000 ms, optimized 1.2000 ms")
    # not slower: exit 0, and the CPU model is written
    fake, _ = _stand_in(lambda ops: 0.95)
    monkeypatch.setattr(pipeline, "time_both", fake)
    assert run(["optimize", model, out, "--device", "cpu", "--fail-on-slowdown", "1.0", "-q"]).exit_code == 0
    assert FUSED not in _domains(onnx.load(out))


def test_cli_device_cpu_usage_errors_are_one_line(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(conv_bn_model(), model)
    for extra, needle in ((["--target", "cuda"], "--target cuda writes FusedElementwise"),
                          (["--provider", "cuda"], "validates on the CPU provider"),
                          (["--device", "tpu"], "")):
        args = extra if extra[0] == "--device" else ["--device", "cpu", *extra]
        result = run(["optimize", model, tmp_path / "o.onnx", *args])
        assert result.exit_code == 2, result.output + result.stderr
        assert "Traceback" not in result.output + result.stderr and needle in result.stderr
        assert not (tmp_path / "o.onnx").exists()


def test_cuda_without_a_gpu_says_fail_on_slowdown_was_not_checked(tmp_path, monkeypatch):
    monkeypatch.setattr("onnxfuse.timing.compare.gpu_unavailable_reason", lambda: NO_GPU_MESSAGE)
    model = tmp_path / "m.onnx"
    onnx.save(conv_bn_model(), model)
    junit = tmp_path / "j.xml"
    line = ("--fail-on-slowdown 1 was not checked: timing needs a CUDA GPU (none is usable here); --device cpu "
            "optimizes for and times on the CPU")
    result = run(["optimize", model, tmp_path / "o.onnx", "--fail-on-slowdown", "1.0", "--junit", junit, "-q"])
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.strip() == f"warning: {line}"  # --quiet: still said, on stderr, in one line
    skipped = ET.parse(junit).getroot().find(".//testcase[@name='latency']/skipped")
    assert skipped is not None and skipped.get("message") == line
    result = run(["optimize", model, tmp_path / "o2.onnx", "--fail-on-slowdown", "1.0"])
    assert result.exit_code == 0 and "was not checked" in result.stdout
    # without --fail-on-slowdown the note is the plain no-GPU one, as before
    result = run(["optimize", model, tmp_path / "o3.onnx", "-q", "--junit", junit])
    assert result.exit_code == 0 and result.stderr == ""
    assert ET.parse(junit).getroot().find(".//skipped").get("message") == NO_GPU_MESSAGE


def test_api_fail_on_slowdown_on_cpu_raises(monkeypatch):
    fake, _ = _stand_in(lambda ops: 1.3)
    monkeypatch.setattr(pipeline, "time_both", fake)
    with pytest.raises(SlowerThanAllowed) as info:
        onnxfuse.optimize(conv_bn_model(), device="cpu", bench=True, fail_on_slowdown=1.05, never_slower=False,
                          samples=1)
    assert info.value.exit_code == 4 and info.value.report.device == "cpu"
