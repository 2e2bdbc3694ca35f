#!/usr/bin/env python3
"""Fused-op counts per kind, onnxfuse against ONNX Runtime's transformers optimizer (ORT-T), on ORT's corpus.

Issue 30's row: on ONNX Runtime's fusion test corpus (``tools/fetch_ort_corpus.py``), onnxfuse's fused-op
count per kind is at least ORT-T's, with every output valid and equal. For each ``*.onnx`` under the
folder that ONNX Runtime's CPU provider runs (the selection of ``tools/ort_corpus_check.py``: what it
skips, this skips):

1. ORT-T: ``onnxruntime.transformers.optimizer.optimize_model(path, model_type=T, num_heads=0,
   hidden_size=0, opt_level=L, use_gpu=False)`` for every T in ``--model-types`` (bert, gpt2) and L in
   ``--opt-levels`` (0, 1); a configuration that raises is counted as failed. Per model and kind ORT-T is
   credited with the **best** of its configurations (the most fused ops of that kind), so ORT-T is
   given every chance; a second column credits it with one configuration per model
   (:func:`one_config_ort_t`), as a user runs it. Each configuration's output is checked by
   ``onnx.checker`` (full_check), run by ORT (CPU) on the same seeded inputs, and compared with the original by onnxfuse's comparator.
2. onnxfuse: ``onnxfuse.optimize(path, out, target="contrib", validate=True, bench=False)`` (validation
   on: an output that is not equal is an error, caught and counted as ``ort_corpus_check`` does), then the
   full checker on its output.

Counted per kind, in the original and in each output (any domain unless said, subgraphs included):

- Attention: com.microsoft Attention, MultiHeadAttention, GroupQueryAttention
- SkipLayerNorm: SkipLayerNormalization
- EmbedLayerNorm: EmbedLayerNormalization
- Gelu: Gelu, BiasGelu
- FastGelu: FastGelu
- SimplifiedLayerNorm: SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization, RMSNormalization
- LayerNorm: LayerNormalization

"Fused" is ``max(0, output - original)``: only ops the optimizer made. Prints a Markdown table (kind |
originals | ORT-T fused | onnxfuse fused | models where ORT-T made more), and for every such model the
reasons onnxfuse gave (``result.unfused`` rows and ``result.applied.refusals`` of the kind's rules,
names folded), and the validity of ORT-T's outputs.

    python tools/ort_corpus_peer.py /tmp/ort-corpus -j 2
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import datetime
import io
import os
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ort_corpus_check import _full_check, _ort_runs  # noqa: E402  (same selection, same inputs)

#: kind → (op types counted, domain required or None for any)
KINDS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "Attention": (("Attention", "MultiHeadAttention", "GroupQueryAttention"), "com.microsoft"),
    "SkipLayerNorm": (("SkipLayerNormalization",), None),
    "EmbedLayerNorm": (("EmbedLayerNormalization",), None),
    "Gelu": (("Gelu", "BiasGelu"), None),
    "FastGelu": (("FastGelu",), None),
    "SimplifiedLayerNorm": (("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                             "RMSNormalization"), None),
    "LayerNorm": (("LayerNormalization",), None),
}

#: kind → onnxfuse rules (target contrib) whose refusals explain a missing fusion of that kind.
RULES: dict[str, tuple[str, ...]] = {
    "Attention": ("contrib-attention",),
    "SkipLayerNorm": ("contrib-skip-layernorm", "contrib-layernorm"),
    "EmbedLayerNorm": ("contrib-embed-layernorm", "contrib-layernorm"),
    "Gelu": ("contrib-gelu", "contrib-bias-gelu"),
    "FastGelu": ("contrib-fast-gelu",),
    "SimplifiedLayerNorm": ("contrib-rmsnorm", "contrib-skip-rmsnorm"),
    "LayerNorm": ("contrib-layernorm",),
}


def kind_counts(model) -> dict[str, int]:
    """Ops of each kind in ``model`` (a ModelProto), subgraphs included."""
    counts = collections.Counter()
    by_op = {op: (kind, dom) for kind, (ops, dom) in KINDS.items() for op in ops}

    def walk(graph):
        for node in graph.node:
            hit = by_op.get(node.op_type)
            if hit and (hit[1] is None or node.domain == hit[1]):
                counts[hit[0]] += 1
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    walk(sub)

    walk(model.graph)
    return {k: counts[k] for k in KINDS}


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("timed out")


def _stub_torch() -> None:
    """opt_level >= 1 (``optimize_by_onnxruntime``) imports ``torch.version`` only to read ``.hip`` for a GPU
    session; without torch installed, a stub module saying "no ROCm" stands in (CPU sessions never read it)."""
    import importlib.util
    import types

    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        return
    torch = types.ModuleType("torch")
    torch.version = types.SimpleNamespace(hip=None, cuda=None)
    sys.modules["torch"] = torch


def _ort_t(path: Path, model_type: str, opt_level: int, samples, reference) -> dict:
    """One ORT-T configuration: counts, checker verdict, runs on ORT CPU, equal to the original."""
    import logging

    import onnx

    from onnxfuse.errors import first_line
    from onnxfuse.runtime.compare import compare_runs
    from onnxfuse.runtime.session import run_samples

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    logging.getLogger().setLevel(logging.ERROR)
    res = {"config": f"{model_type}/O{opt_level}", "error": None}
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(180)
    _stub_torch()
    try:
        from onnxruntime.transformers.optimizer import optimize_model

        with contextlib.redirect_stdout(io.StringIO()):  # its shape inference prints to stdout
            opt = optimize_model(str(path), model_type=model_type, num_heads=0, hidden_size=0,
                                 opt_level=opt_level, use_gpu=False)
        model = opt.model
    except BaseException as exc:  # noqa: BLE001 - ORT-T's failures are counted, whatever they are
        signal.alarm(0)
        res["error"] = f"{type(exc).__name__}: {first_line(exc)[:160]}"
        return res
    signal.alarm(0)
    res["counts"] = kind_counts(model)
    try:
        onnx.checker.check_model(model, full_check=True)
        res["valid"] = True
    except Exception as exc:  # noqa: BLE001
        res["valid"], res["invalid"] = False, " ".join(str(exc).split())[:120]
    try:
        got = run_samples(model, samples, provider="cpu")
        res["runs"] = True
        rows, _ = compare_runs(reference, got)
        bad = [r for r in rows if not r.passed]
        res["equal"] = not bad
        if bad:
            res["differs"] = f"{bad[0].name}: {bad[0].error or f'max abs {bad[0].max_abs:.3g}'}"[:120]
    except Exception as exc:  # noqa: BLE001 - ORT refused to load or run it
        res.setdefault("runs", False)
        res["equal"], res["differs"] = False, first_line(exc)[:120]
    return res


def peer_one(path: str, model_types: tuple[str, ...], opt_levels: tuple[int, ...]) -> dict:
    import onnx

    import onnxfuse
    from onnxfuse.errors import OnnxfuseError, first_line
    from onnxfuse.runtime.session import run_samples
    from onnxfuse.unfused import reason_pattern

    p = Path(path)
    row = {"model": path, "status": None}
    samples, why = _ort_runs(p)
    if samples is None:
        row.update(status="ort-skip", detail=why)
        return row
    original = onnx.load(str(p))
    row["original"] = kind_counts(original)
    row["input_full_check"] = _full_check(p) is None
    reference = run_samples(original, samples, provider="cpu")
    row["ort_t"] = [_ort_t(p, t, lvl, samples, reference) for t in model_types for lvl in opt_levels]
    with tempfile.TemporaryDirectory(prefix="ort-peer-") as tmp:
        out = Path(tmp) / "out.onnx"
        try:
            result = onnxfuse.optimize(str(p), out, target="contrib", validate=True, bench=False, provider="cpu")
        except OnnxfuseError as exc:
            row.update(status=f"exit-{exc.exit_code}", detail=first_line(exc)[:200])
            return row
        except Exception as exc:  # noqa: BLE001 - a crash is a failure too
            row.update(status="crash", detail=f"{type(exc).__name__}: {first_line(exc)[:200]}")
            return row
        row["onnxfuse"] = kind_counts(onnx.load(str(out)))
        problem = _full_check(out)
        row["output_full_check"] = problem is None
        row["status"] = "ok" if (problem is None or not row["input_full_check"]) else "output-invalid"
    reasons = {}
    for kind, rules in RULES.items():
        unf = [f"{u.rule}: {u.count} {u.op} left ({u.reason_count}× '{u.reason}')"
               for u in result.unfused if u.rule in rules]
        ref = collections.Counter(f"{r.rule}: {reason_pattern(r.reason)}"
                                  for r in result.applied.refusals if r.rule in rules)
        reasons[kind] = {"unfused": unf, "refusals": [f"{n}× {why}" for why, n in ref.most_common(4)]}
    row["reasons"] = reasons
    return row


def fused(out: dict, orig: dict, kind: str) -> int:
    return max(0, out[kind] - orig[kind])


def sound(row: dict, c: dict) -> bool:
    """An ORT-T output that counts: ORT (CPU) runs it, its outputs equal the original's (onnxfuse's
    comparator, default tolerances), and it passes the full checker (or fails it as the input does)."""
    return not c["error"] and c.get("runs") and c.get("equal") and (c["valid"] or not row["input_full_check"])


def best_ort_t(row: dict, kind: str, only_sound: bool = False) -> tuple[int, str]:
    """ORT-T's most fused ops of ``kind`` over its configurations, and the configurations giving it."""
    made = [(fused(c["counts"], row["original"], kind), c["config"]) for c in row["ort_t"]
            if not c["error"] and (not only_sound or sound(row, c))]
    if not made:
        return 0, ""
    top = max(n for n, _ in made)
    return top, ",".join(cfg for n, cfg in made if n == top)


def one_config_ort_t(row: dict, kind: str) -> int:
    """ORT-T's fused ops of ``kind`` in ONE output per model: of the outputs that count, the one with the
    most fused ops of all kinds together (the first such configuration on a tie). The best-config columns
    credit ORT-T per kind with a different configuration where that gives more, which counts one residual
    Add + LayerNorm twice when one configuration writes SkipLayerNormalization and another
    LayerNormalization; a user runs one configuration, and onnxfuse writes one model."""
    made = [c for c in row["ort_t"] if not c["error"] and sound(row, c)]
    if not made:
        return 0
    best = max(made, key=lambda c: sum(fused(c["counts"], row["original"], k) for k in KINDS))
    return fused(best["counts"], row["original"], kind)


def report(rows, base: str, args_line: str, model_types, opt_levels) -> str:
    import onnx
    import onnxruntime

    import onnxfuse

    rel = lambda r: r["model"].replace(base, "")  # noqa: E731
    ran = [r for r in rows if r["status"] != "ort-skip"]
    counted = [r for r in ran if "onnxfuse" in r]
    lines = []
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines.append(f"Run {now}, CPU only (onnxruntime {onnxruntime.__version__}, onnx {onnx.__version__}, "
                 f"onnxfuse {getattr(onnxfuse, '__version__', '?')}); ORT-T configurations: "
                 f"model_type {', '.join(model_types)} × opt_level {', '.join(map(str, opt_levels))} "
                 "(num_heads=0, hidden_size=0, use_gpu=False), ORT-T credited per model and kind with its best.\n")
    lines.append(f"```console\n$ {args_line}\n```\n")
    skipped = len(rows) - len(ran)
    status = collections.Counter(r["status"] for r in ran)
    lines.append(f"{len(rows)} models; {skipped} skipped as `ort_corpus_check.py` skips them (ORT cannot load or "
                 f"run them, or their outputs are random); {len(ran)} run by ORT: onnxfuse "
                 + ", ".join(f"{s} {n}" for s, n in sorted(status.items())) + ".\n")
    # ORT-T health
    cfgs = [c["config"] for c in ran[0]["ort_t"]] if ran else []
    lines.append("| ORT-T configuration | raised | output fails full_check (input passes) | "
                 "output fails full_check (input fails too) | ORT CPU cannot run output | outputs differ |")
    lines.append("|---|---|---|---|---|---|")
    for i, cfg in enumerate(cfgs):
        cs = [(r, r["ort_t"][i]) for r in ran]
        err = [c for _, c in cs if c["error"]]
        ok = [(r, c) for r, c in cs if not c["error"]]
        inv_p = sum(1 for r, c in ok if not c["valid"] and r["input_full_check"])
        inv_f = sum(1 for r, c in ok if not c["valid"] and not r["input_full_check"])
        norun = sum(1 for _, c in ok if not c["runs"])
        diff = sum(1 for _, c in ok if c["runs"] and not c["equal"])
        lines.append(f"| {cfg} | {len(err)} | {inv_p} | {inv_f} | {norun} | {diff} |")
    lines.append("")
    # main table
    lines.append(f"Fused ops made (output minus original, at least 0), over the {len(counted)} models onnxfuse "
                 "optimized and validated (`ok`):\n")
    lines.append("| kind | in the originals | ORT-T (best config) | ORT-T, outputs that count (best config) | "
                 "ORT-T, outputs that count (one config per model) | onnxfuse | models where ORT-T made more "
                 "(ORT-T vs onnxfuse; * : that ORT-T output counts) |")
    lines.append("|---|---|---|---|---|---|---|")
    ahead: dict[str, list] = {}
    for kind in KINDS:
        orig = sum(r["original"][kind] for r in counted)
        t_total = sum(best_ort_t(r, kind)[0] for r in counted)
        s_total = sum(best_ort_t(r, kind, True)[0] for r in counted)
        one_total = sum(one_config_ort_t(r, kind) for r in counted)
        f_total = sum(fused(r["onnxfuse"], r["original"], kind) for r in counted)
        more = [r for r in counted if best_ort_t(r, kind)[0] > fused(r["onnxfuse"], r["original"], kind)]
        ahead[kind] = more
        star = lambda r: "*" if best_ort_t(r, kind, True)[0] > fused(r["onnxfuse"], r["original"], kind) else ""  # noqa: E731
        names = ", ".join(f"`{rel(r)}`{star(r)} ({best_ort_t(r, kind)[0]} vs {fused(r['onnxfuse'], r['original'], kind)})"
                          for r in more) or "none"
        lines.append(f"| {kind} | {orig} | {t_total} | {s_total} | {one_total} | {f_total} | {names} |")
    lines.append("")
    # ORT-T ahead: reasons and whether ORT-T's output counted
    details = []
    for kind, more in ahead.items():
        for r in more:
            n, cfg = best_ort_t(r, kind)
            best = [c for c in r["ort_t"] if c["config"] in cfg.split(",")]
            c = next((c for c in best if sound(r, c)), best[0])  # the one that counts, if any
            verdict = ("valid" if c["valid"] else "fails full_check" + (" (input too)" if not r["input_full_check"]
                                                                      else ""))
            verdict += ", runs on ORT CPU" if c["runs"] else ", ORT CPU cannot run it"
            verdict += ", outputs equal" if c.get("equal") else f", outputs differ ({c.get('differs', '')})"
            why = r["reasons"][kind]
            said = "; ".join(why["unfused"] + why["refusals"]) or "no refusal recorded (no candidate seen)"
            details.append(f"- **{kind}**, `{rel(r)}`: ORT-T {n} ({cfg}; {c['config']}'s output: {verdict}), onnxfuse "
                           f"{fused(r['onnxfuse'], r['original'], kind)}. onnxfuse said: {said}")
    if details:
        lines.append("An ORT-T output *counts* when ORT (CPU) runs it, its outputs equal the original's (onnxfuse's "
                     "comparator, default tolerances: float32 rtol 1e-4, atol 1e-5 × max(1, max|ref|)) and it passes "
                     "the full checker or fails it as its input does.\n")
        lines.append("Where ORT-T made more, what onnxfuse's report gives (`result.unfused`, then the most "
                     "frequent `result.applied.refusals` of the kind's rules, names folded):\n")
        lines.extend(details)
        lines.append("")
    failed = [r for r in ran if "onnxfuse" not in r]
    if failed:
        lines.append("Not counted (onnxfuse refused or failed; ORT-T's counts there, best config):\n")
        for r in failed:
            t = {k: best_ort_t(r, k)[0] for k in KINDS if "ort_t" in r and "original" in r}
            made = ", ".join(f"{k} {n}" for k, n in t.items() if n) or "no fusion"
            lines.append(f"- `{rel(r)}` ({r['status']}: {r.get('detail', '')[:120]}); ORT-T: {made}")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("-j", "--jobs", type=int, default=1, help="models at once (one process each; 2 at most here)")
    ap.add_argument("--model-types", default="bert,gpt2")
    ap.add_argument("--opt-levels", default="0,1")
    ap.add_argument("--only", default="", help="substring: only models whose path contains it (quick runs)")
    ap.add_argument("--json", type=Path, help="also write the per-model rows here")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_types = tuple(args.model_types.split(","))
    opt_levels = tuple(int(x) for x in args.opt_levels.split(","))
    models = sorted(str(f) for f in args.folder.rglob("*.onnx") if args.only in str(f))
    rows = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(args.jobs, 2)) as pool:
        futures = {pool.submit(peer_one, m, model_types, opt_levels): m for m in models}
        for fut in concurrent.futures.as_completed(futures):
            try:
                rows.append(fut.result())
            except Exception as exc:  # noqa: BLE001
                rows.append({"model": futures[fut], "status": "crash", "detail": repr(exc)[:200]})
    rows.sort(key=lambda r: r["model"])
    if args.json:
        import json

        args.json.write_text(json.dumps(rows, indent=1, default=str))
    base = str(args.folder).rstrip("/") + "/"
    cmd = "python tools/ort_corpus_peer.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(report(rows, base, cmd, model_types, opt_levels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
