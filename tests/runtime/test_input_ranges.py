"""Integer inputs are drawn from the range the graph implies (ids into an embedding of V rows:
0..V-1), overridable with --input-range; bad ranges are usage errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from onnxfuse.cli import main
from onnxfuse.runtime.input_ranges import ValueRange, implied_ranges
from onnxfuse.runtime.inputs import make_samples

V = 300


def _embedding_model(via_cast: bool = False, onehot: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((V, 16)).astype(np.float32), "table")
    nodes, ids = [], "ids"
    if via_cast:  # int32 ids cast to int64 and unsqueezed before the lookup
        nodes += [h.make_node("Cast", ["ids"], ["ids64"], to=T.INT64),
                  h.make_node("Unsqueeze", ["ids64", "ax"], ["ids_u"])]
        ids = "ids_u"
    nodes.append(h.make_node("Gather", ["table", ids], ["emb"], axis=0))
    nodes.append(h.make_node("Tanh", ["emb"], ["y"]))
    inits = [table, numpy_helper.from_array(np.array([0], np.int64), "ax")]
    outputs = [h.make_tensor_value_info("y", T.FLOAT, ["batch", 64, 16] if not via_cast else ["batch", 1, 64, 16])]
    inputs = [h.make_tensor_value_info("ids", T.INT32 if via_cast else T.INT64, ["batch", 64])]
    if onehot:
        inputs.append(h.make_tensor_value_info("label", T.INT64, ["batch"]))
        inits += [numpy_helper.from_array(np.array(10, np.int64), "depth"),
                  numpy_helper.from_array(np.array([0, 1], np.float32), "onoff")]
        nodes.append(h.make_node("OneHot", ["label", "depth", "onoff"], ["oh"], axis=-1))
        outputs.append(h.make_tensor_value_info("oh", T.FLOAT, ["batch", 10]))
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, inits), opset_imports=[h.make_opsetid("", 13)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("via_cast", [False, True])
def test_embedding_ids_cover_the_table(via_cast):
    model = _embedding_model(via_cast=via_cast)
    assert implied_ranges(model)["ids"].hi == V - 1
    (sample,) = make_samples(model, {"ids": [4, 64]}, seed=0)
    ids = sample.feeds["ids"]
    assert ids.min() >= 0 and ids.max() <= V - 1
    assert len(np.unique(ids)) > 100  # not just 0 and 1
    assert any("indices into 300 entries" in n for n in sample.notes)


def test_onehot_depth_and_plain_integers():
    model = _embedding_model(onehot=True)
    ranges = implied_ranges(model)
    assert (ranges["label"].lo, ranges["label"].hi) == (0, 9)
    (sample,) = make_samples(model, {"ids": [2, 64], "label": [512]}, seed=1)
    assert set(np.unique(sample.feeds["label"])) == set(range(10))


def test_user_range_overrides_and_validation_uses_it():
    model = _embedding_model()
    result = onnxfuse.optimize(model, shapes={"ids": [2, 64]}, input_ranges={"ids": (5, 7)}, target="onnx")
    assert result.validation.passed
    (sample,) = make_samples(model, {"ids": [2, 64]}, seed=0, ranges={"ids": ValueRange(5, 7, "test")})
    assert set(np.unique(sample.feeds["ids"])) <= {5, 6, 7}


@pytest.mark.parametrize("bad", ["ids", "ids:1", "ids:a,b", "ids:5,1", "ids:nan,3", "nope:0,3"])
def test_bad_input_ranges_are_usage_errors(tmp_path, bad):
    path = tmp_path / "m.onnx"
    onnx.save(_embedding_model(), path)
    res = CliRunner().invoke(main, ["optimize", str(path), str(tmp_path / "o.onnx"), "--no-bench",
                                    "--input-range", bad], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and "--input-range" in res.stderr


def test_comparison_with_constants_covers_both_outcomes_and_indices_win():
    nodes = [h.make_node("Equal", ["mask", "zero"], ["is_pad"]), h.make_node("Cast", ["is_pad"], ["pad_f"], to=T.FLOAT),
             h.make_node("Less", ["ids", "limit"], ["ok"]), h.make_node("Gather", ["table", "ids"], ["emb"], axis=0),
             h.make_node("Cast", ["ok"], ["ok_f"], to=T.FLOAT)]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(50, np.int64), "limit"),
             numpy_helper.from_array(np.zeros((20, 4), np.float32), "table")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("mask", T.INT64, [2, 8]), h.make_tensor_value_info("ids", T.INT64, [2, 8])],
                     [h.make_tensor_value_info(n, T.FLOAT, None) for n in ("pad_f", "ok_f", "emb")], inits)
    ranges = implied_ranges(h.make_model(g, opset_imports=[h.make_opsetid("", 13)]))
    assert (ranges["mask"].lo, ranges["mask"].hi) == (0, 1)  # mask == 0: both outcomes, never negative
    assert (ranges["ids"].lo, ranges["ids"].hi) == (0, 19)  # the table's 20 rows beat "ids < 50"


def test_constants_written_as_value_int_count_too():
    """``Constant(value_int=5)`` (and ``value_ints``) is a constant like ``Constant(value=tensor)``: it was
    missed, so ``ids == 5`` gave no range."""
    for attr, value in (("value_int", 5), ("value_ints", [3, 5])):
        nodes = [h.make_node("Constant", [], ["c"], **{attr: value}), h.make_node("Equal", ["ids", "c"], ["eq"]),
                 h.make_node("Cast", ["eq"], ["y"], to=T.FLOAT)]
        g = h.make_graph(nodes, "g", [h.make_tensor_value_info("ids", T.INT64, [2])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2])])
        r = implied_ranges(h.make_model(g, opset_imports=[h.make_opsetid("", 13)]))["ids"]
        assert (r.lo, r.hi) == (min(np.atleast_1d(value)) - 1, max(np.atleast_1d(value)) + 1)


def _shape_input_model(op: str) -> onnx.ModelProto:
    """x [2, 3, 4] float; ``s`` an int64 input of 3 values used as the shape-like input of ``op``."""
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 3, 4])
    s = h.make_tensor_value_info("s", T.INT64, [3])
    if op == "ConstantOfShape":
        nodes = [h.make_node("ConstantOfShape", ["s"], ["c"]), h.make_node("ReduceSum", ["c"], ["r"], keepdims=0),
                 h.make_node("Add", ["x", "r"], ["y"])]
    else:
        nodes = [h.make_node(op, ["x", "s"], ["t"]), h.make_node("ReduceSum", ["t"], ["r"], keepdims=0),
                 h.make_node("Add", ["x", "r"], ["y"])]
    m = h.make_model(h.make_graph(nodes, "g", [x, s], [h.make_tensor_value_info("y", T.FLOAT, [2, 3, 4])]),
                     opset_imports=[h.make_opsetid("", 13)])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("op, lo, hi", [("Expand", 1, 1), ("Tile", 1, 2), ("ConstantOfShape", 1, 4),
                                        ("Reshape", 0, 0)])
def test_shape_like_inputs_get_values_the_original_model_accepts(op, lo, hi, tmp_path):
    """Drawn as 0 or 1, a shape input made the original itself fail (Expand to 0 against 3, Tile by 0
    is fine but Reshape to [1, 0, 1] is not): the range follows what the op accepts, and validation runs."""
    model = _shape_input_model(op)
    r = implied_ranges(model)["s"]
    assert (r.lo, r.hi) == (lo, hi) and op in r.why
    import onnxruntime as ort

    for seed in range(4):
        (sample,) = make_samples(model, {}, seed=seed)
        assert lo <= sample.feeds["s"].min() and sample.feeds["s"].max() <= hi
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        session.run(None, sample.feeds)  # the original runs on it
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    result = onnxfuse.optimize(str(path), provider="cpu")
    assert result.validation.passed


def test_reshape_with_allowzero_has_no_implied_range():
    model = _shape_input_model("Reshape")
    model.opset_import[0].version = 14
    model.graph.node[0].attribute.append(h.make_attribute("allowzero", 1))
    assert "s" not in implied_ranges(model)


def test_a_mask_summed_into_group_query_attention_lengths_is_all_ones():
    """onnxruntime-genai's form: ``seqlens_k = ReduceSum(mask) - 1`` (int32) into GroupQueryAttention,
    whose kernel refuses rows with fewer kept keys than new tokens: the mask is drawn as ones."""
    nodes = [
        h.make_node("ReduceSum", ["mask", "one"], ["kept"], keepdims=0),
        h.make_node("Sub", ["kept", "one"], ["last"]),
        h.make_node("Cast", ["last"], ["seqlens"], to=T.INT32),
        h.make_node("GroupQueryAttention", ["q", "", "", "", "", "seqlens", "total"], ["y"], domain="com.microsoft",
                    num_heads=1, kv_num_heads=1),
    ]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("mask", T.INT64, ["B", "T"]),
                                  h.make_tensor_value_info("q", T.FLOAT, ["B", "S", 12]),
                                  h.make_tensor_value_info("total", T.INT32, [])],
                     [h.make_tensor_value_info("y", T.FLOAT, None)], [numpy_helper.from_array(np.array([1], np.int64), "one")])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    assert implied_ranges(model)["mask"] == ValueRange(1, 1, "summed into GroupQueryAttention's seqlens_k: every key kept")
