"""All-or-nothing output: the model, its external data and the reports land together or not at all, on
errors and on SIGTERM/SIGINT; temporary files are removed (also in $TMPDIR); the model and its data get
the same permissions; racing writers never leave a model beside the other's data.

Signals are sent at exact moments through the ``ONNXFUSE_TEST_PAUSE=<point>:<marker>`` hook
(onnxfuse.atomic.pause_point): the child creates the marker and waits there; the test then signals it.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest

import large_models as lm

EXTERNAL = 64  # model_io._EXTERNAL_THRESHOLD for the child: every model is written with external data


def _wait_for(path, proc, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the child ended (rc {proc.returncode}) before reaching the pause point: {err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the child never reached the pause point")
        time.sleep(0.02)


@pytest.fixture
def model(tmp_path):
    src = tmp_path / "in" / "model.onnx"
    src.parent.mkdir()
    lm.build(src, layers=2, width=256)
    return src


def _interrupt_at(point, sig, model, tmp_path, extra_args=()):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    marker = tmp_path / "marker"
    args = ["optimize", model, out_dir / "m.onnx", "--target", "onnx", "--json", out_dir / "r.json", "--junit",
            out_dir / "r.xml", "--markdown", out_dir / "r.md", *extra_args]
    proc = lm.popen_cli(args, external=EXTERNAL, env={"ONNXFUSE_TEST_PAUSE": f"{point}:{marker}", "TMPDIR": str(tmpdir)})
    _wait_for(marker, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err, out_dir, tmpdir


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_while_saving_leaves_nothing(model, tmp_path, sig, code):
    """Model and data written to temporary files, reports staged, signal before the commit: nothing at
    all is left, in the output folder or in $TMPDIR, and the exit code is 128 + the signal."""
    rc, err, out_dir, tmpdir = _interrupt_at("data-written", sig, model, tmp_path)
    assert rc == code, err
    assert err.strip().splitlines()[-1] == f"interrupted ({signal.Signals(sig).name}); nothing was written"
    assert "Traceback" not in err
    assert lm.listing(out_dir) == []
    assert [f for f in os.listdir(tmpdir) if f != ".ses"] == []  # .ses: written by `import onnxruntime`
    assert lm.listing(model.parent) == ["model.onnx", "model.onnx.data"]


def test_sigterm_during_the_commit_completes_it(model, tmp_path):
    """A signal that arrives while files are being renamed into place waits for the last rename: every
    file is there, consistent, and the message says so (exit 143)."""
    rc, err, out_dir, _ = _interrupt_at("commit", signal.SIGTERM, model, tmp_path)
    assert rc == 143, err
    assert "interrupted (SIGTERM) after writing" in err
    assert lm.listing(out_dir) == ["m.onnx", "m.onnx.data", "r.json", "r.md", "r.xml"]
    assert json.loads((out_dir / "r.json").read_text())["ok"] is True
    np.testing.assert_allclose(lm.run_model(out_dir / "m.onnx", lm.feeds(256))[0],
                               lm.run_model(model, lm.feeds(256))[0], rtol=1e-4, atol=1e-5)


def test_model_and_data_get_the_same_permissions(model, tmp_path, monkeypatch):
    """Was: ``out.onnx.data`` 0600 (created in a private temporary folder) beside a 0644 ``out.onnx``."""
    from onnxfuse import model_io

    monkeypatch.setattr(model_io, "_EXTERNAL_THRESHOLD", EXTERNAL)
    loaded = model_io.load_model(model)
    old = os.umask(0o027)
    try:
        model_io.save_model(loaded, tmp_path / "o.onnx")
    finally:
        os.umask(old)
    modes = {p: stat.S_IMODE(os.stat(tmp_path / p).st_mode) for p in ("o.onnx", "o.onnx.data")}
    assert modes == {"o.onnx": 0o640, "o.onnx.data": 0o640}


def test_inline_save_after_external_save_removes_the_stale_data(model, tmp_path, monkeypatch):
    from onnxfuse import model_io

    loaded = model_io.load_model(model)
    monkeypatch.setattr(model_io, "_EXTERNAL_THRESHOLD", EXTERNAL)
    model_io.save_model(loaded, tmp_path / "o.onnx")
    assert (tmp_path / "o.onnx.data").exists()
    monkeypatch.undo()
    model_io.save_model(loaded, tmp_path / "o.onnx")
    assert lm.listing(tmp_path) == ["in", "o.onnx"]
    assert np.array_equal(lm.weights_of(tmp_path / "o.onnx")["w0"], lm.weights_of(model)["w0"])


RACER = textwrap.dedent("""
    import os, sys, time
    import onnx
    import onnxfuse.model_io as mio
    mio._EXTERNAL_THRESHOLD = 64
    src, out, tag, slow = sys.argv[1:5]
    model = mio.load_model(src)
    model.doc_string = tag
    real = os.replace
    def replace(a, b):  # the slow writer stops right after renaming its data into place
        real(a, b)
        if slow == "1" and str(b).endswith(".data"):
            open(out + ".paused", "w").close()
            time.sleep(3)
    os.replace = replace
    mio.save_model(model, out)
""")


def test_racing_writers_never_leave_a_model_beside_the_other_data(tmp_path):
    """Writer A renames its data, then stalls; writer B saves the same output meanwhile. Was: A's model
    renamed last, beside B's data. Now A holds the folder's lock through its commit: B commits after A,
    and the output is B's model with B's data."""
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    lm.build(a, layers=1, width=256, seed=1)
    lm.build(b, layers=1, width=256, seed=2)
    out = tmp_path / "o" / "out.onnx"
    out.parent.mkdir()
    slow = subprocess.Popen([sys.executable, "-c", RACER, str(a), str(out), "A", "1"], env=lm.child_env())
    paused = out.with_name("out.onnx.paused")
    _wait_for(paused, slow)
    fast = subprocess.run([sys.executable, "-c", RACER, str(b), str(out), "B", "0"], env=lm.child_env(),
                          capture_output=True, text=True, timeout=120)
    assert fast.returncode == 0, fast.stderr
    assert slow.wait(timeout=120) == 0
    tag = onnx.load(str(out), load_external_data=False).doc_string
    weights = lm.weights_of(out)["w0"]
    source = {"A": a, "B": b}[tag]
    assert np.array_equal(weights, lm.weights_of(source)["w0"]), f"model {tag} beside the other writer's data"
    assert sorted(os.listdir(out.parent)) == ["out.onnx", "out.onnx.data", "out.onnx.paused"]


def test_report_in_a_missing_folder_fails_before_anything_is_written(model, tmp_path):
    """Was: exit 1 after the model had been written."""
    out = tmp_path / "o.onnx"
    for option in ("--json", "--markdown", "--junit"):
        result = lm.run_cli(["optimize", model, out, "--target", "onnx", option, tmp_path / "no" / "r"])
        assert result.returncode == 1
        assert len(result.stderr.strip().splitlines()) == 1 and "does not exist" in result.stderr
        assert not out.exists()


def test_output_over_an_input_data_file_is_refused(model, tmp_path):
    """Was: the input's external data overwritten (and the input model broken)."""
    data = model.parent / "model.onnx.data"
    before = data.read_bytes()
    result = lm.run_cli(["optimize", model, data, "--target", "onnx", "--force"], external=EXTERNAL)
    assert result.returncode == 1 and "external-data file of the input" in result.stderr, result.stderr
    # an output whose own .data would be the input's data file
    renamed = model.parent / "other.onnx"
    os.rename(model, renamed)
    result = lm.run_cli(["optimize", renamed, model, "--target", "onnx"], external=EXTERNAL)
    assert result.returncode == 1 and "holds the weights of the input model" in result.stderr, result.stderr
    assert data.read_bytes() == before
    assert lm.listing(model.parent) == ["model.onnx.data", "other.onnx"]


def test_commit_failure_puts_every_file_back(tmp_path, monkeypatch):
    from onnxfuse import atomic
    from onnxfuse.errors import ModelSaveError

    (tmp_path / "a").write_text("old a")
    (tmp_path / "b").write_text("old b")
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        real(src, dst)

    with atomic.OutputSet() as out:
        out.write_text(tmp_path / "a", "new a")
        out.write_text(tmp_path / "b", "new b")
        out.write_text(tmp_path / "c", "new c")
        monkeypatch.setattr(atomic.os, "replace", flaky)
        with pytest.raises(ModelSaveError, match="Input/output error"):
            out.commit()
    monkeypatch.undo()
    assert {p: (tmp_path / p).read_text() for p in lm.listing(tmp_path)} == {"a": "old a", "b": "old b"}


def test_reports_with_a_failed_save_are_not_written(model, tmp_path, monkeypatch):
    """The model cannot be written (a full disk): the reports of that run are not written either."""
    import errno

    from click.testing import CliRunner

    from onnxfuse import lazy_weights as lw
    from onnxfuse.cli import main

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lw, "write_inline", full)
    out = tmp_path / "out"
    out.mkdir()
    result = CliRunner().invoke(main, ["optimize", str(model), str(out / "m.onnx"), "--target", "onnx", "--junit",
                                       str(out / "r.xml"), "--markdown", str(out / "r.md")])
    assert result.exit_code == 1
    assert "no space left on the device while writing the model" in result.stderr
    assert lm.listing(out) == []
