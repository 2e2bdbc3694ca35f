"""Helpers for the contrib-op rule tests (tests/rewrites/test_contrib_*.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx.parser

import helpers


def parse(body: str, opset: int = 17, inits: dict | None = None) -> onnx.ModelProto:
    """A model from onnx.parser text (the graph part), default domain at ``opset``, plus numpy initializers."""
    model = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]>\n{body}')
    for name, value in (inits or {}).items():
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(value), name))
    onnx.checker.check_model(model)
    return model


def fuse(model: onnx.ModelProto, *rules, infer: bool = True):
    """Apply ``rules`` (Rule objects) like the pipeline would, after shape inference; check the result."""
    from onnxfuse.model_io import to_graph, to_model
    from onnxfuse.rewrites import apply_rules

    src = onnx.shape_inference.infer_shapes(model, data_prop=True) if infer else model
    graph = to_graph(src)
    report = apply_rules(graph, list(rules))
    out = to_model(graph, model)
    onnx.checker.check_model(out)
    return out, report


def ops(model: onnx.ModelProto) -> Counter:
    return Counter((f"{n.domain}:" if n.domain not in ("", "ai.onnx") else "") + n.op_type for n in model.graph.node)


def attrs(node) -> dict:
    """A NodeProto's attributes as {name: value}."""
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def refusals(report, rule=None) -> list[str]:
    return [r.reason for r in report.refusals if rule is None or r.rule == rule.name]


def same_outputs(original, optimized, rtol=1e-5, atol=1e-6, seed=0):
    feeds = helpers.random_feeds(original, seed=seed, dim=3)
    want = helpers.run_ort(original, feeds)
    got = helpers.run_ort(optimized, feeds)
    for name, a in want.items():
        np.testing.assert_allclose(got[name].astype(np.float64), a.astype(np.float64), rtol=rtol, atol=atol,
                                   err_msg=f"output {name!r}")
    return want


def to_dtype(model: onnx.ModelProto, np_dtype=np.float16) -> onnx.ModelProto:
    """A copy of an all-float32 model with every float tensor (inputs, outputs, constants) in ``np_dtype``."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(np_dtype))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in list(out.graph.input) + list(out.graph.output):
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = elem
    for i, init in enumerate(out.graph.initializer):
        if init.data_type == onnx.TensorProto.FLOAT:
            arr = onnx.numpy_helper.to_array(init).astype(np_dtype)
            out.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
    for node in out.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == onnx.TensorProto.FLOAT:
                arr = onnx.numpy_helper.to_array(attr.t).astype(np_dtype)
                attr.t.CopyFrom(onnx.numpy_helper.from_array(arr, attr.t.name))
    onnx.checker.check_model(out)
    return out


def same_at(original, optimized, dims: dict[str, int]):
    """Both models on ONNX Runtime (optimizations off) at the symbolic sizes ``dims``, seeded standard-normal
    float32 inputs: every output of the same shape and bit-identical (for rewrites that only move values)."""
    rng = np.random.default_rng(sum(dims.values()))
    feeds = {}
    for inp in original.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else dims[d.dim_param] for d in inp.type.tensor_type.shape.dim]
        feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    want, got = helpers.run_ort(original, feeds), helpers.run_ort(optimized, feeds)
    for name, a in want.items():
        assert got[name].shape == a.shape, (name, dims)
        np.testing.assert_array_equal(got[name], a)

