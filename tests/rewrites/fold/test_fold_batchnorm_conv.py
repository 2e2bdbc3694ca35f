"""fold-batchnorm-conv: BatchNormalization after a Conv folded into its weights and bias, exactly for random
1-D/2-D/3-D configurations (groups, strides, dilations, pads). Shared checks: test_fold_batchnorm.py."""

from __future__ import annotations

import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper
from helpers import assert_same_outputs, load_testdata, make_model, op_types, optimize, vi
from test_fold_batchnorm import BN_RULES, FOLD_RULES, _assert_refused, _bn_inits, _conv_bn


def test_torchvision_export_has_no_batchnorm_left():
    """mobilenet_v2 (width 0.35) exported by torch with BN kept: all 52 fold, outputs within 1e-4 relative."""
    model = load_testdata("mobilenet_v2_w035")
    assert op_types(model).count("BatchNormalization") == 52
    out, report = optimize(model, only=FOLD_RULES)
    assert report.counts["fold-batchnorm-conv"] == 52
    assert "BatchNormalization" not in op_types(out)
    assert op_types(out).count("Conv") == 52
    onnx.checker.check_model(out)
    for seed in (0, 1):
        assert_same_outputs(model, out, rtol=1e-4, seed=seed)

@given(
    nd=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    per_group_in=st.integers(1, 2),
    per_group_out=st.integers(1, 2),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    pad=st.integers(0, 2),
    bias=st.booleans(),
    transpose=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_random_conv_configurations_fold_exactly(nd, group, per_group_in, per_group_out, k, stride, dilation, pad,
                                                 bias, transpose, seed):
    rng = np.random.default_rng(seed)
    cin, cout = group * per_group_in, group * per_group_out
    w_shape = (cin, per_group_out) if transpose else (cout, per_group_in)
    inits = [numpy_helper.from_array(rng.standard_normal(w_shape + (k,) * nd).astype(np.float32), "W"),
             *_bn_inits(rng, cout, "bn")]
    inputs = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), "bias"))
        inputs.append("bias")
    op = "ConvTranspose" if transpose else "Conv"
    nodes = [
        helper.make_node(op, inputs, ["y"], name="conv", group=group, strides=[stride] * nd,
                         dilations=[dilation] * nd, pads=[pad] * (2 * nd)),
        helper.make_node("BatchNormalization", ["y", "bn.g", "bn.b", "bn.m", "bn.v"], ["out"], name="bn"),
    ]
    model = make_model(nodes, [vi("x", ["N", cin] + [7] * nd)], [vi("out", None)], inits)
    out, report = optimize(model, only=BN_RULES)
    assert report.total == 1, report.to_dict()
    assert op_types(out) == [op]
    assert_same_outputs(model, out)

def test_refuses_non_constant_conv_weight():
    rng = np.random.default_rng(0)
    model = _conv_bn(w_name="W_in", extra_inputs=[vi("W_in", [4, 3, 3, 3])], inits=_bn_inits(rng, 4, "bn"))
    _assert_refused(model, "weight 'W_in' is not a constant")

def test_refuses_spatial_zero():
    model = _conv_bn()
    model.graph.node[1].attribute.append(helper.make_attribute("spatial", 0))
    model.opset_import[0].version = 7
    _assert_refused(model, "spatial=0")
