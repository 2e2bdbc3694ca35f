#!/usr/bin/env python3
"""Build a large ONNX model with external data, without ever holding its weights in memory at once.

``LAYERS`` blocks of ``MatMul(x, W) → BatchNormalization → Add(bias) → Relu`` on a ``[1, WIDTH]`` input;
each ``W`` is ``WIDTH × WIDTH`` float32 (8192² × 4 B = 256 MiB), written one at a time into
``<out>.data`` (each tensor 64 KiB-aligned, so ONNX Runtime can map it). The defaults give 9 layers,
2.25 GiB of weights: over protobuf's 2 GiB limit, the model that docs/large-models.md measures.
``--layers 32`` gives 8 GiB.

Weights are drawn with standard deviation ``1/sqrt(WIDTH)`` and BatchNormalization statistics are
random but moderate, so activations keep their scale through every layer and the output is a
meaningful comparison (neither all zeros nor overflowing).

    python benchmarks/large_model.py /tmp/big/model.onnx              # 2.25 GiB
    python benchmarks/large_model.py /tmp/big/model.onnx --layers 32  # 8 GiB
    python benchmarks/large_model.py /tmp/big/model.onnx --inline --layers 7  # 1.75 GiB, one file

Never imported by the package; models are not committed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

ALIGN = 1 << 16


def build(out: Path, layers: int = 9, width: int = 8192, seed: int = 0, inline: bool = False) -> int:
    """Write the model (and ``<out>.data`` unless ``inline``); return the weights' size in bytes."""
    rng = np.random.default_rng(seed)
    data_name = out.name + ".data"
    nodes, inits = [], []
    total = 0
    data = None if inline else open(out.parent / data_name, "wb")
    try:
        x = "x"
        for i in range(layers):
            w = rng.standard_normal((width, width), dtype=np.float32)
            w *= np.float32(1.0 / np.sqrt(width))
            total += w.nbytes
            if inline:
                inits.append(onnx.numpy_helper.from_array(w, f"w{i}"))
            else:
                offset = -(-data.tell() // ALIGN) * ALIGN
                data.seek(offset)
                data.write(memoryview(w).cast("B"))
                t = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[width, width])
                t.data_location = TensorProto.EXTERNAL
                for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(w.nbytes))):
                    t.external_data.add(key=k, value=v)
                inits.append(t)
            del w
            scale = rng.uniform(0.5, 1.5, width).astype(np.float32)
            bias = rng.uniform(-0.1, 0.1, width).astype(np.float32)
            mean = rng.uniform(-0.1, 0.1, width).astype(np.float32)
            var = rng.uniform(0.5, 1.5, width).astype(np.float32)
            add = rng.uniform(-0.1, 0.1, width).astype(np.float32)
            for name, v in (("scale", scale), ("bias", bias), ("mean", mean), ("var", var), ("add", add)):
                inits.append(onnx.numpy_helper.from_array(v, f"{name}{i}"))
                total += v.nbytes
            nodes += [
                helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=f"matmul{i}"),
                helper.make_node("BatchNormalization", [f"mm{i}", f"scale{i}", f"bias{i}", f"mean{i}", f"var{i}"],
                                 [f"bn{i}"], name=f"bn{i}"),
                helper.make_node("Add", [f"bn{i}", f"add{i}"], [f"add_out{i}"], name=f"add{i}"),
                helper.make_node("Relu", [f"add_out{i}"], [f"y{i}" if i < layers - 1 else "y"], name=f"relu{i}"),
            ]
            x = f"y{i}"
    finally:
        if data is not None:
            data.close()
    graph = helper.make_graph(nodes, "large", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with open(out, "wb") as f:
        f.write(model.SerializeToString())
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="model path (the data goes to <out>.data)")
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--width", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inline", action="store_true", help="weights inside the .onnx file (must stay under 2 GiB)")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    total = build(args.out, args.layers, args.width, args.seed, args.inline)
    size = os.path.getsize(args.out) + (0 if args.inline else os.path.getsize(str(args.out) + ".data"))
    print(f"{args.out}: {args.layers} layers of {args.width}x{args.width}, weights {total / 2**30:.3f} GiB, "
          f"files {size / 2**30:.3f} GiB")


if __name__ == "__main__":
    main()
