"""Kernel benchmark: FusedElementwise's CUDA kernel vs the unfused ONNX Runtime graph vs a copy.

For float32 and float16 at 1M, 16M and 64M elements (and bfloat16 at the largest size):

* ``copy``    - a device-to-device copy of the same bytes (torch ``copy_``): the memory-bound floor;
* ``unfused`` - ``tanh(x*sigmoid(x)*0.5+1)`` as standard ONNX ops on ONNX Runtime's CUDA provider,
  ORT_ENABLE_ALL;
* ``fused``   - the same computation as one FusedElementwise node (ORT_ENABLE_ALL), its launch shape
  tuned on the first run (block size and items per thread, ``csrc/launch_tuning.h``); also timed first
  with the default launch (``ONNXFUSE_LAUNCH_TUNING=0``: 256 threads, one item per thread), in the same
  process, and checked bit-equal to it;

plus a broadcast case (per-channel scale and bias on NCHW: ``x*s+b``, s/b of shape [1,C,1,1]) at 16M
and 64M elements (at 16M a run can be shorter than ONNX Runtime's per-run host overhead, ~0.09 ms,
which the CUDA-event timing then measures instead: see the 1M rows; ``--cuda-graph`` removes most of it).

Every ONNX Runtime variant goes through the same harness: IOBinding on GPU-resident buffers (torch
tensors), ONNX Runtime launching on a torch stream (``user_compute_stream``), warm-up, then
(a) GPU time: CUDA events around a batch of runs that do not synchronise, divided by the batch,
median of several batches; (b) host time: median wall time of synchronised single runs. With
``--cuda-graph`` the ORT sessions also use CUDA graphs (less launch overhead). The copy is timed
with CUDA events the same way. Also measured, in fresh processes: the first NVRTC compile of a
kernel and its load from the disk cache.

    python benchmarks/kernels.py --out results/kernels.json [--cuda-graph] [--quick] [--chain 16]

``--chain K`` puts K copies of each computation in one model, each reading the one before (and times K
copies per timed copy): the per-run host cost is then spread over K kernels, as in a real model, and
the time per copy is the kernel's (with ``--cuda-graph``, nearly nothing else).

torch is used here only (buffers, streams, events); onnxfuse itself never imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from onnxfuse.custom_ops import DOMAIN, OPSET_VERSION, make_node, session_options  # noqa: E402
from onnxfuse.custom_ops import native as codegen  # noqa: E402

SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
DTYPES = ["float32", "float16"]
ONNX_T = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
NP_T = {"float32": np.float32, "float16": np.float16}
# IOBinding element types: numpy has no bfloat16, ORT takes the ONNX element type (an int) instead.
BIND_T = {"float32": np.float32, "float16": np.float16, "bfloat16": TensorProto.BFLOAT16}
ES = {"float32": 4, "float16": 2, "bfloat16": 2}


def chain_program(dtype: str) -> str:
    return textwrap.dedent(f"""\
        onnxfuse.elementwise 1
        input x: {dtype}
        const half: {dtype} = 0.5
        const one: {dtype} = 1
        t0: {dtype} = Sigmoid(x)
        t1: {dtype} = Mul(x, t0)
        t2: {dtype} = Mul(t1, half)
        t3: {dtype} = Add(t2, one)
        y: {dtype} = Tanh(t3)
        output y
        """)


def scale_bias_program(dtype: str) -> str:
    return textwrap.dedent(f"""\
        onnxfuse.elementwise 1
        input x: {dtype}
        input s: {dtype}
        input b: {dtype}
        t0: {dtype} = Mul(x, s)
        y: {dtype} = Add(t0, b)
        output y
        """)


def _model(nodes, inputs, outputs, inits=(), fused=False) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "bench", inputs, outputs, list(inits))
    ops = [helper.make_opsetid("", 20)] + ([helper.make_opsetid(DOMAIN, OPSET_VERSION)] if fused else [])
    return helper.make_model(g, opset_imports=ops, ir_version=10)


def _links(repeat: int):
    """(input, output) names of ``repeat`` copies of a computation, each reading the one before: one
    run then launches ``repeat`` kernels, so ONNX Runtime's per-run host cost (~0.05-0.09 ms) is spread
    over them and the per-kernel time is what a node of a real model costs (``--chain``)."""
    names = ["x"] + [f"y{k}" for k in range(1, repeat)] + ["y"]
    return list(zip(names[:-1], names[1:]))


def chain_models(dtype: str, n: int, repeat: int = 1):
    T = ONNX_T[dtype]
    vi = [helper.make_tensor_value_info("x", T, [n])], [helper.make_tensor_value_info("y", T, [n])]
    inits = [helper.make_tensor("half", T, [], [0.5]), helper.make_tensor("one", T, [], [1.0])]
    unfused_nodes, fused_nodes = [], []
    for k, (a, y) in enumerate(_links(repeat)):
        t = [f"t{k}_{i}" for i in range(4)]
        unfused_nodes += [helper.make_node("Sigmoid", [a], [t[0]]), helper.make_node("Mul", [a, t[0]], [t[1]]),
                          helper.make_node("Mul", [t[1], "half"], [t[2]]), helper.make_node("Add", [t[2], "one"], [t[3]]),
                          helper.make_node("Tanh", [t[3]], [y])]
        fused_nodes.append(make_node(chain_program(dtype), [a], [y]))
    unfused = _model(unfused_nodes, *vi, inits)
    fused = _model(fused_nodes, *vi, fused=True)
    return unfused, fused, {"x": (n,)}, (n,)


def scale_bias_models(dtype: str, shape, repeat: int = 1):
    T = ONNX_T[dtype]
    c = shape[1]
    ins = [helper.make_tensor_value_info("x", T, list(shape)), helper.make_tensor_value_info("s", T, [1, c, 1, 1]),
           helper.make_tensor_value_info("b", T, [1, c, 1, 1])]
    outs = [helper.make_tensor_value_info("y", T, list(shape))]
    unfused_nodes, fused_nodes = [], []
    for k, (a, y) in enumerate(_links(repeat)):
        unfused_nodes += [helper.make_node("Mul", [a, "s"], [f"t{k}"]), helper.make_node("Add", [f"t{k}", "b"], [y])]
        fused_nodes.append(make_node(scale_bias_program(dtype), [a, "s", "b"], [y]))
    unfused = _model(unfused_nodes, ins, outs)
    fused = _model(fused_nodes, ins, outs, fused=True)
    return unfused, fused, {"x": shape, "s": (1, c, 1, 1), "b": (1, c, 1, 1)}, shape


# ----------------------------------------------------------------------------------------- harness

class Harness:
    def __init__(self, torch, batch: int, batches: int, host_runs: int, warmup: int, cuda_graph: bool):
        self.torch = torch
        self.stream = torch.cuda.Stream()
        self.batch, self.batches, self.host_runs, self.warmup = batch, batches, host_runs, warmup
        self.cuda_graph = cuda_graph

    def events_ms(self, fn) -> float:
        """Median over batches of (CUDA-event time of `batch` back-to-back calls) / batch."""
        torch = self.torch
        res = []
        with torch.cuda.stream(self.stream):
            for _ in range(self.batches):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                for _ in range(self.batch):
                    fn()
                end.record(self.stream)
                end.synchronize()
                res.append(start.elapsed_time(end) / self.batch)
        return statistics.median(res)

    def time_copy(self, nbytes: int, repeat: int = 1) -> dict:
        """A device-to-device copy of ``nbytes``, ``repeat`` times per timed call (as the ORT models of
        ``--chain`` repeat their computation), time per copy."""
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def copies():
            for _ in range(repeat):
                dst.copy_(src)

        with torch.cuda.stream(self.stream):
            for _ in range(self.warmup):
                copies()
        self.stream.synchronize()
        ms = self.events_ms(copies) / repeat
        return {"gpu_ms": ms, "bytes": 2 * nbytes}

    def session(self, model: onnx.ModelProto, fused: bool):
        so = session_options() if fused else ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3
        opts = {"user_compute_stream": str(self.stream.cuda_stream)}
        if self.cuda_graph:
            opts["enable_cuda_graph"] = "1"
        t0 = time.perf_counter()
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=[("CUDAExecutionProvider", opts)])
        created = time.perf_counter() - t0
        if "CUDAExecutionProvider" not in sess.get_providers():
            raise SystemExit("ONNX Runtime could not use the CUDA provider")
        return sess, created

    def time_ort(self, model, fused: bool, tensors: dict, out_shape, dtype: str) -> dict:
        torch = self.torch
        sess, created = self.session(model, fused)
        io = sess.io_binding()
        for name, t in tensors.items():
            io.bind_input(name, "cuda", 0, BIND_T[dtype], list(t.shape), t.data_ptr())
        y = torch.empty(out_shape, dtype=getattr(torch, dtype), device="cuda")
        io.bind_output("y", "cuda", 0, BIND_T[dtype], list(out_shape), y.data_ptr())
        nosync = ort.RunOptions()
        nosync.add_run_config_entry("disable_synchronize_execution_providers", "1")
        for _ in range(self.warmup):
            sess.run_with_iobinding(io)
        host = []
        for _ in range(self.host_runs):
            t0 = time.perf_counter()
            sess.run_with_iobinding(io)
            host.append((time.perf_counter() - t0) * 1e3)
        gpu = self.events_ms(lambda: sess.run_with_iobinding(io, nosync))
        return {"gpu_ms": gpu, "host_ms": statistics.median(host), "session_create_s": created, "y": y}


# ---------------------------------------------------------------------------------- compile times

_CHILD = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {root!r})
    import numpy as np, onnxruntime as ort
    from onnx import TensorProto, helper
    from onnxfuse.custom_ops import DOMAIN, make_node, native as codegen, session_options
    text = {text!r}
    g = helper.make_graph([make_node(text, ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)],
                          ir_version=10)
    so = session_options(); so.log_severity_level = 3
    t0 = time.perf_counter()
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CUDAExecutionProvider"])
    t1 = time.perf_counter()
    s.run(None, {{"x": np.ones(1024, np.float32)}})
    print(json.dumps(dict(codegen.kernel_stats(), session_create_s=t1 - t0)))
""")


def compile_times() -> dict:
    text = chain_program("float32").replace("0.5", repr(float(np.random.default_rng().uniform(0.1, 0.9))))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, XDG_CACHE_HOME=cache)
        env.pop("ONNXFUSE_KERNEL_CACHE", None)
        runs = []
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(ROOT), text=text)], env=env,
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                return {"error": r.stderr[-2000:]}
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = runs
    return {"first_compile_ms": first["last_compile_ms"], "first_session_create_s": first["session_create_s"],
            "cached_load_ms": second["last_disk_load_ms"], "cached_session_create_s": second["session_create_s"],
            "first_stats": first, "second_stats": second}


# -------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write results as JSON here")
    ap.add_argument("--cuda-graph", action="store_true", help="ORT sessions with enable_cuda_graph")
    ap.add_argument("--quick", action="store_true", help="fewer runs (smoke test)")
    ap.add_argument("--sizes", type=lambda s: [int(float(v)) for v in s.split(",")], default=SIZES,
                    help="comma-separated element counts (default 1M,4M,16M,64M)")
    ap.add_argument("--chain", type=int, default=1, metavar="K",
                    help="K copies of each computation in one model, each reading the last (and K copies "
                         "per timed copy): times are per copy, ONNX Runtime's per-run host cost spread "
                         "over K kernels as in a real model (default 1: one node per run)")
    args = ap.parse_args()

    import torch  # only here: buffers, streams and events for timing

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (torch.cuda.is_available() is False)")
    ort.set_default_logger_severity(3)
    h = Harness(torch, batch=5 if args.quick else 20, batches=3 if args.quick else 9,
                host_runs=10 if args.quick else 50, warmup=3 if args.quick else 10, cuda_graph=args.cuda_graph)
    rows = []
    plan = []  # (dtype, case name, elements, models thunk)
    for dtype in DTYPES + ["bfloat16"]:
        sizes = args.sizes if dtype in DTYPES else [max(args.sizes)]  # bfloat16: the largest size only
        for n in sizes:
            plan.append((dtype, "tanh(x*sigmoid(x)*0.5+1)", n, lambda d=dtype, n=n: chain_models(d, n, args.chain)))
        if dtype in DTYPES:
            for nchw in [(32, 64, 64, 32), (32, 64, 128, 64), (32, 64, 256, 128)]:  # 4M, 16M and 64M elements
                plan.append((dtype, f"x*s+b, s,b per channel [1,64,1,1], x [{','.join(map(str, nchw))}]",
                             int(np.prod(nchw)), lambda d=dtype, s=nchw: scale_bias_models(d, s, args.chain)))
    for dtype, name, n, models in plan:
        tdt = getattr(torch, dtype)
        es = ES[dtype]
        unfused, fused, in_shapes, out_shape = models()
        try:
            g = torch.Generator(device="cuda").manual_seed(0)
            tensors = {k: torch.randn(s, generator=g, device="cuda", dtype=tdt) for k, s in in_shapes.items()}
            if "s" in tensors:  # |s| <= 1 keeps a --chain of x*s+b finite in float16
                tensors["s"] = torch.tanh(tensors["s"])
            in_bytes = sum(int(np.prod(s)) * es for s in in_shapes.values())
            moved = in_bytes + n * es  # bytes read + written by an ideal kernel
            copy = h.time_copy(moved // 2, args.chain)
            u = h.time_ort(unfused, False, tensors, out_shape, dtype)
            # The default launch first (tuning off: nothing is recorded), then a session that tunes on
            # its first run (the module's decision is kept for the rest of the process).
            os.environ["ONNXFUSE_LAUNCH_TUNING"] = "0"
            f0 = h.time_ort(fused, True, tensors, out_shape, dtype)
            os.environ["ONNXFUSE_LAUNCH_TUNING"] = "1"
            tunings = codegen.kernel_stats()["launch_tunings"]
            f = h.time_ort(fused, True, tensors, out_shape, dtype)
            stats = codegen.kernel_stats()
            launch = stats["last_launch_tuning"] if stats["launch_tunings"] > tunings else None
            u["gpu_ms"] /= args.chain  # per copy of the computation
            f["gpu_ms"] /= args.chain
            f0["gpu_ms"] /= args.chain
            same = bool(torch.equal(f["y"], f0["y"]))
            err = (f["y"].float() - u["y"].float()).abs().max().item()
            row = {
                "case": name, "dtype": dtype, "elements": n, "bytes_moved": moved,
                "copy_ms": copy["gpu_ms"], "copy_GBps": moved / copy["gpu_ms"] / 1e6,
                "unfused_ms": u["gpu_ms"], "unfused_host_ms": u["host_ms"],
                "fused_ms": f["gpu_ms"], "fused_host_ms": f["host_ms"],
                "fused_GBps": moved / f["gpu_ms"] / 1e6,
                "fused_vs_copy": copy["gpu_ms"] / f["gpu_ms"],
                "speedup_vs_unfused": u["gpu_ms"] / f["gpu_ms"],
                "fused_session_create_s": f["session_create_s"],
                "max_abs_diff_vs_unfused": err,
                "default_launch_ms": f0["gpu_ms"], "default_launch_vs_copy": copy["gpu_ms"] / f0["gpu_ms"],
                "tuned_vs_default": f0["gpu_ms"] / f["gpu_ms"], "launch": launch,
                "tuned_output_equals_default": same,
            }
            rows.append(row)
            print(f"{dtype:8s} {n:>10d} {name[:28]:28s} copy {row['copy_ms']:.4f} ms  unfused {row['unfused_ms']:.4f} ms"
                  f"  fused {row['fused_ms']:.4f} ms  ({row['fused_vs_copy']:.0%} of copy speed; default launch "
                  f"{row['default_launch_vs_copy']:.0%}){'' if same else '  OUTPUT DIFFERS'}", flush=True)
            del tensors, u, f, f0
            torch.cuda.empty_cache()
        except Exception as e:  # e.g. bfloat16 kernels ONNX Runtime's CUDA provider lacks
            print(f"{dtype:8s} {n:>10d} {name[:28]:28s} FAILED: {str(e).splitlines()[0][:200]}", flush=True)
            torch.cuda.empty_cache()

    ct = compile_times()
    env = {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
           "onnxruntime": ort.__version__, "torch": torch.__version__, "python": platform.python_version(),
           "cuda_graph": args.cuda_graph, "chain": args.chain, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv)}

    print(f"\n### FusedElementwise kernels — {env['gpu']}, onnxruntime {env['onnxruntime']}"
          f"{', CUDA graphs' if args.cuda_graph else ''}{f', chains of {args.chain}' if args.chain > 1 else ''}\n")
    print(f"GPU time per {'copy of the computation' if args.chain > 1 else 'run'} (CUDA events, median); "
          "GB/s counts bytes read + written.\n")
    print("| case | dtype | elements | copy ms (GB/s) | unfused ms | fused ms (GB/s) | fused / copy speed | "
          "default launch / copy | launch kept | speed-up vs unfused | unfused host ms | fused host ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        kept = (f"{r['launch']['threads']}×{r['launch']['items_per_thread']}" if r["launch"] else "untuned")
        print(f"| {r['case']} | {r['dtype']} | {r['elements']:,} | {r['copy_ms']:.4f} ({r['copy_GBps']:.0f}) | "
              f"{r['unfused_ms']:.4f} | {r['fused_ms']:.4f} ({r['fused_GBps']:.0f}) | {r['fused_vs_copy']:.0%} | "
              f"{r['default_launch_vs_copy']:.0%} | {kept} | "
              f"{r['speedup_vs_unfused']:.2f}x | {r['unfused_host_ms']:.3f} | {r['fused_host_ms']:.3f} |")
    print("\nlaunch kept: threads per block × items per thread that launch tuning kept (256×1 is the default).")
    if "error" in ct:
        print(f"\ncompile-time measurement failed: {ct['error']}")
    else:
        print(f"\nNVRTC first compile: {ct['first_compile_ms']:.1f} ms (session creation "
              f"{ct['first_session_create_s'] * 1e3:.0f} ms); disk-cache load in a fresh process: "
              f"{ct['cached_load_ms']:.2f} ms (session creation {ct['cached_session_create_s'] * 1e3:.0f} ms)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"environment": env, "results": rows, "compile": ct}, indent=2))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
