#!/usr/bin/env python3
"""Host cost per node: a chain of N FusedElementwise(Neg) nodes against N native Neg nodes.

At batch 1 and without CUDA graphs a model's latency is mostly ONNX Runtime's per-node host work, so
the custom op's own per-call cost (reading shapes, the broadcast layout, allocating outputs) decides
whether fusing two ops into one pays. The tensors are tiny (16 floats) so the arithmetic is nothing and
what is timed is the call path. Best of 5 repetitions of 100 runs, microseconds per node.

    python benchmarks/host_overhead.py                 # CPU provider
    python benchmarks/host_overhead.py --device cuda   # CUDA provider (includes the kernel launch)

Never imported by the package.
"""

from __future__ import annotations

import argparse
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


def per_node_us(model: onnx.ModelProto, fused: bool, device: str, nodes: int) -> float:
    so = session_options() if fused else ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = 1
    providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=providers)
    feed = {"x": np.ones((1, 16), np.float32)}
    for _ in range(50):
        sess.run(None, feed)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(100):
            sess.run(None, feed)
        best = min(best, (time.perf_counter() - t0) / 100 / nodes * 1e6)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=400)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    native = per_node_us(chain(args.nodes, False), False, args.device, args.nodes)
    fused = per_node_us(chain(args.nodes, True), True, args.device, args.nodes)
    print(f"{args.device}: native Neg {native:.3f} us/node, FusedElementwise {fused:.3f} us/node "
          f"(+{fused - native:.3f} us), onnxruntime {ort.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
