"""MatMuls that read the same tensor with constant weights (q, k and v projections) become one MatMul over
the weights side by side, cut back by a Split; their constant bias Adds become one Add.

Why
---
Llama-family attention projects the normed hidden state three times, ``q = x·W_q (+ b_q)``, ``k = x·W_k
(+ b_k)``, ``v = x·W_v (+ b_v)``: three GEMMs (six kernels with Qwen2's biases) per layer. A KV-cache
decode step multiplies one token at a time, so each of those is a tiny launch-bound GEMV (issue 31:
onnxruntime-genai's hand-built graph packs them into one). ``Split(x·[W_q | W_k | W_v] + [b_q | b_k |
b_v])`` is three kernels, or two without biases, reading x once.

Exactness
---------
Column j of x·[W₁ | W₂ | …] is the dot product of x's row with the same weight column as in the
MatMul that owned it, and the Split hands each block back in order; likewise the bias. The values
differ only by the order in which the GEMM library accumulates each dot product (its tiling depends
on the matrix width): rounding, which validation bounds like any rewrite.

Conditions: at least two MatMuls whose first input is the same tensor x and whose second is a 2-D
constant [K, Nᵢ] of x's element type, read by nothing else (its values move into the packed weight; a
bias, N values, may be shared: it is copied);
packed only when that removes kernels: three or more MatMuls, or two whose every MatMul feeds exactly
one Add of a 1-D constant [Nᵢ] (the biases then pack too; otherwise only the MatMuls do). It runs
after the contrib rules (contrib-attention packs BERT's q, k and v into its own Attention, and the
FusedMatMul rules take a MatMul's scale and transposes) and before fuse-elementwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, append_split, new_constant
from onnxfuse.rewrites.facts.graph import (consumers, constant_value, dtype_of, is_graph_output, is_op,
                                            other_input, shape_of)
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule


def _weight(graph, mm, dtype):
    """The MatMul's constant [K, N] weight when it is read by this MatMul alone, else None."""
    w = mm.inputs[1]
    value = constant_value(graph, w)
    if value is None or value.ndim != 2 or value.dtype != dtype or len(consumers(w)) != 1 or is_graph_output(graph, w):
        return None
    return value


def _bias(graph, mm, width: int):
    """(Add, its [N] constant) when the MatMul's output feeds exactly one Add of a 1-D constant, else None."""
    out = mm.outputs[0]
    readers = consumers(out)
    if len(readers) != 1 or is_graph_output(graph, out) or not is_op(readers[0], "Add") or len(readers[0].inputs) != 2:
        return None
    add = readers[0]
    other = other_input(add, out)
    value = constant_value(graph, other) if other is not None else None
    if value is None or value.shape != (width,):  # a bias shared with other Adds is copied: N values
        return None
    return add, value


class PackSiblingMatmuls(Rule):
    """MatMul(x, W₁), MatMul(x, W₂), … (+ b₁, b₂, …) → Split(MatMul(x, [W₁ | W₂ | …]) (+ [b₁ | b₂ | …]))."""

    name = "pack-sibling-matmuls"
    description = "MatMuls of one tensor by constant weights (q, k, v projections) → one MatMul + Split (biases packed)"
    targets = frozenset(TARGETS)

    def match(self, graph):
        seen = set()
        for node in graph.nodes:
            if is_op(node, "MatMul") and len(node.inputs) == 2 and id(node.inputs[0]) not in seen:
                seen.add(id(node.inputs[0]))
                siblings = [c for c in consumers(node.inputs[0]) if is_op(c, "MatMul") and len(c.inputs) == 2
                            and c.inputs[0] is node.inputs[0] and c.inputs[1] is not node.inputs[0]]
                if len(siblings) >= 2:
                    yield siblings[0]

    def check(self, graph, first):
        x = first.inputs[0]
        dtype = dtype_of(graph, x)
        shape = shape_of(graph, x)
        if dtype is None or shape is None or len(shape) < 2:
            return Refuse("the shared input's element type or rank is unknown")
        group = []
        here = {id(n) for n in graph.nodes}  # graphsurgeon also lists readers inside If/Loop bodies
        for mm in consumers(x):
            if id(mm) in here and is_op(mm, "MatMul") and len(mm.inputs) == 2 and mm.inputs[0] is x:
                w = _weight(graph, mm, dtype)
                if w is not None and w.shape[0] == (shape[-1] if isinstance(shape[-1], int) else w.shape[0]):
                    group.append((mm, w))
        if len(group) < 2 or len({w.shape[0] for _, w in group}) != 1:
            return Refuse("fewer than two MatMuls of this tensor by constant [K, N] weights read only there")
        biases = [_bias(graph, mm, w.shape[1]) for mm, w in group]
        with_bias = all(b is not None for b in biases)
        if len(group) < 3 and not with_bias:
            return Refuse("two MatMuls without bias Adds: packing them would not remove a kernel (Split replaces one)")
        return Plan(first, (x, group, biases if with_bias else None))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        x, group, biases = plan.found
        names = NameAllocator(graph)
        base = (group[0][0].name or "matmul") + "/packed"
        widths = [w.shape[1] for _, w in group]
        dtype = group[0][1].dtype
        packed = gs.Variable(names(f"{base}/out"), dtype=dtype)
        graph.nodes.append(gs.Node("MatMul", names(f"{base}/MatMul"), inputs=[
            x, new_constant(graph, f"{base}/weight", np.concatenate([w for _, w in group], axis=1))], outputs=[packed]))
        if biases is not None:
            biased = gs.Variable(names(f"{base}/biased"), dtype=dtype)
            graph.nodes.append(gs.Node("Add", names(f"{base}/Add"), inputs=[
                packed, new_constant(graph, f"{base}/bias", np.concatenate([b for _, b in biases]))], outputs=[biased]))
            packed = biased
            outs = [add.outputs[0] for add, _ in biases]
            dropped = [mm for mm, _ in group] + [add for add, _ in biases]
        else:
            outs = [mm.outputs[0] for mm, _ in group]
            dropped = [mm for mm, _ in group]
        for node in dropped:
            node.outputs.clear()
            node.inputs.clear()
        append_split(graph, base, packed, widths, outs, names)
        return {"input": x.name, "matmuls": len(group), "biases": biases is not None, "widths": widths}
