"""ONNX Runtime is the user's choice: missing, broken and doubly-installed runtimes are each one line
with the fix, from every command (exit 1 for errors, a warning on stderr otherwise) and from the API.

The three states are simulated in-process: ``sys.modules`` (a missing module, a leftover namespace
package without ``InferenceSession``, an import that fails) and ``importlib.metadata.version`` (which
distributions are installed)."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata
import importlib.util
import subprocess
import sys
import warnings
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from onnx import helper

import onnxfuse
from onnxfuse import ort_runtime
from onnxfuse.cli import main
from onnxfuse.errors import OnnxRuntimeConflictWarning, OnnxRuntimeUnavailable

ROOT = Path(__file__).resolve().parents[1]
_real_version = importlib.metadata.version


def fake_distributions(monkeypatch, installed: dict[str, str]) -> None:
    """``importlib.metadata`` reports exactly ``installed`` among the ONNX Runtime distributions."""

    def version(name):
        if name in ort_runtime.DISTRIBUTIONS:
            if name in installed:
                return installed[name]
            raise importlib.metadata.PackageNotFoundError(name)
        return _real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


def missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` → ModuleNotFoundError
    fake_distributions(monkeypatch, {})


def leftover_namespace(monkeypatch, tmp_path, installed):
    """What `pip uninstall` of one of two installed distributions leaves: an onnxruntime/ folder without
    __init__.py (the shared files are gone), which imports as an empty namespace package."""
    (tmp_path / "site" / "onnxruntime" / "capi").mkdir(parents=True)
    (tmp_path / "site" / "onnxruntime" / "capi" / "libonnxruntime_providers_cuda.so").write_bytes(b"")
    spec = importlib.machinery.PathFinder.find_spec("onnxruntime", [str(tmp_path / "site")])
    assert spec is not None and spec.origin in (None, "namespace")  # a namespace package, as in the wild
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "onnxruntime", module)
    fake_distributions(monkeypatch, installed)


class _FailingImport:
    """A meta-path finder under which `import onnxruntime` fails like a missing shared library."""

    def find_spec(self, name, path=None, target=None):
        if name == "onnxruntime":
            raise ImportError("libonnxruntime.so.1: cannot open shared object file: No such file or directory\nmore")
        return None


def failing_import(monkeypatch):
    monkeypatch.delitem(sys.modules, "onnxruntime", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_FailingImport(), *sys.meta_path])
    fake_distributions(monkeypatch, {"onnxruntime-gpu": "1.31.1"})


def tiny_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
                              "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(tiny_model(), str(path))
    return path


def commands(model_path, tmp_path):
    return {
        "optimize": ["optimize", model_path, tmp_path / "out.onnx"],
        "diff": ["diff", model_path, model_path],
        "bench": ["bench", model_path, "--device", "cpu", "--warmup", "1", "--iterations", "2"],
    }


def run(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def single_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# --------------------------------------------------------------------------------------------------
# missing / broken: exit 1, one line with the fix, nothing written


@pytest.mark.parametrize("command", ["optimize", "diff", "bench"])
def test_missing_runtime_is_one_line_exit_1(monkeypatch, tmp_path, model_path, command):
    missing(monkeypatch)
    result = run(commands(model_path, tmp_path)[command])
    assert result.exit_code == 1
    line = single_line(result.stderr)
    assert "Traceback" not in result.output
    assert line.startswith("error: ONNX Runtime is not installed")
    assert 'pip install "onnxfuse[gpu]"' in line and 'pip install "onnxfuse[cpu]"' in line
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("command", ["optimize", "diff", "bench"])
def test_leftover_package_without_inference_session_is_broken(monkeypatch, tmp_path, model_path, command):
    leftover_namespace(monkeypatch, tmp_path, {"onnxruntime-gpu": "1.31.1"})
    result = run(commands(model_path, tmp_path)[command])
    assert result.exit_code == 1
    line = single_line(result.stderr)
    assert line.startswith("error: ONNX Runtime is broken") and "InferenceSession" in line
    # the distribution still registered is the one to reinstall
    assert line.endswith("fix: pip install --force-reinstall onnxruntime-gpu"), line


def test_broken_fix_names_both_choices_when_none_is_registered(monkeypatch, tmp_path):
    leftover_namespace(monkeypatch, tmp_path, {})
    with pytest.raises(OnnxRuntimeUnavailable) as info:
        ort_runtime.import_onnxruntime()
    assert info.value.reason == "broken" and info.value.exit_code == 1
    assert "pip install --force-reinstall onnxruntime-gpu (NVIDIA GPU) or onnxruntime (CPU)" in str(info.value)
    assert "\n" not in str(info.value)


def test_failing_import_is_broken_in_one_line(monkeypatch, tmp_path, model_path):
    failing_import(monkeypatch)
    result = run(["optimize", model_path, tmp_path / "out.onnx", "--json", tmp_path / "r.json"])
    assert result.exit_code == 1
    line = single_line(result.stderr)
    assert "ONNX Runtime is broken" in line and "libonnxruntime.so.1" in line
    assert "pip install --force-reinstall onnxruntime-gpu" in line
    # like every exit-1 error of optimize, the JSON report says so
    import json

    data = json.loads((tmp_path / "r.json").read_text())
    assert (data["ok"], data["exit_code"], data["error"]) == (False, 1, line.removeprefix("error: "))
    assert data["result"] is None and data["environment"]["onnxruntime"] is None  # the runtime is what broke


def test_api_raises_the_documented_error(monkeypatch, tmp_path):
    missing(monkeypatch)
    with pytest.raises(OnnxRuntimeUnavailable) as info:
        onnxfuse.optimize(tiny_model())
    assert info.value.reason == "missing" and isinstance(info.value, onnxfuse.OnnxfuseError)
    with pytest.raises(OnnxRuntimeUnavailable):
        onnxfuse.diff(tiny_model(), tiny_model())
    leftover_namespace(monkeypatch, tmp_path, {"onnxruntime": "1.32.0"})
    with pytest.raises(OnnxRuntimeUnavailable) as info:
        onnxfuse.optimize(tiny_model())
    assert info.value.reason == "broken" and "pip install --force-reinstall onnxruntime" in str(info.value)


def test_metadata_says_installed_but_nothing_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    fake_distributions(monkeypatch, {"onnxruntime": "1.32.0"})
    with pytest.raises(OnnxRuntimeUnavailable) as info:
        ort_runtime.import_onnxruntime()
    assert info.value.reason == "broken" and "pip install --force-reinstall onnxruntime" in str(info.value)


def test_rules_needs_no_runtime(monkeypatch):
    missing(monkeypatch)
    assert run(["rules", "--json"]).exit_code == 0


# --------------------------------------------------------------------------------------------------
# both distributions installed: a one-line warning, the command still runs


@pytest.fixture
def both_installed(monkeypatch):
    monkeypatch.delenv(ort_runtime.IGNORE_CONFLICT_ENV, raising=False)
    monkeypatch.setattr(ort_runtime, "_warned", False)
    fake_distributions(monkeypatch, {"onnxruntime": "1.32.0", "onnxruntime-gpu": "1.31.1"})


@pytest.mark.parametrize("command", ["optimize", "diff", "bench"])
def test_both_installed_warns_in_one_line(both_installed, tmp_path, model_path, command):
    args = commands(model_path, tmp_path)[command]
    if command == "optimize":
        args += ["--target", "onnx", "--no-bench"]
    result = run(args)
    assert result.exit_code == 0, result.stderr
    line = single_line(result.stderr)
    assert line.startswith("warning: onnxruntime 1.32.0 and onnxruntime-gpu 1.31.1 are both installed")
    assert "fix: pip uninstall -y onnxruntime onnxruntime-gpu, then pip install onnxruntime-gpu" in line
    assert ort_runtime.IGNORE_CONFLICT_ENV in line


def test_both_installed_warning_is_silent_with_quiet_or_the_variable(both_installed, monkeypatch, tmp_path,
                                                                     model_path):
    result = run(["optimize", model_path, tmp_path / "o.onnx", "--quiet"])
    assert result.exit_code == 0 and result.stderr == "" and result.output == ""
    monkeypatch.setenv(ort_runtime.IGNORE_CONFLICT_ENV, "1")
    result = run(["diff", model_path, model_path])
    assert result.exit_code == 0 and result.stderr == ""


def test_api_warns_once_per_process(both_installed):
    with pytest.warns(OnnxRuntimeConflictWarning, match="pip uninstall -y onnxruntime onnxruntime-gpu"):
        onnxfuse.optimize(tiny_model(), target="onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("error", OnnxRuntimeConflictWarning)
        onnxfuse.diff(tiny_model(), tiny_model())


def test_one_distribution_is_no_conflict(monkeypatch):
    monkeypatch.delenv(ort_runtime.IGNORE_CONFLICT_ENV, raising=False)
    fake_distributions(monkeypatch, {"onnxruntime-gpu": "1.31.1"})
    assert ort_runtime.conflict_warning() is None
    assert ort_runtime.installed_distributions() == {"onnxruntime-gpu": "1.31.1"}


# --------------------------------------------------------------------------------------------------
# one import path for ONNX Runtime; `import onnxfuse` stays light


def _runtime_imports(path: Path) -> list[int]:
    """Lines of ``path`` importing onnxruntime outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    lines = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "onnxruntime" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "onnxruntime":
            lines.append(node.lineno)
    return lines


def test_every_onnxruntime_import_goes_through_the_helper():
    offenders = {}
    for path in sorted((ROOT / "onnxfuse").rglob("*.py")):
        if path.name == "ort_runtime.py":
            continue
        lines = _runtime_imports(path)
        if lines:
            offenders[str(path.relative_to(ROOT))] = lines
    assert offenders == {}, f"import onnxruntime through onnxfuse.ort_runtime.import_onnxruntime(): {offenders}"


def test_import_onnxfuse_is_light_and_the_library_never_imports_the_cli():
    code = (
        "import sys, onnxfuse\n"
        "assert callable(onnxfuse.optimize) and callable(onnxfuse.diff), onnxfuse.optimize\n"
        "heavy = [m for m in ('onnxruntime', 'onnx', 'numpy', 'onnx_graphsurgeon') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "import onnxfuse.pipeline, onnxfuse.drift, onnxfuse.reports, onnxfuse.runtime, onnxfuse.timing, onnxfuse.validate\n"
        "assert onnxfuse.OptimizeResult and onnxfuse.DiffReport and onnxfuse.ValidationFailed\n"
        "ui = [m for m in ('click', 'rich', 'onnxfuse.cli') if m in sys.modules]\n"
        "assert not ui, ui\n"
        "assert 'onnxruntime' not in sys.modules\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_runtime_works_here():
    """The environment running these tests has a usable ONNX Runtime (the other tests rely on it)."""
    ort = ort_runtime.import_onnxruntime()
    assert hasattr(ort, "InferenceSession")
