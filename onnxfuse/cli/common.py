"""Pieces shared by every command: error handling, exit codes, consoles, shared options."""

from __future__ import annotations

import codecs
import contextlib
import errno
import functools
import os
import signal
import sys
import threading

import click
from rich.console import Console

from onnxfuse import options
from onnxfuse.errors import InternalError, Interrupted, OnnxfuseError, ResourceError, first_line
from onnxfuse.atomic import committed_paths
from onnxfuse.model_io import last_model_weights
from onnxfuse.reports.contract import failure_document
from onnxfuse.reports.files import check_report_paths, json_text, write_text

EXIT_CODES_HELP = """\b
Exit codes:
  0  success
  1  user or model error (bad file, invalid model, unwritable output,
     runtime failure)
  2  usage error (bad options)
  3  validation failed: outputs differ beyond tolerance (nothing written)
  4  optimize --fail-on-slowdown: the optimized model is slower than
     allowed (nothing written)
  5  internal error: onnxfuse wrote a model ONNX Runtime cannot load, or
     failed unexpectedly (nothing written; please report it)
  130, 143  interrupted by SIGINT (Ctrl-C) or SIGTERM: temporary files
     removed, nothing written
  optimize --out-dir (several models): the worst of the models' codes, in
  the order 2 > 5 > 3 > 4 > 1 > 0 (a wrong command line, an onnxfuse bug,
  wrong answers, slower, a bad file); interrupted, the models already done
  stay written
"""

def verbosity_options(command):
    """``-v/--verbose`` and ``--log-level`` beside a command's own ``-q/--quiet``: ``error`` is ``--quiet``
    (errors only), ``info`` the default (the report, and stage lines off a terminal once a run takes a
    second), ``debug`` is ``--verbose`` (every stage line from the start, on a terminal too). Folded into
    the command's ``quiet`` argument and the progress display's verbosity; ``-q`` with ``-v`` (or a log
    level saying otherwise) is a usage error."""
    # import cycle: importing onnxfuse.cli.render imports this module
    from onnxfuse.cli import render

    @functools.wraps(command)
    def run(*args, verbose=False, log_level=None, **kwargs):
        quiet = kwargs.get("quiet", False)
        if log_level is not None and ((quiet and log_level != "error") or (verbose and log_level != "debug")):
            raise click.UsageError(f"--log-level {log_level} contradicts {'--quiet' if quiet else '--verbose'}")
        if quiet and verbose:
            raise click.UsageError("--quiet and --verbose contradict each other: give one")
        level = log_level or ("error" if quiet else "debug" if verbose else "info")
        kwargs["quiet"] = level == "error"
        render.set_verbose(level == "debug")
        return command(*args, **kwargs)

    run = click.option("--log-level", type=click.Choice(["error", "info", "debug"]), default=None,
                       help="error: as --quiet; info: the default; debug: as --verbose.")(run)
    return click.option("-v", "--verbose", is_flag=True,
                        help="Print every stage as a line with its start time, from the first second.")(run)


#: What a character the stream cannot encode becomes (``PYTHONIOENCODING=ascii``, a C locale in a CI
#: container): the ASCII its meaning is usually written with, else ``?``.
_ASCII_FALLBACK = {"→": "->", "←": "<-", "×": "x", "≤": "<=", "≥": ">=", "±": "+/-", "…": "...", "—": "-",
                   "–": "-", "µ": "u", "²": "^2", "³": "^3", "√": "sqrt", "≈": "~", "·": "*", "ᵀ": "^T",
                   "‘": "'", "’": "'", "“": '"', "”": '"', "•": "*"}


def _fallback(exc: UnicodeError):
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    text = exc.object[exc.start:exc.end]
    return "".join(_ASCII_FALLBACK.get(c, "?") for c in text), exc.end


codecs.register_error("onnxfuse-ascii", _fallback)


def encodable_streams() -> None:
    """Make stdout and stderr write what their encoding cannot hold as ASCII (``→`` as ``->``) instead
    of raising ``UnicodeEncodeError`` half-way through a report: the exit code and the files written
    never depend on the terminal."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(Exception):
                reconfigure(errors="onnxfuse-ascii")


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
    stderr, not shown with ``--quiet``. ONNX Runtime's own log shows with ``--verbose`` only."""
    # start-up: the command line starts (and --help runs) without onnxfuse.ort_runtime
    from onnxfuse.ort_runtime import check_runtime as library_check
    # import cycle: importing onnxfuse.cli.render imports this module
    from onnxfuse.cli import render

    warning = library_check(runtime_log=render.verbose())
    if warning and not quiet:
        stderr.print("[bold yellow]warning:[/] ", end="", markup=True)
        stderr.print(warning, markup=False, highlight=False, soft_wrap=True)


def _terminate(signum, _frame):
    raise Interrupted(signum)


def install_signal_handlers() -> dict:
    """SIGTERM (what CI runners, ``timeout`` and ``kill`` send) is handled like Ctrl-C: it raises
    :class:`~onnxfuse.errors.Interrupted`, so every ``finally`` and ``with`` block on the way out deletes
    its temporary files (output folders and ``$TMPDIR``), then the command exits 143 (SIGINT: 130).
    Returns the previous handlers (for :func:`restore_signal_handlers`)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, _terminate)
    return previous


def restore_signal_handlers(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _interrupted(exc: KeyboardInterrupt) -> None:
    signum = getattr(exc, "signum", signal.SIGINT)
    name = signal.Signals(signum).name
    if committed_paths:
        stderr.print(f"interrupted ({name}) after writing {', '.join(committed_paths)}", markup=False)
    else:
        stderr.print(f"interrupted ({name}); nothing was written", markup=False)
    sys.exit(128 + signum)


def _out_of_memory() -> str:
    size = f" (the model holds {last_model_weights / 2**30:.2f} GiB of weights; optimize needs about 1.5x " \
        "that in memory, see docs/large-models.md)" if last_model_weights else ""
    return f"out of memory{size}"


def as_error(exc: Exception) -> OnnxfuseError | None:
    """What the command line makes of an exception no onnxfuse code raised on purpose, as the error it
    prints and exits with, so that stderr and the ``--json`` failure document say the same: exhausted
    memory or disk is the user's resource (:class:`~onnxfuse.errors.ResourceError`, exit 1); anything
    else is a bug (:class:`~onnxfuse.errors.InternalError`, exit 5, like a model onnxfuse wrote that ONNX
    Runtime cannot load), never filed under the user's or the model's errors. None for click's own
    exceptions, which click reports."""
    if isinstance(exc, OnnxfuseError):
        return exc
    if isinstance(exc, (click.exceptions.Exit, click.ClickException)):
        return None
    if isinstance(exc, MemoryError):
        return ResourceError(_out_of_memory())
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = f" ({exc.filename})" if exc.filename else ""
        return ResourceError(f"no space left on the device{where}: free space, or set TMPDIR to a folder with room "
                             "for temporary files")
    return InternalError(f"internal error ({type(exc).__name__}: {first_line(exc)}); rerun with ONNXFUSE_DEBUG=1 "
                         "for a traceback and please report it")


def handle_errors(func):
    """Turn library errors into one line on stderr and their exit code; never show a traceback.

    Also: SIGTERM and SIGINT become a clean exit (143 / 130) after cleanup, an exhausted memory or disk
    is one line naming it, not an internal error."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        committed_paths.clear()
        previous = install_signal_handlers()
        try:
            return _run(func, args, kwargs)
        finally:
            restore_signal_handlers(previous)

    return wrapper


def _run(func, args, kwargs):
    """Call the command; map what it raises to one line and an exit code (:func:`as_error`)."""
    try:
        return func(*args, **kwargs)
    except KeyboardInterrupt as exc:
        _interrupted(exc)
    except (click.exceptions.Exit, click.ClickException, SystemExit):
        raise
    except Exception as exc:  # an OnnxfuseError, an exhausted resource, or an onnxfuse bug: one line each
        if os.environ.get("ONNXFUSE_DEBUG"):
            raise
        error = as_error(exc)
        fail(error, error.exit_code)


#: ``--json -``: the JSON document goes to stdout, and what the command would print there goes to stderr.
JSON_TO_STDOUT = "-"


def json_option(help_text: str):
    """``--json FILE`` (``-`` for stdout), the same for every command."""
    return click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), metavar="FILE",
                        help=help_text + " Use - for stdout (the human-readable output then goes to stderr).")


def report_console(json_path) -> Console:
    """Where the human-readable report goes: stdout, or stderr when stdout carries the JSON."""
    return stderr if json_path == JSON_TO_STDOUT else stdout


def report_file(json_path):
    """``json_path`` when it names a file (to stage atomically with the other outputs), else None."""
    return None if json_path in (None, JSON_TO_STDOUT) else json_path


def emit_json(json_path, text: str) -> None:
    """The JSON document on stdout, for ``--json -`` (files are staged by the commands themselves)."""
    if json_path == JSON_TO_STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()


def write_failure_json(json_path, command: str, exc, protected: dict | None = None) -> None:
    """After an error that leaves no result: the contract's failure document (``ok: false``, the exit
    code, the one-line error), to the file or stdout. Never raises: the error itself matters more.
    ``protected`` (path → what) are the files the run reads: a report path naming one of them is not
    written (the error may be exactly that). An exception onnxfuse did not raise on purpose is written
    as :func:`as_error` makes it (an internal error, exit 5), as it is printed."""

    exc = as_error(exc)
    if not json_path or exc is None:
        return
    with contextlib.suppress(OnnxfuseError, OSError):
        text = json_text(failure_document(command, exc, exc.exit_code))
        if json_path == JSON_TO_STDOUT:
            emit_json(json_path, text)
        else:
            check_report_paths({json_path: "JSON report"}, protected)
            write_text(json_path, text, what="JSON report")


def range_map(values) -> dict[str, tuple[float, float]] | None:
    """``--input-range NAME:LO,HI`` options as the API takes them (usage errors exit 2)."""
    return options.ranges_from_command_line(values)


def _click_type(spelling: options.CommandLine):
    """The click type of a declared option's value (None: click's own, text)."""
    if spelling.value == "int":
        return int
    if spelling.value == "float":
        if spelling.minimum is None:
            return float
        return click.FloatRange(min=spelling.minimum, min_open=spelling.minimum_open)
    if spelling.value == "choice":
        return click.Choice(spelling.choice_values())
    if spelling.value == "file":
        return click.Path(dir_okay=False)
    if spelling.value == "folder":
        return click.Path(file_okay=False)
    if spelling.value == "text":
        return None
    raise ValueError(f"{spelling.flag}: no click type for a {spelling.value!r} value")


def declared_option(option: options.Option):
    """The click option of a declared option (:mod:`onnxfuse.options`): its flag, parameter name, value
    type, default, metavar and help text, as declared."""
    spelling = option.command_line
    settings = {"help": option.help}
    if spelling.value == "flag":
        settings["is_flag"] = True
    else:
        kind = _click_type(spelling)
        if kind is not None:
            settings["type"] = kind
        if spelling.multiple:
            settings["multiple"] = True
        elif spelling.value not in ("file", "folder"):
            settings["default"] = option.default if spelling.default is options.SAME else spelling.default
        if spelling.show_default:
            settings["show_default"] = True
        if spelling.metavar is not None:
            settings["metavar"] = spelling.metavar
    names = [spelling.flag] if spelling.dest is None else [spelling.flag, spelling.dest]
    return click.option(*names, **settings)


def declared_options(*declared: options.Option):
    """Decorator: the click options of ``declared``, shown in that order."""

    def decorate(func):
        for option in reversed(declared):
            func = declared_option(option)(func)
        return func

    return decorate


#: --right-padded NAME: the promise contrib-mask-lengths relies on, for optimize and diff.
right_padded_option = declared_options(options.RIGHT_PADDED)

#: --shape, --inputs, --input-range, --seed: how models are fed, shared by optimize, diff and bench.
input_options = declared_options(*options.INPUT_OPTIONS)
