"""Conv (+ Add of a same-shaped tensor) + Relu → com.microsoft FusedConv(activation="Relu").

The maths: ``FusedConv(X, W, B, Z) = Relu(Conv(X, W, B) + Z)``; without Z it is ``Relu(Conv(X, W, B))``.
On CUDA, ONNX Runtime runs it as one cuDNN ``ConvolutionBiasActivationForward`` call (the residual Add
and the Relu ride on the convolution's epilogue); on the CPU as Conv with a fused activation / sum.

Conditions as conv_activation_fusion.cc's CUDA branch: float32 only (the CUDA FusedConv kernel); Relu
is the only activation (the one the CUDA kernel implements); the Conv output is read only by the
Relu / the Add and is not a graph output; the Add's other operand Z must have *exactly* the Conv
output's shape (known, dims equal as numbers or the same named dim-param; cuDNN adds Z without
broadcasting — ONNX Runtime's own fusion does not check this, we do) and must not be the Conv output
itself; the Add output is read only by the Relu. All Conv attributes are kept.

**Opt-in (measured slower)**: on an H100 with onnxruntime-gpu 1.31.1 (2026-11-22,
``benchmarks/patterns.py`` and ``benchmarks/zoo.py``, docs/benchmarks.md) FusedConv ran slower than the
separate Conv + Relu that ONNX Runtime schedules itself: a 3×3 Conv+Relu on 16×64×56×56 took 0.107 ms
vs 0.091 ms, and a ResNet-50 with 49 FusedConv nodes ran at 0.41× (batch 1) of the original; cuDNN's
frontend logs "No execution plans support the graph" for many of these shapes and falls back. So the
rule runs only when asked for (``--only contrib-fused-conv``); for Conv + Add + Relu, the residual
Add + Relu goes to FusedElementwise instead (0.094 ms vs 0.103 ms for the original).
"""

from __future__ import annotations

from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.engine.edit import fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    FP32, consumers, first_known_dtype, is_op, nodes_of, only_read_by, other_input, shape_of, shapes_equal,
)


class ContribFusedConv(ContribRule):
    name = "contrib-fused-conv"
    description = "Conv (+ Add of a same-shaped tensor) + Relu in float32 → com.microsoft FusedConv (opt-in: slower on CUDA)"
    opt_in = True

    def match(self, graph):
        return nodes_of(graph, "Conv")

    def analyze(self, graph, node):
        if len(node.outputs) != 1 or len(node.inputs) < 2:
            return Refuse("Conv has an unexpected number of inputs or outputs")
        y = node.outputs[0]
        readers = consumers(y)
        if len(readers) != 1:
            return Refuse(f"Conv output {y.name!r} is read by {len(readers)} nodes")
        nxt = readers[0]
        problem = only_read_by(graph, y, [nxt])
        if problem:
            return problem
        dtype = first_known_dtype(graph, node.inputs[1], node.inputs[0], y)
        problem = dtype_problem(dtype, (FP32,), "Conv")
        if problem:
            return problem
        if is_op(nxt, "Relu"):
            return ([node, nxt], None, nxt.outputs[0])
        if not is_op(nxt, "Add") or len(nxt.inputs) != 2:
            return Refuse(f"Conv output flows into {nxt.op}, not Relu or Add")
        z = other_input(nxt, y)
        if z is None:
            return Refuse("the Add adds the Conv output to itself")
        add_out = nxt.outputs[0]
        relu = add_out.outputs[0] if len(add_out.outputs) == 1 else None
        if not is_op(relu, "Relu"):
            return Refuse("the Add is not followed by a Relu (only)")
        problem = only_read_by(graph, add_out, [relu])
        if problem:
            return problem
        sy, sz = shape_of(graph, y), shape_of(graph, z)
        if sy is None or sz is None:
            return Refuse("shapes of the Conv output and the added tensor unknown (run shape inference first)")
        if not shapes_equal(sy, sz):
            return Refuse(f"added tensor of shape {sz} is not provably the Conv output's shape {sy}")
        return ([node, nxt, relu], z, relu.outputs[0])

    def apply(self, graph, node, plan):
        nodes, z, out = plan
        inputs = list(node.inputs)
        if z is not None:
            # import cycle: importing onnxfuse.rewrites.engine.edit imports this module
            from onnxfuse.rewrites.engine.edit import empty_input

            while len(inputs) < 3:
                inputs.append(empty_input())
            inputs = inputs[:3] + [z]
        attrs = dict(node.attrs)
        attrs["activation"] = "Relu"
        fuse(graph, nodes, "FusedConv", inputs, out, attrs=attrs,
             name=f"{node.name}/FusedConv" if node.name else None)
        return {"op": "com.microsoft.FusedConv", "activation": "Relu", "with_add": z is not None}
