"""Hostile files and paths (issue 29): a model never makes us read outside its folder, and no output or
report path replaces the input, a device, a FIFO or a standard stream.

Each test failed on 93e2115: the absolute location was read (the file's bytes ended up in the output
model), ``--json`` naming the input wrote the failure report over the model, and FIFOs, ``/dev/null``
behind a symlink and ``/dev/stdout`` were replaced by regular files.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

import onnxfuse
from onnxfuse.cli import main


def run(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(result, *needles):
    err = result.stderr.strip()
    assert result.exit_code == 1, (result.exit_code, err)
    assert "Traceback" not in result.output + err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def external_add_model(location: str, length: int = 16) -> onnx.ModelProto:
    """y = x + w, with w (uint8[length]) stored externally at ``location``."""
    w = TensorProto(name="w", data_type=TensorProto.UINT8, dims=[length])
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(length))):
        w.external_data.add(key=key, value=value)
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.UINT8, [length])],
                          [helper.make_tensor_value_info("y", TensorProto.UINT8, [length])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def secret(tmp_path):
    """A file outside the model's folder that a hostile model names."""
    p = tmp_path / "outside" / "secret.bin"
    p.parent.mkdir()
    p.write_bytes(b"TOP-SECRET-BYTES" * 4)
    return p


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    return d


def plain_model_path(folder: Path) -> Path:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["t"]), helper.make_node("Neg", ["t"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    p = folder / "plain.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), p)
    return p


@pytest.mark.parametrize("command", ["optimize", "diff"])
def test_absolute_external_location_is_refused(command, secret, model_dir):
    model = model_dir / "abs.onnx"
    onnx.save(external_add_model(str(secret)), model)
    out = model_dir / "out.onnx"
    args = ["optimize", model, out, "--no-bench"] if command == "optimize" else ["diff", model, model]
    one_line_error(run(args), "abs.onnx", "must be relative")
    assert not out.exists()


@pytest.mark.parametrize("location", ["../outside/secret.bin", "link.bin", "/dev/zero"])
def test_external_location_leaving_the_folder_is_refused(location, secret, model_dir):
    (model_dir / "link.bin").symlink_to(secret)
    model = model_dir / "m.onnx"
    onnx.save(external_add_model(location), model)
    one_line_error(run(["optimize", model, model_dir / "out.onnx", "--no-bench"]), "m.onnx")
    assert not (model_dir / "out.onnx").exists()


def test_api_refuses_foreign_absolute_location_in_memory(secret):
    model = external_add_model(str(secret))
    for call in (lambda: onnxfuse.optimize(model), lambda: onnxfuse.diff(model, model),
                 lambda: onnxfuse.bench(model, device="cpu", iterations=1)):
        with pytest.raises(onnxfuse.ModelLoadError, match="absolute"):
            call()


def test_relative_external_data_inside_the_folder_still_loads(model_dir):
    (model_dir / "w.bin").write_bytes(bytes(range(16)))
    model = model_dir / "ok.onnx"
    onnx.save(external_add_model("w.bin"), model)
    out = model_dir / "out.onnx"
    result = run(["optimize", model, out, "--no-bench", "-q"])
    assert result.exit_code == 0, result.stderr
    w = onnx.numpy_helper.to_array(onnx.load(out).graph.initializer[0])
    np.testing.assert_array_equal(w, np.arange(16, dtype=np.uint8))


def test_json_naming_the_input_leaves_the_input_alone(model_dir):
    model = plain_model_path(model_dir)
    before = digest(model)
    one_line_error(run(["optimize", model, model_dir / "out.onnx", "--json", model]), "input model")
    assert digest(model) == before
    one_line_error(run(["diff", model, model, "--json", model]), "would overwrite the model")
    assert digest(model) == before


def test_output_is_input_with_json_on_input_leaves_input(model_dir):
    model = plain_model_path(model_dir)
    before = digest(model)
    one_line_error(run(["optimize", model, model, "--json", model]), "same file as the input")
    assert digest(model) == before


def test_fifo_output_and_report_are_refused_and_stay_fifos(model_dir):
    model = plain_model_path(model_dir)
    fifo = model_dir / "pipe"
    os.mkfifo(fifo)
    one_line_error(run(["optimize", model, fifo, "--no-bench"]), "FIFO")
    one_line_error(run(["optimize", model, model_dir / "o.onnx", "--json", fifo, "--no-bench"]), "FIFO", "--json -")
    one_line_error(run(["diff", model, model, "--junit", fifo]), "FIFO")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert not (model_dir / "o.onnx").exists()


def test_symlink_to_a_device_is_refused_and_kept(model_dir):
    model = plain_model_path(model_dir)
    link = model_dir / "null.onnx"
    link.symlink_to("/dev/null")
    one_line_error(run(["optimize", model, link, "--no-bench"]), "character device")
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_standard_stream_paths_are_refused(model_dir):
    # /dev/stdout leads through /proc/self/fd/1, which under pytest's capture is a regular file: it must
    # not be replaced either
    model = plain_model_path(model_dir)
    for path in ("/dev/stdout", "/dev/stderr"):
        one_line_error(run(["optimize", model, model_dir / "o.onnx", "--json", path, "--no-bench"]), path)
    link = model_dir / "out-link.json"
    link.symlink_to("/proc/self/fd/1")
    one_line_error(run(["optimize", model, model_dir / "o.onnx", "--json", link, "--no-bench"]), "stream")
    assert not (model_dir / "o.onnx").exists()


def test_symlinked_output_is_written_through(model_dir):
    model = plain_model_path(model_dir)
    target = model_dir / "real.onnx"
    link = model_dir / "link.onnx"
    link.symlink_to(target.name)
    result = run(["optimize", model, link, "--no-bench", "-q"])
    assert result.exit_code == 0, result.stderr
    assert link.is_symlink() and target.is_file()
    onnx.checker.check_model(onnx.load(target))


@pytest.mark.parametrize("out", ["", "/", ".", "..", "o/", "./"])
def test_output_paths_that_name_no_file_are_one_line(model_dir, out, monkeypatch):
    monkeypatch.chdir(model_dir)
    model = plain_model_path(model_dir)
    one_line_error(run(["optimize", model, out, "--no-bench"]), "output model")
    assert not (model_dir / "o").exists()


def test_report_path_ending_in_a_slash_is_one_line(model_dir, monkeypatch):
    monkeypatch.chdir(model_dir)
    model = plain_model_path(model_dir)
    one_line_error(run(["optimize", model, "x.onnx", "--junit", "r/", "--no-bench"]), "JUnit report")
    assert not (model_dir / "x.onnx").exists() and not (model_dir / "r").exists()


@pytest.mark.parametrize("key,value", [("length", "abc"), ("offset", "-4"), ("location", "w.bin\x00x")])
def test_malformed_external_data_fields_are_one_line(model_dir, key, value):
    (model_dir / "w.bin").write_bytes(bytes(16))
    fields = {"location": "w.bin", "offset": "0", "length": "16", key: value}
    model = external_add_model(fields["location"])
    del model.graph.initializer[0].external_data[:]
    for k, v in fields.items():
        model.graph.initializer[0].external_data.add(key=k, value=v)
    path = model_dir / "m.onnx"
    path.write_bytes(model.SerializeToString())
    one_line_error(run(["optimize", path, model_dir / "out.onnx", "--no-bench"]), "m.onnx", "external data")


def test_reports_on_paths_that_are_not_unicode(model_dir, monkeypatch):
    import xml.etree.ElementTree as ET

    monkeypatch.chdir(model_dir)
    src = os.fsdecode(b"in\xff.onnx")
    os.rename(plain_model_path(model_dir), src)
    junit, md = os.fsdecode(b"j\xfe.xml"), os.fsdecode(b"m\xfe.md")
    result = run(["optimize", src, os.fsdecode(b"o\xfd.onnx"), "--junit", junit, "--markdown", md, "-q", "--no-bench"])
    assert result.exit_code == 0, result.stderr
    ET.parse(junit)
    assert "\\udcff" in Path(md).read_text(encoding="utf-8")
