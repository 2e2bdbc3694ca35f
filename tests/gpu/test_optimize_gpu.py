"""End to end on the GPU: `onnxfuse optimize` on the committed real architectures validates on the CUDA
provider (FusedElementwise kernels compiled by NVRTC, contrib ops on CUDA) and times both models."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from helpers import outputs_on_cuda
from onnxfuse.cli import main
from onnxfuse.runtime.session import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU usable by ONNX Runtime")]

TESTDATA = Path(__file__).resolve().parents[2] / "testdata"
MODELS = {
    "mobilenet_v2_w035.onnx": ["input:8,3,96,96"],
    "mobilenet_v3_small_w025_opset13.onnx": [],
    "efficientnet_blocks_opset13.onnx": [],
    "yolo_conv_bn_silu_opset13.onnx": [],
    "convnext_blocks_opset13.onnx": [],
    "bert_tiny_opset14.onnx": ["input_ids:4,32"],
    "distilbert_tiny_opset14.onnx": ["input_ids:4,32"],
    "roberta_tiny_opset14.onnx": ["input_ids:4,32"],
    "gpt2_tiny_opset14.onnx": ["input_ids:4,32"],
    "whisper_encoder_tiny_opset14.onnx": [],
}
# Fused attention ops expected after optimize (contrib-attention runs by default): packed Attention with a
# broadcast [B, 1, S, L] attention_bias (GPT-2: packed from its Split-cut Gemm), on the CUDA kernels.
ATTENTION = {"bert_tiny_opset14.onnx": ("Attention", 2), "distilbert_tiny_opset14.onnx": ("Attention", 2),
             "roberta_tiny_opset14.onnx": ("Attention", 2), "whisper_encoder_tiny_opset14.onnx": ("Attention", 2),
             "gpt2_tiny_opset14.onnx": ("Attention", 2)}


def _optimize(name, tmp_path, *options) -> tuple[dict, Path]:
    """``onnxfuse optimize`` of testdata ``name`` with its shapes and ``options``: (the JSON report, the
    output path); asserts exit 0."""
    src = TESTDATA / name
    if not src.exists():
        pytest.skip(f"{name} not in testdata")
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    args = ["optimize", str(src), str(out), "--json", str(report), *options]
    for s in MODELS[name]:
        args += ["--shape", s]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(report.read_text()), out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_optimize_validates_and_times_on_cuda(name, tmp_path):
    data, out = _optimize(name, tmp_path)
    assert data["result"]["validation"]["provider"] == "cuda"
    assert data["result"]["validation"]["passed"] is True
    assert data["result"]["timing"]["status"] == "ok", data["result"]["timing"]
    print(f"\n{name}: nodes {data['result']['nodes']['before']} -> {data['result']['nodes']['after']}, "
          f"original {data['result']['timing']['original']['latency_ms']['median_ms']:.4f} ms, "
          f"optimized {data['result']['timing']['optimized']['latency_ms']['median_ms']:.4f} ms, "
          f"speed-up {data['result']['timing']['speedup']:.3f}x, rules {[k for k, v in data['result']['rewrites']['counts'].items() if v]}")
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert "BatchNormalization" not in ops
    if name in ATTENTION:
        # The default output times fused attention against its absence (a measured choice for float32
        # transformers): on a 4x32 input either may win, so the structure must match the report's decision.
        op, count = ATTENTION[name]
        taken_away = [t for t in data["result"].get("measured", [])
                      if t["rule"] == "contrib-attention" and t["change"] == "remove" and t["kept"]]
        ladder = data["result"].get("selection") or {}
        kept_rung = [r for r in ladder.get("tried", []) if r["candidate"] == ladder.get("kept")]
        if taken_away:
            assert taken_away[0]["speedup"] > taken_away[0]["without_speedup"], taken_away
            assert op not in ops and "Softmax" in ops, ops
        elif kept_rung and "contrib-attention" in kept_rung[0]["skipped_rules"]:  # the never-slower fallback
            assert kept_rung[0]["slowdown"] is not None and op not in ops, (ladder, ops)
        else:
            assert ops.count(op) == count and "Softmax" not in ops, ops


@pytest.mark.parametrize("name", sorted(ATTENTION))
def test_static_attention_fusion_validates_on_cuda(name, tmp_path):
    """With no timing decisions (``--tune off --allow-slower``) every attention block is fused, whatever
    the GPU measures, and the fused model validates on the CUDA kernels."""
    data, out = _optimize(name, tmp_path, "--tune", "off", "--allow-slower")
    assert data["result"]["validation"]["provider"] == "cuda" and data["result"]["validation"]["passed"] is True
    op, count = ATTENTION[name]
    ops = [n.op_type for n in onnx.load(out).graph.node]
    assert ops.count(op) == count and "Softmax" not in ops, ops


def test_noise_floor_on_cuda_includes_cpu_against_cuda():
    import numpy as np

    import onnxfuse
    from onnxfuse.validate import noise_floor
    from onnxfuse.runtime.inputs import make_samples
    from onnxfuse.runtime.session import run_samples

    model = onnx.load(TESTDATA / "mobilenet_v2_w035.onnx")
    samples = make_samples(model, {"input": [2, 3, 96, 96]})
    reference = run_samples(model, samples, "cuda")
    floor = noise_floor(model, samples, reference, "cuda")
    assert floor and all(np.isfinite(v) and v > 0 for v in floor.values()), floor  # CPU vs CUDA differ
    result = onnxfuse.optimize(model, shapes={"input": [2, 3, 96, 96]}, provider="cuda")
    assert all("noise_floor" in c.extra for c in result.validation.outputs)


def test_optimized_vit_runs_in_a_cuda_graph_and_the_original_cannot():
    """The class token's Expand kept a Shape chain on the CPU, and ONNX Runtime refuses to capture a CUDA
    graph of a model with CPU nodes; after expand-by-broadcast (and constant-reshape-target) the optimized
    ViT has none: it is captured and replayed, with the outputs of the original run without a graph."""
    import numpy as np

    import onnxfuse
    from onnxfuse.runtime.inputs import make_inputs
    from onnxfuse.runtime.session import run_model

    model = onnx.load(TESTDATA / "vit_blocks_opset14.onnx")
    optimized = onnxfuse.optimize(model, provider="cuda").model
    assert not {"Shape", "Expand"} & {n.op_type for n in optimized.graph.node}
    feeds = make_inputs(model, {"input": [4, 3, 32, 32]}, seed=5)
    reference = run_model(model, feeds, "cuda")["output"]

    np.testing.assert_allclose(outputs_on_cuda(optimized, feeds)["output"], reference, rtol=1e-3, atol=1e-3)
    with pytest.raises(Exception):
        outputs_on_cuda(model, feeds)


def test_transformers5_mask_grid_runs_in_a_cuda_graph():
    """transformers 5's mask index grid (Range from Shape, Gather of the flattened mask, Reshape to the
    grid's Shape) with a static length, after flat-index-gather's rows form (GatherElements, B carried by
    the hidden states) and constant-reshape-target: no CPU node, captured in a CUDA graph, the original's
    outputs (which reads the mask in order), also from a mask with more rows than the batch. With fewer
    rows the ONNX spec calls the original's Gather an error (ONNX Runtime's CPU kernel raises; its CUDA
    kernel writes 0 for the rows past the mask): the optimized model raises on CUDA too."""
    import importlib.util

    import numpy as np

    import onnxfuse
    from onnxfuse.runtime.inputs import Inputs
    from onnxfuse.runtime.session import run_model

    spec = importlib.util.spec_from_file_location(
        "grid_cases", Path(__file__).resolve().parents[1] / "rewrites" / "fold" / "test_range_by_cumsum.py")
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    model = cases.grid_model()
    optimized = onnxfuse.optimize(model, provider="cuda").model
    ops = {n.op_type for n in optimized.graph.node}
    assert not {"Shape", "Range", "Concat"} & ops and "GatherElements" in ops
    rng = np.random.default_rng(2)
    feeds = Inputs(feeds={"x": rng.standard_normal((3, 3, 5)).astype(np.float32),
                          "mask": rng.integers(0, 2, (3, cases.L)).astype(np.int64)})
    reference = run_model(model, feeds, "cuda")["out"]
    np.testing.assert_array_equal(outputs_on_cuda(optimized, feeds)["out"], reference)
    more_rows = {"x": feeds.feeds["x"][:2], "mask": feeds.feeds["mask"]}
    np.testing.assert_array_equal(run_model(optimized, Inputs(feeds=more_rows), "cuda")["out"],
                                  run_model(model, Inputs(feeds=more_rows), "cuda")["out"])
    fewer_rows = Inputs(feeds={"x": feeds.feeds["x"], "mask": feeds.feeds["mask"][:2]})
    with pytest.raises(Exception):
        run_model(model, fewer_rows, "cpu")
    with pytest.raises(Exception):
        run_model(optimized, fewer_rows, "cuda")
