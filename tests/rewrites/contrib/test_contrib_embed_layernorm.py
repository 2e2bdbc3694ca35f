"""contrib-embed-layernorm: BERT-style embeddings, LayerNorm(Gather(words) + Gather(token types) +
Gather(positions)), become one com.microsoft EmbedLayerNormalization with the original's outputs
(ONNX Runtime CPU, the original model as the reference), and the refusals name their reason."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import helpers
from helpers import run_ort
from onnxfuse.pipeline import rewrite_model
from onnxfuse.rewrites import select_rules

RULE = "contrib-embed-layernorm"
B, S, H, V, P = 3, 7, 16, 50, 20


def embeddings_model(token_types="input", positions="arange", dtype=np.float32, extra_reader=False,
                     seq=S) -> onnx.ModelProto:
    """``LayerNorm(W[ids] + T[tt] + P[pos])`` as torch exports BERT's embeddings (LayerNormalization at
    opset 17). ``token_types``: "input" (a [B, S] input), "zeros" (a constant 0 per token, broadcast by
    ``Where(c, k, k)`` as expand-by-broadcast writes it) or None. ``positions``: "arange" or "offset"
    (RoBERTa's padding_idx + 1 + s) constants, or "input" (a run-time [B, S] index: not a position table)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((V, H)).astype(dtype), "W"),
             numpy_helper.from_array(rng.standard_normal((P, H)).astype(dtype), "Pt"),
             numpy_helper.from_array(rng.standard_normal((2, H)).astype(dtype), "Tt"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(H)).astype(dtype), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(H)).astype(dtype), "beta")]
    inputs = [helpers.vi("ids", ["B", seq], T.INT64)]
    nodes = [h.make_node("Gather", ["W", "ids"], ["words"])]
    total = "words"
    if token_types == "input":
        inputs.append(helpers.vi("tt", ["B", seq], T.INT64))
        nodes.append(h.make_node("Gather", ["Tt", "tt"], ["types"]))
    elif token_types == "zeros":
        inits.append(numpy_helper.from_array(np.zeros((1, seq), np.int64), "tt_buffer"))
        nodes += [h.make_node("Equal", ["ids", "ids"], ["carrier"]),
                  h.make_node("Where", ["carrier", "tt_buffer", "tt_buffer"], ["tt"]),
                  h.make_node("Gather", ["Tt", "tt"], ["types"])]
    if token_types:
        nodes.append(h.make_node("Add", [total, "types"], ["with_types"]))
        total = "with_types"
    if positions == "input":
        inputs.append(helpers.vi("pos", ["B", seq], T.INT64))
    elif positions == "folded":  # the lookup already folded to its rows (the float16 export's positions)
        table = numpy_helper.to_array(inits[1])
        inits.append(numpy_helper.from_array(table[None, :seq], "positions"))
    else:
        start = 0 if positions == "arange" else 2
        inits.append(numpy_helper.from_array(np.arange(start, start + seq, dtype=np.int64)[None], "pos"))
    if positions != "folded":
        nodes.append(h.make_node("Gather", ["Pt", "pos"], ["positions"]))
    nodes += [h.make_node("Add", [total, "positions"], ["summed"]),
              h.make_node("LayerNormalization", ["summed", "gamma", "beta"], ["out"], axis=-1, epsilon=1e-12)]
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    outputs = [helpers.vi("out", ["B", seq, H], elem)]
    if extra_reader:
        outputs.append(helpers.vi("summed", ["B", seq, H], elem))
    model = helpers.make_model(nodes, inputs, outputs, inits, opset=17)
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model)  # the rule proves [B, S, H]; optimize infers first too


def feeds(model, seed=1):
    rng = np.random.default_rng(seed)
    out = {"ids": rng.integers(0, V, (B, S)).astype(np.int64)}
    names = {i.name for i in model.graph.input}
    if "tt" in names:
        out["tt"] = rng.integers(0, 2, (B, S)).astype(np.int64)
    if "pos" in names:
        out["pos"] = rng.integers(0, P, (B, S)).astype(np.int64)
    return out


@pytest.mark.parametrize("token_types,positions", [("input", "arange"), ("zeros", "arange"),
                                                   (None, "offset"), ("zeros", "offset")])
def test_embeddings_become_one_embed_layernorm_with_the_same_outputs(token_types, positions):
    model = embeddings_model(token_types, positions)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = helpers.op_types(out)
    assert ops.count("EmbedLayerNormalization") == 1 and not {"Gather", "Add", "LayerNormalization"} & set(ops)
    (node,) = [n for n in out.graph.node if n.op_type == "EmbedLayerNormalization"]
    assert (node.input[1] != "") == (token_types == "input")  # segment_ids only for run-time token types
    for seed in (1, 2):
        f = feeds(model, seed)
        want, got = run_ort(model, f)["out"], run_ort(out, f)["out"]
        # the sums are reassociated (constant rows added first): float32 rounding only
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # ... which that tolerance tells from a wrong position table (positions off by two)
        other = embeddings_model(token_types, "offset" if positions == "arange" else "arange")
        assert np.max(np.abs(run_ort(other, f)["out"] - got)) > 1e-2


@pytest.mark.parametrize("positions", ["arange", "folded"])
def test_float16_embeddings_become_one_float16_embed_layernorm(positions):
    """The float16 export's embeddings (its position lookup folded to rows): one float16 op. ONNX Runtime's
    CPU runs it through float32 Casts, so the difference from the original is float16 rounding (the
    original rounds each sum to float16 and its LayerNorm output); the tolerance, a few float16 ulps of
    values near 1, still tells a wrong position table apart."""
    model = embeddings_model("zeros", positions, dtype=np.float16)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    (node,) = [n for n in out.graph.node if n.op_type == "EmbedLayerNormalization"]
    tables = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    assert all(tables[name].dtype == np.float16 for name in node.input[2:] if name in tables)
    assert "Gather" not in helpers.op_types(out) and "LayerNormalization" not in helpers.op_types(out)
    f = feeds(model, 3)
    want, got = run_ort(model, f)["out"], run_ort(out, f)["out"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)
    other = embeddings_model("zeros", "offset", dtype=np.float16)
    assert np.max(np.abs(run_ort(other, f)["out"].astype(np.float32) - got.astype(np.float32))) > 0.1


def _shifted(model, offset, scale=1.0):
    """The model with every embedding table replaced by ``table * scale + offset``."""
    for init in model.graph.initializer:
        if init.name in ("W", "Pt", "Tt"):
            table = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array((table * scale + offset).astype(table.dtype), init.name))
    return model


@pytest.mark.parametrize("offset,scale", [(8.0, 1.0), (0.0, 0.0)])
def test_float16_rows_the_half_statistics_would_lose_are_refused(offset, scale):
    """Rows swamped by their mean (every entry near 24, spread 1.7) or constant (variance 0, and BERT's
    epsilon is 0 in float16): ONNX Runtime's CUDA kernel sums E[x²] and the mean in float16, where the
    variance drowns or turns negative; the original normalizes in float32. float32 tables still fuse."""
    model = _shifted(embeddings_model("zeros", "arange", dtype=np.float16), offset, scale)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 0
    assert any("sums its statistics in float16" in r.reason for r in report.refusals if r.rule == RULE), \
        report.refusals
    out32, report32 = helpers.optimize(_shifted(embeddings_model("zeros", "arange"), offset, scale), only=[RULE])
    assert report32.counts[RULE] == 1


def test_refusals_carry_their_reason():
    cases = {
        "float64": (embeddings_model(dtype=np.float64), "element type"),
        "read elsewhere": (embeddings_model(extra_reader=True), "read elsewhere"),
        "run-time positions": (embeddings_model("input", "input"), "run-time lookups"),
    }
    for name, (model, reason) in cases.items():
        out, report = rewrite_model(model, select_rules("cuda", only=[RULE]))
        assert report.counts[RULE] == 0, name
        assert any(reason in r.reason for r in report.refusals if r.rule == RULE), (name, report.refusals)
        assert "EmbedLayerNormalization" not in helpers.op_types(out)


def dynamic_embeddings_model(seq_from="ids", buffer=P, token_types=True) -> onnx.ModelProto:
    """BERT's embeddings as transformers exports them with a dynamic sequence axis: positions
    ``P[0:S]`` sliced from an arange buffer of ``buffer`` entries; token types ``Expand(GatherElements(
    zeros, positions), [B, S])`` (``token_types``); S read by ``Shape`` from ``seq_from``: "ids", "words"
    (DistilBERT: the looked-up words, whose Shape is then read too) or "other" (another input)."""
    rng = np.random.default_rng(0)
    i64 = lambda name, v: numpy_helper.from_array(np.asarray(v, np.int64), name)  # noqa: E731
    inits = [numpy_helper.from_array(rng.standard_normal((V, H)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((P, H)).astype(np.float32), "Pt"),
             numpy_helper.from_array(rng.standard_normal((2, H)).astype(np.float32), "Tt"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(H)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(H)).astype(np.float32), "beta"),
             i64("arange", np.arange(buffer)[None]), i64("zeros", np.zeros((1, buffer))), i64("zero", 0),
             i64("one", 1), i64("axis0", [0]), i64("axis1", [1]), i64("start", [0]), i64("step", [1])]
    inputs = [helpers.vi("ids", ["B", "S"], T.INT64), helpers.vi("other", ["B", "S2"], T.INT64)]
    nodes = [h.make_node("Gather", ["W", "ids"], ["words"]),
             h.make_node("Shape", ["ids"], ["ids_shape"]),
             h.make_node("Shape", [seq_from], ["seq_shape"]),
             h.make_node("Gather", ["ids_shape", "zero"], ["b"], axis=0),
             h.make_node("Gather", ["seq_shape", "one"], ["s"], axis=0),
             h.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
             h.make_node("Unsqueeze", ["s", "axis0"], ["s1"]),
             h.make_node("Slice", ["arange", "start", "s1", "axis1", "step"], ["pos"]),
             h.make_node("Gather", ["Pt", "pos"], ["positions"])]
    total = "words"
    if token_types:
        nodes += [h.make_node("GatherElements", ["zeros", "pos"], ["tt_row"], axis=1),
                  h.make_node("Concat", ["b1", "s1"], ["bs"], axis=0),
                  h.make_node("Expand", ["tt_row", "bs"], ["tt"]),
                  h.make_node("Gather", ["Tt", "tt"], ["types"]),
                  h.make_node("Add", ["words", "types"], ["with_types"])]
        total = "with_types"
    nodes += [h.make_node("Add", [total, "positions"], ["summed"]),
              h.make_node("LayerNormalization", ["summed", "gamma", "beta"], ["out"], axis=-1, epsilon=1e-12)]
    model = helpers.make_model(nodes, inputs, [helpers.vi("out", ["B", "S", H], T.FLOAT)], inits, opset=17)
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("seq_from,token_types", [("ids", True), ("words", False), ("words", True)])
def test_a_dynamic_sequence_becomes_one_embed_layernorm_with_the_same_outputs(seq_from, token_types):
    model = dynamic_embeddings_model(seq_from, token_types=token_types)
    out, report = rewrite_model(model, select_rules("cuda", only=[RULE]))  # infers and proves shapes first
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = helpers.op_types(out)
    assert ops.count("EmbedLayerNormalization") == 1 and not {"Slice", "Add", "LayerNormalization"} & set(ops)
    (node,) = [n for n in out.graph.node if n.op_type == "EmbedLayerNormalization"]
    assert node.input[1] == ""  # the token types are one constant row, folded into the position table
    rng = np.random.default_rng(5)
    for batch, seq in [(1, 1), (3, 5), (2, P)]:  # every length the original accepts, the buffer's too
        f = {"ids": rng.integers(0, V, (batch, seq)).astype(np.int64), "other": np.zeros((1, 2), np.int64)}
        want, got = run_ort(model, f)["out"], run_ort(out, f)["out"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_dynamic_sequence_refuses_what_it_cannot_prove():
    cases = {
        # the Slice ends at another input's length: P[0:S2] need not be the ids' positions, and the sum is
        # not provably [B, S, H] (S against min(S2, 20)), so the words' index is not proved to be its [B, S]
        "other length": (dynamic_embeddings_model("other"), "run-time index is not an integer tensor"),
        # a one-entry buffer: P[0:1] broadcasts row 0 to every token (a uniform index, like the token
        # types), and with S dynamic there is no position lookup left to size the op's table from
        "one-row buffer": (dynamic_embeddings_model(buffer=1), "not exactly one position lookup"),
    }
    for name, (model, reason) in cases.items():
        out, report = rewrite_model(model, select_rules("cuda", only=[RULE]))
        assert report.counts[RULE] == 0, name
        assert any(reason in r.reason for r in report.refusals if r.rule == RULE), (name, report.refusals)


def reference64(model, f, positions=None, segment=True, bias=None, eps=1e-12):
    """The embeddings' LayerNorm in float64 from the model's own tables: ``LN(W[ids] + P[pos] (+ Tt[tt]) (+
    bias))`` with pos = s (or ``positions``) and biased variance, γ and β as given."""
    tables = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    ids = f["ids"]
    pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape) if positions is None else positions
    x = tables["W"][ids] + tables["Pt"][pos]
    if segment:
        x = x + tables["Tt"][f["tt"]]
    if bias is not None:
        x = x + bias
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * tables["gamma"] + tables["beta"]


def test_the_whole_pipeline_fuses_embeddings_that_contrib_skip_layernorm_took_first():
    """contrib-skip-layernorm runs first and makes the embeddings' last Add and LayerNorm one
    SkipLayerNormalization; contrib-embed-layernorm takes that op (its input and skip are the Add tree's
    two halves): the same value, compared with a float64 reference (float32 rounding only)."""
    model = embeddings_model("input", "arange")
    out, report = rewrite_model(model, select_rules("contrib"))
    assert report.counts["contrib-skip-layernorm"] == 1 and report.counts[RULE] == 1, report.refusals
    ops = helpers.op_types(out)
    assert ops.count("EmbedLayerNormalization") == 1 and not {"Gather", "Add", "SkipLayerNormalization"} & set(ops)
    for seed in (1, 2):
        f = feeds(model, seed)
        want = reference64(model, f)
        np.testing.assert_allclose(run_ort(model, f)["out"], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(run_ort(out, f)["out"], want, rtol=1e-5, atol=1e-5)


def skip_embeddings_model(bias=True, read_sum=False, epsilon=None) -> onnx.ModelProto:
    """``SkipLayerNormalization(W[ids] + Tt[tt], P[arange(S)], γ, β, bias)`` (com.microsoft, as
    contrib-skip-layernorm writes it, or ORT-T's own output): ``read_sum`` makes the fourth output, the
    sum, a graph output; ``epsilon`` None leaves the op's default (1e-12)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((V, H)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((P, H)).astype(np.float32), "Pt"),
             numpy_helper.from_array(rng.standard_normal((2, H)).astype(np.float32), "Tt"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(H)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(H)).astype(np.float32), "beta"),
             numpy_helper.from_array(rng.standard_normal(H).astype(np.float32), "bias"),
             numpy_helper.from_array(np.arange(S, dtype=np.int64)[None], "pos")]
    inputs = [helpers.vi("ids", ["B", S], T.INT64), helpers.vi("tt", ["B", S], T.INT64)]
    attrs = {} if epsilon is None else {"epsilon": epsilon}
    nodes = [h.make_node("Gather", ["W", "ids"], ["words"]), h.make_node("Gather", ["Tt", "tt"], ["types"]),
             h.make_node("Gather", ["Pt", "pos"], ["positions"]),
             h.make_node("Add", ["words", "types"], ["with_types"]),
             h.make_node("SkipLayerNormalization", ["with_types", "positions", "gamma", "beta"] + (["bias"] if bias else []),
                         ["out", "", "", "sum"] if read_sum else ["out"], domain="com.microsoft", **attrs)]
    outputs = [helpers.vi("out", ["B", S, H])] + ([helpers.vi("sum", ["B", S, H])] if read_sum else [])
    model = helpers.make_model(nodes, inputs, outputs, inits, opset=17)
    model.opset_import.append(h.make_opsetid("com.microsoft", 1))
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("bias,epsilon", [(True, None), (False, 1e-5)])
def test_a_skip_layernorm_of_lookups_becomes_one_embed_layernorm(bias, epsilon):
    """Its bias is one more constant row (folded into the position table), its epsilon (the op's
    default 1e-12 when absent) carried over; float64 reference."""
    model = skip_embeddings_model(bias=bias, epsilon=epsilon)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    (node,) = [n for n in out.graph.node if n.op_type == "EmbedLayerNormalization"]
    assert h.get_attribute_value(node.attribute[0]) == pytest.approx(epsilon or 1e-12)
    assert helpers.op_types(out) == ["Cast", "Cast", "EmbedLayerNormalization"]
    b = numpy_helper.to_array([i for i in model.graph.initializer if i.name == "bias"][0]).astype(np.float64)
    for seed in (1, 2):
        f = feeds(model, seed)
        want = reference64(model, f, bias=b if bias else None, eps=epsilon or 1e-12)
        np.testing.assert_allclose(run_ort(model, f)["out"], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(run_ort(out, f)["out"], want, rtol=1e-5, atol=1e-5)
        if bias:  # the tolerance tells the bias's absence apart
            assert np.max(np.abs(reference64(model, f) - want)) > 1e-2


def test_a_skip_layernorm_whose_sum_is_read_is_refused():
    """The op's embedding_sum is W + P + Tt without the bias' place fixed by the original's fourth output
    (and ORT's CPU kernel does not write it for every input form): refused, not rewritten."""
    model = skip_embeddings_model(read_sum=True)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 0
    assert any("sum is read" in r.reason for r in report.refusals if r.rule == RULE), report.refusals
    assert "EmbedLayerNormalization" not in helpers.op_types(out)


def range_positions_model(start=0, length_from="ids", mask=False) -> onnx.ModelProto:
    """ORT's embed_layer_norm_format8: ids [-1, -1] (exporters' -1: no size to shape inference), positions
    ``Expand(Unsqueeze(Range(start, Shape(length_from)[1], 1), 0), Shape(ids))`` built at run time, no
    token types; ``mask``: an attention-mask ``ReduceSum(Cast(mask, int32), axis 1)`` beside it, a
    graph output (what the op's mask_index output would replace only for a 0/1 mask)."""
    rng = np.random.default_rng(0)
    i64 = lambda name, v: numpy_helper.from_array(np.asarray(v, np.int64), name)  # noqa: E731
    inits = [numpy_helper.from_array(rng.standard_normal((V, H)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((P, H)).astype(np.float32), "Pt"),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(H)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(H)).astype(np.float32), "beta"),
             i64("start", start), i64("delta", 1), i64("one", 1), i64("axes0", [0]), i64("axes1", [1])]
    inputs = [h.make_tensor_value_info("ids", T.INT64, [-1, -1]),
              h.make_tensor_value_info("other", T.INT64, [-1, -1])]
    nodes = [h.make_node("Gather", ["W", "ids"], ["words"]),
             h.make_node("Shape", ["ids"], ["ids_shape"]),
             h.make_node("Shape", [length_from], ["len_shape"]),
             h.make_node("Gather", ["len_shape", "one"], ["s"]),
             h.make_node("Range", ["start", "s", "delta"], ["arange"]),
             h.make_node("Unsqueeze", ["arange", "axes0"], ["arange1"]),
             h.make_node("Expand", ["arange1", "ids_shape"], ["pos"]),
             h.make_node("Gather", ["Pt", "pos"], ["positions"]),
             h.make_node("Add", ["words", "positions"], ["summed"]),
             h.make_node("LayerNormalization", ["summed", "gamma", "beta"], ["out"], axis=-1, epsilon=1e-12)]
    outputs = [h.make_tensor_value_info("out", T.FLOAT, [-1, -1, H])]
    if mask:
        inputs.append(h.make_tensor_value_info("mask", T.INT64, [-1, -1]))
        nodes += [h.make_node("Cast", ["mask"], ["mask32"], to=T.INT32),
                  h.make_node("ReduceSum", ["mask32", "axes1"], ["mask_index"], keepdims=0)]
        outputs.append(h.make_tensor_value_info("mask_index", T.INT32, [-1]))
    model = helpers.make_model(nodes, inputs, outputs, inits, opset=17)
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("mask", [False, True])
def test_run_time_arange_positions_become_one_embed_layernorm(mask):
    """The positions arange(S) of the ids' own S, broadcast to the ids' [B, S]: the tree is [B, S, H] by
    the lookups' shapes alone (shape inference knows no size of a -1 dimension), position s reads row s.
    The attention-mask ReduceSum stays as it is (the op's mask_index counts the 1s on CPU and gives the
    last nonzero position + 1 on CUDA: equal to the sum only for a 0/1, right-padded mask, which a run-time
    int64 input does not promise). float64 reference at several sizes."""
    model = range_positions_model(mask=mask)
    out, report = rewrite_model(model, select_rules("cuda", only=[RULE]))
    assert report.counts[RULE] == 1, [r.reason for r in report.refusals]
    ops = helpers.op_types(out)
    assert ops.count("EmbedLayerNormalization") == 1 and not {"Range", "Expand", "Gather", "LayerNormalization"} & set(ops)
    (node,) = [n for n in out.graph.node if n.op_type == "EmbedLayerNormalization"]
    assert len(node.input) == 7  # no mask input: the mask_index output is not used
    assert ("ReduceSum" in ops) == mask
    rng = np.random.default_rng(7)
    for batch, seq in [(1, 1), (3, 5), (2, P)]:
        f = {"ids": rng.integers(0, V, (batch, seq)).astype(np.int64), "other": np.zeros((1, 2), np.int64)}
        if mask:
            f["mask"] = rng.integers(0, 3, (batch, seq)).astype(np.int64)  # not 0/1: the sum is not a count
        want = reference64(model, f, segment=False)
        got = run_ort(out, f)
        np.testing.assert_allclose(run_ort(model, f)["out"], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["out"], want, rtol=1e-5, atol=1e-5)
        if mask:
            np.testing.assert_array_equal(got["mask_index"], f["mask"].sum(1))


def test_run_time_positions_that_are_not_the_ids_arange_are_refused():
    cases = {
        # positions 1..S: not the op's s (the kernel reads row s without position_ids)
        "offset": (range_positions_model(start=1), "run-time index is not an integer tensor"),
        # arange of another input's length: need not be S (Expand broadcasts a length-1 arange), unproved
        "other length": (range_positions_model(length_from="other"), "run-time index is not an integer tensor"),
    }
    for name, (model, reason) in cases.items():
        out, report = rewrite_model(model, select_rules("cuda", only=[RULE]))
        assert report.counts[RULE] == 0, name
        assert any(reason in r.reason for r in report.refusals if r.rule == RULE), (name, report.refusals)
        assert "EmbedLayerNormalization" not in helpers.op_types(out)
