"""Probe (docs/benchmarks.md 5.43, issue 33): where BERT-base's float16 paths differ on the GPU.

5.43 measured, at batch 16 on an H200: the eager export's ``--precision fp16`` output 1.13x the time of its
``half()`` export optimized (1.25x in a CUDA graph), and the sdpa export's ``half()`` output 2.26x the time of
its own ``--precision fp16`` output. Neither model's graph came back. This script exports BERT-base
(``benchmarks/zoo.py``'s spec) with eager and with sdpa attention, in float32 and in ``half()`` (on CUDA, as
the zoo does), optimizes the float32 export with ``--precision fp16`` and the ``half()`` export with the
defaults (validation on, no timing inside optimize), then for each attention prints the three models' op
counts and times them side by side with ONNX Runtime's profiler (top ops by time), at batch 16.

Run on the GPU machine from the repository root (onnxruntime-gpu, torch and transformers importable)::

    OUT=/tmp/probe python3 benchmarks/probes/fp16_paths.py [eager,sdpa]

Writes ``$OUT/r/fp16_paths.log`` and the models under ``$OUT/r/models`` (for ``onnxfuse bench --profile``
or ``nsys`` afterwards). An exploration tool, never imported by the package.
"""
import collections
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, "benchmarks")
import onnx  # noqa: E402
import torch  # noqa: E402  (before onnxruntime: both then use the CUDA libraries torch loaded)

import zoo  # noqa: E402  (first: it puts the repository on sys.path)
import onnxfuse  # noqa: E402

out = Path(os.environ.get("OUT", "/tmp/probe")) / "r"
(out / "models").mkdir(parents=True, exist_ok=True)
attentions = (sys.argv[1] if len(sys.argv) > 1 else "eager,sdpa").split(",")
spec = zoo.SPECS["bert_base"]
#: the GPU, as the zoo exports and times; the CPU only as a smoke test of this script
device = "cuda" if torch.cuda.is_available() else "cpu"


def log(*parts):
    print(*parts, flush=True)
    with open(out / "fp16_paths.log", "a") as f:
        print(*parts, file=f)


def ops(model: onnx.ModelProto) -> str:
    counts = collections.Counter((n.domain + "::" if n.domain not in ("", "ai.onnx") else "") + n.op_type
                                 for n in model.graph.node)
    return f"{len(model.graph.node)} nodes: " + ", ".join(f"{k} {v}" for k, v in counts.most_common())


for attention in attentions:
    t0 = time.time()
    f32, f16 = out / "models" / f"bert_{attention}.onnx", out / "models" / f"bert_{attention}.half.onnx"
    zoo.export(spec, zoo.build_module(spec, attention=attention), f32, 14, device=device)
    zoo.export(spec, zoo.HalfIO(zoo.build_module(spec, attention=attention)), f16, 14, device=device)
    converted = onnxfuse.optimize(str(f32), precision="fp16", bench=False)
    halved = onnxfuse.optimize(str(f16), rtol=1e-2, atol=1e-2, bench=False)
    models = {"--precision fp16": converted.model, "half() optimized": halved.model,
              "half() original": onnx.load(str(f16))}
    for label, model in models.items():
        onnx.save(model, str(out / "models" / f"bert_{attention}.{label.split()[0].strip('-')}.onnx"))
        log(f"[{attention}] {label}: {ops(model)}")
    for label, result in (("--precision fp16", converted), ("half() optimized", halved)):
        log(f"[{attention}] {label}: float32 nodes {sorted(result.extra.get('precision', {}).get('float32_nodes', {}))}"
            f"; notes {[n[:160] for n in result.validation.notes]}")
        forms = [(d.get("mask_form"), d.get("empty_rows_zeroed")) for d in result.applied.details
                 if d["rule"] == "contrib-attention"]
        log(f"[{attention}] {label}: attention (mask form, rows zeroed): "
            f"{sorted(set(forms), key=str)} x{len(forms)}")
    report = onnxfuse.bench(models["--precision fp16"], models["half() optimized"], batch=16, profile=True, top=12,
                            time_budget=2.0, device=device)
    log(f"[{attention}] batch 16 medians (ms): --precision fp16 {report.results[0].stats.median_ms:.3f}, "
        f"half() optimized {report.results[1].stats.median_ms:.3f}")
    for profile in report.to_dict().get("profiles") or []:  # one line per op: the whole table fits the log
        log(f"[{attention}] profile {profile.get('name')}: {profile.get('node_ms_per_run')} ms of nodes a run")
        for row in profile.get("top_by_time", []):
            log(f"    {row['op']:<28} {row['calls_per_run']:>5.0f} calls {row['ms_per_run']:.3f} ms")
    log(f"[{attention}] {time.time() - t0:.0f} s")
