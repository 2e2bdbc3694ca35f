"""The whole default pipeline on a real torch attention export (testdata/vit_blocks_opset14.onnx).

torch's MultiheadAttention computes its scale from ``Shape(q)`` behind a computed Reshape. Before
fold-constants, ViT-B/16 at batch 1 was 0.98x of the original on an H100 (region fusion moved that
scalar arithmetic onto the GPU); with it, the scale folds into the attention MatMul's alpha and the
static size arithmetic disappears (docs/benchmarks.md). This test pins that behaviour and checks the
outputs against ONNX Runtime on the original at batch 1 and 3 (a frozen batch size would show).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from helpers import TESTDATA, optimize
from test_fuse_elementwise import assert_same, needs_library

NAME = "vit_blocks_opset14"
LAYERS, DIM, HEADS = 2, 64, 4


def _load():
    path = TESTDATA / f"{NAME}.onnx"
    if not path.exists():
        pytest.skip(f"{path.name} not in testdata/ (made by testdata/export_fusion_models.py)")
    return onnx.load(str(path))


def _ops(model):
    return Counter(n.op_type for n in model.graph.node)


def test_scale_folds_into_attention_matmul():
    """Without contrib-attention (which takes the whole attention, scale included, since float32
    sequence-first attention packs), the scale still folds into the scores' FusedMatMul."""
    model = _load()
    before = _ops(model)
    assert before["Shape"] == 18 and before["Sqrt"] == 11  # 5 LayerNorms + 3 per attention scale
    out, report = optimize(model, skip="contrib-attention")
    after = _ops(out)
    assert report.counts["fold-constants"] > 0
    assert report.counts["contrib-fused-matmul-scale"] == LAYERS
    alphas = [a.f for n in out.graph.node if n.op_type == "FusedMatMul" for a in n.attribute if a.name == "alpha"]
    assert alphas == pytest.approx([1 / np.sqrt(DIM // HEADS)] * LAYERS, rel=1e-6)
    # The attention scale's Sqrt, Div, Cast and its two Muls per layer are gone; of the 5 decomposed
    # LayerNorms the four that read a residual Add became SkipLayerNorm (three also write the sum, read
    # again by the next block; both sides of every residual Add are provably of one shape since
    # facts/proven_dims.py, two before it), and so did the first block's ln_1, which reads the class
    # token + patches [B, N, E] plus the position embedding [1, N, E], a skip ONNX Runtime broadcasts.
    assert after["Sqrt"] == 0 and after["Cast"] == 0
    assert after["SkipLayerNormalization"] == 5
    assert after["LayerNormalization"] == 0
    # Size arithmetic on static dims is folded; the one size left computed, the batch of the class
    # token's Expand, is carried from the input by expand-by-broadcast: no Shape is left to run on the CPU.
    assert after["Shape"] == 0 and after["Expand"] == 0
    assert len(out.graph.node) < len(model.graph.node) // 2
    # FusedElementwise got only that broadcast, Where(Equal(c, c), token, token), and concat-into-elementwise
    # wrote it straight into the class token's slice of the Concat beside the patches (one FusedConcat, the
    # patches a copy segment): what is left is ONNX Runtime's own fused ops and glue.
    assert not [n for n in out.graph.node if n.op_type == "FusedElementwise"]
    fused = [n for n in out.graph.node if n.op_type == "FusedConcat"]
    assert len(fused) == 1 and report.counts["expand-by-broadcast"] == 1
    program = next(a.s for a in fused[0].attribute if a.name == "program_0").decode()
    assert "Where" in program and "Equal" in program and program.count(" = ") == 2
    assert "Identity" in next(a.s for a in fused[0].attribute if a.name == "program_1").decode()


@needs_library
def test_outputs_match_original_at_two_batch_sizes():
    model = _load()
    out, _ = optimize(model)
    for batch in (1, 3):
        assert_same(model, out, rtol=1e-4, atol=1e-5, dims={"batch": batch})


def test_without_fold_constants_the_scale_stays_on_onnx_runtime():
    model = _load()
    out, report = optimize(model, skip="fold-constants")
    assert report.counts["contrib-fused-matmul-scale"] == 0
    reasons = [r.reason for r in report.refusals if r.rule == "fuse-elementwise"]
    # 4 per layer: torch computes the q and k scales from the same Shape twice; cleanup merges the copies.
    assert sum(r.startswith("scalar computation") for r in reasons) == 4 * LAYERS
    assert _ops(out)["FusedElementwise"] == 0


def test_attention_scores_take_both_scale_and_transpose():
    # contrib-fused-matmul-scale runs before contrib-fused-matmul-transpose, so q·kᵀ·α becomes one
    # FusedMatMul(q, k, alpha, transB=1) in a single pass (the other order left kᵀ's Transpose).
    out, _ = optimize(_load(), skip="contrib-attention")
    fused = [n for n in out.graph.node if n.op_type == "FusedMatMul"]
    attrs = [{a.name: a for a in n.attribute} for n in fused]
    assert len(fused) == LAYERS and all(a["transB"].i == 1 and "alpha" in a for a in attrs)


@pytest.mark.parametrize("name", ["vit_blocks_opset14", "bert_tiny_opset14", "convnext_blocks_opset13",
                                  "yolo_conv_bn_silu_opset13", "mobilenet_v2_w035"])
def test_a_second_pass_finds_nothing(name):
    path = TESTDATA / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path.name} not in testdata/")
    once, _ = optimize(onnx.load(str(path)))
    twice, report = optimize(once)
    assert report.total == 0, {k: v for k, v in report.counts.items() if v}
    assert len(twice.graph.node) == len(once.graph.node)
