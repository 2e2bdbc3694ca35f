"""Ops only ONNX Runtime's CUDA provider runs, written in standard ONNX ops for its CPU provider.

Why: a rewrite may write an op that has a CUDA kernel only (``contrib-channels-last``'s com.microsoft
``NhwcConv``). On a machine without a GPU such a model cannot even be loaded, so it could be neither
validated (a user's CPU-only CI runner, a tuning record made on the GPU and applied there) nor diffed.
:func:`for_cpu` rewrites each such node as its definition, an exact composition of standard ops, so the
CPU provider computes the same function: validation then checks the rewrite against what the op means.
That the CUDA kernel computes the same is the GPU tests' job (tests/gpu/test_channels_last_gpu.py
compares the real op with the original graph). Timing a stand-in says nothing about the GPU.

Stand-ins:

* ``NhwcConv(x, w, b)``, x [N, H, W, C] and w channels-last [M, kH, kW, C/group] (the layout the op reads
  a pre-packed weight in: contrib_channels_last.py says why) = ``Transpose(Conv(Transpose(x, [0, 3, 1, 2]),
  Transpose(w, [0, 3, 1, 2]), b), [0, 2, 3, 1])`` with the node's attributes: transposes only move values.
"""

from __future__ import annotations

import onnx
from onnx import helper

from onnxfuse.model_io import proto_graphs

MS_DOMAIN = "com.microsoft"
TO_NCHW, TO_NHWC = [0, 3, 1, 2], [0, 2, 3, 1]


def _nhwc_conv(node: onnx.NodeProto, tag: str) -> list[onnx.NodeProto]:
    x, w, y = f"{tag}/x_nchw", f"{tag}/w_nchw", f"{tag}/y_nchw"
    conv = helper.make_node("Conv", [x, w, *node.input[2:]], [y], name=f"{tag}/Conv")
    conv.attribute.extend(node.attribute)
    return [helper.make_node("Transpose", [node.input[0]], [x], name=f"{tag}/x", perm=TO_NCHW),
            helper.make_node("Transpose", [node.input[1]], [w], name=f"{tag}/w", perm=TO_NCHW),
            conv,
            helper.make_node("Transpose", [y], [node.output[0]], name=f"{tag}/y", perm=TO_NHWC)]


#: (domain, op) → the node's definition in standard ops
STAND_INS = {(MS_DOMAIN, "NhwcConv"): _nhwc_conv}


def cuda_only_ops(model: onnx.ModelProto) -> list[str]:
    """``domain::op`` of each op in ``model`` (subgraphs included) that only ONNX Runtime's CUDA provider
    runs (:data:`STAND_INS`), sorted: a model with one needs that provider wherever it is deployed."""
    return sorted({f"{node.domain}::{node.op_type}" for g in proto_graphs(model.graph) for node in g.node
                   if (node.domain, node.op_type) in STAND_INS})


def needs_stand_ins(model: onnx.ModelProto) -> bool:
    """``model`` has a node only ONNX Runtime's CUDA provider runs (:data:`STAND_INS`)."""
    return bool(cuda_only_ops(model))


def for_cpu(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself when the CPU provider runs all of it; else a copy with every op of
    :data:`STAND_INS` written as its definition."""
    if not needs_stand_ins(model):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    count = 0
    for graph in proto_graphs(out.graph):  # lazily: a graph's bodies are walked after its nodes are replaced
        nodes = []
        for node in graph.node:
            make = STAND_INS.get((node.domain, node.op_type))
            if make is None:
                nodes.append(node)
                continue
            count += 1
            nodes.extend(make(node, f"onnxfuse_stand_in_{count}/{node.name or node.output[0]}"))
        del graph.node[:]
        graph.node.extend(nodes)
    return out
