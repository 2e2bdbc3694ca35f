"""The values an integer input can legitimately take, read from the graph.

Random validation data must look like what the model is fed. Integer inputs are indices far more
often than quantities: token ids into an embedding table, positions, class ids for a OneHot. Drawn
as 0 or 1 (the old default), a token model sees only two rows of its embedding, where it can amplify
rounding a thousandfold: the exact FastGelu rewrite then drifted 2.5e-4 on a real byte-level model
(a false alarm), against 1.2e-8 on token-like ids.

:func:`implied_ranges` follows each integer graph input forward through ops that keep its values
(Cast to an integer type, Reshape, Squeeze, Unsqueeze, Flatten, Identity, Expand, Transpose, Slice,
Concat) to the ops that use them as indices:

* ``Gather(data, indices, axis)`` and ``GatherElements``: ``[0, data.shape[axis] - 1]`` when that
  dimension is known (an embedding with V rows gives ``[0, V-1]``);
* ``OneHot(indices, depth)`` with a constant depth: ``[0, depth - 1]``;
* a comparison with constants (``Equal``, ``Less``, ``Greater`` and their ``OrEqual`` forms, as in
  ``mask == 0`` or ``ids < vocab``): ``[min(c) - 1, max(c) + 1]`` (not below 0 when every constant is
  >= 0), so both outcomes of every comparison occur.

* a *shape-like* use, where only some values are legal whatever the data: the shape of an ``Expand``
  (``[1, 1]``: ones keep the input's shape and broadcast with anything), the ``repeats`` of a ``Tile``
  (``[1, 2]``), the shape of a ``ConstantOfShape`` (``[1, 4]``: small, non-empty), and the shape of a
  ``Reshape`` without ``allowzero`` (``[0, 0]``: 0 copies the input's dimension, so the target is
  legal whenever it has the input's rank). Drawn as 0 or 1, these made the *original* model fail
  before anything was compared.

* a *lengths mask*: an input summed (``ReduceSum``, then Sub/Add/Cast) into GroupQueryAttention's
  ``seqlens_k``, as onnxruntime-genai's builder writes ``attention_mask``: ``[1, 1]``. The kernel
  refuses a row with fewer kept keys than new tokens (``seqlens_k[0] = 0 is too small``), and a random
  0/1 row says nothing a padded batch would: all ones is what a generation loop feeds.

Several uses intersect: a shape-like use wins (it is a requirement, the others are realism), then an
index range (the tightest table), then a comparison. Inputs with no such use keep ``[0, 1]``: masks
and token-type ids, the other common integer inputs, are 0/1. ``--input-range NAME:LO,HI`` overrides
any of this (inclusive bounds). Floating inputs are standard normal unless given a range, then
uniform in ``[LO, HI)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse.errors import UsageError
from onnxfuse.rewrites.facts.constants import constant_node_value

#: Ops whose output holds the input's values (possibly fewer, rearranged or repeated).
VALUE_PRESERVING = {"Cast", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Expand", "Transpose",
                    "Slice", "Concat", "Tile"}
COMPARISONS = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"}
#: Shape-like uses: op → (which input, lo, hi, why). See the module docstring.
SHAPE_USES = {
    "Expand": (1, 1, 1, "the shape of Expand {node}: ones keep the input's shape"),
    "Tile": (1, 1, 2, "the repeats of Tile {node}"),
    "ConstantOfShape": (0, 1, 4, "the shape of ConstantOfShape {node}"),
    "Reshape": (1, 0, 0, "the shape of Reshape {node}: 0 copies each input dimension"),
}
#: Which implied range wins when an input has several uses (higher wins).
COMPARISON, INDEX, SHAPE_LIKE = 0, 1, 2
INTEGER_TYPES = {onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
                 onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64}


@dataclass(frozen=True)
class ValueRange:
    """Inclusive bounds for an input's random values, and where they come from (for the note)."""

    lo: float
    hi: float
    why: str
    indexes: bool = False  # the input indexes rows of a Gather or GatherElements (token ids into an embedding)

    def describe(self, name: str) -> str:
        return f"input {name!r}: values in [{_num(self.lo)}, {_num(self.hi)}] ({self.why})"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"


def parse_range_options(values) -> dict[str, ValueRange]:
    """``NAME:LO,HI`` options (repeatable; bounds inclusive for integers) → ranges. Bad syntax, NaN
    bounds or LO > HI are usage errors."""
    ranges: dict[str, ValueRange] = {}
    for value in values or ():
        name, sep, bounds = value.rpartition(":")
        parts = bounds.split(",")
        if not sep or not name or len(parts) != 2:
            raise UsageError(f"--input-range {value!r}: expected NAME:LO,HI (e.g. input_ids:0,30521)")
        try:
            lo, hi = float(parts[0]), float(parts[1])
        except ValueError:
            raise UsageError(f"--input-range {value!r}: LO and HI must be numbers") from None
        if not (np.isfinite(lo) and np.isfinite(hi)) or lo > hi:
            raise UsageError(f"--input-range {value!r}: need finite LO <= HI")
        ranges[name] = ValueRange(lo, hi, "--input-range")
    return ranges


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    # looked up when called: tests/test_model_io_large.py stands in for infer_shapes
    from onnxfuse.model_io import infer_shapes

    try:
        inferred = infer_shapes(model)
    except Exception:  # inference is a help here, not a requirement
        inferred = model
    shapes: dict[str, list] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    for t in model.graph.initializer:
        shapes[t.name] = list(t.dims)
    return shapes


def _constant(model: onnx.ModelProto, name: str):
    """An initializer's value, or a ``Constant`` node's from any of its numeric attributes."""
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output and n.output[0] == name:
            return constant_node_value(n)
    return None


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def implied_ranges(model: onnx.ModelProto) -> dict[str, ValueRange]:
    """Ranges for integer graph inputs that index something (see the module docstring)."""
    inits = {t.name for t in model.graph.initializer}
    int_inputs = [vi.name for vi in model.graph.input
                  if vi.name not in inits and vi.type.tensor_type.elem_type in INTEGER_TYPES]
    if not int_inputs:
        return {}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for i in node.input:
            readers.setdefault(i, []).append(node)
    shapes = None
    out: dict[str, ValueRange] = {}
    for name in int_inputs:
        best: ValueRange | None = None
        best_rank = COMPARISON
        stack, seen = [name], {name}
        while stack:
            value = stack.pop()
            for node in readers.get(value, ()):
                found, rank = None, INDEX
                if node.op_type in ("Gather", "GatherElements") and len(node.input) > 1 and node.input[1] == value:
                    shapes = shapes if shapes is not None else _shapes(model)
                    data = shapes.get(node.input[0])
                    axis = int(_attr(node, "axis", 0))
                    if data and -len(data) <= axis < len(data) and data[axis]:
                        rows = int(data[axis])
                        found = ValueRange(0, rows - 1, f"indices into {rows} entries of {node.op_type} "
                                                        f"{node.name or node.input[0]!r}", indexes=True)
                elif node.op_type == "OneHot" and node.input and node.input[0] == value and len(node.input) > 1:
                    depth = _constant(model, node.input[1])
                    if depth is not None and np.size(depth) == 1:
                        found = ValueRange(0, int(np.asarray(depth).reshape(())) - 1, f"OneHot depth {int(np.asarray(depth).reshape(()))}")
                elif node.op_type in COMPARISONS and len(node.input) == 2:
                    other = node.input[1] if node.input[0] == value else node.input[0]
                    c = _constant(model, other)
                    if c is not None and np.size(c) and np.issubdtype(np.asarray(c).dtype, np.number):
                        lo, hi = float(np.min(c)) - 1, float(np.max(c)) + 1
                        lo = max(lo, 0.0) if float(np.min(c)) >= 0 else lo
                        found = ValueRange(np.ceil(lo), np.floor(hi), f"compared with {_num(float(np.min(c)))}"
                                           + (f"..{_num(float(np.max(c)))}" if np.size(c) > 1 else "")
                                           + f" by {node.op_type}")
                        rank = COMPARISON
                elif node.op_type in VALUE_PRESERVING and node.input and node.input[0] == value:
                    if node.op_type == "Cast" and _attr(node, "to", 0) not in INTEGER_TYPES:
                        continue
                    for o in node.output:
                        if o not in seen:
                            seen.add(o)
                            stack.append(o)
                elif node.op_type in SHAPE_USES:
                    index, lo, hi, why = SHAPE_USES[node.op_type]
                    allowzero = node.op_type == "Reshape" and _attr(node, "allowzero", 0)
                    if len(node.input) > index and node.input[index] == value and not allowzero:
                        found = ValueRange(lo, hi, why.format(node=repr(node.name or node.output[0])))
                        rank = SHAPE_LIKE
                if found is None or found.hi < found.lo:
                    continue
                if best is None or rank > best_rank or (rank == best_rank and found.hi - found.lo < best.hi - best.lo):
                    best, best_rank = found, rank
        if best is not None:
            out[name] = best
    for name in _lengths_masks(model, int_inputs, readers):
        out[name] = ValueRange(1, 1, "summed into GroupQueryAttention's seqlens_k: every key kept")
    return out


#: Ops between a summed mask and GroupQueryAttention's seqlens_k (``ReduceSum - 1``, cast to int32).
_LENGTH_STEPS = {"Sub", "Add", "Cast", "Identity", "Squeeze", "Reshape"}


def _lengths_masks(model: onnx.ModelProto, names: list[str], readers: dict) -> list[str]:
    """The integer inputs summed into a GroupQueryAttention's ``seqlens_k`` (input 5)."""
    found = []
    for name in names:
        stack = [n.output[0] for n in readers.get(name, ()) if n.op_type == "ReduceSum" and n.input[0] == name]
        seen = set(stack)
        while stack:
            value = stack.pop()
            for node in readers.get(value, ()):
                if node.op_type == "GroupQueryAttention" and len(node.input) > 5 and node.input[5] == value:
                    found.append(name)
                    stack = []
                    break
                if node.op_type in _LENGTH_STEPS and node.input[0] == value and node.output[0] not in seen:
                    seen.add(node.output[0])
                    stack.append(node.output[0])
    return found


__all__ = ["ValueRange", "implied_ranges", "parse_range_options"]
