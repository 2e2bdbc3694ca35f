"""Probe: one DecodeAttention node against one MultiHeadAttention over the same grouped rows (the If's two
branches), float16 on CUDA, at the decode benchmark's shapes (Qwen2-0.5B: 2 key/value heads of 64, 7 query
heads each). Per op and shape: the GPU time of its kernels per run (CUPTI, through torch's profiler,
over 50 IOBinding runs) and the K/V bytes it reads over that time; and the wall time per run (median of
200, with ONNX Runtime's host work).

    python benchmarks/probes/decode_attention_kernel.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h

from onnxfuse.custom_ops import DOMAIN, session_options
from onnxfuse.rewrites.contrib.contrib_decode_attention import MAX_ROWS

G, N, D = 2, 7, 64


def model(op: str, batch: int, keys: int):
    rows = N
    inputs = [h.make_tensor_value_info("query", TP.FLOAT16, [batch, rows, G * D]),
              h.make_tensor_value_info("key", TP.FLOAT16, [batch, G, keys, D]),
              h.make_tensor_value_info("value", TP.FLOAT16, [batch, G, keys, D])]
    if op == "DecodeAttention":
        inputs.append(h.make_tensor_value_info("bias", TP.FLOAT16, [batch, 1, 1, keys]))
        node = h.make_node(op, ["query", "key", "value", "bias"], ["out", "scratch"], domain=DOMAIN,
                           spec=f"num_heads={G * N} kv_num_heads={G} head_size={D} scale=0.125 "
                                f"max_rows={MAX_ROWS}")
    else:
        inputs.append(h.make_tensor_value_info("bias", TP.FLOAT16, [batch, 1, rows, keys]))
        node = h.make_node(op, ["query", "key", "value", "", "", "bias"], ["out"], domain="com.microsoft",
                           num_heads=G, scale=0.125)
    graph = h.make_graph([node], "g", inputs, [h.make_tensor_value_info("out", TP.FLOAT16, None)])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1),
                                              h.make_opsetid("com.microsoft", 1)], ir_version=8)


def bound_session(op: str, batch: int, keys: int):
    session = ort.InferenceSession(model(op, batch, keys).SerializeToString(), session_options(),
                                   providers=["CUDAExecutionProvider"])
    rng = np.random.default_rng(0)
    binding = session.io_binding()
    for i in session.get_inputs():
        binding.bind_ortvalue_input(i.name, ort.OrtValue.ortvalue_from_numpy(
            rng.standard_normal(list(i.shape)).astype(np.float16), "cuda", 0))
    binding.bind_output("out", "cuda")
    return session, binding


def wall_ms(session, binding, runs: int = 200) -> float:
    times = []
    for _ in range(runs + 20):
        binding.synchronize_inputs()
        t0 = time.perf_counter()
        session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append(time.perf_counter() - t0)
    return float(np.median(times[20:]) * 1e3)


def kernel_us(session, binding, runs: int = 50) -> dict:
    """GPU time per run of each kernel the op launched (CUPTI through torch's profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if "cuda" in str(getattr(e, "device_type", "")).lower():
            took = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0) or 0
            per[e.name[:60]] = per.get(e.name[:60], 0.0) + took / runs
    return {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for batch, keys in ((1, 1025), (1, 4097), (8, 1025), (8, 4097)):
        kv_bytes = 2 * batch * G * keys * D * 2
        row = {"batch": batch, "keys": keys, "kv_MB": round(kv_bytes / 1e6, 2)}
        for op in ("DecodeAttention", "MultiHeadAttention"):
            session, binding = bound_session(op, batch, keys)
            kernels = kernel_us(session, binding)
            busy = sum(kernels.values())
            row[op] = {"wall_ms": round(wall_ms(session, binding), 4), "gpu_us": round(busy, 2),
                       "GB_per_s": round(kv_bytes / (busy * 1e3), 1) if busy else None, "kernels_us": kernels}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
