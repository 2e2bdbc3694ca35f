"""The layout of ``onnxfuse/rewrites`` (issue 13): one rule per file named after the rule, no rule
imports another rule, one registry, the graph facts below the engine and the families (issue 36). Each
rule file's test file: tests/test_test_layout.py. No module imports another's private names:
tests/test_no_private_imports.py."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import onnxfuse.rewrites as rewrites
from helpers import module_imports, module_name
from onnxfuse.rewrites import ORDER, RULES, Rule

ROOT = Path(rewrites.__file__).resolve().parent
FAMILIES = ("fold", "contrib", "elementwise")


def _modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _rules_defined(module_name: str) -> list[type]:
    module = importlib.import_module(module_name)
    return [c for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, Rule) and c.__module__ == module_name and c.name]


def _rule_modules() -> set[str]:
    return {name for name in _modules() if _rules_defined(name)}


def test_every_rule_lives_in_a_family_file_named_after_it():
    seen = []
    for name, path in _modules().items():
        rules = _rules_defined(name)
        if not rules:
            continue
        assert path.parent.name in FAMILIES, f"{path} defines rules outside a family folder"
        assert len(rules) == 1, f"{path} defines {len(rules)} rules: {[r.name for r in rules]}"
        assert path.stem == rules[0].name.replace("-", "_"), f"{path} holds rule {rules[0].name!r}"
        seen.append(f"{path.parent.name}/{rules[0].name}")
    registered = [f"{rewrites.rule_module(e).split('.')[-2]}/{e.split('/')[1]}" for e in ORDER]
    assert set(registered) <= set(seen)
    assert [r.name for r in RULES] == [e.split("/")[1] for e in ORDER]
    # The one rule file not registered (CUDA-only, no CPU kernel), so that a new unregistered file is a decision.
    assert sorted(set(seen) - set(registered)) == ["contrib/contrib-bias-softmax"]


def test_facts_sit_below_the_engine_and_the_families():
    """``rewrites/facts/`` (issue 36 item 2) imports no rule family, and from the engine only the rule
    contract's ``Refuse`` (``engine.rule``) and ``engine.edit``'s ``replace_reads``: the engine and the
    families build on the facts, not the other way round."""
    allowed = {"onnxfuse.rewrites.engine.rule": {"Refuse"}, "onnxfuse.rewrites.engine.edit": {"replace_reads"}}
    bad = []
    for name, path in _modules().items():
        if not name.startswith("onnxfuse.rewrites.facts"):
            continue
        for target, names in module_imports(path):
            if not target.startswith("onnxfuse.rewrites") or target.startswith("onnxfuse.rewrites.facts"):
                continue
            if target not in allowed or not set(names) <= allowed[target]:
                bad.append(f"{name} imports {target}: {sorted(names)}")
    assert bad == []


def test_the_engine_imports_no_family():
    families = tuple(f"onnxfuse.rewrites.{f}" for f in FAMILIES)
    bad = [f"{name} imports {target}" for name, path in _modules().items() if name.startswith("onnxfuse.rewrites.engine")
           for target, _ in module_imports(path) if target.startswith(families)]
    assert bad == []


def test_no_rule_imports_another_rule():
    rule_modules = _rule_modules()
    for name, path in _modules().items():
        if name == "onnxfuse.rewrites":  # the registry loads the rules by name
            continue
        for target, names in module_imports(path):
            candidates = {target} | {f"{target}.{n}" for n in names}
            hit = sorted((candidates & rule_modules) - {name})
            assert not hit, f"{path.relative_to(ROOT)} imports the rule module {hit[0]}"


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_rules_keep_no_state(rule):
    """Plans carry the analysis from check to rewrite: a rule instance has no attributes of its own."""
    assert vars(rule) == {}


def test_rule_docstrings_moved_with_their_rules():
    for entry in ORDER:
        module = importlib.import_module(rewrites.rule_module(entry))
        assert module.__doc__ and len(module.__doc__.strip()) > 80, f"{module.__name__} has no real docstring"
