"""JSON, Markdown and JUnit reports for ``onnxfuse optimize`` (CI job summaries, test dashboards).

Built from an :class:`onnxfuse.pipeline.OptimizeResult`; the validation table reuses the same builders
as ``diff``, so both commands' summaries look alike.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from onnxfuse.errors import EXIT_SLOWER
from onnxfuse.reports.junit import testsuite_element, to_string
from onnxfuse.reports.markdown import cell, comparisons_markdown


def _timing_lines(timing) -> list[str]:
    if timing is None:
        return []
    if timing.status != "ok":
        return [f"> timing: {cell(timing.message)}\n"]
    o, p = timing.original.stats, timing.optimized.stats
    label = timing.original.label
    return [
        f"### Latency ({label}, ORT_ENABLE_ALL on both)\n\n",
        "| model | median ms | p90 ms | p99 ms | min ms | runs |\n|---|---:|---:|---:|---:|---:|\n",
        f"| original | {o.median_ms:.3f} | {o.p90_ms:.3f} | {o.p99_ms:.3f} | {o.min_ms:.3f} | {o.count} |\n",
        f"| optimized | {p.median_ms:.3f} | {p.p90_ms:.3f} | {p.p99_ms:.3f} | {p.min_ms:.3f} | {p.count} |\n\n",
        f"Speed-up: **{timing.speedup:.2f}×**\n\n",
        *(f"> note: {cell(note)}\n\n" for note in timing.notes),
    ]


def optimize_markdown(result, error: str | None = None) -> str:
    """A Markdown section: verdict, rules applied, node counts, validation table, latency."""
    ok = error is None
    out = [f"## onnxfuse optimize: {'✅ ok' if ok else '❌ FAIL'}\n\n"]
    out.append(f"- **input**: `{result.input_path}`\n")
    out.append(f"- **output**: `{result.output_path}`\n" if result.output_path else "- **output**: not written\n")
    out.append(f"- **target**: {result.target}; nodes {result.nodes_before} → {result.nodes_after}\n")
    if error:
        out.append(f"- **error**: {cell(error)}\n")
    applied = {k: v for k, v in result.applied.counts.items() if v}
    out.append("- **rewrites**: " + (", ".join(f"{k} ×{v}" for k, v in applied.items()) or "none") + "\n")
    for dropped in result.applied.dropped:
        out.append(f"- ⚠️ **rule dropped**: `{dropped['rule']}`: {cell(dropped['reason'])}\n")
    for row in getattr(result, "unfused", []):
        out.append(f"- **not fused**: {row.count} {row.op} left by `{row.rule}`: {cell(row.reason)}"
                   + (f" ({row.reason_count} of {row.count})" if row.reason_count != row.count else "") + "\n")
    out.append("\n")
    if result.custom_library:
        out.append(f"> needs the onnxfuse custom-op library (domain `{result.custom_library}`)\n\n")
    if result.validation is not None:
        out.append(comparisons_markdown(f"Validation ({result.validation.provider.upper()})",
                                        result.validation.outputs, notes=result.validation.notes, level=3))
        out.append("\n")
    else:
        out.append("> validation skipped (--no-validate)\n\n")
    out.extend(_timing_lines(result.timing))
    return "".join(out)


def optimize_junit(result, error: str | None = None, suite_name: str = "onnxfuse.optimize") -> str:
    """JUnit XML: each validated output is a testcase; latency is one more when timing ran, and a skipped one
    when it was asked for but could not run (no GPU: ``--fail-on-slowdown`` then checked nothing)."""
    root = ET.Element("testsuites", {"name": suite_name})
    comparisons = result.validation.outputs if result.validation is not None else []
    suite = testsuite_element(root, suite_name, comparisons, result.validation_seconds or None)
    timing = result.timing
    if timing is not None and timing.status == "ok":
        case = ET.SubElement(suite, "testcase", {"classname": suite_name, "name": "latency"})
        text = (f"original median {timing.original.stats.median_ms:.4f} ms, optimized "
                f"{timing.optimized.stats.median_ms:.4f} ms, speed-up {timing.speedup:.3f}x")
        text = "\n".join([text, *timing.notes])  # a fallback to fewer rewrites says so (onnxfuse/selection.py)
        if error and result.exit_code == EXIT_SLOWER:  # the latency check failed (not validation)
            ET.SubElement(case, "failure", {"message": error}).text = text
            suite.set("failures", str(int(suite.get("failures", "0")) + 1))
        else:
            ET.SubElement(case, "system-out").text = text
        suite.set("tests", str(int(suite.get("tests", "0")) + 1))
    elif timing is not None and not error:  # timing asked for but not run (no GPU): a skipped case, not silence
        case = ET.SubElement(suite, "testcase", {"classname": suite_name, "name": "latency"})
        ET.SubElement(case, "skipped", {"message": timing.message or f"timing {timing.status}"})
        suite.set("tests", str(int(suite.get("tests", "0")) + 1))
        suite.set("skipped", str(int(suite.get("skipped", "0")) + 1))
    elif error and not comparisons:
        case = ET.SubElement(suite, "testcase", {"classname": suite_name, "name": "optimize"})
        ET.SubElement(case, "error", {"message": error}).text = error
        suite.set("tests", str(int(suite.get("tests", "0")) + 1))
        suite.set("errors", str(int(suite.get("errors", "0")) + 1))
    for dropped in result.applied.dropped:  # a broken rule, dropped: reported, not a failure
        case = ET.SubElement(suite, "testcase", {"classname": suite_name, "name": f"rule {dropped['rule']}"})
        ET.SubElement(case, "skipped", {"message": f"dropped: {dropped['reason']}"})
        suite.set("tests", str(int(suite.get("tests", "0")) + 1))
        suite.set("skipped", str(int(suite.get("skipped", "0")) + 1))
    root.set("tests", suite.get("tests"))
    root.set("failures", suite.get("failures"))
    return to_string(root)


__all__ = ["optimize_markdown", "optimize_junit"]
