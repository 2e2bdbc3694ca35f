"""ChannelTranspose against ONNX Runtime's Transpose and a device copy, on the few-channel layout changes
at a channels-last region's boundary (issue 34; the op: onnxfuse/rewrites/contrib/contrib_channel_transpose.py).

For each case, one-node models: ONNX ``Transpose`` (perm [0, 2, 3, 1] or [0, 3, 1, 2]) and
``ai.onnxfuse.ChannelTranspose`` (``to=nhwc`` / ``to=nchw``), each checked bit-equal to torch's
``permute().contiguous()`` of the same tensor, then timed with ``benchmarks/kernels.py``'s harness
(IOBinding on torch buffers, ONNX Runtime on a torch stream, CUDA events around batches of runs that do
not synchronise), beside a device-to-device copy of the same bytes (the floor). Cases: the YOLO-style
detector's input [16, 3, 640, 640] into NHWC (0.325 ms in ONNX Runtime on an H200, docs/benchmarks.md
5.27), its 27-channel head back to NCHW, and 8 and 16 channels, in float32 and float16.

Run on the GPU machine from the repository root (onnxruntime-gpu and torch importable):

    python3 benchmarks/probes/channel_transpose.py --out $OUT/channel_transpose.json

torch makes the buffers, streams and events only; onnxfuse never imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

from kernels import Harness  # noqa: E402  (benchmarks/kernels.py: the timing harness its table comes from)
from onnxfuse.custom_ops import DOMAIN  # noqa: E402

#: (direction, shape of x): the YOLO-style input (N, C, H, W) and head (N, H, W, C), then 8 and 16 channels.
CASES = [("nhwc", (16, 3, 640, 640)), ("nchw", (16, 80, 80, 27)), ("nhwc", (16, 8, 320, 320)),
         ("nhwc", (16, 16, 160, 160)), ("nchw", (16, 160, 160, 16))]
PERMS = {"nhwc": [0, 2, 3, 1], "nchw": [0, 3, 1, 2]}
ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


def one_node(direction: str, shape, dtype: str, ours: bool) -> onnx.ModelProto:
    out = [shape[p] for p in PERMS[direction]]
    node = (helper.make_node("ChannelTranspose", ["x"], ["y"], domain=DOMAIN, spec=f"to={direction}") if ours
            else helper.make_node("Transpose", ["x"], ["y"], perm=PERMS[direction]))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", ELEM[dtype], list(shape))],
                              [helper.make_tensor_value_info("y", ELEM[dtype], out)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=8)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--batch", type=int, default=20, help="runs per timed batch")
    args = ap.parse_args(argv)
    h = Harness(torch, batch=args.batch, batches=args.batches, host_runs=20, warmup=10, cuda_graph=False)
    rows = []
    for dtype in ("float32", "float16"):
        for direction, shape in CASES:
            x = torch.randn(shape, device="cuda").to(getattr(torch, dtype))
            want = x.permute(*PERMS[direction]).contiguous()
            row = {"dtype": dtype, "direction": direction, "shape": list(shape)}
            bits = torch.int16 if dtype == "float16" else torch.int32  # compared as bits: NaN == NaN
            for label, ours in (("ort_transpose", False), ("channel_transpose", True)):
                r = h.time_ort(one_node(direction, shape, dtype, ours), ours, {"x": x}, want.shape, dtype)
                row[f"{label}_ms"] = r["gpu_ms"]
                row[f"{label}_exact"] = bool(torch.equal(r["y"].view(bits), want.view(bits)))
            row["copy_ms"] = h.time_copy(x.numel() * x.element_size())["gpu_ms"]
            rows.append(row)
            print(f"{dtype:8s} {direction} {str(shape):22s} copy {row['copy_ms']:.4f}  ORT {row['ort_transpose_ms']:.4f} "
                  f"({row['ort_transpose_exact']})  ours {row['channel_transpose_ms']:.4f} "
                  f"({row['channel_transpose_exact']})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0 if all(r["channel_transpose_exact"] and r["ort_transpose_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
