"""A CI-sized sample of the optimizer fuzz (tests/fuzz_graphs.py): random graphs with nested If/Loop
bodies reading outer values, every target; each output must be valid, loadable, equal to the
original's and idempotent. ``tools/fuzz_optimize.py --count 2000`` runs the big version."""

from __future__ import annotations

import pytest

from fuzz_graphs import TARGETS, check_seed, random_model

pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("seed", range(0, 240, 6))
def test_random_graph_optimizes_soundly(seed, target):
    status, detail = check_seed(seed, target)
    assert status in ("ok", "skip", "ort-bug"), f"seed {seed}: {status}: {detail}"


def test_generator_covers_nesting_and_op_mix():
    ops, nested = set(), 0
    for seed in range(60):
        model = random_model(seed)
        for node in model.graph.node:
            ops.add(node.op_type)
            nested += node.op_type in ("If", "Loop")
    assert nested >= 10
    assert {"MatMul", "Conv", "BatchNormalization", "Reshape", "Transpose", "Softmax", "Concat", "Slice", "Gather",
            "Where", "Cast", "Expand", "If", "Loop"} <= ops


def test_loop_output_of_unknown_shape_feeding_a_fused_region():
    # Found by the fuzz (seed 60): ONNX Runtime reports the unknown shape of a Loop's output as rank 0,
    # and FusedElementwise's shape inference declared its output a scalar, so the Gather after it
    # made the optimized model unloadable.
    assert check_seed(60, "cuda") == ("ok", "cuda")


def test_elementwise_op_of_a_loop_output_feeding_a_fused_region():
    # Found by the fuzz (seed 2819): Abs of a Loop's output, whose shape ONNX's inference knew and ONNX
    # Runtime's did not, fused into a FusedElementwise that declared itself a scalar before a ReduceMax:
    # unloadable. A tensor computed from a Loop, Scan or If output by elementwise ops is now refused
    # as an input of unknown rank.
    assert check_seed(2819, "cuda") == ("ok", "cuda")


def test_a_loop_output_through_reductions_and_a_matmul_feeding_a_fused_region():
    # Found by the fuzz (seed 342992): a Loop's output through ReduceMean, Sub, Pow, ReduceMean and a
    # MatMul (a graph output declaring rank 4, which ONNX Runtime's inference does not use) into a fused
    # Sigmoid that declared itself a scalar; the Conv after it made the model unloadable. The unknown
    # shape is now followed through every op whose output rank ONNX Runtime infers from its inputs'.
    assert check_seed(342992, "cuda") == ("ok", "cuda")


@pytest.mark.parametrize("seed, target", [
    (894, "cuda"),     # phantom readers left by a dead If blocked a BatchNorm fold until a second run
    (2762, "onnx"),    # the same, another target
    (3358, "contrib"), # a failing Loop evaluation left every constant chain for a second run
    (8136, "cuda"),    # a Transpose absorbed into FusedMatMul exposed a scale only a second run folded
    (7721, "onnx"),    # ONNX Runtime's LayerNormFusion rejects the input's own live graph: classified
    (573593, "onnx"),  # an If branch read a Mul of constants the main pass folded after the branch's rewrite
])
def test_seeds_the_fuzz_found(seed, target):
    status, detail = check_seed(seed, target)
    assert status in ("ok", "ort-bug"), f"seed {seed}: {status}: {detail}"


@pytest.mark.parametrize("seed", range(0, 48, 2))
def test_random_conv_net_goes_channels_last_soundly(seed):
    """tests/fuzz_cnn_graphs.py: random conv nets with contrib-channels-last added, NhwcConv run on the CPU
    as its definition: valid, loadable, equal to the original, idempotent."""
    from fuzz_cnn_graphs import check_cnn_seed

    status, detail = check_cnn_seed(seed)
    assert status in ("ok", "skip"), f"seed {seed}: {status}: {detail}"


def test_conv_net_generator_reaches_the_rule_and_its_boundaries():
    import onnxfuse
    from fuzz_cnn_graphs import random_cnn_model

    applied, concats, ops = 0, 0, set()
    for seed in range(0, 48, 2):
        model = random_cnn_model(seed)
        ops |= {n.op_type for n in model.graph.node}
        result = onnxfuse.optimize(model, target="cuda", validate=False, only="+contrib-channels-last")
        applied += result.applied.counts.get("contrib-channels-last", 0) > 0
        concats += result.applied.counts.get("concat-into-elementwise", 0) > 0
    assert applied >= 16
    assert concats >= 1  # FusedConcat in a channels-last net (7% of seeds 470000-470199): checked against the original
    assert {"Conv", "Split", "Concat", "Slice", "MaxPool", "Resize", "If", "Add"} <= ops


def test_a_float16_graph_that_amplifies_rounding_is_judged_against_its_float32_twin():
    """Seed 413024: a float16 Conv, BatchNorm and Mul, folded into one Conv (one float16 rounding instead
    of three), feed nested Loops of Add, Min and Tanh. The original and the optimized model end 0.073 apart
    (beyond float16's 2e-2), but each is 0.036 from the same model computed in float32, in opposite
    directions: the fold is as exact as the original. The oracle now asks that, and still fails an output
    moved away from the float32 result."""
    import numpy as np
    import onnxfuse
    from fuzz_graphs import _no_farther_from_float32, _run, random_inputs

    assert check_seed(413024, "onnx") == ("ok", "onnx")
    model = random_model(413024)
    feeds = random_inputs(model, 413024)
    ref = _run(model, feeds, custom=False)[0]
    got = _run(onnxfuse.optimize(model, target="onnx", validate=False).model, feeds, custom=False)[0]
    assert np.abs(ref.astype(np.float64) - got).max() > 0.05  # what the plain tolerance rejected
    assert _no_farther_from_float32(model, feeds, 0, ref, got)
    moved = (got.astype(np.float32) + 0.1).astype(np.float16)  # a rewrite that shifts the result
    assert not _no_farther_from_float32(model, feeds, 0, ref, moved)


@pytest.mark.parametrize("seed", [581108, 581359])
def test_a_comparison_a_rounding_from_its_threshold_is_not_a_wrong_result(seed):
    """Seeds 581108 and 581359: a Greater of a float output with 0 flips where the value sits within a
    rounding of 0 (ONNX Runtime's CPU Erf gives 6e-8 for erf(0), FusedElementwise 0; a float16 chain
    rounded once instead of twice). The oracle judges such a flip by the operands' distance."""
    assert check_seed(seed, "cuda") == ("ok", "cuda")


def test_the_threshold_oracle_still_fails_a_flip_far_from_the_threshold():
    import numpy as np
    from onnx import TensorProto, helper

    from fuzz_graphs import _flips_at_threshold

    graph = helper.make_graph(
        [helper.make_node("Greater", ["x", "zero"], ["gt"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("gt", TensorProto.BOOL, [4])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {"x": np.array([1e-6, 0.5, -0.3, -1e-7], np.float32)}
    ref = feeds["x"] > 0
    near = ref.copy()
    near[[0, 3]] = ~near[[0, 3]]  # both within 2e-4 of 0
    assert _flips_at_threshold(model, feeds, 0, ref, near, half=False)
    far = ref.copy()
    far[1] = ~far[1]  # 0.5 is not a rounding from 0
    assert not _flips_at_threshold(model, feeds, 0, ref, far, half=False)


@pytest.mark.parametrize("seed", range(500000, 500060, 4))
def test_precision_fp16_of_a_random_graph_validates_or_refuses_and_stays_within_float16(seed):
    """``optimize --precision fp16`` with validation on, as a user runs it (``tools/fuzz_optimize.py
    --precision`` for the big version): refused with one clear error, or a valid, loadable model with float32
    I/O within 3x the drift of the plain float16 conversion computed as ONNX specifies (the fuzz's own check)."""
    from fuzz_graphs import check_precision_seed

    status, detail = check_precision_seed(seed)
    assert status in ("ok", "skip", "refused"), f"seed {seed}: {status}: {detail}"
