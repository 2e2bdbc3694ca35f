"""Rich renderings of library results. Presentation only: every number comes from the library."""

from __future__ import annotations

from rich.table import Table

from onnxfuse.reports import write_json  # noqa: F401  (re-exported for commands)



def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def rules_table(counts: dict[str, int], cleanup: dict[str, int]) -> Table:
    table = Table(title="Rewrites", title_justify="left")
    table.add_column("rule")
    table.add_column("applied", justify="right")
    for name, n in counts.items():
        table.add_row(name, str(n), style=None if n else "dim")
    for name, n in cleanup.items():
        if n:
            table.add_row(f"cleanup: {name}", str(n), style="dim")
    return table


def ops_table(before: dict[str, int], after: dict[str, int]) -> Table:
    table = Table(title="Nodes by op type", title_justify="left")
    table.add_column("op")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    for op in sorted(set(before) | set(after), key=lambda o: (-before.get(o, 0), o)):
        b, a = before.get(op, 0), after.get(op, 0)
        style = "dim" if a == b else ("green" if a < b else "yellow")
        table.add_row(op, str(b), str(a), style=style)
    table.add_row("[bold]total[/]", f"[bold]{sum(before.values())}[/]", f"[bold]{sum(after.values())}[/]")
    return table


def comparison_table(title: str, comparisons, label_a: str = "original", label_b: str = "optimized") -> Table:
    table = Table(title=title, title_justify="left")
    floors = any("noise_floor" in c.extra for c in comparisons)
    columns = [("output", "left"), ("shape", "left"), ("max abs", "right"), ("max rel", "right"),
               ("tolerance", "right")] + ([("x floor", "right")] if floors else []) + [("result", "left")]
    for col, just in columns:
        table.add_column(col, justify=just)
    for c in comparisons:
        verdict = "[green]pass[/]" if c.passed else f"[red]FAIL[/]{' (' + c.error + ')' if c.error else ''}"
        if c.passed and c.extra.get("passed_by") == "noise floor":
            verdict = "[yellow]pass[/] (floor)"
        row = [c.name, "x".join(str(d) for d in c.shape) or "scalar", _fmt(c.max_abs), _fmt(c.max_rel),
               f"rtol {c.rtol:.0e}, atol {c.atol:.1e}"]
        if floors:
            multiple = c.extra.get("floor_multiple")
            row.append("-" if multiple is None else f"{multiple:.1f}")
        table.add_row(*row, verdict)
    return table


def refusals_table(refusals) -> Table:
    table = Table(title="Refused candidates (--explain)", title_justify="left")
    table.add_column("rule")
    table.add_column("node")
    table.add_column("reason")
    for r in refusals:
        table.add_row(r.rule, r.node, r.reason)
    return table


def details_table(details: list[dict]) -> Table:
    table = Table(title="Rewrites applied (--explain)", title_justify="left")
    table.add_column("rule")
    table.add_column("what")
    for d in details:
        rest = {k: v for k, v in d.items() if k != "rule"}
        table.add_row(d.get("rule", ""), ", ".join(f"{k}={v}" for k, v in rest.items()))
    return table


def timing_table(timing) -> Table:
    """Original vs optimized latency (a ``onnxfuse.bench.ComparisonResult`` with status 'ok')."""
    table = Table(title=f"Latency ({timing.original.label}, ORT_ENABLE_ALL on both)", title_justify="left")
    for col in ("model", "median ms", "p90 ms", "p99 ms", "min ms", "runs", "nodes"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, r, nodes in (("original", timing.original, timing.nodes_original),
                           ("optimized", timing.optimized, timing.nodes_optimized)):
        s = r.stats
        table.add_row(name, f"{s.median_ms:.3f}", f"{s.p90_ms:.3f}", f"{s.p99_ms:.3f}", f"{s.min_ms:.3f}",
                      str(s.count), str(nodes))
    sp = timing.speedup
    colour = "green" if sp and sp >= 1 else "red"
    table.caption = f"speed-up: [{colour}]{sp:.2f}×[/]" if sp else None
    return table


class _Bar:
    """A rich progress bar on stderr whose description follows pipeline steps and whose bar follows timing."""

    def __init__(self, disabled: bool):
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        from onnxfuse.cli.common import stderr

        self._progress = None if disabled else Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
            console=stderr, transient=True,
        )
        self._task = None

    def __enter__(self):
        if self._progress is not None:
            self._progress.__enter__()
            self._task = self._progress.add_task("starting…", total=None)
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.__exit__(*exc)
        return False

    def step(self, message: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"{message}…", total=None)

    def fraction(self, message: str, fraction: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=message, total=1.0, completed=fraction)


def progress_bar(disabled: bool = False) -> _Bar:
    return _Bar(disabled)
