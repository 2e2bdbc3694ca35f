"""Layering of the runtime layer and its users, read from the source (ast), not from imports at run time.

* ``validate/``, ``drift.py`` (diff) and ``timing/`` (bench) take sessions, inputs and comparisons from
  ``onnxfuse.runtime`` only: none imports another of the three, and ``runtime/`` imports none of them.
* No module of this area imports a private (``_name``) module or name of another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "onnxfuse"

USERS = {
    "validate": sorted((PKG / "validate").rglob("*.py")),
    "drift": [PKG / "drift.py"],
    "timing": sorted((PKG / "timing").rglob("*.py")),
}
RUNTIME = sorted((PKG / "runtime").rglob("*.py"))
AREA = RUNTIME + [p for ps in USERS.values() for p in ps] + [PKG / "api.py", PKG / "__init__.py",
                                                               PKG / "cli" / "bench_cmd.py"]
#: (file, module imported from): private imports that remain, each with its reason.
ALLOWED_PRIVATE: set[tuple[str, str]] = set()


def _imports(path: Path):
    """(module, [names]) for every import in ``path``, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            yield module, [a.name for a in node.names]


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
        for module, names in _imports(path):
            other = _owner(module)
            if other is not None and other != user:
                bad.append(f"{_rel(path)} imports {module}")
            if module == "onnxfuse" and set(names) & {"validate", "drift", "timing"} - {user}:
                bad.append(f"{_rel(path)} imports {names} from onnxfuse")
            if module.split(".")[0] == "onnxruntime":
                bad.append(f"{_rel(path)} imports onnxruntime directly (use onnxfuse.ort_runtime)")
    assert not bad, bad


def test_runtime_imports_none_of_its_users():
    bad = [f"{_rel(p)} imports {m}" for p in RUNTIME for m, _ in _imports(p) if _owner(m)]
    assert not bad, bad


def test_no_private_names_of_other_modules():
    bad = []
    for path in AREA:
        own = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for module, names in _imports(path):
            if not module.startswith("onnxfuse") or module == own:
                continue
            private_module = any(part.startswith("_") and not part.startswith("__") for part in module.split("."))
            private_names = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if (private_module or private_names) and (_rel(path), module) not in ALLOWED_PRIVATE:
                bad.append(f"{_rel(path)}: from {module} import {', '.join(names)}")
    assert not bad, bad
