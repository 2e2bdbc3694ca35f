"""Absolute-error histograms on a log scale: the numbers (what compare and diff compute; their SVG
rendering is :mod:`onnxfuse.reports.histogram`'s).

Errors between two tensors span many orders of magnitude (1e-9 for a reordered sum, 1e-1 for a bug),
so bins are decades split in ``bins_per_decade``; exact zeros are counted apart, since log(0) has no bin.
"""

from __future__ import annotations

import math

import numpy as np


def error_histogram(ref: np.ndarray, got: np.ndarray, bins_per_decade: int = 2, max_bins: int = 40) -> dict | None:
    """Histogram of ``|got - ref|`` over elements finite on both sides; ``None`` if shapes differ.

    Returns ``{"zeros": n, "edges": [e0, ..., ek], "counts": [c0, ..., c(k-1)], "nonfinite": n}``
    where bin ``i`` holds errors in ``[edges[i], edges[i+1])`` (the last bin is closed).
    """
    ref = np.asarray(ref)
    got = np.asarray(got)
    if ref.shape != got.shape:
        return None
    r = ref.astype(np.float64, copy=False).ravel()
    g = got.astype(np.float64, copy=False).ravel()
    both = np.isfinite(r) & np.isfinite(g)
    err = np.abs(g[both] - r[both])
    nonzero = err[err > 0]
    hist = {"zeros": int(err.size - nonzero.size), "edges": [], "counts": [], "nonfinite": int((~both).sum())}
    if nonzero.size == 0:
        return hist
    log_edges = log_bin_edges(float(nonzero.min()), float(nonzero.max()), bins_per_decade, max_bins)
    counts, _ = np.histogram(np.log10(nonzero), bins=log_edges)
    hist["edges"] = [float(10.0**e) for e in log_edges]
    hist["counts"] = [int(c) for c in counts]
    return hist


def log_bin_edges(lo_err: float, hi_err: float, bins_per_decade: int, max_bins: int) -> np.ndarray:
    """log10 bin edges covering [lo_err, hi_err] (both > 0) on whole bins of 1/bins_per_decade decade,
    at most ``max_bins`` of them (the histogram of one tensor and of a tensor in pieces share them)."""
    lo = math.floor(math.log10(lo_err) * bins_per_decade) / bins_per_decade
    hi = math.ceil(math.log10(hi_err) * bins_per_decade) / bins_per_decade
    n = min(max(1, round((hi - lo) * bins_per_decade)), max_bins)
    if hi <= lo:
        hi = lo + 1.0 / bins_per_decade
    return np.linspace(lo, hi, n + 1)
