#!/usr/bin/env python3
"""Where the memory of ``onnxfuse optimize`` goes, stage by stage, on a large model.

Runs :func:`onnxfuse.optimize` in this process while a thread samples the resident set (``VmRSS`` from
``/proc/self/status``, file-backed pages included, as ``/usr/bin/time -v`` counts them) every 20 ms.
Stages are the pipeline's progress messages (loading, rewriting, checking, validating, saving) and,
inside rewriting, each rule (its ``rewrite`` calls are wrapped to mark the stage) and the export
(``model_io.to_model``). Prints, per stage, the RSS on entry and the peak during it, in GiB and as a
multiple of the model's weights.

    python benchmarks/large_model.py /tmp/big/model.onnx
    python benchmarks/large_model_memory.py /tmp/big/model.onnx /tmp/big/model.opt.onnx --target onnx

``--store-new-weights`` measures the rule-side change docs/large-models.md proposes, without making
it: ``rewrites._weights.set_param`` is wrapped so that each weight it writes goes through
:func:`onnxfuse.model_io.store_weight` (to the spill file) at once, instead of piling up until the
export.

Never imported by the package.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler:
    def __init__(self, period: float = 0.02):
        self.period = period
        self.stage = "start"
        self.rows: dict[str, list[float]] = {}
        self.order: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def mark(self, stage: str) -> None:
        now = rss_bytes()
        with self._lock:
            self.stage = stage
            if stage not in self.rows:
                self.rows[stage] = [now, now, time.perf_counter(), 0.0]
                self.order.append(stage)

    def _sample(self) -> None:
        now = rss_bytes()
        with self._lock:
            row = self.rows.get(self.stage)
            if row is not None:
                row[1] = max(row[1], now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.period)

    def __enter__(self):
        self.mark("start")
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self._sample()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("output", type=Path)
    ap.add_argument("--target", default="onnx")
    ap.add_argument("--no-validate", action="store_true")
    ap.add_argument("--store-new-weights", action="store_true",
                    help="simulate rules handing new weights to model_io.store_weight (see the docstring)")
    args = ap.parse_args()

    import onnxfuse
    from onnxfuse import lazy_weights, model_io
    from onnxfuse.rewrites import RULES

    sampler = Sampler()
    for rule in RULES:
        original = rule.rewrite

        def wrapped(graph, match, _original=original, _name=rule.name):
            sampler.mark(f"  rule {_name}")
            return _original(graph, match)

        rule.rewrite = wrapped
    to_model = model_io.to_model

    def marked_to_model(graph, template):
        sampler.mark("  export (to_model)")
        return to_model(graph, template)

    model_io.to_model = marked_to_model
    if args.store_new_weights:
        import sys

        from onnxfuse.rewrites.engine import edit as _weights

        set_param = _weights.set_param

        def storing_set_param(graph, node, index, values, role="param"):
            mode = set_param(graph, node, index, values, role)
            t = node.inputs[index]
            t.values = model_io.store_weight(graph, t._values)
            return mode

        for name, module in list(sys.modules.items()):  # rule modules import set_param by name
            if name.startswith("onnxfuse.rewrites") and getattr(module, "set_param", None) is set_param:
                module.set_param = storing_set_param
    t0 = time.perf_counter()
    with sampler:
        onnxfuse.optimize(str(args.model), str(args.output), target=args.target, validate=not args.no_validate,
                          progress=sampler.mark)
        sampler.mark("done")
    weights = model_io.last_model_weights or 1
    gib = 2**30
    print(f"{args.model}: weights {weights / gib:.3f} GiB; {time.perf_counter() - t0:.1f} s; "
          f"lazy={weights >= lazy_weights.LAZY_MODEL_BYTES}")
    print(f"{'stage':32s} {'RSS at start':>14s} {'peak in stage':>14s} {'peak/weights':>13s}")
    for stage in sampler.order:
        start, peak, _, _ = sampler.rows[stage]
        print(f"{stage:32s} {start / gib:11.2f} GiB {peak / gib:11.2f} GiB {peak / weights:12.2f}x")


if __name__ == "__main__":
    main()
