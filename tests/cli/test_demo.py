"""`onnxfuse demo` (issue 35, item 6): the quick start with no checkout. The sample models are valid and
deterministic, optimize applies rules to them and exits 0, and the commands the demo prints run as
printed (pasted into a shell), within 80 columns."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import onnx
import pytest
from click.testing import CliRunner

from onnxfuse import demo
from onnxfuse.cli import main


def run(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def cli(args, cwd, columns=80):
    env = {**os.environ, "COLUMNS": str(columns), "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "onnxfuse", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, env=env, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("name", sorted(demo.SAMPLES))
def test_samples_are_valid_and_deterministic(name):
    model = demo.SAMPLES[name]()
    onnx.checker.check_model(model, full_check=True)
    assert model.SerializeToString() == demo.SAMPLES[name]().SerializeToString()
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim][0] == "batch"


def test_demo_writes_the_samples_and_prints_commands_that_run(tmp_path):
    proc = cli(["demo"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    folder = tmp_path / demo.DEFAULT_DIR
    assert sorted(p.name for p in folder.iterdir()) == ["conv_block.onnx", "mlp_block.onnx"]
    assert (folder / "mlp_block.onnx").read_bytes() == demo.mlp_block().SerializeToString()
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    # the printed commands, continuation lines joined, as a shell reads them
    commands = " ".join(line.strip() for line in lines[lines.index("Next:") + 1:] if not line.strip().startswith("#"))
    commands = [c.strip() for c in commands.replace(" \\ ", " ").split("onnxfuse optimize ") if c.strip()]
    assert commands == [
        "onnxfuse-demo --out-dir onnxfuse-demo/optimized --json onnxfuse-demo/report.json",
        "onnxfuse-demo/conv_block.onnx onnxfuse-demo/conv_block.opt.onnx",
        "onnxfuse-demo/mlp_block.onnx onnxfuse-demo/mlp_block.opt.onnx --explain",
    ]
    both = cli(["optimize", *commands[0].split()], cwd=tmp_path)
    assert both.returncode == 0, both.stderr
    report = json.loads((folder / "report.json").read_text())
    conv, mlp = (m["result"] for m in report["result"]["models"])
    assert conv["nodes"] == {"before": 13, "after": 9}
    assert conv["rewrites"]["counts"]["fold-batchnorm-conv"] == 3
    assert mlp["nodes"] == {"before": 29, "after": 5}
    assert {k: mlp["rewrites"]["counts"][k] for k in ("contrib-layernorm", "contrib-bias-gelu",
                                                        "contrib-skip-layernorm")} == \
        {"contrib-layernorm": 1, "contrib-bias-gelu": 1, "contrib-skip-layernorm": 1}
    assert conv["validation"]["passed"] and mlp["validation"]["passed"]
    for command in commands[1:]:
        proc = cli(["optimize", *command.split()], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    assert (folder / "conv_block.opt.onnx").exists() and (folder / "mlp_block.opt.onnx").exists()


def test_running_it_again_keeps_the_samples_and_refuses_a_users_file(tmp_path):
    folder = tmp_path / "d"
    assert run(["demo", folder, "--quiet"]).exit_code == 0
    result = run(["demo", folder, "--quiet"])  # the same bytes: fine
    assert result.exit_code == 0 and result.output == ""
    (folder / "conv_block.onnx").write_bytes(b"the user's own model")
    result = run(["demo", folder])
    assert result.exit_code == 1
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "conv_block.onnx" in err[0] and "--force" in err[0]
    assert (folder / "conv_block.onnx").read_bytes() == b"the user's own model"
    assert run(["demo", folder, "--force", "--quiet"]).exit_code == 0
    assert (folder / "conv_block.onnx").read_bytes() == demo.conv_block().SerializeToString()


def test_run_optimizes_both_and_exits_0(tmp_path):
    folder = tmp_path / "with space"
    result = run(["demo", folder, "--run"])
    assert result.exit_code == 0, result.stderr
    assert sorted(p.name for p in (folder / "optimized").iterdir()) == ["conv_block.onnx", "mlp_block.onnx"]
    assert "2 of 2 ok" in result.output
    assert "[1/2] conv_block.onnx ... ok" in result.stderr and "[2/2] mlp_block.onnx ... ok" in result.stderr


def test_commands_quote_a_folder_with_a_space():
    (what, words), *_ = demo.next_commands("my models")
    assert words == ["onnxfuse", "optimize", "'my models'", "--out-dir", "'my models/optimized'", "--json",
                     "'my models/report.json'"]


def test_shell_lines_fit_and_keep_flags_with_their_values():
    from onnxfuse.cli.layout import shell_lines

    words = ["onnxfuse", "optimize", "a" * 30, "--out-dir", "b" * 30, "--json", "c" * 20]
    lines = shell_lines(words, 54)
    assert lines == ["  onnxfuse optimize " + "a" * 30 + " \\", "      --out-dir " + "b" * 30 + " \\",
                     "      --json " + "c" * 20]
    assert all(len(line) <= 54 for line in lines)
