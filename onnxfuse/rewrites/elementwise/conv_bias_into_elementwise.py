"""Move a Conv's bias into the FusedElementwise region that reads the Conv's output (target ``cuda``).

Why: ONNX Runtime's CUDA Conv runs the convolution and then adds the bias in a second kernel
(cuDNN's ``cudnnAddTensor``, ``op_generic_tensor_kernel`` in a profile): one more full read and write
of the activation. Measured with Nsight Compute on an H100 (batch 16, docs/benchmarks.md), that pass
was 21% of EfficientNet-B0's GPU time and 25% of MobileNetV3-Large's. When the only readers of the
Conv's output are elementwise ops that fuse-elementwise turns into one FusedElementwise node (SiLU,
HardSwish, a residual Add…), the bias can be added there for free: the Conv loses its bias and
``Add(conv_out, bias)`` becomes the region's first instruction.

Exactness: on CUDA, ``cudnnAddTensor`` computes ``1·bias + 1·y`` in float and rounds once to the
tensor's type; the region computes ``y + bias`` in float and rounds once: the same value for float32.
ONNX Runtime's CPU Conv adds the bias inside its accumulation instead, so there the two differ by one
rounding of the convolution sum (tests/rewrites/elementwise/test_conv_bias_into_elementwise.py bounds it). For float16/bfloat16
the region keeps the sum in float until its output (one rounding fewer), well within the
half-precision tolerance validation applies.

Which Convs: default-domain Conv, or com.microsoft ``NhwcConv`` (channels-last: its bias is added in a
second cuDNN pass too, and broadcasts on the last axis as it is), or default-domain ``ConvTranspose``
(ONNX Runtime's CUDA kernel runs cuDNN's backward-data convolution, then ``cudnnAddTensor`` for the bias,
and its CPU kernel adds the bias after the column-to-image pass: a separate addition on both providers,
so the lifted Add is the same single rounding; its output channels are the weight's second dimension
times ``group``: a DB text detector's head, a UNet decoder), with a constant 1-D bias of length C (the output channels), output of
known rank ≥ 3 and float element type, not a graph output, read only by default-domain ops the
elementwise language has. Whether those readers really become one fused region is decided by running
the region analysis of fuse-elementwise (:mod:`onnxfuse.rewrites.elementwise.regions`) on a trial graph with every candidate
lifted: a lifted Add left alone (its readers refused, or a one-op region) would only hand the bias back
to ONNX Runtime (which folds such an Add into the Conv again), so only the Convs whose Add lands in a
region of two or more ops are rewritten; the others are reported with that reason.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.elementwise.regions import RegionAnalysis, candidate_ops
from onnxfuse.rewrites.engine.edit import NameAllocator, fresh_name
from onnxfuse.rewrites.engine.rule import Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import (
    constant_value, graphs_within, is_alive, is_default_domain, is_graph_output, is_ms_op,
)

_FLOAT = (np.float32, np.float16)


def is_nhwc_conv(node) -> bool:
    """com.microsoft ``NhwcConv`` (contrib-channels-last writes it): a Conv on [N, H, W, C] tensors, its
    bias added by cuDNN in a second pass as the NCHW Conv's is."""
    return is_ms_op(node, "NhwcConv")


#: A Conv without a bias: nothing to lift, and not worth a line in the report.
_NO_BIAS = Refuse("no bias")


def _is_conv(node) -> bool:
    """A convolution whose bias ONNX Runtime adds in a pass of its own (module docstring)."""
    return (node.op in ("Conv", "ConvTranspose") and is_default_domain(node)) or is_nhwc_conv(node)


def _output_channels(conv, weight) -> int:
    """Conv and NhwcConv: the weight's first dimension; ConvTranspose: its second times ``group``."""
    if conv.op == "ConvTranspose":
        return int(weight.shape[1]) * int(conv.attrs.get("group", 1))
    return int(weight.shape[0])


def _candidate_problem(graph, conv) -> Refuse | None:
    """Why ``conv`` cannot have its bias lifted (before the trial), or ``None``."""
    if len(conv.inputs) < 3 or conv.inputs[2].is_empty():
        return _NO_BIAS
    bias = constant_value(graph, conv.inputs[2])
    weight = constant_value(graph, conv.inputs[1])
    if bias is None or weight is None:
        return Refuse("bias or weight is not a constant")
    if bias.ndim != 1 or weight.ndim < 3 or bias.shape[0] != _output_channels(conv, weight):
        return Refuse("bias is not one value per output channel")
    if bias.dtype.type not in _FLOAT and str(bias.dtype) != "bfloat16":
        return Refuse(f"bias dtype {bias.dtype}")
    out = conv.outputs[0]
    if is_graph_output(graph, out):
        return Refuse("its output is a graph output")
    readers = list(out.outputs)
    if not readers:
        return Refuse("its output is unused")
    ops = candidate_ops()
    for r in readers:
        if not is_default_domain(r) or r.op not in ops:
            return Refuse(f"its output is also read by {r.op} {r.name!r}, which is not elementwise", r)
    return None


class _Lift:
    """One Conv's bias moved into a new ``Add`` (applied and reverted in place)."""

    def __init__(self, graph, conv, names: NameAllocator, node_names: set[str]):
        self.conv = conv
        self.out = conv.outputs[0]
        self.bias_tensor = conv.inputs[2]
        rank = np.asarray(constant_value(graph, conv.inputs[1])).ndim
        bias = np.asarray(constant_value(graph, conv.inputs[2]))
        channels_last = is_nhwc_conv(conv)  # [N, H, W, C]: the 1-D bias broadcasts on the last axis as it is
        shape = bias.shape if channels_last else (bias.shape[0],) + (1,) * (rank - 2)
        self.bias = gs.Constant(names(f"{self.bias_tensor.name}/lifted"), np.ascontiguousarray(bias.reshape(shape)))
        self.raw = gs.Variable(names(f"{self.out.name}/no_bias"), dtype=self.out.dtype, shape=self.out.shape)
        self.add_name = fresh_name(node_names, f"{conv.name or 'Conv'}/bias")
        self.add = None
        self.graph = graph

    def apply(self):
        # gs keeps producer/consumer links in step through its list methods (clear/append/pop).
        self.conv.outputs.clear()
        self.conv.outputs.append(self.raw)
        self.conv.inputs.pop(2)
        self.add = gs.Node(op="Add", name=self.add_name, inputs=[self.raw, self.bias], outputs=[self.out])
        # Right after the Conv: the region analysis visits nodes in list order, as a topological order.
        at = next(i for i, n in enumerate(self.graph.nodes) if n is self.conv)
        self.graph.nodes.insert(at + 1, self.add)

    def revert(self):
        self.add.inputs.clear()
        self.add.outputs.clear()
        at = next(i for i, n in enumerate(self.graph.nodes) if n is self.add)
        del self.graph.nodes[at]
        self.conv.inputs.append(self.bias_tensor)
        self.conv.outputs.clear()
        self.conv.outputs.append(self.out)


class LiftConvBiasIntoElementwise(Rule):
    name = "conv-bias-into-elementwise"
    description = "Conv bias added inside the FusedElementwise region reading the Conv (no separate bias pass)"
    targets = frozenset({"cuda"})

    def match(self, graph):
        found = []
        for g in graphs_within(graph):
            convs = [n for n in g.nodes if _is_conv(n)]
            if not convs:
                continue
            problems = {id(c): _candidate_problem(g, c) for c in convs}
            candidates = [c for c in convs if problems[id(c)] is None]
            verdict: dict[int, Refuse | None] = {}
            if candidates:
                names, node_names = NameAllocator(g), {n.name for n in g.nodes}
                lifts = [_Lift(g, c, names, node_names) for c in candidates]
                for lift in lifts:
                    lift.apply()
                try:
                    fused = set()
                    for region in RegionAnalysis(g).regions():
                        if region.refusal is None and len(region.nodes) > 1:
                            fused.update(id(n) for n in region.nodes)
                finally:
                    for lift in reversed(lifts):
                        lift.revert()
                for lift in lifts:
                    verdict[id(lift.conv)] = (None if id(lift.add) in fused else Refuse(
                        "the Conv's readers do not form a fused region with the bias Add"))
            for c in convs:
                refusal = problems[id(c)] if problems[id(c)] is not None else verdict[id(c)]
                if refusal is not _NO_BIAS:
                    found.append((g, c, refusal))
        return found

    def anchor(self, match):
        return match[1]

    def anchor_name(self, match) -> str:
        return match[1].name or "Conv"

    def check(self, graph, match):
        g, conv, refusal = match
        if refusal:
            return refusal
        if not is_alive(conv):
            return Refuse("the Conv changed during this pass")
        return _candidate_problem(g, conv) or Plan(conv, g)

    def rewrite(self, graph, plan: Plan):
        conv, g = plan.anchor, plan.found
        lift = _Lift(g, conv, NameAllocator(g), {n.name for n in g.nodes})
        lift.apply()
        return {"conv": conv.name, "bias": lift.bias_tensor.name, "add": lift.add.name,
                "output": lift.out.name}
