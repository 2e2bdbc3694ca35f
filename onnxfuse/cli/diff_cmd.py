"""``onnxfuse diff A B``: run two models on the same inputs and report how far apart they are."""

from __future__ import annotations


import click
from rich.markup import escape

from onnxfuse.cli import render
from onnxfuse.cli.common import (verbosity_options, EXIT_CODES_HELP, check_runtime, emit_json, fail, handle_errors, input_options,
                                 json_option, report_console, report_file, right_padded_option, write_failure_json)
from onnxfuse import api, model_io
from onnxfuse.drift import DEFAULT_BATCH_SIZE, parse_tol_options
from onnxfuse.errors import ValidationFailed
from onnxfuse.atomic import OutputSet
from onnxfuse.reports import formatting, diff_html, diff_junit, diff_markdown
from onnxfuse.reports.files import check_report_paths, json_text, stage_reports
from onnxfuse.runtime.inputs import parse_shape_options
from onnxfuse.cli.common import range_map

DIFF_HELP = """Run models A and B on the same inputs and compare every output.

Inputs are seeded random data drawn from A's signature (or --inputs), cast to each model's own input
dtypes, so an fp16 model and its fp32 original see the same values. Each side runs on its own
provider, so CPU-vs-GPU and fp32-vs-fp16 are both one command. For every output: max abs/rel error,
mean abs error, RMS error, cosine similarity, the fraction of elements beyond tolerance, the worst
element, and NaN/Inf mismatches. A is the reference. --intermediates also compares every tensor the
two models share by name (or through B's `onnxfuse.tensor_map` metadata), in topological order, and
names the first one that drifts beyond tolerance.

\b
Examples:
  onnxfuse diff model.onnx model.opt.onnx
  onnxfuse diff model.onnx model.onnx --provider-a cpu --provider-b cuda
  onnxfuse diff model.fp32.onnx model.fp16.onnx --samples 4 \\
      --tol logits:1e-2:1e-3
  onnxfuse diff a.onnx b.onnx --intermediates --json diff.json --html d.html
  onnxfuse diff a.onnx b.onnx --shape input:8,3,224,224 \\
      --markdown "$GITHUB_STEP_SUMMARY" --junit diff.xml
  onnxfuse diff bert.onnx bert.opt.onnx --right-padded attention_mask

Tolerance per element: |B - A| <= atol + rtol * |A|. Defaults depend on dtype (the looser of the two
sides: fp32 rtol 1e-4, fp16 1e-2; atol scaled by the tensor's largest magnitude); --rtol/--atol
replace them for every tensor, --tol NAME:RTOL:ATOL for one tensor. Only outputs decide the exit
code; intermediate drift is diagnostic.
"""

PROVIDER = click.Choice(["auto", "cpu", "cuda"], case_sensitive=False)


@click.command(help=DIFF_HELP, epilog=EXIT_CODES_HELP.replace("validation failed: outputs differ beyond tolerance "
                                                               "(nothing written)",
                                                               "drift: an output differs beyond tolerance"))
@click.argument("model_a", metavar="A", type=click.Path(dir_okay=True))
@click.argument("model_b", metavar="B", type=click.Path(dir_okay=True))
@click.option("--provider-a", type=PROVIDER, default="auto", show_default=True, help="Provider that runs A.")
@click.option("--provider-b", type=PROVIDER, default="auto", show_default=True, help="Provider that runs B.")
@input_options
@right_padded_option
@click.option("--samples", type=click.IntRange(min=1), default=1, show_default=True,
              help="Number of random draws (seeds SEED, SEED+1, ...); metrics cover all of them.")
@click.option("--rtol", type=float, default=None, help="Relative tolerance for every tensor (default: by dtype).")
@click.option("--atol", type=float, default=None, help="Absolute tolerance for every tensor (default: by dtype and scale).")
@click.option("--tol", "tols", multiple=True, metavar="NAME:RTOL:ATOL",
              help="Tolerance for one output or tensor (repeatable), e.g. logits:1e-3:1e-5.")
@click.option("--intermediates", is_flag=True, help="Also compare every tensor both models share, and name the "
                                                    "first one that drifts beyond tolerance.")
@click.option("--batch-size", type=click.IntRange(min=1), default=DEFAULT_BATCH_SIZE, show_default=True,
              help="With --intermediates: tensors exposed per run (bounds memory).")
@json_option("Write the report as JSON (schema: onnxfuse/reports/schemas/report.schema.json in the package).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False),
              help="Write a Markdown summary (appended when PATH is $GITHUB_STEP_SUMMARY).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False),
              help="Write JUnit XML: each output a testcase, failures with their metrics.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Write a self-contained HTML report with an error histogram per output.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing but errors (and the failure line on drift).")
@verbosity_options
@handle_errors
def diff(model_a, model_b, provider_a, provider_b, shapes, inputs_path, seed, input_ranges, right_padded, samples, rtol, atol, tols,
         intermediates, batch_size, json_path, markdown_path, junit_path, html_path, quiet) -> None:
    read = {**model_io.input_files(model_a, "model A"), **model_io.input_files(model_b, "model B")}
    try:
        check_runtime(quiet)
        shape_map = parse_shape_options(shapes)
        tolerances = parse_tol_options(tols)
        check_report_paths({report_file(json_path): "JSON report", markdown_path: "Markdown report",
                            junit_path: "JUnit report", html_path: "HTML report"}, read)

        with render.progress_bar(disabled=quiet) as bar:
            report = api.diff(
                model_a, model_b, shapes=shape_map, seed=seed, inputs=inputs_path, samples=samples,
                input_ranges=range_map(input_ranges), right_padded=list(right_padded),
                provider_a=provider_a.lower(), provider_b=provider_b.lower(), rtol=rtol, atol=atol,
                tolerances=tolerances, intermediates=intermediates, batch_size=batch_size,
                histograms=html_path is not None or json_path is not None, progress=bar.step,
            )
    except Exception as exc:  # an internal error too: its document says exit 5, as stderr does
        write_failure_json(json_path, "diff", exc, read)
        raise

    # All reports land together or not at all (an error or a signal while writing leaves none).
    with OutputSet() as out:
        stage_reports(out, [(report_file(json_path), lambda: json_text(report), "JSON report"),
                            (markdown_path, lambda: diff_markdown(report) + "\n", "Markdown report"),
                            (junit_path, lambda: diff_junit(report), "JUnit report"),
                            (html_path, lambda: diff_html(report), "HTML report")])
        out.commit()
    emit_json(json_path, json_text(report))

    if not quiet:
        _print_report(report, report_console(json_path))
    failure = formatting.drift_failure(report)
    if failure is not None:
        fail(ValidationFailed(failure), ValidationFailed.exit_code)


def _print_report(report, stdout, max_rows: int = 20) -> None:
    inputs = report.inputs
    src = f"seed {inputs['seed']}" if inputs.get("seed") is not None else f"inputs from {inputs['source']}"
    shapes = ", ".join(f"{k} {formatting.shape(v)}" for k, v in inputs["shapes"].items()) or "no inputs"
    stdout.print(f"A: {report.model_a} ({report.provider_a.upper()})   B: {report.model_b} "
                 f"({report.provider_b.upper()})", markup=False)
    stdout.print(f"inputs: {src}, {inputs['samples']} sample(s); {shapes}", markup=False)
    stdout.print(render.drift_table("Outputs", report.outputs))
    if report.intermediates_checked:
        bad = [c for c in report.intermediates if not c.passed]
        if bad:
            shown = bad[:max_rows]
            more = f" (first {len(shown)} of {len(bad)}; all in --json/--html)" if len(bad) > len(shown) else ""
            stdout.print(render.drift_table(f"Intermediate tensors beyond tolerance{more}", shown, positions=True))
        stdout.print(f"intermediates: {len(report.intermediates)} compared, {len(bad)} beyond tolerance")
    fd = report.first_divergence
    if fd:
        where = escape(f" ({fd['op_type']} node {fd['node']!r})") if fd.get("op_type") else ""
        stdout.print(f"[bold]first divergence:[/] {fd['kind']} [bold]{escape(fd['name'])}[/]{where}, "
                     f"max abs {formatting.num(fd['max_abs'])}", highlight=False)
    for note in report.notes:
        render.print_prose(stdout, note, "note: ", "[yellow]note:[/] ")
    verdict = "[green]pass[/]: all outputs within tolerance" if report.passed else "[red]FAIL[/]: drift beyond tolerance"
    stdout.print(f"{verdict} ({report.seconds:.2f} s)")
