#!/usr/bin/env python3
"""Run onnxfuse over every model of a folder that ONNX Runtime's CPU provider runs, and count.

The promise checked (issue 29): if ONNX Runtime runs a model, ``onnxfuse optimize`` accepts it, its
output passes ``onnx.checker.check_model(full_check=True)`` whenever the input does, and its outputs
equal the original's. For each ``*.onnx`` under the folder (``tools/fetch_ort_corpus.py`` writes ORT's
fusion test models there):

1. ORT (CPU) loads the original *as given* and runs it on onnxfuse's seeded inputs (dynamic dimensions
   1, else 8, 32: as validation sizes them), twice; a model it cannot load or run, or whose outputs
   are random (a Dropout given training_mode, Random* ops; or outputs that differ between two runs),
   is counted and skipped;
2. ``onnxfuse.optimize(model, out, target=...)`` (what ``onnxfuse optimize`` calls; validation on, on the
   CPU) must succeed (exit code 0);
3. the output must pass the full checker when the input does;
4. ORT runs the original as given (not repaired) and the output on every sample validation used
   (``save_inputs``), compared by onnxfuse's comparator at its default tolerances.

Prints one line per model that failed a step, the repairs made (from the output's
``onnxfuse.repaired`` metadata) and a table of counts (Markdown, for docs/ort-corpus.md).
``--count-ops Gelu,FastGelu,...`` also counts those op types (any domain, subgraphs included) in each
original and in onnxfuse's output, per model and in total (models whose original holds none of the
``--with-ops`` types are left out when that option is given: a quick run over the models a rule can fire on).

    python tools/ort_corpus_check.py /tmp/ort-corpus --target contrib -j 2
    python tools/ort_corpus_check.py /tmp/ort-corpus --count-ops Gelu,FastGelu,BiasGelu,QuickGelu \
        --with-ops Erf,Tanh,Sigmoid,Gelu,FastGelu,BiasGelu,QuickGelu
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import sys
import tempfile
from pathlib import Path


def _full_check(path, full: bool = True) -> str | None:
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=full)
    except Exception as exc:  # ValidationError, InferenceError
        return " ".join(str(exc).split())[:160]
    return None


#: Ops whose outputs are random (Dropout too, when given a training_mode input).
RANDOM_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
              "BiasDropout", "BitmaskDropout", "BitmaskBiasDropout"}


def _ort_runs(path: Path):
    """(samples, None) when ORT runs the model as given on onnxfuse's draws with the same outputs twice,
    else (None, why)."""
    import numpy as np
    import onnx
    import onnx.numpy_helper

    from onnxfuse import repair
    from onnxfuse.errors import first_line
    from onnxfuse.runtime.inputs import make_samples
    from onnxfuse.runtime.session import run_samples

    model = onnx.load(str(path))
    off = {t.name for t in model.graph.initializer if not onnx.numpy_helper.to_array(t).any()}
    random = sorted({n.op_type for n in model.graph.node if n.op_type in RANDOM_OPS
                     or (n.op_type == "Dropout" and len(n.input) > 2 and n.input[2] and n.input[2] not in off)})
    if random:
        return None, f"ORT runs it, with random outputs ({', '.join(random)}: training mode)"
    try:
        run_samples(model, [], provider="cpu")  # session creation alone: does ORT load it?
    except Exception as exc:
        return None, "ORT cannot load it: " + first_line(exc)[:120]
    shaped, _ = repair.repaired(model)  # declared shapes for inputs onnx's checker wanted repaired
    why = "no inputs"
    for dim in (1, 8, 32):
        try:
            samples = make_samples(shaped, {}, 0, None, None, dim, 1)
            first = run_samples(model, samples, provider="cpu")
        except Exception as exc:
            why = first_line(exc)[:120]
            continue
        again = run_samples(model, samples, provider="cpu")
        if any(not np.array_equal(a[k], b[k], equal_nan=True) for a, b in zip(first, again) for k in a):
            return None, "ORT runs it, with random outputs (differ run to run: Dropout in training mode)"
        return samples, None
    return None, "ORT cannot run it on onnxfuse's draws: " + why


def op_counts(model) -> "collections.Counter":
    """Op types of ``model`` (a ModelProto), subgraphs included."""
    counts = collections.Counter()

    def walk(graph):
        for node in graph.node:
            counts[node.op_type] += 1
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    walk(sub)

    walk(model.graph)
    return counts


def check_one(path: str, target: str) -> dict:
    import numpy as np
    import onnx

    import onnxfuse
    from onnxfuse.errors import OnnxfuseError, first_line
    from onnxfuse.runtime.compare import compare_runs
    from onnxfuse.runtime.inputs import load_npz_samples, input_specs
    from onnxfuse.runtime.session import run_samples

    p = Path(path)
    row = {"model": path, "status": None, "detail": "", "repaired": "", "input_full_check": None}
    samples, why = _ort_runs(p)
    if samples is None:
        row.update(status="ort-skip", detail=why)
        return row
    row["input_full_check"] = _full_check(p) is None
    row["input_check"] = _full_check(p, full=False) is None  # what load_model asked before issue 29
    with tempfile.TemporaryDirectory(prefix="ort-corpus-") as tmp:
        out, saved = Path(tmp) / "out.onnx", Path(tmp) / "inputs.npz"
        try:
            onnxfuse.optimize(str(p), out, target=target, provider="cpu", save_inputs=saved)
        except OnnxfuseError as exc:
            row.update(status=f"exit-{exc.exit_code}", detail=first_line(exc)[:200])
            return row
        except Exception as exc:  # a crash is a failure too
            row.update(status="crash", detail=f"{type(exc).__name__}: {first_line(exc)[:200]}")
            return row
        optimized = onnx.load(str(out))
        row["ops_in"], row["ops_out"] = op_counts(onnx.load(str(p), load_external_data=False)), op_counts(optimized)
        row["repaired"] = next((m.value for m in optimized.metadata_props if m.key == "onnxfuse.repaired"), "")
        problem = _full_check(out)
        if row["input_full_check"] and problem:
            row.update(status="output-invalid", detail=problem)
            return row
        original = onnx.load(str(p))
        runs = load_npz_samples(input_specs(optimized), saved)
        feeds = [s.feeds for s in runs]
        ref = run_samples(original, feeds, provider="cpu")
        got = run_samples(optimized, feeds, provider="cpu", keep_failures=True)
        rows, _ = compare_runs(ref, got)
        bad = [r for r in rows if not r.passed]
        if bad and any(not r.passed for r in compare_runs(ref, run_samples(original, feeds, provider="cpu"))[0]):
            row.update(status="ort-skip", detail="ORT runs it, with random outputs (differ run to run: "
                                                 "Dropout in training mode, seen at validation's sizes)")
            return row
        if bad:
            worst = max(bad, key=lambda r: np.nan_to_num(r.max_abs, nan=np.inf))
            row.update(status="differs", detail=f"{worst.name}: max abs {worst.max_abs:.3g} "
                                                f"({worst.error or 'beyond tolerance'})")
            return row
        row.update(status="ok", detail="" if row["input_full_check"] or problem is None else
                   f"output fails the checker as the input does: {problem[:100]}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--target", default="contrib", choices=["cuda", "contrib", "onnx"])
    ap.add_argument("-j", "--jobs", type=int, default=1, help="models checked at once (one process each)")
    ap.add_argument("--count-ops", default="", help="comma-separated op types to count in each original and output")
    ap.add_argument("--with-ops", default="", help="check only models whose original holds one of these op types")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    models = sorted(str(f) for f in args.folder.rglob("*.onnx"))
    if args.with_ops:
        import onnx

        wanted = set(args.with_ops.split(","))
        models = [m for m in models if wanted & set(op_counts(onnx.load(m, load_external_data=False)))]
    rows = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(check_one, m, args.target): m for m in models}
        for fut in concurrent.futures.as_completed(futures):
            try:
                rows.append(fut.result())
            except Exception as exc:
                rows.append({"model": futures[fut], "status": "crash", "detail": repr(exc)[:200], "repaired": "",
                             "input_full_check": None})
    rows.sort(key=lambda r: r["model"])
    base = str(args.folder).rstrip("/") + "/"
    for r in rows:
        if r["status"] != "ok" or r["detail"]:
            print(f"{r['status']:15} {r['model'].replace(base, '')}: {r['detail']}")
    counts = collections.Counter(r["status"] for r in rows)
    runs = [r for r in rows if r["status"] != "ort-skip"]
    repaired = [r for r in runs if r["repaired"]]
    kinds = collections.Counter(part.split(" (")[0].split(":")[0].strip()
                                for r in repaired for part in r["repaired"].split("; "))
    print()
    print("| models | count |\n|---|---|")
    print(f"| in the folder | {len(rows)} |")
    skips = collections.Counter(r["detail"].split(":")[0].split(" (")[0] for r in rows if r["status"] == "ort-skip")
    for why, n in sorted(skips.items()):
        print(f"| skipped: {why} | {n} |")
    print(f"| ORT runs | {len(runs)} |")
    print(f"| of those, input passes onnx.checker (full_check) | {sum(1 for r in runs if r['input_full_check'])} |")
    print(f"| of those, input fails onnx.checker (refused at load before issue 29) | "
          f"{sum(1 for r in runs if r.get('input_check') is False)} |")
    for status in sorted(counts):
        if status != "ort-skip":
            print(f"| onnxfuse: {status} | {counts[status]} |")
    print(f"| accepted after a repair at load | {len(repaired)} |")
    print("\n| repair | models |\n|---|---|")
    for kind, n in kinds.most_common():
        print(f"| {kind} | {n} |")
    if args.count_ops:
        print_op_counts(rows, args.count_ops.split(","), base)
    return 0 if all(r["status"] in ("ok", "ort-skip") for r in rows) else 1


def print_op_counts(rows, names, base) -> None:
    """Per model with any of ``names`` in its original or output: their counts before → after; totals."""
    print(f"\n| model | {' | '.join(names)} (original → onnxfuse) |\n|---|{'---|' * len(names)}")
    total_in, total_out = collections.Counter(), collections.Counter()
    for r in rows:
        ops_in, ops_out = r.get("ops_in"), r.get("ops_out")
        if ops_in is None or not any(ops_in[n] or ops_out[n] for n in names):
            continue
        total_in.update({n: ops_in[n] for n in names})
        total_out.update({n: ops_out[n] for n in names})
        print(f"| {r['model'].replace(base, '')} | " + " | ".join(f"{ops_in[n]} → {ops_out[n]}" for n in names) + " |")
    print("| **total** | " + " | ".join(f"{total_in[n]} → {total_out[n]}" for n in names) + " |")


if __name__ == "__main__":
    sys.exit(main())
