"""Give a Reshape a constant target shape when only its dynamic sizes are computed.

Why
---
Exporters write ``x.view(n, t, heads, d)`` as ``Reshape(x, Concat(Unsqueeze(Gather(Shape(y), 0)),
[t], [heads], [d]))``: the batch size is read from some tensor's shape at run time even though the
Reshape could infer it. After ``fold-constants`` has turned every static entry into a constant, what
remains of each such chain is a few tiny CPU nodes (Shape, Gather, Unsqueeze, Mul, Concat) per
Reshape. ONNX Runtime executes them on every run (ViT-B/16: hundreds of nodes), which at batch 1
costs more host time than the GPU work they describe, and it refuses CUDA-graph capture of a model
that has CPU nodes. ONNX Runtime's own ReshapeFusion only handles the case where the Shape is taken
of the Reshape's own input.

What
----
For ``Reshape(x, Concat(p₀, …, pₖ))`` (``allowzero`` 0) whose parts are constants or one-element
computed values, the target becomes a constant:

* a computed part that is ``x``'s own dimension at the same position (``Gather(Shape(x), i)``,
  possibly through Unsqueeze/Squeeze/Cast/Slice), or another tensor's dimension that shape inference
  named with the same symbol (``batch``) or that has the same static size, becomes ``0``, ONNX's "copy
  this dimension";
* a computed part of several elements whose value the Shape chain determines
  (:func:`~onnxfuse.rewrites.engine.shape_values.shape_value`: static sizes and dimension names, e.g.
  ``Shape(idx)`` of transformers 5's mask index grid, [batch, 1, 1, 128]) contributes its static sizes
  as constants (the values the original computes, so the same meaning) and its names as copies when x
  has that name at the same position, else as computed entries;
* then, if exactly one computed part is left and no constant is ``-1``, it becomes ``-1`` ("infer").

Exactness: ``0`` reproduces the copied value by definition. ``-1`` is inferred as the element count of
``x`` divided by the product of the other entries; whenever the original Reshape succeeds that
product times the computed value *is* the element count, so the inferred value equals the computed one
(the constant entries are checked to be positive, so the division is defined). A copy proven by a
shared symbolic name relies on the model's own declaration (in ONNX the same ``dim_param`` means the
same size; ONNX Runtime does not check it, so inputs that break it are outside the contract). The one difference is
a zero-size tensor whose computed entry is 0: the original then copies ``x``'s dimension at that
position, ``-1`` infers 0. Refused: two or more computed entries that are not copies, multi-element
computed parts that are not copies, ``allowzero=1`` with a zero constant, unknown part sizes.
The Concat and its inputs stay when something else reads them; otherwise cleanup removes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxfuse.rewrites.engine.edit import new_constant
from onnxfuse.rewrites.engine.facts import constant_value, is_op, producer_of
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.engine.shape_values import shape_value

# Ops that pass a shape entry through unchanged (one element stays one element, value kept).
_PASS_THROUGH = frozenset({"Unsqueeze", "Squeeze", "Identity", "Reshape", "Flatten"})


def _num_elements(graph, tensor, depth: int = 0) -> int | None:
    """Element count of a small shape value: from the graph's structure where shape inference gave
    none (Unsqueeze of a Gather with a scalar index is one element), else from the tensor's shape."""
    arr = constant_value(graph, tensor)
    if arr is not None:
        return int(arr.size)
    node = producer_of(tensor)
    if node is not None and depth < 8:
        if is_op(node, "Unsqueeze", "Squeeze", "Identity", "Cast", "Neg", "Abs"):
            return _num_elements(graph, node.inputs[0], depth + 1)
        if is_op(node, "Gather") and (idx := constant_value(graph, node.inputs[1])) is not None:
            return int(idx.size)
        if is_op(node, "Mul", "Add", "Sub", "Div") and len(node.inputs) == 2:
            a, b = (_num_elements(graph, t, depth + 1) for t in node.inputs)
            if a is not None and b is not None and 1 in (a, b):
                return max(a, b)
        dims = _dims_of(graph, tensor)
        if dims is not None:
            return len(dims[1])
    shape = getattr(tensor, "shape", None)
    if shape is None or any(not isinstance(d, (int, np.integer)) for d in shape):
        return None
    return int(np.prod(shape)) if len(shape) else 1


def _dims_of(graph, part):
    """When ``part`` is ``Shape(src)[a:b]`` (through pass-through ops and Casts to int64), return
    ``(src, [a, a+1, ...])`` with non-negative positions; else None."""
    t = part
    for _ in range(8):
        node = producer_of(t)
        if node is None:
            return None
        if is_op(node, *_PASS_THROUGH) or (is_op(node, "Cast") and int(node.attrs.get("to", 0)) == 7):
            t = node.inputs[0]
            continue
        if is_op(node, "Gather") and int(node.attrs.get("axis", 0)) == 0:
            shape_node = producer_of(node.inputs[0])
            idx = constant_value(graph, node.inputs[1])
            if not is_op(shape_node, "Shape") or idx is None or idx.size != 1:
                return None
            src, positions = _shape_source(shape_node)
            if src is None:
                return None
            i = int(idx.reshape(-1)[0])
            i = i + len(positions) if i < 0 else i
            if not 0 <= i < len(positions):
                return None
            return src, [positions[i]]
        if is_op(node, "Shape"):
            src, positions = _shape_source(node)
            return (src, positions) if src is not None else None
        if is_op(node, "Slice"):
            shape_node = producer_of(node.inputs[0])
            if not is_op(shape_node, "Shape"):
                return None
            src, positions = _shape_source(shape_node)
            starts, ends = constant_value(graph, node.inputs[1]), constant_value(graph, node.inputs[2])
            extra = [constant_value(graph, t) for t in node.inputs[3:] if t.name]
            if src is None or starts is None or ends is None or starts.size != 1 or ends.size != 1:
                return None
            if any(e is None for e in extra):
                return None
            if len(extra) >= 1 and int(extra[0].reshape(-1)[0]) != 0:  # axes
                return None
            if len(extra) >= 2 and int(extra[1].reshape(-1)[0]) != 1:  # steps
                return None
            picked = positions[slice(int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0]))]
            return (src, list(picked)) if picked else None
        return None
    return None


def _shape_source(shape_node):
    """``(tensor, positions)`` for a Shape node (its start/end attributes applied); (None, None) when
    the source rank is unknown."""
    src = shape_node.inputs[0]
    shape = getattr(src, "shape", None)
    if shape is None:
        return None, None
    positions = list(range(len(shape)))
    start = shape_node.attrs.get("start")
    end = shape_node.attrs.get("end")
    if start is not None or end is not None:
        positions = positions[slice(int(start) if start is not None else None, int(end) if end is not None else None)]
    return src, positions


def _copies(x, start: int, src, positions) -> bool:
    """True when ``src``'s dimensions at ``positions`` are ``x``'s at ``start, start+1, ...``: the
    same tensor at the same indices, dimensions that shape inference gave the same symbolic name
    (``batch``), which means the same value, or the same static size (another layer's ``Shape`` that
    the duplicate merge left shared: ViT's [197, batch] read from layer 0 for every layer)."""
    if src is x:
        return positions == list(range(start, start + len(positions)))
    x_shape, s_shape = getattr(x, "shape", None), getattr(src, "shape", None)
    if x_shape is None or s_shape is None or start + len(positions) > len(x_shape):
        return False
    for k, p in enumerate(positions):
        a, b = x_shape[start + k], s_shape[p]
        named = isinstance(a, str) and a
        static = isinstance(a, (int, np.integer)) and not isinstance(a, bool) and a >= 0
        if not ((named or static) and a == b):
            return False
    return True


def _named_copy(x, position: int, name) -> bool:
    """x's dimension at ``position`` has the name ``name``: a 0 there copies that value."""
    shape = getattr(x, "shape", None)
    return isinstance(name, str) and shape is not None and position < len(shape) and shape[position] == name


class ConstantReshapeTarget(Rule):
    """Reshape(x, Concat(computed sizes)) → Reshape(x, constant) with 0 (copy) / -1 (infer).

    Runs for every target (the result is standard ONNX); the plan is the new target."""

    name = "constant-reshape-target"
    description = "Reshape targets computed from Shape become constants with 0 (copy) and -1 (infer)"
    targets = frozenset(TARGETS)
    #: A constant target with 0/-1 lets ONNX infer the output's dimensions (BERT's head merge: from
    #: ``(unk, unk, 768)`` to ``(batch, 128, 768)``), which later rules need to prove shapes equal.
    makes_shapes_inferable = True

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Reshape") and len(node.inputs) == 2 and is_op(producer_of(node.inputs[1]), "Concat"):
                yield node

    def check(self, graph, node):
        x, target = node.inputs
        concat = producer_of(target)
        allowzero = int(node.attrs.get("allowzero", 0))
        if not is_op(concat, "Concat") or int(concat.attrs.get("axis", 0)) not in (0, -1):
            return Refuse("target is no longer a Concat")
        entries: list = []  # int constants, "copy" or "computed"
        computed = 0
        for part in concat.inputs:
            arr = constant_value(graph, part)
            if arr is not None:
                entries.extend(int(v) for v in arr.reshape(-1))
                continue
            dims = _dims_of(graph, part)
            if dims is not None and allowzero == 0 and _copies(x, len(entries), *dims):
                entries.extend(["copy"] * len(dims[1]))
                continue
            n = _num_elements(graph, part)
            if n != 1:
                values = shape_value(graph, part) if allowzero == 0 else None
                if values is None or any(isinstance(v, bool) for v in values):
                    return Refuse(f"computed part {part.name!r} has {n if n is not None else 'an unknown number of'} "
                                  "elements and is not a copy of the input's dimensions")
                for v in values:  # what the Shape chain computes: sizes, or names
                    if isinstance(v, int):
                        entries.append(v)
                    elif _named_copy(x, len(entries), v):
                        entries.append("copy")
                    else:
                        entries.append("computed")
                        computed += 1
                continue
            entries.append("computed")
            computed += 1
        if computed == 0 and "copy" not in entries:
            return Refuse("target is already constant (fold-constants leaves nothing to do)")
        if computed > 1:
            return Refuse(f"{computed} computed sizes (only one can be inferred with -1)")
        consts = [e for e in entries if isinstance(e, int)]
        if computed == 1:
            if -1 in consts:
                return Refuse("a constant -1 is already present")
            if any(c <= 0 for c in consts):
                return Refuse("a constant size is not positive (0 or negative): -1 could not be inferred safely")
        if allowzero == 1 and 0 in consts:
            return Refuse("allowzero=1 with a zero size")
        shape = [0 if e == "copy" else (-1 if e == "computed" else e) for e in entries]
        return Plan(node, np.asarray(shape, dtype=np.int64))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        node, shape = plan.anchor, plan.found
        node.inputs[1] = new_constant(graph, f"{node.name or node.outputs[0].name}_target", shape)
        return {"node": node.name, "target": shape.tolist()}
