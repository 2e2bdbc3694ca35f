"""Never slower on the GPU (onnxfuse/selection.py): the fallback ladder with real CUDA timing and
validation. Every timing is made to count as slower (the margin set below -100%), so every rung runs:
each candidate is rewritten, validated on CUDA and timed against the original, and the graph as loaded
is kept; the report carries every rung's real medians."""

from __future__ import annotations

import pytest

import onnxfuse
import onnxfuse.selection as selection
from helpers import load_testdata
from onnxfuse.runtime.session import cuda_available
from onnxfuse.timing import BenchConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]


def test_every_rung_is_validated_and_timed_on_cuda(monkeypatch):
    monkeypatch.setattr(selection, "SLOWER_MARGIN", -2.0)
    model = load_testdata("bert_tiny_sdpa_opset14")
    result = onnxfuse.optimize(model, provider="cuda", samples=1, bench=True,
                               bench_config=BenchConfig(device="cuda", warmup=3, time_budget_s=0.05, min_iterations=5))
    chosen = result.extra["selection"]
    assert [t["candidate"] for t in chosen["tried"]] == ["fused attention", "FusedElementwise kernels", "every rewrite"]
    assert all(t["original_ms"] > 0 and t["candidate_ms"] > 0 for t in chosen["tried"])
    assert chosen["kept"] == "every rewrite" and result.applied.applied_rules() == []
    assert result.validation.passed and result.validation.provider == "cuda"
    assert result.timing.status == "ok" and any("slower than the original" in n for n in result.timing.notes)


def test_a_measured_choice_is_timed_and_decided_on_cuda():
    """The measured choice (selection.try_measured) with real CUDA timing, at batch 16 where channels-last
    can pay: contrib-channels-last is tried on top of the YOLO block's output, validated on CUDA and timed
    beside it in two fresh sessions; the decision agrees with its own figures (kept only when its speed-up
    beats the output's by the margin and it wins in both sessions), and the written model is the one
    decided on; contrib-channel-transpose is tried after it only when it was kept."""
    model = load_testdata("yolo_conv_bn_silu_opset13")
    result = onnxfuse.optimize(model, provider="cuda", samples=1, bench=True, shapes={"input": [16, 3, 64, 64]},
                               bench_config=BenchConfig(device="cuda", warmup=5, time_budget_s=0.3, min_iterations=20))
    assert result.validation.passed and result.validation.provider == "cuda"
    trial, transposes = result.extra["measured"]
    assert trial["rule"] == "contrib-channels-last" and trial["speedup"] > 0 and trial["without_speedup"] > 0
    (gains,) = trial["session_gains"]  # one size, two sessions, side by side
    assert len(gains) == 2 and all(g > 0 for g in gains)
    assert not trial["kept"] or all(g > 1 for g in gains)
    assert transposes["rule"] == "contrib-channel-transpose"
    assert trial["kept"] or transposes["refused"] == "not tried: contrib-channels-last not kept"
    beats = trial["speedup"] > trial["without_speedup"] * (1 + selection.SLOWER_MARGIN)
    # kept needs the gain by median and by fastest run alike (selection.is_faster); the report's speed-ups
    # are the better of the two, so a kept choice beats by them, and one that does not beat is not kept
    assert beats or not trial["kept"]
    assert trial["kept"] or trial["refused"] == "not faster"
    has_nhwc = "NhwcConv" in {n.op_type for n in result.model.graph.node}
    assert has_nhwc == trial["kept"]
