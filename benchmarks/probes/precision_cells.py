"""Issue 33's precision cells for one transformer, without the zoo's full grid: the float32 export and
its ``.half()`` twin (the zoo's builders and exporter), then ``onnxfuse optimize`` three ways through the
CLI a user runs (the half() export as it is; the float32 export with ``--precision fp16`` and with
``--precision bf16``; all three under ``--right-padded attention_mask`` for the models of
``--right-padded``: until 2026-11-29 the half() export was optimized without it, so its attention took
the additive bias while the precision variants took 1-D lengths, docs/benchmarks.md 5.60), each pair
timed with ``onnxfuse bench`` (interleaved rounds, IOBinding on the GPU) at batch 1 and 16, CUDA graphs
off and on, and profiled at batch 1 without graphs: nodes and kernels per run and the ops whose
host-side time differs, the question of the zoo's one slow cell (docs/benchmarks.md 5.52: ``--precision
fp16`` 7-18% behind half() at 1×128 without CUDA graphs, ahead everywhere else).

Why a probe and not the zoo: the zoo runs the float32 cells, ORT's transformers optimizer and the
measured choices first (400 s for GPT-2 small on an H200); this takes the cells issue 33 asks for.
Optimization here uses ``--no-bench`` (no measured choices), so a graph can differ from the zoo's where a
measured choice would have dropped a rule; the report records each output's op counts.

Run on the GPU machine from the repository root (transformers on the path; transformers 4.x for the
``(1 - m)·c`` mask of BERT's eager export):

    python3 benchmarks/probes/precision_cells.py --models gpt2_small@sdpa,bert_base@eager --out $OUT/cells

Writes ``cells.json`` (every optimize report and bench result, rewritten after each step), ``cells.md``
(the table) and each bench's JSON report in --out; the models go to --out/models.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import zoo  # noqa: E402  (benchmarks/zoo.py: the builders and the exporter the zoo's numbers come from)


def cli(*args: str) -> tuple[int, str]:
    """Run ``python -m onnxfuse ARGS``; (exit code, the last lines of its output)."""
    proc = subprocess.run([sys.executable, "-m", "onnxfuse", *args], capture_output=True, text=True)
    return proc.returncode, (proc.stdout + proc.stderr)[-1500:]


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def shapes(spec, batch: int) -> list[str]:
    """``--shape`` arguments for the spec's inputs at ``batch`` (the zoo's sequence length)."""
    out = []
    for name, tensor in zip(spec.input_names, spec.example(batch, "cpu")):
        out += ["--shape", f"{name}:{','.join(str(d) for d in tensor.shape)}"]
    return out


def run_model(name: str, work: Path, batches: list[int], budget: float, record: dict, log, device: str,
              right_padded: bool, save) -> None:
    """Export, optimize and time ``name``; ``save()`` after every step, so a run cut short by a deadline
    keeps every cell it finished (the first GPU run of this probe lost its profile that way)."""
    import torch

    base, attention = zoo.split_variant(name)
    spec = zoo.SPECS[base]
    mask = "attention_mask" in spec.input_names
    fp32, half = work / f"{base}.onnx", work / f"{base}.half.onnx"
    t0 = time.perf_counter()
    zoo.export(spec, zoo.build_module(spec, attention=attention), fp32, 14, device=device)
    zoo.export(spec, zoo.HalfIO(zoo.build_module(spec, attention=attention)), half, 14, device=device)
    if device == "cuda":
        torch.cuda.empty_cache()
    log(f"{name}: exported in {time.perf_counter() - t0:.0f} s")
    promise = ["--right-padded", "attention_mask"] if mask and right_padded else []
    unchecked = ["--no-validate"] if device == "cpu" else []  # bf16 validates on CUDA only
    variants = {
        "half-opt": (half, [*promise]),  # the same user, the same promise: the pair differs by precision only
        "precision-fp16": (fp32, ["--precision", "fp16", *promise]),
        "precision-bf16": (fp32, ["--precision", "bf16", *promise, *unchecked]),
    }
    made = {"fp32": fp32, "half": half}
    for label, (src, extra) in variants.items():
        out, report = work / f"{base}.{label}.onnx", work / f"{base}.{label}.json"
        t0 = time.perf_counter()
        rc, tail = cli("optimize", str(src), str(out), "--no-bench", "-q", "--json", str(report), *extra)
        seconds = time.perf_counter() - t0
        rep = load_json(report) or {}
        result = rep.get("result") or {}
        record.setdefault(name, {})[f"optimize-{label}"] = {
            "exit": rc, "seconds": round(seconds, 1), "tail": tail if rc else "",
            "nodes_after": (result.get("nodes") or {}).get("after"), "ops_after": result.get("ops_after"),
            "validation_passed": (result.get("validation") or {}).get("passed"), "timings": result.get("timings")}
        log(f"{name}: {label} exit {rc} in {seconds:.0f} s, {(result.get('nodes') or {}).get('after')} nodes")
        save()
        if rc == 0:
            made[label] = out
    pairs = [("half-opt", "precision-fp16"), ("half-opt", "precision-bf16"), ("fp32", "precision-bf16")]
    ranges = ["--input-range", "attention_mask:1,1"] if mask else []
    for batch in batches:
        for graph in (False, True):
            for a, b in pairs:
                if a not in made or b not in made:
                    continue
                js = work.parent / f"bench-{base}-{a}-{b}-{batch}-{int(graph)}.json"
                profile = ["--profile"] if batch == 1 and not graph and a == "half-opt" else []
                rc, tail = cli("bench", str(made[a]), str(made[b]), *shapes(spec, batch), *ranges, "--time-budget",
                               str(budget), "--sessions", "2", *(["--cuda-graph"] if graph else []), *profile,
                               "--device", device, "-q", "--json", str(js))
                res = (load_json(js) or {}).get("result") or {}
                ms = [m["latency_ms"]["median_ms"] for m in res.get("models", [])]
                cell = {"exit": rc, "ms": ms, "tail": tail if rc else ""}
                if profile and res.get("profiles"):
                    cell["profiles"] = res["profiles"]
                record[name][f"bench {a} vs {b} b{batch} graph={graph}"] = cell
                log(f"{name}: b{batch}{' graph' if graph else ''} {a} vs {b}: exit {rc} {ms}")
                save()


def markdown(record: dict) -> str:
    rows = ["| model | batch | CUDA graph | half() optimized | --precision fp16 | fp16 / half() | --precision bf16 | "
            "bf16 / half() | fp32 original | bf16 speed-up |", "|---|---:|:---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, cells in record.items():
        for key in sorted({k.split(" ", 4)[-1] for k in cells if k.startswith("bench ")}):
            def ms(a, b):
                c = cells.get(f"bench {a} vs {b} {key}") or {}
                return c.get("ms") if c.get("exit") == 0 and len(c.get("ms") or []) == 2 else None
            p16, b16, f32 = ms("half-opt", "precision-fp16"), ms("half-opt", "precision-bf16"), ms("fp32", "precision-bf16")
            fmt = lambda x: f"{x:.3f}" if x is not None else "–"  # noqa: E731
            batch, graph = key.split(" ")
            rows.append(f"| {name} | {batch[1:]} | {'yes' if graph.endswith('True') else 'no'} | "
                        f"{fmt(p16[0] if p16 else None)} | {fmt(p16[1] if p16 else None)} | "
                        f"{fmt(p16[1] / p16[0] if p16 else None)} | {fmt(b16[1] if b16 else None)} | "
                        f"{fmt(b16[1] / b16[0] if b16 else None)} | {fmt(f32[0] if f32 else None)} | "
                        f"{fmt(f32[0] / f32[1] if f32 else None)} |")
    note = ("\nEach ratio is within one interleaved `onnxfuse bench` pair: the half() column is the fp16 pair's (the "
            "bf16 pair times half() again), the fp32 column the bf16 pair's.\n")
    return "\n".join(rows) + "\n" + note


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2_small@sdpa,bert_base@eager")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--time-budget", type=float, default=1.0)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--right-padded", default="bert_base@eager",
                   help="models (comma list) whose precision variants are optimized under --right-padded "
                        "attention_mask (their masks are timed all ones, which keeps the promise)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: a smoke test of the script on a machine without a GPU (times mean nothing)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "models"
    work.mkdir(exist_ok=True)
    record: dict = {}

    def log(msg: str) -> None:
        print(f"[cells {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def save() -> None:
        (args.out / "cells.json").write_text(json.dumps(record, indent=1))
        (args.out / "cells.md").write_text(markdown(record))

    for name in args.models.split(","):
        try:
            run_model(name, work, [int(b) for b in args.batches.split(",")], args.time_budget, record, log,
                      args.device, name in args.right_padded.split(","), save)
        except Exception as exc:  # one model's failure should not hide the other's cells
            record.setdefault(name, {})["error"] = repr(exc)[:500]
            log(f"{name}: failed: {exc!r}"[:300])
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
