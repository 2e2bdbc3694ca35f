"""Shape inference's one entry point (onnxfuse.rewrites.facts.inference): ONNX's inference with the options
onnxfuse varies, and "infer, then prove" for a graph about to be rewritten or mid-rewrite."""

from __future__ import annotations

import ast

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from helpers import ROOT
from onnxfuse import model_io
from onnxfuse.rewrites.facts.inference import inferred_and_proven, onnx_inferred, reinferred_and_proven
from test_range_dims import range_model


def reshape_model():
    """y = Reshape(x, Concat(Shape(x)[0], [32])): only data propagation gives y's batch dimension."""
    inits = [numpy_helper.from_array(np.array([0], np.int64), "i0"),
             numpy_helper.from_array(np.array([32], np.int64), "width")]
    nodes = [h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "i0"], ["b"], axis=0),
             h.make_node("Concat", ["b", "width"], ["target"], axis=0), h.make_node("Reshape", ["x", "target"], ["y"])]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", 4, 8])],
                         [h.make_tensor_value_info("y", T.FLOAT, None)], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


def dims(model, name):
    (vi,) = [v for v in list(model.graph.value_info) + list(model.graph.output) if v.name == name]
    return [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]


def test_data_prop_is_the_option_that_propagates_shape_values():
    assert dims(onnx_inferred(reshape_model(), data_prop=True), "y") == ["batch", 32]
    assert dims(onnx_inferred(reshape_model()), "y") != ["batch", 32]


def test_strict_raises_where_plain_inference_skips():
    graph = h.make_graph([h.make_node("Add", ["a", "b"], ["c"])], "g",
                         [h.make_tensor_value_info("a", T.FLOAT, [2, 3]), h.make_tensor_value_info("b", T.FLOAT, [4, 5])],
                         [h.make_tensor_value_info("c", T.FLOAT, None)])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    onnx_inferred(model)  # the broadcast error is skipped
    with pytest.raises(Exception, match="(?i)broadcast|incompatible"):
        onnx_inferred(model, strict=True)


def test_inferred_and_proven_gives_the_proved_range_length():
    """Range(0, batch, 1)'s length is an invented symbol for ONNX; after the pair it is ``batch``."""
    graph = inferred_and_proven(range_model())
    assert isinstance(graph, gs.Graph)
    assert list(graph.tensors()["grid"].shape) == ["batch", 4]


def test_the_importer_is_the_callers():
    seen = []
    graph = inferred_and_proven(range_model(), lambda m: seen.append(m) or model_io.to_graph(m))
    assert len(seen) == 1 and dims(seen[0], "rows")  # the importer got the inferred model
    assert list(graph.tensors()["grid"].shape) == ["batch", 4]


def test_reinferred_and_proven_fills_in_a_graph_mid_rewrite():
    graph = gs.import_onnx(range_model())
    assert graph.tensors()["grid"].shape is None
    reinferred_and_proven(graph)
    assert list(graph.tensors()["grid"].shape) == ["batch", 4]


def shape_inference_callers(root) -> list[str]:
    """Files under ``root/onnxfuse`` that reach ``onnx.shape_inference`` (an attribute or an import)."""
    found = []
    for path in sorted((root / "onnxfuse").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, ast.Attribute) and n.attr == "shape_inference"
               or isinstance(n, ast.ImportFrom) and "shape_inference" in (n.module or "") + " ".join(a.name for a in n.names)
               for n in ast.walk(tree)):
            found.append(path.relative_to(root).as_posix())
    return found


def test_onnx_inference_is_called_in_one_place():
    assert shape_inference_callers(ROOT) == ["onnxfuse/rewrites/facts/inference.py"]


def test_the_check_finds_a_second_caller(tmp_path):
    (tmp_path / "onnxfuse").mkdir()
    (tmp_path / "onnxfuse" / "a.py").write_text("import onnx\nonnx.shape_inference.infer_shapes(m)\n")
    (tmp_path / "onnxfuse" / "b.py").write_text("from onnx.shape_inference import infer_shapes\n")
    (tmp_path / "onnxfuse" / "c.py").write_text("import onnx\nonnx.checker.check_model(m)\n")
    assert shape_inference_callers(tmp_path) == ["onnxfuse/a.py", "onnxfuse/b.py"]
