"""The value an ONNX ``Constant`` node writes, read from either graph format: one reader, one table.

A Constant may hold its value in ``value`` (a tensor) or in ``value_int(s)`` / ``value_float(s)``; a
reader that looks at ``value`` only misses the others (input ranges once did: ``ids == Constant(value_int=5)``
gave no range). :func:`constant_node_value` reads a protobuf node (``onnx.NodeProto``: the layers that
read protobuf graphs, ``runtime/input_ranges.py``, ``runtime/dim_symbols.py``, ``precision.py``,
:mod:`.range_dims`) and a graphsurgeon node (the rewrites, through :func:`.graph.constant_value`) alike;
both go through :data:`VALUE_ATTRS` and :func:`_attribute_value`, so the two formats cannot disagree on
an attribute's element type.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper

#: Element types of the ``Constant`` attributes other than ``value`` (a tensor).
_SCALAR_ATTRS = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32,
                 "value_floats": np.float32}

#: The attributes a graphsurgeon Constant node is read from, in the order they are tried (a valid node
#: has exactly one); strings and sparse tensors are read by no rule.
VALUE_ATTRS = ("value", "value_float", "value_int", "value_floats", "value_ints")


def _attribute_value(name: str, raw) -> np.ndarray:
    """The array a ``Constant`` attribute ``name`` (one of :data:`VALUE_ATTRS`) holding ``raw`` writes."""
    if name == "value":
        return np.asarray(raw)
    return np.asarray(raw, dtype=_SCALAR_ATTRS[name])


def constant_node_value(node) -> np.ndarray | None:
    """The value an ONNX ``Constant`` node writes (``value``, ``value_float(s)``, ``value_int(s)``), or
    ``None`` for the attributes no reader needs (strings, sparse tensors).

    A protobuf ``node`` is read only when it is a default-domain ``Constant`` (None for another op), its
    attributes in their order; a graphsurgeon ``node`` is taken to be a Constant (its callers found it
    with :func:`.graph.constant_producer`), its attributes in :data:`VALUE_ATTRS` order."""
    if isinstance(node, onnx.NodeProto):
        return _proto_constant_value(node)
    attrs = node.attrs
    for name in VALUE_ATTRS:
        if name in attrs:
            raw = attrs[name]
            if name == "value" and isinstance(raw, gs.Constant):
                raw = raw.values
            return _attribute_value(name, raw)
    return None


def _proto_constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    for a in node.attribute:
        if a.name == "value":
            return _attribute_value("value", numpy_helper.to_array(a.t))
        if a.name in _SCALAR_ATTRS:
            return _attribute_value(a.name, onnx.helper.get_attribute_value(a))
    return None
