"""Probe (docs/benchmarks.md 5.27; run from the repository root on the GPU machine with $OUT set): YOLO b16 fp32 - 1x1 NhwcConv as MatMul (a GEMM) vs cuDNN; kernel-level profile of ORT runs."""
import os, subprocess, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
import numpy as np, onnx
from onnx import helper, numpy_helper
import zoo
from onnxfuse.timing import BenchConfig, time_models
from onnxfuse.runtime.inputs import Inputs
from onnxfuse.custom_ops import session_options

out = Path(os.environ["OUT"]) / "r"; out.mkdir(parents=True, exist_ok=True)
def log(*a):
    print(*a, flush=True)
    with open(out / "probe2.log", "a") as f: print(*a, file=f)

def attr(n, name, default):
    for a in n.attribute:
        if a.name == name: return helper.get_attribute_value(a)
    return default

def gemm_1x1(m):
    m = onnx.ModelProto.FromString(m.SerializeToString())
    inits = {i.name: i for i in m.graph.initializer}
    nodes, changed = [], 0
    for n in m.graph.node:
        w = inits.get(n.input[1]) if n.op_type == "NhwcConv" and len(n.input) > 1 else None
        if w is not None and list(w.dims[1:3]) == [1, 1] and attr(n, "group", 1) == 1 and set(attr(n, "strides", [1, 1])) == {1} \
                and not any(attr(n, "pads", [0, 0, 0, 0])) and attr(n, "auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET"):
            wa = numpy_helper.to_array(w).reshape(w.dims[0], w.dims[3]).T.copy()  # [C, M]
            name = n.input[1] + "_gemm"
            m.graph.initializer.append(numpy_helper.from_array(wa, name))
            if len(n.input) > 2 and n.input[2]:
                mid = n.output[0] + "_mm"
                nodes += [helper.make_node("MatMul", [n.input[0], name], [mid]), helper.make_node("Add", [mid, n.input[2]], [n.output[0]])]
            else:
                nodes.append(helper.make_node("MatMul", [n.input[0], name], [n.output[0]]))
            changed += 1
        else:
            nodes.append(n)
    del m.graph.node[:]; m.graph.node.extend(nodes)
    return m, changed

spec = zoo.SPECS["yolo_silu"]
mod = zoo.build_module(spec)
p = Path("/tmp/y.onnx")
if not p.exists(): zoo.export(spec, mod, p, 14)
if not Path("/tmp/y.opt.onnx").exists():
    subprocess.run([sys.executable, "-m", "onnxfuse", "optimize", str(p), "/tmp/y.opt.onnx", "--shape", "images:16,3,640,640", "--force", "--quiet"])
orig, opt = onnx.load(str(p)), onnx.load("/tmp/y.opt.onnx")
g, k = gemm_1x1(opt)
log("1x1 convs as MatMul:", k)
x = np.random.default_rng(0).standard_normal((16, 3, 640, 640)).astype(np.float32)
feeds = {"images": x}
import onnxruntime as ort
sess = lambda mm: ort.InferenceSession(mm.SerializeToString(), session_options(), providers=["CUDAExecutionProvider"])
a, b = sess(opt).run(None, feeds)[0], sess(g).run(None, feeds)[0]
log("max abs diff gemm vs conv:", float(np.abs(a - b).max()), "scale", float(np.abs(a).max()))
cfg = BenchConfig(device="cuda", warmup=10, time_budget_s=0.5, min_iterations=20)
for rnd in range(2):
    res = time_models([(nm, mm, Inputs(feeds=feeds, seed=0, source="probe")) for nm, mm in [("orig", orig), ("opt", opt), ("opt_gemm1x1", g)]], cfg, rounds=3)
    log("timing", {r.name if hasattr(r, "name") else i: round(r.stats.median_ms, 3) for i, r in enumerate(res)})
from torch.profiler import profile, ProfilerActivity
for nm, mm in [("opt", opt), ("opt_gemm1x1", g)]:
    s = sess(mm)
    xb = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    io = s.io_binding(); io.bind_ortvalue_input("images", xb); io.bind_output(s.get_outputs()[0].name, "cuda")
    for _ in range(5): s.run_with_iobinding(io)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10): s.run_with_iobinding(io)
    (out / f"ort_prof_{nm}.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=100))
log("done")
