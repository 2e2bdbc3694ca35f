"""Global average pooling of a channels-last tensor: which form should a channels-last region use?
(issue 34; the rule: onnxfuse/rewrites/contrib/contrib_channels_last.py).

Why: inside a channels-last region ``GlobalAveragePool`` becomes ``ReduceMean(axes=[1, 2], keepdims=1)``
over [N, H, W, C], which ONNX Runtime's CUDA provider hands to cuDNN's generic reduction. In the DB text
detector at batch 16 (MobileNetV3-L backbone at 640 × 640, eight squeeze-excitation blocks) those
reductions took 1.08 ms of the optimized model's 11.6 ms of kernels, where the original's eight NCHW
``GlobalAveragePool`` took 0.24 ms (ncu, docs/benchmarks.md 5.69). The same blocks sit in every
MobileNetV3 and EfficientNet, where the measured choice refused channels-last (5.63).

For each squeeze-excitation shape, one-node (or few-node) models computing y = mean over H, W of x
[N, H, W, C] as [N, 1, 1, C]:

* ``reduce_mean``: ``ReduceMean(axes=[1, 2], keepdims=1)``, what the rule wrote before ``ChannelsLastMean``;
* ``channels_last_mean``: onnxfuse's ``ChannelsLastMean`` (csrc/channels_last_mean.cc), what it writes now;
* ``nhwc_gap``: ``GlobalAveragePool`` in ONNX Runtime's internal ``com.ms.internal.nhwc`` domain, the
  kernel its own ``prefer_nhwc`` layout pass uses (present only in builds with CUDA NHWC ops; an internal
  domain, so a rule would need a CPU stand-in: onnxfuse/runtime/stand_ins.py);
* ``transpose_gap``: ``Transpose`` to NCHW, ``GlobalAveragePool``, ``Transpose`` of the [N, C, 1, 1]
  result back (a whole-tensor transpose, then the original's kernel);
* ``matmul``: ``Reshape`` to [N, H·W, C], ``MatMul`` by a constant [1, H·W] row of 1 / (H·W) (cuBLAS,
  a batched GEMV; in float32 ONNX Runtime's default TF32 math rounds x to 10 mantissa bits: its error
  is reported);

beside the original's own cost, ``nchw_gap``: ``GlobalAveragePool`` of the same values in NCHW (and
``nchw_reduce_mean``, ``ReduceMean`` over [2, 3] of them: ONNX Runtime's reduction over trailing axes,
a candidate for the NCHW outputs' pools), and a
device copy of x's bytes (a read and a write of x: twice the floor of a read). Each result is compared
with torch's float64 mean (max relative error). Shapes: the DB detector's (MobileNetV3-L at 640) and
EfficientNet-B0's (224) squeeze-excitation inputs at batch 16, float32 and float16.

Run on the GPU machine from the repository root (onnxruntime-gpu and torch importable):

    python3 benchmarks/probes/nhwc_pool.py --out $OUT/nhwc_pool.json

torch makes the buffers, streams, events and the reference only; onnxfuse never imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parents[1]))

from kernels import Harness  # noqa: E402  (benchmarks/kernels.py: the timing harness)
from onnxfuse.custom_ops import DOMAIN  # noqa: E402

#: [N, H, W, C] inputs of squeeze-excitation blocks at batch 16: the DB detector's MobileNetV3-L at 640,
#: then EfficientNet-B0's at 224.
SHAPES = [(16, 80, 80, 72), (16, 80, 80, 120), (16, 40, 40, 480), (16, 40, 40, 672), (16, 20, 20, 960),
          (16, 112, 112, 32), (16, 56, 56, 144), (16, 28, 28, 240), (16, 14, 14, 480), (16, 7, 7, 1152)]
ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
NHWC_DOMAIN = "com.ms.internal.nhwc"
FORMS = ("reduce_mean", "channels_last_mean", "nhwc_gap", "transpose_gap", "matmul", "nchw_gap", "nchw_reduce_mean")


def model(form: str, shape, dtype: str) -> onnx.ModelProto:
    """``form``'s graph from x to y (see the module docstring); ``nchw_gap`` reads x in NCHW."""
    n, h, w, c = shape
    elem, inits = ELEM[dtype], []
    nchw = form.startswith("nchw")
    x_shape, y_shape = ([n, c, h, w], [n, c, 1, 1]) if nchw else (list(shape), [n, 1, 1, c])
    if form == "reduce_mean":
        nodes = [helper.make_node("ReduceMean", ["x"], ["y"], axes=[1, 2], keepdims=1)]
    elif form == "channels_last_mean":
        nodes = [helper.make_node("ChannelsLastMean", ["x"], ["y"], domain=DOMAIN)]
    elif form == "nchw_reduce_mean":
        nodes = [helper.make_node("ReduceMean", ["x"], ["y"], axes=[2, 3], keepdims=1)]
    elif form == "nhwc_gap":
        nodes = [helper.make_node("GlobalAveragePool", ["x"], ["y"], domain=NHWC_DOMAIN)]
    elif form == "transpose_gap":
        nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 3, 1, 2]),
                 helper.make_node("GlobalAveragePool", ["xt"], ["yt"]),
                 helper.make_node("Transpose", ["yt"], ["y"], perm=[0, 2, 3, 1])]
    elif form == "matmul":
        np_dtype = np.float16 if dtype == "float16" else np.float32
        inits = [numpy_helper.from_array(np.full((1, h * w), 1.0 / (h * w), np_dtype), "row"),
                 numpy_helper.from_array(np.array([n, h * w, c], np.int64), "rows_shape"),
                 numpy_helper.from_array(np.array(y_shape, np.int64), "y_shape")]
        nodes = [helper.make_node("Reshape", ["x", "rows_shape"], ["rows"]),
                 helper.make_node("MatMul", ["row", "rows"], ["mean"]),
                 helper.make_node("Reshape", ["mean", "y_shape"], ["y"])]
    else:
        nodes = [helper.make_node("GlobalAveragePool", ["x"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", elem, x_shape)],
                              [helper.make_tensor_value_info("y", elem, y_shape)], initializer=inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(NHWC_DOMAIN, 1)] if form == "nhwc_gap" else []) + (
        [helper.make_opsetid(DOMAIN, 1)] if form == "channels_last_mean" else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


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
        for shape in SHAPES:
            x = torch.randn(shape, device="cuda").to(getattr(torch, dtype))
            want = x.double().mean(dim=(1, 2), keepdim=True)
            row = {"dtype": dtype, "shape": list(shape), "copy_ms": h.time_copy(x.numel() * x.element_size())["gpu_ms"]}
            for form in FORMS:
                nchw = form.startswith("nchw")
                feed = x.permute(0, 3, 1, 2).contiguous() if nchw else x
                out_shape = (shape[0], shape[3], 1, 1) if nchw else (shape[0], 1, 1, shape[3])
                try:
                    r = h.time_ort(model(form, shape, dtype), form == "channels_last_mean", {"x": feed}, out_shape, dtype)
                except Exception as e:  # noqa: BLE001 (an op this build lacks: recorded, the others still run)
                    row[form] = {"error": str(e).splitlines()[0][:200]}
                    continue
                got = r["y"].double().reshape(want.shape)
                err = float(((got - want).abs() / want.abs().clamp_min(1e-6)).max())
                row[form] = {"ms": r["gpu_ms"], "max_rel_err": err}
            rows.append(row)
            cells = "  ".join(f"{f} {row[f]['ms']:.4f}" if "ms" in row[f] else f"{f} -" for f in FORMS)
            print(f"{dtype:8s} {str(shape):22s} copy {row['copy_ms']:.4f}  {cells}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
