"""Terminal output in an 80-column CI log (no TTY): no identifier cut, no column dropped, no flag split,
and `--explain` summarizing where `--explain-all` lists.

Before: `onnxfuse rules` printed `fold-batchnorm-convtra…` at 80 columns, the bench table squeezed its
speed-up column to nothing, and `--explain` printed a line per refusal.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter

import pytest
from click.testing import CliRunner
from rich.console import Console
from rich.text import Text

from onnxfuse.cli import main
from onnxfuse.cli.common import stdout
from onnxfuse.cli.layout import Column, FitTable, wrap_prose
from onnxfuse.cli.render import reason_pattern
from onnxfuse.rewrites import RULES

from pathlib import Path

TESTDATA = Path(__file__).resolve().parents[2] / "testdata"
BOX = "│┃"


def cells(line: str) -> list[str]:
    """The cells of one table row (box characters removed, stripped)."""
    return [c.strip() for c in re.split(f"[{BOX}]", line)[1:-1]]


def render(renderable, width: int) -> list[str]:
    console = Console(width=width, file=open(os.devnull, "w"), color_system=None)
    with console.capture() as cap:
        console.print(renderable)
    return cap.get().splitlines()


@pytest.fixture
def narrow(monkeypatch):
    """The CLI's stdout console at 80 columns, as in a CI log without a TTY."""
    monkeypatch.setattr(stdout, "_width", 80)
    yield


def test_rules_at_80_columns_without_a_tty_keeps_every_rule_name_and_word_whole():
    env = dict(os.environ, COLUMNS="80", TERM="dumb")
    out = subprocess.run([sys.executable, "-m", "onnxfuse", "rules"], capture_output=True, text=True, env=env,
                         stdin=subprocess.DEVNULL, check=True).stdout
    lines = out.splitlines()
    heads = [x for x in lines[2:] if x and not x.startswith(" ")]
    assert [h.split("  [")[0] for h in heads] == [r.name for r in RULES]  # each name whole, in run order
    described, key = {}, None
    for x in lines[2:]:
        if x and not x.startswith(" "):
            key = x.split("  [")[0]
        elif x.strip():
            described[key] = described.get(key, []) + [x.strip()]
    for rule in RULES:  # the description's words, in order, none split across lines
        assert " ".join(described[rule.name]) == " ".join(rule.description.split())
    for x in lines:  # a line runs past 80 only for one word that is longer by itself
        assert Text(x).cell_len <= 80 or len(x.split()) == 1, x


def test_fit_table_splits_instead_of_dropping_and_repeats_the_key_column():
    table = FitTable("T", [Column("name", "id")] + [Column(f"metric{i}", "num") for i in range(8)])
    table.add_row("a-rather-long-identifier-name", *[f"{i}.123456e-05" for i in range(8)])
    wide = render(table, 300)
    narrow = render(table, 80)
    assert sum("T" == x.strip() for x in wide) == 1 and not any("continued" in x for x in wide)
    assert any("(continued)" in x for x in narrow)
    assert max(Text(x).cell_len for x in narrow) <= 80
    rows = [cells(x) for x in narrow if x.startswith("│")]
    assert all(r[0] == "a-rather-long-identifier-name" for r in rows)  # every part repeats it, whole
    values = [v for r in rows for v in r[1:]]
    assert values == [f"{i}.123456e-05" for i in range(8)]  # every column present, in order, uncut
    headers = [h for x in narrow if x.startswith("┃") for h in cells(x)[1:]]
    assert headers == [f"metric{i}" for i in range(8)]


def test_fit_table_never_squeezes_prose_to_nothing():
    table = FitTable(None, [Column("rule", "id"), Column("ids", "id"), Column("what", "text")])
    table.add_row("x" * 30, "y" * 30, "a description that has to wrap over several lines at this width")
    lines = render(table, 80)
    assert max(Text(x).cell_len for x in lines) <= 80
    headers = [cells(x) for x in lines if x.startswith("┃")]
    assert headers == [["rule", "ids"], ["rule", "what"]]  # split, not squeezed
    rows = [cells(x) for x in lines if x.startswith("│")]
    assert [r[1] for r in rows if r[0] == "x" * 30][0] == "y" * 30
    text = " ".join(r[1] for r in rows[1:])
    assert text.split() == "a description that has to wrap over several lines at this width".split()


@pytest.mark.parametrize("width", [30, 40, 60])
def test_wrap_prose_keeps_flags_with_their_values_and_backticked_spans(width):
    text = ("validation failed on output 'logits'; rerun with --skip contrib-fast-gelu or pass "
            "--input-range ids:0,30521 to draw realistic ids, or see `onnxfuse optimize --help` for more")
    lines = wrap_prose(text, width)
    joined = "\n".join(lines)
    for span in ("--skip contrib-fast-gelu", "--input-range ids:0,30521", "`onnxfuse optimize --help`"):
        assert span in joined  # on one line
    assert " ".join(lines).split() == text.split()
    assert all(len(x) <= width for x in lines if "`" not in x)


def test_explain_counts_per_rule_and_reason_and_explain_all_lists_each(narrow, tmp_path):
    model = TESTDATA / "vit_blocks_opset14.onnx"
    report = tmp_path / "r.json"
    brief = CliRunner().invoke(main, ["optimize", str(model), str(tmp_path / "a.onnx"), "--explain", "--no-validate",
                                      "--json", str(report)], catch_exceptions=False)
    assert brief.exit_code == 0, brief.output
    full = CliRunner().invoke(main, ["optimize", str(model), str(tmp_path / "b.onnx"), "--explain-all",
                                     "--no-validate"], catch_exceptions=False)
    assert full.exit_code == 0, full.output
    refusals = json.loads(report.read_text())["result"]["rewrites"]["refusals"]
    expected = Counter((r["rule"], reason_pattern(r["reason"])) for r in refusals)
    assert len(expected) < len(refusals)  # the model has reasons that differ only in names

    lines = brief.output.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("Refused candidates"))
    shown, current = Counter(), None
    for x in lines[start + 4:]:
        if not x.startswith("│"):
            break
        rule, count, reason = cells(x)[:3]  # the example node may follow in a continued part
        if rule:
            current = [rule, int(count), reason]
            shown[(current[0], current[2])] = current[1]
        else:  # a wrapped reason continues on this line
            shown.pop((current[0], current[2]))
            current[2] += " " + reason
            shown[(current[0], current[2])] = current[1]
    assert dict(shown) == dict(expected)
    assert len(brief.output.splitlines()) < len(full.output.splitlines())
    for r in refusals:  # --explain-all names every refused node
        assert r["node"].split("/")[-1] in full.output
    assert max(Text(x).cell_len for x in brief.output.splitlines()) <= 80


def test_on_a_very_narrow_console_prose_wraps_instead_of_being_cropped():
    table = FitTable(None, [Column("rule", "id"), Column("targets", "text")])
    table.add_row("fold-batchnorm-convtranspose", "contrib, cuda, onnx (opt-in: --only)")
    lines = render(table, 40)
    assert max(Text(x).cell_len for x in lines) <= 40
    text = "".join(cells(x)[1] for x in lines if x.startswith("│"))
    assert text.replace(" ", "") == "contrib,cuda,onnx(opt-in:--only)"  # every character, none cropped


def test_node_names_wrap_only_before_a_slash():
    from onnxfuse.cli.layout import wrap_path

    name = "/layers/layers.0/self_attention/Reshape_10"
    lines = wrap_path(name, 20).split("\n")
    assert lines == ["/layers/layers.0", "/self_attention", "/Reshape_10"]
    assert "".join(lines) == name
    folded = wrap_path("/" + "x" * 30, 12).split("\n")  # a part longer than the column folds, nothing lost
    assert all(len(x) <= 12 for x in folded) and "".join(folded) == "/" + "x" * 30
    table = FitTable(None, [Column("rule", "id"), Column("node", "path")])
    table.add_row("gemm-rows-to-matmul", name)
    text = "\n".join(render(table, 50))
    assert "Reshape_10" in text and "self_attention" in text


def test_rewrites_table_lists_the_rules_that_applied_and_counts_the_rest():
    from onnxfuse.cli.render import rules_table

    lines = render(rules_table({"fold-constants": 3, "contrib-gelu": 0, "contrib-attention": 2, "fuse-elementwise": 0},
                               {"duplicate": 4, "identity": 0}), 80)
    rows = [cells(line)[0] for line in lines if line.startswith("│")]
    assert rows == ["fold-constants", "contrib-attention", "cleanup: duplicate"]
    assert any(line.strip() == "2 rules did not apply" for line in lines)
    nothing = render(rules_table({"contrib-gelu": 0}, {}), 80)
    assert [cells(line) for line in nothing if line.startswith("│")] == [["(none)", "0"]]
    assert any(line.strip() == "1 rule did not apply" for line in nothing)


@pytest.mark.parametrize("command", [[], ["optimize"], ["diff"], ["bench"], ["rules"], ["demo"]])
def test_help_fits_80_columns(command):
    """Every --help line, examples and the exit-code table included, fits an 80-column CI log."""
    env = dict(os.environ, COLUMNS="80", TERM="dumb")
    out = subprocess.run([sys.executable, "-m", "onnxfuse", *command, "--help"], capture_output=True, text=True,
                         env=env, stdin=subprocess.DEVNULL, check=True).stdout
    assert "Examples" in out or command == ["demo"]
    too_long = [x for x in out.splitlines() if Text(x).cell_len > 80]
    assert not too_long, too_long
