"""CLI tests for `onnxfuse bench`: real CPU timing of a tiny model, the "needs a GPU" line and exit
codes, option checks, JSON and --profile output."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

import tiny_models
from onnxfuse.cli import main
from onnxfuse.timing import bench as bench_lib

FAST = ["--warmup", "1", "--time-budget", "0.05"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_help_has_examples():
    r = invoke("bench", "--help")
    assert r.exit_code == 0
    assert "Examples:" in r.output and "onnxfuse bench model.onnx model.opt.onnx" in r.output
    for opt in ("--batch", "--shape", "--inputs", "--seed", "--cuda-graph", "--iterations", "--warmup",
                "--time-budget", "--device", "--json", "--quiet", "--profile"):
        assert opt in r.output


def test_cpu_timing_one_model(tiny_path):
    r = invoke("bench", tiny_path, "--device", "cpu", *FAST)
    assert r.exit_code == 0, r.output
    assert "Latency (CPU" in r.output and "tiny" in r.output and "median" in r.output


def test_cpu_two_models_json(tmp_path, tiny_path):
    other = tmp_path / "other.onnx"
    onnx.save(tiny_models.conv_relu_add(), str(other))
    out = tmp_path / "r.json"
    r = invoke("bench", tiny_path, other, "--device", "cpu", "--batch", "2", "--iterations", "7",
               "--warmup", "1", "--json", out)
    assert r.exit_code == 0, r.output
    assert "than tiny" in r.output
    data = json.loads(out.read_text())
    assert data["ok"] is True and data["result"]["config"]["device"] == "cpu"
    assert [m["name"] for m in data["result"]["models"]] == ["tiny", "other"]
    for m in data["result"]["models"]:
        assert m["latency_ms"]["count"] == 7
        assert m["shapes"] == {"x": [2, 3, 8, 8]} and m["device"] == "cpu"
    assert data["result"]["speedup"] > 0 and data["environment"]["onnxruntime"]


def test_quiet_prints_nothing(tiny_path):
    r = invoke("bench", tiny_path, "--device", "cpu", "--quiet", *FAST)
    assert r.exit_code == 0 and r.output == ""


def test_profile_tables(tiny_path, tmp_path):
    out = tmp_path / "p.json"
    r = invoke("bench", tiny_path, "--device", "cpu", "--profile", "--json", out, *FAST)
    assert r.exit_code == 0, r.output
    assert "top ops by time" in r.output and "top ops by count" in r.output and "nodes/run" in r.output
    prof = json.loads(out.read_text())["result"]["profiles"][0]
    assert prof["nodes_per_run"] > 0 and prof["top_by_time"] and prof["kernels_per_run"] is None


def test_needs_a_gpu(monkeypatch, tiny_path, tmp_path):
    monkeypatch.setattr(bench_lib, "gpu_unavailable_reason", lambda: "timing needs a CUDA GPU (none is usable here)")
    out = tmp_path / "e.json"
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--json", str(out)])
    assert r.exit_code == 1
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "timing needs a CUDA GPU" in lines[0] and "--device cpu" in lines[0]
    assert "Traceback" not in r.output
    assert json.loads(out.read_text())["ok"] is False
    # --device cpu still works on that machine
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", *FAST])
    assert r.exit_code == 0


@pytest.mark.parametrize(
    "extra, code, message",
    [
        (["--device", "cpu", "--cuda-graph"], 2, "CUDA graphs need --device cuda"),
        (["--device", "cpu", "--iterations", "0"], 2, "--iterations"),
        (["--device", "cpu", "--time-budget", "-1"], 2, "--time-budget"),
        (["--device", "cpu", "--batch", "0"], 2, "--batch"),
        (["--device", "cpu", "--shape", "nope:1,2"], 2, "unknown input"),
        (["--device", "tpu"], 2, "tpu"),
    ],
)
def test_bad_options(tiny_path, extra, code, message):
    r = CliRunner().invoke(main, ["bench", str(tiny_path), *extra])
    assert r.exit_code == code, r.output
    assert message in r.output and "Traceback" not in r.output


def test_batch_with_inputs_is_a_usage_error(tiny_path, tmp_path):
    npz = tmp_path / "x.npz"
    np.savez(npz, x=np.zeros((1, 3, 8, 8), np.float32))
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--batch", "2", "--inputs", str(npz)])
    assert r.exit_code == 2 and "--batch" in r.output
    r = CliRunner().invoke(main, ["bench", str(tiny_path), "--device", "cpu", "--inputs", str(npz), *FAST])
    assert r.exit_code == 0, r.output


def test_fixed_batch_model(tmp_path):
    path = tmp_path / "fixed.onnx"
    onnx.save(tiny_models.conv_relu_add(batch=1), str(path))
    r = CliRunner().invoke(main, ["bench", str(path), "--device", "cpu", "--batch", "4"])
    assert r.exit_code == 1 and "fixed shape" in r.output


def test_missing_model(tmp_path):
    r = CliRunner().invoke(main, ["bench", str(tmp_path / "nope.onnx"), "--device", "cpu"])
    assert r.exit_code == 1 and "no such file" in r.output and "Traceback" not in r.output


def test_dynamic_dims_note(tmp_path):
    path = tmp_path / "two.onnx"
    onnx.save(tiny_models.two_inputs(), str(path))
    r = invoke("bench", path, "--device", "cpu", "--batch", "3", *FAST)
    assert r.exit_code == 0, r.output
    assert "note:" in r.output and "seq" in r.output


def test_sessions_pool_samples_from_fresh_sessions(tmp_path, tiny_path):
    out = tmp_path / "r.json"
    r = invoke("bench", tiny_path, tiny_path, "--device", "cpu", "--iterations", "9", "--sessions", "3",
               "--warmup", "1", "--json", out)
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["result"]["config"]["sessions"] == 3
    for m in data["result"]["models"]:
        assert m["latency_ms"]["count"] == 9  # 3 sessions x 3 runs, pooled
        note = next(n for n in m["notes"] if "sessions pooled" in n)
        assert len(note.split(":")[-1].split(",")) == 3  # one median per session


def test_sessions_must_be_positive(tiny_path):
    r = invoke("bench", tiny_path, "--device", "cpu", "--sessions", "0", *FAST)
    assert r.exit_code == 2 and "--sessions" in r.output


def test_pool_sessions_statistics():
    from onnxfuse.timing.compare import pool_sessions
    from onnxfuse.timing.runner import BenchResult
    from onnxfuse.timing.stats import summarize

    def result(samples):
        return BenchResult(name="m", device="cpu", cuda_graph=False, optimization="all", stats=summarize(samples),
                           warmup=1, shapes={}, nodes=1, providers=["CPUExecutionProvider"], samples_ms=samples)

    pooled = pool_sessions([result([1.0, 1.0, 1.0]), result([2.0, 2.0, 2.0]), result([3.0, 3.0, 3.0])])
    assert pooled.stats.count == 9 and pooled.stats.median_ms == 2.0 and pooled.stats.min_ms == 1.0
    assert pooled.samples_ms == [1.0] * 3 + [2.0] * 3 + [3.0] * 3
    assert pooled.notes[-1].endswith("1.000, 2.000, 3.000")


def test_cuda_graph_of_a_model_with_control_flow_is_one_clear_line():
    """ONNX Runtime cannot capture an If in a CUDA graph (contrib-decode-attention writes one per layer):
    the timer says so, naming the node, before it needs a GPU or a session."""
    from onnx import TensorProto as TP
    from onnx import helper as h

    from onnxfuse.errors import RuntimeFailure
    from onnxfuse.runtime.inputs import Inputs
    from onnxfuse.timing.runner import BenchConfig, Timer

    branch = lambda name, op: h.make_graph([h.make_node(op, ["x"], [f"{name}_y"])], name, [],  # noqa: E731
                                           [h.make_tensor_value_info(f"{name}_y", TP.FLOAT, [2])])
    graph = h.make_graph(
        [h.make_node("ReduceSum", ["x"], ["s"], keepdims=0), h.make_node("Greater", ["s", "zero"], ["c"]),
         h.make_node("If", ["c"], ["y"], name="decode_or_prefill", then_branch=branch("t", "Relu"),
                     else_branch=branch("e", "Neg"))],
        "g", [h.make_tensor_value_info("x", TP.FLOAT, [2])], [h.make_tensor_value_info("y", TP.FLOAT, [2])],
        [h.make_tensor(name="zero", data_type=TP.FLOAT, dims=[], vals=[0.0])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    inputs = Inputs(feeds={"x": np.ones(2, np.float32)})
    with pytest.raises(RuntimeFailure, match="m: CUDA graphs cannot capture control flow, and the model has 1 If "
                                             "node\\(s\\) \\(the first: decode_or_prefill\\); time it without --cuda-graph"):
        Timer(model, inputs, BenchConfig(device="cuda", cuda_graph=True, iterations=1), name="m")
    # without the If, the same config gets past this check (to the GPU check on a CPU machine)
    model.graph.node.pop()
    model.graph.node.append(h.make_node("Relu", ["x"], ["y"]))
    try:
        Timer(model, inputs, BenchConfig(device="cuda", cuda_graph=True, iterations=1), name="m").close()
    except Exception as exc:  # NoGPU here; nothing on a GPU machine
        assert "control flow" not in str(exc)
