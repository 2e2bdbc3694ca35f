#!/usr/bin/env python3
"""Fuzz the optimizer: random graphs (tests/fuzz_graphs.py) through `onnxfuse.optimize`, checked for
validity, loadability, equal outputs and idempotence. Prints a tally and every failing seed.

    python tools/fuzz_optimize.py --count 2000 [--start 0] [--jobs 2] [--target cuda|contrib|onnx]
    python tools/fuzz_optimize.py --attention --count 2000   # random attention graphs (fuzz_attention_graphs.py)
    python tools/fuzz_optimize.py --only +contrib-channels-last --target cuda --count 500   # with an opt-in rule
    python tools/fuzz_optimize.py --cnn --count 1000   # random conv nets through contrib-channels-last
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fuzz_graphs import check_seed  # noqa: E402


def _one(args):
    seed, target, kind, only = args  # kind: "precision", "cnn", True (attention graphs) or False (op graphs)
    if kind == "precision":
        from fuzz_graphs import check_precision_seed
        return seed, *check_precision_seed(seed, target)
    if kind == "cnn":
        from fuzz_cnn_graphs import check_cnn_seed

        return seed, *check_cnn_seed(seed, target)
    if kind:
        from fuzz_attention_graphs import check_attention_seed

        return seed, *check_attention_seed(seed, target)
    return seed, *check_seed(seed, target, only=only)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--target", default=None, help="default: cycle cuda, contrib, onnx by seed")
    ap.add_argument("--attention", action="store_true", help="random attention graphs instead of random op graphs")
    ap.add_argument("--cnn", action="store_true",
                    help="random conv nets with contrib-channels-last added (tests/fuzz_cnn_graphs.py)")
    ap.add_argument("--precision", action="store_true",
                    help="optimize --precision fp16 of random float32 op graphs, validation on; its own drift check "
                         "against the plain float16 conversion ('refused' is an allowed outcome)")
    ap.add_argument("--only", default=None, metavar="RULES",
                    help="optimize's --only, e.g. +contrib-channels-last to add an opt-in rule (op graphs only)")
    args = ap.parse_args()
    t0 = time.time()
    tally = collections.Counter()
    kind = "cnn" if args.cnn else "precision" if args.precision else args.attention
    work = [(s, args.target, kind, args.only) for s in range(args.start, args.start + args.count)]
    with ProcessPoolExecutor(args.jobs) as pool:
        for seed, status, detail in pool.map(_one, work, chunksize=8):
            tally[status] += 1
            if status not in ("ok", "skip", "ort-bug"):
                print(f"seed {seed}: {status}: {detail}", flush=True)
    print(f"{args.count} graphs in {time.time() - t0:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    return 0 if set(tally) <= {"ok", "skip", "ort-bug", "refused"} else 1


if __name__ == "__main__":
    sys.exit(main())
