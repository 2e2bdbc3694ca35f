"""Pieces shared by every command: error handling, exit codes, consoles, shared options."""

from __future__ import annotations

import functools
import os
import sys

import click
from rich.console import Console

from onnxfuse.errors import EXIT_USER_ERROR, OnnxfuseError

EXIT_CODES_HELP = """\b
Exit codes:
  0  success
  1  user or model error (bad file, invalid model, unwritable output, runtime failure)
  2  usage error (bad options)
  3  validation failed: outputs differ beyond tolerance (nothing written)
  4  optimize --fail-on-slowdown: the optimized model is slower than allowed (nothing written)
"""

stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)


def fail(exc: BaseException, code: int) -> None:
    """Print ``error: <message>`` as one line on stderr and exit with ``code``."""
    stderr.print("[bold red]error:[/] ", end="", markup=True)
    stderr.print(str(exc), markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


def check_runtime(quiet: bool = False) -> None:
    """At the start of every command that runs models: ONNX Runtime must be importable (else its one-line
    error, exit 1, through :func:`handle_errors`); a conflicting installation is one warning line on
    stderr, not shown with ``--quiet``."""
    from onnxfuse.ort_runtime import check_runtime as library_check

    warning = library_check()
    if warning and not quiet:
        stderr.print("[bold yellow]warning:[/] ", end="", markup=True)
        stderr.print(warning, markup=False, highlight=False, soft_wrap=True)


def handle_errors(func):
    """Turn library errors into one line on stderr and their exit code; never show a traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except OnnxfuseError as exc:
            if os.environ.get("ONNXFUSE_DEBUG"):
                raise
            fail(exc, exc.exit_code)
        except KeyboardInterrupt:
            stderr.print("interrupted; nothing was written")
            sys.exit(130)
        except (click.exceptions.Exit, click.ClickException, SystemExit):
            raise
        except Exception as exc:  # an onnxfuse bug: still one line, with a way to see more
            if os.environ.get("ONNXFUSE_DEBUG"):
                raise
            fail(
                RuntimeError(f"internal error ({type(exc).__name__}: {exc}); rerun with ONNXFUSE_DEBUG=1 "
                             "for a traceback and please report it"),
                EXIT_USER_ERROR,
            )

    return wrapper


def range_map(values) -> dict[str, tuple[float, float]] | None:
    """``--input-range NAME:LO,HI`` options as the API takes them (usage errors exit 2)."""
    from onnxfuse.validate.input_ranges import parse_range_options

    return {k: (r.lo, r.hi) for k, r in parse_range_options(values).items()} or None


def input_options(func):
    """--shape, --input-range, --inputs, --seed: how models are fed, shared by optimize, diff and bench."""
    func = click.option("--seed", type=int, default=0, show_default=True,
                        help="Seed for the random inputs.")(func)
    func = click.option("--input-range", "input_ranges", multiple=True, metavar="NAME:LO,HI",
                        help="Draw this input's random values in [LO, HI] (repeatable). Default: integer "
                             "inputs in the range the graph implies (ids into an embedding of V rows: "
                             "0..V-1), else 0 or 1; floats standard normal (uniform with a range).")(func)
    func = click.option("--inputs", "inputs_path", type=click.Path(dir_okay=False),
                        help="An .npz file with one array per model input, used instead of random data.")(func)
    func = click.option("--shape", "shapes", multiple=True, metavar="NAME:D0,D1,...",
                        help="Shape of an input with dynamic dimensions (repeatable). "
                             "Unspecified dynamic dimensions default to 1.")(func)
    return func
