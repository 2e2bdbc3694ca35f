"""``optimize --precision bf16``: the bfloat16 conversion (onnxfuse/precision.py with ``target=BFLOAT16``),
the nodes kept float32 for want of a bfloat16 CUDA kernel (onnxfuse/precision_kernels.py), and the refusals
of runs that cannot check a bfloat16 model. The conversion's numbers are checked with ONNX's reference
evaluator (numpy, ml_dtypes' bfloat16), independent of ONNX Runtime, whose CPU provider has almost no
bfloat16 kernels; tests/gpu/test_precision_bf16_gpu.py checks it on CUDA."""

from __future__ import annotations

import json
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxfuse
from helpers import TESTDATA, load_testdata
from onnxfuse import precision_kernels
from onnxfuse.cli import main
from onnxfuse.errors import InternalError, PrecisionError, SessionRefused
from onnxfuse.model_io import to_graph
from onnxfuse.pipeline import rewrite_model
from onnxfuse.precision import BFLOAT16, convert_to_fp16
from onnxfuse.precision_kernels import (has_bfloat16_kernel, installed_kernel_islands, kernel_islands,
                                        nodes_without_a_bfloat16_kernel)
from onnxfuse.rewrites import ApplyReport
from onnxfuse.rewrites.facts.graph import scalar_constant
from onnxfuse.runtime.session import cuda_available
from onnxfuse.validate.culprit import precision_culprit, unloadable
from onnxfuse.validate.precision_judge import conversion_notes

BF16_MAX_BITS = 0x7F7F  # bfloat16's largest finite value, 3.3895e38


def _bits(tensor: onnx.TensorProto) -> np.ndarray:
    return np.frombuffer(tensor.raw_data, np.uint16)


def test_bfloat16_tensors_round_to_nearest_even_as_ml_dtypes_does():
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(4000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4000),
                             # exact ties between two bfloat16 values: 1 + 2^-8 (to even: 1) and 1 + 3·2^-8 (up)
                             np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8)], np.float32)])
    values = values.astype(np.float32)
    want = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    got = _bits(BFLOAT16.tensor(values, "w"))
    assert BFLOAT16.tensor(values).data_type == T.BFLOAT16
    np.testing.assert_array_equal(got, want)
    assert got[-3] == np.array([1.0], np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)[0]  # tie to even


def test_bfloat16_sentinels_clamp_to_its_largest_and_epsilons_stay_non_zero():
    values = np.array([np.finfo(np.float32).min, np.finfo(np.float32).max, 1e-45, -1e-45, 0.0], np.float32)
    naive = values.astype(ml_dtypes.bfloat16)
    assert np.isinf(naive[0]) and np.isinf(naive[1])  # why the clamp: finfo.min rounds to -inf
    bits = _bits(BFLOAT16.tensor(values))
    assert list(bits[:2]) == [0x8000 | BF16_MAX_BITS, BF16_MAX_BITS]
    assert list(bits[2:]) == [0x0001, 0x8001, 0x0000]  # ± the smallest subnormal (2^-133), and 0 stays 0


def _mlp(extra_op: str = "Clip", name_it: bool = True) -> onnx.ModelProto:
    """x·W + b, Erf, Tanh, then ``extra_op`` (one without a bfloat16 CUDA kernel), then Softmax."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.3).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b"),
             numpy_helper.from_array(np.array(-0.5, np.float32), "lo"),
             numpy_helper.from_array(np.array(0.5, np.float32), "hi")]
    nodes = [h.make_node("MatMul", ["x", "W"], ["m"], name="mm"), h.make_node("Add", ["m", "b"], ["a"], name="add"),
             h.make_node("Erf", ["a"], ["e"], name="erf"), h.make_node("Tanh", ["e"], ["t"], name="tanh"),
             h.make_node(extra_op, ["t", "lo", "hi"], ["c"], name="clip" if name_it else ""),
             h.make_node("Softmax", ["c"], ["y"], axis=-1, name="softmax")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [4, 16])],
                         [h.make_tensor_value_info("y", T.FLOAT, [4, 16])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_ops_without_a_bfloat16_cuda_kernel_stay_float32_by_name():
    model = _mlp()
    kept = kernel_islands(model, BFLOAT16)
    assert set(kept) == {"clip"} and "Clip has no bfloat16 kernel" in kept["clip"]
    assert all(has_bfloat16_kernel(n) for n in model.graph.node if n.name != "clip")
    converted, notes = convert_to_fp16(model, keep_nodes=kept, target=BFLOAT16)
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in onnx.shape_inference.infer_shapes(converted, strict_mode=True).graph.value_info}
    clip = next(n for n in converted.graph.node if n.name == "clip")
    assert [types.get(i) for i in clip.input[:1]] == [T.FLOAT]  # computes in float32, its input cast up
    mm = next(n for n in converted.graph.node if n.name == "mm")
    assert types[mm.output[0]] == T.BFLOAT16
    assert {t.name: t.data_type for t in converted.graph.initializer}["W"] == T.BFLOAT16
    assert any("'clip' (Clip has no bfloat16 kernel" in n for n in notes)


def test_the_bfloat16_conversion_matches_float32_within_bfloat16_rounding():
    model = _mlp()
    converted, _ = convert_to_fp16(model, keep_nodes=kernel_islands(model, BFLOAT16), target=BFLOAT16)
    assert [vi.type.tensor_type.elem_type for vi in converted.graph.input] == [T.FLOAT]  # float32 interface
    assert [vi.type.tensor_type.elem_type for vi in converted.graph.output] == [T.FLOAT]
    x = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = np.asarray(ReferenceEvaluator(converted).run(None, {"x": x})[0], np.float32)
    error = float(np.abs(got - want).max() / np.abs(want).max())
    assert 0 < error < 2e-2  # rounded (bfloat16 has 8 bits of mantissa), and only that
    cosine = float(got.ravel() @ want.ravel() / np.linalg.norm(got) / np.linalg.norm(want))
    assert cosine > 0.999


def test_an_unnamed_node_without_a_kernel_is_refused_with_one_line():
    with pytest.raises(PrecisionError, match="unnamed Clip node cannot compute in bfloat16 .Clip has no bfloat16 kernel"):
        kernel_islands(_mlp(name_it=False), BFLOAT16)


def test_a_body_op_without_a_kernel_is_refused_naming_the_if():
    then = h.make_graph([h.make_node("Clip", ["x"], ["c"], name="inner_clip")], "then", [],
                        [h.make_tensor_value_info("c", T.FLOAT, [2])])
    other = h.make_graph([h.make_node("Identity", ["x"], ["d"], name="inner_id")], "else", [],
                         [h.make_tensor_value_info("d", T.FLOAT, [2])])
    graph = h.make_graph([h.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other)], "g",
                         [h.make_tensor_value_info("cond", T.BOOL, []), h.make_tensor_value_info("x", T.FLOAT, [2])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    with pytest.raises(PrecisionError, match="If 'branch' holds a Clip node"):
        kernel_islands(model, BFLOAT16)


def _refusing(ops: list[str], calls: list):
    """A stand-in for make_session refusing the conversion as ONNX Runtime words it, once per op in ``ops``
    (the first that still has a bfloat16 node), then loading it."""
    def make_session(model, provider, name="model"):
        calls.append(model)
        for op in ops:
            node = next((n for n in model.graph.node if n.op_type == op and _reads_bfloat16(model, n)), None)
            if node is not None:
                raise SessionRefused(f"{name}: ONNX Runtime cannot load the model: [ONNXRuntimeError] : 9 : "
                                     f"NOT_IMPLEMENTED : Could not find an implementation for {op}(13) node with "
                                     f"name '{node.name}'")
        return object()
    return make_session


def _reads_bfloat16(model, node) -> bool:
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.value_info}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return any(types.get(i) == T.BFLOAT16 for i in node.input)


def test_what_the_installed_runtime_lacks_is_kept_float32_by_op(monkeypatch):
    calls: list = []
    monkeypatch.setattr(precision_kernels, "make_session", _refusing(["Erf", "Tanh"], calls))
    model = _mlp()
    keep, notes = installed_kernel_islands(model, BFLOAT16, kernel_islands(model, BFLOAT16))
    assert set(keep) == {"clip", "erf", "tanh"} and len(calls) == 3
    assert "Erf(13)" in keep["erf"] or "opset 13" in keep["erf"]
    assert [n.split(" node(s)")[0] for n in notes] == ["--precision bf16: 1 Erf", "--precision bf16: 1 Tanh"]


def test_a_conversion_refused_for_another_reason_is_our_internal_error(monkeypatch):
    def refuse(model, provider, name="model"):
        raise SessionRefused(f"{name}: ONNX Runtime cannot load the model: Type Error: Type (tensor(bfloat16)) of "
                             "input parameter (x) of operator (Foo) in node (n) is invalid.")
    monkeypatch.setattr(precision_kernels, "make_session", refuse)
    with pytest.raises(InternalError, match="conversion of the model .onnxfuse's own"):
        installed_kernel_islands(_mlp(), BFLOAT16, {})


@pytest.mark.skipif(cuda_available(), reason="the refusal is for machines without a usable CUDA GPU")
def test_bf16_without_a_gpu_is_refused_in_one_line_and_writes_nothing(tmp_path):
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(_mlp(), src)
    before = src.read_bytes()
    result = CliRunner().invoke(main, ["optimize", str(src), str(out), "--precision", "bf16"])
    assert result.exit_code == 1, result.output
    assert "no usable CUDA GPU" in result.output and "--no-validate" in result.output
    assert "Traceback" not in result.output and not out.exists() and src.read_bytes() == before


@pytest.mark.parametrize("flags, words", [(["--device", "cpu"], "its CPU provider has almost no bfloat16"),
                                          (["--provider", "cpu"], "--provider cpu cannot run")])
def test_bf16_for_the_cpu_provider_is_a_usage_error(tmp_path, flags, words):
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(_mlp(), src)
    result = CliRunner().invoke(main, ["optimize", str(src), str(out), "--precision", "bf16", *flags])
    assert result.exit_code == 2, result.output
    assert words in result.output and not out.exists()


@pytest.mark.parametrize("name", ["bert_tiny_opset14", "distilbert_tiny_sdpa_opset17", "yolo_conv_bn_silu_opset13"])
def test_unvalidated_bf16_output_is_well_typed_and_keeps_the_interface(tmp_path, name):
    src, out, report = tmp_path / "in.onnx", tmp_path / "out.onnx", tmp_path / "r.json"
    model = load_testdata(name)
    onnx.save(model, src)
    before = src.read_bytes()
    result = CliRunner().invoke(main, ["optimize", str(src), str(out), "--precision", "bf16", "--no-validate",
                                       "--no-bench", "--json", str(report), "-q"])
    assert result.exit_code == 0, result.output
    assert src.read_bytes() == before
    written = onnx.load(str(out))
    onnx.shape_inference.infer_shapes(written, strict_mode=True, check_type=True)  # every op's types agree
    sig = [(v.name, v.type.tensor_type.elem_type) for v in list(written.graph.input) + list(written.graph.output)]
    assert sig == [(v.name, v.type.tensor_type.elem_type) for v in list(model.graph.input) + list(model.graph.output)]
    data = json.loads(report.read_text())["result"]["precision"]
    assert data["precision"] == "bf16"
    if name.startswith("yolo"):  # opset 13: ONNX's Conv takes no bfloat16 before opset 22, and the notes say so
        assert not any(t.data_type == T.BFLOAT16 and len(t.dims) == 4 for t in written.graph.initializer)
        assert any("23 Conv node(s) compute in float32: ONNX's Conv at opset 13 takes no bfloat16" in n
                   for n in data["notes"])
    else:
        assert any(t.data_type == T.BFLOAT16 for t in written.graph.initializer)


def test_the_api_takes_bf16_and_max_drift_with_it():
    result = onnxfuse.optimize(_mlp(), precision="bf16", validate=False, max_drift="3e-2")
    assert result.extra["precision"]["max_drift"]["normalized_error"] == pytest.approx(3e-2)


def _layernorm(opset: int) -> onnx.ModelProto:
    """A decomposed LayerNorm (torch's opset-14 export): Pow(x - mean, 2), whose exponent ONNX's Pow-13 takes
    in no bfloat16."""
    nodes = [h.make_node("ReduceMean", ["x"], ["mu"], axes=[-1], name="mean"),
             h.make_node("Sub", ["x", "mu"], ["d"], name="sub"),
             h.make_node("Pow", ["d", "two"], ["d2"], name="pow"),
             h.make_node("ReduceMean", ["d2"], ["var"], axes=[-1], name="var"),
             h.make_node("Add", ["var", "eps"], ["ve"], name="eps_add"), h.make_node("Sqrt", ["ve"], ["sd"], name="sqrt"),
             h.make_node("Div", ["d", "sd"], ["y"], name="div")]
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-12, np.float32), "eps")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 8])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2, 8])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_a_float32_exponent_leaves_pows_bfloat16_result_uncast():
    # Pow-13's exponent stays float32 (no bfloat16 in its type list); the base and result are bfloat16, so
    # the result reaches the ReduceMean directly, as the LayerNorm pattern needs (it gained a Cast to its own
    # type once, which left the pattern unrecognised)
    converted, _ = convert_to_fp16(_layernorm(14), target=BFLOAT16)
    pow_node = next(n for n in converted.graph.node if n.name == "pow")
    readers = [n for n in converted.graph.node if pow_node.output[0] in n.input]
    assert [n.name for n in readers] == ["var"]
    inits = {t.name: t.data_type for t in converted.graph.initializer}
    assert inits["two"] == T.FLOAT and inits["eps"] == T.BFLOAT16
    onnx.shape_inference.infer_shapes(converted, strict_mode=True, check_type=True)
    x = np.random.default_rng(4).standard_normal((2, 8)).astype(np.float32)
    want = ReferenceEvaluator(_layernorm(14)).run(None, {"x": x})[0]
    got = np.asarray(ReferenceEvaluator(converted).run(None, {"x": x})[0], np.float32)
    assert np.abs(got - want).max() < 3e-2 * np.abs(want).max()


def test_rules_read_a_bfloat16_scalar_as_its_number():
    converted, _ = convert_to_fp16(_layernorm(17), target=BFLOAT16)
    graph = to_graph(converted)  # as a rule sees it
    eps = next(n for n in graph.nodes if n.name == "eps_add").inputs[1]
    value = scalar_constant(graph, eps)
    assert value is not None and value.dtype == np.float32
    assert float(value) == float(np.float32(1e-12).astype(ml_dtypes.bfloat16))  # bfloat16's 1e-12, exactly


def test_a_bfloat16_conversion_onnx_runtime_cannot_load_is_named_as_such():
    # The CPU provider has no bfloat16 MatMul: the conversion itself does not load there, so the exit-5 error
    # blames the bfloat16 conversion by its own name (the float16 wording and culprit once served both)
    model = _mlp()
    start, _ = convert_to_fp16(model, keep_nodes=kernel_islands(model, BFLOAT16), target=BFLOAT16)
    options = SimpleNamespace(precision="bf16", provider="cpu")
    error = unloadable(SessionRefused("model: ONNX Runtime cannot load the model: no kernel"), model, start, [],
                       ApplyReport(), options, rewrite_model)
    assert isinstance(error, InternalError) and error.rules == ["precision-bf16"]
    assert str(error).startswith("internal error: onnxfuse's bfloat16 conversion (--precision bf16) wrote a model")
    assert precision_culprit("bfloat16") == "precision-bf16" and precision_culprit("float16") == "precision-fp16"


def test_bfloat16_layernorms_fuse_to_the_ops_whose_cuda_kernels_take_bfloat16():
    # ONNX Runtime's CUDA LayerNormalization and SkipLayerNormalization take bfloat16 (its CPU kernels do
    # not; a bfloat16 model is one for CUDA): the tiny BERT's 5 LayerNorms become 1 + 4 fused ops in bfloat16
    result = onnxfuse.optimize(load_testdata("bert_tiny_opset14"), precision="bf16", validate=False)
    out = result.model
    onnx.shape_inference.infer_shapes(out, strict_mode=True, check_type=True)
    ops = [n.op_type for n in out.graph.node]
    assert ops.count("LayerNormalization") == 1 and ops.count("SkipLayerNormalization") == 4
    assert "ReduceMean" not in ops
    types = {t.name: t.data_type for t in out.graph.initializer}
    for node in out.graph.node:
        if node.op_type in ("LayerNormalization", "SkipLayerNormalization"):
            assert [types[name] for name in node.input if name in types] and all(
                types[name] == T.BFLOAT16 for name in node.input if name in types)  # γ, β (and bias) in bfloat16


def test_a_nan_weight_stays_nan_in_bfloat16():
    # a NaN whose payload sits in the low 16 bits only would round up into the exponent's carry: infinity
    quiet_low = np.array([0x7F800001, 0xFF800001, 0x7FC00000], np.uint32).view(np.float32)
    bits = _bits(BFLOAT16.tensor(quiet_low))
    as_float = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(as_float).all(), [hex(b) for b in bits]
    assert list(bits >> 15) == [0, 1, 0]  # the sign kept


def test_an_integer_op_without_a_kernel_in_a_body_is_not_a_reason_to_refuse():
    # Less has no bfloat16 CUDA kernel, but on int64 values it is never converted: only float32 values count,
    # per graph, as ONNX type inference gives them (an untyped body value once counted as float)
    less = h.make_node("Less", ["n", "limit"], ["c"], name="inner_less")
    then = h.make_graph([less], "then", [], [h.make_tensor_value_info("c", T.BOOL, [])],
                        [numpy_helper.from_array(np.array(3, np.int64), "limit")])
    other = h.make_graph([h.make_node("Not", ["cond"], ["d"], name="inner_not")], "else", [],
                         [h.make_tensor_value_info("d", T.BOOL, [])])
    nodes = [h.make_node("If", ["cond"], ["flag"], name="branch", then_branch=then, else_branch=other),
             h.make_node("Cast", ["flag"], ["f"], to=T.FLOAT, name="cast"),
             h.make_node("Mul", ["x", "f"], ["y"], name="mul")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("cond", T.BOOL, []),
                                      h.make_tensor_value_info("n", T.INT64, []),
                                      h.make_tensor_value_info("x", T.FLOAT, [2])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    assert kernel_islands(model, BFLOAT16) == {}


def test_a_constant_of_shape_below_opset_20_writes_float32_and_is_cast():
    # ConstantOfShape writes bfloat16 only from opset 20: at 14 its value stays float32, kept by name, and its
    # result is cast for the bfloat16 Add that reads it (a bfloat16 value attribute failed ONNX's type check)
    nodes = [h.make_node("Shape", ["x"], ["s"], name="shape"),
             h.make_node("ConstantOfShape", ["s"], ["z"], name="zeros",
                         value=numpy_helper.from_array(np.array([0.5], np.float32))),
             h.make_node("Add", ["x", "z"], ["y"], name="add")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2, 3])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 14)])
    model.ir_version = 8
    kept = kernel_islands(model, BFLOAT16)
    assert set(kept) == {"zeros"} and "ConstantOfShape at opset 14 writes no bfloat16" in kept["zeros"]
    converted, _ = convert_to_fp16(model, keep_nodes=kept, target=BFLOAT16)
    onnx.shape_inference.infer_shapes(converted, strict_mode=True, check_type=True)
    x = np.random.default_rng(5).standard_normal((2, 3)).astype(np.float32)
    got = np.asarray(ReferenceEvaluator(converted).run(None, {"x": x})[0], np.float32)
    np.testing.assert_allclose(got, x + 0.5, rtol=1e-2, atol=1e-2)
    model.opset_import[0].version = 20  # from 20 it writes bfloat16 itself
    assert kernel_islands(model, BFLOAT16) == {}


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Every value's element type by ONNX's strict type inference (which raises on a type error)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, check_type=True)
    g = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*g.value_info, *g.input, *g.output]}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def test_every_testdata_model_gives_a_well_typed_bf16_output_or_one_line():
    # the whole pipeline without validation (no GPU here): each output passes ONNX's strict type check, or the
    # model is refused with a PrecisionError; found seven models whose ConstantOfShape wrote bfloat16 at opset 14.
    # And every node the rewrites leave in bfloat16 has a bfloat16 CUDA kernel.
    refused, unrunnable = [], {}
    for path in sorted(TESTDATA.glob("*.onnx")):
        if path.name.startswith("bad_"):
            continue
        try:
            result = onnxfuse.optimize(onnx.load(str(path)), precision="bf16", validate=False)
        except PrecisionError as exc:
            refused.append(path.name)
            assert "\n" not in str(exc)
            # float16 models; a body op that cannot be kept; ONNX's checker not knowing ORT's SimplifiedLayerNorm
            # in the ONNX domain (as --precision fp16 refuses that model too)
            assert ("declares no float32" in str(exc) or "inside If/Loop/Scan bodies" in str(exc)
                    or "No Op registered for SimplifiedLayerNormalization" in str(exc)), (path.name, str(exc))
            continue
        missing = nodes_without_a_bfloat16_kernel(result.model)
        if missing:
            unrunnable[path.name] = missing
    assert unrunnable == {}
    assert "bert_tiny_opset14.onnx" not in refused and "gpt2_tiny_opset14.onnx" not in refused


def test_the_note_for_an_output_passed_within_the_conversion_drift_names_bfloat16():
    output = SimpleNamespace(name="logits", max_abs=0.03, extra={"passed_by": "noise floor", "noise_floor": 1e-3})
    report = SimpleNamespace(outputs=[output])
    notes = conversion_notes(report, {"logits": 0.02}, "bfloat16")
    assert notes and notes[0].startswith("--precision bf16: logits beyond bfloat16's default tolerance but within 3x "
                                         "the drift of the model merely converted to bfloat16")
    assert output.extra["conversion_drift"] == 0.02
    assert conversion_notes(report, {"logits": 0.02})[0].startswith("--precision fp16: logits beyond float16's")


def test_dtype_of_reads_a_bfloat16_variable_through_onnx_s_table():
    # graphsurgeon keeps bfloat16 as its ONNX enum (16); the rules read it as ml_dtypes' bfloat16
    import onnx_graphsurgeon as gs

    from onnxfuse.rewrites.facts.graph import BF16, dtype_of, float_eps, is_float_dtype

    graph = gs.Graph()
    assert dtype_of(graph, gs.Variable("x", dtype=T.BFLOAT16)) == np.dtype(ml_dtypes.bfloat16) == BF16[0]
    assert dtype_of(graph, gs.Variable("y", dtype=np.float16)) == np.dtype(np.float16)
    assert dtype_of(graph, gs.Variable("z", dtype=T.UNDEFINED)) is None
    assert is_float_dtype(BF16[0]) and not is_float_dtype(np.dtype(np.int64))
    assert float_eps(BF16[0]) == 2.0 ** -7 and float_eps(np.dtype(np.float16)) == 2.0 ** -10


@pytest.mark.parametrize("name,attentions", [("bert_tiny_opset14", 2), ("bert_tiny_sdpa_opset17", 2),
                                             ("whisper_encoder_tiny_sdpa_opset17", 2)])
def test_bfloat16_softmax_islands_fuse_into_bfloat16_attention(name, attentions):
    # the conversion keeps each Softmax and its finfo(float32).min mask a float32 island between a bfloat16
    # upcast and a Cast down to bfloat16: that island is a bfloat16 attention (ONNX Runtime 1.31.1's CUDA
    # Attention and MultiHeadAttention have BFloat16 kernels)
    out = onnxfuse.optimize(load_testdata(name), precision="bf16", validate=False).model
    types = _value_types(out)
    fused = [n for n in out.graph.node if n.op_type in ("Attention", "MultiHeadAttention")]
    assert len(fused) == attentions and not [n for n in out.graph.node if n.op_type == "Softmax"]
    for node in fused:
        assert types[node.input[0]] == T.BFLOAT16 and types[node.output[0]] == T.BFLOAT16


def test_a_keep_bias_below_opset_16_is_built_in_float32_and_cast_down():
    # ONNX's Where takes bfloat16 from opset 16: at opset 14 the sdpa export's keep bias Where(keep, 0, fill)
    # runs in float32 and is cast to bfloat16 (exact: each element is 0 or the fill); both layers share it.
    # (contrib-layernorm raises the opset to 17 afterwards; the bias was built at 14.)
    model = load_testdata("bert_tiny_sdpa_opset14")
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [14]
    out = onnxfuse.optimize(model, precision="bf16", validate=False, skip="fuse-elementwise").model  # (it takes the pair)
    types = _value_types(out)
    fused = [n for n in out.graph.node if n.op_type == "Attention"]
    biases = {n.input[5] for n in fused}
    assert len(fused) == 2 and len(biases) == 1  # one bias for both layers
    (bias,) = biases
    assert types[bias] == T.BFLOAT16
    producers = {o: n for n in out.graph.node for o in n.output}
    cast = producers[bias]
    assert cast.op_type == "Cast" and producers[cast.input[0]].op_type == "Where"
    assert types[cast.input[0]] == T.FLOAT
    where = producers[cast.input[0]]
    values = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    fill = [values[i].reshape(-1)[0] for i in where.input[1:] if i in values and values[i].reshape(-1)[0] != 0]
    assert fill and fill[0].dtype == np.float32 and float(fill[0]) == float(np.finfo(np.float32).min) / 2
    assert float(np.array(fill[0], ml_dtypes.bfloat16)) == -(2.0 ** 127)  # finite in bfloat16


def test_fast_gelu_takes_its_constants_rounded_to_bfloat16_and_no_others():
    # --precision bf16 writes √(2/π) as 0.796875 (1.3e-3 below): within bfloat16's 2·eps, so FastGelu; a
    # coefficient 2% off (beyond bfloat16's rounding) stays unfused
    def gelu_model(k):
        c = lambda v, n: numpy_helper.from_array(np.array(v, ml_dtypes.bfloat16), n)
        nodes = [h.make_node("Mul", ["x", "x"], ["x2"]), h.make_node("Mul", ["x2", "x"], ["x3"]),
                 h.make_node("Mul", ["x3", "c3"], ["a"]), h.make_node("Add", ["x", "a"], ["b"]),
                 h.make_node("Mul", ["b", "k"], ["u"]), h.make_node("Tanh", ["u"], ["t"]),
                 h.make_node("Add", ["t", "one"], ["p"]), h.make_node("Mul", ["x", "p"], ["q"]),
                 h.make_node("Mul", ["q", "half"], ["y"])]
        g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.BFLOAT16, [4, 64])],
                         [h.make_tensor_value_info("y", T.BFLOAT16, [4, 64])],
                         [c(0.044715, "c3"), c(k, "k"), c(1.0, "one"), c(0.5, "half")])
        return h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=8)

    def ops(k):
        out = onnxfuse.optimize(gelu_model(k), validate=False, only="contrib-fast-gelu").model
        return [n.op_type for n in out.graph.node]

    assert ops(float(np.sqrt(2 / np.pi))) == ["FastGelu"]
    assert "FastGelu" not in ops(float(np.sqrt(2 / np.pi)) * 1.02)


def _nearest_bfloat16(x: float) -> float:
    """x rounded to the nearest bfloat16, ties to even: the reference, by searching the neighbours of
    float32(x)'s top 16 bits (independent of ml_dtypes' conversion)."""
    top = int(np.array(x, np.float32).view(np.uint32)) >> 16
    candidates = [np.array([(b & 0xFFFF) << 16], np.uint32).view(np.float32)[0] for b in (top - 1, top, top + 1)]
    best = min(candidates, key=lambda c: (abs(float(c) - x), (int(np.array(c).view(np.uint32)) >> 16) & 1))
    return float(best)


def test_bfloat16_scalar_chains_fold_to_the_correctly_rounded_values():
    # the sdpa symbolic's scale Sqrt(1 / Sqrt(Cast(D, bfloat16))), each step rounded to bfloat16 as ONNX
    # Runtime's CUDA kernels round it; the reference rounds each exact (float64) step to the nearest bfloat16
    import onnx_graphsurgeon as gs

    from onnxfuse.rewrites.fold.bfloat16_scalars import fold_bfloat16_scalars

    for d in (48, 64, 80, 96, 100, 128):
        nodes = [h.make_node("Cast", ["d"], ["df"], to=T.BFLOAT16), h.make_node("Sqrt", ["df"], ["s"]),
                 h.make_node("Div", ["one", "s"], ["r"]), h.make_node("Sqrt", ["r"], ["scale"]),
                 h.make_node("Mul", ["x", "scale"], ["y"])]
        inits = [numpy_helper.from_array(np.array(d, np.int64), "d"),
                 numpy_helper.from_array(np.array(1.0, ml_dtypes.bfloat16), "one")]
        model = h.make_model(h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.BFLOAT16, [4])],
                                          [h.make_tensor_value_info("y", T.BFLOAT16, [4])], inits),
                             opset_imports=[h.make_opsetid("", 14)], ir_version=8)
        graph = gs.import_onnx(model)
        assert fold_bfloat16_scalars(graph) == 4
        (mul,) = graph.nodes
        step = _nearest_bfloat16(float(d))
        for f in (np.sqrt, lambda v: 1.0 / v, np.sqrt):  # each step exact in float64, then rounded
            step = _nearest_bfloat16(float(f(step)))
        got = np.asarray(mul.inputs[1].values)
        assert got.dtype == np.dtype(ml_dtypes.bfloat16) and float(got) == step, d


def test_bfloat16_scalar_folding_leaves_what_it_does_not_compute():
    # a run-time input, a graph output, and float16 arithmetic (ONNX Runtime's CPU provider folds that) stay
    import onnx_graphsurgeon as gs

    from onnxfuse.rewrites.fold.bfloat16_scalars import fold_bfloat16_scalars

    nodes = [h.make_node("Sqrt", ["x"], ["sx"]), h.make_node("Neg", ["c"], ["out"]),
             h.make_node("Sqrt", ["h"], ["hs"]), h.make_node("Cast", ["hs"], ["hb"], to=T.BFLOAT16),
             h.make_node("Add", ["sx", "hb"], ["y"])]
    inits = [numpy_helper.from_array(np.array(2.0, ml_dtypes.bfloat16), "c"),
             numpy_helper.from_array(np.array(2.0, np.float16), "h")]
    model = h.make_model(h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.BFLOAT16, [4])],
                                      [h.make_tensor_value_info("y", T.BFLOAT16, [4]),
                                       h.make_tensor_value_info("out", T.BFLOAT16, [])], inits),
                         opset_imports=[h.make_opsetid("", 14)], ir_version=8)
    graph = gs.import_onnx(model)
    assert fold_bfloat16_scalars(graph) == 0
    assert [n.op for n in graph.nodes] == ["Sqrt", "Neg", "Sqrt", "Cast", "Add"]


def _through_float32(value: float) -> float:
    """ONNX Runtime's CUDA Cast of a float64 or an integer to bfloat16: ``(BFloat16)a`` with a float-only
    constructor, so to float32 (to nearest) and then to bfloat16 (to nearest even), computed here with
    Python's float and bit arithmetic on float32's bits (not ml_dtypes, which the fold uses)."""
    bits = int(np.array(value, np.float64).astype(np.float32).view(np.uint32))
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return float(np.array(rounded << 16, np.uint32).view(np.float32))


def test_a_float64_or_large_integer_cast_folds_to_the_cuda_kernels_double_rounding():
    # the kernel rounds twice (float32, then bfloat16): 1 + 2^-8 + 2^-30 is a bfloat16 tie once in float32
    # (1.0), above the tie in float64 (1.0078125 rounded once); 2^24 + 2^16 + 1 likewise (2^24 either way
    # through float32, 2^24 + 2^17 rounded once)
    import onnx_graphsurgeon as gs

    from onnxfuse.rewrites.fold.bfloat16_scalars import fold_bfloat16_scalars

    wide, big = 1.0 + 2.0 ** -8 + 2.0 ** -30, 2 ** 24 + 2 ** 16 + 1
    assert _through_float32(wide) == 1.0 and _nearest_bfloat16(wide) == 1.0078125
    assert _through_float32(big) == 2.0 ** 24 and _nearest_bfloat16(big) == 2.0 ** 24 + 2.0 ** 17
    nodes = [h.make_node("Cast", ["wide"], ["w"], to=T.BFLOAT16), h.make_node("Cast", ["big"], ["b"], to=T.BFLOAT16),
             h.make_node("Mul", ["x", "w"], ["xw"]), h.make_node("Mul", ["xw", "b"], ["y"])]
    inits = [numpy_helper.from_array(np.array(wide, np.float64), "wide"),
             numpy_helper.from_array(np.array(big, np.int64), "big")]
    model = h.make_model(h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.BFLOAT16, [4])],
                                      [h.make_tensor_value_info("y", T.BFLOAT16, [4])], inits),
                         opset_imports=[h.make_opsetid("", 14)], ir_version=8)
    graph = gs.import_onnx(model)
    assert fold_bfloat16_scalars(graph) == 2
    assert [n.op for n in graph.nodes] == ["Mul", "Mul"]
    got = [float(np.asarray(n.inputs[1].values).astype(np.float64)) for n in graph.nodes]
    assert got == [_through_float32(wide), _through_float32(big)]


def test_an_unfolded_sdpa_export_fuses_in_bfloat16_as_in_float16():
    # do_constant_folding=False leaves the sdpa scale as size arithmetic; under bf16 ONNX Runtime's CPU provider
    # cannot evaluate it (and one bfloat16 node in its evaluation stopped all folding): 107 nodes, no attention
    path = TESTDATA / "gpt2_tiny_sdpa_unfolded_opset14.onnx"
    counts = {}
    for precision in ("fp16", "bf16"):
        out = onnxfuse.optimize(onnx.load(str(path)), precision=precision, validate=False,
                                right_padded="attention_mask").model
        ops = [n.op_type for n in out.graph.node]
        assert ops.count("Attention") == 2 and ops.count("FastGelu") == 2 and "Sqrt" not in ops, (precision, ops)
        counts[precision] = len(ops)
    assert counts["bf16"] == counts["fp16"]


def test_an_sdpa_scale_given_in_float64_fuses_in_bfloat16_as_in_float16():
    # a scale passed to sdpa as a Python float reaches the graph as a float64 constant cast to the model's
    # type (torch 2.11's export of GPT-2 small on the GPU machine): cast to bfloat16 under bf16, which the
    # fold once left to the run time, and no attention fused there (docs/benchmarks.md 5.52)
    model = onnx.load(str(TESTDATA / "gpt2_tiny_sdpa_unfolded_opset14.onnx"))
    casts = [n for n in model.graph.node if n.op_type == "Cast" and n.name.endswith("/attn/Cast_1")]
    assert len(casts) == 2
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.125, np.float64), "scale_float64"))
    for cast in casts:
        cast.input[0] = "scale_float64"
    counts = {}
    for precision in ("fp16", "bf16"):
        out = onnxfuse.optimize(model, precision=precision, validate=False, right_padded="attention_mask").model
        ops = [n.op_type for n in out.graph.node]
        assert ops.count("Attention") == 2 and "Sqrt" not in ops and "Softmax" not in ops, (precision, ops)
        counts[precision] = len(ops)
    assert counts["bf16"] == counts["fp16"]


@pytest.mark.parametrize("op,exact", [("Add", lambda a, b: a + b), ("Sub", lambda a, b: a - b),
                                      ("Mul", lambda a, b: a * b), ("Div", lambda a, b: a / b)])
def test_bfloat16_scalar_arithmetic_folds_correctly_rounded(op, exact):
    # 8 random pairs of bfloat16 vectors: every element the nearest bfloat16 to the exact (float64) result
    import onnx_graphsurgeon as gs

    from onnxfuse.rewrites.fold.bfloat16_scalars import fold_bfloat16_scalars

    rng = np.random.default_rng(11)
    for _ in range(8):
        a = (rng.standard_normal(16) * 10).astype(ml_dtypes.bfloat16)
        b = (rng.standard_normal(16) * 10).astype(ml_dtypes.bfloat16)
        nodes = [h.make_node(op, ["a", "b"], ["c"]), h.make_node("Mul", ["x", "c"], ["y"])]
        model = h.make_model(h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.BFLOAT16, [16])],
                                          [h.make_tensor_value_info("y", T.BFLOAT16, [16])],
                                          [numpy_helper.from_array(a, "a"), numpy_helper.from_array(b, "b")]),
                             opset_imports=[h.make_opsetid("", 14)], ir_version=8)
        graph = gs.import_onnx(model)
        assert fold_bfloat16_scalars(graph) == 1
        got = np.asarray(graph.nodes[0].inputs[1].values).astype(np.float64)
        want = [_nearest_bfloat16(float(exact(float(x), float(y)))) for x, y in zip(a, b)]
        assert got.tolist() == want
