"""Probe (docs/benchmarks.md 5.27; run from the repository root on the GPU machine with $OUT set): where YOLO fp32 b16 loses to torch.compile; and whether NHWC Resize / MaxPool (as 3-D pool) run fast on ORT CUDA."""
import os, subprocess, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import numpy as np, torch
from onnx import helper, TensorProto as TP
import zoo
from onnxfuse.timing import BenchConfig, time_models
from onnxfuse.runtime.inputs import Inputs

out = Path(os.environ["OUT"]) / "r"; out.mkdir(parents=True, exist_ok=True)
def log(*a):
    print(*a, flush=True)
    with open(out / "probe.log", "a") as f: print(*a, file=f)

cfg = BenchConfig(device="cuda", warmup=10, time_budget_s=0.3, min_iterations=20)
def t(models):
    res = time_models([(n, m, Inputs(feeds=f, seed=0, source="probe")) for n, m, f in models], cfg, rounds=2)
    return {n: round(r.stats.median_ms, 4) for (n, _, _), r in zip(models, res)}

def one(op, x_shape, y_shape_hint, attrs, extra_inits=(), extra_inputs=()):
    x = helper.make_tensor_value_info("x", TP.FLOAT, x_shape)
    y = helper.make_tensor_value_info("y", TP.FLOAT, None)
    node = helper.make_node(op, ["x", *extra_inputs], ["y"], **attrs)
    g = helper.make_graph([node], "g", [x], [y], initializer=list(extra_inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)

rng = np.random.default_rng(0)
# MaxPool 5x5 s1 p2: NCHW 2-D vs NHWC as 3-D pool over [N,1,H,W,C]
for (n, c, h) in [(16, 256, 20), (16, 128, 80)]:
    a = rng.standard_normal((n, c, h, h)).astype(np.float32)
    b = np.ascontiguousarray(a.transpose(0, 2, 3, 1))[:, None]
    m2 = one("MaxPool", list(a.shape), None, dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2], strides=[1, 1]))
    m3 = one("MaxPool", list(b.shape), None, dict(kernel_shape=[5, 5, 1], pads=[2, 2, 0, 2, 2, 0], strides=[1, 1, 1]))
    mt = one("Transpose", list(a.shape), None, dict(perm=[0, 2, 3, 1]))
    log("maxpool", (n, c, h), t([("nchw2d", m2, {"x": a}), ("nhwc3d", m3, {"x": b}), ("transpose", mt, {"x": a})]))
# Resize nearest 2x: NCHW vs NHWC scales
for (n, c, h) in [(16, 512, 20), (16, 256, 40)]:
    a = rng.standard_normal((n, c, h, h)).astype(np.float32)
    b = np.ascontiguousarray(a.transpose(0, 2, 3, 1))
    s1 = helper.make_tensor("s", TP.FLOAT, [4], [1, 1, 2, 2]); s2 = helper.make_tensor("s", TP.FLOAT, [4], [1, 2, 2, 1])
    kw = dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    r1 = one("Resize", list(a.shape), None, kw, [s1], ["", "s"]); r2 = one("Resize", list(b.shape), None, kw, [s2], ["", "s"])
    log("resize", (n, c, h), t([("nchw", r1, {"x": a}), ("nhwc", r2, {"x": b})]))

# The model: export, optimize (default: measured choices), profile both, torch.compile profile
spec = zoo.SPECS["yolo_silu"]
mod = zoo.build_module(spec)
p = Path("/tmp/y.onnx"); zoo.export(spec, mod, p, 14)
env = dict(os.environ)
subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(p), "/tmp/y.opt.onnx", "--shape", "images:16,3,640,640",
                "--json", str(out / "opt.json"), "--force"], env=env)
subprocess.run([sys.executable, "-m", "onnxfuse", "bench", str(p), "/tmp/y.opt.onnx", "--shape", "images:16,3,640,640",
                "--profile", "--top", "30", "--json", str(out / "bench.json")], env=env, stdout=open(out / "bench.txt", "w"))
mod = mod.cuda().eval(); fn = torch.compile(mod)
x = torch.randn(16, 3, 640, 640, device="cuda")
with torch.inference_mode():
    for _ in range(5): fn(x)
torch.cuda.synchronize()
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    with torch.inference_mode():
        for _ in range(10): fn(x)
    torch.cuda.synchronize()
(out / "torch_prof.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90))
log("done")
