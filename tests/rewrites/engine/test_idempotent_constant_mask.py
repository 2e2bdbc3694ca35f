"""One optimize reaches the fixed point: contrib-attention with a constant key mask and static sizes
writes ``Expand(constant, constant)`` (and ``Unsqueeze(constant)``) after fold-constants ran; the engine
runs fold-constants again in the same run (``GraphPass.pending``). On 93e2115 a second optimize folded
them (issue 29: 6.5% of random attention graphs were not idempotent)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from onnx import numpy_helper

import onnxfuse
from test_contrib_attention import S, attention_model, feeds_for
from helpers import run_ort


@pytest.mark.parametrize("shape", [(1, 1, 1, S), (S,), (1, S)])
@pytest.mark.parametrize("target", ["contrib", "cuda"])
def test_constant_key_mask_is_folded_in_one_run(shape, target):
    model = attention_model(mask="causal")
    mask = np.zeros(shape, np.float32)
    mask[..., -2:] = -10000.0
    i = next(k for k, t in enumerate(model.graph.initializer) if t.name == "madd")
    model.graph.initializer[i].CopyFrom(numpy_helper.from_array(mask, "madd"))
    del model.graph.value_info[:]
    first = onnxfuse.optimize(model, target=target, bench=False)
    ops = Counter(n.op_type for n in first.model.graph.node)
    assert ops["Attention"] == 1 and ops["Expand"] == 0 and ops["Unsqueeze"] == 0, ops
    second = onnxfuse.optimize(first.model, target=target, bench=False)
    assert not any(second.applied.counts.values()), second.applied.counts
    if target == "contrib":  # the CPU provider runs Attention: same outputs as the original
        feeds = feeds_for(model)
        want, got = run_ort(model, feeds), run_ort(first.model, feeds)
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(mask="padding"), dict(mask=None), dict(mask="padding", cross=True)])
def test_shape_reads_of_static_dims_are_folded_in_one_run(kw):
    """The exporter reads Shape of the scores and heads; the rewrite recomputes them from Shape(x), whose
    S is static: Slice(Shape(x), 1, 2) is fold-constants' work, done in the same run (failed at 9cd5a04,
    whose pending looked at constant inputs only)."""
    model = attention_model(shape_reads=True, **kw)
    first = onnxfuse.optimize(model, target="contrib", bench=False)
    ops = Counter(n.op_type for n in first.model.graph.node)
    assert ops["Attention"] + ops["MultiHeadAttention"] == 1, ops
    second = onnxfuse.optimize(first.model, target="contrib", bench=False)
    assert not any(second.applied.counts.values()), second.applied.counts
