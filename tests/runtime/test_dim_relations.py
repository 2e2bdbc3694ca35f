"""Validation finds consistent sizes on its own (issue 29, part 2): relations between dynamic dimensions
are read from the graph (a Concat of past and new keys meeting the mask, a lookup of the mask by key
index), sizes are chosen that satisfy them, and a KV-cache decoder is validated at a prefill and a
decode shape without --shape or --inputs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxfuse
from helpers import TESTDATA, run_ort
from onnxfuse.runtime.dim_relations import derive
from onnxfuse.runtime.inputs import input_specs, make_samples

P, S, M, B = "past[2]", "new[2]", "mask[1]", "new[0]"


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    g = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _i64(name, value):
    return numpy_helper.from_array(np.array(value, np.int64), name)


def _concat_meets_mask() -> onnx.ModelProto:
    """scores = q · Concat(past, new)ᵀ, [B, 2, S, P + S], plus the mask [B, 1, 1, M]: M = P + S."""
    nodes = [
        h.make_node("Concat", ["past", "new"], ["keys"], axis=2),
        h.make_node("Transpose", ["keys"], ["kt"], perm=[0, 1, 3, 2]),
        h.make_node("MatMul", ["new", "kt"], ["scores"]),
        h.make_node("Cast", ["mask"], ["maskf"], to=T.FLOAT),
        h.make_node("Unsqueeze", ["maskf", "axes"], ["mask4"]),
        h.make_node("Add", ["scores", "mask4"], ["y"]),
    ]
    return _model(nodes, [h.make_tensor_value_info("past", T.FLOAT, ["batch", 2, "past", 4]),
                          h.make_tensor_value_info("new", T.FLOAT, ["batch", 2, "seq", 4]),
                          h.make_tensor_value_info("mask", T.INT64, ["batch", "total"])],
                  [h.make_tensor_value_info("y", T.FLOAT, None), h.make_tensor_value_info("keys", T.FLOAT, None)],
                  [_i64("axes", [1, 2])])


def _mask_looked_up_by_key_index() -> onnx.ModelProto:
    """transformers' form: key positions ``Range(0, Shape(past)[2] + Shape(ids)[1])`` index the mask's
    columns (a Gather, so a longer mask would run too): M >= P + S, taken tight."""
    nodes = [
        h.make_node("Shape", ["past"], ["sp"]), h.make_node("Gather", ["sp", "two"], ["p"], axis=0),
        h.make_node("Shape", ["ids"], ["si"]), h.make_node("Gather", ["si", "one"], ["s"], axis=0),
        h.make_node("Add", ["p", "s"], ["total"]),
        h.make_node("Range", ["zero", "total", "one"], ["kv"]),
        h.make_node("Gather", ["mask", "kv"], ["picked"], axis=1),
        h.make_node("Concat", ["past", "past"], ["y"], axis=0),
    ]
    return _model(nodes, [h.make_tensor_value_info("ids", T.INT64, ["batch", "seq"]),
                          h.make_tensor_value_info("mask", T.INT64, ["batch", "total"]),
                          h.make_tensor_value_info("past", T.FLOAT, ["batch", 2, "past", 4])],
                  [h.make_tensor_value_info("picked", T.INT64, None), h.make_tensor_value_info("y", T.FLOAT, None)],
                  [_i64("zero", 0), _i64("one", 1), _i64("two", 2)])


def _satisfied(rel, values) -> bool:
    return all(p.evaluate(values) == 0 for p in rel.equalities) and all(p.evaluate(values) >= 0 for p in rel.bounds)


def test_concat_of_past_and_new_ties_the_mask_to_their_sum():
    rel = derive(_concat_meets_mask())
    assert rel is not None and rel.needed
    assert rel.defs[M].render({P: 0, S: 1}) == f"{P} + {S}"
    assert rel.cache == [P]
    values = rel.assign(rel.primary())
    assert values is not None and _satisfied(rel, values)
    assert values[M] == values[P] + values[S] and values[P] != values[S]  # distinct sizes, so a swap shows
    assert values["mask[0]"] == values["past[0]"] == values[B]


def test_drawn_samples_have_the_derived_sizes_and_the_original_runs_on_them():
    model = _concat_meets_mask()
    (sample,) = make_samples(model)
    shapes = sample.shapes()
    assert shapes["mask"][1] == shapes["past"][2] + shapes["new"][2]
    run_ort(model, sample.feeds)  # raises if the sizes were inconsistent
    assert any(n.startswith("dimension relations read from the graph: mask[1] = past[2] + new[2]") for n in sample.notes)
    assert not any("set to 1" in n for n in sample.notes)


def test_a_mask_lookup_by_key_index_is_sized_to_cover_every_key():
    model = _mask_looked_up_by_key_index()
    rel = derive(model)
    assert rel is not None and rel.needed
    assert rel.defs[M].render() == "ids[1] + past[2]" and M in rel.tight
    values = rel.assign(rel.primary())
    assert _satisfied(rel, values) and values[M] == values["ids[1]"] + values["past[2]"]
    (sample,) = make_samples(model)
    run_ort(model, sample.feeds)


def test_a_mask_looked_up_by_gather_nd_is_sized_entry_by_entry():
    """The dynamo exporter's form: ``GatherND(mask, Concat(batch_idx, kv_idx))`` on the last axis, each
    index from a Range: the mask's batch covers the batch, its length every key."""
    nodes = [
        h.make_node("Shape", ["past"], ["sp"]), h.make_node("Gather", ["sp", "two"], ["p"], axis=0),
        h.make_node("Shape", ["ids"], ["si"]), h.make_node("Gather", ["si", "one"], ["s"], axis=0),
        h.make_node("Gather", ["si", "zero"], ["b"], axis=0),
        h.make_node("Add", ["p", "s"], ["total"]),
        h.make_node("Range", ["zero", "b", "one"], ["bi"]), h.make_node("Range", ["zero", "total", "one"], ["kv"]),
        h.make_node("Unsqueeze", ["bi", "ax_b"], ["bi2"]), h.make_node("Unsqueeze", ["kv", "ax_kv"], ["kv2"]),
        h.make_node("Unsqueeze", ["b", "zero1"], ["b1"]), h.make_node("Unsqueeze", ["total", "zero1"], ["t1"]),
        h.make_node("Concat", ["b1", "t1"], ["grid_shape"], axis=0),
        h.make_node("Expand", ["bi2", "grid_shape"], ["bi3"]), h.make_node("Expand", ["kv2", "grid_shape"], ["kv3"]),
        h.make_node("Unsqueeze", ["bi3", "last"], ["bi4"]), h.make_node("Unsqueeze", ["kv3", "last"], ["kv4"]),
        h.make_node("Concat", ["bi4", "kv4"], ["index"], axis=-1),  # [B, T, 2]: (batch, key) pairs
        h.make_node("GatherND", ["mask", "index"], ["picked"]),
        h.make_node("Concat", ["past", "past"], ["y"], axis=0),
    ]
    model = _model(nodes, [h.make_tensor_value_info("ids", T.INT64, ["batch", "seq"]),
                           h.make_tensor_value_info("mask", T.INT64, ["mask_batch", "total"]),
                           h.make_tensor_value_info("past", T.FLOAT, ["batch", 2, "past", 4])],
                   [h.make_tensor_value_info("picked", T.INT64, None), h.make_tensor_value_info("y", T.FLOAT, None)],
                   [_i64("zero", 0), _i64("one", 1), _i64("two", 2), _i64("ax_b", [1]), _i64("ax_kv", [0]),
                    _i64("last", [-1]), _i64("zero1", [0])])
    rel = derive(model)
    assert rel is not None and rel.needed
    assert rel.defs["mask[1]"].render() == "ids[1] + past[2]" and rel.defs["mask[0]"].render() == "ids[0]"
    (sample,) = make_samples(model)
    run_ort(model, sample.feeds)
    assert sample.shapes()["mask"] == [sample.shapes()["ids"][0], sample.shapes()["ids"][1] + sample.shapes()["past"][2]]


def test_optimize_validates_a_tied_model_without_shapes_and_names_the_relation():
    result = onnxfuse.optimize(_concat_meets_mask(), target="onnx")
    assert result.validation.passed
    notes = result.validation.notes
    assert any("mask[1] = past[2] + new[2]" in n for n in notes)
    assert any(n.startswith("prefill (empty cache)") for n in notes)
    assert any(n.startswith("decode (one new token)") for n in notes)


def test_shape_option_fixes_its_sizes_and_the_rest_is_solved_around_them():
    model = _concat_meets_mask()
    (sample,) = make_samples(model, shapes={"new": [2, 2, 6, 4]})
    shapes = sample.shapes()
    assert shapes["new"] == [2, 2, 6, 4]
    assert shapes["past"][0] == 2 and shapes["mask"] == [2, shapes["past"][2] + 6]
    assert shapes["past"][2] == 2  # still a size of its own (it adds up with the new tokens), not 1
    run_ort(model, sample.feeds)


def test_shapes_given_for_every_input_are_kept_as_given():
    model = _concat_meets_mask()
    given = {"past": [1, 2, 4, 4], "new": [1, 2, 3, 4], "mask": [1, 7]}
    (sample,) = make_samples(model, shapes=given)
    assert sample.shapes() == given
    assert not any(n.startswith("sizes that satisfy them") for n in sample.notes)
    wrong = {**given, "mask": [1, 5]}  # the user's sizes win even where they break a relation
    (sample,) = make_samples(model, shapes=wrong)
    assert sample.shapes() == wrong


def test_contradicting_relations_derive_nothing_and_keep_the_default_sizes():
    # x [N] + c [3] and x [N] + d [5]: N would be 3 and 5 at once.
    nodes = [h.make_node("Add", ["x", "c"], ["y"]), h.make_node("Add", ["x", "d"], ["z"])]
    model = _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["N"])],
                   [h.make_tensor_value_info("y", T.FLOAT, None), h.make_tensor_value_info("z", T.FLOAT, None)],
                   [numpy_helper.from_array(np.ones(3, np.float32), "c"), numpy_helper.from_array(np.ones(5, np.float32), "d")])
    assert derive(model) is None
    (sample,) = make_samples(model)
    assert sample.shapes() == {"x": [1]}


def test_a_broadcast_against_a_constant_does_not_change_the_sizes():
    # x [N] + c [3]: N = 3 or N = 1 (broadcast) both run; the model keeps the default 1.
    model = _model([h.make_node("Add", ["x", "c"], ["y"])], [h.make_tensor_value_info("x", T.FLOAT, ["N"])],
                   [h.make_tensor_value_info("y", T.FLOAT, None)], [numpy_helper.from_array(np.ones(3, np.float32), "c")])
    assert not derive(model).needed
    (sample,) = make_samples(model)
    assert sample.shapes() == {"x": [1]}


def test_models_whose_dimensions_all_fit_at_1_keep_their_sizes():
    model = onnx.load(str(TESTDATA / "bert_tiny_opset14.onnx"))
    rel = derive(model)
    assert rel is None or not rel.needed
    (sample,) = make_samples(model)
    assert sample.shapes() == {"input_ids": [1, 1], "attention_mask": [1, 1]}
    assert not any("dimension relations" in n for n in sample.notes)


KV_MODELS = [f"{arch}_kv_opset{opset}{suffix}" for arch in ("llama", "qwen2") for opset in (14, 17)
             for suffix in ("", "_fp16")]


@pytest.mark.parametrize("name", KV_MODELS)
def test_kv_cache_decoders_optimize_and_validate_without_shapes(name):
    result = onnxfuse.optimize(str(TESTDATA / f"{name}.onnx"))
    assert result.validation.passed
    notes = result.validation.notes
    assert any("attention_mask[1] = input_ids[1] + past_key_values.0.key[2]" in n for n in notes)
    prefill = [n for n in notes if n.startswith("prefill (empty cache)")]
    decode = [n for n in notes if n.startswith("decode (one new token)")]
    assert prefill and "past_key_values.0.key[2] 0" in prefill[0]
    assert decode and "input_ids[1] 1" in decode[0]
    assert len(result.validation.outputs) == 5


def test_kv_cache_decoder_through_the_cli(tmp_path):
    from click.testing import CliRunner

    from onnxfuse.cli import main

    out = tmp_path / "out.onnx"
    r = CliRunner().invoke(main, ["optimize", str(TESTDATA / "qwen2_kv_opset17.onnx"), str(out), "--no-bench"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert out.exists() and "dimension relations" in r.output


def test_every_kv_input_is_tied():
    rel = derive(onnx.load(str(TESTDATA / "llama_kv_opset14.onnx")))
    assert rel.untied == []
    assert set(rel.free) == {"input_ids[0]", "input_ids[1]", "past_key_values.0.key[2]"}
    specs = input_specs(onnx.load(str(TESTDATA / "llama_kv_opset14.onnx")))
    shapes = rel.shapes(specs, rel.assign(rel.primary()))
    assert shapes["attention_mask"] == [1, 5] and shapes["past_key_values.1.value"] == [1, 2, 3, 16]


GENAI_MODELS = ["qwen2_genai_builder_fp32", "qwen2_genai_builder_fp16"]


@pytest.mark.parametrize("name", GENAI_MODELS)
def test_genai_builder_model_is_sized_through_group_query_attention(name):
    """onnxruntime-genai's graph has no Concat: GroupQueryAttention appends to the cache and takes the
    mask's length as its total sequence length, and sums the mask into seqlens_k. Sizes are derived
    from the op (T = P + S, the head size 16 for the dynamic ``kv_cache_dim``), the mask is drawn all
    ones, and the original runs on the first size, a second size, a prefill and a decode sample.
    (onnxfuse's loader refuses the model for now, SimplifiedLayerNormalization in the ONNX domain, so the
    samples are run here directly.)"""
    model = onnx.load(str(TESTDATA / f"{name}.onnx"))
    rel = derive(model)
    assert rel.needed and rel.untied == []
    assert rel.defs["attention_mask[1]"].render() == "input_ids[1] + past_key_values.0.key[2]"
    assert rel.defs["past_key_values.0.key[3]"].render() == "16"
    assert rel.cache == ["past_key_values.0.key[2]"]
    samples = make_samples(model, count=2)
    assert all((s.feeds["attention_mask"] == 1).all() for s in samples)
    for sample in samples:
        run_ort(model, sample.feeds)
    from onnxfuse.runtime.inputs import relation_variants

    ran = []
    for how, draws in relation_variants(model, samples[0]):
        for draw in draws:
            try:
                run_ort(model, draw.feeds)
            except Exception:  # noqa: BLE001 - a candidate the kernel refuses; the next one is tried
                continue
            ran.append(how)
            break
    assert ran == ["second size", "prefill", "decode"]


def test_diff_sizes_a_kv_cache_decoder_the_same_way():
    """diff draws from model A's signature through the same make_samples: a float32 decoder against
    its float16 export runs without --shape."""
    report = onnxfuse.diff(str(TESTDATA / "llama_kv_opset14.onnx"), str(TESTDATA / "llama_kv_opset14_fp16.onnx"))
    assert report.passed
    assert any("attention_mask[1] = input_ids[1] + past_key_values.0.key[2]" in n for n in report.notes)


@pytest.mark.parametrize("name", GENAI_MODELS)
def test_genai_builder_model_optimizes_without_shape_options(name):
    """End to end (issue 29's Done-when): a model onnxruntime-genai's builder wrote loads (its
    ONNX-domain SimplifiedLayerNormalization kept as ONNX Runtime reads it), is sized from its
    GroupQueryAttention, and validates at prefill and decode shapes, with no --shape or --inputs."""
    result = onnxfuse.optimize(str(TESTDATA / f"{name}.onnx"), bench=False, target="contrib")
    assert result.validation is not None and result.validation.passed
    notes = " ".join(result.validation.notes)
    assert "prefill" in notes and "decode" in notes and "repaired" in notes
