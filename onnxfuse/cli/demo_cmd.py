"""``onnxfuse demo [DIR]``: write the sample models (:mod:`onnxfuse.demo`) and say what to run on them."""

from __future__ import annotations

from pathlib import Path

import click

from onnxfuse import demo
from onnxfuse.cli import render
from onnxfuse.cli.common import EXIT_CODES_HELP, handle_errors, stdout

DEMO_HELP = f"""Write two small sample models into DIR (default: ./{demo.DEFAULT_DIR}) and print the commands to
try on them: the quick start, with no checkout and no model of your own.

conv_block.onnx is a Conv+BatchNorm+ReLU residual block with a classifier; mlp_block.onnx a
transformer's feed-forward half (LayerNorm, MatMul, GELU, residual), decomposed as torch exports it.
Both are built on the spot with seeded weights: the same bytes on every machine. --run also optimizes
both into DIR/optimized and prints the report.

\b
Examples:
  onnxfuse demo
  onnxfuse demo /tmp/demo --run
"""


@click.command(help=DEMO_HELP, epilog=EXIT_CODES_HELP)
@click.argument("folder", metavar="[DIR]", required=False, default=demo.DEFAULT_DIR,
                type=click.Path(file_okay=False))
@click.option("--run", "run_it", is_flag=True, help="Also optimize both models into DIR/optimized now.")
@click.option("--force", is_flag=True, help="Replace sample files already in DIR.")
@click.option("-q", "--quiet", is_flag=True, help="Print nothing on success.")
@click.pass_context
@handle_errors
def demo_command(ctx, folder, run_it, force, quiet) -> None:
    paths = demo.write_samples(folder, force=force)
    if not quiet:
        table = render.FitTable(f"Wrote {len(paths)} sample models to {render.escape(str(folder))}",
                                [render.Column("model", "id"), render.Column("what it is", "text")])
        for p in paths:
            table.add_row(p.name, demo.DESCRIPTIONS[p.name])
        stdout.print(table)
    if run_it:
        # import cycle: importing onnxfuse.cli.optimize_cmd imports this module
        from onnxfuse.cli.optimize_cmd import optimize

        ctx.invoke(optimize, paths=tuple(str(p) for p in paths), out_dir=str(Path(folder) / "optimized"),
                   quiet=quiet, force=force)
        return
    if not quiet:
        stdout.print("Next:")
        for what, words in demo.next_commands(folder):
            render.print_prose(stdout, what, "  # ")
            for line in render.shell_lines(words, stdout.width):
                stdout.print(line, markup=False, highlight=False, soft_wrap=True)
