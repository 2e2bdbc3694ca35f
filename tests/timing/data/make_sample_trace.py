"""Regenerate sample_trace_cpu.json: ONNX Runtime's CPU profiler trace of a tiny Conv→Relu→Add model,
1 warm-up run + 3 profiled runs. Run from the repo root: ``python tests/timing/data/make_sample_trace.py``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_models import conv_relu_add  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    model = conv_relu_add()
    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.enable_profiling = True
        opts.profile_file_prefix = os.path.join(tmp, "ort")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
        for _ in range(4):
            sess.run(None, {"x": x})
        events = json.loads(Path(sess.end_profiling()).read_text())
    for e in events:  # machine-specific details are not needed by the tests
        e["pid"] = 1
        e["tid"] = 1
        e.get("args", {}).pop("thread_scheduling_stats", None)
    (HERE / "sample_trace_cpu.json").write_text(json.dumps(events, indent=0) + "\n")


if __name__ == "__main__":
    main()
