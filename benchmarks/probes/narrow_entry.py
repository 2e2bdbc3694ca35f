"""Probe (docs/benchmarks.md 5.27): contrib-channels-last with and without a "narrow entry" (the first
Conv, reading an image's 3 channels, left NCHW so the boundary transpose moves to its 32-channel output),
at batch 16, fp32 and fp16, with torch.compile (default mode) of the same module in the same process.

The narrow entry measured slower and was not kept; this script ran against a working tree whose
contrib_channels_last.py had ``NARROW_ENTRY_CHANNELS`` (a Conv with fewer input channels from outside the
regions stays NCHW). Without that constant it times the rule twice. Run on the GPU machine from the
repository root with $OUT set; results in $OUT/r/probe4.log."""
import os, sys, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import numpy as np, onnx, torch
import zoo, onnxfuse
import onnxfuse.rewrites.contrib.contrib_channels_last as ccl
from onnxfuse.timing import BenchConfig, time_models
from onnxfuse.runtime.inputs import Inputs
from onnxfuse.custom_ops import session_options
import onnxruntime as ort

out = Path(os.environ["OUT"]) / "r"; out.mkdir(parents=True, exist_ok=True)
def log(*a):
    print(*a, flush=True)
    with open(out / "probe4.log", "a") as f: print(*a, file=f)
cfg = BenchConfig(device="cuda", warmup=10, time_budget_s=0.6, min_iterations=20)
sess = lambda mm: ort.InferenceSession(mm.SerializeToString(), session_options(), providers=["CUDAExecutionProvider"])

def variants(model):
    res = {}
    for label, narrow in (("old", 0), ("narrow", 8)):
        ccl.NARROW_ENTRY_CHANNELS = narrow
        r = onnxfuse.optimize(model, only="+contrib-channels-last", bench=False, validate=False)
        res[label] = r.model
        ops = [n.op_type for n in r.model.graph.node]
        log(f"  {label}: NhwcConv {ops.count('NhwcConv')}, Conv {ops.count('Conv')}, Transpose {ops.count('Transpose')}")
    return res

def tcompile(module, example):
    fn = torch.compile(module, dynamic=False)
    with torch.inference_mode():
        fn(*example); torch.cuda.synchronize()
    r = zoo.time_torch(fn, example, 10, 0.6, 20, "cuda")
    return round(r["latency_ms"]["median_ms"], 3)

for name, fp16s in (("yolo_silu", (False, True)), ("resnet50", (False, True)), ("convnext_tiny", (False,))):
    spec = zoo.SPECS[name]
    for half in fp16s:
        t0 = time.time()
        module = zoo.build_module(spec)
        if half: module = zoo.HalfIO(module)
        p = Path(f"/tmp/{name}{'.fp16' if half else ''}.onnx")
        zoo.export(spec, module, p, 14, device="cuda" if half else "cpu")
        model = onnx.load(str(p))
        log(f"{name} {'fp16' if half else 'fp32'}")
        v = variants(model)
        feeds = spec.feeds(16)
        a, b = sess(v["old"]).run(None, feeds)[0], sess(v["narrow"]).run(None, feeds)[0]
        log(f"  max abs old vs narrow {float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max()):.3g} (scale {float(np.abs(a).max()):.3g})")
        for rnd in range(2):
            res = time_models([(k, m, Inputs(feeds=feeds, seed=0, source="p4")) for k, m in [("orig", model), ("old", v["old"]), ("narrow", v["narrow"])]], cfg, rounds=3)
            log(f"  ORT b16 round {rnd}: " + ", ".join(f"{k} {r.stats.median_ms:.3f}" for k, r in zip(("orig", "old", "narrow"), res)))
        module = module.cuda().eval()
        log(f"  torch.compile b16: {tcompile(module, spec.example(16, 'cuda'))} ms  ({time.time() - t0:.0f} s)")
        module.cpu(); torch.cuda.empty_cache()
log("done")
