"""contrib-attention's raw mask_index on the CUDA kernels: a key padding mask with holes and left padding
(not only right padding) gives the original's outputs. A kernel that read the raw mask as sequence
lengths (as ONNX Runtime's 1-D mask_index is) would differ here. Also: float16 masked_fill with
finfo(float16).min as a raw mask with the float32 fill, and float32 self-attention over 256 keys or more
with its raw mask of ones (which keeps ONNX Runtime on its unfused kernel)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import helpers
from onnxfuse.runtime.session import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]

H, D = 4, 32
E = H * D


def heads(seq: int, dtype):
    """The q, k, v projections of x split into heads (qh, kh as Kᵀ, vh), as transformers exports them, and
    a ``const(name, value)`` that adds initializers to the returned list."""
    rng = np.random.default_rng(seq)
    inits = []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    nodes = []
    for p in "qkv":
        nodes += [h.make_node("MatMul", ["x", const(f"W{p}", (rng.standard_normal((E, E)) / np.sqrt(E)).astype(dtype))], [f"{p}0"]),
                  h.make_node("Add", [f"{p}0", const(f"b{p}", (rng.standard_normal(E) * 0.1).astype(dtype))], [f"{p}1"]),
                  h.make_node("Reshape", [f"{p}1", const(f"s{p}", np.array([0, 0, H, D], np.int64))], [f"{p}2"]),
                  h.make_node("Transpose", [f"{p}2"], [f"{p}h"], perm=[0, 2, 3, 1] if p == "k" else [0, 2, 1, 3])]
    return nodes, inits, const


def layer(seq: int, form: str = "bias") -> onnx.ModelProto:
    """One self-attention layer as transformers 5 exports it, its mask ``Where(keep, 0, finfo.min)``
    (``form`` "bias"); "fill16": in float16, DistilBERT's ``masked_fill``, ``Where(keep, s, finfo(float16).min)``;
    "none": no mask (and no ``keep`` input)."""
    dtype, elem = (np.float16, T.FLOAT16) if form == "fill16" else (np.float32, T.FLOAT)
    nodes, inits, const = heads(seq, dtype)
    nodes += [h.make_node("MatMul", ["qh", "kh"], ["scores"]),
              h.make_node("Mul", ["scores", const("scale", np.array(D ** -0.5, dtype))], ["scaled"]),
              h.make_node("Unsqueeze", ["keep", const("axes", np.array([1, 2], np.int64))], ["keep4"])]
    if form == "bias":
        nodes += [h.make_node("Where", ["keep4", const("zero", np.array(0, np.float32)),
                                        const("min", np.array(np.finfo(np.float32).min, np.float32))], ["bias"]),
                  h.make_node("Add", ["scaled", "bias"], ["masked"])]
    elif form == "fill16":
        nodes.append(h.make_node("Where", ["keep4", "scaled", const("min", np.array(np.finfo(np.float16).min,
                                                                                     np.float16))], ["masked"]))
    else:
        nodes = [n for n in nodes if n.op_type != "Unsqueeze"] + [h.make_node("Identity", ["scaled"], ["masked"])]
    nodes += [h.make_node("Softmax", ["masked"], ["probs"], axis=-1),
              h.make_node("MatMul", ["probs", "vh"], ["ctx"]),
              h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ctx_t", const("merge", np.array([0, 0, E], np.int64))], ["out"])]
    inputs = [helpers.vi("x", ["B", seq, E], elem)] + ([] if form == "none" else [helpers.vi("keep", ["B", seq], T.BOOL)])
    model = helpers.make_model(nodes, inputs, [helpers.vi("out", ["B", seq, E], elem)], inits, opset=17)
    return onnx.shape_inference.infer_shapes(model)  # the rules prove shapes; optimize infers them first too


def run_cuda(model, feeds):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    return session.run(None, feeds)[0]


def fused(model, mask_form: str):
    """``model`` after contrib-attention alone, checked to have put its mask in ``mask_form``."""
    out, report = helpers.optimize(model, only=["contrib-attention"])
    (detail,) = [d for d in report.details if d["rule"] == "contrib-attention"]
    assert detail["mask_form"] == mask_form
    return out


def padded_keep(seq: int) -> np.ndarray:
    """A [3, seq] keep mask: holes in item 0, the first half of item 1 padded (left padding), the last 7
    keys of item 2 padded (right padding)."""
    keep = np.ones((3, seq), bool)
    keep[0, 5] = keep[0, -1] = False
    keep[1, : seq // 2] = False
    keep[2, seq - 7:] = False
    return keep


def with_filter_value(model, value):
    """A copy of ``model`` whose one Attention adds ``value`` where its mask is 0."""
    changed = onnx.ModelProto()
    changed.CopyFrom(model)
    (att,) = [n for n in changed.graph.node if n.op_type == "Attention"]
    next(a for a in att.attribute if a.name == "mask_filter_value").f = value
    return changed


@pytest.mark.parametrize("seq", [40, 128])
def test_raw_mask_index_with_holes_matches_the_original_on_cuda(seq):
    model = layer(seq)
    out = fused(model, "mask_index")
    rng = np.random.default_rng(1)
    keep = padded_keep(seq)
    feeds = {"x": rng.standard_normal((3, seq, E)).astype(np.float32), "keep": keep}
    want, got = run_cuda(model, feeds), run_cuda(out, feeds)
    # Rounding only: float32 GEMMs on the GPU (TF32 by default in ONNX Runtime) differ by ~1e-4 here.
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
    # ... and that tolerance sees a misread mask: the same number of kept keys per row, all at the start
    # (what a kernel reading the mask as sequence lengths would use), moves the output far more.
    as_lengths = np.zeros_like(keep)
    for row, n in enumerate(keep.sum(axis=1)):
        as_lengths[row, :n] = True
    misread = run_cuda(model, dict(feeds, keep=as_lengths))
    assert np.max(np.abs(misread - want)) > 1e-2


def test_float16_masked_fill_as_a_raw_mask_matches_the_original_on_cuda():
    """finfo(float16).min is not absorbing; the kernel adds finfo(float32).min in float32 instead, so a row
    with every key masked stays uniform (item 1) and holes get weight 0, as in the float16 original."""
    seq = 64
    model = layer(seq, "fill16")
    out = fused(model, "mask_index")
    keep = padded_keep(seq)
    keep[1] = False  # item 1: every key masked
    feeds = {"x": np.random.default_rng(1).standard_normal((3, seq, E)).astype(np.float16), "keep": keep}
    want, got = run_cuda(model, feeds).astype(np.float64), run_cuda(out, feeds).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)  # float16 rounding
    # the tolerance sees the fill the graph holds, -65504: item 1 would then follow its scores
    weaker = with_filter_value(out, -65504.0)
    assert np.max(np.abs(run_cuda(weaker, feeds).astype(np.float64)[1] - want[1])) > 5e-2


def test_float32_over_many_keys_with_the_mask_of_ones_matches_the_original_on_cuda():
    seq = 300
    model = layer(seq, "none")
    out = fused(model, "all-keys mask_index")
    feeds = {"x": np.random.default_rng(2).standard_normal((2, seq, E)).astype(np.float32)}
    np.testing.assert_allclose(run_cuda(out, feeds), run_cuda(model, feeds), rtol=1e-3, atol=1e-3)


def causal_layer(seq: int, island: bool) -> onnx.ModelProto:
    """One self-attention layer as transformers 5 exports GPT-2: the mask ``Where(Not(And(causal, keep)),
    finfo(float32).min, ConstantOfShape(zeros))``. ``island``: float16 weights and input, the scaled
    scores cast up to float32 for the mask and the Softmax, the weights cast back down for ×V (the
    float16 export); else all float32."""
    dtype, elem = (np.float16, T.FLOAT16) if island else (np.float32, T.FLOAT)
    nodes, inits, const = heads(seq, dtype)
    nodes += [h.make_node("MatMul", ["qh", "kh"], ["scores"]),
              h.make_node("Mul", ["scores", const("scale", np.array(D ** -0.5, dtype))], ["scaled16"]),
              h.make_node("Cast" if island else "Identity", ["scaled16"], ["scaled"], **({"to": T.FLOAT} if island else {})),
              h.make_node("Unsqueeze", ["keep", const("axes", np.array([1, 2], np.int64))], ["keep4"]),
              h.make_node("And", [const("causal", np.tril(np.ones((seq, seq), bool))[None, None]), "keep4"], ["allowed"]),
              h.make_node("Not", ["allowed"], ["dropped"]),
              h.make_node("Shape", ["allowed"], ["allowed_shape"]),
              h.make_node("ConstantOfShape", ["allowed_shape"], ["zeros"],
                          value=numpy_helper.from_array(np.zeros(1, np.float32))),
              h.make_node("Where", ["dropped", const("min", np.array(np.finfo(np.float32).min, np.float32)), "zeros"],
                          ["bias"]),
              h.make_node("Add", ["scaled", "bias"], ["masked"]),
              h.make_node("Softmax", ["masked"], ["probs32"], axis=-1),
              h.make_node("Cast" if island else "Identity", ["probs32"], ["probs"], **({"to": T.FLOAT16} if island else {})),
              h.make_node("MatMul", ["probs", "vh"], ["ctx"]),
              h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ctx_t", const("merge", np.array([0, 0, E], np.int64))], ["out"])]
    model = helpers.make_model(nodes, [helpers.vi("x", ["B", seq, E], elem), helpers.vi("keep", ["B", seq], T.BOOL)],
                               [helpers.vi("out", ["B", seq, E], elem)], inits, opset=17)
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize("island", [False, True])
def test_causal_and_padding_mask_as_a_3d_mask_index_matches_the_original_on_cuda(island):
    """[B, S, L] raw mask on CUDA (float32, and the float16 layer with a float32 softmax island): left
    padding leaves the first queries of a row with no key; the original's softmax is uniform there
    (finfo.min absorbs every score) and the kernel's float32 fill must keep it so."""
    seq = 64
    model = causal_layer(seq, island)
    out = fused(model, "mask_index")
    rng = np.random.default_rng(1)
    keep = padded_keep(seq)  # left padding: queries 0..31 of item 1 see no key
    dtype = np.float16 if island else np.float32
    feeds = {"x": rng.standard_normal((3, seq, E)).astype(dtype), "keep": keep}
    want = run_cuda(model, feeds).astype(np.float64)
    got = run_cuda(out, feeds).astype(np.float64)
    tol = 1e-2 if island else 1e-3  # float16 rounding / TF32 rounding
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # that tolerance sees a fill that does not absorb: -65504 (all a float16 bias could hold) weights the
    # fully masked rows by their scores instead of uniformly
    weaker = with_filter_value(out, -65504.0)
    assert np.max(np.abs(run_cuda(weaker, feeds).astype(np.float64) - want)) > 5 * tol


@pytest.mark.parametrize("form", ["bias", "fill16"])
def test_right_padded_lengths_match_the_original_on_cuda_and_left_padding_would_not(form):
    """contrib-mask-lengths under the promise ``keep`` is right-padded: the 1-D lengths ONNX Runtime reads
    fastest give the original's outputs on right-padded rows (float32 and the float16 masked_fill, where
    lengths may take ONNX Runtime's fused float16 kernels); the same counts padded on the left do not."""
    seq = 128
    model = layer(seq, form)
    out, report = helpers.optimize(model, only=["contrib-attention", "contrib-mask-lengths"], right_padded=["keep"])
    assert report.counts["contrib-mask-lengths"] == 1
    dtype = np.float16 if form == "fill16" else np.float32
    keep = np.arange(seq)[None, :] < np.array([seq, 77, 1, 100])[:, None]
    feeds = {"x": np.random.default_rng(1).standard_normal((4, seq, E)).astype(dtype), "keep": keep}
    want, got = run_cuda(model, feeds).astype(np.float64), run_cuda(out, feeds).astype(np.float64)
    tol = 1e-2 if form == "fill16" else 1e-3  # float16 / TF32 rounding
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    left = dict(feeds, keep=keep[:, ::-1].copy())
    assert np.max(np.abs(run_cuda(out, left).astype(np.float64)[1:] - run_cuda(model, left).astype(np.float64)[1:])) > 5 * tol


def transformers4_island_layer(seq: int) -> onnx.ModelProto:
    """One float16 self-attention layer as ``--precision fp16`` leaves transformers 4's eager BERT: the
    scaled scores cast up to float32, the extended mask ``(1 - Cast(m))·finfo(float32).min`` of an int64
    [B, L] mask added there, a float32 Softmax, its weights cast back to float16 for ×V."""
    nodes, inits, const = heads(seq, np.float16)
    nodes += [h.make_node("MatMul", ["qh", "kh"], ["scores"]),
              h.make_node("Mul", ["scores", const("scale", np.array(D ** -0.5, np.float16))], ["scaled16"]),
              h.make_node("Cast", ["scaled16"], ["scaled"], to=T.FLOAT),
              h.make_node("Unsqueeze", ["m", const("axes", np.array([1, 2], np.int64))], ["m4"]),
              h.make_node("Cast", ["m4"], ["m4f"], to=T.FLOAT),
              h.make_node("Sub", [const("one", np.array(1.0, np.float32)), "m4f"], ["dropped"]),
              h.make_node("Mul", ["dropped", const("min", np.array(np.finfo(np.float32).min, np.float32))], ["bias"]),
              h.make_node("Add", ["scaled", "bias"], ["masked"]),
              h.make_node("Softmax", ["masked"], ["probs32"], axis=-1),
              h.make_node("Cast", ["probs32"], ["probs"], to=T.FLOAT16),
              h.make_node("MatMul", ["probs", "vh"], ["ctx"]),
              h.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              h.make_node("Reshape", ["ctx_t", const("merge", np.array([0, 0, E], np.int64))], ["out"])]
    model = helpers.make_model(nodes, [helpers.vi("x", ["B", seq, E], T.FLOAT16), helpers.vi("m", ["B", seq], T.INT64)],
                               [helpers.vi("out", ["B", seq, E], T.FLOAT16)], inits, opset=17)
    return onnx.shape_inference.infer_shapes(model)


def test_transformers_4_mask_under_the_promise_matches_the_original_on_cuda():
    """Under ``--right-padded m`` the (1 - m)·c island fuses into float16 Attention and its mask into 1-D
    lengths (ONNX Runtime's fused float16 kernels); on right-padded 0/1 rows the CUDA outputs equal the
    original's (float16 rounding), an item that keeps one key included."""
    seq = 128
    model = transformers4_island_layer(seq)
    out, report = helpers.optimize(model, only=["contrib-attention", "contrib-mask-lengths"], right_padded=["m"])
    assert report.counts["contrib-attention"] == 1 and report.counts["contrib-mask-lengths"] == 1
    m = (np.arange(seq)[None, :] < np.array([seq, 77, 1, 100])[:, None]).astype(np.int64)
    feeds = {"x": np.random.default_rng(3).standard_normal((4, seq, E)).astype(np.float16), "m": m}
    want, got = run_cuda(model, feeds).astype(np.float64), run_cuda(out, feeds).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name,fused", [("distilbert_tiny_unfolded_opset14", "Attention"),
                                        ("distilbert_tiny_sdpa_unfolded_opset14", "Attention"),
                                        ("bert_tiny_dynamo", "Attention"),
                                        ("optimum_bart_decoder", "MultiHeadAttention")])
def test_precision_fp16_keep_masks_without_a_promise_match_the_float32_original_on_cuda(name, fused):
    """The keep masks --precision fp16 finds without a promise (keep_masks.always_false: DistilBERT eager's
    expanded masked_fill; zero_where_false: transformers 4's sdpa mask; docs/benchmarks.md 5.60), first
    validated on the CPU: on CUDA the output loads, holds the fused op, validates, and its outputs on masks
    with holes and a row with every key masked stay within float16's drift budget of the float32
    original (normalized max error 2e-2, cosine 0.999)."""
    import onnxruntime as ort

    import onnxfuse
    from onnxfuse.custom_ops import session_options

    model = helpers.load_testdata(name)
    result = onnxfuse.optimize(model, precision="fp16", provider="cuda")
    assert result.validation.passed
    assert fused in [n.op_type for n in result.model.graph.node], result.applied.refusals
    rng = np.random.default_rng(11)
    feeds = {}
    for vi in model.graph.input:
        dims = [d.dim_value or 4 for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == T.INT64 and "mask" in vi.name:
            mask = (np.arange(dims[1])[None, :] < np.array([dims[1], 3, 1, 0])[:, None]).astype(np.int64)
            mask[2, dims[1] - 1] = 1  # a hole: not right-padded
            feeds[vi.name] = mask
        elif vi.type.tensor_type.elem_type == T.INT64:
            feeds[vi.name] = rng.integers(0, 100, dims).astype(np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(dims).astype(np.float32)
    want = helpers.run_ort(model, feeds)  # the float32 original on the CPU provider
    session = ort.InferenceSession(result.model.SerializeToString(), session_options(),
                                   providers=[("CUDAExecutionProvider", {"use_tf32": "0"})])
    names = [o.name for o in session.get_outputs()]
    got = dict(zip(names, session.run(names, feeds)))
    for key, ref in want.items():
        ref, out = ref.astype(np.float64), got[key].astype(np.float64)
        error = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
        cosine = float(out.ravel() @ ref.ravel() / max(np.linalg.norm(out) * np.linalg.norm(ref), 1e-30))
        assert error <= 2e-2 and cosine >= 0.999, (key, error, cosine)
