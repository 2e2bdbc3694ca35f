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
For ``Reshape(x, Concat(p₀, …, pₖ))`` whose parts are constants or one-element
computed values (or a target a Shape chain computes whole, one part), the target becomes a constant:

* a computed part that is ``x``'s own dimension at the same position (``Gather(Shape(x), i)``,
  possibly through Unsqueeze/Squeeze/Cast/Slice), or another tensor's dimension that shape inference
  named with the same symbol (``batch``) or that has the same static size, becomes ``0``, ONNX's "copy
  this dimension";
* a computed part of several elements whose value the Shape chain determines
  (:func:`~onnxfuse.rewrites.facts.shape_values.shape_value`: static sizes and dimension names, e.g.
  ``Shape(idx)`` of transformers 5's mask index grid, [batch, 1, 1, 128]) contributes its static sizes
  as constants (the values the original computes, so the same meaning) and its names as copies when x
  has that name at the same position, else as computed entries;
* a one-element computed part whose value the Shape chain determines as a static size (``Gather(Shape(y),
  2)`` where y's dimension 2 is 8400, the rest of y's shape dynamic) becomes that size;
* then, if exactly one computed part is left and no constant is ``-1``, it becomes ``-1`` ("infer").

Exactness: ``0`` reproduces the copied value by definition. ``-1`` is inferred as the element count of
``x`` divided by the product of the other entries; whenever the original Reshape succeeds that
product times the computed value *is* the element count, so the inferred value equals the computed one
(the constant entries are checked to be positive, so the division is defined). A copy proven by a
shared symbolic name relies on the model's own declaration (in ONNX the same ``dim_param`` means the
same size; ONNX Runtime does not check it, so inputs that break it are outside the contract). The one difference is
a zero-size tensor whose computed entry is 0: the original then copies ``x``'s dimension at that
position, ``-1`` infers 0.

``allowzero=1`` (torch's dynamo exporter writes it on every ``view``): the computed entries are read
literally there, and a proven copy's literal value *is* the copied dimension, so the new target is
written with ``allowzero=0`` (its 0s copy) and means the same, unless a constant entry is 0 (literal
there, a copy after): refused. Refused: two or more computed entries that are not copies, multi-element
computed parts that are not copies, ``allowzero=1`` with a zero constant, unknown part sizes.
The Concat and its inputs stay when something else reads them; otherwise cleanup removes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxfuse.rewrites.engine.edit import new_constant
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import constant_value, is_op, producer_of
from onnxfuse.rewrites.facts.shape_values import shape_read, shape_value


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
        dims = shape_read(graph, tensor)
        if dims is not None:
            return len(dims[1])
    shape = getattr(tensor, "shape", None)
    if shape is None or any(not isinstance(d, (int, np.integer)) for d in shape):
        return None
    return int(np.prod(shape)) if len(shape) else 1


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


def _whole_shape_target(graph, target) -> bool:
    """A computed (non-constant) target that a Shape chain gives whole: read by ``shape_read`` or valued
    by ``shape_value`` (cleanup turns the exporter's one-input ``Concat(Shape(y))`` into ``Shape(y)``)."""
    if producer_of(target) is None or constant_value(graph, target) is not None:
        return False
    return shape_read(graph, target) is not None or shape_value(graph, target) is not None


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
            if is_op(node, "Reshape") and len(node.inputs) == 2 and (
                    is_op(producer_of(node.inputs[1]), "Concat") or _whole_shape_target(graph, node.inputs[1])):
                yield node

    def check(self, graph, node):
        x, target = node.inputs
        concat = producer_of(target)
        allowzero = int(node.attrs.get("allowzero", 0))
        if is_op(concat, "Concat"):
            if int(concat.attrs.get("axis", 0)) not in (0, -1):
                return Refuse("target is a Concat along another axis")
            parts = concat.inputs
        elif _whole_shape_target(graph, target):
            parts = [target]  # one computed part: the whole target (a Concat of one input, removed by cleanup)
        else:
            return Refuse("target is no longer a Concat or a Shape chain")
        entries: list = []  # int constants, "copy" or "computed"
        computed = 0
        for part in parts:
            arr = constant_value(graph, part)
            if arr is not None:
                entries.extend(int(v) for v in arr.reshape(-1))
                continue
            dims = shape_read(graph, part)
            if dims is not None and _copies(x, len(entries), *dims):
                entries.extend(["copy"] * len(dims[1]))
                continue
            n = _num_elements(graph, part)
            if n == 1:
                value = shape_value(graph, part)  # a static size read from a Shape: that size
                if value is not None and isinstance(value[0], int) and not isinstance(value[0], bool) \
                        and value[0] > 0:
                    entries.append(value[0])
                    continue
            if n != 1:
                values = shape_value(graph, part)
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
            return Refuse("allowzero=1 with a constant 0 (a zero-size axis there, a copy once written as allowzero=0)")
        shape = [0 if e == "copy" else (-1 if e == "computed" else e) for e in entries]
        return Plan(node, np.asarray(shape, dtype=np.int64))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        node, shape = plan.anchor, plan.found
        node.inputs[1] = new_constant(graph, f"{node.name or node.outputs[0].name}_target", shape)
        if "allowzero" in node.attrs:  # its 0s are copies (check refused a literal 0 under allowzero=1);
            node.attrs["allowzero"] = 0  # below opset 14 Reshape has no such attribute to write
        return {"node": node.name, "target": shape.tolist()}
