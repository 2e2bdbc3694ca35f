"""Elementwise fusion does work proportional to the graph, not to the graph times the region.

Counted, not timed: the number of times the region analysis reads a node's operands while fusing a
chain of N elementwise nodes into one region must grow linearly with N. Before the incremental
judge (17285c3) every join rescanned the whole region: N=400 read operands about 80,000 times,
N=800 about 320,000 times (quadratic). benchmarks/optimizer_scaling.py has the seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnxfuse
from onnxfuse.rewrites.elementwise import regions

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from optimizer_scaling import chain  # noqa: E402


def _operand_reads(n: int, monkeypatch) -> int:
    calls = 0
    original = regions.RegionAnalysis.dynamic_operands

    def counting(self, i):
        nonlocal calls
        calls += 1
        return original(self, i)

    monkeypatch.setattr(regions.RegionAnalysis, "dynamic_operands", counting)
    result = onnxfuse.optimize(chain(n), validate=False, only="fuse-elementwise")
    assert [node.op_type for node in result.model.graph.node] == ["FusedElementwise"]
    monkeypatch.undo()
    return calls


def test_chain_fusion_is_linear(monkeypatch):
    small, large = _operand_reads(400, monkeypatch), _operand_reads(800, monkeypatch)
    assert large < 2.5 * small, (small, large)
    assert large < 20 * 800  # a few reads per node, not one per node per join
