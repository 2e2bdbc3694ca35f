"""Progress off a terminal (issue 35): one line per stage with the seconds since the start, once the
command has run a second; a quick run (and a bad input refused at once) prints nothing beside its report."""

from __future__ import annotations

import io

from rich.console import Console

from onnxfuse.cli import render


def _bar(times):
    bar = render.progress_bar()
    out = io.StringIO()
    bar._stderr, bar._lines, bar._progress = Console(file=out, width=80), True, None  # as off a terminal
    clock = iter(times)
    bar._clock, bar._started = (lambda: next(clock)), 0.0
    return bar, out


def test_stages_print_once_the_run_is_long_with_their_own_times():
    bar, out = _bar([0.0, 0.3, 2.5, 2.6, 9.0])  # the repeated stage reads no time
    with bar:
        bar.step("loading")
        bar.step("rewriting")
        assert out.getvalue() == ""  # still under a second: nothing yet
        bar.step("validating")
        bar.fraction("timing", 0.1)
        bar.fraction("timing", 0.5)  # the same stage again: no new line
        bar.step("saving")
    assert out.getvalue().splitlines() == ["[    0.0 s] loading", "[    0.3 s] rewriting", "[    2.5 s] validating",
                                           "[    2.6 s] timing", "[    9.0 s] saving"]


def test_a_quick_run_prints_no_stage_line():
    bar, out = _bar([0.0, 0.1, 0.2])
    with bar:
        for stage in ("loading", "rewriting", "saving"):
            bar.step(stage)
    assert out.getvalue() == ""


def test_quiet_prints_nothing():
    bar = render.progress_bar(disabled=True)
    assert not bar._lines and bar._progress is None
