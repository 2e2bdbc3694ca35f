"""FusedConcat (custom_ops.CONCAT_OP_TYPE) on ONNX Runtime's CPU provider: each segment's program result
written into its slice of the concatenation, against NumPy (np.concatenate of each program evaluated by
expr.evaluate, the Python reference of the language); the extra outputs; the shape/type inference that
lets a standard op read the output; and the errors. The CUDA kernels' cases: tests/gpu/test_fused_concat_gpu.py
(the same builders); their host side (placement fields, kernel choice): tests/custom_ops/test_cuda_codegen.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

from onnxfuse.custom_ops import CONCAT_AXIS_ATTR, CONCAT_OP_TYPE, DOMAIN, concat_program_attr, expr, opset_import, session_options

SILU = "onnxfuse.elementwise 1\ninput x: {t}\ns: {t} = Sigmoid(x)\ny: {t} = Mul(x, s)\noutput y\noutput s\n"
COPY = "onnxfuse.elementwise 1\ninput x: {t}\noutput x\n"
ADD_BIAS = "onnxfuse.elementwise 1\ninput x: {t}\ninput b: {t}\ny: {t} = Add(x, b)\noutput y\noutput y\n"
RELU = "onnxfuse.elementwise 1\ninput x: {t}\ny: {t} = Relu(x)\noutput y\n"

ONNX_TYPE = {"float32": TP.FLOAT, "float16": TP.FLOAT16}
NP_TYPE = {"float32": np.float32, "float16": np.float16}


def concat_model(programs: list[str], input_shapes: list[list[list[int]]], axis: int, dtype: str = "float32",
                 consumer: str | None = None) -> onnx.ModelProto:
    """One FusedConcat node of ``programs`` (texts), segment k reading inputs of ``input_shapes[k]``;
    ``consumer``: a standard op (e.g. "Relu") reading output 0, whose input type only shape inference
    gives (no value_info)."""
    inputs, outputs, names = [], ["y"], []
    for k, (text, shapes) in enumerate(zip(programs, input_shapes)):
        prog = expr.parse(text)
        assert len(prog.inputs) == len(shapes)
        for i, shape in enumerate(shapes):
            names.append(f"s{k}_in{i}")
            inputs.append(h.make_tensor_value_info(names[-1], ONNX_TYPE[dtype], shape))
        outputs += [f"s{k}_out{j}" for j in range(1, len(prog.outputs))]
    attrs = {concat_program_attr(k): text for k, text in enumerate(programs)}
    nodes = [h.make_node(CONCAT_OP_TYPE, names, outputs, domain=DOMAIN, name="cat", **{CONCAT_AXIS_ATTR: axis}, **attrs)]
    graph_outputs = outputs
    if consumer:
        nodes.append(h.make_node(consumer, ["y"], ["z"]))
        graph_outputs = ["z"] + outputs[1:]
    g = h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info(n, ONNX_TYPE[dtype], None) for n in graph_outputs])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17), opset_import()], ir_version=8)


def feeds_for(model: onnx.ModelProto, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        dtype = np.float16 if vi.type.tensor_type.elem_type == TP.FLOAT16 else np.float32
        out[vi.name] = (rng.standard_normal(shape) * 3).astype(dtype)
    return out


def reference(programs: list[str], feeds: dict, axis: int) -> list[np.ndarray]:
    """np.concatenate of every program's output 0 along ``axis``, then each program's outputs 1..,
    each program evaluated on its own inputs by expr.evaluate."""
    values = list(feeds.values())
    firsts, extras, at = [], [], 0
    for text in programs:
        prog = expr.parse(text)
        mine = values[at:at + len(prog.inputs)]
        at += len(prog.inputs)
        shape = np.broadcast_shapes(*[v.shape for v in mine])
        results = [np.broadcast_to(r, shape) for r in expr.evaluate(prog, mine)]
        firsts.append(results[0])
        extras += results[1:]
    return [np.concatenate(firsts, axis=axis)] + extras


def run_concat(model: onnx.ModelProto, feeds: dict, provider: str = "CPUExecutionProvider") -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=[provider])
    assert session.get_providers()[0] == provider
    return session.run(None, feeds)


#: (programs, each segment's input shapes, axis): channels (NCHW, 1), channels last (3), the outer axis
#: (0), a per-channel bias broadcast, a copy segment, and segments of odd sizes (no 4-element rows).
CASES = [
    ([SILU, COPY, ADD_BIAS], [[[2, 3, 4, 5]], [[2, 2, 4, 5]], [[2, 4, 4, 5], [4, 1, 1]]], 1),
    ([SILU, COPY, ADD_BIAS], [[[2, 4, 5, 3]], [[2, 4, 5, 2]], [[2, 4, 5, 7], [7]]], 3),
    ([RELU, SILU], [[[3, 4, 5]], [[1, 4, 5]]], 0),
    ([RELU, RELU, RELU], [[[2, 1, 3]], [[2, 5, 3]], [[2, 2, 3]]], 1),
    ([SILU, RELU], [[[2, 16, 8, 8]], [[2, 8, 8, 8]]], 1),
]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_segment_lands_in_its_slice(case, dtype):
    texts, shapes, axis = CASES[case]
    programs = [t.format(t=dtype) for t in texts]
    model = concat_model(programs, shapes, axis, dtype)
    feeds = feeds_for(model, seed=case)
    got = run_concat(model, feeds)
    want = reference(programs, feeds, axis)
    assert len(got) == len(want)
    tol = 1e-6 if dtype == "float32" else 2e-3
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == NP_TYPE[dtype]
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol)


def test_copy_segments_are_bit_exact():
    programs = [COPY.format(t="float32")] * 3
    model = concat_model(programs, [[[2, 3, 5]], [[2, 1, 5]], [[2, 4, 5]]], 1)
    feeds = feeds_for(model)
    (got,) = run_concat(model, feeds)
    assert np.array_equal(got, np.concatenate(list(feeds.values()), axis=1))


def test_a_standard_op_reads_the_output_through_shape_inference():
    """Relu after the node has no declared input type: the session loads only if infer_concat_shapes
    typed output 0; its value is the concatenation's."""
    programs = [SILU.format(t="float32"), RELU.format(t="float32")]
    model = concat_model(programs, [[[2, 3, 4]], [[2, 5, 4]]], 1, consumer="Neg")
    feeds = feeds_for(model)
    got = run_concat(model, feeds)
    want = reference(programs, feeds, 1)
    np.testing.assert_allclose(got[0], -want[0], rtol=1e-6, atol=1e-6)
    inferred = onnx.shape_inference.infer_shapes(model)  # the op is unknown to onnx: nothing to check there
    assert inferred.graph.node[0].op_type == CONCAT_OP_TYPE


def test_segments_that_do_not_concatenate_fail_with_one_line_naming_the_node():
    programs = [RELU.format(t="float32")] * 2
    model = concat_model(programs, [[[2, 3, 4]], [[2, 3, 5]]], 1)
    with pytest.raises(Exception, match=r"FusedConcat node 'cat': program_1's result \[2, 3, 5\] does not concatenate "
                                        r"with program_0's \[2, 3, 4\] along axis 1"):
        run_concat(model, feeds_for(model))


@pytest.mark.parametrize("change,message", [
    ("no_axis", "missing int attribute 'axis'"),
    ("negative_axis", "attribute axis is -1"),
    ("no_program", "missing string attribute 'program_0'"),
    ("extra_input", "the node has 3 inputs and 1 outputs but its programs declare 2 inputs"),
    ("mixed_dtypes", "program_1's output 0 is float16, program_0's float32"),
])
def test_a_malformed_node_is_refused_when_the_session_is_created(change, message):
    f32, f16 = RELU.format(t="float32"), RELU.format(t="float16")
    programs = [f32, f16] if change == "mixed_dtypes" else [f32, f32]
    model = concat_model(programs, [[[2, 3]], [[2, 3]]], 1)
    node = model.graph.node[0]
    if change == "mixed_dtypes":
        model.graph.input[1].type.tensor_type.elem_type = TP.FLOAT16
    keep = [a for a in node.attribute
            if not (change == "no_axis" and a.name == CONCAT_AXIS_ATTR)
            and not (change == "no_program" and a.name.startswith("program_"))]
    del node.attribute[:]
    node.attribute.extend(keep)
    if change == "negative_axis":
        next(a for a in node.attribute if a.name == CONCAT_AXIS_ATTR).i = -1
    if change == "extra_input":
        node.input.append("s1_in0")
    with pytest.raises(Exception, match=message):
        ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
