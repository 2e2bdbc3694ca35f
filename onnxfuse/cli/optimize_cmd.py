"""``onnxfuse optimize IN OUT`` (rewrite, validate and save a model) and ``onnxfuse optimize IN... --out-dir
DIR`` (each of several models, one report; the loop is :func:`onnxfuse.api.optimize_many`)."""

from __future__ import annotations

import os
import sys

import click

from onnxfuse.cli import render
from onnxfuse.cli.common import (verbosity_options, EXIT_CODES_HELP, check_runtime, declared_options, emit_json,
                                 handle_errors, input_options, json_option, report_console, report_file,
                                 right_padded_option, stderr, write_failure_json)
from onnxfuse.errors import OnnxfuseError, SlowerThanAllowed, UsageError, ValidationFailed
from onnxfuse import api, batch, lazy_weights, model_io, options
from onnxfuse.repair import note as repair_note
from onnxfuse.atomic import OutputSet
from onnxfuse.reports.files import check_report_paths, json_text, stage_reports
from onnxfuse.reports.optimize_report import many_junit, many_markdown, optimize_junit, optimize_markdown, tuning_note

OPTIMIZE_HELP = """Optimize INPUT and write the result to OUTPUT; or, with --out-dir DIR, optimize every
INPUT (a model, a folder of .onnx files, or a quoted glob pattern) into DIR/<stem>.onnx.

Folds BatchNormalization and constant scale/bias into Conv, ConvTranspose and Gemm weights, maps
known patterns to ONNX Runtime's fused ops and collapses chains of elementwise ops into one
FusedElementwise op, then checks the result: the original and optimized models run on ONNX Runtime
(CUDA when a GPU is usable, else CPU) on the same seeded inputs, and every output must match within
tolerance. If one does not, the rule responsible is named, nothing is written, and the exit code is 3.
With a GPU, both models are then timed (ORT_ENABLE_ALL on both). --device cpu optimizes for ONNX
Runtime's CPU provider instead: no FusedElementwise (its CPU kernel is an interpreter), validated and
timed on the CPU. The input file is never modified; the output is written atomically.

\b
Examples:
  onnxfuse optimize resnet.onnx resnet.opt.onnx
  onnxfuse optimize model.onnx out.onnx --shape input:8,3,224,224 \\
      --json report.json
  onnxfuse optimize model.onnx out.onnx --skip fold-scale-bias --explain
  onnxfuse optimize model.onnx out.onnx --only fuse-elementwise --explain-all
  onnxfuse optimize model.onnx out.onnx --inputs sample.npz --quiet
  onnxfuse optimize model.onnx out.onnx --target onnx  # standard ops only
  onnxfuse optimize model.onnx out.onnx --device cpu   # for the CPU provider
  onnxfuse optimize resnet.onnx out.onnx --tune-shape input:16,3,224,224
  onnxfuse optimize bert.onnx out.onnx --shape input_ids:1,128 \\
      --shape attention_mask:1,128 --tune-dim batch=16
  onnxfuse optimize model.onnx out.fp16.onnx --precision fp16
  onnxfuse optimize model.onnx out.fp16.onnx --precision fp16-io  # fp16 I/O
  onnxfuse optimize model.onnx out.fp16.onnx --precision fp16 \\
      --max-drift 1e-2,0.9999
  onnxfuse optimize bert.onnx bert.opt.onnx --right-padded attention_mask
  onnxfuse optimize model.onnx out.onnx --fail-on-slowdown 1.0 \\
      --markdown "$GITHUB_STEP_SUMMARY"
  onnxfuse optimize a.onnx b.onnx exports/ 'more/*.onnx' --out-dir optimized

With --out-dir every option applies to each model (--inputs: every model must accept the file), one
report covers them all (--json: a list of models; --junit: a test suite per model; --markdown: a
section per model), a model that fails does not stop the others, and the exit code is the worst of
theirs (2 > 5 > 3 > 4 > 1 > 0: see below). --save-inputs and --explain need one model.
"""


def declared(*keywords):
    """The click options of these of optimize's declared options (:data:`onnxfuse.options.OPTIMIZE`), in
    this order; the ones only the command line has (where reports go, what is printed) are its own."""
    return declared_options(*(options.OPTIMIZE[keyword] for keyword in keywords))


@click.command(help=OPTIMIZE_HELP, epilog=EXIT_CODES_HELP)
@click.argument("paths", nargs=-1, metavar="INPUT OUTPUT | INPUT... --out-dir DIR", type=click.Path(dir_okay=True))
@click.option("--out-dir", "out_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Optimize every INPUT into DIR/<stem>.onnx (DIR is created if missing); INPUT may be a "
                   "folder (its .onnx files) or a quoted glob pattern.")
@declared("target", "device", "only", "skip")
@click.option("--explain", is_flag=True, help="Summarize the rewrites applied and the candidates refused: counts "
                                              "per rule and per reason, with an example of each.")
@click.option("--explain-all", is_flag=True, help="List every rewrite applied and every candidate refused, with "
                                                  "its node and reason (the JSON report always has them all).")
@declared("validate")
@input_options
@right_padded_option
@declared("rtol", "atol", "samples", "save_inputs", "strict", "provider", "precision", "max_drift", "bench",
          "fail_on_slowdown", "never_slower", "tune", "tune_time", "tune_shapes", "tune_dims", "tuning_record")
@json_option("Also write the report as JSON to this file (schema: onnxfuse/reports/schemas/report.schema.json).")
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False),
              help="Also write a Markdown summary (appended when PATH is $GITHUB_STEP_SUMMARY).")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False),
              help="Also write JUnit XML: each validated output (and the latency check) is a test case.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on success (errors still go to stderr).")
@declared("force")
@verbosity_options
@handle_errors
def optimize(paths, out_dir, explain, explain_all, json_path, markdown_path, junit_path, quiet, **values) -> None:
    # ``values``: the declared options (onnxfuse/options.py) as click parsed them, by parameter name;
    # options.from_command_line makes them the API's keywords.
    # Models from CLI_LAZY_MODEL_BYTES of weights are held lazily (why: its comment), except with
    # --precision fp16, which converts weights held in memory only (onnxfuse/precision.py).
    lazy = lazy_weights.CLI_LAZY_MODEL_BYTES if values["precision"] == "fp32" else lazy_weights.LAZY_MODEL_BYTES
    shown = dict(explain=explain, explain_all=explain_all, json_path=json_path, markdown_path=markdown_path,
                 junit_path=junit_path, quiet=quiet)
    if out_dir is not None:
        with lazy_weights.lazy_from(lazy):
            return _optimize_many(paths, out_dir, values, **shown)
    if len(paths) != 2:
        raise click.UsageError(f"expected INPUT OUTPUT, got {len(paths)} path{'s' if len(paths) != 1 else ''}; to "
                               "optimize several models give --out-dir DIR", ctx=click.get_current_context())
    with lazy_weights.lazy_from(lazy):
        return _optimize_one(*paths, values, **shown)


def _optimize_one(input_path, output_path, values, explain, explain_all, json_path, markdown_path, junit_path,
                  quiet) -> None:
    try:
        check_runtime(quiet)
        options.from_command_line(values, ["shapes"])  # a bad --shape is the first error, before the paths'
        force, fail_on_slowdown = values["force"], values["fail_on_slowdown"]
        # Every output path is checked before the (possibly long) run: nothing may be written when a
        # report cannot be, and nothing is written until everything can be (see _save).
        model_io.check_output_path(output_path, input_path, force)
        check_report_paths(
            {report_file(json_path): "JSON report", markdown_path: "Markdown report", junit_path: "JUnit report",
             values["save_inputs"]: "--save-inputs file", values["tuning_record"]: "tuning record"},
            {output_path: "output model", str(model_io.data_path(output_path)): "output model's external data",
             **model_io.input_files(input_path)},
        )
        with render.progress_bar(disabled=quiet) as bar:
            result = api.optimize(input_path, None, **options.from_command_line(values), progress=bar.step,
                                  bench_progress=bar.fraction)
            bar.step("saving")
            _save(result, input_path, output_path, force, json_path, markdown_path, junit_path)
    except (ValidationFailed, SlowerThanAllowed) as exc:
        # The run got far enough to have a report: show it and write the requested files, then let
        # handle_errors print the one-line error and exit with the code.
        report = exc.report
        if report is not None:
            if not quiet and report.validation is not None:
                stderr.print(render.comparison_table("Validation", report.validation.outputs))
            if not quiet and report.timing is not None:
                stderr.print(render.timing_table(report.timing))
            with OutputSet() as out:
                _stage_reports(out, report, json_path, markdown_path, junit_path)
                out.commit()
            emit_json(json_path, json_text(report))
        else:
            write_failure_json(json_path, "optimize", exc, model_io.input_files(input_path))
        raise
    except Exception as exc:  # an internal error too: its document says exit 5, as stderr does
        write_failure_json(json_path, "optimize", exc, model_io.input_files(input_path))
        raise

    emit_json(json_path, json_text(result))

    if quiet:
        _warn_unchecked(result, fail_on_slowdown)
        return
    stdout = report_console(json_path)
    for dropped in result.applied.dropped:
        stderr.print("[yellow]warning:[/] ", end="")
        stderr.print(f"rule {dropped['rule']} was dropped ({dropped['reason']}); the other rules were applied",
                     markup=False, highlight=False, soft_wrap=True)
    stdout.print(render.rules_table(result.applied.counts, result.applied.cleanup))
    stdout.print(render.ops_table(result.ops_before, result.ops_after, result.body_ops_before, result.body_ops_after))
    for row in result.unfused:
        render.print_prose(stdout, render.unfused_line(row), "not fused: ", "[yellow]not fused:[/] ")
    if explain or explain_all:
        details = render.details_table if explain_all else render.details_summary_table
        refusals = render.refusals_table if explain_all else render.refusal_summary_table
        if result.applied.details:
            stdout.print(details(result.applied.details))
        if result.applied.refusals:
            stdout.print(refusals(result.applied.refusals))
        else:
            stdout.print("No candidate was refused.")
    if result.validation is not None:
        stdout.print(render.comparison_table(f"Validation ({result.validation.provider.upper()} provider)",
                                             result.validation.outputs))
        for note in result.validation.notes:
            render.print_prose(stdout, note, "note: ", "[yellow]note:[/] ")
    else:
        stdout.print("[yellow]validation skipped (--no-validate)[/]")
        if result.extra.get("repairs"):  # with validation its notes say it
            render.print_prose(stdout, repair_note(result.extra["repairs"]), "note: ", "[yellow]note:[/] ")
    if result.timing is not None:
        if result.timing.status == "ok":
            stdout.print(render.timing_table(result.timing))
            for note in result.timing.notes:
                render.print_prose(stdout, note, "note: ", "[yellow]note:[/] ")
        else:
            render.print_prose(stdout, result.timing.message, "note: ", "[yellow]note:[/] ")
    record = tuning_note(result)
    if record:
        render.print_prose(stdout, record, "note: ", "[yellow]note:[/] ")
    if result.extra.get("cuda_only_ops"):
        render.print_prose(stdout, f"the output runs on ONNX Runtime's CUDA provider only "
                           f"({', '.join(result.extra['cuda_only_ops'])})", "note: ", "[yellow]note:[/] ")
    if result.custom_library:
        render.print_prose(stdout, f"the output uses custom ops of domain {result.custom_library!r}: run it with "
                           "`onnxfuse.custom_ops.session_options()` (library: `onnxfuse.custom_ops.library_path()`)",
                           "note: ", "[yellow]note:[/] ")
    render.print_prose(stdout, f"Wrote {result.output_path}: {result.nodes_before} → {result.nodes_after} nodes; "
                       f"rewrite {result.rewrite_seconds:.2f} s, validation {result.validation_seconds:.2f} s, "
                       f"total {result.total_seconds:.2f} s")
    sys.stdout.flush()


def _optimize_many(paths, out_dir, values, explain, explain_all, json_path, markdown_path, junit_path,
                   quiet) -> None:
    """The many-models form: plan, check every path, run each model (library), write one report of all."""
    protected = {}
    try:
        if not paths:
            raise UsageError("--out-dir: give at least one INPUT (a model, a folder or a quoted glob pattern)")
        if explain or explain_all:
            raise UsageError(f"--explain{'-all' if explain_all else ''} prints one model's rewrites: use it with one "
                             "model (INPUT OUTPUT); with --out-dir the --json report holds every model's")
        batch.check_options(save_inputs=values["save_inputs"])
        check_runtime(quiet)
        jobs = batch.plan(paths, out_dir, force=values["force"])
        for job in jobs:
            protected.update(model_io.input_files(str(job.input_path)))
        outputs = {}
        for job in jobs:
            outputs[str(job.output_path)] = "output model"
            outputs[str(model_io.data_path(job.output_path))] = "output model's external data"
        check_report_paths({report_file(json_path): "JSON report", markdown_path: "Markdown report",
                            junit_path: "JUnit report"}, {**outputs, **protected})
        with render.BatchProgress(disabled=quiet) as progress:
            result = api.optimize_many(
                [str(p) for p in paths], out_dir, **options.from_command_line(values),
                started=progress.started, progress=progress.step, bench_progress=progress.fraction,
                finished=progress.finished, reraise=bool(os.environ.get("ONNXFUSE_DEBUG")),
            )
    except OnnxfuseError as exc:
        write_failure_json(json_path, "optimize", exc, protected)
        raise
    with OutputSet() as out:
        stage_reports(out, [(report_file(json_path), lambda: json_text(result), "JSON report"),
                            (markdown_path, lambda: many_markdown(result), "Markdown report"),
                            (junit_path, lambda: many_junit(result), "JUnit report")])
        out.commit()
    emit_json(json_path, json_text(result))
    for run in result.runs:  # the summary table says "no GPU", not that the latency check was skipped
        if run.result is not None:
            _warn_unchecked(run.result, values["fail_on_slowdown"], f"{run.name}: ")
    if not quiet:
        stdout = report_console(json_path)
        for run in result.runs:  # a broken rule, dropped: said for each model, as with one
            for dropped in (run.result.applied.dropped if run.result is not None else ()):
                stderr.print("[yellow]warning:[/] ", end="")
                stderr.print(f"{run.name}: rule {dropped['rule']} was dropped ({dropped['reason']}); the other "
                             "rules were applied", markup=False, highlight=False, soft_wrap=True)
        stdout.print(render.many_table(result))
        for run in result.runs:  # what stayed unfused, one line per model (the reasons: one model alone, or --json)
            if run.ok and run.result.unfused:
                left = ", ".join(f"{u.count} {u.op} left by {u.rule}" for u in run.result.unfused)
                render.print_prose(stdout, f"{run.name}: {left}", "not fused: ", "[yellow]not fused:[/] ")
        for run in result.failed:
            render.print_prose(stdout, f"{run.name}: {run.error}", "failed: ", "[red]failed:[/] ", fold=True)
        libraries = sorted({r.result.custom_library for r in result.runs if r.ok and r.result.custom_library})
        if libraries:
            render.print_prose(stdout, f"outputs use custom ops of domain {', '.join(map(repr, libraries))}: run them "
                               "with `onnxfuse.custom_ops.session_options()`", "note: ", "[yellow]note:[/] ")
        sys.stdout.flush()
    result.raise_for_failure()


def _warn_unchecked(result, fail_on_slowdown, prefix: str = "") -> None:
    """The one line saying --fail-on-slowdown could not measure, on stderr: with --quiet, and for each model of
    --out-dir (one model without --quiet prints it as the timing note): a latency check that did not run is
    never a silent pass."""
    timing = result.timing
    if fail_on_slowdown is not None and timing is not None and timing.status != "ok" and timing.message:
        stderr.print("[yellow]warning:[/] ", end="")
        stderr.print(prefix + timing.message, markup=False, highlight=False, soft_wrap=True)


def _save(result, input_path, output_path, force, json_path, markdown_path, junit_path) -> None:
    """Write the model, its external data and the reports as one :class:`~onnxfuse.atomic.OutputSet`:
    they land together or not at all (an error, SIGINT or SIGTERM before the commit leaves nothing)."""
    result.output_path = str(output_path)
    with OutputSet() as out:
        _stage_reports(out, result, json_path, markdown_path, junit_path)
        model_io.save_model(result.model, output_path, input_path=input_path, force=force, check=False,
                            outputs=out)
        out.commit()


def _stage_reports(out, result, json_path, markdown_path, junit_path) -> None:
    """JSON, Markdown and JUnit reports of a finished (or failed-at-validation/timing) run, staged in ``out``."""
    stage_reports(out, [(report_file(json_path), lambda: json_text(result), "JSON report"),
                        (markdown_path, lambda: optimize_markdown(result, error=result.error) + "\n", "Markdown report"),
                        (junit_path, lambda: optimize_junit(result, error=result.error), "JUnit report")])
