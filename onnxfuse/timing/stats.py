"""Latency statistics: pure functions over lists of run times, so they test without a GPU.

Percentiles interpolate linearly between closest ranks (numpy's default ``linear`` method): for sorted
samples ``x[0..n-1]`` the q-th percentile sits at rank ``(n-1)·q/100``. With few samples, p99 is close
to the maximum; :class:`LatencyStats` keeps the count so a reader can judge.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of already-sorted values, linear interpolation."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    rank = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


@dataclass(frozen=True)
class LatencyStats:
    """Summary of ``count`` runs, all times in milliseconds."""

    count: int
    median_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float
    mean_ms: float
    std_ms: float

    @property
    def spread(self) -> float:
        """(p90 − median) / median: a cheap noise indicator (0.02 = p90 within 2 % of the median)."""
        return (self.p90_ms - self.median_ms) / self.median_ms if self.median_ms > 0 else 0.0

    def to_dict(self) -> dict:
        d = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        d["spread"] = round(self.spread, 4)
        return d


def summarize(samples_ms: Sequence[float]) -> LatencyStats:
    """Statistics of run times given in milliseconds."""
    if not samples_ms:
        raise ValueError("no timing samples to summarize")
    xs = sorted(float(x) for x in samples_ms)
    n = len(xs)
    mean = math.fsum(xs) / n
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return LatencyStats(
        count=n,
        median_ms=percentile(xs, 50),
        p90_ms=percentile(xs, 90),
        p99_ms=percentile(xs, 99),
        min_ms=xs[0],
        max_ms=xs[-1],
        mean_ms=mean,
        std_ms=math.sqrt(var),
    )


def speedup(baseline_ms: float | None, candidate_ms: float | None) -> float | None:
    """How many times faster ``candidate`` is than ``baseline`` (>1 = faster); None when unknown."""
    if not baseline_ms or not candidate_ms or baseline_ms <= 0 or candidate_ms <= 0:
        return None
    return baseline_ms / candidate_ms


def should_stop(count: int, elapsed_s: float, *, iterations: int | None, time_budget_s: float | None,
                min_iterations: int) -> bool:
    """The sampling loop's stopping rule.

    Stop once ``iterations`` runs were made, or once ``time_budget_s`` has passed — but never before
    ``min_iterations`` runs (unless ``iterations`` itself is smaller). With neither limit, stop after
    ``min_iterations``.
    """
    if iterations is not None and count >= iterations:
        return True
    floor = min_iterations if iterations is None else min(min_iterations, iterations)
    if count < floor:
        return False
    if time_budget_s is None:
        return iterations is None
    return elapsed_s >= time_budget_s
