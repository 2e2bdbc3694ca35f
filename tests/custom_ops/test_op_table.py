"""One op table for both languages (issue 13).

``expr.OP_TABLE`` (plus ``custom_ops.LANGUAGE_VERSION``/``MAX_RANK`` and the kernel and NVRTC
constants of ``custom_ops.native``) is the definition; ``tools/gen_op_table.py`` writes
``csrc/op_table.gen.h`` from it, and the C++ library takes its ``enum Op``, op rows, CPU dispatch,
kernel names, NVRTC options and language version from that header. Here:

* the committed header is exactly the generator's output (so it cannot be edited by hand, nor go
  stale after a change to the Python table);
* the built library, asked through ``native.library_tables()``, reports the same ops in the same
  order with the same content (arity, ops.h function, dtypes, result rule, attributes and defaults,
  form, fast functions) and the same constants;
* each check is shown to fail on a planted disagreement (two rows swapped, one arity changed, a
  hand-swapped header that no longer compiles).
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

from onnxfuse.custom_ops import LANGUAGE_VERSION, expr, library_path, native

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "onnxfuse" / "custom_ops" / "csrc"
_spec = importlib.util.spec_from_file_location("gen_op_table", ROOT / "tools" / "gen_op_table.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)


def differences(got: dict, want: dict) -> list[str]:
    """Where the library's tables (got) differ from the Python ones (want), one line each."""
    out = []
    got_names = [o["name"] for o in got.get("ops", [])]
    want_names = [o["name"] for o in want["ops"]]
    if got_names != want_names:
        out.append(f"op order: library {got_names} != Python {want_names}")
    for k, (g, w) in enumerate(zip(got.get("ops", []), want["ops"])):
        if g != w:
            out.append(f"op row {k}: library {g} != Python {w}")
    for key in sorted(set(got) | set(want)):
        if key != "ops" and got.get(key) != want.get(key):
            out.append(f"{key}: library {got.get(key)!r} != Python {want.get(key)!r}")
    return out


def test_committed_header_is_the_generators_output():
    committed = (CSRC / "op_table.gen.h").read_text()
    assert committed == gen.render(), "csrc/op_table.gen.h is stale: run python tools/gen_op_table.py"


def test_generator_check_mode_agrees():
    r = subprocess.run([shutil.which("python") or "python", str(ROOT / "tools" / "gen_op_table.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_library_reports_the_python_table():
    got, want = native.library_tables(), gen.expected_tables()
    assert differences(got, want) == []
    # The rows are in expr.OP_TABLE order, name and arity as the parser uses them.
    assert [(o["name"], o["arity"]) for o in got["ops"]] == [(n, s.arity) for n, s in expr.OP_TABLE.items()]
    assert ctypes.CDLL(library_path()).onnxfuse_language_version() == LANGUAGE_VERSION


def test_python_constants_are_consistent(monkeypatch):
    assert native.VARIANT_ALL == sum(native.KERNEL_NAMES) == (1 << len(native.KERNELS)) - 1
    assert [native.VARIANT_FAST_VEC, native.VARIANT_FAST_SCALAR, native.VARIANT_BROADCAST,
            native.VARIANT_BROADCAST_VEC] == [1, 2, 4, 8]
    for env in ("ONNXFUSE_NVRTC_PATH", *native.NVRTC_ROOT_ENVS):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("CUDA_PATH", "/opt/cuda")
    names = native.NVRTC_LIBRARY_NAMES
    assert native.nvrtc_candidates() == [*names, *(f"{root}{sub}{n}" for root in ("/opt/cuda", "/usr/local/cuda")
                                                   for sub in native.NVRTC_ROOT_SUBDIRS for n in names)]
    for row in gen.expected_tables()["ops"]:
        assert row["form"] in gen.FORMS
    # Every op's ops.h function exists in ops.h (the CUDA generator calls it by name).
    ops_h = (CSRC / "ops.h").read_text()
    for spec in expr.OP_TABLE.values():
        if spec.op_type != "Cast":  # Cast calls ofx_cast_<dtype> (special form)
            assert f" {spec.c_function}(" in ops_h, spec.c_function


# ------------------------------------------------------------------ the checks can fail

def _swapped(rows: list, i: int, j: int) -> list:
    rows = list(rows)
    rows[i], rows[j] = rows[j], rows[i]
    return rows


def test_differences_finds_a_swap_and_a_changed_arity():
    want = gen.expected_tables()
    got = dict(want, ops=_swapped(want["ops"], 7, 8))  # Neg <-> Abs
    found = differences(got, want)
    assert any("op order" in d for d in found) and any("op row 7" in d for d in found), found
    bad = [dict(o) for o in want["ops"]]
    bad[10]["arity"] = 2  # Exp
    assert any("op row 10" in d for d in differences(dict(want, ops=bad), want))
    assert differences(dict(want, nvrtc_options=["--std=c++14"]), want)


def test_stale_header_is_detected(monkeypatch):
    items = list(expr.OP_TABLE.items())
    monkeypatch.setattr(expr, "OP_TABLE", dict(_swapped(items, 7, 8)))
    assert gen.render() != (CSRC / "op_table.gen.h").read_text()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_hand_swapped_header_does_not_compile(tmp_path):
    """Swapping two rows of kOps (or two enumerators) by hand breaks the header's static_asserts."""
    text = (CSRC / "op_table.gen.h").read_text()
    lines = text.splitlines(keepends=True)
    neg = next(k for k, l in enumerate(lines) if l.startswith('    {"Neg", '))
    abs_ = next(k for k, l in enumerate(lines) if l.startswith('    {"Abs", '))
    lines[neg], lines[abs_] = lines[abs_], lines[neg]
    for name, body in (("good", text), ("bad", "".join(lines))):
        d = tmp_path / name
        d.mkdir()
        (d / "op_table.gen.h").write_text(body)
        (d / "tu.cc").write_text('#include "op_table.gen.h"\nint main() { return 0; }\n')
        r = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", str(d / "tu.cc")], capture_output=True, text=True)
        if name == "good":
            assert r.returncode == 0, r.stderr
        else:
            assert r.returncode != 0 and "Op::Neg" in r.stderr, r.stderr
