"""The Python API, ``onnxfuse.optimize`` and ``onnxfuse.diff``: models as paths or protos (never modified),
inputs as arrays or .npz, the same reports as the CLI's ``--json``, the documented errors, and the
README's export → optimize → save example run as written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import helper, numpy_helper

import onnxfuse
from onnxfuse.cli import main
from onnxfuse.rewrites import RULES
from helpers import BreakConvWeights, conv_bn_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(conv_bn_model(), str(path))
    return path


def x(batch=2, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, 3, 8, 8)).astype(np.float32)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def without_timings(report: dict) -> dict:
    """A report minus what differs from run to run: wall-clock timings."""
    body = report["result"]
    if body is not None:
        body = {k: v for k, v in body.items() if k not in ("timings", "seconds")}
    return {**report, "result": body}


# --------------------------------------------------------------------------------------------------
# optimize


def test_top_level_names_are_functions_and_documented_types():
    assert callable(onnxfuse.optimize) and callable(onnxfuse.diff)
    for name in ("OnnxfuseError", "ValidationFailed", "SlowerThanAllowed", "ModelLoadError", "ModelSaveError",
                 "InputsError", "UsageError", "RuntimeFailure", "OnnxRuntimeUnavailable"):
        assert issubclass(getattr(onnxfuse, name), onnxfuse.OnnxfuseError if name != "OnnxfuseError" else Exception)
    from onnxfuse.drift import DiffReport
    from onnxfuse.pipeline import OptimizeResult

    assert onnxfuse.OptimizeResult is OptimizeResult and onnxfuse.DiffReport is DiffReport
    assert set(onnxfuse.__all__) <= set(dir(onnxfuse))


def test_optimize_from_path_writes_the_output(model_path, tmp_path):
    out = tmp_path / "out.onnx"
    before = model_path.read_bytes()
    result = onnxfuse.optimize(model_path, out, target="onnx")
    assert isinstance(result, onnxfuse.OptimizeResult)
    assert [n.op_type for n in result.model.graph.node] == ["Conv", "Relu"]
    assert result.validation.passed and result.timing is None  # bench is off by default in the API
    assert result.output_path == str(out) and result.input_path == str(model_path)
    written = onnx.load(str(out))
    assert written.SerializeToString() == result.model.SerializeToString()
    assert model_path.read_bytes() == before
    # the input file is not overwritten without force
    with pytest.raises(onnxfuse.ModelSaveError, match="same file as the input"):
        onnxfuse.optimize(model_path, model_path)
    assert model_path.read_bytes() == before


def test_optimize_from_modelproto_leaves_it_unchanged_and_writes_nothing(tmp_path):
    model = conv_bn_model()
    before = model.SerializeToString()
    result = onnxfuse.optimize(model, target="onnx", inputs={"x": x()})
    assert model.SerializeToString() == before
    assert result.input_path == "<model>" and result.output_path is None
    assert list(tmp_path.iterdir()) == []
    assert result.model is not model and result.nodes_before == 3 and result.nodes_after == 2
    assert result.validation.outputs[0].shape == [2, 4, 8, 8]
    # save later, atomically
    result.save(tmp_path / "later.onnx")
    assert onnx.load(str(tmp_path / "later.onnx")).SerializeToString() == result.model.SerializeToString()
    assert result.to_json()["result"]["output"] == str(tmp_path / "later.onnx")


def test_inputs_as_arrays_npz_and_a_list_of_samples(model_path, tmp_path):
    arrays = {"x": x(batch=3)}
    npz = tmp_path / "in.npz"
    np.savez(npz, **arrays)
    from_arrays = onnxfuse.optimize(model_path, inputs=arrays, target="onnx")
    from_npz = onnxfuse.optimize(model_path, inputs=npz, target="onnx")
    from_str = onnxfuse.optimize(model_path, inputs=str(npz), target="onnx")
    a, b, c = (r.to_json()["result"]["validation"] for r in (from_arrays, from_npz, from_str))
    assert a == b == c and a["outputs"][0]["shape"] == [3, 4, 8, 8]
    assert a["notes"] == []  # no defaulted dynamic dimension: the shapes are the user's
    # several samples (of different batch sizes): each must pass; the worst one is reported
    many = onnxfuse.optimize(model_path, inputs=[{"x": x(1, seed=5)}, {"x": 100 * x(4, seed=6)}], target="onnx")
    row = many.validation.outputs[0]
    assert row.passed and row.extra["worst_sample"] == 1 and row.shape == [4, 4, 8, 8]


@pytest.mark.parametrize("inputs,needles", [
    ({"x": x().astype(np.float64)}, ["'x'", "float64", "float32"]),
    ({"y": x()}, ["no array named 'x'"]),
    ({"x": np.zeros((2, 5, 8, 8), np.float32)}, ["'x'", "shape"]),
    ([], ["empty"]),
    (42, ["int"]),
])
def test_bad_inputs_are_one_line_inputs_errors(model_path, inputs, needles):
    with pytest.raises(onnxfuse.InputsError) as info:
        onnxfuse.optimize(model_path, inputs=inputs, target="onnx")
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 1
    for needle in needles:
        assert needle in message, (needle, message)


def test_validation_failure_raises_with_the_culprit(tmp_path):
    model = conv_bn_model()
    before = model.SerializeToString()
    out = tmp_path / "out.onnx"
    with pytest.raises(onnxfuse.ValidationFailed) as info:
        onnxfuse.optimize(model, out, target="onnx", rules=RULES + [BreakConvWeights()])
    exc = info.value
    assert exc.culprit == "test-break-conv" and exc.exit_code == 3
    assert "test-break-conv" in str(exc) and "\n" not in str(exc)
    assert not out.exists() and model.SerializeToString() == before
    report = exc.report.to_json()
    assert report["ok"] is False and report["exit_code"] == 3 and report["result"]["culprit"] == "test-break-conv"
    assert report["error"] == str(exc) and report["result"]["validation"]["passed"] is False
    # skipping the culprit passes
    assert onnxfuse.optimize(model, target="onnx", rules=RULES + [BreakConvWeights()], skip="test-break-conv")


def test_usage_and_type_errors(model_path):
    with pytest.raises(onnxfuse.UsageError, match="no-such-rule"):
        onnxfuse.optimize(model_path, only=["no-such-rule"])
    with pytest.raises(onnxfuse.UsageError, match="tpu"):
        onnxfuse.optimize(model_path, target="tpu")
    with pytest.raises(onnxfuse.ModelLoadError, match="no such file"):
        onnxfuse.optimize(model_path.parent / "nope.onnx")
    with pytest.raises(TypeError, match="ModelProto"):
        onnxfuse.optimize(b"not a model")


def test_report_equals_the_cli_json(model_path, tmp_path):
    out, cli_json = tmp_path / "out.onnx", tmp_path / "cli.json"
    npz = tmp_path / "in.npz"
    np.savez(npz, x=x())
    result = cli("optimize", model_path, out, "--inputs", npz, "--no-bench", "--json", cli_json, "--quiet")
    assert result.exit_code == 0, result.stderr
    api = onnxfuse.optimize(model_path, out, inputs={"x": x()})
    written = json.loads(cli_json.read_text())
    assert without_timings(api.to_json()) == without_timings(written)
    assert set(written["result"]["timings"]) == set(api.to_json()["result"]["timings"])


def test_report_times_every_stage(model_path):
    """Issue 35 item 8: the report says where a run's time went (load, rewrite, validation, timing)."""
    timings = onnxfuse.optimize(model_path, inputs={"x": x()}).to_json()["result"]["timings"]
    assert list(timings) == ["load_s", "rewrite_s", "validation_s", "timing_s", "total_s"]
    assert timings["load_s"] > 0 and timings["rewrite_s"] > 0 and timings["validation_s"] > 0
    assert timings["timing_s"] == 0  # bench is off by default in the API
    assert timings["load_s"] + timings["rewrite_s"] + timings["validation_s"] <= timings["total_s"] + 3e-4
    in_memory = onnxfuse.optimize(conv_bn_model(), inputs={"x": x()}).to_json()["result"]["timings"]
    assert in_memory["load_s"] == 0 and in_memory["total_s"] > 0


def test_markdown_report_times_every_stage_that_ran(model_path):
    from onnxfuse.reports.optimize_report import optimize_markdown

    text = optimize_markdown(onnxfuse.optimize(model_path, inputs={"x": x()}))
    line = next(ln for ln in text.splitlines() if ln.startswith("- **time**"))
    assert re.fullmatch(r"- \*\*time\*\*: load \d+\.\d\d s, rewrite \d+\.\d\d s, validation \d+\.\d\d s, "
                        r"total \d+\.\d\d s", line), line
    text = optimize_markdown(onnxfuse.optimize(conv_bn_model(), validate=False))
    line = next(ln for ln in text.splitlines() if ln.startswith("- **time**"))
    assert re.fullmatch(r"- \*\*time\*\*: rewrite \d+\.\d\d s, total \d+\.\d\d s", line), line


def test_failure_report_equals_the_cli_json(model_path, tmp_path, monkeypatch):
    out, cli_json = tmp_path / "out.onnx", tmp_path / "cli.json"
    with pytest.raises(onnxfuse.ValidationFailed) as info:
        onnxfuse.optimize(model_path, out, target="onnx", rules=RULES + [BreakConvWeights()])
    monkeypatch.setattr("onnxfuse.rewrites.RULES", RULES + [BreakConvWeights()])
    result = cli("optimize", model_path, out, "--target", "onnx", "--no-bench", "--json", cli_json, "--quiet")
    assert result.exit_code == 3
    assert without_timings(info.value.report.to_json()) == without_timings(json.loads(cli_json.read_text()))


# --------------------------------------------------------------------------------------------------
# diff


def scale_model(bias: np.ndarray | None = None) -> onnx.ModelProto:
    """y = 2·x (+ bias): A and B of a diff whose drift is known exactly."""
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("Mul", ["x", "two"], ["y" if bias is None else "s"])]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias.astype(np.float32), "bias"))
        nodes.append(helper.make_node("Add", ["s", "bias"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 6])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 6])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def numpy_metrics(ref: np.ndarray, got: np.ndarray, rtol: float, atol: float) -> dict:
    r, g = ref.astype(np.float64), got.astype(np.float64)
    diff = np.abs(g - r)
    rel_mask = np.abs(r) > atol
    return {
        "max_abs": diff.max(),
        "mean_abs": diff.mean(),
        "rms": np.sqrt((diff ** 2).mean()),
        "max_rel": (diff[rel_mask] / np.abs(r[rel_mask])).max(),
        "cosine": float(np.dot(r.ravel(), g.ravel()) / (np.linalg.norm(r) * np.linalg.norm(g))),
        "mismatch_fraction": float((diff > atol + rtol * np.abs(r)).mean()),
    }


def test_diff_numbers_match_numpy(tmp_path):
    bias = np.linspace(-3e-3, 3e-3, 6)
    a, b = scale_model(), scale_model(bias)
    before = (a.SerializeToString(), b.SerializeToString())
    samples = [{"x": np.random.default_rng(s).standard_normal((n, 6)).astype(np.float32)} for s, n in ((0, 4), (1, 4))]
    report = onnxfuse.diff(a, b, inputs=samples, rtol=1e-4, atol=1e-3)
    assert (a.SerializeToString(), b.SerializeToString()) == before
    assert isinstance(report, onnxfuse.DiffReport) and report.inputs["samples"] == 2
    ref = np.stack([2 * s["x"] for s in samples])
    got = np.stack([(2 * s["x"]) + bias.astype(np.float32) for s in samples])
    want = numpy_metrics(ref, got, rtol=1e-4, atol=1e-3)
    (c,) = report.outputs
    for key, value in want.items():
        assert getattr(c, key) == pytest.approx(value, rel=1e-5, abs=1e-9), key
    assert c.passed is (want["mismatch_fraction"] == 0.0)
    assert report.passed is False and report.failing() == ["y"]  # |bias| up to 3e-3 > atol 1e-3
    # drift is reported, never raised; a model against itself passes
    assert onnxfuse.diff(a, a, inputs=samples[0]).passed is True


def test_diff_report_equals_the_cli_json(tmp_path):
    a_path, b_path = tmp_path / "a.onnx", tmp_path / "b.onnx"
    onnx.save(scale_model(), str(a_path))
    onnx.save(scale_model(np.full(6, 1e-6)), str(b_path))
    npz = tmp_path / "in.npz"
    feeds = {"x": np.random.default_rng(3).standard_normal((5, 6)).astype(np.float32)}
    np.savez(npz, **feeds)
    cli_json = tmp_path / "diff.json"
    result = cli("diff", a_path, b_path, "--inputs", npz, "--intermediates", "--json", cli_json, "--quiet")
    assert result.exit_code == 0, result.stderr
    written = json.loads(cli_json.read_text())
    report = onnxfuse.diff(a_path, b_path, inputs=npz, intermediates=True)
    assert without_timings(report.to_json()) == without_timings(written)
    # in-memory inputs give the same numbers (the source is named differently)
    from_arrays = onnxfuse.diff(a_path, b_path, inputs=feeds, intermediates=True).to_json()
    assert from_arrays["result"]["inputs"]["source"] == "arrays"
    assert from_arrays["result"]["outputs"] == written["result"]["outputs"]
    assert from_arrays["result"]["passed"] is written["result"]["passed"] is True


def test_diff_argument_errors(tmp_path):
    a = scale_model()
    feeds = {"x": np.ones((1, 6), np.float32)}
    with pytest.raises(onnxfuse.UsageError, match="samples"):
        onnxfuse.diff(a, a, inputs=feeds, samples=3)
    with pytest.raises(onnxfuse.InputsError, match="dtype"):
        onnxfuse.diff(a, a, inputs={"x": np.ones((1, 6), np.int64)})
    with pytest.raises(TypeError):
        onnxfuse.diff(a, 3)


# --------------------------------------------------------------------------------------------------
# the README example, run as written


HEADING = "## Python API"


def readme_example() -> str:
    """The first ```python block under "## Python API" in README.md, else in README-API-SECTION.md (the
    section's draft, until it is merged into the README)."""
    for name in ("README.md", "README-API-SECTION.md"):
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_text()
        if HEADING not in text:
            continue
        section = re.split(r"^## ", text.split(HEADING, 1)[1], flags=re.M)[0]
        block = re.search(r"^```python\n(.*?)^```", section, re.S | re.M)
        assert block, f"{name}: no ```python block under {HEADING!r}"
        return block.group(1)
    pytest.fail(f"no {HEADING!r} section with a python example in README.md (or README-API-SECTION.md)")


# What the README's own example triggers in third-party code, by design: torch's notice about its legacy
# exporter (the example asks for it: the dynamo exporter is another path) and ONNX Runtime's notice that the
# CUDA provider the example lists first is absent on a CPU machine.
@pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:Specified provider 'CUDAExecutionProvider' is not in available provider names")
def test_readme_export_optimize_save_example(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    code = readme_example()
    assert "torch.onnx.export" in code and "dynamo=False" in code and "onnxfuse.optimize(" in code
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "README example", "exec"), namespace)  # asserts ORT's output against torch's itself
    optimized = onnx.load(str(tmp_path / "model.opt.onnx"))
    original = onnx.load(str(tmp_path / "model.onnx"))
    assert len(optimized.graph.node) < len(original.graph.node)
    assert "BatchNormalization" not in [n.op_type for n in optimized.graph.node]
    result = namespace["result"]
    assert result.validation.passed and result.output_path == "model.opt.onnx"
    # and independently of the example's own check: ONNX Runtime's output matches torch's
    import onnxruntime as ort

    from onnxfuse.custom_ops import session_options

    x = namespace["x"]
    session = ort.InferenceSession("model.opt.onnx", session_options(), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = namespace["model"](x).numpy()
    np.testing.assert_allclose(session.run(None, {"x": x.numpy()})[0], expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------
# bench


def test_bench_on_the_cpu_from_paths_and_protos(model_path):
    proto = conv_bn_model()
    before = proto.SerializeToString()
    seen = []
    report = onnxfuse.bench(model_path, proto, device="cpu", batch=2, iterations=5, warmup=1,
                            progress=lambda m, f: seen.append(f))
    assert isinstance(report, onnxfuse.BenchReport) and proto.SerializeToString() == before
    assert [r.stats.count for r in report.results] == [5, 5] and report.speedup > 0
    doc = report.to_json()
    assert doc["ok"] is True and doc["exit_code"] == 0 and doc["command"] == "bench"
    data = doc["result"]
    assert data["config"]["device"] == "cpu"
    assert [m["path"] for m in data["models"]] == [str(model_path), "<model 2>"]
    assert data["models"][0]["shapes"] == {"x": [2, 3, 8, 8]} and data["profiles"] is None
    assert json.loads(json.dumps(doc)) == doc
    assert seen and seen == sorted(seen) and all(0 <= f <= 1 + 1e-9 for f in seen)
    one = onnxfuse.bench(proto, device="cpu", iterations=3, warmup=0)
    assert len(one.results) == 1 and one.speedup is None and one.to_json()["result"]["speedup"] is None


def test_bench_json_has_the_keys_the_cli_writes(model_path, tmp_path):
    out = tmp_path / "b.json"
    r = cli("bench", model_path, "--device", "cpu", "--iterations", "3", "--warmup", "0", "--json", out)
    assert r.exit_code == 0, r.output
    report = onnxfuse.bench(model_path, device="cpu", iterations=3, warmup=0)
    cli_json, api_json = json.loads(out.read_text()), report.to_json()
    assert list(cli_json) == list(api_json) and list(cli_json["result"]) == list(api_json["result"])
    assert cli_json["result"]["config"] == api_json["result"]["config"]
    assert cli_json["environment"] == api_json["environment"]
    assert [m["path"] for m in cli_json["result"]["models"]] == [m["path"] for m in api_json["result"]["models"]]


def test_bench_argument_errors(model_path, tmp_path, monkeypatch):
    with pytest.raises(onnxfuse.UsageError, match="CUDA graphs need --device cuda"):
        onnxfuse.bench(model_path, device="cpu", cuda_graph=True)
    with pytest.raises(onnxfuse.UsageError, match="--iterations"):
        onnxfuse.bench(model_path, device="cpu", iterations=0)
    with pytest.raises(onnxfuse.UsageError, match="--batch"):
        onnxfuse.bench(model_path, device="cpu", batch=2, inputs=tmp_path / "x.npz")
    with pytest.raises(onnxfuse.UsageError, match="seed"):
        onnxfuse.bench(model_path, device="cpu", seed=-1)
    with pytest.raises(onnxfuse.ModelLoadError):
        onnxfuse.bench(tmp_path / "nope.onnx", device="cpu")
    with pytest.raises(TypeError):
        onnxfuse.bench(42, device="cpu")
    from onnxfuse.timing import bench as bench_lib

    monkeypatch.setattr(bench_lib, "gpu_unavailable_reason", lambda: "timing needs a CUDA GPU (none is usable here)")
    with pytest.raises(onnxfuse.RuntimeFailure, match="timing needs a CUDA GPU") as info:
        onnxfuse.bench(model_path)
    from onnxfuse.reports.contract import failure_document

    doc = failure_document("bench", info.value, info.value.exit_code)
    assert (doc["ok"], doc["exit_code"], doc["error"], doc["result"]) == (False, 1, str(info.value), None)


def test_bench_stays_the_function_after_the_timing_package_is_imported():
    import onnxfuse.timing  # noqa: F401  (a subpackage named bench would replace the function here)
    import onnxfuse.timing.bench  # noqa: F401

    assert callable(onnxfuse.bench) and onnxfuse.bench.__module__ == "onnxfuse.api"


def test_an_invalid_modelproto_is_the_callers_error_as_an_invalid_file_is(tmp_path):
    # the load check a file gets (onnx.checker on the repaired model) applies to a proto handed to the API,
    # to optimize, diff and bench alike: exit 1, the checker's reason, nothing written. Before, optimize only
    # checked its own output, and called the model's fault its internal error (exit 5).
    from onnxfuse.errors import ModelLoadError

    path = Path(__file__).resolve().parent.parent / "testdata" / "bad_undefined_input.onnx"
    model = onnx.load(str(path))
    for call in (lambda: onnxfuse.optimize(model, tmp_path / "out.onnx", validate=False),
                 lambda: onnxfuse.diff(model, model),
                 lambda: onnxfuse.bench(model, device="cpu")):
        with pytest.raises(ModelLoadError, match=r"^<model[^>]*>: invalid ONNX model: Nodes in a graph must be "
                                                 r"topologically sorted") as info:
            call()
        assert info.value.exit_code == 1
    assert not (tmp_path / "out.onnx").exists()
    with pytest.raises(ModelLoadError, match="invalid ONNX model: Nodes in a graph must be topologically sorted"):
        onnxfuse.optimize(path, validate=False)  # the same words for the file
