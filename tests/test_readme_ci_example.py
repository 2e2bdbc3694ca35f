"""The README's CI example must run as written: execute its `run:` steps (all but the install) in a
shell from the repository root, with a GitHub-style step summary file, and check what they produce."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ci_run_steps() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Use in CI", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    return [m.group(1).strip() for m in re.finditer(r"^\s*- run: (.+)$", block, re.M)]


def test_readme_ci_steps_run_as_written(tmp_path):
    steps = ci_run_steps()
    assert steps[0].startswith("pip install"), steps
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copytree(ROOT / "testdata", work / "testdata")
    summary = tmp_path / "summary.md"
    env = dict(os.environ, GITHUB_STEP_SUMMARY=str(summary))
    # `onnxfuse` is the console script; make sure the one of this interpreter's environment is found.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    for step in steps[1:]:
        done = subprocess.run(step, shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (step, done.stdout[-2000:], done.stderr[-2000:])
    report = json.loads((work / "optimize.json").read_text())
    assert report["ok"] is True and report["result"]["validation"]["passed"] is True
    assert (work / "model.opt.onnx").exists() and (work / "optimize.xml").exists() and (work / "diff.xml").exists()
    text = summary.read_text()
    assert "onnxfuse optimize: ✅ ok" in text and "onnxfuse diff" in text
