"""runtime/stand_ins.py: ops only ONNX Runtime's CUDA provider has run on the CPU as their definitions."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from helpers import make_model, vi
from onnxfuse.runtime.session import make_session
from onnxfuse.runtime.stand_ins import for_cpu, needs_stand_ins


def _conv_models(rng):
    """The same convolution twice: an NCHW Conv, and a com.microsoft NhwcConv on transposed data with a
    channels-last weight (grouped, strided, padded, with a bias), the latter also inside an If branch."""
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    attrs = dict(group=2, strides=[2, 1], pads=[1, 0, 1, 2])
    nchw = make_model([helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)], [vi("x", [2, 4, 7, 9])],
                      [vi("y", [2, 6, 4, 9])],
                      [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")], opset=17)
    conv = helper.make_node("NhwcConv", ["xt", "wt", "b"], ["yt"], domain="com.microsoft", **attrs)
    branch = helper.make_graph([helper.make_node("NhwcConv", ["xt", "wt", "b"], ["z"], domain="com.microsoft",
                                                 **attrs)], "then", [], [vi("z", [2, 4, 9, 6])])
    other = helper.make_graph([helper.make_node("Identity", ["yt"], ["z2"])], "else", [], [vi("z2", [2, 4, 9, 6])])
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 3, 1]), conv,
             helper.make_node("If", ["cond"], ["zt"], then_branch=branch, else_branch=other)]
    nhwc = make_model(nodes, [vi("x", [2, 4, 7, 9]), vi("cond", [], TensorProto.BOOL)],
                      [vi("yt", [2, 4, 9, 6]), vi("zt", [2, 4, 9, 6])],
                      [numpy_helper.from_array(np.ascontiguousarray(w.transpose(0, 2, 3, 1)), "wt"),
                       numpy_helper.from_array(b, "b")], opset=17)
    nhwc.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return nchw, nhwc


def test_nhwc_conv_runs_on_the_cpu_as_its_definition_in_graphs_and_branches():
    rng = np.random.default_rng(0)
    nchw, nhwc = _conv_models(rng)
    assert needs_stand_ins(nhwc) and not needs_stand_ins(nchw)
    assert for_cpu(nchw) is nchw
    cpu = for_cpu(nhwc)
    assert not needs_stand_ins(cpu) and needs_stand_ins(nhwc)  # a copy: the input is left as it was
    onnx.checker.check_model(cpu)
    x = rng.standard_normal((2, 4, 7, 9)).astype(np.float32)
    want = make_session(nchw, "cpu").run(None, {"x": x})[0].transpose(0, 2, 3, 1)
    for cond in (True, False):
        got = make_session(nhwc, "cpu").run(None, {"x": x, "cond": np.array(cond)})  # stand-ins applied there
        for g in got:
            np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
