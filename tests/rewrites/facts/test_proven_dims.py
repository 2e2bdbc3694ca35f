"""Dimensions ONNX shape inference leaves invented that onnxfuse proves (rewrites/facts/proven_dims.py).

Each proof is checked against ONNX Runtime: the proved shape must be the shape the model really
computes, at several run-time sizes (an independent reference for the reasoning)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from helpers import run_ort
from onnxfuse import model_io
from onnxfuse.rewrites.facts.proven_dims import Clamped, broadcast_dims, prove_dims

M, H = 8, 4  # the buffers' length (max positions) and the hidden size


def _model(nodes, inputs, outputs, inits=(), opset=17):
    graph = h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info(o, T.FLOAT if o.startswith("f") else T.INT64, None)
                                             for o in outputs], list(inits))
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _proved(model) -> dict[str, list]:
    graph = model_io.to_graph(model_io.infer_shapes(model))
    prove_dims(graph)
    return {name: list(t.shape) if t.shape is not None else None for name, t in graph.tensors().items()}


def embeddings_model(target_from="ids", limit=M):
    """BERT's embeddings with a dynamic sequence: positions ``P[0:S]`` sliced from an arange buffer of
    ``limit`` entries, token types ``Expand(GatherElements(zeros, positions), [B, S])``, words
    ``Gather(W, ids)``, summed. ``target_from``: the tensor whose Shape gives the Expand's target."""
    i64 = lambda name, v: numpy_helper.from_array(np.asarray(v, np.int64), name)  # noqa: E731
    f32 = lambda name, v: numpy_helper.from_array(np.asarray(v, np.float32), name)  # noqa: E731
    rng = np.random.default_rng(0)
    inits = [i64("buffer", np.arange(limit)[None, :]), i64("zeros", np.zeros((1, limit))), i64("zero", 0),
             i64("one", 1), i64("axis0", [0]), i64("axis1", [1]), i64("start", [0]), i64("step", [1]),
             f32("words", rng.standard_normal((20, H))), f32("positions", rng.standard_normal((limit, H))),
             f32("types", rng.standard_normal((2, H)))]
    nodes = [h.make_node("Shape", ["ids"], ["ids_shape"]),
             h.make_node("Gather", ["ids_shape", "one"], ["s"], axis=0),
             h.make_node("Unsqueeze", ["s", "axis0"], ["s1"]),
             h.make_node("Slice", ["buffer", "start", "s1", "axis1", "step"], ["pos_ids"]),
             h.make_node("GatherElements", ["zeros", "pos_ids"], ["type_row"], axis=1),
             h.make_node("Shape", [target_from], ["target_shape"]),
             h.make_node("Gather", ["target_shape", "zero"], ["b"], axis=0),
             h.make_node("Gather", ["target_shape", "one"], ["t"], axis=0),
             h.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
             h.make_node("Unsqueeze", ["t", "axis0"], ["t1"]),
             h.make_node("Concat", ["b1", "t1"], ["bs"], axis=0),
             h.make_node("Expand", ["type_row", "bs"], ["type_ids"]),
             h.make_node("Gather", ["words", "ids"], ["f_words"], axis=0),
             h.make_node("Gather", ["types", "type_ids"], ["f_types"], axis=0),
             h.make_node("Gather", ["positions", "pos_ids"], ["f_positions"], axis=0),
             h.make_node("Add", ["f_words", "f_types"], ["f_sum"]),
             h.make_node("Add", ["f_sum", "f_positions"], ["f_embeddings"])]
    inputs = [h.make_tensor_value_info("ids", T.INT64, ["batch", "sequence"]),
              h.make_tensor_value_info("other", T.INT64, ["rows", "cols"])]
    return _model(nodes, inputs, ["type_ids", "f_embeddings", "pos_ids"], inits)


def _feeds(batch, seq, other=(2, 3)):
    rng = np.random.default_rng(batch * 100 + seq)
    return {"ids": rng.integers(0, 20, (batch, seq)).astype(np.int64), "other": np.zeros(other, np.int64)}


def test_the_token_type_and_embedding_sums_get_the_ids_batch_and_sequence():
    model = embeddings_model()
    plain = model_io.infer_shapes(model)
    onnx_dims = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
                 for vi in list(plain.graph.value_info) + list(plain.graph.output)}
    assert not {"batch", "sequence"} & set(onnx_dims["type_ids"])  # what ONNX alone gives: invented names
    shapes = _proved(model)
    assert shapes["type_ids"] == ["batch", "sequence"]
    assert shapes["f_sum"] == ["batch", "sequence", H]
    assert shapes["f_embeddings"] == ["batch", "sequence", H]  # min(S, 8) met S: S whenever it runs
    assert shapes["pos_ids"][0] == 1 and str(shapes["pos_ids"][1]).startswith("unk__")  # min(S, 8): no name
    for batch, seq in [(1, 1), (3, 5), (2, M)]:  # the claim against what ONNX Runtime computes
        got = run_ort(model, _feeds(batch, seq))
        assert got["type_ids"].shape == (batch, seq) and got["f_embeddings"].shape == (batch, seq, H)


def test_a_sequence_longer_than_the_buffer_makes_the_original_fail():
    # The proof holds "whenever the model runs": past the buffer, min(S, 8) != S and the Add fails.
    with pytest.raises(Exception):
        run_ort(embeddings_model(), _feeds(1, M + 1))


def test_a_target_read_from_another_input_proves_nothing():
    # Expand(row [1, min(S, 8)], [rows, cols]): cols is not S, and either could be 1 at run time.
    shapes = _proved(embeddings_model(target_from="other"))
    assert "cols" not in shapes["type_ids"] and "sequence" not in shapes["type_ids"]
    assert shapes["type_ids"][0] == "rows"  # the row of 1 broadcast to the target's rows: that is proved


def reshape_model(target):
    inits = [numpy_helper.from_array(np.asarray(target, np.int64), "target")]
    nodes = [h.make_node("Reshape", ["x", "target"], ["merged"]), h.make_node("Relu", ["merged"], ["f_out"])]
    return _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["batch", "sequence", 4, 16])], ["f_out"], inits)


def test_a_head_merge_reshape_keeps_the_sequence():
    shapes = _proved(reshape_model([0, -1, 64]))
    assert shapes["merged"] == ["batch", "sequence", 64] and shapes["f_out"] == ["batch", "sequence", 64]
    x = np.zeros((2, 5, 4, 16), np.float32)
    assert run_ort(reshape_model([0, -1, 64]), {"x": x})["f_out"].shape == (2, 5, 64)


@pytest.mark.parametrize("target", [[0, -1, 48], [-1, 64], [0, -1, 32]])
def test_a_reshape_whose_quotient_is_not_one_name_is_left_alone(target):
    # S·64/48 is not a name; [-1, 64] is B·S (a product); [0, -1, 32] is 2·S
    shapes = _proved(reshape_model(target))
    assert "sequence" not in shapes["merged"]


def test_a_range_over_a_proved_dimension_gets_it():
    # Range(0, Gather(Shape(Reshape(x, [0, -1, 64])), 1)): the length is known once the Reshape is proved.
    inits = [numpy_helper.from_array(np.asarray([0, -1, 64], np.int64), "target"),
             numpy_helper.from_array(np.asarray(1, np.int64), "one"), numpy_helper.from_array(np.asarray(0, np.int64), "zero")]
    nodes = [h.make_node("Reshape", ["x", "target"], ["merged"]),
             h.make_node("Shape", ["merged"], ["shape"]),
             h.make_node("Gather", ["shape", "one"], ["n"], axis=0),
             h.make_node("Range", ["zero", "n", "one"], ["rows"])]
    model = _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["batch", "sequence", 4, 16])], ["rows"], inits)
    assert _proved(model)["rows"] == ["sequence"]
    assert run_ort(model, {"x": np.zeros((2, 5, 4, 16), np.float32)})["rows"].shape == (5,)


@pytest.mark.parametrize("a, b, want", [
    ([Clamped("s", 8)], ["s"], ["s"]),       # min(s, 8) ⊕ s = s
    (["s"], [Clamped("s", 8)], ["s"]),
    ([Clamped("s", 8)], [1], [Clamped("s", 8)]),
    ([Clamped("s", 8)], ["t"], [None]),      # another name: unknown
    (["a"], ["b"], [None]),                  # either may be 1
    ([3], ["a"], [3]),                       # a must be 3 or 1
    ([3], [4], None),                        # never broadcasts
    (["b", 1, "s"], [4, 1], ["b", 4, "s"]),  # right-aligned
])
def test_broadcast_rules(a, b, want):
    assert broadcast_dims(a, b) == want


def test_a_renamed_symbol_reaches_every_tensor_that_shared_it():
    # Gather(types, type_ids) shares the Expand's invented symbols in ONNX's inference; renaming them
    # names the lookup too, without inferring again.
    graph = model_io.to_graph(model_io.infer_shapes(embeddings_model()))
    before = list(graph.tensors()["f_types"].shape)
    assert all(isinstance(d, str) and d.startswith("unk__") for d in before[:2])
    assert prove_dims(graph) >= 2
    assert list(graph.tensors()["f_types"].shape) == ["batch", "sequence", H]
    assert isinstance(graph, gs.Graph)


def test_a_refresh_gives_a_proved_name_to_every_tensor_that_shares_its_new_symbol():
    # values = TopK(x, k) has a length ONNX cannot know; say a proof named it ``sequence`` (a name the
    # model declares). Inferring again invents one symbol for values and Relu(values) alike: both must
    # come out ``sequence``, not the kept name on one and the new symbol on the other.
    from onnxfuse.rewrites.facts.shapes import refresh_shapes

    nodes = [h.make_node("TopK", ["x", "k"], ["values", "indices"], axis=1),
             h.make_node("Relu", ["values"], ["f_relu"])]
    inputs = [h.make_tensor_value_info("x", T.FLOAT, ["batch", 8]), h.make_tensor_value_info("k", T.INT64, [1]),
              h.make_tensor_value_info("y", T.FLOAT, ["batch", "sequence"])]
    graph = model_io.to_graph(model_io.infer_shapes(_model(nodes, inputs, ["f_relu"])))
    tensors = graph.tensors()
    assert str(tensors["f_relu"].shape[1]).startswith("unk__")
    tensors["values"].shape = ["batch", "sequence"]
    refresh_shapes(graph)
    assert list(tensors["values"].shape) == ["batch", "sequence"]
    assert list(tensors["f_relu"].shape) == ["batch", "sequence"]


def _random_chain(rng) -> tuple:
    """A random chain over x [batch, sequence, 4] of the steps proven_dims reasons about: slices of a
    fixed buffer to a size read from Shape, Expands to targets from Shape, broadcasting Adds, Reshapes
    with 0 and -1 and Ranges. Returns (model, names of the tensors to check)."""
    i64 = lambda name, v: numpy_helper.from_array(np.asarray(v, np.int64), name)  # noqa: E731
    inits = [i64("zero", 0), i64("one", 1), i64("axis0", [0]), i64("axis1", [1]), i64("start", [0]),
             i64("step", [1]), numpy_helper.from_array(rng.standard_normal((1, 6, 4)).astype(np.float32), "buf6"),
             numpy_helper.from_array(rng.standard_normal((1, 1, 4)).astype(np.float32), "buf1"),
             i64("merge", [0, -1, 4]), i64("flat", [0, -1])]
    nodes = [h.make_node("Shape", ["x"], ["xs"]), h.make_node("Gather", ["xs", "zero"], ["b"], axis=0),
             h.make_node("Gather", ["xs", "one"], ["s"], axis=0), h.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
             h.make_node("Unsqueeze", ["s", "axis0"], ["s1"])]
    tensors, checked = ["x"], []
    for k in range(int(rng.integers(3, 7))):
        a = tensors[int(rng.integers(len(tensors)))]
        out = f"t{k}"
        step = rng.choice(["slice", "expand", "add", "reshape", "range"])
        if step == "slice":
            buf = rng.choice(["buf6", "buf1"])
            nodes.append(h.make_node("Slice", [buf, "start", "s1", "axis1", "step"], [out]))
        elif step == "expand":
            nodes += [h.make_node("Concat", ["b1", "s1", f"c{k}"], [f"shape{k}"], axis=0),
                      h.make_node("Expand", [a, f"shape{k}"], [out])]
            inits.append(i64(f"c{k}", [4]))
        elif step == "add":
            other = tensors[int(rng.integers(len(tensors)))]
            nodes.append(h.make_node("Add", [a, other], [out]))
        elif step == "reshape":
            nodes += [h.make_node("Reshape", [a, "merge"], [f"m{k}"]), h.make_node("Reshape", [f"m{k}", "flat"], [out])]
        else:
            nodes += [h.make_node("Range", ["zero", "s", "one"], [f"r{k}"]),
                      h.make_node("Cast", [f"r{k}"], [f"rf{k}"], to=T.FLOAT)]
            out = f"rf{k}"
        tensors.append(out)
        checked.append(out)
    outputs = [h.make_tensor_value_info(t, T.FLOAT, None) for t in checked]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, ["batch", "sequence", 4])], outputs, inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    return model, checked


@pytest.mark.parametrize("seed", range(40))
def test_every_proved_dimension_is_the_one_onnx_runtime_computes(seed):
    """Soundness, on random chains: wherever a proof names a dimension (``batch``, ``sequence``) or a
    size, ONNX Runtime's output has exactly that, at every size tried where the model runs."""
    rng = np.random.default_rng(seed)
    model, checked = _random_chain(rng)
    graph = model_io.to_graph(model_io.infer_shapes(model))
    prove_dims(graph)
    proved = {name: graph.tensors()[name].shape for name in checked}
    for batch, seq in [(1, 1), (2, 3), (3, 6), (2, 7)]:
        try:
            got = run_ort(model, {"x": np.zeros((batch, seq, 4), np.float32)})
        except Exception:  # the original fails at this size (a broadcast of min(S, 6) against S > 6)
            continue
        values = {"batch": batch, "sequence": seq}
        for name in checked:
            shape = proved[name]
            if shape is None:
                continue
            assert len(shape) == got[name].ndim, (seed, name, shape)
            for d, actual in zip(shape, got[name].shape):
                if isinstance(d, int) or d in values:
                    assert (d if isinstance(d, int) else values[d]) == actual, (seed, name, shape, got[name].shape)


def tensordot_model(tail):
    """tf2onnx's ``Tensordot`` at opset 11: ``Reshape(MatMul(Reshape(x, [B·S, 4]), W), target)`` with the
    target ``Concat(Gather(Cast(Shape(x), int32), [0, 1]), [8])`` cast back to int64, which ONNX inference
    gives no rank; then ``tail`` (nodes reading ``dense``, the last one writing ``f_out``)."""
    inits = [numpy_helper.from_array(np.asarray([0, 1], np.int64), "free"),
             numpy_helper.from_array(np.asarray([8], np.int32), "h32"),
             numpy_helper.from_array(np.asarray([-1, 4], np.int64), "flat_t"),
             numpy_helper.from_array(np.ones((4, 8), np.float32), "w"),
             numpy_helper.from_array(np.ones((8, 8), np.float32), "w2")]
    nodes = [h.make_node("Shape", ["x"], ["shp"]), h.make_node("Cast", ["shp"], ["shp32"], to=T.INT32),
             h.make_node("Gather", ["shp32", "free"], ["lead"], axis=0),
             h.make_node("Concat", ["lead", "h32"], ["tgt32"], axis=0),
             h.make_node("Cast", ["tgt32"], ["tgt"], to=T.INT64),
             h.make_node("Reshape", ["x", "flat_t"], ["flat"]), h.make_node("MatMul", ["flat", "w"], ["mm"]),
             h.make_node("Reshape", ["mm", "tgt"], ["dense"]), *tail]
    return _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, ["batch", "sequence", 4])], ["f_out"], inits,
                  opset=11)


def test_a_computed_target_with_no_0_or_minus_1_is_the_reshapes_shape():
    model = tensordot_model([h.make_node("Softmax", ["dense"], ["soft"], axis=-1),
                             h.make_node("ReduceMean", ["soft"], ["mean"], axes=[2], keepdims=1),
                             h.make_node("ReduceSum", ["soft"], ["f_out"], axes=[-1], keepdims=0)])
    shapes = _proved(model)
    assert shapes["dense"] == ["batch", "sequence", 8] and shapes["soft"] == ["batch", "sequence", 8]
    assert shapes["mean"] == ["batch", "sequence", 1] and shapes["f_out"] == ["batch", "sequence"]
    assert run_ort(model, {"x": np.zeros((2, 5, 4), np.float32)})["f_out"].shape == (2, 5)


def test_gather_carries_a_proved_shape():
    inits = [numpy_helper.from_array(np.asarray([0], np.int64), "col0")]
    model = tensordot_model([h.make_node("Gather", ["dense", "col0"], ["picked"], axis=2),
                             h.make_node("Relu", ["picked"], ["f_out"])])
    model.graph.initializer.extend(inits)
    shapes = _proved(model)
    assert shapes["picked"] == ["batch", "sequence", 1] and shapes["f_out"] == ["batch", "sequence", 1]
    assert run_ort(model, {"x": np.zeros((2, 5, 4), np.float32)})["f_out"].shape == (2, 5, 1)


def test_gemm_carries_a_proved_shape():
    # A = Reshape(y, [rows, 4]) from y's own Shape through int32 Casts: no rank for ONNX inference
    inits = [numpy_helper.from_array(np.asarray([0], np.int64), "first"),
             numpy_helper.from_array(np.asarray([4], np.int32), "h32"),
             numpy_helper.from_array(np.ones((8, 4), np.float32), "w")]
    nodes = [h.make_node("Shape", ["y"], ["shp"]), h.make_node("Cast", ["shp"], ["shp32"], to=T.INT32),
             h.make_node("Gather", ["shp32", "first"], ["lead"], axis=0),
             h.make_node("Concat", ["lead", "h32"], ["tgt32"], axis=0),
             h.make_node("Cast", ["tgt32"], ["tgt"], to=T.INT64),
             h.make_node("Reshape", ["y", "tgt"], ["a"]), h.make_node("Gemm", ["a", "w"], ["f_out"], transB=1)]
    model = _model(nodes, [h.make_tensor_value_info("y", T.FLOAT, ["rows", 4])], ["f_out"], inits, opset=11)
    assert _proved(model)["f_out"] == ["rows", 8]
    assert run_ort(model, {"y": np.zeros((3, 4), np.float32)})["f_out"].shape == (3, 8)


def offset_range_model(start_from="past"):
    """GPT-2's position ids with a KV cache: ``Range(P, P + S, 1)``, P the past length and S the new one."""
    inits = [numpy_helper.from_array(np.asarray(2, np.int64), "two"), numpy_helper.from_array(np.asarray(1, np.int64), "one"),
             numpy_helper.from_array(np.asarray(3, np.int64), "three")]
    nodes = [h.make_node("Shape", ["past"], ["ps"]), h.make_node("Gather", ["ps", "two"], ["p"], axis=0),
             h.make_node("Shape", ["ids"], ["is"]), h.make_node("Gather", ["is", "one"], ["s"], axis=0),
             h.make_node("Shape", [start_from], ["ss"]),
             h.make_node("Gather", ["ss", "two" if start_from == "past" else "three"], ["start"], axis=0),
             h.make_node("Add", ["p", "s"], ["limit"]), h.make_node("Range", ["start", "limit", "one"], ["rows"])]
    inputs = [h.make_tensor_value_info("past", T.FLOAT, ["batch", 2, "past_len", 4]),
              h.make_tensor_value_info("other", T.FLOAT, ["batch", 2, 4, "other_len"]),
              h.make_tensor_value_info("ids", T.INT64, ["batch", "sequence"])]
    return _model(nodes, inputs, ["rows"], inits)


def test_a_range_from_the_past_length_to_past_plus_sequence_has_the_sequence_length():
    model = offset_range_model()
    assert _proved(model)["rows"] == ["sequence"]
    feeds = {"past": np.zeros((2, 2, 3, 4), np.float32), "other": np.zeros((2, 2, 4, 6), np.float32),
             "ids": np.zeros((2, 5), np.int64)}
    assert run_ort(model, feeds)["rows"].shape == (5,)


def test_a_range_from_another_start_is_left_alone():
    # Range(O, P + S, 1) has P + S − O elements: not a name
    assert "sequence" not in (_proved(offset_range_model(start_from="other"))["rows"] or [])


def test_tiled_positions_take_the_batch_of_the_repeats():
    """transformers' Whisper decoder: ``positions = Tile(Unsqueeze(Range(0, S)), [B, 1])`` with B and S read
    from ``Shape(ids)``, added to the token embeddings ``Gather(W, ids)``: the Tile's output is [B, S], so
    the sum keeps ``batch`` and ``sequence`` (inference invents the Tile's batch); ``ConstantOfShape`` of the
    same shape too. Checked against ONNX Runtime's shapes at several sizes."""
    i64 = lambda name, v: numpy_helper.from_array(np.asarray(v, np.int64), name)  # noqa: E731
    inits = [i64("zero", 0), i64("one", 1), i64("axis0", [0]), i64("ones", [1]),
             numpy_helper.from_array(np.random.default_rng(0).standard_normal((20, H)).astype(np.float32), "words")]
    nodes = [h.make_node("Shape", ["ids"], ["shape"]),
             h.make_node("Gather", ["shape", "zero"], ["b"], axis=0),
             h.make_node("Gather", ["shape", "one"], ["s"], axis=0),
             h.make_node("Range", ["zero", "s", "one"], ["arange"]),
             h.make_node("Unsqueeze", ["arange", "axis0"], ["row"]),
             h.make_node("Unsqueeze", ["b", "axis0"], ["b1"]),
             h.make_node("Concat", ["b1", "ones"], ["repeats"], axis=0),
             h.make_node("Tile", ["row", "repeats"], ["positions"]),
             h.make_node("Cast", ["positions"], ["f_positions"], to=T.FLOAT),
             h.make_node("Unsqueeze", ["f_positions", "minus1"], ["f_pos3"]),
             h.make_node("Gather", ["words", "ids"], ["f_words"], axis=0),
             h.make_node("Add", ["f_words", "f_pos3"], ["f_sum"]),
             h.make_node("ConstantOfShape", ["shape"], ["filled"])]
    inits.append(i64("minus1", [-1]))
    model = _model(nodes, [h.make_tensor_value_info("ids", T.INT64, ["batch", "sequence"])],
                   ["positions", "f_sum", "filled"], inits)
    proved = _proved(model)
    assert proved["positions"] == ["batch", "sequence"], proved["positions"]
    assert proved["f_sum"] == ["batch", "sequence", H], proved["f_sum"]
    assert proved["filled"] == ["batch", "sequence"], proved["filled"]
    for b, s in ((1, 3), (2, 5), (4, 1)):
        got = run_ort(model, {"ids": np.zeros((b, s), np.int64)})
        assert got["positions"].shape == (b, s) and got["f_sum"].shape == (b, s, H) and got["filled"].shape == (b, s)
