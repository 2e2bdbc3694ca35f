"""Imports only go down the layers (issue 36), read from the source (ast), function-level imports included:
a module may import its own layer and the ones below, never one above. ``onnxfuse.__version__`` is the one
name every layer may read from the package.

The layers, lowest first, and why each sits where it does:

0. foundation: errors, atomic output, the one import of ONNX Runtime (``ort_runtime``; graphsurgeon's
   constant folding, a rewrite, runs on it), weights kept on disk (``lazy_weights``);
1. the graph: loading and saving (``model_io``, which repairs at load: ``repair``; output shapes checked
   on export: ``declared_shapes``), the rewrites (with ``rewrites.facts``, the facts about a graph of
   either format that ``model_io``, ``precision`` and ``runtime`` read too), the custom ops, the float16
   conversion, what stayed unfused;
2. running models: ``runtime`` (sessions, inputs, the comparator, its histograms, what a run ran on);
3. the report contract (``reports``: JSON envelope, schema, Markdown, JUnit, HTML), which the results
   of the layer above serialize themselves through;
4. judging and measuring: ``validate``, ``drift`` (diff), ``timing`` (bench), ``selection``,
   ``tuning_record``;
5. the pipelines and the API: ``options`` (optimize's options, declared once: their checks use the
   parsers of the layers below), ``pipeline``, ``batch``, ``demo``, ``api``, the package itself;
6. the command line (``cli``, ``__main__``).
"""

from __future__ import annotations

import pytest

from helpers import ROOT, module_imports, module_name

LAYERS = [
    ("errors", "atomic", "ort_runtime", "lazy_weights"),
    ("model_io", "repair", "declared_shapes", "rewrites", "custom_ops", "precision", "unfused"),
    ("runtime",),
    ("reports",),
    ("validate", "drift", "timing", "selection", "tuning_record"),
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
