"""``onnxfuse rules``: list the rewrite rules, their targets and what they do."""

from __future__ import annotations

import json

import click
from onnxfuse.cli import render
from onnxfuse.cli.common import handle_errors, stdout
from onnxfuse.rewrites import RULES


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@handle_errors
def rules(as_json: bool) -> None:
    """List the rewrite rules in the order they run.

    \b
    Examples:
      onnxfuse rules
      onnxfuse optimize in.onnx out.onnx --skip fold-scale-bias
    """
    rows = [{"name": r.name, "targets": sorted(r.targets), "opt_in": r.opt_in, "description": r.description}
            for r in RULES]
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for line in render.rule_list_lines(rows, stdout.width):
        stdout.print(line, markup=False, highlight=False, soft_wrap=True)
