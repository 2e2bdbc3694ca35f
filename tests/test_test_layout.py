"""The tests mirror the code (issue 36 item 6): ``tests/rewrites/`` has one folder per package of
``onnxfuse/rewrites/`` (``fold``, ``contrib``, ``elementwise``, ``engine``, ``facts``), and every rule file
``onnxfuse/rewrites/FAMILY/NAME.py`` has its test file ``tests/rewrites/FAMILY/test_NAME.py`` (a family's
shared checks may live in other files of that folder too). Test modules import each other by basename
(there is no ``__init__.py`` under ``tests/``), so basenames are unique across ``tests/``."""

from __future__ import annotations

import importlib
from collections import Counter
from pathlib import Path

import onnxfuse.rewrites as rewrites
from helpers import ROOT, module_name
from onnxfuse.rewrites import ORDER, Rule

CODE = Path(rewrites.__file__).resolve().parent
TESTS = ROOT / "tests" / "rewrites"
FAMILIES = ("fold", "contrib", "elementwise")
#: Test modules directly in tests/rewrites/: they check the package as a whole (its layout, its one
#: refusal type), not one of its folders.
PACKAGE_WIDE = {"test_layout.py", "test_refusal_type.py"}


def rule_files() -> list[Path]:
    """Every file of a family folder that defines a rule: the registry's (``ORDER``) and any other (the
    unregistered contrib-bias-softmax)."""
    found = {CODE.joinpath(*rewrites.rule_module(e).split(".")[2:]).with_suffix(".py") for e in ORDER}
    for family in FAMILIES:
        for path in sorted((CODE / family).glob("*.py")):
            module = importlib.import_module(module_name(path))
            if any(isinstance(c, type) and issubclass(c, Rule) and c.__module__ == module.__name__ and c.name
                   for c in vars(module).values()):
                found.add(path)
    return sorted(found)


def missing_tests(tests_root: Path) -> list[str]:
    """``FAMILY/NAME.py`` for each rule file without ``tests_root/FAMILY/test_NAME.py``."""
    return [f"{p.parent.name}/{p.name}" for p in rule_files()
            if not (tests_root / p.parent.name / f"test_{p.name}").exists()]


def test_rule_files_are_found_through_the_registry():
    files = {f"{p.parent.name}/{p.stem}" for p in rule_files()}
    assert "fold/fold_batchnorm_conv" in files and "elementwise/fuse_elementwise" in files
    assert "contrib/contrib_bias_softmax" in files  # not registered (CUDA-only), still a rule file
    assert len(files) == len(ORDER) + 1


def test_every_rule_file_has_a_test_file_of_its_name():
    assert missing_tests(TESTS) == []


def test_the_check_catches_a_rule_file_without_its_test(tmp_path):
    for family in FAMILIES:
        (tmp_path / family).mkdir()
    (tmp_path / "fold" / "test_fold_batchnorm_conv.py").write_text("")
    missing = missing_tests(tmp_path)
    assert "fold/fold_batchnorm_conv.py" not in missing
    assert "fold/fold_batchnorm_gemm.py" in missing and "elementwise/fuse_elementwise.py" in missing
    assert len(missing) == len(rule_files()) - 1


def test_test_folders_mirror_the_packages():
    packages = {p.name for p in CODE.iterdir() if (p / "__init__.py").exists()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders == packages == {"fold", "contrib", "elementwise", "engine", "facts"}
    assert {p.name for p in TESTS.glob("test_*.py")} == PACKAGE_WIDE


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in (ROOT / "tests").rglob("*.py") if p.name != "conftest.py")
    assert [n for n, k in names.items() if k > 1] == []
