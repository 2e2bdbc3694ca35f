"""``onnxfuse optimize IN OUT``: rewrite, validate and save a model."""

from __future__ import annotations

import contextlib
import sys

import click

from onnxfuse.cli import render
from onnxfuse.cli.common import EXIT_CODES_HELP, fail, input_options, stderr, stdout
from onnxfuse.errors import OnnxfuseError, ValidationFailed
from onnxfuse.reports import write_json
from onnxfuse.optimize import OptimizeOptions, optimize_file
from onnxfuse.rewrites import TARGETS
from onnxfuse.validate.inputs import parse_shape_options

OPTIMIZE_HELP = """Optimize INPUT and write the result to OUTPUT.

Folds BatchNormalization and constant scale/bias into Conv, ConvTranspose and Gemm weights, then
checks the result: the original and optimized models run on ONNX Runtime (CUDA when a GPU is usable,
else CPU) on the same seeded inputs, and every output must match within tolerance. If one does not,
the rule responsible is named, nothing is written, and the exit code is 3. The input file is never
modified; the output is written atomically.

\b
Examples:
  onnxfuse optimize resnet.onnx resnet.opt.onnx
  onnxfuse optimize model.onnx out.onnx --shape input:8,3,224,224 --json report.json
  onnxfuse optimize model.onnx out.onnx --skip fold-scale-bias --explain
  onnxfuse optimize model.onnx out.onnx --inputs sample.npz --rtol 1e-3 --quiet
"""


@click.command(help=OPTIMIZE_HELP, epilog=EXIT_CODES_HELP)
@click.argument("input_path", metavar="INPUT", type=click.Path(dir_okay=True))
@click.argument("output_path", metavar="OUTPUT", type=click.Path())
@click.option("--target", type=click.Choice(TARGETS), default="cuda", show_default=True,
              help="cuda: everything; contrib: only ONNX Runtime's own ops; onnx: standard ONNX ops only.")
@click.option("--only", multiple=True, metavar="RULE,...", help="Run only these rules (see `onnxfuse rules`).")
@click.option("--skip", multiple=True, metavar="RULE,...", help="Do not run these rules.")
@click.option("--explain", is_flag=True, help="List every rewrite applied and every candidate refused, with the reason.")
@click.option("--no-validate", is_flag=True, help="Skip comparing the optimized model's outputs with the original's.")
@input_options
@click.option("--rtol", type=float, default=None, help="Relative tolerance (default depends on dtype: fp32 1e-4, fp16 1e-2).")
@click.option("--atol", type=float, default=None, help="Absolute tolerance (default depends on dtype and output scale).")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="ONNX Runtime provider used for validation.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write the report as JSON to this file.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on success (errors still go to stderr).")
@click.option("--force", is_flag=True, help="Allow OUTPUT to be the same file as INPUT.")
def optimize(input_path, output_path, target, only, skip, explain, no_validate, shapes, inputs_path, seed,
             rtol, atol, provider, json_path, quiet, force) -> None:
    try:
        options = OptimizeOptions(
            target=target, only=list(only) or None, skip=list(skip) or None, validate=not no_validate,
            shapes=parse_shape_options(shapes), inputs_path=inputs_path, seed=seed, rtol=rtol, atol=atol,
            provider=provider, force=force,
        )
        status = contextlib.nullcontext() if quiet else stderr.status("optimizing…", spinner="dots")
        with status as live:
            def progress(message: str) -> None:
                if live is not None:
                    live.update(f"{message}…")

            result = optimize_file(input_path, output_path, options, progress=progress)
    except ValidationFailed as exc:
        if exc.report is not None:
            if not quiet and exc.report.validation is not None:
                stderr.print(render.comparison_table("Validation", exc.report.validation.outputs))
            if json_path:
                write_json(json_path, {"ok": False, "exit_code": exc.exit_code, "error": str(exc),
                                              "culprit": exc.culprit, **exc.report.to_dict()})
        fail(exc, exc.exit_code)
    except OnnxfuseError as exc:
        if json_path:
            with contextlib.suppress(OnnxfuseError):
                write_json(json_path, {"ok": False, "exit_code": exc.exit_code, "error": str(exc)})
        fail(exc, exc.exit_code)
    except Exception as exc:  # an onnxfuse bug: one line, never a traceback (ONNXFUSE_DEBUG=1 shows it)
        import os

        if os.environ.get("ONNXFUSE_DEBUG"):
            raise
        fail(RuntimeError(f"internal error ({type(exc).__name__}: {exc}); rerun with ONNXFUSE_DEBUG=1 and "
                          "please report it"), 1)

    if json_path:
        write_json(json_path, {"ok": True, "exit_code": 0, **result.to_dict()})
    if quiet:
        return
    stdout.print(render.rules_table(result.applied.counts, result.applied.cleanup))
    stdout.print(render.ops_table(result.ops_before, result.ops_after))
    if explain:
        if result.applied.details:
            stdout.print(render.details_table(result.applied.details))
        if result.applied.refusals:
            stdout.print(render.refusals_table(result.applied.refusals))
        else:
            stdout.print("No candidate was refused.")
    if result.validation is not None:
        stdout.print(render.comparison_table(f"Validation ({result.validation.provider.upper()} provider)",
                                             result.validation.outputs))
        for note in result.validation.notes:
            stdout.print(f"[yellow]note:[/] {note}")
    else:
        stdout.print("[yellow]validation skipped (--no-validate)[/]")
    if result.custom_library:
        stdout.print(f"[yellow]note:[/] the output uses custom ops of domain {result.custom_library!r}: "
                     "run it with onnxfuse.custom_ops.session_options() (library: onnxfuse.custom_ops.library_path())")
    stdout.print(f"Wrote {result.output_path}: {result.nodes_before} → {result.nodes_after} nodes; "
                 f"rewrite {result.rewrite_seconds:.2f} s, validation {result.validation_seconds:.2f} s, "
                 f"total {result.total_seconds:.2f} s")
    sys.stdout.flush()
