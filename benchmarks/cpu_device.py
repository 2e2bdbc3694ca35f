#!/usr/bin/env python3
"""``onnxfuse optimize --device cpu`` on every testdata model, then original against optimized on the CPU.

Issue 32's done-when for item 5: every testdata model optimized with ``--device cpu`` is at least as fast
as the original on ONNX Runtime's CPU provider. For each ``testdata/*.onnx`` (``bad_*`` skipped: they are
broken on purpose):

1. ``python -m onnxfuse optimize MODEL OUT --device cpu --json R --save-inputs S -q`` in a child process,
   the command users run (the never-slower ladder inside it times on the CPU and may fall back);
2. in this process, the original, the original again (an A/A pair: this machine's noise for this model)
   and the written model, timed under one :class:`onnxfuse.timing.BenchConfig` (``device="cpu"``,
   ``ORT_ENABLE_ALL``) in interleaved rounds (:func:`onnxfuse.timing.time_models`), on the first sample
   validation used (``--save-inputs``);
3. with ``--cuda-output``, also the default (``--device cuda``) output, FusedElementwise and all, written with
   ``--no-validate --no-bench`` and timed in the same rounds on the CPU: why ``--device cpu`` leaves the
   cuda-only rules out.

Writes ``results.json`` and ``results.md`` (the Markdown table for docs/benchmarks.md) into ``--out``
after every model, so a run cut short still leaves its table; ``--deadline`` stops starting new models.

Usage (repo root)::

    python benchmarks/cpu_device.py --out /tmp/cpu_device --time-budget 0.4 --deadline 540
    python benchmarks/cpu_device.py --out /tmp/cpu_device --models conv_bn_relu,bert_tiny_opset14

Never imported by the package.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import onnx  # noqa: E402

from onnxfuse.runtime.inputs import input_specs, load_npz_samples  # noqa: E402
from onnxfuse.selection import SLOWER_MARGIN  # noqa: E402
from onnxfuse.timing import BenchConfig, time_models  # noqa: E402


def models(names: str | None) -> list[Path]:
    found = sorted(p for p in (REPO / "testdata").glob("*.onnx") if not p.name.startswith("bad_"))
    if names:
        wanted = set(names.split(","))
        found = [p for p in found if p.stem in wanted]
    return found


def optimize_default(path: Path, out: Path, timeout: float) -> Path | None:
    """The default (cuda) output, unvalidated and untimed: only to be timed on the CPU here."""
    target = out / "models" / f"{path.stem}.cuda.onnx"
    target.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "onnxfuse", "optimize", str(path), str(target), "--no-validate", "--no-bench", "-q"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    return target if done.returncode == 0 and target.exists() else None


def optimize(path: Path, out: Path, timeout: float) -> dict:
    """The CLI, as a user runs it; returns what its JSON report says (or why it has none)."""
    work = out / "models"
    work.mkdir(parents=True, exist_ok=True)
    target, report, npz = work / path.name, work / f"{path.stem}.json", work / f"{path.stem}.npz"
    for p in (target, report, npz):
        p.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "onnxfuse", "optimize", str(path), str(target), "--device", "cpu",
           "--json", str(report), "--save-inputs", str(npz), "-q"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {"exit_code": None, "error": f"optimize ran over {timeout:.0f} s", "seconds": timeout}
    row = {"exit_code": done.returncode, "seconds": round(time.perf_counter() - t0, 2), "output": str(target),
           "inputs": str(npz), "stderr": done.stderr.strip()[-500:]}
    if report.exists():
        doc = json.loads(report.read_text())
        row["error"] = doc.get("error")
        result = doc.get("result") or {}
        timing = result.get("timing") or {}
        selection = result.get("selection")
        row.update({
            "device": result.get("device"), "target": result.get("target"),
            "nodes": result.get("nodes"),
            "rules_applied": sorted(k for k, v in ((result.get("rewrites") or {}).get("counts") or {}).items() if v),
            "ops_after": result.get("ops_after"),
            "optimize_speedup": timing.get("speedup"), "timing_device": timing.get("device"),
            "kept": (selection or {}).get("kept"), "selection": selection,
        })
    return row


def time_pair(path: Path, row: dict, budget: float, rounds: int, default: Path | None = None) -> None:
    original, optimized = onnx.load(str(path)), onnx.load(row["output"])
    inputs = load_npz_samples(input_specs(original), Path(row["inputs"]))[0]
    config = BenchConfig(device="cpu", warmup=5, time_budget_s=budget, min_iterations=20)
    jobs = [("original", original, inputs), ("original again", original, inputs), ("optimized", optimized, inputs)]
    if default is not None:
        jobs.append(("default output", onnx.load(str(default)), inputs))
    a, again, b, *rest = time_models(jobs, config, rounds=rounds)
    if rest:
        row["default_ms"] = rest[0].stats.median_ms
        row["default_speedup"] = a.stats.median_ms / rest[0].stats.median_ms
    row.update({
        "shapes": a.shapes, "original_ms": a.stats.median_ms, "original_again_ms": again.stats.median_ms,
        "optimized_ms": b.stats.median_ms, "original_min_ms": a.stats.min_ms, "optimized_min_ms": b.stats.min_ms,
        "runs": [a.stats.count, again.stats.count, b.stats.count],
        "speedup": a.stats.median_ms / b.stats.median_ms,
        "aa": a.stats.median_ms / again.stats.median_ms,
    })


def kept_text(row: dict) -> str:
    if row.get("kept"):
        return f"without {row['kept']}"
    if not row.get("rules_applied"):
        return "no rule applied"
    return "all rules"


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"Command: `{meta['command']}` ({meta['date']}, {meta['machine']}, ONNX Runtime {meta['onnxruntime']}, "
           f"{meta['seconds']:.0f} s).\n\n",
           "| model | nodes | kept by the ladder | optimize's own speed-up | original ms | optimized ms | speed-up | "
           "A/A | default (cuda) output on the CPU |\n|---|---:|---|---:|---:|---:|---:|---:|---:|\n"]
    for r in rows:
        nodes = r.get("nodes") or {}
        if r.get("exit_code") != 0 or "speedup" not in r:
            why = r.get("error") or r.get("stderr") or "no timing"
            out.append(f"| {r['model']} | {nodes.get('before', '')} | exit {r.get('exit_code')}: "
                       f"{why.splitlines()[-1][:80] if why else ''} | | | | | | |\n")
            continue
        own, default = r.get("optimize_speedup"), r.get("default_speedup")
        out.append(f"| {r['model']} | {nodes['before']} → {nodes['after']} | {kept_text(r)} | "
                   f"{'' if own is None else f'{own:.2f}×'} | {r['original_ms']:.4f} | {r['optimized_ms']:.4f} | "
                   f"**{r['speedup']:.2f}×** | {r['aa']:.2f}× | {'' if default is None else f'{default:.2f}×'} |\n")
    timed = [r for r in rows if "speedup" in r]
    if timed:
        floor = 1.0 - SLOWER_MARGIN
        below = [r for r in timed if r["speedup"] < floor]
        slowest = min(timed, key=lambda r: r["speedup"])
        out.append(f"\n{len(timed)} of {len(rows)} models timed; {len(timed) - len(below)} at least "
                   f"{floor:.2f}× (the ladder's {SLOWER_MARGIN:.0%} noise margin); slowest "
                   f"{slowest['model']} {slowest['speedup']:.2f}× (its A/A {slowest['aa']:.2f}×)"
                   + (f"; below: {', '.join(r['model'] for r in below)}" if below else "") + ".\n")
    return "".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default=None, help="comma list of testdata stems (default: every model but bad_*)")
    ap.add_argument("--time-budget", type=float, default=0.4, help="seconds of timed runs per model and pair")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (original, original again, optimized)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds one optimize may take")
    ap.add_argument("--deadline", type=float, default=None, help="stop starting new models after this many seconds")
    ap.add_argument("--cuda-output", action="store_true",
                    help="also time the default (--device cuda) output on the CPU, in the same rounds")
    args = ap.parse_args()
    import onnxruntime

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    meta = {"command": "python benchmarks/cpu_device.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "onnxruntime": onnxruntime.__version__,
            "seconds": 0.0}
    rows: list[dict] = []
    for path in models(args.models):
        if args.deadline is not None and time.perf_counter() - t0 > args.deadline:
            rows.append({"model": path.stem, "exit_code": None, "error": "not run (--deadline)"})
            continue
        row = {"model": path.stem, **optimize(path, out, args.timeout)}
        if row.get("exit_code") == 0:
            try:
                default = optimize_default(path, out, args.timeout) if args.cuda_output else None
                time_pair(path, row, args.time_budget, args.rounds, default)
            except Exception as exc:  # one model's failure is a row, not the end of the run
                row["error"] = f"timing: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        rows.append(row)
        meta["seconds"] = time.perf_counter() - t0
        shown = f"{row['speedup']:.2f}x (A/A {row['aa']:.2f}x)" if "speedup" in row else row.get("error")
        print(f"[{meta['seconds']:6.1f} s] {path.stem}: exit {row.get('exit_code')}, {shown}", flush=True)
        (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
        (out / "results.md").write_text(markdown(rows, meta))
    meta["seconds"] = time.perf_counter() - t0
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    (out / "results.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
