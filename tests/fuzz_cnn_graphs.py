"""Random conv nets for the equality and idempotence fuzzer with contrib-channels-last
(``tools/fuzz_optimize.py --cnn``): chains of Conv (grouped, depthwise, strided, dilated, padded or
``auto_pad``, with or without a bias) joined by the ops a channels-last region takes (pointwise ops with
constants of every broadcast rank, residual Adds, Concat / Split / Slice over channels (a Concat of
pointwise results, as a C2f block's, becomes a FusedConcat), global pools,
nearest Resize) and by the ops it does not (MaxPool, linear Resize, Reshape, a non-constant rank-2 operand), with tensors read from
the middle as graph outputs and by an If branch. The optimized model runs on the CPU with every NhwcConv
as its definition (runtime/stand_ins.py) and must equal the original.

``check_cnn_seed(seed)`` returns what ``fuzz_graphs.check_seed`` returns, for the same verdicts."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

UNARY = ("Relu", "Sigmoid", "Tanh", "HardSwish", "LeakyRelu", "Abs", "Neg")
BINARY = ("Add", "Mul", "Sub", "Max")


class _Net:
    def __init__(self, rng):
        self.rng, self.nodes, self.inits, self.outputs, self.n = rng, [], [], [], 0

    def name(self, base):
        self.n += 1
        return f"{base}{self.n}"

    def const(self, values, base="c"):
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(values, np.float32), name))
        return name

    def node(self, op, inputs, base=None, outputs=1, **attrs):
        names = [self.name(base or op.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, **attrs))
        return names if outputs > 1 else names[0]


def _conv(net: _Net, x, c_in, h, w, keep: bool = False):
    """A random Conv of x [N, c_in, h, w]; returns (y, c_out, h_out, w_out). ``keep``: the output has
    x's shape (stride 1, same padding, c_in channels), for a residual or a Concat back."""
    rng = net.rng
    kind = rng.choice(["dense", "grouped", "depthwise", "pointwise"])
    group = {"dense": 1, "pointwise": 1, "grouped": 2 if c_in % 2 == 0 else 1, "depthwise": c_in}[kind]
    c_out = c_in if kind == "depthwise" or keep else int(rng.choice([4, 6, 8]))
    c_out = max(c_out - c_out % group, group)
    k = 1 if kind == "pointwise" else int(rng.choice([1, 3]))
    stride = 1 if keep or h <= 4 else int(rng.choice([1, 1, 2]))
    dilation = int(rng.choice([1, 1, 2])) if k == 3 and h > 6 else 1
    weight = net.const(rng.standard_normal((c_out, c_in // group, k, k)) * 0.5, "w")
    inputs = [x, weight] + ([net.const(rng.standard_normal(c_out) * 0.1, "b")] if rng.random() < 0.7 else [])
    attrs = dict(group=group, strides=[stride, stride], dilations=[dilation, dilation])
    if rng.random() < 0.3 and dilation == 1:  # ONNX Runtime's CPU Conv takes no dilation with auto_pad
        attrs["auto_pad"] = "SAME_UPPER"
        h_out, w_out = -(-h // stride), -(-w // stride)
    else:
        p = (k - 1) * dilation // 2
        attrs["pads"] = [p, p, p, p]
        h_out = (h + 2 * p - dilation * (k - 1) - 1) // stride + 1
        w_out = (w + 2 * p - dilation * (k - 1) - 1) // stride + 1
    return net.node("Conv", inputs, **attrs), c_out, h_out, w_out


def _pointwise(net: _Net, x, c, w):
    """A unary op, or a binary one with a constant per channel ([C, 1, 1], [1, C, 1, 1]), per column
    ([W]: rank 1 aligns with the last axis), per element of a plane ([1, W]) or a scalar."""
    rng = net.rng
    if rng.random() < 0.5:
        op = str(rng.choice(UNARY))
        return net.node(op, [x], alpha=0.1) if op == "LeakyRelu" else net.node(op, [x])
    shape = [(c, 1, 1), (1, c, 1, 1), (w,), (1, w), (), (1,)][rng.integers(6)]
    other = net.const(rng.uniform(0.5, 1.5, shape), "k")
    return net.node(str(rng.choice(BINARY)), [x, other] if rng.random() < 0.7 else [other, x])


def random_cnn_model(seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    net = _Net(rng)
    n, c, h, w = int(rng.choice([1, 2])), 3, int(rng.choice([8, 12])), int(rng.choice([8, 10]))
    h0, w0 = h, w
    x = "x"
    for _ in range(int(rng.integers(3, 9))):
        step = rng.random()
        if step < 0.45:
            x, c, h, w = _conv(net, x, c, h, w)
        elif step < 0.65:
            x = _pointwise(net, x, c, w)
        elif step < 0.72:  # residual: a Conv that keeps the shape, added back
            y, _, _, _ = _conv(net, x, c, h, w, keep=True)
            x = net.node("Add", [x, y])
        elif step < 0.78 and c % 2 == 0:  # Split over channels, one half through a Conv, Concat back
            a, b = net.node("Split", [x], outputs=2, axis=1)
            a2, _, _, _ = _conv(net, a, c // 2, h, w, keep=True)
            if rng.random() < 0.5:  # C2f-like: SiLU results concatenated (a FusedConcat, concat-into-elementwise)
                a2 = net.node("Mul", [a2, net.node("Sigmoid", [a2])])
                if rng.random() < 0.5:
                    b = net.node("Mul", [b, net.node("Sigmoid", [b])])
            x = net.node("Concat", [a2, b] if rng.random() < 0.5 else [b, a2], axis=int(rng.choice([1, -3])))
        elif step < 0.82 and c > 2:  # Slice of channels
            stop = int(rng.integers(2, c + 1))
            starts = numpy_helper.from_array(np.array([0], np.int64), net.name("s0"))
            ends = numpy_helper.from_array(np.array([stop], np.int64), net.name("s1"))
            axes = numpy_helper.from_array(np.array([1], np.int64), net.name("s2"))
            net.inits += [starts, ends, axes]
            x, c = net.node("Slice", [x, starts.name, ends.name, axes.name]), stop
        elif step < 0.87:  # MaxPool (a boundary) or Resize (nearest: inside; linear: a boundary)
            if rng.random() < 0.5 and h >= 4:
                x = net.node("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
                h, w = h // 2, w // 2
            else:
                scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), net.name("sc"))
                net.inits.append(scales)
                x = net.node("Resize", [x, "", scales.name], mode="nearest" if rng.random() < 0.6 else "linear")
                h, w = h * 2, w * 2
        elif step < 0.92:
            net.outputs.append((x, [n, c, h, w]))  # read from the middle
        else:
            x = _pointwise(net, x, c, w)
    if rng.random() < 0.3:
        x = net.node("GlobalAveragePool", [x])
        h = w = 1
    net.outputs.append((x, [n, c, h, w]))
    graph_outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in net.outputs]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, 3, h0, w0])]
    if rng.random() < 0.2 and len(net.outputs) >= 1:  # an If branch reading a tensor of the net by name
        inner, shape = net.outputs[0]
        branch = helper.make_graph([helper.make_node("Neg", [inner], ["then_out"])], "then", [],
                                   [helper.make_tensor_value_info("then_out", TensorProto.FLOAT, shape)])
        other = helper.make_graph([helper.make_node("Abs", [inner], ["else_out"])], "else", [],
                                  [helper.make_tensor_value_info("else_out", TensorProto.FLOAT, shape)])
        net.nodes.append(helper.make_node("If", ["flag"], ["branch_out"], then_branch=branch, else_branch=other))
        inputs.append(helper.make_tensor_value_info("flag", TensorProto.BOOL, []))
        graph_outputs.append(helper.make_tensor_value_info("branch_out", TensorProto.FLOAT, shape))
    graph = helper.make_graph(net.nodes, f"cnn_{seed}", inputs, _unique(graph_outputs), net.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _unique(outputs):
    seen, out = set(), []
    for o in outputs:
        if o.name not in seen:
            seen.add(o.name)
            out.append(o)
    return out


def cnn_inputs(model: onnx.ModelProto, seed: int) -> dict:
    rng = np.random.default_rng(seed + 1)
    feeds = {}
    for vi in model.graph.input:
        if vi.type.tensor_type.elem_type == TensorProto.BOOL:
            feeds[vi.name] = np.array(bool(rng.random() < 0.5))
        else:
            shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def check_cnn_seed(seed: int, target: str | None = None) -> tuple[str, str]:
    import fuzz_graphs

    return fuzz_graphs.check_seed(seed, target or "cuda", make=random_cnn_model, inputs=cnn_inputs,
                                  only="+contrib-channels-last")
