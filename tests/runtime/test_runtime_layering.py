"""Layering of the runtime layer and its users, read from the source (ast), not from imports at run time.

* ``validate/``, ``drift.py`` (diff) and ``timing/`` (bench) take sessions, inputs and comparisons from
  ``onnxfuse.runtime`` only: none imports another of the three, and ``runtime/`` imports none of them.
(No module imports another's private names: tests/test_no_private_imports.py, for the whole package.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import ROOT, module_imports

PKG = ROOT / "onnxfuse"

USERS = {
    "validate": sorted((PKG / "validate").rglob("*.py")),
    "drift": [PKG / "drift.py"],
    "timing": sorted((PKG / "timing").rglob("*.py")),
}
RUNTIME = sorted((PKG / "runtime").rglob("*.py"))


def _owner(module: str) -> str | None:
    for user in USERS:
        prefix = "onnxfuse." + user
        if module == prefix or module.startswith(prefix + "."):
            return user
    return None


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_area_exists():
    assert RUNTIME and all(USERS.values())


@pytest.mark.parametrize("user", sorted(USERS))
def test_users_take_the_runtime_layer_from_runtime_only(user):
    bad = []
    for path in USERS[user]:
        for module, names in module_imports(path):
            other = _owner(module)
            if other is not None and other != user:
                bad.append(f"{_rel(path)} imports {module}")
            if module == "onnxfuse" and set(names) & {"validate", "drift", "timing"} - {user}:
                bad.append(f"{_rel(path)} imports {names} from onnxfuse")
            if module.split(".")[0] == "onnxruntime":
                bad.append(f"{_rel(path)} imports onnxruntime directly (use onnxfuse.ort_runtime)")
    assert not bad, bad


def test_runtime_imports_none_of_its_users():
    bad = [f"{_rel(p)} imports {m}" for p in RUNTIME for m, _ in module_imports(p) if _owner(m)]
    assert not bad, bad
