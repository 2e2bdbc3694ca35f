"""The value an ONNX ``Constant`` node writes, read from the protobuf (``onnx.NodeProto``).

A Constant may hold its value in ``value`` (a tensor) or in ``value_int(s)`` / ``value_float(s)``; a
reader that looks at ``value`` only misses the others (input ranges once did: ``ids == Constant(value_int=5)``
gave no range). Used by the layers that read protobuf graphs (``runtime/input_ranges.py``,
``range_dims.py``); the rewrites read graphsurgeon nodes with ``rewrites.engine.facts.constant_node_value``,
which reads the same attributes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

#: Element types of the ``Constant`` attributes other than ``value`` (a tensor).
_SCALAR_ATTRS = {"value_int": np.int64, "value_ints": np.int64, "value_float": np.float32,
                 "value_floats": np.float32}


def constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The value of a default-domain ``Constant`` node, or None (another op, or a string / sparse value)."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name in _SCALAR_ATTRS:
            return np.asarray(onnx.helper.get_attribute_value(a), _SCALAR_ATTRS[a.name])
    return None
