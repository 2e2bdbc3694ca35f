"""Which ``Resize`` nodes repeat each input element a whole number of times along each axis.

A nearest-mode ``Resize`` by integer factors s_i reads, for output index o_i along axis i, the input
element at floor(o_i / s_i) when its coordinate transformation and rounding agree on that. ONNX (opset 11
on) maps o to the input coordinate x and rounds x by ``nearest_mode``; with o = k·s + r (0 <= r < s):

* ``asymmetric``: x = o / s = k + r/s, in [k, k + 1): ``floor`` gives k (the rounding modes give k + 1
  once r/s >= 1/2);
* ``half_pixel``, ``pytorch_half_pixel`` (the same when the output length is above 1, which s >= 2 makes
  it): x = (o + 1/2)/s - 1/2 = k + (r + 1/2)/s - 1/2, strictly within 1/2 of k, so ``round_prefer_floor``
  and ``round_prefer_ceil`` give k (never a tie); ``floor`` and ``ceil`` do not;
* ``tf_half_pixel_for_nn``: x = (o + 1/2)/s = k + (r + 1/2)/s, in (k, k + 1): ``floor`` gives k.

An axis with s = 1 maps o to itself under each of these. ``align_corners``, ``half_pixel_symmetric`` and
``tf_crop_and_resize`` depend on the lengths or a region of interest: refused. So does opset 18's
``axes`` attribute and a ``keep_aspect_ratio_policy`` other than ``stretch``. The factors come from
constant ``scales`` that are whole numbers, or from ``sizes`` (the output length is then exactly in·s,
as ``floor(in · s)`` is for scales): each size a whole multiple of the input's static length on that
axis, or the input's own length on that axis read by a ``Shape`` chain (factor 1). That second form is
what ``F.interpolate(x, size=(h, w))`` exports with a dynamic batch (torchvision's feature pyramid):
``Concat(Slice(Shape(x), 0, 2), [h, w])`` (read by ``_size_entries``: ``Shape`` of the Resize's own input,
whatever name inference gave the dimension); a size that only carries the same dimension name as the
input, read from another tensor, is not proof.
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.facts.graph import constant_value, is_op, opset_of, producer_of, shape_of

#: (coordinate_transformation_mode, nearest_mode) pairs under which integer factors read floor(o / s)
FLOOR_MAPPINGS = frozenset({("asymmetric", "floor"), ("half_pixel", "round_prefer_floor"),
                            ("half_pixel", "round_prefer_ceil"), ("pytorch_half_pixel", "round_prefer_floor"),
                            ("pytorch_half_pixel", "round_prefer_ceil"), ("tf_half_pixel_for_nn", "floor")})

#: attributes that do not act on nearest resizing (ONNX's defaults for the rest are checked by value)
_IGNORED = frozenset({"cubic_coeff_a", "exclude_outside", "extrapolation_value", "antialias"})


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nearest_upsample_factors(graph, node) -> list[int] | None:
    """The whole-number factor per axis of ``node``, a ``Resize`` whose output element o reads input
    element floor(o / s) on every axis (see the module docstring), at least one factor above 1; None
    otherwise (any other Resize, or one this cannot prove)."""
    if not is_op(node, "Resize") or opset_of(graph) < 11 or len(node.inputs) < 3:
        return None
    attrs = {k: _text(v) for k, v in node.attrs.items() if k not in _IGNORED}
    if attrs.pop("mode", "nearest") != "nearest" or attrs.pop("keep_aspect_ratio_policy", "stretch") != "stretch":
        return None
    mapping = (attrs.pop("coordinate_transformation_mode", "half_pixel"),
               attrs.pop("nearest_mode", "round_prefer_floor"))
    if attrs or mapping not in FLOOR_MAPPINGS:  # anything left: opset 18's axes, or an attribute not known here
        return None
    rank = len(shape_of(graph, node.inputs[0]) or ())
    if len(node.inputs) > 3 and node.inputs[3].name:
        factors = _factors_from_sizes(graph, node)
        if factors is None:
            return None
    else:
        scales = constant_value(graph, node.inputs[2]) if node.inputs[2].name else None
        if scales is None or scales.size != rank or rank == 0:
            return None
        values = scales.reshape(-1).astype(np.float64)
        if not np.all(values >= 1) or not np.all(values == np.round(values)):
            return None
        factors = [int(v) for v in values]
    return factors if any(f > 1 for f in factors) else None


def _factors_from_sizes(graph, node) -> list[int] | None:
    """The factor per axis that ``node``'s ``sizes`` input gives (see the module docstring), or None."""
    data = node.inputs[0]
    dims, sizes = shape_of(graph, data), _size_entries(graph, node.inputs[3], data, 8)
    if dims is None or sizes is None or len(sizes) != len(dims):
        return None
    factors = []
    for axis, (size, dim) in enumerate(zip(sizes, dims)):
        if size == ("own", axis):
            factors.append(1)  # the input's own length on this axis: output length = input length
        elif (isinstance(size, int) and isinstance(dim, (int, np.integer)) and dim > 0 and size % int(dim) == 0
              and size >= dim):
            factors.append(size // int(dim))
        else:
            return None
    return factors


def _size_entries(graph, tensor, data, depth: int) -> list | None:
    """The 1-D int64 ``tensor`` as a list of its entries, each an int or ``("own", axis)``: ``data``'s own
    length along ``axis``, read by ``Shape(data)`` (whatever name shape inference gave that dimension, or
    none). Through constants, ``Concat``, ``Cast``, ``Shape``'s start/end, and a ``Slice`` of such a list
    by constant bounds on axis 0 with step 1; None for anything else."""
    value = constant_value(graph, tensor)
    if value is not None:
        return [int(v) for v in value.reshape(-1)] if np.issubdtype(value.dtype, np.integer) and value.ndim <= 1 else None
    node = producer_of(tensor)
    if node is None or depth == 0:
        return None
    if is_op(node, "Shape") and node.inputs[0] is data:
        rank = len(shape_of(graph, data) or ())
        start, end = node.attrs.get("start"), node.attrs.get("end")
        return [("own", a) for a in range(rank)][slice(start, end)] if rank else None
    if is_op(node, "Cast"):
        return _size_entries(graph, node.inputs[0], data, depth - 1)
    if is_op(node, "Concat") and int(node.attrs.get("axis", 0)) in (0, -1):
        parts = [_size_entries(graph, t, data, depth - 1) for t in node.inputs]
        return None if any(p is None for p in parts) else [e for p in parts for e in p]
    if is_op(node, "Slice") and len(node.inputs) >= 3:
        entries = _size_entries(graph, node.inputs[0], data, depth - 1)
        bounds = [constant_value(graph, t) if t.name else None for t in node.inputs[1:5]]
        if entries is None or any(b is None for b in bounds[:2]):
            return None
        axes, steps = (bounds + [None, None])[2:4]
        if (axes is not None and [int(a) for a in axes.reshape(-1)] not in ([0], [-1])) or (
                steps is not None and [int(v) for v in steps.reshape(-1)] != [1]):
            return None
        return entries[int(bounds[0].reshape(-1)[0]):int(bounds[1].reshape(-1)[0])]
    return None
