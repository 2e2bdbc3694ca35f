"""A feature pyramid's top-down step, ``Add(lateral, Resize(coarse, ×2 nearest))``, in the three forms
upsample-by-broadcast can leave it (issue 34; the rule: onnxfuse/rewrites/elementwise/upsample_by_broadcast.py):

* ``resize_add``: the original, ONNX Runtime's Resize writing the upsampled map, then its Add;
* ``view_ort_add``: the rule's output for a lone Add (fuse-elementwise leaves a single op to ONNX
  Runtime): Reshapes into the finer view, ONNX Runtime's broadcasting Add, a Reshape back;
* ``view_fused_add``: the same view with the Add as a one-op FusedElementwise (what fusing lone ops on
  a view would give, not written by any rule today);

each checked bit-equal to torch's ``lateral + coarse.repeat_interleave`` (the upsample), beside a device
copy of the lateral map's bytes (the ideal fused step reads 1.25 and writes 1 map: about 1.1 copies).
Shapes: the DB detector's three FPN levels at batch 16 (NHWC, as its channels-last region runs them, 256
channels) and torchvision's ResNet-50 pyramid's (NCHW), float32 and float16. The answer decides whether
fuse-elementwise should take a lone op that reads a view (5.70).

Run on the GPU machine from the repository root (onnxruntime-gpu and torch importable):

    python3 benchmarks/probes/upsample_view.py --out $OUT/upsample_view.json

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
from onnxfuse.custom_ops import DOMAIN, make_node  # noqa: E402

#: (layout, the lateral map's shape) at batch 16; the coarse map is half its height and width
CASES = [("nhwc", (16, 40, 40, 256)), ("nhwc", (16, 80, 80, 256)), ("nhwc", (16, 160, 160, 256)),
         ("nchw", (16, 256, 40, 40)), ("nchw", (16, 256, 80, 80)), ("nchw", (16, 256, 160, 160))]
ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}
FORMS = ("resize_add", "view_ort_add", "view_fused_add")


def coarse_shape(layout: str, full) -> list[int]:
    n, a, b, c = full
    return [n, a // 2, b // 2, c] if layout == "nhwc" else [n, a, b // 2, c // 2]


def views(layout: str, full) -> tuple[list[int], list[int]]:
    """The Reshape targets of the lateral map and the coarse map into the finer view."""
    n, a, b, c = full
    if layout == "nhwc":
        return [n, a // 2, 2, b // 2, 2, c], [n, a // 2, 1, b // 2, 1, c]
    return [n, a, b // 2, 2, c // 2, 2], [n, a, b // 2, 1, c // 2, 1]


def model(form: str, layout: str, full, dtype: str) -> onnx.ModelProto:
    elem = ELEM[dtype]
    inputs = [helper.make_tensor_value_info("lateral", elem, list(full)),
              helper.make_tensor_value_info("coarse", elem, coarse_shape(layout, full))]
    if form == "resize_add":
        scales = [1, 2, 2, 1] if layout == "nhwc" else [1, 1, 2, 2]
        inits = [numpy_helper.from_array(np.array([], np.float32), "roi"),
                 numpy_helper.from_array(np.array(scales, np.float32), "scales")]
        nodes = [helper.make_node("Resize", ["coarse", "roi", "scales"], ["up"], mode="nearest",
                                  coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
                 helper.make_node("Add", ["lateral", "up"], ["y"])]
    else:
        fine, coarse = views(layout, full)
        inits = [numpy_helper.from_array(np.array(fine, np.int64), "fine"),
                 numpy_helper.from_array(np.array(coarse, np.int64), "coarse_view"),
                 numpy_helper.from_array(np.array(full, np.int64), "back")]
        text = f"onnxfuse.elementwise 1\ninput a: {dtype}\ninput b: {dtype}\nt0: {dtype} = Add(a, b)\noutput t0\n"
        add = (helper.make_node("Add", ["a6", "b6"], ["y6"]) if form == "view_ort_add"
               else make_node(text, ["a6", "b6"], ["y6"]))
        nodes = [helper.make_node("Reshape", ["lateral", "fine"], ["a6"]),
                 helper.make_node("Reshape", ["coarse", "coarse_view"], ["b6"]), add,
                 helper.make_node("Reshape", ["y6", "back"], ["y"])]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", elem, list(full))],
                              initializer=inits)
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(DOMAIN, 1)] if form == "view_fused_add" else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--batch", type=int, default=20, help="runs per timed batch")
    args = ap.parse_args(argv)
    h = Harness(torch, batch=args.batch, batches=args.batches, host_runs=20, warmup=10, cuda_graph=False)
    rows, exact = [], True
    for dtype in ("float32", "float16"):
        for layout, full in CASES:
            lateral = torch.randn(full, device="cuda").to(getattr(torch, dtype))
            coarse = torch.randn(coarse_shape(layout, full), device="cuda").to(getattr(torch, dtype))
            axes = (1, 2) if layout == "nhwc" else (2, 3)
            want = lateral + coarse.repeat_interleave(2, dim=axes[0]).repeat_interleave(2, dim=axes[1])
            row = {"dtype": dtype, "layout": layout, "shape": list(full),
                   "copy_ms": h.time_copy(lateral.numel() * lateral.element_size())["gpu_ms"]}
            for form in FORMS:
                r = h.time_ort(model(form, layout, full, dtype), form == "view_fused_add",
                               {"lateral": lateral, "coarse": coarse}, full, dtype)
                same = bool(torch.equal(r["y"], want))
                exact = exact and same
                row[form] = {"ms": r["gpu_ms"], "exact": same}
            rows.append(row)
            cells = "  ".join(f"{f} {row[f]['ms']:.4f}{'' if row[f]['exact'] else ' (differs)'}" for f in FORMS)
            print(f"{dtype:8s} {layout} {str(full):22s} copy {row['copy_ms']:.4f}  {cells}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
