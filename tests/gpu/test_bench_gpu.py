"""GPU tests for onnxfuse.timing: IOBinding timing on the CUDA provider, CUDA-graph mode (outputs at
fixed addresses must hold the right values), profiling, compare_models, compare_beside and the bench CLI on CUDA.
Skipped where ONNX Runtime has no usable CUDA GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from onnxfuse.runtime.session import cuda_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "timing"))
import tiny_models  # noqa: E402
from helpers import outputs_on_cuda  # noqa: E402

from onnxfuse.timing import BenchConfig, compare_beside, compare_models, profile, time_model  # noqa: E402
from onnxfuse.cli import main  # noqa: E402
from onnxfuse.runtime.session import run_model  # noqa: E402
from onnxfuse.runtime.inputs import make_inputs  # noqa: E402

FAST = dict(warmup=3, time_budget_s=0.2, min_iterations=10)


@pytest.fixture
def model():
    return tiny_models.conv_relu_add()


@pytest.fixture
def inputs(model):
    return make_inputs(model, {"x": [4, 3, 8, 8]}, seed=3)


def test_time_model_cuda(model, inputs):
    r = time_model(model, inputs, BenchConfig(device="cuda", **FAST))
    assert r.device == "cuda" and "CUDAExecutionProvider" in r.providers
    assert r.stats.count >= 10 and 0 < r.stats.min_ms <= r.stats.median_ms <= r.stats.p99_ms
    assert r.output_specs[0].shape == [4, 4, 8, 8]


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_iobinding_outputs_are_correct(model, inputs, cuda_graph):
    reference = run_model(model, inputs, "cpu")["y"]
    np.testing.assert_allclose(outputs_on_cuda(model, inputs, cuda_graph)["y"], reference, rtol=1e-3, atol=1e-3)


def test_cuda_graph_timing(model, inputs):
    plain = time_model(model, inputs, BenchConfig(device="cuda", **FAST))
    graph = time_model(model, inputs, BenchConfig(device="cuda", cuda_graph=True, **FAST),
                       output_specs=plain.output_specs)
    assert graph.cuda_graph and graph.label == "CUDA + CUDA graph" and graph.stats.count >= 10
    # and without pre-computed output shapes (probed with a plain run)
    probed = time_model(model, inputs, BenchConfig(device="cuda", cuda_graph=True, **FAST))
    assert probed.output_specs[0].shape == [4, 4, 8, 8]


def test_profile_cuda(model, inputs):
    p = profile(model, inputs, BenchConfig(device="cuda", warmup=3), runs=5)
    s = p.summary
    assert s.runs == 5 and s.nodes_per_run > 0
    assert any("CUDA" in prov for prov in s.nodes_by_provider), s.nodes_by_provider
    print("kernels per run:", s.kernels_per_run, "notes:", s.notes)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_compare_models_cuda(model, inputs, cuda_graph):
    r = compare_models(model, model, inputs, BenchConfig(device="cuda", cuda_graph=cuda_graph, **FAST),
                       profile_ops=not cuda_graph, profile_runs=5)
    assert r.status == "ok", r.message
    assert r.speedup is not None and 0.3 < r.speedup < 3.0  # same model twice
    json.dumps(r.to_dict())


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_compare_beside_cuda(model, inputs, cuda_graph):
    """A measured choice's run: candidate and incumbent beside the original, one run, one original figure."""
    ours, theirs = compare_beside(model, model, model, inputs, BenchConfig(device="cuda", cuda_graph=cuda_graph, **FAST))
    assert ours.status == theirs.status == "ok", ours.message
    assert ours.original is theirs.original
    assert 0.3 < ours.optimized.stats.median_ms / theirs.optimized.stats.median_ms < 3.0  # the same model


def test_custom_op_model_registers_library(inputs):
    custom_ops = pytest.importorskip("onnxfuse.custom_ops")
    try:
        custom_ops.library_path()
    except custom_ops.LibraryNotFoundError as exc:
        pytest.skip(f"custom-op library not built: {exc}")
    from onnx import TensorProto, helper

    program = ("onnxfuse.elementwise 1\ninput x: float32\nt0: float32 = Relu(x)\n"
               "t1: float32 = Mul(t0, t0)\noutput t1\n")
    graph = helper.make_graph(
        [custom_ops.make_node(program, ["x"], ["y"], name="fused")], "custom",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 8, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14), custom_ops.opset_import()])
    model.ir_version = 8
    x = inputs.feeds["x"]
    expected = np.maximum(x, 0) ** 2
    for cuda_graph in (False, True):
        np.testing.assert_allclose(outputs_on_cuda(model, inputs, cuda_graph)["y"], expected, rtol=1e-5, atol=1e-6)


def test_bench_cli_cuda(tmp_path, model):
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    out = tmp_path / "r.json"
    r = CliRunner().invoke(main, ["bench", str(path), str(path), "--batch", "8", "--time-budget", "0.2",
                                  "--profile", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "Latency (CUDA" in r.output
    data = json.loads(out.read_text())
    assert data["result"]["models"][0]["device"] == "cuda" and data["result"]["models"][0]["shapes"] == {"x": [8, 3, 8, 8]}
    r = CliRunner().invoke(main, ["bench", str(path), "--cuda-graph", "--time-budget", "0.2"])
    assert r.exit_code == 0, r.output
    assert "CUDA graph" in r.output


def test_bench_api_on_the_gpu(tmp_path):
    import onnxfuse

    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_models.conv_relu_add(), str(path))
    report = onnxfuse.bench(path, path, iterations=20, warmup=2, profile=True)
    data = report.to_json()
    assert data["ok"] is True and data["result"]["config"]["device"] == "cuda" and data["environment"]["gpus"]
    assert [m["latency_ms"]["count"] for m in data["result"]["models"]] == [20, 20] and report.speedup > 0
    assert len(data["result"]["profiles"]) == 2
