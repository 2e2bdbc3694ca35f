"""Probe (docs/benchmarks.md 5.28; run from the repository root on the GPU machine with $OUT set): the
YOLO-style detector at batch 16 under contrib-channels-last, as this session's two changes left it (nearest
Resizes inside the region, concat-split-parts) and without them (``_nearest_resize_scales`` patched to
refuse, ``--skip concat-split-parts``), against the original, fp32 and fp16, in one process; with TORCH=1
also torch.compile (mode default) of the same module. Results in $OUT/r/resize.log."""
import os, sys, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import onnx, torch
import zoo, onnxfuse
import onnxfuse.rewrites.contrib.contrib_channels_last as ccl
from onnxfuse.timing import BenchConfig, time_models
from onnxfuse.runtime.inputs import Inputs

out = Path(os.environ["OUT"]) / "r"; out.mkdir(parents=True, exist_ok=True)
def log(*a):
    print(*a, flush=True)
    with open(out / "resize.log", "a") as f: print(*a, file=f)
cfg = BenchConfig(device="cuda", warmup=10, time_budget_s=0.6, min_iterations=20)
rule = ccl._nearest_resize_scales
spec = zoo.SPECS["yolo_silu"]
for half in (False, True):
    t0 = time.time()
    module = zoo.build_module(spec)
    if half: module = zoo.HalfIO(module)
    p = Path(f"/tmp/yolo{'.fp16' if half else ''}.onnx")
    zoo.export(spec, module, p, 14, device="cuda" if half else "cpu")
    model = onnx.load(str(p))
    made = {}
    for label, before in (("before", True), ("after", False)):
        ccl._nearest_resize_scales = (lambda g, n: None) if before else rule
        r = onnxfuse.optimize(model, only="+contrib-channels-last", skip="concat-split-parts" if before else None,
                              bench=False, provider="cuda")
        made[label] = r.model
        ops = [n.op_type for n in r.model.graph.node]
        log(f"{'fp16' if half else 'fp32'} {label}: validation {r.validation.passed}, nodes {len(ops)}, "
            + ", ".join(f"{o} {ops.count(o)}" for o in ("Transpose", "Split", "Slice", "Concat")))
    ccl._nearest_resize_scales = rule
    feeds = spec.feeds(16)
    for rnd in range(2):
        res = time_models([(k, m, Inputs(feeds=feeds, seed=0, source="p5")) for k, m in [("orig", model), *made.items()]], cfg, rounds=3)
        log(f"  b16 round {rnd}: " + ", ".join(f"{k} {r.stats.median_ms:.3f}" for k, r in zip(("orig", *made), res)))
    if os.environ.get("TORCH") == "1":
        module = module.cuda().eval()
        fn = torch.compile(module, dynamic=False)
        example = spec.example(16, "cuda")
        with torch.inference_mode():
            fn(*example); torch.cuda.synchronize()
        r = zoo.time_torch(fn, example, 10, 0.6, 20, "cuda")
        log(f"  torch.compile b16: {r['latency_ms']['median_ms']:.3f} ms ({time.time() - t0:.0f} s)")
        module.cpu(); torch.cuda.empty_cache()
log("done")
