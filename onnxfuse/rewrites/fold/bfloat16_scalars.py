"""Small bfloat16 constant arithmetic, folded as ONNX Runtime's CUDA kernels compute it (fold-constants' helper).

Why
---
fold-constants evaluates constant subgraphs with ONNX Runtime's CPU provider, which has almost no bfloat16
kernels, so it leaves every node that reads or writes bfloat16 alone. Under ``--precision bf16`` that kept
the size arithmetic of torch's legacy ``scaled_dot_product_attention`` symbolic, ``Sqrt(1 / Sqrt(Cast(D)))``
on the query and key heads, as run-time nodes (a GPT-2 exported with ``do_constant_folding=False``): the
attention rule wants a constant scale, so no attention fused, where float16 fused both layers.

What and why it is exact
------------------------
A node whose every input is a constant of at most :data:`MAX_ELEMENTS` elements, one of :data:`OPS`, with a
bfloat16 input or output, becomes a constant: computed in float32 from its inputs (bfloat16 values are float32
values) and rounded once to bfloat16, to nearest even (ml_dtypes' conversion). ONNX Runtime's CUDA kernels of
these ops in bfloat16 compute each element in float32 (or bfloat16's native instructions) and round to
nearest; float32's ``+ − × ÷`` and ``√`` are correctly rounded, and rounding a correctly rounded float32
result again to bfloat16's 8 bits is the correctly rounded bfloat16 result (24 ≥ 2·8 + 2 bits: the double
rounding is innocuous), so the constant is the value the kernel gives. ``Cast`` to bfloat16 goes through
float32 as the kernel's does: ONNX Runtime's CUDA ``Cast`` (``OP_Cast`` in ``cast_op.cu``) converts with
``(BFloat16)a``, and its ``BFloat16`` has a ``float`` constructor only, so a float64 or an integer is first
converted to float32 (to nearest) and that is rounded to bfloat16 (``__float2bfloat16``). For a float64
or an integer beyond 2²⁴ that rounds twice, and the folded constant rounds the same twice: the kernel's
value, not the single correctly rounded one (1 + 2⁻⁸ + 2⁻³⁰ is 1.0 both ways here, 1.0078125 rounded once).
Leaving those to the run time instead kept torch 2.11's sdpa scale, a float64 constant cast down, as a
run-time node in GPT-2 small under ``--precision bf16``: no attention fused (docs/benchmarks.md 5.52).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import replace_reads
from onnxfuse.rewrites.facts.graph import BF16, constant_value, dtype_of, is_op

#: ops folded here: elementwise arithmetic float32 computes correctly rounded, and Cast
OPS = ("Cast", "Sqrt", "Reciprocal", "Neg", "Add", "Sub", "Mul", "Div", "Identity")
#: the most elements a folded result may hold (scales and sizes, not weights)
MAX_ELEMENTS = 64


def _float32_result(node, values: list[np.ndarray]) -> np.ndarray | None:
    """The node's result in float32 from float32 inputs, or None when it is not computed here."""
    if node.op == "Cast":  # through float32, as the CUDA kernel converts (module docstring)
        source = values[0]
        return None if source.dtype.kind not in "fiub" and source.dtype not in BF16 else source.astype(np.float32)
    x = [v.astype(np.float32) for v in values]
    with np.errstate(all="ignore"):
        return {
            "Identity": lambda: x[0], "Sqrt": lambda: np.sqrt(x[0]), "Neg": lambda: -x[0],
            "Reciprocal": lambda: np.float32(1) / x[0], "Add": lambda: x[0] + x[1], "Sub": lambda: x[0] - x[1],
            "Mul": lambda: x[0] * x[1], "Div": lambda: x[0] / x[1],
        }[node.op]().astype(np.float32)


def fold_bfloat16_scalars(graph: gs.Graph) -> int:
    """Replace each foldable bfloat16 node of ``graph`` (module docstring) by a constant; the number folded.
    Walks in graph order, so a chain folds in one call."""
    if not BF16:
        return 0
    folded = 0
    for node in list(graph.nodes):
        if not is_op(node, *OPS) or len(node.outputs) != 1 or not node.inputs:
            continue
        out = node.outputs[0]
        if any(t is out for t in graph.outputs):
            continue
        to = int(node.attrs.get("to", 0)) if node.op == "Cast" else None
        if to is not None and to not in (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16):
            continue
        types = [dtype_of(graph, t) for t in node.inputs]
        if not (any(t in BF16 for t in types) or to == onnx.TensorProto.BFLOAT16):
            continue
        values = [constant_value(graph, t) for t in node.inputs]
        if any(v is None for v in values) or any(v.size > MAX_ELEMENTS for v in values):
            continue
        result = _float32_result(node, [np.asarray(v) for v in values])
        if result is None or result.size > MAX_ELEMENTS:
            continue
        value = result if to == onnx.TensorProto.FLOAT else result.astype(BF16[0])
        replace_reads(out, gs.Constant(f"{out.name}/bfloat16_folded", np.asarray(value)))
        node.inputs.clear()
        node.outputs.clear()
        folded += 1
    if folded:
        graph.cleanup(remove_unused_graph_inputs=False)
    return folded
