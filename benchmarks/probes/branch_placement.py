"""Probe (issue 31; run from the repository root on the GPU machine): which ONNX Runtime provider runs each
op inside an If branch. docs/benchmarks.md 5.32 found a custom op (DecodeAttention) inside a branch run on
the CPU provider; onnxfuse/bodies.py therefore runs only ONNX Runtime's own contrib ops' rules in bodies,
while fuse-elementwise has always put FusedElementwise (a custom op) there. This prints, for optimum's
merged T5 decoder (testdata) before and after ``onnxfuse.optimize``, the nodes per (op, provider) from ONNX
Runtime's profile of one run on each branch, and the median time per run of each model on each branch.

    python benchmarks/probes/branch_placement.py [MODEL.onnx]
"""
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import onnxfuse  # noqa: E402
from onnxfuse.custom_ops import session_options  # noqa: E402
from test_subgraph_names import _feeds  # noqa: E402  (the merged decoder's inputs on either branch)


def placement(model, feeds) -> Counter:
    options = session_options()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "p")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
    session.run(None, feeds)
    found = Counter()
    for event in json.load(open(session.end_profiling())):
        args = event.get("args", {})
        if event.get("cat") == "Node" and "op_name" in args and event.get("name", "").endswith("_kernel_time"):
            found[(args["op_name"], args.get("provider", "?"))] += 1
    return found


def median_ms(model, feeds, runs=200) -> float:
    session = ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CUDAExecutionProvider"])
    for _ in range(20):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "testdata/optimum_t5_decoder_merged.onnx")
    original = onnx.load(path)
    optimized = onnxfuse.optimize(original, bench=False).model
    for use_cache in (False, True):
        feeds = _feeds(use_cache)
        for name, model in (("original", original), ("onnxfuse", optimized)):
            counts = placement(model, feeds)
            on_cpu = sorted(f"{op}×{n}" for (op, p), n in counts.items() if p != "CUDAExecutionProvider")
            print(f"use_cache_branch={use_cache} {name}: {median_ms(model, feeds):.3f} ms per run; "
                  f"{sum(counts.values())} nodes run, not on CUDA: {', '.join(on_cpu) or 'none'}", flush=True)


if __name__ == "__main__":
    main()
