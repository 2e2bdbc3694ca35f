#!/usr/bin/env python3
"""Host cost per node: a chain of N FusedElementwise(Neg) nodes against N native Neg nodes.

At batch 1 and without CUDA graphs a model's latency is mostly ONNX Runtime's per-node host work, so
the custom op's own per-call cost (reading shapes, the broadcast layout, allocating outputs) decides
whether fusing two ops into one pays. The tensors are tiny (16 floats) so the arithmetic is nothing and
what is timed is the call path. Best of 5 repetitions of 100 runs, microseconds per node.

    python benchmarks/host_overhead.py                 # CPU provider
    python benchmarks/host_overhead.py --device cuda   # CUDA provider (includes the kernel launch)
    python benchmarks/host_overhead.py --hogs 0,2,4    # beside N processes spinning on the CPU

``--hogs N,...`` times both chains again beside N processes that only spin on the CPU (a loaded host:
docs/benchmarks.md 5.63, where an optimized model lost more than its original on a busy GPU machine), and
reports the median of 60 repetitions besides the best of them: under time slicing the best run hides what
a busy host costs.

Never imported by the package.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from onnxfuse.custom_ops import DOMAIN, OPSET_VERSION, make_node, session_options

NEG = "onnxfuse.elementwise 1\ninput x0: float32\nt0: float32 = Neg(x0)\noutput t0\n"


def chain(n: int, fused: bool) -> onnx.ModelProto:
    nodes, x = [], "x"
    for i in range(n):
        y = f"y{i}"
        nodes.append(make_node(NEG, [x], [y], name=f"n{i}") if fused else helper.make_node("Neg", [x], [y]))
        x = y
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 16])])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(DOMAIN, OPSET_VERSION)] if fused else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def spin(stop_at: float) -> None:
    """Busy-loop on one core until ``stop_at`` (time.time())."""
    x = 0
    while time.time() < stop_at:
        x += 1


@contextlib.contextmanager
def spinning(count: int, limit_s: float = 600.0):
    """``count`` processes spinning on the CPU (:func:`spin`) for the ``with`` block, stopped when it ends
    (``limit_s``: they stop by themselves after that, should the block's process die first). Used by
    ``probes/host_contention.py`` too."""
    procs = [multiprocessing.Process(target=spin, args=(time.time() + limit_s,), daemon=True) for _ in range(count)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
            p.join()


def per_node_us(model: onnx.ModelProto, fused: bool, device: str, nodes: int, reps: int = 5) -> tuple[float, float]:
    """(best, median) microseconds per node over ``reps`` repetitions of 100 runs."""
    so = session_options() if fused else ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    feed = {"x": np.ones((1, 16), np.float32)}
    for _ in range(50):
        sess.run(None, feed)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(100):
            sess.run(None, feed)
        times.append((time.perf_counter() - t0) / 100 / nodes * 1e6)
    return min(times), float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=400)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--hogs", default=None, help="comma list: time beside N CPU-spinning processes (0: alone)")
    args = ap.parse_args()
    plain, fusedm = chain(args.nodes, False), chain(args.nodes, True)
    if args.hogs is None:
        native, _ = per_node_us(plain, False, args.device, args.nodes)
        fused, _ = per_node_us(fusedm, True, args.device, args.nodes)
        print(f"{args.device}: native Neg {native:.3f} us/node, FusedElementwise {fused:.3f} us/node "
              f"(+{fused - native:.3f} us), onnxruntime {ort.__version__}")
        return 0
    for hogs in [int(h) for h in args.hogs.split(",")]:
        with spinning(hogs):
            native = per_node_us(plain, False, args.device, args.nodes, reps=60)
            fused = per_node_us(fusedm, True, args.device, args.nodes, reps=60)
        print(f"{args.device}, {hogs} spinning: native Neg {native[1]:.3f} us/node median ({native[0]:.3f} best), "
              f"FusedElementwise {fused[1]:.3f} ({fused[0]:.3f}), onnxruntime {ort.__version__}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
