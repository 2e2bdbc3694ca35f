"""`onnxfuse diff` and :func:`onnxfuse.drift.diff_models`: metrics on known perturbations, intermediates,
exit codes, and the JSON report against its committed schema."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.cli import main
from onnxfuse.drift import TENSOR_MAP_KEY, diff_models, parse_tol_options
from onnxfuse.errors import InputsError, UsageError
from onnxfuse.reports import load_schema, schema_path
from onnxfuse.runtime.inputs import make_inputs

jsonschema = pytest.importorskip("jsonschema")

ROWS, K, COLS = 5, 3, 4
DELTA = 0.5
PERTURBED = (1, 2)  # W[k, j] += DELTA


def _model(nodes, inits, x_type=TensorProto.FLOAT, y_type=TensorProto.FLOAT, x_shape=("N", K), y_shape=("N", COLS),
           metadata=None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                              [helper.make_tensor_value_info("y", y_type, list(y_shape))], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for key, value in (metadata or {}).items():
        model.metadata_props.add(key=key, value=value)
    return model


def weights(delta=0.0, cols=COLS, dtype=np.float32) -> np.ndarray:
    w = (np.arange(K * cols, dtype=np.float32).reshape(K, cols) / 8.0 - 0.7)
    w[PERTURBED] += delta
    return w.astype(dtype)


def matmul(delta=0.0, cols=COLS, dtype=np.float32, onnx_type=TensorProto.FLOAT) -> onnx.ModelProto:
    """y = x · W; with ``delta`` one element of W is moved by ``delta``."""
    return _model([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
                  [numpy_helper.from_array(weights(delta, cols, dtype), "W")], x_type=onnx_type, y_type=onnx_type,
                  y_shape=("N", cols))


def chain(delta=0.0, rename_h2=None, metadata=None) -> onnx.ModelProto:
    """x → MatMul(W1) h1 → Relu r1 → MatMul(W2) h2 → Tanh t2 → MatMul(W3) y; the perturbation is in W2."""
    w1 = np.eye(K, dtype=np.float32)
    w2 = np.full((K, K), 0.25, dtype=np.float32)
    w2[0, 1] += delta
    w3 = np.ones((K, COLS), dtype=np.float32)
    h2 = rename_h2 or "h2"
    nodes = [
        helper.make_node("Abs", ["x"], ["ax"], name="abs"),  # keeps Relu from zeroing the perturbation
        helper.make_node("MatMul", ["ax", "W1"], ["h1"], name="m1"),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu"),
        helper.make_node("MatMul", ["r1", "W2"], [h2], name="m2"),
        helper.make_node("Tanh", [h2], ["t2"], name="tanh"),
        helper.make_node("MatMul", ["t2", "W3"], ["y"], name="m3"),
    ]
    inits = [numpy_helper.from_array(w, n) for w, n in ((w1, "W1"), (w2, "W2"), (w3, "W3"))]
    return _model(nodes, inits, metadata=metadata)


def save(model, tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    onnx.save(model, str(path))
    return str(path)


def validate_schema(payload: dict) -> None:
    schema = json.loads(schema_path().read_text())
    jsonschema.validate(payload, schema, cls=jsonschema.Draft202012Validator)


def test_schema_ships_inside_the_package():
    """The schema is package data (installed with onnxfuse), not a file of the source checkout's docs/."""
    import onnxfuse.reports

    path = schema_path()
    assert path.is_file()
    assert Path(onnxfuse.reports.__file__).resolve().parent in path.parents
    assert load_schema() == json.loads(path.read_text())
    jsonschema.Draft202012Validator.check_schema(load_schema())


def expected_error(seed=0, rows=ROWS):
    """|δ · x[:, k]| computed by hand from the inputs diff draws (A is fp32, so make_inputs matches)."""
    x = make_inputs(matmul(), {"x": [rows, K]}, seed=seed).feeds["x"].astype(np.float64)
    k, j = PERTURBED
    err = np.abs(DELTA * x[:, k])
    i = int(np.argmax(err))
    return err, i, j, x


# ---------------------------------------------------------------------------------------------------
# library


def test_known_perturbation_reports_exact_error():
    report = diff_models(matmul(), matmul(DELTA), shapes={"x": [ROWS, K]}, provider_a="cpu", provider_b="cpu")
    err, i, j, x = expected_error()
    (c,) = report.outputs
    assert c.max_abs == pytest.approx(err.max(), rel=1e-5)
    assert c.worst_index == [i, j]
    y_a = float(x[i] @ weights().astype(np.float64)[:, j])
    assert c.worst_ref == pytest.approx(y_a, rel=1e-5, abs=1e-6)
    assert c.worst_got == pytest.approx(y_a + DELTA * x[i, PERTURBED[0]], rel=1e-5, abs=1e-6)
    # Only column j moves; mean abs and RMS over all ROWS×COLS elements follow from err.
    assert c.mean_abs == pytest.approx(err.sum() / (ROWS * COLS), rel=1e-4)
    assert c.rms == pytest.approx(np.sqrt((err**2).sum() / (ROWS * COLS)), rel=1e-4)
    y_col = x @ weights().astype(np.float64)[:, j]
    beyond = np.count_nonzero(err > c.atol + c.rtol * np.abs(y_col))
    assert beyond > 0 and c.mismatch_fraction == pytest.approx(beyond / (ROWS * COLS))
    assert 0 < c.cosine < 1
    assert not c.passed and not report.passed
    assert report.failing() == ["y"]


def test_identical_models_report_zero_and_pass():
    report = diff_models(matmul(), matmul(), shapes={"x": [ROWS, K]}, samples=2, provider_a="cpu", provider_b="cpu")
    (c,) = report.outputs
    assert (c.max_abs, c.max_rel, c.mean_abs, c.rms, c.mismatch_fraction) == (0, 0, 0, 0, 0)
    assert c.cosine == pytest.approx(1.0)
    assert c.passed and report.passed and report.first_divergence is None
    assert report.inputs["seeds"] == [0, 1] and report.inputs["shapes"] == {"x": [ROWS, K]}
    validate_schema(report.to_json())


def test_nan_on_one_side_fails():
    w = weights()
    w[PERTURBED] = np.nan
    bad = _model([helper.make_node("MatMul", ["x", "W"], ["y"])], [numpy_helper.from_array(w, "W")])
    report = diff_models(matmul(), bad, shapes={"x": [ROWS, K]}, provider_a="cpu", provider_b="cpu")
    (c,) = report.outputs
    assert not c.passed and c.nonfinite_mismatches == ROWS
    assert c.worst_index[1] == PERTURBED[1] and c.worst_got is None  # NaN is reported as null
    payload = report.to_json()
    validate_schema(payload)
    assert payload["result"]["outputs"][0]["worst_got"] is None  # NaN written as null (strict JSON)
    json.dumps(payload, allow_nan=False)


def test_shape_mismatch_is_reported_not_raised():
    report = diff_models(matmul(), matmul(cols=COLS + 1), shapes={"x": [2, K]}, samples=2,
                         provider_a="cpu", provider_b="cpu")
    (c,) = report.outputs
    assert not c.passed and "shape mismatch" in c.error
    assert "[2, 4]" in c.error and "[2, 5]" in c.error
    assert report.histograms["y"] is None
    validate_schema(report.to_json())


def test_tolerance_flips_pass_fail_at_the_error():
    err, *_ = expected_error()
    e = float(err.max())
    kw = dict(shapes={"x": [ROWS, K]}, provider_a="cpu", provider_b="cpu", rtol=0.0)
    assert diff_models(matmul(), matmul(DELTA), atol=e * 1.001, **kw).passed
    assert not diff_models(matmul(), matmul(DELTA), atol=e * 0.999, **kw).passed
    # per-output override beats the global tolerance
    assert diff_models(matmul(), matmul(DELTA), atol=0.0, tolerances={"y": (0.0, e * 1.001)}, **kw).passed


def test_intermediates_find_first_divergence_in_the_middle():
    report = diff_models(chain(), chain(0.3), shapes={"x": [2, K]}, intermediates=True,
                         provider_a="cpu", provider_b="cpu")
    names = [c.name for c in report.intermediates]
    assert names == ["ax", "h1", "r1", "h2", "t2"]  # topological order, the output compared apart
    assert [c.passed for c in report.intermediates] == [True, True, True, False, False]
    fd = report.first_divergence
    assert fd["name"] == "h2" and fd["kind"] == "intermediate" and fd["node"] == "m2" and fd["op_type"] == "MatMul"
    assert [c.extra["position"] for c in report.intermediates] == [1, 2, 3, 4, 5]
    validate_schema(report.to_json())


@pytest.mark.parametrize("batch_size", [1, 2, 64])
def test_intermediates_in_batches_give_the_same_answer(batch_size):
    report = diff_models(chain(), chain(0.3), shapes={"x": [2, K]}, intermediates=True, batch_size=batch_size,
                         provider_a="cpu", provider_b="cpu")
    assert [(c.name, c.passed) for c in report.intermediates] == [
        ("ax", True), ("h1", True), ("r1", True), ("h2", False), ("t2", False)]
    assert report.first_divergence["name"] == "h2"


def test_models_are_not_modified():
    a, b = chain(), chain(0.3)
    before = (a.SerializeToString(), b.SerializeToString())
    diff_models(a, b, intermediates=True, batch_size=2, provider_a="cpu", provider_b="cpu")
    assert (a.SerializeToString(), b.SerializeToString()) == before


def test_tensor_map_pairs_absorbed_tensors():
    fused = chain(rename_h2="fused_h2", metadata={TENSOR_MAP_KEY: json.dumps({"h2": "fused_h2"})})
    report = diff_models(chain(), fused, intermediates=True, provider_a="cpu", provider_b="cpu")
    h2 = next(c for c in report.intermediates if c.name == "h2")
    assert h2.extra["name_b"] == "fused_h2" and h2.passed
    # without the map the renamed tensor is not compared, and that is said
    plain = diff_models(chain(), chain(rename_h2="fused_h2"), intermediates=True, provider_a="cpu", provider_b="cpu")
    assert "h2" not in [c.name for c in plain.intermediates]
    assert any("no counterpart" in n for n in plain.notes)
    # the map in A (A is the optimized one) is honoured inverted
    swapped = diff_models(fused, chain(), intermediates=True, provider_a="cpu", provider_b="cpu")
    assert any(c.name == "fused_h2" and c.extra["name_b"] == "h2" for c in swapped.intermediates)


def test_fp16_model_gets_the_same_draw_cast():
    fp16 = matmul(dtype=np.float16, onnx_type=TensorProto.FLOAT16)
    report = diff_models(matmul(), fp16, shapes={"x": [ROWS, K]}, provider_a="cpu", provider_b="cpu")
    (c,) = report.outputs
    assert report.inputs["dtypes_a"] == {"x": "float32"} and report.inputs["dtypes_b"] == {"x": "float16"}
    assert c.extra["dtype_b"] == "float16"
    assert c.passed, c  # fp16 defaults (the looser dtype) apply
    assert 0 < c.max_abs < 1e-2
    assert c.rtol == pytest.approx(1e-2)


def test_samples_cover_every_draw():
    one = diff_models(matmul(), matmul(DELTA), shapes={"x": [ROWS, K]}, provider_a="cpu", provider_b="cpu")
    three = diff_models(matmul(), matmul(DELTA), shapes={"x": [ROWS, K]}, samples=3, provider_a="cpu",
                        provider_b="cpu")
    worst = max(expected_error(seed=s)[0].max() for s in range(3))
    assert three.outputs[0].max_abs == pytest.approx(worst, rel=1e-5)
    assert three.outputs[0].max_abs >= one.outputs[0].max_abs
    assert three.outputs[0].shape == [ROWS, COLS] and "worst_sample" in three.outputs[0].extra


def test_bad_arguments():
    with pytest.raises(UsageError):
        diff_models(matmul(), matmul(), samples=0)
    with pytest.raises(UsageError, match="unknown tensor"):
        diff_models(matmul(), matmul(), tolerances={"nope": (0, 0)})
    with pytest.raises(UsageError, match="unknown input"):  # a usage error (exit 2), not the model's
        diff_models(matmul(), matmul(), shapes={"nope": [1]})
    other = _model([helper.make_node("Identity", ["z"], ["y"])], [], x_shape=(K,))
    other.graph.input[0].name = "z"
    with pytest.raises(InputsError, match="input 'z'"):
        diff_models(matmul(), other)


@pytest.mark.parametrize("value, ok", [("y:1e-3:1e-5", True), ("a:b:0.1:0", True), ("y:1e-3", False),
                                       ("y:x:1", False), (":1:1", False), ("y:-1:0", False), ("y:nan:0", False)])
def test_parse_tol(value, ok):
    if ok:
        name = value.rsplit(":", 2)[0]
        assert name in parse_tol_options([value])
    else:
        with pytest.raises(UsageError):
            parse_tol_options([value])


# ---------------------------------------------------------------------------------------------------
# CLI


@pytest.fixture
def pair(tmp_path):
    return save(matmul(), tmp_path, "a.onnx"), save(matmul(DELTA), tmp_path, "b.onnx")


def run(*args, env=None):
    return CliRunner().invoke(main, ["diff", *args], env=env)


def test_cli_pass_and_fail_exit_codes(pair, tmp_path):
    a, b = pair
    same = run(a, a, "--provider-a", "cpu", "--provider-b", "cpu")
    assert same.exit_code == 0, same.output
    assert "pass" in same.output
    differ = run(a, b, "--shape", f"x:{ROWS},{K}", "--provider-a", "cpu", "--provider-b", "cpu")
    assert differ.exit_code == 3, differ.output
    assert "FAIL" in differ.output and "y" in differ.output


def test_cli_exit_code_flips_at_atol(pair):
    a, b = pair
    e = float(expected_error()[0].max())
    base = [a, b, "--shape", f"x:{ROWS},{K}", "--rtol", "0", "-q"]
    assert run(*base, "--atol", repr(e * 1.001)).exit_code == 0
    assert run(*base, "--atol", repr(e * 0.999)).exit_code == 3
    assert run(*base, "--atol", "0", "--tol", f"y:0:{e * 1.001!r}").exit_code == 0


def test_cli_writes_every_report(pair, tmp_path):
    a, b = pair
    out = {k: tmp_path / f"r.{k}" for k in ("json", "md", "xml", "html")}
    result = run(a, b, "--shape", f"x:{ROWS},{K}", "--intermediates", "--samples", "2", "--json", str(out["json"]),
                 "--markdown", str(out["md"]), "--junit", str(out["xml"]), "--html", str(out["html"]), "-q")
    assert result.exit_code == 3
    payload = json.loads(out["json"].read_text())
    validate_schema(payload)
    assert payload["result"]["passed"] is False and payload["result"]["outputs"][0]["name"] == "y"
    assert payload["result"]["inputs"]["seed"] == 0 and payload["result"]["inputs"]["shapes"] == {"x": [ROWS, K]}
    assert payload["result"]["outputs"][0]["max_abs"] == pytest.approx(max(expected_error(seed=s)[0].max() for s in (0, 1)),
                                                              rel=1e-5)
    assert "❌" in out["md"].read_text()
    assert "<failure" in out["xml"].read_text()
    assert "<svg" in out["html"].read_text()
    # quiet prints only the failure line, on stderr
    assert result.stdout == ""


def test_cli_quiet_pass_prints_nothing(pair):
    a, _ = pair
    result = run(a, a, "-q")
    assert result.exit_code == 0 and result.output == ""


def test_cli_markdown_appends_to_github_step_summary(pair, tmp_path):
    a, _ = pair
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    result = run(a, a, "-q", "--markdown", str(summary), env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert result.exit_code == 0
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "onnxfuse diff" in text
    other = tmp_path / "other.md"
    other.write_text("old\n")
    run(a, a, "-q", "--markdown", str(other), env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert not other.read_text().startswith("old")


def test_cli_intermediates_names_first_divergence(tmp_path):
    a, b = save(chain(), tmp_path, "a.onnx"), save(chain(0.3), tmp_path, "b.onnx")
    result = CliRunner().invoke(main, ["diff", a, b, "--intermediates", "--batch-size", "2"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 3
    assert "first divergence" in result.output and "h2" in result.output and "MatMul" in result.output


def test_cli_inputs_npz(pair, tmp_path):
    a, b = pair
    x = np.zeros((2, K), dtype=np.float32)
    x[:, PERTURBED[0]] = [1.0, -4.0]
    npz = tmp_path / "in.npz"
    np.savez(npz, x=x)
    path = tmp_path / "r.json"
    result = run(a, b, "--inputs", str(npz), "--json", str(path), "-q")
    assert result.exit_code == 3
    payload = json.loads(path.read_text())
    assert payload["result"]["outputs"][0]["max_abs"] == pytest.approx(4.0 * DELTA)
    assert payload["result"]["inputs"]["seed"] is None and payload["result"]["inputs"]["source"] == str(npz)
    validate_schema(payload)


@pytest.mark.parametrize("args, code, words", [
    (["{a}", "{missing}"], 1, "no such file"),
    (["{a}", "{garbage}"], 1, "not a valid ONNX model"),
    (["{a}", "{a}", "--tol", "y:1e-3"], 2, "NAME:RTOL:ATOL"),
    (["{a}", "{a}", "--tol", "y:abc:1"], 2, "must be numbers"),
    (["{a}", "{a}", "--tol", "nope:1:1"], 2, "unknown tensor"),
    (["{a}", "{a}", "--shape", "x"], 2, "NAME:D0"),
    (["{a}", "{a}", "--shape", "nope:1,2"], 2, "unknown input"),
    (["{a}", "{a}", "--samples", "0"], 2, "samples"),
    (["{a}", "{a}", "--batch-size", "0"], 2, "batch-size"),
    (["{a}", "{a}", "--rtol", "-1"], 2, "--rtol"),
    (["{a}", "{a}", "--provider-a", "tpu"], 2, "provider-a"),
    (["{a}", "{a}", "--inputs", "{missing}"], 1, "no such inputs file"),
    (["{a}", "{a}", "--inputs", "{npz}", "--samples", "2"], 2, "--samples"),
    (["{a}", "{a}", "--json", "{nodir}/r.json"], 1, "does not exist"),
    (["{a}"], 2, "Missing argument"),
])
def test_cli_bad_inputs(pair, tmp_path, args, code, words):
    a, _ = pair
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not a model\xff" * 10)
    npz = tmp_path / "x.npz"
    np.savez(npz, x=np.zeros((1, K), np.float32))
    fmt = dict(a=a, missing=str(tmp_path / "missing.onnx"), garbage=str(garbage), npz=str(npz),
               nodir=str(tmp_path / "nodir"))
    result = run(*[s.format(**fmt) for s in args])
    assert result.exit_code == code, result.output
    assert words in result.output
    assert "Traceback" not in result.output
    if code == 1:
        lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:")


def test_cli_help_has_examples():
    result = CliRunner().invoke(main, ["diff", "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and "onnxfuse diff model.onnx model.opt.onnx" in result.output
    assert "Exit codes" in result.output


def test_subgraph_tensors_are_skipped():
    """Tensors inside an If body are not exposed (they cannot be graph outputs); the If output is compared."""
    def branch(name, op):
        out = helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)
        return helper.make_graph([helper.make_node(op, ["x"], [f"{name}_inner"]),
                                  helper.make_node("Identity", [f"{name}_inner"], [f"{name}_out"])], name, [], [out])

    nodes = [
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["picked"], then_branch=branch("then", "Relu"),
                         else_branch=branch("else", "Neg")),
        helper.make_node("MatMul", ["picked", "W"], ["y"]),
    ]
    model = _model(nodes, [numpy_helper.from_array(np.float32(0), "zero"), numpy_helper.from_array(weights(), "W")])
    report = diff_models(model, model, shapes={"x": [2, K]}, intermediates=True, provider_a="cpu", provider_b="cpu")
    names = [c.name for c in report.intermediates]
    assert "s" in names and "picked" in names
    assert not any("inner" in n or n.endswith("_out") for n in names)
    assert report.passed
