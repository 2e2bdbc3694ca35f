"""fold-batchnorm-convtranspose: BatchNormalization after a ConvTranspose folded into its weights (grouped: each
group's output-channel slices scaled). The family's shared checks: tests/rewrites/fold/test_fold_batchnorm.py."""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper
from helpers import load_testdata, optimize


def test_grouped_convtranspose_scales_the_right_slices():
    """Output channel o = g*(C_out/group)+j lives in W[g*Cin/group:(g+1)*Cin/group, j]."""
    model = load_testdata("convtranspose_bn")
    out, _ = optimize(model, only="fold-batchnorm-convtranspose")
    before = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    after = {i.name: numpy_helper.to_array(i) for i in out.graph.initializer}
    w = before["deconv0.weight"]  # (8, 3, 3, 3), group=2 → C_out 6
    s = before["bn0.gamma"] / np.sqrt(before["bn0.var"] + 1e-3)
    new_w = after[next(n for n in out.graph.node if n.name == "deconv0").input[1]]
    for o in range(6):
        g, j = divmod(o, 3)
        rows = slice(g * 4, (g + 1) * 4)
        np.testing.assert_allclose(new_w[rows, j], (w[rows, j] * s[o]).astype(np.float32), rtol=0, atol=0)
