"""Parsing ONNX Runtime's profiler trace (``SessionOptions.enable_profiling``) into per-op numbers.

The trace is a JSON array of Chrome-trace events. The ones used here:

* ``cat == "Session"``, ``name == "model_run"``: one per ``Run`` call, so per-run averages can be taken;
* ``cat == "Node"``, ``name`` ending in ``_kernel_time``: one per node executed, with ``args.op_name``,
  ``args.provider`` and ``dur`` (µs). (``_fence_before``/``_fence_after`` records are bookkeeping.)
  With the CUDA provider this duration is host time spent in the node's ``Compute`` (mostly launching
  its kernels), not GPU execution time;
* ``cat == "Kernel"``: GPU kernel records, present only when ONNX Runtime was built with CUDA
  profiling (CUPTI). Pip wheels usually are not, so kernel counts are reported as unknown then.

Everything here is pure: a list of events in, dataclasses out.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

_KERNEL_SUFFIX = "_kernel_time"


@dataclass
class OpStat:
    """One op type's share of a run (averaged over the profiled runs)."""

    op: str
    calls_per_run: float
    ms_per_run: float
    share: float  # of the node time of a run, 0..1
    providers: list[str] = field(default_factory=list)
    kernels_per_run: float | None = None

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "calls_per_run": round(self.calls_per_run, 3),
            "ms_per_run": round(self.ms_per_run, 6),
            "share": round(self.share, 4),
            "providers": self.providers,
            "kernels_per_run": None if self.kernels_per_run is None else round(self.kernels_per_run, 3),
        }


@dataclass
class TraceSummary:
    """Per-op totals of a profiled session."""

    runs: int
    ops: list[OpStat]
    nodes_per_run: float
    node_ms_per_run: float
    kernels_per_run: float | None  # None: the trace has no GPU kernel records
    kernel_ms_per_run: float | None
    nodes_by_provider: dict[str, float]  # per run
    notes: list[str] = field(default_factory=list)

    def top_by_time(self, n: int = 10) -> list[OpStat]:
        return sorted(self.ops, key=lambda o: (-o.ms_per_run, o.op))[:n]

    def top_by_count(self, n: int = 10) -> list[OpStat]:
        return sorted(self.ops, key=lambda o: (-o.calls_per_run, -o.ms_per_run, o.op))[:n]

    def to_dict(self, top: int = 10) -> dict:
        return {
            "runs": self.runs,
            "nodes_per_run": round(self.nodes_per_run, 3),
            "node_ms_per_run": round(self.node_ms_per_run, 6),
            "kernels_per_run": None if self.kernels_per_run is None else round(self.kernels_per_run, 3),
            "kernel_ms_per_run": None if self.kernel_ms_per_run is None else round(self.kernel_ms_per_run, 6),
            "nodes_by_provider": {k: round(v, 3) for k, v in self.nodes_by_provider.items()},
            "top_by_time": [o.to_dict() for o in self.top_by_time(top)],
            "top_by_count": [o.to_dict() for o in self.top_by_count(top)],
            "ops": [o.to_dict() for o in self.ops],
            "notes": list(self.notes),
        }


def load_trace(path: str | Path) -> list[dict]:
    """Events of a trace file (ONNX Runtime writes a bare array; ``{"traceEvents": [...]}`` also works)."""
    data = json.loads(Path(path).read_text())
    return events_of(data)


def events_of(data) -> list[dict]:
    if isinstance(data, dict):
        data = data.get("traceEvents", [])
    if not isinstance(data, list):
        raise ValueError("not an ONNX Runtime profiler trace (expected a JSON array of events)")
    return [e for e in data if isinstance(e, dict)]


def _is_kernel(event: dict) -> bool:
    return str(event.get("cat", "")).lower() == "kernel"


def summarize_trace(events: list[dict] | dict, skip_runs: int = 0) -> TraceSummary:
    """Per-op time and counts, averaged per run (``events``: a trace's event list or its JSON object).

    ``skip_runs`` drops the first runs' records (warm-up, CUDA-graph capture) using the ``model_run``
    records' start times; without ``model_run`` records everything counts as one run.
    """
    events = events_of(events)
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e.get("ts", 0))
    start_ts = None
    if skip_runs and len(runs) > skip_runs:
        start_ts = runs[skip_runs].get("ts", 0)
        runs = runs[skip_runs:]
    n_runs = max(1, len(runs))
    notes: list[str] = []

    def counted(e: dict) -> bool:
        return start_ts is None or e.get("ts", 0) >= start_ts

    node_calls: dict[str, int] = defaultdict(int)
    node_us: dict[str, float] = defaultdict(float)
    providers: dict[str, set] = defaultdict(set)
    by_provider: dict[str, int] = defaultdict(int)
    node_op: dict[str, str] = {}
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith(_KERNEL_SUFFIX) or not counted(e):
            continue
        args = e.get("args") or {}
        op = str(args.get("op_name") or "?")
        node_op[str(e["name"])[: -len(_KERNEL_SUFFIX)]] = op
        node_calls[op] += 1
        node_us[op] += float(e.get("dur", 0) or 0)
        prov = str(args.get("provider") or "?")
        providers[op].add(prov)
        by_provider[prov] += 1

    kernels = [e for e in events if _is_kernel(e) and counted(e)]
    kernel_calls: dict[str, int] = defaultdict(int)
    kernel_us = 0.0
    for e in kernels:
        args = e.get("args") or {}
        op = args.get("op_name")
        if not op:
            parent = str(args.get("parent_name", ""))
            op = node_op.get(parent[: -len(_KERNEL_SUFFIX)] if parent.endswith(_KERNEL_SUFFIX) else parent, "?")
        kernel_calls[str(op)] += 1
        kernel_us += float(e.get("dur", 0) or 0)
    if not kernels:
        notes.append("no GPU kernel records in the trace (ONNX Runtime built without CUDA profiling): "
                     "kernel counts unknown; node counts and host-side node times only")

    total_us = sum(node_us.values())
    ops = [
        OpStat(
            op=op,
            calls_per_run=node_calls[op] / n_runs,
            ms_per_run=node_us[op] / n_runs / 1000.0,
            share=(node_us[op] / total_us) if total_us > 0 else 0.0,
            providers=sorted(providers[op]),
            kernels_per_run=(kernel_calls.get(op, 0) / n_runs) if kernels else None,
        )
        for op in node_calls
    ]
    for op in set(kernel_calls) - set(node_calls):  # kernels we could not tie to a node
        ops.append(OpStat(op=op, calls_per_run=0.0, ms_per_run=0.0, share=0.0,
                          kernels_per_run=kernel_calls[op] / n_runs))
    ops.sort(key=lambda o: (-o.ms_per_run, o.op))
    return TraceSummary(
        runs=len(runs) if runs else 1,
        ops=ops,
        nodes_per_run=sum(node_calls.values()) / n_runs,
        node_ms_per_run=total_us / n_runs / 1000.0,
        kernels_per_run=(len(kernels) / n_runs) if kernels else None,
        kernel_ms_per_run=(kernel_us / n_runs / 1000.0) if kernels else None,
        nodes_by_provider={k: v / n_runs for k, v in sorted(by_provider.items())},
        notes=notes,
    )
