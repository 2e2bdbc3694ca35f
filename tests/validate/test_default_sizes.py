"""Dynamic dimensions nobody sized: 1 by default, a larger size where the model cannot run at 1 (with
a note), a one-line error naming them where it runs at none; a declared 0 dimension stays 0."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from onnxfuse.errors import InputsError
from onnxfuse.runtime.inputs import input_specs, make_samples


def _conv_needs_room(kernel: int) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 3, kernel, kernel)).astype(np.float32), "w")
    g = h.make_graph([h.make_node("Conv", ["x", "w"], ["c"]), h.make_node("Relu", ["c"], ["y"])], "g",
                     [h.make_tensor_value_info("x", T.FLOAT, ["N", 3, "H", "W"])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", 4, None, None])], [w])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_a_model_that_cannot_run_at_1_is_validated_at_a_size_it_can():
    result = onnxfuse.optimize(_conv_needs_room(3), target="onnx")
    assert result.validation.passed
    assert any("does not run with" in n and "validated with 8" in n for n in result.validation.notes)


def test_a_model_that_runs_at_no_default_size_gets_one_line_naming_the_dimensions():
    with pytest.raises(InputsError) as err:
        onnxfuse.optimize(_conv_needs_room(300), target="onnx")
    message = str(err.value)
    assert "x[2] (H)" in message and "--shape" in message and "\n" not in message


def test_declared_zero_dimension_is_fed_as_zero():
    g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g", [h.make_tensor_value_info("x", T.FLOAT, [0, 4])],
                     [h.make_tensor_value_info("y", T.FLOAT, [0, 4])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    assert input_specs(m)[0].shape == [0, 4]
    (sample,) = make_samples(m)
    assert sample.feeds["x"].shape == (0, 4)
