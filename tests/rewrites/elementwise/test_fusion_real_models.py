"""fuse-elementwise on real architectures (testdata/export_fusion_models.py, random weights).

For each model: node counts before/after, every elementwise op left unfused has a reported reason,
and outputs match the original on ONNX Runtime CPU with the FusedElementwise library (fp32, 1e-4).
"""

from __future__ import annotations

import onnx
import pytest

from helpers import TESTDATA, optimize, op_types
from test_fuse_elementwise import FUSED, RULE, assert_same, needs_library

# model -> (nodes before, nodes after fuse-elementwise alone, fused nodes)
EXPECTED = {
    "mobilenet_v3_small_w025_opset13": (152, 114, 28),
    "efficientnet_blocks_opset13": (79, 58, 21),
    # Cleanup merges duplicate nodes: YOLO's chunk() computes the same Shape→Slice bounds per block
    # (21 merged), ConvNeXt repeats its LayerNorm Constant nodes (11).
    "yolo_conv_bn_silu_opset13": (134, 87, 22),
    # ConvNeXt's decomposed LayerNorms are left to ONNX Runtime's own LayerNormFusion (faster on the GPU).
    "convnext_blocks_opset13": (104, 66, 6),
}
BERT = "bert_tiny_opset14"


def _candidates():
    from onnxfuse.rewrites.elementwise.regions import candidate_ops as _candidate_ops

    return _candidate_ops()


def _load(name):
    path = TESTDATA / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path.name} not in testdata/ (made by testdata/export_fusion_models.py)")
    return onnx.load(str(path))


def _assert_every_leftover_reported(out, report):
    reported = {r.node for r in report.refusals if r.rule == RULE}
    left = [n for n in out.graph.node if n.op_type in _candidates() and n.domain in ("", "ai.onnx")]
    missing = [n.name for n in left if n.name not in reported]
    assert not missing, f"elementwise ops left without a reason: {missing}"
    return left


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_node_counts_and_reasons(name):
    model = _load(name)
    before, after, fused = EXPECTED[name]
    out, report = optimize(model, only=RULE)
    onnx.checker.check_model(out)
    assert len(model.graph.node) == before
    assert len(out.graph.node) == after
    assert op_types(out).count(FUSED) == fused == report.counts[RULE]
    left = _assert_every_leftover_reported(out, report)
    # What stays unfused is a lone op that cannot join a region without a cycle (residual Adds
    # across convolutions, ReLUs whose consumer fused with the SE gate instead).
    # YOLO's chunk() also computes int64 slice bounds from Shape: refused as shape computations.
    # Decomposed LayerNorms (ConvNeXt) are refused on purpose: ONNX Runtime fuses them itself.
    assert all(r.reason.startswith(("single op", "shape computation", "part of a decomposed LayerNorm",
                                    "residual Add feeding a LayerNorm"))
               for r in report.refusals if r.rule == RULE), report.refusals
    assert {n.op_type for n in left} <= {"Add", "Relu", "Mul", "Div", "Sub", "Pow", "Sqrt"}
    # Every fused node's outputs carry dtype and shape.
    vis = {v.name: v for v in list(out.graph.value_info) + list(out.graph.output)}
    for n in out.graph.node:
        if n.op_type == FUSED:
            for o in n.output:
                assert vis[o].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
                assert vis[o].type.tensor_type.shape.dim[0].dim_param  # symbolic batch, never dropped


@needs_library
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_numerics_match_original(name):
    model = _load(name)
    out, _ = optimize(model, only=RULE)
    for batch in (1, 3):
        assert_same(model, out, rtol=1e-4, atol=1e-5, dims={"batch": batch})


@needs_library
@pytest.mark.parametrize("name", sorted(EXPECTED) + [BERT])
def test_full_cuda_target_pipeline(name):
    """All cuda-target rules (folding, contrib patterns, then fusion) together stay exact."""
    model = _load(name)
    out, report = optimize(model, target="cuda")
    onnx.checker.check_model(out)
    assert len(out.graph.node) < len(model.graph.node)
    # (On YOLO the contrib rules take every SiLU as QuickGelu first; fusion gets what is left.)
    _assert_every_leftover_reported(out, report)
    # Token ids are never negative: contrib-embed-layernorm documents that its op rejects negative ids,
    # which ONNX's Gather counts from the end (the other models have no integer inputs).
    assert_same(model, out, rtol=1e-4, atol=1e-5, int_low=0)


def test_bert_tiny_fuses_elementwise_regions():
    model = _load(BERT)
    out, report = optimize(model, only=RULE)
    onnx.checker.check_model(out)
    assert op_types(out).count(FUSED) == report.counts[RULE] > 0
    assert len(out.graph.node) < len(model.graph.node)
    _assert_every_leftover_reported(out, report)
    if needs_library.args[0] is False:
        assert_same(model, out, rtol=1e-4, atol=1e-5)


YOLO_DECODE = "yolo_decode_head_opset13"


@needs_library
def test_yolo_decode_head_with_a_dynamic_batch_is_fused_through():
    """A YOLOv8 export's box decoding behind a dynamic batch: the head reads its sizes from ``Shape``
    (``view(b, 4, reg, a)``, ``view(b, 4, a)``, ``chunk``). constant-reshape-target makes the first
    target constant only once the anchor count (a static dimension of a tensor whose batch is not) is
    read as a constant; fold-constants then runs again before the fusions (the engine's restart) and folds
    the size reads the new shapes make static, so the chunk's Slices take constant bounds and the
    decoding (anchors minus and plus the distances, centre, size, stride) fuses. Before, the Slices kept
    an unknown rank and six elementwise ops, the Shape, Gather and integer arithmetic stayed."""
    import onnxfuse

    model = _load(YOLO_DECODE)
    result = onnxfuse.optimize(model, validate=False, bench=False)  # the pipeline: shapes inferred at load
    out = result.model
    onnx.checker.check_model(out)
    ops = op_types(out)
    for op in ("Shape", "Gather", "Sub", "Add", "Div"):
        assert op not in ops, (op, ops)
    assert ops.count("FusedConcat") == 1, ops
    assert result.applied.counts["constant-reshape-target"] == 4
    for batch in (1, 3):
        assert_same(model, out, rtol=1e-4, atol=1e-4, dims={"batch": batch})
    again = onnxfuse.optimize(out, validate=False, bench=False)
    assert not any(again.applied.counts.values()), {k: v for k, v in again.applied.counts.items() if v}
