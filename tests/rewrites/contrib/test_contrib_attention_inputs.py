"""contrib-attention-inputs: the Split, rotations, head transposes, cache Concats and repeated heads in
front of a KV-cache decoder's MultiHeadAttention become one ai.onnxfuse AttentionInputs node.

Two levels, each against an independent reference: the op itself (ONNX Runtime's CPU provider running
the library's CPU kernel) against a float64 NumPy model of rotate/concat/repeat, over float32, float16
and bfloat16, halves and pairs rotation, partial rotation, no rotation, with and without the repeated
heads; and the rule on the float16 testdata decoders, whose logits and presents equal the original's
at prefill, decode and a batch of several new tokens over a cache, with a left-padded row."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as h

import onnxfuse
from helpers import float_types, load_testdata
from onnxfuse.custom_ops import DOMAIN, session_options

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "gpu"))
from test_kv_cache_gpu import LAYERS, _assert_equal_at_real_tokens  # noqa: E402  (the same prefill/decode checks, run on the CPU here)

RULE = "contrib-attention-inputs"
B, S, P, H, G, D = 2, 3, 4, 4, 2, 8


#: The op's output forms: the repeated heads too (5 outputs), the presents only (3), and the grouped query
#: with the presents (3, spec grouped=1).
FORMS = ["repeated", "presents", "grouped"]


def _op_model(elem, rotary_dim, interleaved, form, bias=False):
    """One AttentionInputs node; bfloat16 (which numpy cannot hand to ONNX Runtime) between float32 Casts.
    ``bias``: the projection's bias as the last input (spec bias=1)."""
    outputs = 5 if form == "repeated" else 3
    names = ["qkv", "past_key", "past_value"] + (["cos", "sin"] if rotary_dim else []) + (["qkv_bias"] if bias else [])
    shapes = [[B, S, (H + 2 * G) * D], [B, G, P, D], [B, G, P, D]]
    shapes += [[B, S, rotary_dim // 2]] * 2 if rotary_dim else []
    shapes += [[(H + 2 * G) * D]] if bias else []
    outs = ["query", "present_key", "present_value", "key_heads", "value_heads"][:outputs]
    cast = elem == TP.BFLOAT16
    nodes = [h.make_node("Cast", [n], [f"{n}_bf16"], to=TP.BFLOAT16) for n in names] if cast else []
    nodes.append(h.make_node("AttentionInputs", [f"{n}_bf16" for n in names] if cast else names,
                             [f"{o}_bf16" for o in outs] if cast else outs, domain=DOMAIN,
                             spec=f"num_heads={H} kv_num_heads={G} head_size={D} rotary_dim={rotary_dim} "
                                  f"interleaved={interleaved}" + (" grouped=1" if form == "grouped" else "")
                                  + (" bias=1" if bias else "")))
    nodes += [h.make_node("Cast", [f"{o}_bf16"], [o], to=TP.FLOAT) for o in outs] if cast else []
    io = TP.FLOAT if cast else elem
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info(n, io, s) for n, s in zip(names, shapes)],
                         [h.make_tensor_value_info(o, io, None) for o in outs])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)], ir_version=8)


def _in_type(values, elem):
    """float32 values rounded to the element type (to nearest even), as float64."""
    v = np.asarray(values, np.float32)
    if elem == TP.FLOAT16:
        v = v.astype(np.float16)
    elif elem == TP.BFLOAT16:
        u = v.view(np.uint32).astype(np.uint64)
        v = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    return v.astype(np.float64)


def _reference(f, rotary_dim, interleaved, form="repeated", elem=TP.FLOAT):
    x = {k: v.astype(np.float64) for k, v in f.items()}
    if "qkv_bias" in x:  # the projection's Add, in the element type
        x["qkv"] = _in_type(x["qkv"] + x["qkv_bias"], elem)
    q = x["qkv"][..., :H * D].reshape(B, S, H, D)
    k = x["qkv"][..., H * D:(H + G) * D].reshape(B, S, G, D)
    v = x["qkv"][..., (H + G) * D:].reshape(B, S, G, D)

    def rotate(t):
        if not rotary_dim:
            return t
        out, c, s, r = t.copy(), x["cos"][:, :, None, :], x["sin"][:, :, None, :], rotary_dim
        a, b = (t[..., 0:r:2], t[..., 1:r:2]) if interleaved else (t[..., :r // 2], t[..., r // 2:r])
        if interleaved:
            out[..., 0:r:2], out[..., 1:r:2] = a * c - b * s, b * c + a * s
        else:
            out[..., :r // 2], out[..., r // 2:r] = a * c - b * s, b * c + a * s
        return out

    present_k = np.concatenate([x["past_key"], rotate(k).transpose(0, 2, 1, 3)], axis=2)
    present_v = np.concatenate([x["past_value"], v.transpose(0, 2, 1, 3)], axis=2)
    repeat = lambda t: np.repeat(t, H // G, axis=1)  # noqa: E731  (head h reads key/value head h // n)
    if form == "grouped":  # row s·n + j of head g: query head g·n + j at token s
        query = rotate(q).reshape(B, S, G, H // G, D).transpose(0, 1, 3, 2, 4).reshape(B, S * (H // G), G * D)
        return [query, present_k, present_v]
    out = [rotate(q).reshape(B, S, H * D), present_k, present_v, repeat(present_k), repeat(present_v)]
    return out if form == "repeated" else out[:3]


def _types():
    return float_types(1e-6, 2e-3, 2e-2)


def _op_feeds(elem, dtype, rotary_dim, interleaved, form, bias=False):
    """Seeded inputs of :func:`_op_model`, values representable in the element type (fed as float32 where
    it is bfloat16: the model casts)."""
    rng = np.random.default_rng(rotary_dim + 10 * interleaved + 100 * FORMS.index(form))
    shapes = {"qkv": (B, S, (H + 2 * G) * D), "past_key": (B, G, P, D), "past_value": (B, G, P, D)}
    if rotary_dim:
        shapes.update(cos=(B, S, rotary_dim // 2), sin=(B, S, rotary_dim // 2))
    if bias:
        shapes["qkv_bias"] = ((H + 2 * G) * D,)
    feeds = {k: rng.standard_normal(s).astype(np.float32).astype(dtype) for k, s in shapes.items()}
    if elem == TP.BFLOAT16:  # values representable in bfloat16, fed as float32
        return {k: _in_type(v.astype(np.float32), elem).astype(np.float32) for k, v in feeds.items()}
    return feeds


@pytest.mark.parametrize("elem,dtype,tol", _types(), ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("rotary_dim,interleaved", [(D, 0), (D, 1), (6, 0), (0, 0)])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_op_equals_rotate_concat_repeat_in_float64(elem, dtype, tol, rotary_dim, interleaved, form, bias):
    feeds = _op_feeds(elem, dtype, rotary_dim, interleaved, form, bias)
    session = ort.InferenceSession(_op_model(elem, rotary_dim, interleaved, form, bias).SerializeToString(),
                                   session_options(), providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)
    want = _reference(feeds, rotary_dim, interleaved, form, elem)
    assert len(got) == len(want) == (5 if form == "repeated" else 3)
    for name, a, b in zip(["query", "present_key", "present_value", "key_heads", "value_heads"], got, want):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a.astype(np.float64), b, rtol=tol, atol=tol * 4, err_msg=name)
        if name != "query" and (name.startswith("value") or name.endswith("value") or not rotary_dim):
            assert np.array_equal(a.astype(np.float64), b), f"{name} is a copy"  # exact where nothing rotates


def test_a_bad_spec_is_one_clear_error():
    model = _op_model(TP.FLOAT, D, 0, "repeated")
    model.graph.node[0].attribute[0].s = b"num_heads=4 kv_num_heads=3 head_size=8 rotary_dim=8 interleaved=0"
    with pytest.raises(Exception, match="AttentionInputs node.*divisible"):
        ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    grouped = _op_model(TP.FLOAT, D, 0, "repeated")  # grouped takes no repeated heads: 3 outputs only
    grouped.graph.node[0].attribute[0].s += b" grouped=1"
    session = ort.InferenceSession(grouped.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="AttentionInputs node.*and 3 outputs, got 5 and 5"):
        session.run(None, _op_feeds(TP.FLOAT, np.float32, D, 0, "repeated"))


@pytest.mark.parametrize("name", ["qwen2_kv_opset14_fp16", "mistral_kv_opset17_fp16", "llama_kv_dynamo_fp16",
                                  "optimum_llama_kv_fp16", "phi3_kv_opset17_fp16",  # Phi-3: Slices of a fused qkv_proj
                                  "phi3_partial_kv_opset17_fp16"])  # q's partial rotation on [B, H, S, D] heads
def test_decoders_equal_the_original_at_prefill_decode_and_chunks(name):
    model = load_testdata(name)
    result = onnxfuse.optimize(model, samples=2)
    assert result.validation.passed and result.applied.counts[RULE] == LAYERS, result.applied.refusals
    ops = Counter(n.op_type for n in result.model.graph.node)
    assert ops["AttentionInputs"] == LAYERS and ops["RotaryEmbedding"] == ops["Split"] == 0, ops
    if name.startswith("qwen2"):  # q/k/v biases: the op adds the packed bias itself, no Add is left for it
        specs = [a.s for n in result.model.graph.node if n.op_type == "AttentionInputs" for a in n.attribute]
        assert all(b"bias=1" in spec for spec in specs), specs
        assert not any(n.op_type == "Add" and "packed" in n.name for n in result.model.graph.node)
    original = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    fused = ort.InferenceSession(result.model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(13)
    _assert_equal_at_real_tokens(original, fused, ((2, 6, 0), (3, 1, 9), (2, 3, 4)), rng)


def test_not_for_the_cpu_provider_and_refuses_what_it_cannot_read():
    cpu = onnxfuse.optimize(load_testdata("qwen2_kv_opset14_fp16"), validate=False, device="cpu")
    assert RULE not in cpu.rules and "AttentionInputs" not in {n.op_type for n in cpu.model.graph.node}
    qwen3 = onnxfuse.optimize(load_testdata("qwen3_kv_opset17_fp16"), validate=False)
    assert qwen3.applied.counts.get(RULE, 0) == 0  # per-head q/k norms between the projection and the heads
    assert any(r.rule == RULE and "key or value is not Concat" in r.reason for r in qwen3.applied.refusals)
    bert = onnxfuse.optimize(load_testdata("bert_tiny_sdpa_opset14"), validate=False)
    assert bert.applied.counts.get(RULE, 0) == 0
