"""Markdown reports, e.g. for a GitHub Actions job summary (``$GITHUB_STEP_SUMMARY``)."""

from __future__ import annotations

from onnxfuse.reports import formatting

_HEADER = ("| | tensor | shape | max abs | max rel | mean abs | RMS | cosine | beyond tol | worst element | "
           "tolerance |\n|---|---|---|---:|---:|---:|---:|---:|---:|---|---|\n")


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _row(c) -> str:
    mark = "✅" if c.passed else "❌"
    name = f"`{cell(c.name)}`" + (f" → `{cell(c.extra['name_b'])}`" if c.extra.get("name_b") else "")
    if c.error:
        return f"| {mark} | {name} | {formatting.shape(c.shape)} | {cell(c.error)} | | | | | | | |\n"
    nf = f" ({c.nonfinite_mismatches} NaN/Inf)" if c.nonfinite_mismatches else ""
    return (f"| {mark} | {name} | {formatting.shape(c.shape)} | {formatting.num(c.max_abs)} | {formatting.num(c.max_rel)} | "
            f"{formatting.num(c.mean_abs)} | {formatting.num(c.rms)} | {formatting.num(c.cosine, 6)} | "
            f"{formatting.percent(c.mismatch_fraction)}{nf} | {cell(formatting.worst(c))} | {formatting.tolerance(c)} |\n")


def comparisons_table(comparisons) -> str:
    """A Markdown table of comparisons (one row each)."""
    return _HEADER + "".join(_row(c) for c in comparisons)


def _multiple(c) -> str:
    m = c.extra.get("floor_multiple")
    return "-" if m is None else f"{m:.1f}×"


def comparisons_markdown(title: str, comparisons, notes=None, level: int = 2) -> str:
    """A titled section: verdict line, metrics table, notes. Reusable by any command."""
    comparisons = list(comparisons)
    failed = [c for c in comparisons if not c.passed]
    verdict = (f"**✅ pass**: {len(comparisons)} tensor(s) within tolerance" if not failed else
               f"**❌ FAIL**: {len(failed)} of {len(comparisons)} tensor(s) beyond tolerance")
    out = [f"{'#' * level} {title}\n\n", verdict + "\n\n"]
    if comparisons:
        out.append(comparisons_table(comparisons) + "\n")
    floors = [c for c in comparisons if "noise_floor" in c.extra]
    if floors:
        out.append("> drift as a multiple of the model's own noise floor (original, ONNX Runtime's optimizations "
                   "off vs on): " + ", ".join(f"`{cell(c.name)}` {_multiple(c)}" for c in floors) + "\n")
    drifts = [(c, formatting.drift(c)) for c in comparisons if formatting.drift(c)]
    if drifts:
        out.append("> drift against the float32 original, normalized max error / cosine (the model merely converted, "
                   "no rewrite, in brackets): " + ", ".join(
                       f"`{cell(c.name)}` {err} / {cos}" + (" (passed by the drift budget)"
                                                            if c.extra.get("passed_by") == "drift budget" else "")
                       for c, (err, cos) in drifts) + "\n")
    for note in notes or ():
        out.append(f"> note: {cell(note)}\n")
    return "".join(out)


def diff_markdown(report, max_intermediates: int = 50) -> str:
    """The whole ``diff`` report: models, inputs, outputs, first divergence, intermediates."""
    status = "✅ pass" if report.passed else "❌ FAIL"
    inputs = report.inputs
    shapes = ", ".join(f"`{k}` {formatting.shape(v)} {report.inputs['dtypes_a'].get(k, '')}"
                       for k, v in inputs["shapes"].items()) or "(none)"
    src = f"seed {inputs['seed']}" if inputs.get("seed") is not None else f"file `{inputs['source']}`"
    out = [
        f"## onnxfuse diff: {status}\n\n",
        f"- **A**: `{report.model_a}` on {report.provider_a.upper()}\n",
        f"- **B**: `{report.model_b}` on {report.provider_b.upper()}\n",
        f"- **inputs**: {src}, {inputs['samples']} sample(s); {shapes}\n",
    ]
    fd = report.first_divergence
    if fd:
        where = f" ({fd['op_type']} node `{cell(fd['node'])}`)" if fd.get("op_type") else ""
        out.append(f"- **first divergence**: {fd['kind']} `{cell(fd['name'])}`{where}, max abs "
                   f"{formatting.num(fd['max_abs'])}\n")
    out.append("\n")
    out.append(comparisons_markdown("Outputs", report.outputs, level=3))
    if report.intermediates_checked:
        failed = [c for c in report.intermediates if not c.passed]
        out.append(f"\n### Intermediate tensors\n\n{len(report.intermediates)} compared in topological order, "
                   f"{len(failed)} beyond tolerance.\n\n")
        if failed:
            shown = failed[:max_intermediates]
            out.append("<details><summary>Tensors beyond tolerance"
                       + (f" (first {len(shown)})" if len(shown) < len(failed) else "") + "</summary>\n\n")
            out.append(comparisons_table(shown) + "\n</details>\n")
    if report.notes:
        out.append("\n")
        for note in report.notes:
            out.append(f"> note: {cell(note)}\n")
    return "".join(out)
