"""Snapshot of what the rewrites make of every test graph, to prove a refactor changes nothing.

For every ``testdata/*.onnx`` (a file that fails to load or optimize is recorded with its error, as it
fails today) and target ``cuda`` and ``contrib`` and each again with ``precision="fp16"`` (a model
that refuses it, a float16 one, is recorded with the error), and target ``cuda`` with ``precision="bf16"``
(unvalidated, as every record: a bfloat16 model cannot run on this CPU), and for ``tests/fuzz_attention_graphs.random_attention_model(seed)``, seeds 0..199 by default, and
a few hand-picked ``tests/rewrites/test_contrib_attention.attention_model`` graphs (:data:`EXTRA`), it
runs ``onnxfuse.optimize(model, target=T, validate=False, bench=False)`` and records the sha256 of
``result.model.SerializeToString()``, the refusals (rule, node, reason), the per-rewrite details and the
dropped rules. Run it before and after a change and compare::

    python tools/rewrite_snapshot.py --out /tmp/before.json            # on the base commit
    python tools/rewrite_snapshot.py --out /tmp/after.json --compare /tmp/before.json

(several ``--compare`` snapshots of the base, from several runs, collect the variants of the float16
cases that are not deterministic: below.)

``--compare`` prints every case whose record differs and exits 1 if any does; a differing case is first
rerun up to ``--retries`` times (default 5) and passes if a rerun equals the base, with a line saying so
(:func:`_retry`: the float16 conversion is not deterministic from one process to the next).

Each case (a file, a chunk of seeds, the extra graphs) runs in a fresh process with the cyclic garbage
collector off: optimizing a model is not independent of what the same process optimized before (found
here: ``distilbert_tiny_opset14.onnx`` with ``precision="fp16"`` folds one more Cast after three other
models were optimized in that process, and not with ``gc.disable()``, which points at something keyed by
``id()`` of freed objects), so a snapshot taken in shared processes would differ between runs for no
change of code. String hashing is seeded (``PYTHONHASHSEED=0``, the script re-runs itself with it): some
rewrites iterate over sets of names, whose order otherwise changes from one process to the next. ``--jobs`` runs cases in
that many processes (default 2); ``--seeds N`` takes seeds 0..N-1; ``--only SUBSTRING`` keeps the cases
whose name contains it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
import gc
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("cuda", "contrib")
SEED_CHUNK = 20  # random graphs per process (fixed chunks: the same history every run)


def _record(model, **kwargs) -> dict:
    import onnxfuse

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = onnxfuse.optimize(model, validate=False, bench=False, **kwargs)
    except Exception as e:  # noqa: BLE001  (recorded: it must fail the same way after the change)
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    applied = result.applied
    return {
        "sha256": hashlib.sha256(result.model.SerializeToString()).hexdigest(),
        "refusals": [[r.rule, r.node, r.reason] for r in applied.refusals],
        "details": json.loads(json.dumps(applied.details, default=str)),
        "dropped": applied.dropped,
    }


def _file_case(path: str) -> dict:
    import onnx

    out = {}
    try:
        model = onnx.load(path)
    except Exception as e:  # noqa: BLE001
        return {f"{Path(path).name}": {"load_error": f"{type(e).__name__}: {str(e)[:200]}"}}
    for target in TARGETS:
        out[f"{Path(path).name}|{target}"] = _record(model, target=target)
        out[f"{Path(path).name}|{target}|fp16"] = _record(model, target=target, precision="fp16")
    # bfloat16 is a CUDA precision (its ops' kernels are CUDA's): one record, target cuda
    out[f"{Path(path).name}|cuda|bf16"] = _record(model, target="cuda", precision="bf16")
    return out


def _seed_case(seeds) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from fuzz_attention_graphs import random_attention_model

    out = {}
    for seed in seeds:
        model = random_attention_model(seed)
        out.update({f"fuzz-attention-{seed}|{t}": _record(model, target=t) for t in TARGETS})
    return out


#: hand-picked ``attention_model`` options for paths the files and the random graphs do not reach: the
#: float32 long-key policy (refused cross-attention, the packed all-keys mask), cross-attention masks
EXTRA = {
    "long-self": dict(seq=256), "long-self-padding": dict(seq=256, mask="padding"),
    "long-self-causal": dict(seq=256, mask="causal"), "long-self-where": dict(seq=256, mask="where"), "long-cross": dict(cross=True, kv_len=256),
    "long-cross-fp16": dict(cross=True, kv_len=256, dtype="float16"), "cross-255": dict(cross=True, kv_len=255),
    "cross-padding": dict(cross=True, mask="padding"), "cross-where": dict(cross=True, mask="where"),
    "cross-padding-fp16": dict(cross=True, mask="padding", dtype="float16"),
}


def _extra_case(names) -> dict:
    import numpy as np

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "rewrites" / "contrib")]
    from test_contrib_attention import attention_model

    out = {}
    for name in names:
        options = dict(EXTRA[name])
        options["dtype"] = np.dtype(options.get("dtype", "float32")).type
        model = attention_model(**options)
        out.update({f"extra-{name}|{t}": _record(model, target=t) for t in TARGETS})
    return out


def _run(case):
    kind, arg = case
    return {"file": _file_case, "seed": _seed_case, "extra": _extra_case}[kind](arg)


def main(argv=None) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":  # set iteration order must not change between runs
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", action="append", default=[],
                        help="a snapshot of the base; several: a record passes when it equals any of theirs")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--only", default="")
    parser.add_argument("--retries", type=int, default=5, help="reruns of a differing case before it counts")
    args = parser.parse_args(argv)
    cases = [("file", str(p)) for p in sorted((ROOT / "testdata").glob("*.onnx"))]
    seeds = [s for s in range(args.seeds) if args.only in f"fuzz-attention-{s}"]
    extra = [name for name in EXTRA if args.only in f"extra-{name}"]
    cases = [c for c in cases if args.only in Path(c[1]).name]
    cases += [("seed", seeds[i:i + SEED_CHUNK]) for i in range(0, len(seeds), SEED_CHUNK)]
    cases += [("extra", extra)] if extra else []
    snapshot: dict = {}
    with Pool(args.jobs, initializer=gc.disable, maxtasksperchild=1) as pool:  # a fresh process per case
        for part in pool.imap(_run, cases, chunksize=1):
            snapshot.update(part)
    Path(args.out).write_text(json.dumps(snapshot, indent=1, sort_keys=True))
    print(f"{len(snapshot)} records ({sum('sha256' in r for r in snapshot.values())} optimized) -> {args.out}")
    if not args.compare:
        return 0
    bases = [json.loads(Path(p).read_text()) for p in args.compare]
    base = bases[0]
    keys = sorted(set().union(*bases, snapshot)) if not args.only else sorted(snapshot)
    differ = [k for k in keys if all(b.get(k) != snapshot.get(k) for b in bases)]
    if differ and args.retries:
        differ = _retry(differ, bases, args.retries, args.jobs)
    for k in differ:
        b, a = base.get(k, {}), snapshot.get(k, {})
        fields = sorted(f for f in set(b) | set(a) if b.get(f) != a.get(f))
        print(f"DIFFERS {k}: {', '.join(fields)}")
    print(f"compared {len(keys)} records: {len(keys) - len(differ)} identical, {len(differ)} differ "
          f"({sum('sha256' in base.get(k, {}) for k in keys)} optimized models in the base)")
    return 1 if differ else 0


def _case_of(key: str):
    name = key.split("|")[0]
    if name.startswith("fuzz-attention-"):
        return ("seed", (int(name.rsplit("-", 1)[1]),))
    if name.startswith("extra-"):
        return ("extra", (name[len("extra-"):],))
    return ("file", str(ROOT / "testdata" / name))


def _retry(differ, bases, retries: int, jobs: int) -> list[str]:
    """The keys still differing after rerunning their cases up to ``retries`` times, each in a fresh process:
    a record passes when one rerun equals the base. Needed for the float16 cases: on the base commit
    itself, a rerun of ``--precision fp16`` sometimes folds one Cast more or less (fold-constants' count,
    then the names of later nodes), 1-3 of the 156 float16 records per run; the cause is outside the
    rewrites this tool checks (the float16 conversion and constant folding), and it is printed per key."""
    left = set(differ)
    for attempt in range(1, retries + 1):
        cases = sorted({_case_of(k) for k in left})
        with Pool(jobs, initializer=gc.disable, maxtasksperchild=1) as pool:
            rerun = {k: v for part in pool.imap(_run, cases, chunksize=1) for k, v in part.items()}
        for k in sorted(left):
            if any(rerun.get(k) == b.get(k) for b in bases):
                print(f"equal on rerun {attempt}: {k}")
                left.discard(k)
        if not left:
            break
    return sorted(left)

if __name__ == "__main__":
    sys.exit(main())
