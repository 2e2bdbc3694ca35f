"""-v/--verbose, -q/--quiet and --log-level (issue 35): verbose prints every stage as a line with its start
time from the first second, then "done"; error level prints nothing on success; contradictions exit 2."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import TESTDATA


def _run(*args, tmp_path):
    env = dict(os.environ, COLUMNS="80", TERM="dumb")
    return subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(TESTDATA / "conv_bn_relu.onnx"),
                           str(tmp_path / "out.onnx"), "--provider", "cpu", *args], capture_output=True, text=True,
                          env=env, stdin=subprocess.DEVNULL)


def test_verbose_prints_every_stage_from_the_start_then_done(tmp_path):
    out = _run("-v", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    stages = [line for line in out.stderr.splitlines() if re.match(r"\[\s*\d+\.\d s\] ", line)]
    names = [line.split("] ", 1)[1] for line in stages]
    assert names[0] == "loading" and "rewriting" in names and "validating" in names and names[-1] == "done"
    assert "Rewrites" in out.stdout  # the report as usual


def test_default_prints_no_stage_line_for_a_quick_run(tmp_path):
    out = _run(tmp_path=tmp_path)
    assert out.returncode == 0 and not re.search(r"\[\s*\d+\.\d s\]", out.stderr)


@pytest.mark.parametrize("args", [["--log-level", "error"], ["-q"]])
def test_error_level_is_quiet(args, tmp_path):
    out = _run(*args, tmp_path=tmp_path)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == ""


@pytest.mark.parametrize("args", [["-q", "-v"], ["-q", "--log-level", "debug"], ["-v", "--log-level", "info"]])
def test_contradictions_are_usage_errors(args, tmp_path):
    out = _run(*args, tmp_path=tmp_path)
    assert out.returncode == 2 and "contradict" in out.stderr
    assert not (tmp_path / "out.onnx").exists()


def test_fail_on_slowdown_with_no_bench_is_a_usage_error(tmp_path):
    """It could never be checked: one line and exit 2, not a silent pass (issue 32)."""
    out = _run("--no-bench", "--fail-on-slowdown", "1.05", tmp_path=tmp_path)
    assert out.returncode == 2 and "--no-bench" in out.stderr and not (tmp_path / "out.onnx").exists()
