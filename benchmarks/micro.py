"""What the one-pattern micro-benchmarks share (``attention_ops.py``, ``embed_layernorm.py``,
``weight_layout.py``): their command line and the files they write. Never imported by the package.

Each script times a few hand-built or rule-written models against each other at a few batch sizes on one
device; each takes ``--out DIR``, ``--batches 1,16``, ``--time-budget SECONDS`` and ``--device cuda|cpu``
(cpu: only to check the script), and writes ``NAME.json`` ({date, rows}) and, with a table, ``NAME.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def parse_args(doc: str, time_budget: float, argv=None, batches: str = "1,16",
               extra=None) -> tuple[argparse.Namespace, Path, list[int]]:
    """The arguments (first paragraph of ``doc`` as the description), the output folder (created) and
    the batch sizes. ``extra(parser)`` adds a script's own options."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batches", default=batches)
    p.add_argument("--time-budget", type=float, default=time_budget)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, out, [int(b) for b in args.batches.split(",")]


def write_results(out: Path, name: str, rows: list[dict], table: list[str] | None = None) -> None:
    """``NAME.json`` with today's date and the rows; ``NAME.md`` with the Markdown ``table`` lines (also
    printed) when given."""
    (out / f"{name}.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    if table:
        (out / f"{name}.md").write_text("\n".join(table) + "\n")
        print("\n".join(table))


def time_variants(runnable: list, args, checks: dict, **fields) -> dict:
    """Time the ``(label, model, inputs)`` variants interleaved (3 rounds, ``args.time_budget`` each) on
    ``args.device``; the row ``{**fields, "median_ms": {label: ms}, "checks": checks}``, also printed."""
    from onnxfuse.timing import BenchConfig, time_models

    cfg = BenchConfig(device=args.device, warmup=5, time_budget_s=args.time_budget, min_iterations=10)
    results = time_models(runnable, cfg, rounds=3)
    row = {**fields, "median_ms": {label: r.stats.median_ms for (label, _, _), r in zip(runnable, results)},
           "checks": checks}
    print(json.dumps(row), flush=True)
    return row


def variant_cells(row: dict, labels: list[str]) -> list[str]:
    """One Markdown cell per variant: its median ms, "(WRONG)" after it when its check failed, "error"
    when it did not run."""
    cells = []
    for label in labels:
        t, check = row["median_ms"].get(label), row["checks"].get(label, {})
        cells.append("error" if t is None else f"{t:.3f}" + ("" if check.get("ok", True) in (True, None) else " (WRONG)"))
    return cells
