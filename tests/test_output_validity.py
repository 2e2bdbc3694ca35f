"""The output passes ``onnx.checker.check_model(full_check=True)`` whenever the input does (issue 29).

Three of ONNX Runtime's fusion test models broke that (docs/ort-corpus.md), each reduced here:
a declared output shape the graph never computes, exposed once the Reshape target is folded
(``reshape_fusion_with_graph_inputs``, ``reshape_fusion_distillbert``); a declared -1 dimension read as
the size -1, which made a ``Range`` 0 long and contradicted the Expand after it
(``embed_layer_norm_format8/9``). And ORT's own LayerNormalization below opset 17 with a float32 scale
over a float16 input (``skip_layer_norm_no_beta_with_cast``) must not become a SkipLayerNormalization,
which takes one type.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxfuse

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _ort(model, feeds):
    import onnxruntime as ort

    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feeds)))


def _optimized(model, tmp_path):
    path = tmp_path / "in.onnx"
    onnx.save(model, path)
    onnxfuse.optimize(str(path), tmp_path / "out.onnx", target="contrib", provider="cpu")
    return onnx.load(str(tmp_path / "out.onnx"))


def _same(model, out, feeds):
    want, got = _ort(model, feeds), _ort(out, feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)


def test_a_declared_output_shape_the_folded_graph_contradicts_is_corrected(tmp_path):
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "a"),
             numpy_helper.from_array(np.array(1, np.int64), "i"),
             numpy_helper.from_array(np.array([0], np.int64), "axes")]
    nodes = [helper.make_node("Shape", ["q"], ["s"]), helper.make_node("Gather", ["s", "i"], ["g"]),
             helper.make_node("Unsqueeze", ["g", "axes"], ["u"]), helper.make_node("Concat", ["a", "u"], ["t"], axis=0),
             helper.make_node("Reshape", ["x", "t"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("q", F, [1, 50]),
                                       helper.make_tensor_value_info("x", F, [1, 200, 50])],
                          [helper.make_tensor_value_info("y", F, [10, 20, "unk"])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model, full_check=True)  # the input passes: the target is computed
    out = _optimized(model, tmp_path)
    onnx.checker.check_model(out, full_check=True)
    assert [d.dim_value for d in out.graph.output[0].type.tensor_type.shape.dim] == [200, 50]
    rng = np.random.default_rng(0)
    _same(model, out, {"q": rng.standard_normal((1, 50)).astype(np.float32),
                       "x": rng.standard_normal((1, 200, 50)).astype(np.float32)})


def test_a_declared_minus_one_dimension_is_dynamic_not_a_size(tmp_path):
    inits = [numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "word"),
             numpy_helper.from_array(np.arange(32, dtype=np.float32).reshape(8, 4) / 7, "pos"),
             numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "axes")]
    nodes = [helper.make_node("Shape", ["ids"], ["s"]), helper.make_node("Gather", ["s", "one"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["r"]),
             helper.make_node("Unsqueeze", ["r", "axes"], ["ru"]), helper.make_node("Expand", ["ru", "s"], ["p"]),
             helper.make_node("Gather", ["word", "ids"], ["w"]), helper.make_node("Gather", ["pos", "p"], ["e"]),
             helper.make_node("Add", ["w", "e"], ["y"])]
    ids = helper.make_tensor_value_info("ids", I64, [1, 1])
    for d in ids.type.tensor_type.shape.dim:  # an exporter's -1 for a dynamic dimension (ORT reads it so)
        d.dim_value = -1
    g = helper.make_graph(nodes, "g", [ids], [helper.make_tensor_value_info("y", F, [None, None, 4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model, full_check=True)
    out = _optimized(model, tmp_path)
    onnx.checker.check_model(out, full_check=True)
    _same(model, out, {"ids": np.array([[0, 2, 1, 2, 0]], np.int64)})


def test_ort_layernorm_with_a_float32_scale_over_float16_is_not_fused(tmp_path):
    nodes = [helper.make_node("Add", ["a", "b"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "gamma"], ["c"], axis=-1, epsilon=1e-5)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT16, [2, 3, 4]),
                                       helper.make_tensor_value_info("b", TensorProto.FLOAT16, [2, 3, 4])],
                          [helper.make_tensor_value_info("c", F, [2, 3, 4])],
                          [numpy_helper.from_array(np.array([1, 2, 3, 4], np.float32), "gamma")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 12)])
    out = _optimized(model, tmp_path)
    assert "SkipLayerNormalization" not in {n.op_type for n in out.graph.node}
    rng = np.random.default_rng(0)
    _same(model, out, {k: rng.standard_normal((2, 3, 4)).astype(np.float16) for k in "ab"})
