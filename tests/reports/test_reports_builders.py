"""Report builders on hand-made Comparison objects: no models, no ONNX Runtime."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from onnxfuse.drift import DiffReport
from onnxfuse.reports import (clean_json, comparisons_junit, comparisons_markdown, diff_html, diff_json, diff_junit,
                              diff_markdown, error_histogram, histogram_svg, write_json, write_text)
from onnxfuse.errors import ModelSaveError
from onnxfuse.runtime.compare import Comparison, compare_arrays


def comparisons():
    ref = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    good = compare_arrays("logits", ref, ref.copy())
    bad_got = ref.copy()
    bad_got[2, 1] += 0.25
    bad = compare_arrays("pipe|name", ref, bad_got)
    shape = Comparison(name="boxes", dtype="float32", shape=[3, 4], passed=False, rtol=1e-4, atol=1e-5,
                       mismatch_fraction=1.0, error="shape mismatch: [3, 4] vs [3, 5]")
    return [good, bad, shape]


def report(intermediates=True):
    outs = comparisons()
    inter = [compare_arrays("h", np.ones(3, np.float32), np.ones(3, np.float32))]
    inter[0].extra.update(position=1, node="n", op_type="Relu")
    ref = np.linspace(-1, 1, 12).reshape(3, 4)
    return DiffReport(
        model_a="a.onnx", model_b="b <&>.onnx", provider_a="cpu", provider_b="cuda",
        inputs={"source": "random", "seed": 0, "samples": 1, "seeds": [0], "shapes": {"x": [3, 4]},
                "dtypes_a": {"x": "float32"}, "dtypes_b": {"x": "float16"}},
        outputs=outs, intermediates=inter if intermediates else [], intermediates_checked=intermediates,
        first_divergence={"name": "pipe|name", "name_b": "pipe|name", "kind": "output", "position": 3, "node": "mm",
                          "op_type": "MatMul", "max_abs": 0.25, "max_rel": 1.0, "mismatch_fraction": 0.1, "error": None},
        tolerance={"rtol": None, "atol": None, "overrides": {}},
        histograms={"logits": error_histogram(ref, ref), "pipe|name": error_histogram(ref, ref + 1e-3)},
        notes=["a note with [brackets]"],
    )


def test_markdown_table_and_verdict():
    text = comparisons_markdown("Validation", comparisons())
    assert text.startswith("## Validation\n")
    assert "❌ FAIL**: 2 of 3" in text
    assert "`pipe\\|name`" in text  # pipes escaped so the table keeps its columns
    rows = [ln for ln in text.splitlines() if ln.startswith("| ✅") or ln.startswith("| ❌")]
    assert len(rows) == 3
    assert all(r.count("|") - r.count("\\|") == rows[0].count("|") - rows[0].count("\\|") for r in rows)
    assert "shape mismatch" in text
    ok = comparisons_markdown("All good", comparisons()[:1], level=3)
    assert ok.startswith("### All good") and "✅ pass" in ok


def test_diff_markdown_mentions_everything():
    text = diff_markdown(report())
    assert "onnxfuse diff: ❌ FAIL" in text and "first divergence" in text and "CUDA" in text
    assert "Intermediate tensors" in text and "note: a note" in text


def test_junit_testcases_and_failures():
    root = ET.fromstring(comparisons_junit("validation", comparisons()))
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["logits", "pipe|name", "boxes"]
    assert suite.get("tests") == "3" and suite.get("failures") == "2" and root.get("failures") == "2"
    failure = cases[1].find("failure")
    assert "max abs" in failure.get("message") and "max_abs:" in failure.text and "cosine:" in failure.text
    assert cases[0].find("failure") is None
    assert "shape mismatch" in cases[2].find("failure").get("message")


def test_diff_junit_is_valid_xml_with_properties():
    root = ET.fromstring(diff_junit(report()))
    suite = root.find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["model_b"] == "b <&>.onnx" and props["provider_b"] == "cuda"
    assert "first divergence" in suite.find("system-out").text


def test_html_is_self_contained_with_svg_histograms():
    page = diff_html(report())
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)\s*=\s*["']?https?:""", page)
    assert page.count("<svg") == 2  # two outputs have histograms, the shape mismatch says why not
    assert "shapes differ" in page
    assert "b &lt;&amp;&gt;.onnx" in page  # escaped
    assert "Intermediate tensors" in page


def test_histogram_counts_and_svg():
    ref = np.zeros(10)
    got = np.array([0, 0, 1e-6, 2e-6, 1e-3, 1e-3, 1e-3, 0.5, np.nan, 0])
    h = error_histogram(ref, got)
    assert h["zeros"] == 3 and h["nonfinite"] == 1
    assert sum(h["counts"]) == 6
    assert h["edges"][0] <= 1e-6 and h["edges"][-1] >= 0.5
    svg = histogram_svg(h, atol=1e-4)
    assert svg.startswith("<svg") and svg.endswith("</svg>") and "atol" in svg
    assert svg.count("<rect") == 1 + len(h["counts"])
    assert error_histogram(np.zeros(3), np.zeros(4)) is None
    assert "shapes differ" in histogram_svg(None)
    assert error_histogram(ref, ref)["counts"] == []


def test_clean_json_and_write(tmp_path):
    assert clean_json({"a": float("nan"), "b": [np.float32(1.5), float("inf")], "c": np.int64(3)}) == \
        {"a": None, "b": [1.5, None], "c": 3}
    path = tmp_path / "r.json"
    write_json(path, {"x": math.nan})
    assert json.loads(path.read_text()) == {"x": None}
    payload = diff_json(report())
    json.dumps(payload, allow_nan=False)
    with pytest.raises(ModelSaveError):
        write_text(tmp_path / "missing" / "r.md", "x")
    with pytest.raises(ModelSaveError):
        write_text(tmp_path, "x")


def test_optimize_junit_fails_the_latency_case_by_exit_code_not_by_wording():
    """The latency testcase fails when the run ended in exit 4 (slower than allowed), whatever the
    error says; a validation failure whose message happens to contain "slower" does not fail it."""
    from types import SimpleNamespace

    from onnxfuse.reports.optimize_report import optimize_junit

    stats = SimpleNamespace(median_ms=2.0)
    timing = SimpleNamespace(status="ok", original=SimpleNamespace(stats=stats),
                             optimized=SimpleNamespace(stats=SimpleNamespace(median_ms=3.0)), speedup=2 / 3, notes=[])

    def result(exit_code, error):
        return SimpleNamespace(validation=None, validation_seconds=0.0, timing=timing, exit_code=exit_code,
                               error=error, applied=SimpleNamespace(dropped=[]))

    latency_failed = optimize_junit(result(4, "median 3.000 ms exceeds 1.00 x 2.000 ms"), error="median 3.000 ms exceeds 1.00 x 2.000 ms")
    assert '<failure message="median 3.000 ms exceeds' in latency_failed
    other = optimize_junit(result(3, "output 'slower_path' differs"), error="output 'slower_path' differs")
    assert "<failure" not in other


def test_optimize_junit_reports_latency_skipped_without_a_gpu():
    """A CI runner without a GPU: the latency check could not run, which the report says as a skipped
    testcase with the reason (not by leaving the case out)."""
    import xml.etree.ElementTree as ET
    from types import SimpleNamespace

    from onnxfuse.reports.optimize_report import optimize_junit

    timing = SimpleNamespace(status="no-gpu", message="timing needs a CUDA GPU (none is usable here)", notes=[])
    result = SimpleNamespace(validation=None, validation_seconds=0.0, timing=timing, exit_code=0, error=None,
                             applied=SimpleNamespace(dropped=[]))
    suite = ET.fromstring(optimize_junit(result)).find("testsuite")
    (case,) = [c for c in suite.findall("testcase") if c.get("name") == "latency"]
    assert case.find("skipped").get("message") == "timing needs a CUDA GPU (none is usable here)"
    assert suite.get("skipped") == "1" and suite.get("tests") == "1"
    no_timing = SimpleNamespace(**{**vars(result), "timing": None})  # --no-bench: nothing asked, no case
    assert ET.fromstring(optimize_junit(no_timing)).find("testsuite").find("testcase") is None
