"""No module imports another module's private names (issue 13): a leading underscore means "only this
module relies on it", so a helper two modules share gets a public name in a module of its own.

Every module of the package, every import (top level or inside a function): ``from m import _name``
and imports of a private module (``m._helpers``) are refused. Dunder names (``__version__``) are
public by convention.
"""

from __future__ import annotations

from pathlib import Path

from helpers import ROOT, module_imports, module_name

PACKAGE = ROOT / "onnxfuse"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(path: Path) -> list[str]:
    here = module_name(path)
    found = []
    for module, names in module_imports(path):
        if module == here:
            continue
        if any(_private(p) for p in module.split(".")):
            found.append(f"{module} (a private module)")
        found += [f"{module}.{n}" for n in names if _private(n)]
    return found


def test_no_module_imports_another_modules_private_names():
    offenders = {str(p.relative_to(ROOT)): private_imports(p) for p in sorted(PACKAGE.rglob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_catches_private_imports():
    probe = PACKAGE / "cli" / "_probe_for_test.py"
    assert not probe.exists()
    probe.write_text("from onnxfuse.reports.formatting import _hidden\n"
                     "def f():\n    import onnxfuse.rewrites._x\n"
                     "from . import _y\nfrom onnxfuse import __version__\n")
    try:
        assert sorted(private_imports(probe)) == ["onnxfuse.cli._y", "onnxfuse.reports.formatting._hidden",
                                                  "onnxfuse.rewrites._x (a private module)"]
    finally:
        probe.unlink()
