"""Imports only go down the layers (issue 36), read from the source (ast), function-level imports included:
a module may import its own layer and the ones below, never one above. ``onnxfuse.__version__`` is the one
name every layer may read from the package.

The layers, lowest first, and why each sits where it does:

0. foundation: errors, atomic output, the one import of ONNX Runtime (``ort_runtime``; graphsurgeon's
   constant folding, a rewrite, runs on it), weights kept on disk (``lazy_weights``);
1. the graph: loading and saving (``model_io``, which repairs at load: ``repair``; output shapes checked
   on export: ``declared_shapes``), the rewrites (with ``rewrites.facts``, and ``bodies``, which runs them
   inside If/Loop bodies, each as a model of its own; the facts about a graph of
   either format that ``model_io``, ``precision`` and ``runtime`` read too), the custom ops, the float16
   conversion (with ``ort_types``: the types ONNX Runtime's own ops write, from its schemas), what stayed
   unfused;
2. running models: ``runtime`` (sessions, inputs, the comparator, its histograms, what a run ran on);
3. the report contract (``reports``: JSON envelope, schema, Markdown, JUnit, HTML), which the results
   of the layer above serialize themselves through;
4. judging and measuring: ``validate``, ``drift`` (diff), ``timing`` (bench), ``selection``,
   ``tuning_record``, ``tune_sizes`` (the ``--tune-shape`` draws and timings: validation's samples at
   other sizes), ``precision_kernels`` (which nodes stay float32 under ``--precision bf16``, and whether
   this run can check bfloat16: it asks ``runtime`` for a usable CUDA provider);
5. the pipelines and the API: ``options`` (optimize's options, declared once: their checks use the
   parsers of the layers below), ``pipeline``, ``batch``, ``demo``, ``api``, the package itself;
6. the command line (``cli``, ``__main__``).

And imports sit at the top of a module unless there is a reason: a function-level import carries a comment
saying why (it would load onnx, ONNX Runtime, graphsurgeon or numpy at start-up, which ``import onnxfuse``
and the CLI's start must not; an import cycle; a test standing in for the name), on its line or the line
above it (or above the run of imports it belongs to).
"""

from __future__ import annotations

import ast

import pytest

from helpers import ROOT, module_imports, module_name

LAYERS = [
    ("errors", "atomic", "ort_runtime", "lazy_weights"),
    ("model_io", "repair", "declared_shapes", "rewrites", "bodies", "custom_ops", "precision", "ort_types",
     "unfused"),
    ("runtime",),
    ("reports",),
    ("validate", "drift", "timing", "selection", "tuning_record", "tune_sizes", "precision_kernels"),
    ("options", "pipeline", "batch", "demo", "api", "__init__"),
    ("cli", "__main__"),
]
EVERYWHERE = {"onnxfuse.__version__"}
MODULES = sorted((ROOT / "onnxfuse").rglob("*.py"))


def layer_of(module: str) -> int | None:
    """The layer of a dotted onnxfuse module name; None outside the package."""
    parts = module.split(".")
    if parts[0] != "onnxfuse":
        return None
    top = parts[1] if len(parts) > 1 else "__init__"
    for k, names in enumerate(LAYERS):
        if top in names:
            return k
    raise AssertionError(f"{module}: in no layer (add it to LAYERS, with why)")


def upward_imports(path) -> list[str]:
    me = layer_of(module_name(path))
    bad = []
    for module, names in module_imports(path):
        targets = [f"{module}.{n}" for n in names] if module == "onnxfuse" else [module]
        for target in targets:
            if target in EVERYWHERE:
                continue
            other = layer_of(target)
            if other is not None and other > me:
                bad.append(f"{module_name(path)} (layer {me}) imports {target} (layer {other})")
    return bad


def test_every_module_has_a_layer():
    for path in MODULES:
        assert layer_of(module_name(path)) is not None


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_imports_only_go_down(path):
    assert upward_imports(path) == []


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    import helpers

    monkeypatch.setattr(helpers, "module_imports", lambda p: [("onnxfuse.cli.render", ["x"])])
    monkeypatch.setattr(__import__(__name__), "module_imports", lambda p: [("onnxfuse.cli.render", ["x"])])
    assert upward_imports(ROOT / "onnxfuse" / "runtime" / "compare.py") == [
        "onnxfuse.runtime.compare (layer 2) imports onnxfuse.cli.render (layer 6)"]


def unexplained_lazy_imports(path) -> list[str]:
    """``LINE: import`` for each import inside a function of ``path`` that has no comment on its line, or on
    the line above it or above the run of import lines it belongs to."""
    lines = path.read_text().splitlines()
    bad = []
    for func in ast.walk(ast.parse("\n".join(lines), str(path))):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            above = node.lineno - 2  # index of the line above
            while above >= 0 and lines[above].lstrip().startswith(("import ", "from ")):
                above -= 1
            if "#" in lines[node.lineno - 1] or (above >= 0 and lines[above].lstrip().startswith("#")):
                continue
            bad.append(f"{node.lineno}: {lines[node.lineno - 1].strip()}")
    return sorted(set(bad), key=lambda b: int(b.split(":")[0]))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_function_level_import_says_why(path):
    assert unexplained_lazy_imports(path) == []


def test_the_check_catches_an_unexplained_function_level_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import json\n\n\n"
                      "def explained():\n"
                      "    # start-up: onnx is heavy\n"
                      "    import onnx\n"
                      "    from onnx import helper\n"
                      "    import numpy  # start-up\n\n\n"
                      "def unexplained():\n"
                      "    x = 1\n"
                      "    from onnxfuse import model_io\n"
                      "    return model_io, x\n")
    assert unexplained_lazy_imports(module) == ["13: from onnxfuse import model_io"]
