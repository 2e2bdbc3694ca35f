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


def _time_line(result) -> str:
    """The seconds of each stage that ran (issue 35 item 8: every report says where the time went)."""
    stages = [("load", result.load_seconds if result.load_seconds else None), ("rewrite", result.rewrite_seconds),
              ("validation", result.validation_seconds if result.validation is not None else None),
              ("timing", result.timing_seconds if result.timing is not None else None),
              ("total", result.total_seconds)]
    return "- **time**: " + ", ".join(f"{name} {sec:.2f} s" for name, sec in stages if sec is not None) + "\n"


def optimize_markdown(result, error: str | None = None, heading: str = "onnxfuse optimize") -> str:
    """A Markdown section: verdict, rules applied, node counts, validation table, latency. ``heading``:
    what the section's title names (each model's file name in a run over several)."""
    ok = error is None
    out = [f"## {heading}: {'✅ ok' if ok else '❌ FAIL'}\n\n"]
    out.append(f"- **input**: `{result.input_path}`\n")
    out.append(f"- **output**: `{result.output_path}`\n" if result.output_path else "- **output**: not written\n")
    device = getattr(result, "device", "cuda")
    for_device = "" if device == "cuda" else f" for the {device.upper()} provider (--device {device})"
    out.append(f"- **target**: {result.target}{for_device}; nodes {result.nodes_before} → {result.nodes_after}\n")
    out.append(_time_line(result))
    if error:
        out.append(f"- **error**: {cell(error)}\n")
    applied = {k: v for k, v in result.applied.counts.items() if v}
    out.append("- **rewrites**: " + (", ".join(f"{k} ×{v}" for k, v in applied.items()) or "none") + "\n")
    record = tuning_note(result)
    if record:
        out.append(f"- **tuning record**: {cell(record)}\n")
    for dropped in result.applied.dropped:
        out.append(f"- ⚠️ **rule dropped**: `{dropped['rule']}`: {cell(dropped['reason'])}\n")
    for row in getattr(result, "unfused", []):
        out.append(f"- **not fused**: {row.count} {row.op} left by `{row.rule}`: {cell(row.reason)}"
                   + (f" ({row.reason_count} of {row.count})" if row.reason_count != row.count else "") + "\n")
    out.append("\n")
    if result.custom_library:
        out.append(f"> needs the onnxfuse custom-op library (domain `{result.custom_library}`)\n\n")
    if result.extra.get("cuda_only_ops"):
        out.append(f"> needs ONNX Runtime's CUDA provider ({', '.join(result.extra['cuda_only_ops'])})\n\n")
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
    suite = _optimize_suite(root, result, error, suite_name)
    root.set("tests", suite.get("tests"))
    root.set("failures", suite.get("failures"))
    return to_string(root)


def tuning_note(result) -> str | None:
    """The line the console prints about ``--tuning-record`` (applied, recorded, or nothing measured), with
    "(written)" when this run added its decision; None without the option."""
    record = getattr(result, "extra", {}).get("tuning_record")
    if not record or not record.get("note"):
        return None
    return record["note"] + (" (written)" if record.get("written") else "")


def _count(suite, key: str) -> None:
    suite.set(key, str(int(suite.get(key, "0")) + 1))


def _optimize_suite(root, result, error: str | None, suite_name: str):
    """One model's ``<testsuite>`` under ``root`` (see :func:`optimize_junit`)."""
    comparisons = result.validation.outputs if result.validation is not None else []
    suite = testsuite_element(root, suite_name, comparisons, result.validation_seconds or None)
    timing = result.timing
    if timing is not None and timing.status == "ok":
        case = ET.SubElement(suite, "testcase", {"classname": suite_name, "name": "latency"})
        text = ("CPU: " if getattr(timing, "device", "cuda") == "cpu" else "") + (
                f"original median {timing.original.stats.median_ms:.4f} ms, optimized "
                f"{timing.optimized.stats.median_ms:.4f} ms, speed-up {timing.speedup:.3f}x")
        text = "\n".join([text, *timing.notes])  # a fallback to fewer rewrites says so (onnxfuse/selection.py)
        if error and result.exit_code == EXIT_SLOWER:  # the latency check failed (not validation)
            ET.SubElement(case, "failure", {"message": error}).text = text
            _count(suite, "failures")
        else:
            ET.SubElement(case, "system-out").text = text
        _count(suite, "tests")
    elif timing is not None and not error:  # timing asked for but not run (no GPU): a skipped case, not silence
        case = ET.SubElement(suite, "testcase", {"classname": suite_name, "name": "latency"})
        ET.SubElement(case, "skipped", {"message": timing.message or f"timing {timing.status}"})
        _count(suite, "tests")
        _count(suite, "skipped")
    record = tuning_note(result)
    if record:  # the decision applied or recorded, where a CI log reader looks for it
        ET.SubElement(suite, "system-out").text = f"tuning record: {record}"
    elif error and not comparisons:
        _error_case(suite, suite_name, error)
    for dropped in result.applied.dropped:  # a broken rule, dropped: reported, not a failure
        case = ET.SubElement(suite, "testcase", {"classname": suite_name, "name": f"rule {dropped['rule']}"})
        ET.SubElement(case, "skipped", {"message": f"dropped: {dropped['reason']}"})
        _count(suite, "tests")
        _count(suite, "skipped")
    return suite


def _error_case(suite, suite_name: str, error: str) -> None:
    case = ET.SubElement(suite, "testcase", {"classname": suite_name, "name": "optimize"})
    ET.SubElement(case, "error", {"message": error}).text = error
    _count(suite, "tests")
    _count(suite, "errors")


def many_junit(batch, suite_name: str = "onnxfuse.optimize") -> str:
    """JUnit XML of a run over several models (an :class:`onnxfuse.batch.BatchResult`): one
    ``<testsuite>`` per model, named ``onnxfuse.optimize.<file name>``, as :func:`optimize_junit` builds it;
    a model that failed before it had a result (a bad file) is one errored testcase."""
    root = ET.Element("testsuites", {"name": suite_name})
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for run in batch.runs:
        name = f"{suite_name}.{run.name}"
        if run.result is not None:
            suite = _optimize_suite(root, run.result, run.error, name)
        else:
            suite = testsuite_element(root, name, [], run.seconds)
            _error_case(suite, name, run.error or "failed")
        for key in totals:
            totals[key] += int(suite.get(key, "0"))
    for key in ("tests", "failures", "errors"):
        root.set(key, str(totals[key]))
    return to_string(root)


def many_markdown(batch) -> str:
    """Markdown of a run over several models: a summary table (model, nodes, verdict, speed-up), then
    each model's section as :func:`optimize_markdown` writes it (or its error)."""
    ok = not batch.failed
    out = [f"## onnxfuse optimize: {len(batch.runs)} models, "
           f"{'✅ all ok' if ok else f'❌ {len(batch.failed)} failed (exit {batch.exit_code})'}\n\n",
           f"Outputs in `{cell(batch.out_dir)}`.\n\n",
           "| model | nodes | verdict | speed-up |\n|---|---:|---|---:|\n"]
    for run in batch.runs:
        mark = "✅" if run.ok else "❌"
        out.append(f"| `{cell(run.name)}` | {run.nodes_text()} | {mark} {run.verdict()} | {run.timing_text()} |\n")
    out.append("\n")
    for run in batch.runs:
        if run.result is not None:
            out.append(optimize_markdown(run.result, error=run.error, heading=f"`{cell(run.name)}`"))
        else:
            out.append(f"## `{cell(run.name)}`: ❌ FAIL\n\n- **input**: `{run.input_path}`\n"
                       "- **output**: not written\n"
                       f"- **error** (exit {run.exit_code}): {cell(run.error)}\n\n")
    return "".join(out)


__all__ = ["many_junit", "many_markdown", "optimize_junit", "optimize_markdown"]
