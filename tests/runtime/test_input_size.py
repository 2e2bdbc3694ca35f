"""Random inputs are sized before they are drawn: an input too large for memory is one line naming it and
its size. Was: ``MemoryError`` (numpy asked for 7.3 TiB of float64) reported as an internal error."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from onnxfuse.errors import InputsError
from onnxfuse.runtime.inputs import InputSpec, make_inputs


def _model(tmp_path, dims=(1_000_000, 1_000_000)):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(dims))
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path = tmp_path / "huge.onnx"
    path.write_bytes(model.SerializeToString())
    return model, path


def test_huge_declared_input_is_refused_before_drawing(tmp_path):
    model, _ = _model(tmp_path)
    with pytest.raises(InputsError) as info:
        make_inputs(model)
    message = str(info.value)
    assert "'x'" in message and "[1000000, 1000000]" in message and "1e+12 elements" in message
    assert "3.6 TiB as float32" in message and "7.3 TiB more while drawing" in message


def test_the_check_counts_every_input_and_the_largest_draw():
    from onnxfuse.runtime.inputs import check_input_sizes

    f32 = np.dtype(np.float32)
    specs = [(InputSpec("a", f32, [1000]), [1000]), (InputSpec("b", f32, [10]), [10])]
    need = 1010 * 4 + 8 * 1000
    check_input_sizes(specs, available=need)
    with pytest.raises(InputsError, match="input 'a'"):
        check_input_sizes(specs, available=need - 1)


@pytest.mark.parametrize("command", ["optimize", "diff"])
def test_command_line_says_it_in_one_line(tmp_path, command):
    from onnxfuse.cli import main

    _, path = _model(tmp_path)
    args = [command, str(path), str(tmp_path / "out.onnx" if command == "optimize" else path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "input 'x'" in lines[0] and "internal error" not in lines[0], result.stderr
