"""Probe (docs/benchmarks.md 5.27; run from the repository root on the GPU machine with $OUT set): per-node cost of YOLO b16 fp32's Transposes, Concats, Splits, MaxPools, Resizes in onnxfuse's output."""
import os, subprocess, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import numpy as np, onnx
from onnx import helper, shape_inference, TensorProto as TP
import zoo
from onnxfuse.timing import BenchConfig, time_models
from onnxfuse.runtime.inputs import Inputs

out = Path(os.environ["OUT"]) / "r"; out.mkdir(parents=True, exist_ok=True)
def log(*a):
    print(*a, flush=True)
    with open(out / "probe3.log", "a") as f: print(*a, file=f)
p = Path("/tmp/y.onnx")
if not p.exists(): zoo.export(zoo.SPECS["yolo_silu"], zoo.build_module(zoo.SPECS["yolo_silu"]), p, 14)
if not Path("/tmp/y.opt.onnx").exists():
    subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(p), "/tmp/y.opt.onnx", "--shape", "images:16,3,640,640", "--force", "--quiet"])
m = onnx.load("/tmp/y.opt.onnx")
m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 16
inf = shape_inference.infer_shapes(m)
shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in list(inf.graph.value_info) + list(inf.graph.input) + list(inf.graph.output)}
inits = {i.name: i for i in m.graph.initializer}
rng = np.random.default_rng(0)
jobs = []
for i, n in enumerate(m.graph.node):
    if n.op_type not in ("Transpose", "Concat", "Split", "MaxPool", "Resize"): continue
    ins, feeds, init = [], {}, []
    for k, name in enumerate(n.input):
        if not name: ins.append(""); continue
        if name in inits: init.append(inits[name]); ins.append(name); continue
        s = shapes.get(name)
        if not s or 0 in s: break
        feeds[name] = rng.standard_normal(s).astype(np.float32); ins.append(name)
    else:
        vi = [helper.make_tensor_value_info(k, TP.FLOAT, list(v.shape)) for k, v in feeds.items()]
        outs = [helper.make_tensor_value_info(o, TP.FLOAT, None) for o in n.output]
        g = helper.make_graph([n], "g", vi, outs, initializer=init)
        mm = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        desc = f"{i}:{n.op_type} " + " ".join(str(shapes.get(x)) for x in n.input if x and x not in inits) + " " + ",".join(f"{a.name}={helper.get_attribute_value(a)}" for a in n.attribute if a.name in ("perm", "axis"))
        jobs.append((desc, mm, Inputs(feeds=feeds, seed=0, source="probe")))
cfg = BenchConfig(device="cuda", warmup=5, time_budget_s=0.1, min_iterations=20)
res = time_models(jobs, cfg, rounds=1)
tot = {}
for (d, _, _), r in zip(jobs, res):
    log(f"{r.stats.median_ms:8.4f}  {d}")
    op = d.split(":")[1].split()[0]; tot[op] = tot.get(op, 0) + r.stats.median_ms
log("totals", {k: round(v, 3) for k, v in tot.items()})
