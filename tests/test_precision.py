"""``optimize --precision fp16``: float16 compute, float32 interface, validated against the float32
original at float16's tolerances; constants float16 cannot hold are handled as documented in
onnxfuse/precision.py, and the conversion is named when it alone breaks validation."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from helpers import load_testdata, op_types_within, random_feeds, run_ort
from onnxfuse.cli import main
from onnxfuse.custom_ops import session_options
from onnxfuse import precision
from onnxfuse.precision import HALF_TINY, convert_to_fp16

MODELS = ["conv_bn_relu", "mobilenet_v2_w035", "efficientnet_blocks_opset13", "yolo_conv_bn_silu_opset13",
          "convnext_blocks_opset13", "vit_blocks_opset14", "bert_tiny_opset14"]


def feeds_for(model, seed=0):
    names = {i.name for i in model.graph.input}
    if "input_ids" in names:
        rng = np.random.default_rng(seed)
        mask = np.ones((2, 12), np.int64)
        mask[1, 8:] = 0
        return {"input_ids": rng.integers(0, 1000, (2, 12)), "attention_mask": mask}
    return random_feeds(model, seed=seed, dim=2)


def run_optimized(model, feeds):
    """The optimized model on ONNX Runtime's CPU provider, its graph optimizations off: ORT 1.32's CPU
    optimizer at ORT_ENABLE_ALL segfaults on float16 ViT graphs, torch's own ``.half()`` export of
    testdata's ViT included (found 2026-11-23), which says nothing about the conversion."""
    import onnxruntime as ort

    opts = session_options()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def signature(model):
    return [(v.name, v.type.tensor_type.elem_type) for v in list(model.graph.input) + list(model.graph.output)]


@pytest.mark.parametrize("name", MODELS)
def test_fp16_keeps_the_interface_and_matches_the_fp32_original(name):
    model = load_testdata(name)
    before = model.SerializeToString()
    result = onnxfuse.optimize(model, precision="fp16", provider="cpu")
    assert model.SerializeToString() == before
    out = result.model
    assert signature(out) == signature(model)  # float32 in, float32 out
    readers = {}
    for n in out.graph.node:
        for i in n.input:
            readers.setdefault(i, set()).add(n.op_type)
    float32_weights = [t.name for t in out.graph.initializer if t.data_type == T.FLOAT
                       and not readers.get(t.name, set()) <= {"Resize"}]  # Resize's scales are float32 only
    assert float32_weights == []
    assert result.validation.passed and all(c.rtol >= 1e-2 for c in result.validation.outputs)
    assert result.to_json()["result"]["precision"]["precision"] == "fp16"
    feeds = feeds_for(model, seed=5)
    want, got = run_ort(model, feeds), run_optimized(out, feeds)
    for key, a in want.items():  # an independent check: the fp32 original on ONNX Runtime, not our validator
        scale = float(np.abs(a).max()) or 1.0
        assert np.isfinite(got[key]).all()
        np.testing.assert_allclose(got[key], a, rtol=2e-2, atol=2e-2 * scale, err_msg=key)


def _masked_softmax(fill: float, eps: float) -> onnx.ModelProto:
    """y = softmax(x + mask·fill) · ... with a LayerNorm-style epsilon Add: the sentinel and the epsilon."""
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 4])
    m = h.make_tensor_value_info("m", T.FLOAT, [2, 4])
    nodes = [h.make_node("Mul", ["m", "fill"], ["bias"]), h.make_node("Add", ["x", "bias"], ["s"]),
             h.make_node("Softmax", ["s"], ["p"], axis=-1),
             h.make_node("ReduceMean", ["x"], ["mu"], axes=[-1]), h.make_node("Sub", ["x", "mu"], ["d"]),
             h.make_node("Mul", ["d", "d"], ["d2"]), h.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
             h.make_node("Add", ["var", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["sd"]),
             h.make_node("Div", ["d", "sd"], ["n"]), h.make_node("Add", ["p", "n"], ["y"])]
    inits = [numpy_helper.from_array(np.array(fill, np.float32), "fill"),
             numpy_helper.from_array(np.array(eps, np.float32), "eps")]
    model = h.make_model(h.make_graph(nodes, "g", [x, m], [h.make_tensor_value_info("y", T.FLOAT, [2, 4])], inits),
                         opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_a_softmax_mask_stays_float32_and_epsilons_stay_non_zero():
    model = _masked_softmax(float(np.finfo(np.float32).min), 1e-12)
    half, notes = convert_to_fp16(model)
    values = {t.name: numpy_helper.to_array(t) for t in half.graph.initializer}
    assert values["fill"].dtype == np.float32 and float(values["fill"]) == float(np.finfo(np.float32).min)
    assert float(values["eps"]) == pytest.approx(HALF_TINY)  # not 0
    assert any("softmax" in n and "float32" in n for n in notes)
    softmax = next(n for n in half.graph.node if n.op_type == "Softmax")
    types = {vi.name: vi.type.tensor_type.elem_type for vi in onnx.shape_inference.infer_shapes(half).graph.value_info}
    assert types[softmax.input[0]] == T.FLOAT  # the island: mask, Add and Softmax in float32
    x = np.array([[1, 2, 3, 4], [5, 5, 5, 5]], np.float32)  # the second row's variance is 0
    m = np.array([[0, 0, 1, 1], [1, 1, 1, 1]], np.float32)  # the second row fully masked
    want = run_ort(model, {"x": x, "m": m})["y"]
    got = run_ort(half, {"x": x, "m": m})["y"]
    assert np.isfinite(got).all()  # -inf would give NaN in the fully masked row, eps = 0 a division by 0
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def test_a_fully_masked_row_stays_uniform():
    """The original adds finfo(float32).min, which absorbs the scores: a row whose every key is masked is
    uniform. A clamped -65504 would not absorb them (the row would follow its scores, 0.24 off on
    BERT-base); the float32 island keeps it uniform."""
    model = _masked_softmax(float(np.finfo(np.float32).min), 1e-12)
    half, _ = convert_to_fp16(model)
    x = np.array([[1, 2, 3, 4], [0, 3, -2, 6]], np.float32)  # unequal scores in the masked row
    m = np.array([[0, 0, 1, 1], [1, 1, 1, 1]], np.float32)
    want = run_ort(model, {"x": x, "m": m})["y"]
    got = run_ort(half, {"x": x, "m": m})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    clamped = numpy_helper.from_array(np.array(-65504.0, np.float32), "fill")  # what the clamp would do
    other = onnx.ModelProto()
    other.CopyFrom(model)
    other.graph.initializer.remove(next(t for t in other.graph.initializer if t.name == "fill"))
    other.graph.initializer.append(clamped)
    assert np.abs(run_ort(other, {"x": x, "m": m})["y"] - want).max() > 0.1  # the test can tell


def test_a_sentinel_that_reaches_no_softmax_is_clamped():
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 4])
    nodes = [h.make_node("Max", ["x", "floor"], ["y"])]
    inits = [numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "floor")]
    model = h.make_model(h.make_graph(nodes, "g", [x], [h.make_tensor_value_info("y", T.FLOAT, [2, 4])], inits),
                         opset_imports=[h.make_opsetid("", 13)])
    half, notes = convert_to_fp16(model)
    (floor,) = [numpy_helper.to_array(t) for t in half.graph.initializer]
    assert floor.dtype == np.float16 and float(floor) == -65504.0 and notes == []  # not -inf


def test_a_constant_beyond_float16_stays_float32_with_a_note():
    x = h.make_tensor_value_info("x", T.FLOAT, [3])
    nodes = [h.make_node("Mul", ["x", "big"], ["b"]), h.make_node("Mul", ["b", "small"], ["y"])]
    inits = [numpy_helper.from_array(np.array(1e5, np.float32), "big"),
             numpy_helper.from_array(np.array(1e-5, np.float32), "small")]
    model = h.make_model(h.make_graph(nodes, "g", [x], [h.make_tensor_value_info("y", T.FLOAT, [3])], inits),
                         opset_imports=[h.make_opsetid("", 17)])
    half, notes = convert_to_fp16(model)
    kinds = {t.name: t.data_type for t in half.graph.initializer}
    assert kinds == {"big": T.FLOAT, "small": T.FLOAT16}
    assert any("'big'" in n and "beyond float16's range" in n for n in notes)
    x = np.array([0.5, 1.0, 3.0], np.float32)
    np.testing.assert_allclose(run_ort(half, {"x": x})["y"], x, rtol=2e-3)  # 1e5·x would overflow float16


def test_an_input_the_schema_keeps_float32_is_cast_back():
    """Resize's scales are tensor(float) only: they stay float32 while the data is float16."""
    x = h.make_tensor_value_info("x", T.FLOAT, [1, 1, 2, 2])
    nodes = [h.make_node("Relu", ["x"], ["r"]), h.make_node("Resize", ["r", "", "scales"], ["y"], mode="nearest")]
    inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    model = h.make_model(h.make_graph(nodes, "g", [x], [h.make_tensor_value_info("y", T.FLOAT, [1, 1, 4, 4])], inits),
                         opset_imports=[h.make_opsetid("", 17)])
    half, notes = convert_to_fp16(model)
    assert {t.name: t.data_type for t in half.graph.initializer}["scales"] == T.FLOAT and notes == []
    x = np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2)
    np.testing.assert_array_equal(run_ort(half, {"x": x})["y"], run_ort(model, {"x": x})["y"])


def test_if_branches_reading_outer_values_convert_consistently():
    then_graph = h.make_graph([h.make_node("Mul", ["x", "two"], ["t"])], "then", [],
                              [h.make_tensor_value_info("t", T.FLOAT, [3])])
    else_graph = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [],
                              [h.make_tensor_value_info("e", T.FLOAT, [3])])
    nodes = [h.make_node("If", ["c"], ["y"], then_branch=then_graph, else_branch=else_graph)]
    model = h.make_model(h.make_graph(nodes, "g", [h.make_tensor_value_info("c", T.BOOL, []),
                                                   h.make_tensor_value_info("x", T.FLOAT, [3])],
                                      [h.make_tensor_value_info("y", T.FLOAT, [3])],
                                      [numpy_helper.from_array(np.array(2.0, np.float32), "two")]),
                         opset_imports=[h.make_opsetid("", 17)])
    half, _ = convert_to_fp16(model)
    x = np.array([1.5, -2.0, 3.25], np.float32)
    for c in (True, False):
        feeds = {"c": np.array(c), "x": x}
        np.testing.assert_array_equal(run_ort(half, feeds)["y"], run_ort(model, feeds)["y"])


def test_the_conversion_itself_is_named_when_it_breaks_validation():
    model = load_testdata("conv_bn_relu")
    with pytest.raises(onnxfuse.ValidationFailed) as info:
        onnxfuse.optimize(model, precision="fp16", provider="cpu", rtol=1e-7, atol=1e-9, max_drift=1e-6)
    assert info.value.culprit == "precision-fp16" and "float16 conversion itself" in str(info.value)
    message = str(info.value)  # the drift the user weighs, with the tolerance it missed
    worst = max(info.value.report.validation.outputs, key=lambda c: c.max_abs)
    assert f"drifts up to {worst.max_abs:.3g}" in message and "cosine" in message and "--atol" in message
    assert f"normalized max error {worst.extra['drift_error']:.3g}" in message and "--max-drift" in message


def test_refusals_are_one_line_errors(tmp_path):
    ints = h.make_model(h.make_graph([h.make_node("Neg", ["i"], ["o"])], "g",
                                     [h.make_tensor_value_info("i", T.INT64, [2])],
                                     [h.make_tensor_value_info("o", T.INT64, [2])]),
                        opset_imports=[h.make_opsetid("", 17)])
    with pytest.raises(onnxfuse.PrecisionError, match="nothing to convert"):
        onnxfuse.optimize(ints, precision="fp16", provider="cpu")
    # a float16 model whose exporter computes one step in float32: already float16, the step is deliberate
    island = h.make_model(h.make_graph(
        [h.make_node("Cast", ["x"], ["x32"], to=T.FLOAT), h.make_node("Exp", ["x32"], ["e"]),
         h.make_node("Cast", ["e"], ["y"], to=T.FLOAT16)], "g",
        [h.make_tensor_value_info("x", T.FLOAT16, [2])], [h.make_tensor_value_info("y", T.FLOAT16, [2])]),
        opset_imports=[h.make_opsetid("", 17)])
    with pytest.raises(onnxfuse.PrecisionError, match="declares no float32 .* exporter left inside"):
        onnxfuse.optimize(island, precision="fp16", provider="cpu")
    path = tmp_path / "ints.onnx"
    onnx.save(ints, str(path))
    r = CliRunner().invoke(main, ["optimize", str(path), str(tmp_path / "o.onnx"), "--precision", "fp16"])
    assert r.exit_code == 1 and "nothing to convert" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.onnx").exists()
    r = CliRunner().invoke(main, ["optimize", str(path), str(tmp_path / "o.onnx"), "--precision", "fp8"])
    assert r.exit_code == 2


def test_cli_json_reports_the_precision(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(load_testdata("mobilenet_v2_w035"), str(src))
    r = CliRunner().invoke(main, ["optimize", str(src), str(tmp_path / "o.onnx"), "--precision", "fp16",
                                  "--json", str(tmp_path / "r.json"), "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["ok"] and doc["result"]["precision"]["precision"] == "fp16"
    assert doc["result"]["validation"]["passed"]


def test_masked_fill_zeros_join_the_island():
    """GPT-2's mask is ``Where(drop, finfo.min, ConstantOfShape(shape))``: the zeros are written in float32
    inside the island (no Cast of float16 zeros at run time), so contrib-attention still sees zeros."""
    x = h.make_tensor_value_info("x", T.FLOAT, [2, 4])
    drop = h.make_tensor_value_info("drop", T.BOOL, [2, 4])
    nodes = [h.make_node("Shape", ["x"], ["shape"]),
             h.make_node("ConstantOfShape", ["shape"], ["zeros"],
                         value=numpy_helper.from_array(np.zeros(1, np.float32))),
             h.make_node("Where", ["drop", "fill", "zeros"], ["bias"]),
             h.make_node("Add", ["x", "bias"], ["s"]), h.make_node("Softmax", ["s"], ["p"], axis=-1),
             h.make_node("Relu", ["p"], ["y"])]  # (a Softmax writing a graph output stays out of islands)
    inits = [numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "fill")]
    model = h.make_model(h.make_graph(nodes, "g", [x, drop], [h.make_tensor_value_info("y", T.FLOAT, [2, 4])], inits),
                         opset_imports=[h.make_opsetid("", 13)])
    half, _ = convert_to_fp16(model)
    (zeros,) = [n for n in half.graph.node if n.op_type == "ConstantOfShape"]
    assert zeros.attribute[0].t.data_type == T.FLOAT
    assert not any(n.op_type == "Cast" and "zeros" in n.input for n in half.graph.node)
    xv = np.array([[1, 2, 3, 4], [0, 3, -2, 6]], np.float32)
    dv = np.array([[False, True, False, True], [True, True, True, True]])  # the second row fully masked
    np.testing.assert_allclose(run_ort(half, {"x": xv, "drop": dv})["y"], run_ort(model, {"x": xv, "drop": dv})["y"],
                               rtol=1e-2, atol=1e-3)


def test_float16_constants_raise_no_numpy_warning():
    """A float16 sdpa decoder whose exporter left float32 steps (testdata ``qwen2_sdpa_kv_opset14_fp16``):
    the sentinel search compared its float16 mask constants with 1e30 in float16, and numpy printed an
    overflow warning on the console; now in float64, silently."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        onnxfuse.optimize(load_testdata("qwen2_sdpa_kv_opset14_fp16"), precision="fp16", validate=False)
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in seen]


def test_an_sdpa_decoders_float32_islands_fuse_after_the_conversion():
    """``--precision fp16`` of a float16 sdpa decoder whose exporter left float32 steps (its RMSNorm statistics,
    the attention's V): the conversion writes those Casts as ``Cast(to=float16)`` of float16 tensors;
    cancel-cast-roundtrip removes them (every rule after it sees plain float16 steps), so every RMSNorm becomes SkipSimplifiedLayerNormalization (two per layer) and every layer AttentionInputs,
    as without the flag (a 4-layer Qwen2-0.5B-wide sdpa export: 167 nodes with every norm decomposed,
    now 112, the count without the flag)."""
    from collections import Counter

    result = onnxfuse.optimize(load_testdata("qwen2_sdpa_kv_opset14_fp16"), precision="fp16", samples=2)
    assert result.validation.passed, result.validation
    ops = Counter(op_types_within(result.model))  # DecodeAttention sits in its If's then branch
    assert ops["SkipSimplifiedLayerNormalization"] == 4 and ops["ReduceMean"] == 0, ops
    assert ops["AttentionInputs"] == ops["DecodeAttention"] == 2, ops



def test_a_genai_builder_float32_decoder_converts_to_float16_and_validates():
    # onnxruntime-genai's builder writes SimplifiedLayerNormalization in the ONNX domain (ORT runs it; ONNX's
    # checker has no schema) and value annotations its own Constants contradict: the conversion is judged by
    # what it changes, so neither refuses it any more (it exited 1, "fails ONNX type inference")
    model = load_testdata("qwen2_genai_builder_fp32")
    result = onnxfuse.optimize(model, precision="fp16", provider="cpu", bench=False)
    assert result.validation.passed
    weights = [t for t in result.model.graph.initializer if len(t.dims) == 2 and min(t.dims) > 8]
    assert weights and all(t.data_type == T.FLOAT16 for t in weights)


def test_a_type_error_the_conversion_makes_is_still_refused(monkeypatch):
    # the input passes ONNX's checks and the converted form does not: the conversion's own fault, refused
    convert_graph = precision._Converter.graph

    def broken(self, graph, main):
        convert_graph(self, graph, main)
        if main:
            graph.node.append(h.make_node("Frobnicate", ["x"], ["junk"], name="junk"))

    monkeypatch.setattr(precision._Converter, "graph", broken)
    with pytest.raises(onnxfuse.PrecisionError, match="float16 form of the model fails ONNX type inference"):
        convert_to_fp16(_masked_softmax(-1e4, 1e-5))
