"""Timing statistics, stopping rule, profiler-trace parsing, --batch shapes and report structures:
everything in onnxfuse.timing that does not need a GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tiny_models
from onnxfuse.timing import (
    NO_GPU_MESSAGE,
    BenchConfig,
    BenchResult,
    ComparisonResult,
    batch_shapes,
    compare_beside,
    compare_models,
    load_trace,
    percentile,
    speedup,
    summarize,
    summarize_trace,
    time_model,
)
from onnxfuse.timing import runner
from onnxfuse.timing.stats import should_stop
from onnxfuse.timing.trace import events_of
from onnxfuse.errors import InputsError, UsageError
from onnxfuse.runtime.inputs import make_inputs

# ---------------------------------------------------------------------------------------------- stats


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=200), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values, q):
    xs = sorted(values)
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-9)


def test_percentile_edges():
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize():
    s = summarize([3.0, 1.0, 2.0, 4.0, 10.0])
    assert s.count == 5
    assert s.median_ms == 3.0 and s.min_ms == 1.0 and s.max_ms == 10.0
    assert s.mean_ms == pytest.approx(4.0)
    assert s.std_ms == pytest.approx(np.std([3, 1, 2, 4, 10], ddof=1))
    assert s.p90_ms == pytest.approx(np.percentile([1, 2, 3, 4, 10], 90))
    assert s.p99_ms <= s.max_ms
    d = s.to_dict()
    assert set(d) >= {"count", "median_ms", "p90_ms", "p99_ms", "min_ms", "mean_ms", "spread"}
    json.dumps(d)
    one = summarize([2.0])
    assert one.std_ms == 0.0 and one.p99_ms == 2.0
    with pytest.raises(ValueError):
        summarize([])


def test_speedup():
    assert speedup(2.0, 1.0) == 2.0
    assert speedup(1.0, 2.0) == 0.5
    assert speedup(None, 1.0) is None and speedup(1.0, 0.0) is None


@pytest.mark.parametrize(
    "count, elapsed, iterations, budget, floor, stop",
    [
        (0, 0.0, None, 1.0, 10, False),
        (5, 2.0, None, 1.0, 10, False),   # over budget but below the minimum run count
        (10, 2.0, None, 1.0, 10, True),
        (10, 0.5, None, 1.0, 10, False),
        (3, 0.0, 3, None, 10, True),      # iteration count reached (below the floor: it wins)
        (2, 0.0, 3, None, 10, False),
        (3, 5.0, 100, 1.0, 3, True),      # budget first
        (100, 0.1, 100, 1.0, 3, True),    # count first
        (10, 0.0, None, None, 10, True),  # neither limit: the floor
    ],
)
def test_should_stop(count, elapsed, iterations, budget, floor, stop):
    assert should_stop(count, elapsed, iterations=iterations, time_budget_s=budget, min_iterations=floor) is stop


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(device="tpu"), "unknown device"),
        (dict(device="cpu", cuda_graph=True), "CUDA graphs"),
        (dict(warmup=-1), "--warmup"),
        (dict(iterations=0), "--iterations"),
        (dict(time_budget_s=0), "--time-budget"),
        (dict(iterations=None, time_budget_s=None), "iteration count or a time budget"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(UsageError, match=message):
        BenchConfig(**kwargs).validate()


def test_cuda_graph_warmup_floor():
    assert BenchConfig(cuda_graph=True, warmup=0).effective_warmup >= 2
    assert BenchConfig(warmup=0).effective_warmup == 0

# ---------------------------------------------------------------------------------------------- trace


def test_sample_trace(sample_trace_path):
    events = load_trace(sample_trace_path)
    s = summarize_trace(events)
    assert s.runs == 4
    assert s.nodes_per_run == 3
    assert {o.op for o in s.ops} == {"Conv", "Relu", "Add"}
    assert all(o.calls_per_run == 1 for o in s.ops)
    assert s.top_by_time(1)[0].op == "Conv"  # the first (warm-up) Conv dominates
    assert sum(o.share for o in s.ops) == pytest.approx(1.0)
    assert s.nodes_by_provider == {"CPUExecutionProvider": 3}
    assert s.kernels_per_run is None and any("kernel" in n for n in s.notes)
    json.dumps(s.to_dict())


def test_sample_trace_skips_warmup_runs(sample_trace_path):
    events = load_trace(sample_trace_path)
    full = summarize_trace(events)
    steady = summarize_trace(events, skip_runs=1)
    assert steady.runs == 3 and steady.nodes_per_run == 3
    conv = {o.op: o for o in steady.ops}["Conv"]
    assert conv.ms_per_run < {o.op: o for o in full.ops}["Conv"].ms_per_run
    # Too many runs to skip: nothing is dropped rather than everything.
    assert summarize_trace(events, skip_runs=10).runs == 4


def test_trace_with_kernel_records():
    events = [
        {"cat": "Session", "name": "model_run", "ts": 0, "dur": 100},
        {"cat": "Node", "name": "conv_kernel_time", "ts": 1, "dur": 30,
         "args": {"op_name": "Conv", "provider": "CUDAExecutionProvider"}},
        {"cat": "Node", "name": "conv_fence_before", "ts": 1, "dur": 0, "args": {"op_name": "Conv"}},
        {"cat": "Kernel", "name": "implicit_gemm", "ts": 2, "dur": 20, "args": {"op_name": "Conv"}},
        {"cat": "Kernel", "name": "bias_relu", "ts": 3, "dur": 5, "args": {"parent_name": "conv_kernel_time"}},
        {"cat": "Node", "name": "add_kernel_time", "ts": 40, "dur": 10,
         "args": {"op_name": "Add", "provider": "CUDAExecutionProvider"}},
        {"cat": "Kernel", "name": "elementwise", "ts": 41, "dur": 4, "args": {"op_name": "Add"}},
        {"cat": "Kernel", "name": "memcpy", "ts": 42, "dur": 1, "args": {}},
    ]
    s = summarize_trace({"traceEvents": events})
    assert s.runs == 1 and s.nodes_per_run == 2
    assert s.kernels_per_run == 4 and s.kernel_ms_per_run == pytest.approx(0.030)
    by_op = {o.op: o for o in s.ops}
    assert by_op["Conv"].kernels_per_run == 2 and by_op["Add"].kernels_per_run == 1
    assert by_op["?"].kernels_per_run == 1 and by_op["?"].calls_per_run == 0
    assert s.top_by_count(1)[0].op in {"Conv", "Add"}
    assert not s.notes


def test_trace_rejects_non_traces(tmp_path):
    with pytest.raises(ValueError):
        events_of("nope")
    bad = tmp_path / "t.json"
    bad.write_text('{"traceEvents": [1, {"cat": "Node"}]}')
    assert load_trace(bad) == [{"cat": "Node"}]

# ---------------------------------------------------------------------------------------------- --batch


def test_batch_shapes_sets_first_dynamic_dim():
    shapes, notes = batch_shapes(tiny_models.conv_relu_add(), 16)
    assert shapes == {"x": [16, 3, 8, 8]} and notes == []


def test_batch_shapes_other_dynamic_dims_and_explicit_shapes():
    model = tiny_models.two_inputs()
    shapes, notes = batch_shapes(model, 4)
    assert shapes == {"ids": [4, 1], "x": [4, 4]}
    assert len(notes) == 1 and "seq" in notes[0] and "--shape ids:4,1" in notes[0]
    shapes, notes = batch_shapes(model, 4, {"ids": [4, 128]})
    assert shapes == {"ids": [4, 128], "x": [4, 4]} and notes == []
    assert batch_shapes(model, None, {"x": [2, 4]}) == ({"x": [2, 4]}, [])


def test_batch_shapes_fixed_batch():
    model = tiny_models.conv_relu_add(batch=1)
    assert batch_shapes(model, 1) == ({}, [])
    with pytest.raises(InputsError, match="fixed shape"):
        batch_shapes(model, 8)
    with pytest.raises(UsageError):
        batch_shapes(model, 0)

# ---------------------------------------------------------------------------------------------- reports


def _result(name: str, samples) -> BenchResult:
    return BenchResult(name=name, device="cuda", cuda_graph=False, optimization="all", stats=summarize(samples),
                       warmup=10, shapes={"x": [1, 3, 8, 8]}, nodes=3, providers=["CUDAExecutionProvider"],
                       samples_ms=list(samples))


def test_comparison_result_report():
    r = ComparisonResult(status="ok", device="cuda", cuda_graph=False, original=_result("original", [2.0, 2.0, 2.2]),
                         optimized=_result("optimized", [1.0, 1.0, 1.1]), nodes_original=10, nodes_optimized=4)
    assert r.ok and r.speedup == pytest.approx(2.0)
    d = r.to_dict()
    assert d["speedup"] == 2.0 and d["nodes"] == {"original": 10, "optimized": 4}
    assert d["original"]["latency_ms"]["median_ms"] == 2.0 and "samples_ms" not in d["original"]
    assert d["profile"] is None
    assert "samples_ms" in r.original.to_dict(samples=True)
    json.dumps(d)
    empty = ComparisonResult(status="no-gpu", device="cuda", cuda_graph=False, message=NO_GPU_MESSAGE)
    assert empty.speedup is None and not empty.ok and empty.to_dict()["message"] == NO_GPU_MESSAGE


def test_compare_models_without_gpu_returns_status(monkeypatch, tiny_model):
    monkeypatch.setattr(runner, "cuda_available", lambda: False)
    inputs = make_inputs(tiny_model, {"x": [1, 3, 8, 8]})
    r = compare_models(tiny_model, tiny_model, inputs, BenchConfig(device="cuda"))
    assert r.status == "no-gpu" and r.message == NO_GPU_MESSAGE
    assert "timing needs a CUDA GPU" in r.message and "\n" not in r.message
    with pytest.raises(runner.NoGPU, match="timing needs a CUDA GPU"):
        time_model(tiny_model, inputs, BenchConfig(device="cuda"))


def test_compare_models_on_cpu(tiny_model):
    inputs = make_inputs(tiny_model, {"x": [2, 3, 8, 8]})
    seen = []
    cfg = BenchConfig(device="cpu", warmup=2, iterations=30, time_budget_s=None)
    r = compare_models(tiny_model, tiny_model, inputs, cfg, profile_ops=True, profile_runs=5,
                       progress=lambda m, f: seen.append(f))
    assert r.status == "ok", r.message
    assert r.original.stats.count == 30 and r.optimized.stats.count == 30
    assert r.original.device == "cpu" and r.original.label == "CPU"
    assert r.speedup is not None and r.nodes_original == 3
    assert 0 < r.profile_original.summary.nodes_per_run <= 3  # ORT_ENABLE_ALL may fuse Conv+Relu
    assert r.profile_original.summary.runs == 5
    assert seen and seen[-1] == 1.0 and all(0.0 <= f <= 1.0 for f in seen)
    assert seen == sorted(seen)
    json.dumps(r.to_dict())


def test_compare_beside_times_three_models_in_one_run_sharing_the_original(monkeypatch, tiny_model):
    """A candidate and the incumbent each against the original, all three in one interleaved run of two
    fresh sessions: both results hold the same original samples and each session's median; a missing GPU
    or a broken model is both results' status."""
    inputs = make_inputs(tiny_model, {"x": [2, 3, 8, 8]})
    cfg = BenchConfig(device="cpu", warmup=1, iterations=12, time_budget_s=None)
    seen = []
    ours, theirs = compare_beside(tiny_model, tiny_model, tiny_model, inputs, cfg, progress=lambda m, f: seen.append(m))
    assert ours.status == theirs.status == "ok"
    assert ours.original is theirs.original and ours.optimized is not theirs.optimized
    assert ours.original.stats.count == ours.optimized.stats.count == theirs.optimized.stats.count == 12
    assert any("incumbent" in m for m in seen) and any("candidate" in m for m in seen)
    # two fresh sessions at least (the iterations split between them), each one's median kept
    assert all(len(r.session_medians_ms) == 2 for r in (ours.original, ours.optimized, theirs.optimized))
    assert any(m.startswith("session 2/2") for m in seen)
    broken = tiny_models.conv_relu_add()
    broken.graph.node[1].input[0] = "missing"
    ours, theirs = compare_beside(tiny_model, broken, tiny_model, inputs, cfg)
    assert ours.status == theirs.status == "failed" and "candidate" in ours.message
    monkeypatch.setattr(runner, "cuda_available", lambda: False)
    ours, theirs = compare_beside(tiny_model, tiny_model, tiny_model, inputs, BenchConfig(device="cuda"))
    assert ours.status == theirs.status == "no-gpu" and theirs.message == NO_GPU_MESSAGE


def test_compare_models_failure_is_a_status(tiny_model):
    broken = tiny_models.conv_relu_add()
    broken.graph.node[1].input[0] = "missing"
    inputs = make_inputs(tiny_model, {"x": [1, 3, 8, 8]})
    r = compare_models(tiny_model, broken, inputs, BenchConfig(device="cpu", time_budget_s=0.01))
    assert r.status == "failed" and "optimized" in r.message and "\n" not in r.message


def test_time_model_cpu_budget_and_outputs(tiny_model):
    inputs = make_inputs(tiny_model, {"x": [1, 3, 8, 8]})
    r = time_model(tiny_model, inputs, BenchConfig(device="cpu", warmup=1, time_budget_s=0.05, min_iterations=5))
    assert r.stats.count >= 5 and r.device == "cpu" and r.providers == ["CPUExecutionProvider"]
    assert r.output_specs and r.output_specs[0].shape == [1, 4, 8, 8]
    assert r.output_specs[0].dtype == np.float32
