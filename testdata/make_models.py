#!/usr/bin/env python3
"""Build the small committed test models in this folder (deterministic: run it again, get the same bytes).

    python testdata/make_models.py            # (re)write every model next to this script
    python testdata/make_models.py --out DIR  # write them elsewhere (the tests check determinism this way)

Each model is built with ``onnx.helper`` from its own seeded random generator, so adding a model never
changes another. BatchNorm statistics are random (mean ≠ 0, var ≠ 1, γ ≠ 1, β ≠ 0) so a wrong fold shows
up numerically. README.md beside this file lists what each model exercises. The functions are importable
(``from make_models import MODELS``) so tests can build variants without touching the files.
"""

from __future__ import annotations

import argparse
import sys
import zlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
OPSET = 15
IR_VERSION = 8  # ONNX Runtime 1.2x reads IR ≤ 10/11; 8 is plenty for opset 15


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def model(name: str, nodes, inputs, outputs, inits, opset: int = OPSET, check: bool = True, extra_opsets=()):
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    opsets = [helper.make_opsetid("", opset), *[helper.make_opsetid(d, v) for d, v in extra_opsets]]
    m = helper.make_model(graph, opset_imports=opsets, ir_version=IR_VERSION, producer_name="onnxfuse-testdata")
    if check:
        onnx.checker.check_model(m, full_check=True)
    return m


def vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


class Builder:
    """Collects nodes and initializers; random parameters come from one seeded generator."""

    def __init__(self, name: str, dtype=np.float32):
        self.rng = rng_for(name)
        self.dtype = dtype
        self.nodes: list = []
        self.inits: list = []

    def const(self, name, values, dtype=None):
        arr = np.asarray(values, dtype=dtype or self.dtype)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def randn(self, name, shape, scale=1.0, dtype=None):
        return self.const(name, self.rng.standard_normal(shape) * scale, dtype)

    def node(self, op, inputs, outputs, name=None, **attrs):
        outputs = [outputs] if isinstance(outputs, str) else outputs
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name or outputs[0], **attrs))
        return outputs[0]

    def bn(self, x, channels, name, stats_dtype=None, out=None, **attrs):
        """A BatchNormalization with non-trivial statistics."""
        d = stats_dtype or self.dtype
        r = self.rng
        gamma = self.const(f"{name}.gamma", r.uniform(0.5, 1.5, channels) * r.choice([-1, 1], channels), d)
        beta = self.const(f"{name}.beta", r.standard_normal(channels) * 0.5, d)
        mean = self.const(f"{name}.mean", r.standard_normal(channels) * 0.5, d)
        var = self.const(f"{name}.var", r.uniform(0.2, 2.0, channels), d)
        return self.node("BatchNormalization", [x, gamma, beta, mean, var], out or f"{name}_out", name=name,
                         epsilon=1e-3, **attrs)

    def conv(self, x, cin, cout, k, name, group=1, bias=True, **attrs):
        ks = (k, k) if isinstance(k, int) else tuple(k)  # an int means a square 2-d kernel
        fan_in = cin // group * int(np.prod(ks))
        w = self.randn(f"{name}.weight", (cout, cin // group, *ks), scale=fan_in ** -0.5)
        inputs = [x, w] + ([self.randn(f"{name}.bias", (cout,), 0.1)] if bias else [])
        return self.node("Conv", inputs, f"{name}_out", name=name, group=group, **attrs)


# ---------------------------------------------------------------------------------------------------
# the models


def conv_bn_relu():
    """Conv+BN+ReLU x4: plain with bias, depthwise strided, grouped dilated, bias-less 1x1 with asymmetric pads."""
    b = Builder("conv_bn_relu")
    x = "input"
    y = b.conv(x, 8, 16, 3, "conv0", pads=[1, 1, 1, 1])
    y = b.node("Relu", [b.bn(y, 16, "bn0")], "relu0")
    y = b.conv(y, 16, 16, 3, "conv1_dw", group=16, bias=False, strides=[2, 2], pads=[1, 1, 1, 1])
    y = b.node("Relu", [b.bn(y, 16, "bn1")], "relu1")
    y = b.conv(y, 16, 32, 3, "conv2_grouped", group=4, dilations=[2, 2], pads=[2, 2, 2, 2])
    y = b.node("Relu", [b.bn(y, 32, "bn2")], "relu2")
    y = b.conv(y, 32, 12, 1, "conv3_1x1", bias=False, pads=[0, 1, 1, 0])
    b.node("Relu", [b.bn(y, 12, "bn3")], "output")
    return model("conv_bn_relu", b.nodes, [vi("input", ["N", 8, 16, 16])], [vi("output", ["N", 12, 9, 9])], b.inits)


def conv1d_bn():
    """1-d grouped, strided, dilated Conv whose weight comes from a Constant node, then BN and ReLU."""
    b = Builder("conv1d_bn")
    w = b.rng.standard_normal((6, 2, 5)).astype(np.float32) * 0.3
    b.node("Constant", [], "conv.weight", name="conv.weight_const", value=numpy_helper.from_array(w, "cw"))
    y = b.node("Conv", ["input", "conv.weight"], "conv_out", name="conv", group=2, strides=[2], dilations=[2], pads=[4, 4])
    b.node("Relu", [b.bn(y, 6, "bn")], "output")
    return model("conv1d_bn", b.nodes, [vi("input", ["N", 4, 32])], [vi("output", ["N", 6, 16])], b.inits)


def conv3d_bn():
    """3-d Conv with bias, strided, then BN."""
    b = Builder("conv3d_bn")
    y = b.conv("input", 3, 5, (3, 3, 3), "conv", strides=[1, 2, 2], pads=[1, 1, 1, 1, 1, 1])
    b.bn(y, 5, "bn", out="output")
    return model("conv3d_bn", b.nodes, [vi("input", ["N", 3, 6, 8, 8])], [vi("output", ["N", 5, 6, 4, 4])], b.inits)


def convtranspose_bn():
    """Grouped ConvTranspose (group=2, C_in 8 -> C_out 6) with bias + BN + ReLU, then a bias-less one + BN."""
    b = Builder("convtranspose_bn")
    w0 = b.randn("deconv0.weight", (8, 3, 3, 3), 0.2)  # (C_in, C_out/group, kH, kW)
    y = b.node("ConvTranspose", ["input", w0, b.randn("deconv0.bias", (6,), 0.1)], "deconv0_out", name="deconv0",
               group=2, strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1])
    y = b.node("Relu", [b.bn(y, 6, "bn0")], "relu0")
    w1 = b.randn("deconv1.weight", (6, 4, 2, 2), 0.3)
    y = b.node("ConvTranspose", [y, w1], "deconv1_out", name="deconv1", strides=[2, 2])
    b.bn(y, 4, "bn1", out="output")
    return model("convtranspose_bn", b.nodes, [vi("input", ["N", 8, 5, 5])], [vi("output", ["N", 4, 20, 20])], b.inits)


def gemm_bn():
    """Gemm+BN three ways: transB=1 with alpha/beta and C (N,); transB=0 without C; C of shape (1, N) and beta."""
    b = Builder("gemm_bn")
    y = b.node("Gemm", ["input", b.randn("fc0.weight", (24, 16), 0.25), b.randn("fc0.bias", (24,), 0.1)], "fc0_out",
               name="fc0", transB=1, alpha=0.5, beta=2.0)
    y = b.node("Relu", [b.bn(y, 24, "bn0")], "relu0")
    y = b.node("Gemm", [y, b.randn("fc1.weight", (24, 12), 0.2)], "fc1_out", name="fc1")
    y = b.node("Relu", [b.bn(y, 12, "bn1")], "relu1")
    y = b.node("Gemm", [y, b.randn("fc2.weight", (12, 10), 0.3), b.randn("fc2.bias", (1, 10), 0.1)], "fc2_out",
               name="fc2", beta=0.75)
    b.bn(y, 10, "bn2", out="output")
    return model("gemm_bn", b.nodes, [vi("input", ["N", 16])], [vi("output", ["N", 10])], b.inits)


def matmul_bn():
    """MatMul with a constant (K, N) weight on a 2-D input, then BN and ReLU (folds into Gemm)."""
    b = Builder("matmul_bn")
    y = b.node("MatMul", ["input", b.randn("fc.weight", (16, 12), 0.25)], "fc_out", name="fc")
    b.node("Relu", [b.bn(y, 12, "bn")], "output")
    return model("matmul_bn", b.nodes, [vi("input", ["N", 16])], [vi("output", ["N", 12])], b.inits)


def matmul3d_bn():
    """MatMul on a rank-3 input then BN over axis 1 (5 'channels' = sequence positions): must be refused."""
    b = Builder("matmul3d_bn")
    y = b.node("MatMul", ["input", b.randn("fc.weight", (16, 12), 0.25)], "fc_out", name="fc")
    b.bn(y, 5, "bn", out="output")
    return model("matmul3d_bn", b.nodes, [vi("input", ["N", 5, 16])], [vi("output", ["N", 5, 12])], b.inits)


def conv_scale_bias():
    """Constant per-channel chains: Conv→Mul(C,1,1)→Add(1,C,1,1)→Mul()→Sub(1,)→Div(C,1,1)→Relu, Conv→(c−y)→Add,
    and a Gemm head →Mul(C,)→Add(1,C); each op folds into the producer."""
    b = Builder("conv_scale_bias")
    r = b.rng
    y = b.conv("input", 4, 8, 3, "conv0", pads=[1, 1, 1, 1])
    y = b.node("Mul", [y, b.const("s0", r.uniform(0.5, 2.0, (8, 1, 1)))], "mul0")
    y = b.node("Add", [b.const("t0", r.standard_normal((1, 8, 1, 1))), y], "add0")
    y = b.node("Mul", [y, b.const("s1", 1.7)], "mul1")
    y = b.node("Sub", [y, b.const("t1", [0.3])], "sub0")
    y = b.node("Div", [y, b.const("d0", r.uniform(0.5, 3.0, (8, 1, 1)))], "div0")
    y = b.node("Relu", [y], "relu0")
    y = b.conv(y, 8, 6, 1, "conv1", bias=False)
    y = b.node("Sub", [b.const("t2", r.standard_normal((6, 1, 1))), y], "rsub0")
    y = b.node("Add", [y, b.const("t3", r.standard_normal((1, 6, 1, 1)))], "add1")
    y = b.node("GlobalAveragePool", [y], "gap")
    y = b.node("Flatten", [y], "flat")
    y = b.node("Gemm", [y, b.randn("fc.weight", (5, 6), 0.3), b.randn("fc.bias", (5,), 0.1)], "fc_out", name="fc",
               transB=1)
    y = b.node("Mul", [y, b.const("s2", r.uniform(0.5, 2.0, (5,)))], "mul2")
    b.node("Add", [y, b.const("t4", r.standard_normal((1, 5)))], "output")
    return model("conv_scale_bias", b.nodes, [vi("input", ["N", 4, 8, 8])], [vi("output", ["N", 5])], b.inits)


def conv_bn_fp16():
    """fp16 Convs (one depthwise) with fp32 BatchNorm statistics (opset 15 allows mixed T/T1/T2)."""
    b = Builder("conv_bn_fp16", dtype=np.float16)
    y = b.conv("input", 8, 16, 3, "conv0", pads=[1, 1, 1, 1])
    y = b.node("Relu", [b.bn(y, 16, "bn0", stats_dtype=np.float32)], "relu0")
    y = b.conv(y, 16, 16, 3, "conv1_dw", group=16, bias=False, pads=[1, 1, 1, 1])
    b.bn(y, 16, "bn1", stats_dtype=np.float32, out="output")
    f16 = TensorProto.FLOAT16
    return model("conv_bn_fp16", b.nodes, [vi("input", ["N", 8, 8, 8], f16)], [vi("output", ["N", 16, 8, 8], f16)],
                 b.inits)


def shared_weights():
    """Two Convs share one weight and bias; each has its own BN. Both fold; the first into a copy.
    The second reads Relu(input), so the two are not the same computation (cleanup would merge them)."""
    b = Builder("shared_weights")
    w = b.randn("shared.weight", (6, 4, 3, 3), 1 / 6)
    bias = b.randn("shared.bias", (6,), 0.1)
    ya = b.node("Conv", ["input", w, bias], "conv_a_out", name="conv_a", pads=[1, 1, 1, 1])
    relu = b.node("Relu", ["input"], "relu_out", name="relu")
    yb = b.node("Conv", [relu, w, bias], "conv_b_out", name="conv_b", pads=[1, 1, 1, 1])
    ya = b.bn(ya, 6, "bn_a")
    yb = b.bn(yb, 6, "bn_b")
    b.node("Add", [ya, yb], "output")
    return model("shared_weights", b.nodes, [vi("input", ["N", 4, 8, 8])], [vi("output", ["N", 6, 8, 8])], b.inits)


def bn_input_is_output():
    """Conv→BN where the Conv output is also a graph output: the fold must be refused."""
    b = Builder("bn_input_is_output")
    y = b.conv("input", 4, 6, 3, "conv", pads=[1, 1, 1, 1], )
    b.bn(y, 6, "bn", out="output")
    return model("bn_input_is_output", b.nodes, [vi("input", ["N", 4, 8, 8])],
                 [vi("output", ["N", 6, 8, 8]), vi("conv_out", ["N", 6, 8, 8])], b.inits)


def bn_training():
    """Conv→BN with training_mode=1 and its running-statistics outputs: the fold must be refused."""
    b = Builder("bn_training")
    y = b.conv("input", 4, 6, 3, "conv", pads=[1, 1, 1, 1])
    b.bn(y, 6, "bn", out=["output", "running_mean", "running_var"], training_mode=1)
    return model("bn_training", b.nodes, [vi("input", ["N", 4, 8, 8])], [vi("output", ["N", 6, 8, 8])], b.inits)


def bad_undefined_input():
    """Invalid: a node reads a tensor nothing defines (onnx.checker rejects it)."""
    nodes = [helper.make_node("Add", ["input", "undefined_tensor"], ["output"], name="add")]
    return model("bad_undefined_input", nodes, [vi("input", ["N", 4])], [vi("output", ["N", 4])], [], check=False)


def bad_unknown_op():
    """Valid ONNX, but its op (domain com.example) is implemented by no execution provider."""
    nodes = [helper.make_node("Frobnicate", ["input"], ["output"], name="frob", domain="com.example")]
    return model("bad_unknown_op", nodes, [vi("input", ["N", 4])], [vi("output", ["N", 4])], [],
                 extra_opsets=[("com.example", 1)])


MODELS = {
    f.__name__: f
    for f in (
        conv_bn_relu, conv1d_bn, conv3d_bn, convtranspose_bn, gemm_bn, matmul_bn, matmul3d_bn, conv_scale_bias,
        conv_bn_fp16, shared_weights, bn_input_is_output, bn_training, bad_undefined_input, bad_unknown_op,
    )
}

MAX_BYTES = 2 * 2**20


def build_all(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, make in MODELS.items():
        path = out / f"{name}.onnx"
        data = make().SerializeToString(deterministic=True)
        assert len(data) < MAX_BYTES, f"{path} is {len(data)} bytes; keep test models under 2 MB"
        path.write_bytes(data)
        written.append(path)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE, help="folder to write into (default: beside this script)")
    args = ap.parse_args(argv)
    for path in build_all(args.out):
        print(f"{path.stat().st_size:>9,}  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
