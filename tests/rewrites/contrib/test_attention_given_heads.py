"""contrib-attention over heads it cannot trace to a projection (Llama, Qwen2, Mistral: rotary embeddings on
q and k after the head split, ``repeat_kv`` on k and v): float16 becomes MultiHeadAttention reading key and
value as the [B, H, L, D] heads the graph has and the query merged back to [B, S, E]; float32 is refused
(measured slower: benchmarks/gqa_attention.py).

References: a float64 NumPy attention written here from the definition, and the original on ONNX Runtime.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper as h
from onnx import numpy_helper

import helpers
import onnxfuse
from contrib_testlib import fuse, ops, refusals
from onnxfuse.rewrites.contrib.contrib_attention import ContribAttention
from test_attention_exports import run_optimized

RULE = ContribAttention()
H, HKV, D = 4, 2, 8
E, EKV = H * D, HKV * D


def _llama_block(dtype=np.float16, rotary=("q", "k"), grouped=True, keep=False, keep_batch="B") -> onnx.ModelProto:
    """x [B, S, E] → q, k, v projections → heads → (rotary on ``rotary``) → (repeat_kv on k and v) →
    softmax(QKᵀ·D^-1/2 + m)·V → [B, S, E]; m [B, 1, S, S] is an input (0 / the dtype's lowest), or with
    ``keep`` made from a bool input as transformers' sdpa mask is: ``Where(keep, 0, finfo.min)``."""
    rng = np.random.default_rng(7)
    elem = h.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits, nodes = [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    kv_heads = HKV if grouped else H
    for p, heads in (("q", H), ("k", kv_heads), ("v", kv_heads)):
        w = (rng.standard_normal((E, heads * D)) / np.sqrt(E)).astype(dtype)
        nodes += [h.make_node("MatMul", ["x", const(f"W{p}", w)], [f"{p}0"]),
                  h.make_node("Reshape", [f"{p}0", const(f"s{p}", np.array([0, 0, heads, D], np.int64))], [f"{p}1"]),
                  h.make_node("Transpose", [f"{p}1"], [f"{p}h"], perm=[0, 2, 1, 3])]
    half = const("half", np.array([D // 2], np.int64))
    for p in rotary:  # x·cos + rotate_half(x)·sin, cos/sin [1, 1, S, D] from the inputs
        nodes += [h.make_node("Slice", [f"{p}h", const(f"{p}_z", np.array([0], np.int64)), half,
                                        const(f"{p}_ax", np.array([3], np.int64))], [f"{p}_lo"]),
                  h.make_node("Slice", [f"{p}h", half, const(f"{p}_end", np.array([D], np.int64)), f"{p}_ax"],
                              [f"{p}_hi"]),
                  h.make_node("Neg", [f"{p}_hi"], [f"{p}_neg"]),
                  h.make_node("Concat", [f"{p}_neg", f"{p}_lo"], [f"{p}_rot"], axis=-1),
                  h.make_node("Mul", [f"{p}h", "cos"], [f"{p}_c"]),
                  h.make_node("Mul", [f"{p}_rot", "sin"], [f"{p}_s"]),
                  h.make_node("Add", [f"{p}_c", f"{p}_s"], [f"{p}r"])]
    q, k, v = ("qr" if "q" in rotary else "qh"), ("kr" if "k" in rotary else "kh"), "vh"
    if grouped:  # repeat_kv: [B, Hkv, L, D] → [B, Hkv, 1, L, D] → [B, Hkv, n, L, D] → [B, H, L, D]
        for p, t in (("k", k), ("v", v)):
            nodes += [h.make_node("Unsqueeze", [t, const(f"{p}_u", np.array([2], np.int64))], [f"{p}_5"]),
                      h.make_node("Expand", [f"{p}_5", const(f"{p}_n", np.array([1, 1, H // HKV, 1, 1], np.int64))],
                                  [f"{p}_x"]),
                      h.make_node("Reshape", [f"{p}_x", const(f"{p}_r", np.array([0, H, -1, D], np.int64))],
                                  [f"{p}_rep"])]
        k, v = "k_rep", "v_rep"
    nodes += [h.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]),
              h.make_node("MatMul", [q, "kt"], ["qk"]),
              h.make_node("Mul", ["qk", const("scale", np.array(D ** -0.5, dtype))], ["scores"]),
              *([h.make_node("Where", ["keep", const("zero", np.array(0, dtype)),
                                           const("lowest", np.array(np.finfo(dtype).min, dtype))], ["m"])]
                if keep else []),
              h.make_node("Add", ["scores", "m"], ["masked"]),
              h.make_node("Softmax", ["masked"], ["p"], axis=-1),
              h.make_node("MatMul", ["p", v], ["ctx"]),
              h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ctx_t", const("merge", np.array([0, 0, E], np.int64))], ["y"])]
    inputs = [h.make_tensor_value_info("x", elem, ["B", "S", E]),
              h.make_tensor_value_info("keep", onnx.TensorProto.BOOL, [keep_batch, 1, "S", "S"]) if keep else
              h.make_tensor_value_info("m", elem, ["B", 1, "S", "S"])]
    if rotary:
        inputs += [h.make_tensor_value_info(n, elem, [1, 1, "S", D]) for n in ("cos", "sin")]
    graph = h.make_graph(nodes, "llama_block", inputs, [h.make_tensor_value_info("y", elem, ["B", "S", E])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


def _feeds(model, batch, seq, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    keep = np.tril(np.ones((seq, seq), bool))[None, None].repeat(batch, 0)
    keep[0, :, :, :2] = False  # left padding: the first two queries of item 0 see no key at all
    angles = np.arange(seq)[:, None] * rng.random(D)[None]
    feeds = {"x": rng.standard_normal((batch, seq, E)).astype(dtype)}
    keep_input = next((i for i in model.graph.input if i.name == "keep"), None)
    if keep_input is not None:  # a keep mask shared by the batch ([1, 1, S, L]) takes item 0's rows
        feeds["keep"] = keep[:1] if keep_input.type.tensor_type.shape.dim[0].dim_value == 1 else keep
    else:
        feeds["m"] = np.where(keep, 0, np.finfo(dtype).min).astype(dtype)
    if any(i.name == "cos" for i in model.graph.input):
        feeds["cos"] = np.cos(angles)[None, None].astype(dtype)
        feeds["sin"] = np.sin(angles)[None, None].astype(dtype)
    return feeds


def _reference(model, feeds, rotary):
    """float64 attention from the model's own weights and the definition (not from any graph)."""
    w = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    x = feeds["x"].astype(np.float64)
    batch, seq, _ = x.shape

    def heads(p):
        y = x @ w[f"W{p}"]
        return y.reshape(batch, seq, -1, D).transpose(0, 2, 1, 3)

    def rotate(t):
        if "cos" not in feeds:
            return t
        rot = np.concatenate([-t[..., D // 2:], t[..., :D // 2]], axis=-1)
        return t * feeds["cos"].astype(np.float64) + rot * feeds["sin"].astype(np.float64)

    q, k, v = heads("q"), heads("k"), heads("v")
    q, k = (rotate(q) if "q" in rotary else q), (rotate(k) if "k" in rotary else k)
    k, v = np.repeat(k, H // k.shape[1], axis=1), np.repeat(v, H // v.shape[1], axis=1)
    mask = feeds["m"].astype(np.float64) if "m" in feeds else np.where(feeds["keep"], 0, np.finfo(np.float32).min)
    s = q @ k.transpose(0, 1, 3, 2) * D ** -0.5 + mask  # finfo(float32).min absorbs s in float64 too
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ v).transpose(0, 2, 1, 3).reshape(batch, seq, E)


@pytest.mark.parametrize("rotary,grouped", [(("q", "k"), True), (("q", "k"), False), ((), True), (("q",), False)])
def test_float16_given_heads_become_multihead_attention(rotary, grouped):
    model = _llama_block(np.float16, rotary, grouped)
    out, report = fuse(model, RULE)
    assert report.counts[RULE.name] == 1, refusals(report, RULE)
    found = ops(out)
    assert found["com.microsoft:MultiHeadAttention"] == 1 and "Softmax" not in found
    detail = next(d for d in report.details if d["rule"] == RULE.name)
    assert detail["kv_layout"] == "BNSH" and detail["scale"] == pytest.approx(D ** -0.5, rel=1e-3)
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    assert len(mha.input) == 6 and not mha.input[3] and not mha.input[4]  # no bias with [B, H, L, D] keys
    for batch, seq in ((2, 6), (1, 1), (3, 9)):
        feeds = _feeds(model, batch, seq)
        want = _reference(model, feeds, rotary)
        original = helpers.run_ort(model, feeds)["y"].astype(np.float64)
        got = helpers.run_ort(out, feeds)["y"].astype(np.float64)
        assert np.abs(original - want).max() < 2e-2  # the float16 graph itself
        assert np.abs(got - want).max() < 2e-2, f"{batch}x{seq}"
        assert np.abs(got - original).max() < 1e-2, f"{batch}x{seq}"


def test_query_split_from_its_projection_stays_a_bsd_query():
    """Grouped keys without rotary: q is cut from its projection, so the op reads that [B, S, E] tensor
    directly (no Transpose is added for it) while key and value are the repeated heads."""
    model = _llama_block(np.float16, rotary=(), grouped=True)
    out, report = fuse(model, RULE)
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    assert mha.input[0] == "q0" and mha.input[1] == "k_rep" and mha.input[2] == "v_rep"
    assert not any(n.op_type == "Transpose" and n.input[0] == "qh" for n in out.graph.node)


def test_float32_given_heads_are_refused_as_measured_slower():
    model = _llama_block(np.float32)
    out, report = fuse(model, RULE)
    assert report.counts[RULE.name] == 0
    assert any("float32 attention over given" in r and "gqa_attention.py" in r for r in refusals(report, RULE)), \
        refusals(report, RULE)
    assert ops(out)["Softmax"] == 1


def test_heads_of_unknown_size_are_refused_with_both_reasons():
    model = _llama_block(np.float16)
    # hide H and D: the value info after the rotary says nothing, and the Reshape of repeat_kv reads -1, -1
    for init in model.graph.initializer:
        if init.name == "k_r":
            init.CopyFrom(numpy_helper.from_array(np.array([0, -1, 0, D], np.int64), "k_r"))
    out, report = fuse(model, RULE)
    reasons = refusals(report, RULE)
    assert report.counts[RULE.name] == 0 and any("as given heads" in r for r in reasons), reasons


def test_tiny_llama_dynamo_export_fp16():
    """testdata/llama_tiny_dynamo_fp16.onnx (export_transformers.py --llama): every Softmax in one
    MultiHeadAttention, validation passes, and the outputs match the original on ONNX Runtime CPU with
    left padding (rows whose first queries see no key) and right padding."""
    model = helpers.load_testdata("llama_tiny_dynamo_fp16")
    assert [n.op_type for n in model.graph.node].count("Softmax") == 2
    result = onnxfuse.optimize(model, provider="cpu", samples=2)
    assert result.validation.passed
    found = [n.op_type for n in result.model.graph.node]
    assert found.count("MultiHeadAttention") == 2 and "Softmax" not in found, result.applied.refusals
    rng = np.random.default_rng(5)
    for batch, seq in ((3, 11), (2, 5), (1, 1)):
        mask = np.ones((batch, seq), np.int64)
        mask[0, : seq // 2] = 0
        mask[-1, seq - 1:] = 0 if seq > 1 else 1
        feeds = {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64), "attention_mask": mask}
        want = helpers.run_ort(model, feeds)["last_hidden_state"].astype(np.float64)
        got = run_optimized(result.model, feeds)[0].astype(np.float64)
        assert np.isfinite(want).all()
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2, err_msg=f"{batch}x{seq}")


def _heads_model(key_batch) -> onnx.ModelProto:
    """softmax(q·kᵀ)·v over heads given as graph inputs, merged to [B, S, E]; k's batch ``key_batch``."""
    f16 = h.np_dtype_to_tensor_dtype(np.dtype(np.float16))
    nodes = [h.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             h.make_node("MatMul", ["q", "kt"], ["s"]),
             h.make_node("Softmax", ["s"], ["p"], axis=-1),
             h.make_node("MatMul", ["p", "v"], ["o"]),
             h.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
             h.make_node("Reshape", ["ot", "merge"], ["y"])]
    inits = [numpy_helper.from_array(np.array([0, 0, E], np.int64), "merge")]
    inputs = [h.make_tensor_value_info("q", f16, ["B", H, "S", D]),
              h.make_tensor_value_info("k", f16, [key_batch, H, "S", D]),
              h.make_tensor_value_info("v", f16, ["B", H, "S", D])]
    graph = h.make_graph(nodes, "heads", inputs, [h.make_tensor_value_info("y", f16, ["B", "S", E])], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=8)


def test_given_heads_of_one_batch_fuse_and_a_broadcast_batch_is_refused():
    """MatMul broadcasts k's batch of 1 against q's B; MultiHeadAttention does not: refused unless q, k and
    v are provably of one batch size."""
    same = _heads_model("B")
    out, report = fuse(same, RULE)
    assert report.counts[RULE.name] == 1, refusals(report, RULE)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((2, H, 5, D)).astype(np.float16) for n in "qkv"}
    np.testing.assert_allclose(helpers.run_ort(out, feeds)["y"].astype(np.float64),
                               helpers.run_ort(same, feeds)["y"].astype(np.float64), atol=1e-2)
    broadcast = _heads_model(1)
    out, report = fuse(broadcast, RULE)
    assert report.counts[RULE.name] == 0
    assert any("not provably of one batch size" in r for r in refusals(report, RULE)), refusals(report, RULE)


@pytest.mark.parametrize("keep_batch", ["B", 1])
def test_precision_fp16_of_a_float32_llama_block_takes_the_keep_mask_raw(keep_batch):
    """``--precision fp16`` of a float32 block whose mask is ``Where(keep, 0, finfo(float32).min)``: the
    conversion keeps that mask and the Softmax in float32 (a float16 fill would not absorb the scores, and
    rows with every key masked would change). The given heads then go to MultiHeadAttention with ``keep``
    as its raw key_padding_mask [B, S, L] and mask_filter_value finfo(float32).min, which its kernel adds
    to float32 scores: rows with every key masked (left padding) average V, as in the float32 original.
    Checked against the float64 reference, those rows included. A mask shared by the batch ([1, 1, S, L])
    is spelled out by Expand to the query's batch first, L read from the key heads' axis 2."""
    model = _llama_block(np.float32, keep=True, keep_batch=keep_batch)
    result = onnxfuse.optimize(model, precision="fp16", provider="cpu", samples=2)
    assert result.validation.passed
    found = [n for n in result.model.graph.node if n.op_type == "MultiHeadAttention"]
    assert len(found) == 1 and "Softmax" not in [n.op_type for n in result.model.graph.node], \
        result.applied.refusals
    (mha,) = found
    assert len(mha.input) == 5 and mha.input[4]
    expands = [n for n in result.model.graph.node if n.op_type == "Expand" and n.input[0] == "keep"]
    assert len(expands) == (1 if keep_batch == 1 else 0)  # a shared mask spelled out to the batch
    assert onnx.helper.get_attribute_value(next(a for a in mha.attribute if a.name == "mask_filter_value")) == \
        pytest.approx(float(np.finfo(np.float32).min))
    for batch, seq in ((2, 6), (3, 9)):
        feeds = _feeds(model, batch, seq, np.float32)
        want = _reference(model, feeds, ("q", "k"))
        got = run_optimized(result.model, feeds)[0].astype(np.float64)
        assert np.abs(helpers.run_ort(model, feeds)["y"] - want).max() < 1e-4  # the reference is the model's
        np.testing.assert_allclose(got[0, :2], want[0, :2], atol=2e-2)  # rows with every key masked
        np.testing.assert_allclose(got, want, atol=3e-2)
