"""The length of ``Range(0, n, 1)`` when n is a dimension: a fact ONNX shape inference does not derive.

Why
---
transformers 5 builds its attention masks from index tensors: ``batch_idx = Range(0, B, 1)`` with
``B = Gather(Shape(hidden_states), 0)``, then ``padding_mask[batch_idx, kv_idx]``. ONNX's inference (with
data propagation) gives a Range output a fresh unknown dimension (``unk__N``) even when its limit is a
dimension it knows, so every tensor built from the index loses its batch dimension, and a rule cannot
prove that the mask is ``[batch, 1, 1, L]`` (contrib-attention's ``mask_index``; measured: 0.03–0.13 ms
per BERT-base inference on an H100, docs/benchmarks.md 5.7).

What is proved
--------------
``Range(start, limit, delta)`` has ``max(0, ceil((limit - start) / delta))`` elements. With start the
constant 0 and delta the constant 1 that is ``max(0, limit)``, and ``limit`` traced back to one
dimension ``d`` of a tensor T (``Gather(Shape(T), k)`` with a constant scalar k, through integer Casts,
Squeeze, Reshape to a scalar and Identity) is a size, so ``>= 0``: the length is exactly T's dimension k,
a number or a named dimension (never an ``unk__`` name: those are only meaningful within one inference).
The symbol inference gave the Range's length is renamed to that dimension (:func:`range_lengths`).
"""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from onnxfuse.rewrites.facts.constants import constant_node_value

#: Integer element types a Cast may change the limit to without changing its value (a size < 2**31).
_INT_TYPES = {onnx.TensorProto.INT32, onnx.TensorProto.INT64}


def _constant_values(graph: onnx.GraphProto) -> dict:
    values = {}
    for init in graph.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL and len(init.dims) <= 1:
            try:
                values[init.name] = numpy_helper.to_array(init)
            except Exception:  # an unreadable initializer is simply not a known constant
                pass
    for node in graph.node:
        value = constant_node_value(node)
        if value is not None and node.output:
            values[node.output[0]] = value
    return values


def _is_scalar_constant(values, name, expected) -> bool:
    v = values.get(name)
    return v is not None and v.size == 1 and v.dtype.kind in "iu" and int(v.reshape(())) == expected


def _shapes(model: onnx.ModelProto) -> dict:
    shapes = {}
    for vi in list(model.graph.input) + list(model.graph.value_info) + list(model.graph.output):
        t = vi.type.tensor_type
        if vi.type.HasField("tensor_type") and t.HasField("shape"):
            shapes[vi.name] = list(t.shape.dim)
    return shapes


def _known(dim) -> bool:
    if dim.HasField("dim_value"):
        return dim.dim_value >= 0
    return dim.HasField("dim_param") and bool(dim.dim_param) and not dim.dim_param.startswith("unk__")


def _limit_dim(name, producers, values, shapes, depth: int = 6):
    """The dimension (a TensorShapeProto.Dimension) that the scalar ``name`` provably equals, or None."""
    for _ in range(depth):
        node = producers.get(name)
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), None)
            if to not in _INT_TYPES:
                return None
            name = node.input[0]
        elif node.op_type in ("Identity", "Squeeze", "Reshape") and node.input:
            name = node.input[0]
        elif node.op_type == "Gather" and len(node.input) == 2:
            shape_node = producers.get(node.input[0])
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            k = values.get(node.input[1])
            if (shape_node is None or shape_node.op_type != "Shape" or shape_node.attribute or axis != 0
                    or k is None or k.size != 1 or k.dtype.kind not in "iu"):
                return None
            dims = shapes.get(shape_node.input[0])
            index = int(k.reshape(()))
            if dims is None or not -len(dims) <= index < len(dims):
                return None
            dim = dims[index]
            return dim if _known(dim) else None
        else:
            return None
    return None


def range_lengths(model: onnx.ModelProto) -> bool:
    """Give every ``Range(0, dim, 1)`` of ``model``'s main graph (already inferred) its proved length.

    Inference names an unknown Range length with a fresh symbol (``unk__N``) and shares that symbol only
    with dimensions it proved equal to it (an Unsqueeze keeps it, a broadcast against 1 keeps it), so
    renaming the symbol to the proved dimension wherever it occurs is sound; it also reaches every
    tensor downstream without inferring again. Returns True when something was renamed."""
    graph = model.graph
    ranges = [n for n in graph.node if n.op_type == "Range" and n.domain in ("", "ai.onnx") and len(n.input) == 3]
    if not ranges:
        return False
    values = _constant_values(graph)
    producers = {o: n for n in graph.node for o in n.output}
    shapes = _shapes(model)
    renames = {}
    for node in ranges:
        start, limit, delta = node.input
        if not (_is_scalar_constant(values, start, 0) and _is_scalar_constant(values, delta, 1)):
            continue
        dims = shapes.get(node.output[0])
        if dims is None or len(dims) != 1 or _known(dims[0]) or not dims[0].dim_param:
            continue
        dim = _limit_dim(limit, producers, values, shapes)
        if dim is not None:
            renames[dims[0].dim_param] = dim
    if not renames:
        return False
    for vi in list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                if d.HasField("dim_param") and d.dim_param in renames:
                    d.CopyFrom(renames[d.dim_param])
    return True
