"""Every terminal table the commands print (rich), built on :mod:`onnxfuse.cli.layout` so none cuts an
identifier or drops a column in an 80-column CI log. Presentation only: every number comes from the
library."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

from rich.markup import escape

from onnxfuse.cli.layout import Column, FitTable, print_prose, shell_lines  # noqa: F401  (print_prose, shell_lines: for commands)
from onnxfuse.reports import formatting
from onnxfuse.unfused import reason_pattern


def rules_table(counts: dict[str, int], cleanup: dict[str, int]) -> FitTable:
    """The rules that applied, in run order, with their counts; the rest summed up in the caption ("N
    rules did not apply": `onnxfuse rules` lists them, `--explain` says why), so a small model's report
    is not 30 rows of zeros (issue 35)."""
    idle = [name for name, n in counts.items() if not n]
    caption = (f"{len(idle)} rule{'s' if len(idle) != 1 else ''} did not apply"
               if idle else None)
    table = FitTable("Rewrites", [Column("rule", "id"), Column("applied", "num")], caption=caption)
    for name, n in counts.items():
        if n:
            table.add_row(name, str(n))
    for name, n in cleanup.items():
        if n:
            table.add_row(f"cleanup: {name}", str(n), style="dim")
    if not table.rows:
        table.add_row("(none)", "0", style="dim")
    return table


def rule_list_lines(rows: list[dict], width: int) -> list[str]:
    """``onnxfuse rules`` as a list, not a table: each rule's name (whole: users pass it to --skip) and its
    targets on one line, its description wrapped under it at word boundaries only. A three-column table
    at 80 columns left the description 20 characters and cut words such as ``Shape→Gather→Div→Reshape``
    in two (issue 35); a word longer than the line stays whole and runs past it."""
    lines = ["Rewrite rules in run order, each with the --target values that run it", ""]
    for row in rows:
        targets = ", ".join(row["targets"]) + ("; opt-in: --only +RULE" if row["opt_in"] else "")
        lines.append(f"{row['name']}  [{targets}]")
        lines.extend(textwrap.wrap(row["description"], width=max(20, width - 4), initial_indent="    ",
                                   subsequent_indent="    ", break_long_words=False, break_on_hyphens=False))
    return lines


def ops_table(before: dict[str, int], after: dict[str, int], body_before: dict[str, int] | None = None,
              body_after: dict[str, int] | None = None) -> FitTable:
    """The main graph's nodes by op type and their total; then, where the model has If/Loop/Scan bodies,
    their nodes as rows ``in bodies: OP`` (outside the total, which is the main graph's node count)."""
    table = FitTable("Nodes by op type", [Column("op", "id"), Column("before", "num"), Column("after", "num")])

    def rows(b_counts, a_counts, label):
        for op in sorted(set(b_counts) | set(a_counts), key=lambda o: (-b_counts.get(o, 0), o)):
            b, a = b_counts.get(op, 0), a_counts.get(op, 0)
            style = "dim" if a == b else ("green" if a < b else "yellow")
            table.add_row(escape(label + op), str(b), str(a), style=style)

    rows(before, after, "")
    table.add_row("[bold]total[/]", f"[bold]{sum(before.values())}[/]", f"[bold]{sum(after.values())}[/]")
    rows(body_before or {}, body_after or {}, "in bodies: ")
    return table


def comparison_table(title: str, comparisons, label_a: str = "original", label_b: str = "optimized") -> FitTable:
    """One row per output, its verdict second (issue 35: at 80 columns the numbers that do not fit move to a
    continued table, the verdict never does), then shape, errors, tolerance (rtol / atol), the noise
    floor multiple when there is one and, for a precision change, the drift figures (normalized max error
    and cosine against the float32 original, the plain cast's in brackets)."""
    floors = any("noise_floor" in c.extra for c in comparisons)
    drifts = any(formatting.drift(c) for c in comparisons)  # a precision change: its figures, the cast's in ()
    columns = [Column("output", "id"), Column("result", "text"), Column("shape", "num"), Column("max abs", "num"),
               Column("max rel", "num"), Column("rtol / atol", "num")] + ([Column("x floor", "num")] if floors else []) \
        + ([Column("norm. err (cast)", "num"), Column("cosine (cast)", "num")] if drifts else [])
    table = FitTable(title, columns)
    for c in comparisons:
        verdict = "[green]pass[/]" if c.passed else f"[red]FAIL[/]{' (' + escape(c.error) + ')' if c.error else ''}"
        if c.passed and c.extra.get("passed_by") == "noise floor":
            verdict = "[yellow]pass[/] (floor)"
        elif c.passed and c.extra.get("passed_by") == "drift budget":
            verdict = "[yellow]pass[/] (budget)"
        row = [escape(c.name), verdict, "x".join(str(d) for d in c.shape) or "scalar", formatting.num(c.max_abs),
               formatting.num(c.max_rel), f"{c.rtol:.0e} / {c.atol:.1e}"]
        if floors:
            multiple = c.extra.get("floor_multiple")
            row.append("-" if multiple is None else f"{multiple:.1f}")
        if drifts:
            row.extend(formatting.drift(c) or ("-", "-"))
        table.add_row(*row)
    return table


def unfused_line(row) -> str:
    """One line for an :class:`onnxfuse.unfused.Unfused` row (printed by default after the op counts)."""
    share = "" if row.reason_count == row.count else f" ({row.reason_count} of {row.count})"
    return (f"{row.count} {row.op} left by {row.rule}: {row.reason}{share}"
            + ("; --explain lists the other reasons" if row.reason_count != row.count else ""))


def refusal_summary_table(refusals) -> FitTable:
    """``--explain``: refusals counted per rule and reason (names in reasons folded), with one example
    node; ``--explain-all`` lists each one (:func:`refusals_table`)."""
    groups: dict[tuple[str, str], list] = {}
    for r in refusals:
        groups.setdefault((r.rule, reason_pattern(r.reason)), []).append(r)
    table = FitTable("Refused candidates (--explain-all lists each)",
                     [Column("rule", "id"), Column("refused", "num"), Column("reason", "text"),
                      Column("e.g. node", "path")])
    for (rule, pattern), items in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        table.add_row(rule, str(len(items)), escape(pattern), escape(items[0].node))
    return table


def details_summary_table(details: list[dict]) -> FitTable:
    """``--explain``: rewrites counted per rule, with the first one's details as an example."""
    groups: dict[str, list[dict]] = {}
    for d in details:
        groups.setdefault(d.get("rule", ""), []).append(d)
    table = FitTable("Rewrites applied (--explain-all lists each)",
                     [Column("rule", "id"), Column("count", "num"), Column("e.g.", "text")])
    for rule, items in groups.items():
        table.add_row(rule, str(len(items)), escape(_detail_text(items[0])))
    return table


def _detail_text(detail: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in detail.items() if k != "rule")


def refusals_table(refusals) -> FitTable:
    table = FitTable("Refused candidates (--explain-all)",
                     [Column("rule", "id"), Column("node", "path"), Column("reason", "text")])
    for r in refusals:
        table.add_row(r.rule, escape(r.node), escape(r.reason))
    return table


def details_table(details: list[dict]) -> FitTable:
    table = FitTable("Rewrites applied (--explain-all)", [Column("rule", "id"), Column("what", "text")])
    for d in details:
        table.add_row(d.get("rule", ""), escape(_detail_text(d)))
    return table


def timing_table(timing) -> FitTable:
    """Original vs optimized latency (a ``onnxfuse.timing.ComparisonResult`` with status 'ok')."""
    sp = timing.speedup
    colour = "green" if sp and sp >= 1 else "red"
    table = FitTable(f"Latency ({timing.original.label}, ORT_ENABLE_ALL on both)",
                     [Column("model", "id")] + [Column(c, "num") for c in
                                                ("median ms", "p90 ms", "p99 ms", "min ms", "runs", "nodes")],
                     caption=f"speed-up: [{colour}]{sp:.2f}×[/]" if sp else None)
    for name, r, nodes in (("original", timing.original, timing.nodes_original),
                           ("optimized", timing.optimized, timing.nodes_optimized)):
        s = r.stats
        table.add_row(name, f"{s.median_ms:.3f}", f"{s.p90_ms:.3f}", f"{s.p99_ms:.3f}", f"{s.min_ms:.3f}",
                      str(s.count), str(nodes))
    return table


def drift_table(title: str, comparisons, positions: bool = False) -> FitTable:
    """``diff``'s metrics per tensor. Every column is kept: where they do not fit side by side (mean abs,
    RMS and the worst element, below about 130 columns) they follow in a continued table."""
    columns = [Column("tensor", "path")] + ([Column("#", "num"), Column("op", "id")] if positions else [])
    columns += [Column("shape", "num"), Column("max abs", "num"), Column("max rel", "num"),
                Column("cosine", "num"), Column("beyond tol", "num"), Column("result", "text"),
                Column("mean abs", "num"), Column("RMS", "num"), Column("worst element", "text")]
    table = FitTable(title, columns)
    for c in comparisons:
        name = escape(c.name + (f" → {c.extra['name_b']}" if c.extra.get("name_b") else ""))
        pre = [str(c.extra.get("position", "")), escape(c.extra.get("op_type", ""))] if positions else []
        if c.error:
            row = [formatting.shape(c.shape), "", "", "", "", f"[red]FAIL[/] ({escape(c.error)})", "", "", ""]
        else:
            beyond = formatting.percent(c.mismatch_fraction)
            if c.nonfinite_mismatches:
                beyond += f" ({c.nonfinite_mismatches} NaN/Inf)"
            row = [formatting.shape(c.shape), formatting.num(c.max_abs), formatting.num(c.max_rel),
                   formatting.num(c.cosine, 6), beyond, "[green]pass[/]" if c.passed else "[red]FAIL[/]",
                   formatting.num(c.mean_abs), formatting.num(c.rms), escape(formatting.worst(c))]
        table.add_row(name, *pre, *row)  # the tensor first: each continued part repeats it
    return table


def _ms(x: float) -> str:
    return f"{x:.4g}" if x < 100 else f"{x:.1f}"


def latency_table(results, title: str) -> FitTable:
    """``bench``: each model's latency (ms) and, with two, the speed-up over the first."""
    # start-up: the command line starts (and --help runs) without onnxfuse.timing.stats
    from onnxfuse.timing.stats import speedup

    two = len(results) > 1
    columns = [Column("model", "id")] + [Column(c, "num") for c in ("median", "p90", "p99", "min", "mean", "runs",
                                                                       "nodes")]
    table = FitTable(title, columns + ([Column("speed-up", "num")] if two else []), caption="times in ms")
    base = results[0].stats.median_ms if results else None
    for r in results:
        s = r.stats
        row = [escape(r.name), *(_ms(x) for x in (s.median_ms, s.p90_ms, s.p99_ms, s.min_ms, s.mean_ms)),
               str(s.count), str(r.nodes)]
        if two:
            sp = speedup(base, s.median_ms)
            row.append("-" if sp is None else f"{sp:.2f}×")
        table.add_row(*row)
    return table


def profile_tables(prof, top: int) -> list[FitTable]:
    """``bench --profile``: the top ops by time and by count."""
    s = prof.summary
    kernels = "unknown" if s.kernels_per_run is None else f"{s.kernels_per_run:.0f}"
    providers = ", ".join(f"{k.replace('ExecutionProvider', '')} {v:.0f}" for k, v in s.nodes_by_provider.items())
    caption = f"{s.nodes_per_run:.0f} nodes/run ({providers}); kernels/run: {kernels}"
    columns = [Column("op", "id"), Column("calls/run", "num"), Column("ms/run", "num"), Column("share", "num")]
    columns += [Column("kernels/run", "num")] if s.kernels_per_run is not None else []
    tables = []
    for title, ops in ((f"{prof.name}: top ops by time", s.top_by_time(top)),
                       (f"{prof.name}: top ops by count", s.top_by_count(top))):
        table = FitTable(escape(title), columns, caption=escape(caption))
        for o in ops:
            row = [escape(o.op), f"{o.calls_per_run:.0f}", f"{o.ms_per_run:.4f}", f"{100 * o.share:.1f}%"]
            if s.kernels_per_run is not None:
                row.append(f"{o.kernels_per_run or 0:.0f}")
            table.add_row(*row)
        tables.append(table)
    return tables


#: Off a terminal, stage lines start once a command has run this long (a quick run prints only its report).
QUIET_FIRST_SECONDS = 1.0

#: ``-v`` / ``--log-level debug``: stage lines from the first second, on a terminal too (:func:`set_verbose`)
_VERBOSE = [False]


def verbose() -> bool:
    """Whether ``-v`` / ``--log-level debug`` was given (:func:`set_verbose`)."""
    return _VERBOSE[0]


def set_verbose(on: bool) -> None:
    """Every stage as one line on stderr as it starts, with the seconds since the command started, from
    the first second and on a terminal too (instead of the redrawn bar), and a last line when the command
    is done: for a log that must show every stage, however short the run."""
    _VERBOSE[0] = bool(on)


class _Bar:
    """The one progress display of every command: a rich bar on stderr (transient: gone when the command
    prints its report) whose description follows steps (:meth:`step`, a spinner) and whose bar follows
    a fraction (:meth:`fraction`, e.g. timing). Off a terminal (a CI log, a pipe), where a bar cannot be
    redrawn in place, each stage is one short line on stderr as it starts, with the seconds since the
    command started (``[   3.2 s] validating``), so a log shows where a long run is and where its time
    went; the lines start once the command has run :data:`QUIET_FIRST_SECONDS` (earlier stages are then
    printed with their own times), so a quick run, and a bad input refused at once, print nothing
    beside their report or their one error line. Disabled with ``--quiet``."""

    def __init__(self, disabled: bool, label: str = ""):
        # start-up: the command line starts (and --help runs) without rich.progress (nor rich)
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        # import cycle: importing onnxfuse.cli.common imports this module
        from onnxfuse.cli.common import stderr

        self._stderr, self._started, self._clock = stderr, time.perf_counter(), time.perf_counter
        self._verbose = _VERBOSE[0] and not disabled
        self._lines = not disabled and (self._verbose or not stderr.is_terminal)
        self._last = None
        self._pending: list[tuple[float, str]] = []  # stages not printed yet (the run was still short)
        self._progress = None if disabled or self._verbose or not stderr.is_terminal else Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
            console=stderr, transient=True,
        )
        self._task = None
        self._label = f"{label}: " if label else ""  # the model, in a run over several

    def _line(self, message: str) -> None:
        """One line per stage off a terminal; repeated messages (timing's fractions) print once."""
        if not self._lines or message == self._last:
            return
        self._last = message
        self._pending.append((self._clock() - self._started, message))
        if self._verbose or self._pending[-1][0] >= QUIET_FIRST_SECONDS:
            for elapsed, text in self._pending:
                self._stderr.print(f"[{elapsed:7.1f} s] {text}", markup=False, highlight=False, soft_wrap=True)
            self._pending.clear()

    def __enter__(self):
        if self._progress is not None:
            self._progress.__enter__()
            self._task = self._progress.add_task("starting…", total=None)
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
        if self._verbose and exc[0] is None:
            self._line(self._label + "done")
        return False

    def step(self, message: str) -> None:
        message = self._label + message
        self._line(message)
        if self._progress is not None:
            self._progress.update(self._task, description=f"{message}…", total=None)

    def fraction(self, message: str, fraction: float) -> None:
        message = self._label + message
        self._line(message)
        if self._progress is not None:
            self._progress.update(self._task, description=message, total=1.0, completed=fraction)


def progress_bar(disabled: bool = False) -> _Bar:
    return _Bar(disabled)


def model_line(k: int, n: int, run) -> str:
    """One model's line in a run over several, as it ends: ``[2/5] bert.onnx ... ok, 1.93× (12.1 s)``."""
    timing = run.timing_text()
    verdict = ("ok" + (f", {timing}" if timing != "-" else "")) if run.ok else f"{run.verdict()}, exit {run.exit_code}"
    return f"[{k}/{n}] {run.name} ... {verdict} ({run.seconds:.1f} s)"


class BatchProgress:
    """Progress of a run over several models (``optimize ... --out-dir``): each model gets the one-model
    display (:class:`_Bar`, its stages labelled ``[k/n] name``, so off a terminal only a model that runs
    over a second prints stage lines) and, as it ends, one :func:`model_line` on stderr, so a CI log
    shows each model's verdict as it happens. Methods are the callbacks :func:`onnxfuse.api.optimize_many`
    takes. Disabled with ``--quiet``."""

    def __init__(self, disabled: bool):
        # import cycle: importing onnxfuse.cli.common imports this module
        from onnxfuse.cli.common import stderr

        self._disabled, self._stderr, self._bar = disabled, stderr, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._close(*exc)
        return False

    def _close(self, *exc) -> None:
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.__exit__(*(exc or (None, None, None)))

    def started(self, k: int, n: int, job) -> None:
        self._close()
        self._bar = _Bar(self._disabled, label=f"[{k}/{n}] {job.name}").__enter__()

    def step(self, message: str) -> None:
        if self._bar is not None:
            self._bar.step(message)

    def fraction(self, message: str, fraction: float) -> None:
        if self._bar is not None:
            self._bar.fraction(message, fraction)

    def finished(self, k: int, n: int, run) -> None:
        self._close()
        if not self._disabled:
            self._stderr.print(model_line(k, n, run), markup=False, highlight=False)


def many_table(batch) -> FitTable:
    """The summary of a run over several models: one row per model (nodes before → after, verdict,
    speed-up or "no GPU"). Models are named by stem (their output is DIR/<stem>.onnx), whole: with a name
    too long for 80 columns the table continues below rather than cut it."""
    ok = len(batch.runs) - len(batch.failed)
    caption = (f"{ok} of {len(batch.runs)} ok" + (f"; exit code {batch.exit_code} (the worst)" if batch.failed else "")
               + f"; {batch.seconds:.1f} s")
    table = FitTable(f"Models (outputs in {escape(batch.out_dir)})",
                     [Column("model", "id"), Column("nodes", "num"), Column("verdict", "text"),
                      Column("speed-up", "num")], caption=caption)
    for run in batch.runs:
        verdict = "[green]ok[/]" if run.ok else f"[red]{run.verdict()}[/] ({run.exit_code})"
        table.add_row(escape(Path(run.input_path).stem), run.nodes_text(), verdict, run.timing_text())
    return table
