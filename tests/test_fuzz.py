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


@pytest.mark.parametrize("seed, target", [
    (894, "cuda"),     # phantom readers left by a dead If blocked a BatchNorm fold until a second run
    (2762, "onnx"),    # the same, another target
    (3358, "contrib"), # a failing Loop evaluation left every constant chain for a second run
    (8136, "cuda"),    # a Transpose absorbed into FusedMatMul exposed a scale only a second run folded
    (7721, "onnx"),    # ONNX Runtime's LayerNormFusion rejects the input's own live graph: classified
])
def test_seeds_the_fuzz_found(seed, target):
    status, detail = check_seed(seed, target)
    assert status in ("ok", "ort-bug"), f"seed {seed}: {status}: {detail}"
