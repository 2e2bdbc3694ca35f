"""All-or-nothing output: a model, its external data and the reports land together or not at all.

Why: a CI job reads ``out.onnx``, ``out.onnx.data`` and ``report.json`` as one result. A run that fails
(or is stopped with SIGTERM/SIGINT) half-way must leave the previous result exactly as it was, never a
model beside another run's data, never a report describing a model that was not written.

How (:class:`OutputSet`):

1. Every file is written under a temporary name *in its destination folder* (``.out.onnx.3fa9c1d2.tmp``),
   so the final step is a ``rename``, which is atomic within a file system. Temporary files are
   created with mode ``0o666`` filtered by the umask, like any new file, so a model and its data get
   the same permissions.
2. :meth:`OutputSet.commit` renames them into place in the order they were staged (the command line
   stages the reports, then the external data, the model last). During the renames
   * SIGINT and SIGTERM are deferred (:func:`deferred_signals`): a signal arriving there is acted on
     once every file is in place, so a signal never splits a commit;
   * the destination folders are locked with ``flock`` (an exclusive lock on the folder itself, so no
     lock file is ever left behind). Two writers racing for the same ``out.onnx`` therefore commit one
     after the other, each renaming its data *and* its model while holding the lock: the last one to
     commit wins both files, and ``out.onnx`` always matches ``out.onnx.data``. (Without the lock, A
     renaming data, B renaming data and model, then A renaming its model would leave A's model beside
     B's data.) Where a file system cannot lock (rare: some network mounts), commits go unlocked.
   * every file about to be replaced or removed is first hard-linked to a backup name, so an error in
     the middle (a rename refused, a full disk while appending to the CI summary) puts every file back
     as it was before the commit began: the commit is all-or-nothing even across several files.
3. On any error or signal before the commit, :meth:`OutputSet.discard` (run by the ``with`` block)
   deletes the temporary files: nothing is left behind.

Readers are not locked out: a reader opening ``out.onnx`` during the few milliseconds of a commit can
see the new data with the old model. Writers, which this module is about, never leave such a pair.

Testing hook: ``ONNXFUSE_TEST_PAUSE=<point>:<marker file>`` makes :func:`pause_point` create the marker
and wait (up to 30 s, or until a signal arrives) at ``<point>``, so a test can send SIGTERM at an exact
moment of a save (``data-written``: temporary files written, before the commit; ``commit``: inside the
commit, signals deferred).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import stat
import threading
import time
from pathlib import Path

from onnxfuse.errors import ModelSaveError, ResourceError

#: Signals deferred during a commit (and turned into a clean exit by the command line).
HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: Paths committed by this process (the command line says whether an interrupted run wrote anything).
committed_paths: list[str] = []

_pending_signal = threading.Event()


def _folder(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def os_error_message(exc: OSError, path, what: str) -> str:
    """One line for an ``OSError`` while writing ``what`` at ``path``; disk full and quota are named."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{path}: no space left on the device while writing the {what} ({reason})"
    return f"{path}: cannot write the {what} ({reason})"


def write_error(exc: OSError, path, what: str) -> ModelSaveError:
    """The :class:`ModelSaveError` (or :class:`ResourceError` for a full disk) for ``exc``."""
    cls = ResourceError if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ModelSaveError
    return cls(os_error_message(exc, path, what))


# ---------------------------------------------------------------------------------------------------
# signals


@contextlib.contextmanager
def deferred_signals():
    """Hold SIGINT/SIGTERM until the block ends, then act on the first one that arrived.

    Works by swapping in a handler that only records the signal (Python handlers run in the main
    thread, whichever thread the kernel delivered to, so masking one thread would not be enough).
    On exit the previous handlers come back and a recorded signal is re-delivered to them: a handler
    that raises (the command line's) raises here, the default action terminates the process. Outside
    the main thread, where handlers cannot be changed, the block runs undeferred. Nests.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def record(signum, _frame):
        pending.append(signum)
        _pending_signal.set()

    previous = {}
    for sig in HANDLED_SIGNALS:
        previous[sig] = signal.signal(sig, record)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _pending_signal.clear()
        if pending:
            sig = pending[0]
            handler = previous[sig]
            if callable(handler):
                handler(sig, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), sig)


def pause_point(name: str) -> None:
    """Testing hook (see the module docstring); does nothing unless ``ONNXFUSE_TEST_PAUSE`` names ``name``."""
    spec = os.environ.get("ONNXFUSE_TEST_PAUSE", "")
    point, _, marker = spec.partition(":")
    if point != name or not marker:
        return
    Path(marker).write_text(str(os.getpid()))
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and not _pending_signal.is_set():
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------------
# locking


@contextlib.contextmanager
def _locked(folders):
    """Exclusive ``flock`` on each folder (sorted, so two writers never deadlock); unlocked where the
    file system refuses."""
    # POSIX only (Windows has no fcntl): imported where the lock is taken
    import fcntl

    fds = []
    try:
        for folder in sorted({os.path.realpath(f) for f in folders}):
            try:
                fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                os.close(fd)
                continue
            fds.append(fd)
        yield
    finally:
        for fd in reversed(fds):
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


# ---------------------------------------------------------------------------------------------------
# destinations

#: Folders of kernel objects, never of files a user means to keep: a path resolving into them (``/dev/null``,
#: ``/dev/stdout`` → ``/proc/self/fd/1`` → ``pipe:[…]``) is a stream or a device, not a destination.
_SPECIAL_TREES = ("/dev", "/proc", "/sys")

_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def check_file_name(path, what: str = "file") -> None:
    """Refuse, in one line, a path that cannot name a file: empty, ending in ``/``, or whose last part is
    ``.``, ``..`` or the root (``pathlib`` would silently drop the trailing slash and write ``out`` for
    ``out/``, or fail with an internal error on ``.``)."""
    raw = os.fspath(path)
    if not raw:
        raise ModelSaveError(f"the {what} path is empty")
    if raw.endswith(os.sep) or os.path.basename(os.path.normpath(raw)) in ("", ".", "..") or raw.endswith(os.sep + "."):
        raise ModelSaveError(f"{raw}: names a directory, not a file, cannot write the {what}")


def destination(final, what: str = "file") -> Path:
    """Where ``final`` is really written: through a symlink to its target (the link stays a link), and
    only ever a regular file or a new name.

    Refused with one :class:`ModelSaveError` line: a FIFO, a device, a socket or a directory, and any
    path that resolves into ``/dev``, ``/proc`` or ``/sys`` (a symlink to a standard stream included).
    Replacing such a path by renaming a regular file over it would destroy it (run as root, the system's
    null device), and writing into it is not the all-or-nothing write a model or report needs; the JSON
    report goes to stdout with ``--json -`` instead."""
    final = Path(final)
    real = Path(os.path.realpath(final))
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise write_error(exc, final, what) from None
    only_files = f"the {what} is only written to a regular file" + (" (for stdout use --json -)" if "JSON" in what else "")
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise ModelSaveError(f"{final}: is {kind}; {only_files}")
    special = next((hop for hop in _link_chain(final)
                    if any(hop == top or hop.startswith(top + "/") for top in _SPECIAL_TREES)), None)
    if special is not None:
        raise ModelSaveError(f"{final}: leads to {special}, a device or stream, not a file; {only_files}")
    return real if final.is_symlink() else final


def _link_chain(path: Path) -> list[str]:
    """``path`` (absolute), every symlink it leads through, and its real path: ``/dev/stdout`` →
    ``/proc/self/fd/1`` → wherever stdout goes (a regular file when redirected, which must not be
    replaced either: the stream would silently lose what it was writing)."""
    hops = [os.path.abspath(path)]
    for _ in range(40):
        if not os.path.islink(hops[-1]):
            break
        try:
            target = os.readlink(hops[-1])
        except OSError:
            break
        hops.append(os.path.normpath(os.path.join(os.path.dirname(hops[-1]), target)))
    return [*hops, os.path.realpath(path)]


# ---------------------------------------------------------------------------------------------------
# the transaction


def new_temp_file(final: Path, suffix: str = "tmp") -> Path:
    """Create an empty, uniquely named file beside ``final`` (``.<name>.<random>.<suffix>``, mode 0o666
    minus the umask) and return its path."""
    folder = _folder(final)
    for _ in range(100):
        tmp = folder / f".{final.name}.{secrets.token_hex(4)}.{suffix}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(final))


class OutputSet:
    """Files that must land together (see the module docstring). Use as a context manager::

        with OutputSet() as out:
            tmp = out.temp_for(Path("model.onnx"))   # write the model to tmp
            out.write_text(Path("report.json"), text)
            out.commit()                             # all renamed into place, or none

    Leaving the block without :meth:`commit` (an error, a signal) deletes every temporary file.
    Files are committed in the order they were added; add the model last.
    """

    def __init__(self):
        self._staged: list[tuple[Path, Path, str]] = []  # (temporary, final, what)
        self._removals: list[Path] = []
        self._appends: list[tuple[Path, str, str]] = []
        self.committed = False

    def __enter__(self) -> OutputSet:
        return self

    def __exit__(self, *exc) -> None:
        if not self.committed:
            self.discard()

    @property
    def finals(self) -> list[Path]:
        return [final for _, final, _ in self._staged]

    def temp_for(self, final, what: str = "file") -> Path:
        """A new empty temporary file that :meth:`commit` renames to ``final``."""
        final = destination(final, what)
        with deferred_signals():  # created and registered together, so discard() always finds it
            try:
                tmp = new_temp_file(final)
            except OSError as exc:
                raise write_error(exc, final, what) from None
            self._staged.append((tmp, final, what))
        return tmp

    def write_text(self, final, text: str, what: str = "report") -> Path:
        """Stage ``text`` (UTF-8) for ``final``."""
        tmp = self.temp_for(final, what)
        try:
            # backslashreplace: a path or name that is not valid Unicode (a file name of raw bytes) is
            # written as \udcff rather than failing the whole write
            with open(tmp, "w", encoding="utf-8", errors="backslashreplace") as f:
                f.write(text)
        except OSError as exc:
            raise write_error(exc, final, what) from None
        return tmp

    def append_text(self, final, text: str, what: str = "report") -> None:
        """Append ``text`` to ``final`` at commit time (CI summary files collect every step's output)."""
        self._appends.append((destination(final, what), text, what))

    def remove(self, path) -> None:
        """Delete ``path`` at commit time if it exists (a stale ``.data`` after an inline save)."""
        self._removals.append(Path(path))

    def discard(self) -> None:
        """Delete the temporary files (nothing reaches a final name)."""
        with deferred_signals():
            for tmp, _, _ in self._staged:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self._staged.clear()

    def commit(self) -> None:
        """Rename every staged file into place, then the removals and appends; all or nothing."""
        folders = {_folder(f) for f in self.finals} | {_folder(p) for p in self._removals}
        with deferred_signals(), _locked(folders):
            pause_point("commit")
            undo: list[tuple[Path, Path | None]] = []  # (final, its backup) for each replaced/created file
            appended: list[tuple[Path, int | None]] = []
            current = None
            try:
                for tmp, final, what in self._staged:
                    current = (final, what)
                    backup = _backup(final)
                    try:
                        os.replace(tmp, final)
                    except OSError:
                        _unlink_quietly(backup)
                        raise
                    undo.append((final, backup))
                for path in self._removals:
                    current = (path, "stale file")
                    if path.is_file():
                        backup = _backup(path)
                        try:
                            os.unlink(path)
                        except OSError:
                            _unlink_quietly(backup)
                            raise
                        undo.append((path, backup))
                for path, text, what in self._appends:
                    current = (path, what)
                    size = path.stat().st_size if path.exists() else None
                    appended.append((path, size))
                    with open(path, "a", encoding="utf-8", errors="backslashreplace") as f:
                        f.write(text)
            except OSError as exc:
                self._rollback(undo, appended)
                self.discard()
                path, what = current
                raise write_error(exc, path, what) from None
            for _, backup in undo:
                _unlink_quietly(backup)
            self._staged.clear()
            self.committed = True
            committed_paths.extend(str(f) for f, _ in undo)

    @staticmethod
    def _rollback(undo, appended) -> None:
        for path, size in reversed(appended):
            with contextlib.suppress(OSError):
                if size is None:
                    os.unlink(path)
                else:
                    os.truncate(path, size)
        for final, backup in reversed(undo):
            with contextlib.suppress(OSError):
                if backup is not None:
                    os.replace(backup, final)
                else:
                    os.unlink(final)


def _unlink_quietly(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _backup(path: Path) -> Path | None:
    """Hard-link ``path`` (when it exists) to a unique backup name beside it; None when there is nothing
    to back up or the file system cannot link (the commit then cannot undo that one file)."""
    if not path.is_file():
        return None
    folder = _folder(path)
    for _ in range(100):
        backup = folder / f".{path.name}.{secrets.token_hex(4)}.bak"
        try:
            os.link(path, backup)
            return backup
        except FileExistsError:
            continue
        except OSError:
            return None
    return None


def write_file_atomically(path, text: str, what: str = "report") -> Path:
    """One text file, atomically (temporary file in the same folder, then rename)."""
    with OutputSet() as out:
        out.write_text(path, text, what)
        out.commit()
    return Path(path)
