"""The ``onnxfuse`` command line: click commands that parse options, call the library, render with rich.

Each command lives in its own module and is registered on :data:`main` below. No logic lives here:
errors raised by the library carry their exit code (see :mod:`onnxfuse.errors`) and are printed as one
line, without a traceback (``ONNXFUSE_DEBUG=1`` shows it).
"""

from __future__ import annotations

import click

from onnxfuse import __version__
from onnxfuse.cli.common import EXIT_CODES_HELP, encodable_streams
from onnxfuse.cli import demo_cmd, optimize_cmd, rules_cmd


class _OneLineUsageErrors(click.Group):
    """click prints a usage error as four lines (usage, a hint, a blank line, the error); CI logs and
    scripts get one: ``error: <what is wrong> (see 'onnxfuse optimize --help')``, exit 2."""

    def main(self, *args, **kwargs):
        encodable_streams()
        if kwargs.get("standalone_mode", True):
            try:
                return super().main(*args, **{**kwargs, "standalone_mode": False})
            except click.UsageError as e:
                where = e.ctx.command_path if e.ctx is not None else "onnxfuse"
                click.echo(f"error: {e.format_message()} (see '{where} --help')", err=True)
                raise SystemExit(e.exit_code) from None
            except click.exceptions.Abort:
                click.echo("error: aborted", err=True)
                raise SystemExit(130) from None
            except click.exceptions.Exit as e:
                raise SystemExit(e.exit_code) from None
            except click.ClickException as e:
                click.echo(f"error: {e.format_message()}", err=True)
                raise SystemExit(e.exit_code) from None
        return super().main(*args, **kwargs)


@click.group(
    cls=_OneLineUsageErrors,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=EXIT_CODES_HELP,
)
@click.version_option(__version__, prog_name="onnxfuse")
def main() -> None:
    """Make ONNX models faster on NVIDIA GPUs under ONNX Runtime, without changing their answers.

    \b
    Examples:
      onnxfuse demo                      # sample models to try, and commands
      onnxfuse optimize model.onnx model.opt.onnx
      onnxfuse optimize a.onnx b.onnx --out-dir optimized
      onnxfuse optimize model.onnx out.onnx --explain --json report.json
      onnxfuse diff model.onnx model.opt.onnx --intermediates
      onnxfuse bench model.onnx model.opt.onnx --batch 16 --cuda-graph
      onnxfuse rules
    """


def _register() -> None:
    main.add_command(optimize_cmd.optimize)
    main.add_command(rules_cmd.rules)
    main.add_command(demo_cmd.demo_command, name="demo")
    for module_name, attr in (("diff_cmd", "diff"), ("bench_cmd", "bench")):
        try:
            module = __import__(f"onnxfuse.cli.{module_name}", fromlist=[attr])
        except ModuleNotFoundError as exc:
            if exc.name != f"onnxfuse.cli.{module_name}":
                raise
            continue
        main.add_command(getattr(module, attr))


_register()
