"""JUnit XML reports: one testcase per compared tensor, failures carrying the metrics."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from onnxfuse.reports import formatting


def _details(c) -> str:
    lines = [f"tensor: {c.name}", f"shape: {formatting.shape(c.shape)}  dtype: {c.dtype}"
             + (f" vs {c.extra['dtype_b']}" if c.extra.get("dtype_b") else "")]
    if c.error:
        lines.append(f"error: {c.error}")
    else:
        lines += [
            f"max_abs: {formatting.num(c.max_abs, 6)}", f"max_rel: {formatting.num(c.max_rel, 6)}",
            f"mean_abs: {formatting.num(c.mean_abs, 6)}", f"rms: {formatting.num(c.rms, 6)}", f"cosine: {formatting.num(c.cosine, 8)}",
            f"mismatch_fraction: {formatting.num(c.mismatch_fraction, 6)}",
            f"nonfinite_mismatches: {c.nonfinite_mismatches}",
            f"worst element: {formatting.worst(c)}",
        ]
    lines.append(f"tolerance: {formatting.tolerance(c)}")
    if "noise_floor" in c.extra:
        multiple = c.extra.get("floor_multiple")
        lines.append(f"noise floor: {formatting.num(c.extra['noise_floor'], 6)} (drift "
                     f"{'-' if multiple is None else f'{multiple:.1f}x'} the floor"
                     f"{'; passed within the floor' if c.extra.get('passed_by') == 'noise floor' else ''})")
    figures = formatting.drift(c)
    if figures:
        lines.append(f"drift against float32: normalized max error {figures[0]}, cosine {figures[1]} (the model merely "
                     "converted, no rewrite, in brackets"
                     f"{'; passed within the drift budget' if c.extra.get('passed_by') == 'drift budget' else ''})")
    return "\n".join(lines)


def testsuite_element(parent, suite_name: str, comparisons, seconds: float | None) -> ET.Element:
    comparisons = list(comparisons)
    failures = sum(not c.passed for c in comparisons)
    attrs = {"name": suite_name, "tests": str(len(comparisons)), "failures": str(failures), "errors": "0",
             "skipped": "0"}
    if seconds is not None:
        attrs["time"] = f"{seconds:.3f}"
    suite = ET.SubElement(parent, "testsuite", attrs) if parent is not None else ET.Element("testsuite", attrs)
    for c in comparisons:
        case = ET.SubElement(suite, "testcase", {"classname": suite_name, "name": c.name, "time": "0"})
        if not c.passed:
            failure = ET.SubElement(case, "failure", {"message": formatting.one_line(c), "type": "DriftBeyondTolerance"})
            failure.text = _details(c)
        else:
            ET.SubElement(case, "system-out").text = _details(c)
    return suite


def comparisons_junit(suite_name: str, comparisons, seconds: float | None = None) -> str:
    """A ``<testsuites>`` document with one suite named ``suite_name``; each comparison is a testcase."""
    root = ET.Element("testsuites", {"name": suite_name})
    suite = testsuite_element(root, suite_name, comparisons, seconds)
    root.set("tests", suite.get("tests"))
    root.set("failures", suite.get("failures"))
    return to_string(root)


def diff_junit(report, suite_name: str = "onnxfuse.diff") -> str:
    """JUnit XML for a ``diff`` report: each *output* is a testcase (intermediates are diagnostic and
    appear in the suite's system-out, with the first divergence)."""
    root = ET.Element("testsuites", {"name": suite_name})
    suite = testsuite_element(root, suite_name, report.outputs, report.seconds)
    props = ET.Element("properties")
    for key, value in (("model_a", report.model_a), ("model_b", report.model_b),
                       ("provider_a", report.provider_a), ("provider_b", report.provider_b),
                       ("seed", report.inputs.get("seed")), ("samples", report.inputs.get("samples"))):
        ET.SubElement(props, "property", {"name": key, "value": "" if value is None else str(value)})
    suite.insert(0, props)
    lines = []
    if report.first_divergence:
        fd = report.first_divergence
        lines.append(f"first divergence: {fd['kind']} {fd['name']}"
                     + (f" ({fd['op_type']} node {fd['node']})" if fd.get("op_type") else "")
                     + f", max abs {formatting.num(fd['max_abs'])}")
    if report.intermediates_checked:
        bad = [c for c in report.intermediates if not c.passed]
        lines.append(f"intermediates: {len(report.intermediates)} compared, {len(bad)} beyond tolerance")
        lines += ["  " + formatting.one_line(c) for c in bad[:50]]
    lines += [f"note: {n}" for n in report.notes]
    if lines:
        ET.SubElement(suite, "system-out").text = "\n".join(lines)
    root.set("tests", suite.get("tests"))
    root.set("failures", suite.get("failures"))
    return to_string(root)


#: Characters XML 1.0 cannot hold at all, not even as character references (C0 controls but tab, newline
#: and carriage return; lone surrogates; U+FFFE and U+FFFF). A tensor may be named with any of them.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_safe(text):
    """``text`` with each character XML cannot hold written as its Python escape (``\\x01``)."""
    if not isinstance(text, str):
        return text
    return _NOT_XML.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), text)


def to_string(root: ET.Element) -> str:
    """The document as well-formed XML, whatever the tensor names hold (see :func:`_xml_safe`)."""
    for element in root.iter():
        element.text = _xml_safe(element.text)
        element.tail = _xml_safe(element.tail)
        for key, value in list(element.attrib.items()):
            element.set(key, _xml_safe(value))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
