"""fold-batchnorm-gemm: BatchNormalization after a Gemm (or a rank-2 MatMul) folded into B and C, for every C
broadcast, alpha, beta and transB; a MatMul of another rank refused. Shared checks: test_fold_batchnorm.py."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper
from helpers import assert_same_outputs, load_testdata, make_model, op_types, optimize, vi
from test_fold_batchnorm import BN_RULES, _assert_refused, _bn_inits


@pytest.mark.parametrize("c_shape", [None, (), (1,), (5,), (1, 5), (3, 1), (3, 5)])
@pytest.mark.parametrize("trans_b, alpha, beta", [(0, 1.0, 1.0), (1, 0.5, 2.0), (1, 1.5, 0.0)])
def test_gemm_c_broadcast_shapes_alpha_beta(c_shape, trans_b, alpha, beta):
    rng = np.random.default_rng(7)
    b_shape = (5, 4) if trans_b else (4, 5)
    inits = [numpy_helper.from_array(rng.standard_normal(b_shape).astype(np.float32), "B"), *_bn_inits(rng, 5, "bn")]
    inputs = ["x", "B"]
    if c_shape is not None:
        inits.append(numpy_helper.from_array(np.asarray(rng.standard_normal(c_shape), dtype=np.float32), "C"))
        inputs.append("C")
    nodes = [
        helper.make_node("Gemm", inputs, ["y"], name="gemm", transB=trans_b, alpha=alpha, beta=beta),
        helper.make_node("BatchNormalization", ["y", "bn.g", "bn.b", "bn.m", "bn.v"], ["out"], name="bn"),
    ]
    model = make_model(nodes, [vi("x", [3, 4])], [vi("out", [3, 5])], inits)
    out, report = optimize(model, only=BN_RULES)
    assert report.counts["fold-batchnorm-gemm"] == 1
    assert op_types(out) == ["Gemm"]
    assert_same_outputs(model, out)

def test_refuses_matmul_rank3_committed():
    _assert_refused(load_testdata("matmul3d_bn"), "MatMul input has rank 3")

def test_refuses_matmul_with_unknown_input_rank():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "B"), *_bn_inits(rng, 5, "bn")]
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "B"], ["y"], name="mm"),
             helper.make_node("BatchNormalization", ["y", "bn.g", "bn.b", "bn.m", "bn.v"], ["out"], name="bn")]
    model = make_model(nodes, [vi("x", None)], [vi("out", None)], inits)
    _assert_refused(model, "MatMul input rank is unknown")
