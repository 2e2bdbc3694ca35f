"""fold-weight-upcast: a float16 weight cast up to float32 at run time (torch's half() export with sdpa
attention) is stored in float32, so the pattern rules see a constant weight."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import helpers
import onnxfuse

RULE = "fold-weight-upcast"
K, N = 512, 768  # 768 KiB of float16, 1.5 MiB as float32: over fold-constants' 1 MiB limit


def upcast_linear(shared=False, n=N, to=T.FLOAT):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((K, n)) / np.sqrt(K)).astype(np.float16)
    nodes = [h.make_node("Cast", ["W"], ["W32"], to=to), h.make_node("MatMul", ["x", "W32"], ["y"])]
    elem = T.FLOAT if to == T.FLOAT else T.DOUBLE
    outputs = [helpers.vi("y", ["B", 3, n], elem)]
    if shared:  # the same float16 weight also read as it is
        nodes.append(h.make_node("Gather", ["W", "ids"], ["emb"]))
        outputs.append(helpers.vi("emb", ["B", n], T.FLOAT16))
    inputs = [helpers.vi("x", ["B", 3, K], elem)] + ([helpers.vi("ids", ["B"], T.INT64)] if shared else [])
    return helpers.make_model(nodes, inputs, outputs, [numpy_helper.from_array(w, "W")], opset=17), w


def test_the_weight_is_stored_in_float32_with_the_same_values():
    model, w = upcast_linear()
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 1
    assert helpers.op_types(out) == ["MatMul"]
    (weight,) = [numpy_helper.to_array(i) for i in out.graph.initializer]
    assert weight.dtype == np.float32
    np.testing.assert_array_equal(weight, w.astype(np.float32))  # every value, exactly
    helpers.assert_same_outputs(model, out)


def test_a_large_weight_read_elsewhere_too_is_not_stored_twice():
    model, _ = upcast_linear(shared=True)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 0 and "Cast" in helpers.op_types(out)
    assert any("store it twice" in r.reason for r in report.refusals)


def test_a_small_shared_weight_is_folded():
    model, w = upcast_linear(shared=True, n=8)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 1 and "Cast" not in helpers.op_types(out)
    helpers.assert_same_outputs(model, out)
    # the float16 weight stays for its other reader: the model grows by the whole float32 copy
    assert report.bytes_added() == {RULE: (w.size * 4, 1)}


def test_a_cast_to_another_type_is_left():
    model, _ = upcast_linear(to=T.DOUBLE)
    out, report = helpers.optimize(model, only=[RULE])
    assert report.counts[RULE] == 0 and "Cast" in helpers.op_types(out)
    assert any("not to float32" in r.reason for r in report.refusals)


def test_the_projections_behind_the_casts_fuse_as_in_the_float32_model(monkeypatch):
    """A tiny BERT whose weights are float16 constants cast up (the half() sdpa export's form) fuses into
    the same ops as its float32 twin; without this rule it does not. fold-constants' growth limit is
    lowered to 64 bytes so that it leaves the tiny model's Casts, as it leaves a real model's."""
    import onnxfuse.rewrites.fold.fold_constants as fold_constants  # the module whose limit is lowered

    monkeypatch.setattr(fold_constants, "SIZE_LIMIT", 64)
    model32 = helpers.load_testdata("bert_tiny_sdpa_opset14")
    model16 = _weights_read_through_casts(model32)
    out32 = onnxfuse.optimize(model32, provider="cpu", bench=False)
    out16 = onnxfuse.optimize(model16, provider="cpu", bench=False)  # validated against model16
    assert out16.validation.passed and out16.applied.counts[RULE] > 0
    assert sorted(helpers.op_types(out16.model)) == sorted(helpers.op_types(out32.model))
    without = onnxfuse.optimize(model16, provider="cpu", bench=False, skip=[RULE])
    assert sorted(helpers.op_types(without.model)) != sorted(helpers.op_types(out32.model))


def _weights_read_through_casts(model):
    """A copy whose float32 weights of two or more dimensions are stored in float16 and read through
    ``Cast(to=float)``, as torch's half() export with sdpa attention writes them."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    casts = []
    for init in graph.initializer:
        value = numpy_helper.to_array(init)
        if value.dtype == np.float32 and value.ndim >= 2:
            init.CopyFrom(numpy_helper.from_array(value.astype(np.float16), init.name + "_f16"))
            casts.append(h.make_node("Cast", [init.name], [init.name[:-4]], to=T.FLOAT))
    nodes = casts + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    return copy


def test_the_user_is_told_the_file_grows_and_how_to_keep_it_small():
    """A 2 MB float16 weight stored in float32 adds its 2 MB: optimize says so in a note, with the --skip
    that avoids it; a model that grows by less than 1 MiB gets no such note."""
    model, w = upcast_linear(n=2048)
    result = onnxfuse.optimize(model, provider="cpu", bench=False)
    assert result.applied.bytes_added() == {RULE: (w.nbytes, 1)}
    want = (f"the output stores more weight bytes than the input: {RULE} {w.nbytes / 1e6:.1f} MB (1 tensor); "
            f"--skip {RULE} keeps the file smaller")
    assert want in result.validation.notes, result.validation.notes
    small, _ = upcast_linear(n=8)
    assert not any("more weight bytes" in n for n in onnxfuse.optimize(small, provider="cpu", bench=False).validation.notes)
