"""Seeded inputs: dtype handling, --shape parsing, symbolic dimensions shared between inputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxfuse.errors import UsageError
from onnxfuse.runtime.inputs import make_inputs, parse_shape_options


def two_input_model():
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])
    mask = helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", "seq"])
    feats = helper.make_tensor_value_info("feats", TensorProto.FLOAT16, ["batch", 4])
    out = helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", "seq"])
    g = helper.make_graph([helper.make_node("Add", ["ids", "mask"], ["y"])], "g", [ids, mask, feats], [out])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_shape_of_one_input_sizes_inputs_sharing_its_symbols():
    inputs = make_inputs(two_input_model(), parse_shape_options(["ids:3,7"]), seed=1)
    assert inputs.feeds["ids"].shape == (3, 7)
    assert inputs.feeds["mask"].shape == (3, 7)
    assert inputs.feeds["feats"].shape == (3, 4)
    assert inputs.notes == []


def test_defaults_to_one_with_a_note_and_honours_dtypes():
    inputs = make_inputs(two_input_model(), seed=0)
    assert inputs.feeds["ids"].shape == (1, 1) and inputs.feeds["ids"].dtype == np.int64
    assert inputs.feeds["feats"].dtype == np.float16
    assert set(np.unique(inputs.feeds["ids"])) <= {0, 1}
    assert any("batch" in n for n in inputs.notes)


def test_same_seed_same_data_other_seed_other_data():
    a = make_inputs(two_input_model(), {"feats": [5, 4]}, seed=3).feeds["feats"]
    b = make_inputs(two_input_model(), {"feats": [5, 4]}, seed=3).feeds["feats"]
    c = make_inputs(two_input_model(), {"feats": [5, 4]}, seed=4).feeds["feats"]
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_bad_shapes():
    with pytest.raises(UsageError):
        parse_shape_options(["ids=3,4"])
    with pytest.raises(UsageError):
        parse_shape_options(["ids:3,x"])
    # every --shape that does not fit the model is the command line's error (exit 2), as an unknown name is
    with pytest.raises(UsageError, match="fixed"):
        make_inputs(two_input_model(), {"feats": [2, 5]})
    with pytest.raises(UsageError, match="unknown input"):  # a usage error (exit 2), not the model's
        make_inputs(two_input_model(), {"nope": [1]})
    with pytest.raises(UsageError, match="rank"):
        make_inputs(two_input_model(), {"ids": [1, 2, 3]})
