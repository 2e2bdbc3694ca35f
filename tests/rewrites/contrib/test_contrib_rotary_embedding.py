"""contrib-rotary-embedding: transformers' apply_rotary_pos_emb → ONNX RotaryEmbedding (opset 23), checked
against a float64 numpy reference of the decomposed formula on ONNX Runtime's CPU provider, with
arbitrary (not contiguous) position ids; and the refusals that keep it exact."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from contrib_testlib import fuse, ops, parse, refusals

import helpers
from onnxfuse.rewrites.contrib.contrib_rotary_embedding import ContribRotaryEmbedding

ROPE = ContribRotaryEmbedding()
B, H, S, D = 2, 3, 5, 8
INV_FREQ = (1.0 / (10000.0 ** (np.arange(0, D, 2) / D))).astype(np.float32)


def rope_model(opset=17, dtype="float", second="f", scale=None, cos_batch="B", slice_end=None, neg_first=True,
               half_caches=False):
    """x [B, H, S, D] rotated by cos/sin of positions [cos_batch, S]; ``second``: the Concat's second
    operand (``g`` makes the halves differ); ``scale``: a scalar on cos and sin (attention_scaling);
    ``half_caches`` (float32 x): the caches rounded to float16, Unsqueezed, then cast up to float32 (optimum's
    float16 Gemma export in its float32 layers)."""
    half = D // 2
    end = slice_end if slice_end is not None else 9223372036854775807
    cast = "" if dtype == "float" else "c = Cast <to = 10> (cf)\ns = Cast <to = 10> (sf)"
    cos_out, sin_out = ("cf", "sf") if dtype == "float" else ("c", "s")
    scaled = (f"k = Constant <value = float {{{scale}}}> ()\ncf = Mul(cr, k)\nsf = Mul(sr, k)" if scale is not None
              else "cf = Identity(cr)\nsf = Identity(sr)")
    rot = ("rh = Concat <axis = -1> (nx2, x1)" if neg_first else "rh = Concat <axis = -1> (x1, nx2)")
    unsqueezed = (f"cu = Unsqueeze({cos_out}, ax1)\n        su = Unsqueeze({sin_out}, ax1)" if not half_caches else
                  "ch = Cast <to = 10> (cf)\n        sh = Cast <to = 10> (sf)\n        cuh = Unsqueeze(ch, ax1)\n"
                  "        suh = Unsqueeze(sh, ax1)\n        cu = Cast <to = 1> (cuh)\n        su = Cast <to = 1> (suh)")
    body = f"""
        p1 = Unsqueeze(pos, ax2)
        pf = Cast <to = 1> (p1)
        f = Mul(pf, inv_freq)
        g = Mul(f, two)
        emb = Concat <axis = -1> (f, {second})
        cr = Cos(emb)
        sr = Sin(emb)
        {scaled}
        {cast}
        {unsqueezed}
        xc = Mul(x, cu)
        x1 = Slice(x, zero, h, last)
        x2 = Slice(x, h, end, last)
        nx2 = Neg(x2)
        {rot}
        rs = Mul(rh, su)
        y = Add(xc, rs)
    """
    model = parse(f"g ({dtype}[B,{H},S,{D}] x, int64[{cos_batch},S] pos) => ({dtype}[B,{H},S,{D}] y) {{\n{body}\n}}",
                  opset=opset, inits={"inv_freq": INV_FREQ, "two": np.array(2.0, np.float32),
                                      "ax1": np.array([1], np.int64), "ax2": np.array([2], np.int64),
                                      "zero": np.array([0], np.int64), "h": np.array([half], np.int64),
                                      "end": np.array([end], np.int64), "last": np.array([-1], np.int64)})
    return model


def reference(x, pos, scale=1.0):
    """transformers' formula in float64: x·cos + rotate_half(x)·sin, cos = cos(Concat(f, f))·scale."""
    f = pos[..., None].astype(np.float64) * INV_FREQ.astype(np.float64)
    emb = np.concatenate([f, f], axis=-1)
    cos, sin = (np.cos(emb) * scale)[:, None], (np.sin(emb) * scale)[:, None]
    x = x.astype(np.float64)
    rot = np.concatenate([-x[..., D // 2:], x[..., :D // 2]], axis=-1)
    return x * cos + rot * sin


def feeds(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((B, H, S, D)).astype(dtype),
            "pos": rng.integers(0, 4096, size=(B, S)).astype(np.int64)}  # any positions, not 0..S-1


@pytest.mark.parametrize("opset", [17, 23])
@pytest.mark.parametrize("scale", [None, 0.75], ids=["plain", "attention-scaling"])
def test_rotary_becomes_rotary_embedding_and_matches_the_formula(opset, scale):
    m = rope_model(opset=opset, scale=scale)
    out, report = fuse(m, ROPE)
    assert report.counts[ROPE.name] == 1, refusals(report)
    assert ops(out)["RotaryEmbedding"] == 1 and "Neg" not in ops(out) and "Concat" in ops(out), ops(out)
    assert {o.domain: o.version for o in out.opset_import}[""] == 23
    onnx.checker.check_model(out, full_check=True)
    f = feeds()
    got = helpers.run_ort(out, f)["y"]
    np.testing.assert_allclose(got, reference(f["x"], f["pos"], scale or 1.0), rtol=2e-5, atol=2e-5)


def test_rotary_float16():
    m = rope_model(dtype="float16")
    out, report = fuse(m, ROPE)
    assert report.counts[ROPE.name] == 1, refusals(report)
    f = feeds(np.float16)
    want = reference(f["x"], f["pos"])
    got = helpers.run_ort(out, f)["y"].astype(np.float64)
    before = helpers.run_ort(m, f)["y"].astype(np.float64)
    # float16 rounding of cos/sin and of x: both models are as far from float64 as each other
    assert np.max(np.abs(got - want)) <= 2 * np.max(np.abs(before - want)) + 1e-3


def test_rotary_with_float16_caches_cast_up_casts_the_halves():
    """x float32, the caches float16 cast up after their Unsqueeze: RotaryEmbedding takes the float16
    halves cast to float32 (a Cast is per element: the values the pattern multiplied by), so it equals the
    original to float32 rounding, and the formula within the caches' float16 rounding."""
    m = rope_model(half_caches=True)
    out, report = fuse(m, ROPE)
    assert report.counts[ROPE.name] == 1, refusals(report)
    rotary = next(n for n in out.graph.node if n.op_type == "RotaryEmbedding")
    casts = {n.output[0]: n for n in out.graph.node if n.op_type == "Cast"}
    assert all(casts[t].attribute[0].i == onnx.TensorProto.FLOAT for t in rotary.input[1:]), rotary.input
    f = feeds()
    got = helpers.run_ort(out, f)["y"]
    np.testing.assert_allclose(got, helpers.run_ort(m, f)["y"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, reference(f["x"], f["pos"]), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("variant, reason", [
    (dict(second="g"), "halves may differ"),
    (dict(cos_batch="C"), "not provably x's"),
    (dict(slice_end=D // 2 + 2), "no operand is rotate_half"),
    (dict(neg_first=False), "no operand is rotate_half"),
], ids=["halves-differ", "other-batch-cache", "partial-second-half", "unnegated-order"])
def test_rotary_refusals_keep_the_graph(variant, reason):
    m = rope_model(**variant)
    out, report = fuse(m, ROPE)
    assert report.counts[ROPE.name] == 0
    assert any(reason in r for r in refusals(report, ROPE)), refusals(report, ROPE)
    assert "RotaryEmbedding" not in ops(out)


def test_rotary_with_caches_of_batch_one_expands_them_to_x_batch():
    """optimum's Gemma export computes its positions as [1, S]: cos and sin broadcast over x's batch. The
    rewrite spells them out with Expand (the batch read from the graph input that declares x's batch name)
    before RotaryEmbedding, which takes [B, S, D/2] caches; the result equals the formula at batch 3."""
    m = rope_model(cos_batch="1")
    out, report = fuse(m, ROPE)
    assert report.counts[ROPE.name] == 1, refusals(report)
    found = ops(out)
    assert found["RotaryEmbedding"] == 1 and found["Expand"] == 2 and "Neg" not in found, found
    expand = next(n for n in out.graph.node if n.op_type == "Expand")
    shape = next(n for n in out.graph.node if n.op_type == "Shape")
    assert shape.input[0] == "x" and expand.input[0] in ("cr", "sr")  # x declares the batch B; cos, sin (Identity gone)
    rng = np.random.default_rng(4)
    x, pos = rng.standard_normal((3, H, S, D)).astype(np.float32), rng.integers(0, 4096, (1, S)).astype(np.int64)
    got = helpers.run_ort(out, {"x": x, "pos": pos})["y"]
    np.testing.assert_allclose(got, reference(x, pos), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, helpers.run_ort(m, {"x": x, "pos": pos})["y"], rtol=1e-6, atol=1e-6)


def test_rotary_refused_when_a_piece_is_read_elsewhere():
    m = rope_model()
    m.graph.output.append(onnx.helper.make_tensor_value_info("nx2", onnx.TensorProto.FLOAT, None))
    out, report = fuse(m, ROPE)
    assert report.counts[ROPE.name] == 0
    assert any("graph output" in r for r in refusals(report, ROPE)), refusals(report, ROPE)


def merged_model():
    """q as Llama's attention cuts it (src [B, S, H·D] → [B, H, S, D]), rotated, merged back to [B, S, H·D]
    as contrib-attention's MultiHeadAttention query reads it."""
    m = rope_model()
    g = m.graph
    x_input = g.input[0]
    g.input.remove(x_input)
    g.input.insert(0, onnx.helper.make_tensor_value_info("src", onnx.TensorProto.FLOAT, ["B", "S", H * D]))
    g.initializer.extend([onnx.numpy_helper.from_array(np.array([0, 0, H, D], np.int64), "split_t"),
                          onnx.numpy_helper.from_array(np.array([0, 0, H * D], np.int64), "merge_t")])
    head = [onnx.helper.make_node("Reshape", ["src", "split_t"], ["xs"]),
            onnx.helper.make_node("Transpose", ["xs"], ["x"], perm=[0, 2, 1, 3])]
    tail = [onnx.helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]),
            onnx.helper.make_node("Reshape", ["yt", "merge_t"], ["out"])]
    nodes = head + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    del g.output[:]
    g.output.append(onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["B", "S", H * D]))
    onnx.checker.check_model(m)
    return m


def test_rotary_of_split_heads_merged_back_takes_the_3d_form():
    m = merged_model()
    out, report = fuse(m, ROPE)
    assert report.counts[ROPE.name] == 1, refusals(report)
    assert "Transpose" not in ops(out) and "Reshape" not in ops(out), ops(out)
    node = next(n for n in out.graph.node if n.op_type == "RotaryEmbedding")
    assert node.input[0] == "src" and onnx.helper.get_attribute_value(node.attribute[0]) == H
    f = feeds()
    src = f.pop("x").transpose(0, 2, 1, 3).reshape(B, S, H * D)
    want = reference(src.reshape(B, S, H, D).transpose(0, 2, 1, 3), f["pos"]).transpose(0, 2, 1, 3).reshape(B, S, -1)
    np.testing.assert_allclose(helpers.run_ort(out, {"src": src, **f})["out"], want, rtol=2e-5, atol=2e-5)


# --- partial rotation: rotary_embedding_dim -----------------------------------------------------------------

FULL = D + 6  # the head size; the first D dimensions are rotated, the last 6 passed through


def partial_model(tail_first=False):
    """Phi-3 / GPT-NeoX's partial rotary: ``Concat(rope(src[..., :D]), src[..., D:])`` on src [B, H, S, FULL];
    ``tail_first``: the pass-through half first (not the op's layout)."""
    half = D // 2
    joined = "out = Concat <axis = -1> (tail, y)" if tail_first else "out = Concat <axis = -1> (y, tail)"
    body = f"""
        x = Slice(src, zero, rot, last)
        tail = Slice(src, rot, end, last)
        p1 = Unsqueeze(pos, ax2)
        pf = Cast <to = 1> (p1)
        f = Mul(pf, inv_freq)
        emb = Concat <axis = -1> (f, f)
        cr = Cos(emb)
        sr = Sin(emb)
        cu = Unsqueeze(cr, ax1)
        su = Unsqueeze(sr, ax1)
        xc = Mul(x, cu)
        x1 = Slice(x, zero, h, last)
        x2 = Slice(x, h, end, last)
        nx2 = Neg(x2)
        rh = Concat <axis = -1> (nx2, x1)
        rs = Mul(rh, su)
        y = Add(xc, rs)
        {joined}
    """
    return parse(f"g (float[B,{H},S,{FULL}] src, int64[B,S] pos) => (float[B,{H},S,{FULL}] out) {{\n{body}\n}}",
                 opset=17, inits={"inv_freq": INV_FREQ, "ax1": np.array([1], np.int64),
                                  "ax2": np.array([2], np.int64), "zero": np.array([0], np.int64),
                                  "h": np.array([half], np.int64), "rot": np.array([D], np.int64),
                                  "end": np.array([9223372036854775807], np.int64),
                                  "last": np.array([-1], np.int64)})


def partial_feeds(seed=0):
    rng = np.random.default_rng(seed)
    return {"src": rng.standard_normal((B, H, S, FULL)).astype(np.float32),
            "pos": rng.integers(0, 4096, size=(B, S)).astype(np.int64)}


def test_partial_rotary_takes_the_whole_head_with_rotary_embedding_dim():
    out, report = fuse(partial_model(), ROPE)
    assert report.counts[ROPE.name] == 1, refusals(report)
    assert ops(out)["RotaryEmbedding"] == 1 and ops(out)["Slice"] == 2 and "Concat" in ops(out), ops(out)
    node = next(n for n in out.graph.node if n.op_type == "RotaryEmbedding")
    assert node.input[0] == "src" and node.output[0] == "out"
    assert {a.name: a.i for a in node.attribute} == {"rotary_embedding_dim": D}
    onnx.checker.check_model(out, full_check=True)
    f = partial_feeds()
    got = helpers.run_ort(out, f)["out"]
    want = np.concatenate([reference(f["src"][..., :D], f["pos"]), f["src"][..., D:].astype(np.float64)], axis=-1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got[..., D:], f["src"][..., D:])  # passed through bitwise


def test_partial_rotary_with_another_layout_rotates_the_slice_only():
    # the pass-through half first: not RotaryEmbedding's layout. The sliced x is rotated as a full rotation
    # of a D-wide tensor; the Slices and the Concat stay.
    out, report = fuse(partial_model(tail_first=True), ROPE)
    assert report.counts[ROPE.name] == 1, refusals(report)
    node = next(n for n in out.graph.node if n.op_type == "RotaryEmbedding")
    assert node.input[0] == "x" and not node.attribute
    f = partial_feeds(1)
    want = np.concatenate([f["src"][..., D:].astype(np.float64), reference(f["src"][..., :D], f["pos"])], axis=-1)
    np.testing.assert_allclose(helpers.run_ort(out, f)["out"], want, rtol=1e-4, atol=1e-4)
