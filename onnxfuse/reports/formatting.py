"""Number formatting shared by the text report builders."""

from __future__ import annotations

import math


def num(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        if x == 0:
            return "0"
        return f"{x:.{digits}g}"
    return str(x)


def percent(x) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0%"
    if x < 0.0001:
        return "<0.01%"
    return f"{100 * x:.2f}%"


def shape(s) -> str:
    return "×".join(str(d) for d in s) if s else "scalar"


def worst(c) -> str:
    """'[i, j] A=… B=…' for a Comparison's worst element, or '-'."""
    if c.worst_index is None or c.error or (c.max_abs == 0 and not c.nonfinite_mismatches):
        return "-"
    sample = c.extra.get("worst_sample")
    where = ("s" + str(sample) + " " if sample is not None else "") + str(list(c.worst_index))
    return f"{where}: A={num(c.worst_ref, 6)} B={num(c.worst_got, 6)}"


def tolerance(c) -> str:
    return f"rtol {c.rtol:.1e}, atol {c.atol:.1e}"


def drift(c) -> tuple[str, str] | None:
    """A precision change's figures for a Comparison (``--precision fp16``, onnxfuse/validate/drift_budget.py):
    (normalized max error, cosine), each followed by the plain conversion's in brackets; None without."""
    if "drift_error" not in c.extra:
        return None
    err, cos = num(c.extra["drift_error"]), f"{c.extra['drift_cosine']:.6f}"
    if "conversion_error" in c.extra:
        err += f" ({num(c.extra['conversion_error'])})"
        cos += f" ({c.extra['conversion_cosine']:.6f})"
    return err, cos


def one_line(c) -> str:
    """A failing comparison in one line (JUnit messages, summaries)."""
    if c.error:
        return f"{c.name}: {c.error}"
    return (f"{c.name}: max abs {num(c.max_abs)}, max rel {num(c.max_rel)}, {percent(c.mismatch_fraction)} of "
            f"elements beyond {tolerance(c)}"
            + (f", {c.nonfinite_mismatches} NaN/Inf mismatch(es)" if c.nonfinite_mismatches else ""))


def drift_failure(report) -> str | None:
    """The one line ``diff`` fails with (its stderr line and its JSON ``error``), or None when every
    output passed."""
    bad = [c for c in report.outputs if not c.passed]
    if not bad:
        return None
    return (f"{len(bad)} of {len(report.outputs)} output(s) differ beyond tolerance: "
            + "; ".join(one_line(c) for c in bad[:3]) + (" …" if len(bad) > 3 else ""))
