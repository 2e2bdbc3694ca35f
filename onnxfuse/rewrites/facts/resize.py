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
constant ``scales`` that are whole numbers, or constant ``sizes`` that are whole multiples of a static
input shape (the output length is then exactly in·s, as ``floor(in · s)`` is for scales).
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.facts.graph import constant_value, is_op, opset_of, shape_of

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
        sizes, dims = constant_value(graph, node.inputs[3]), shape_of(graph, node.inputs[0])
        if sizes is None or dims is None or sizes.size != len(dims) or not all(
                isinstance(d, (int, np.integer)) and d > 0 for d in dims):
            return None
        if any(int(out) % int(d) for out, d in zip(sizes.reshape(-1), dims)):
            return None
        factors = [int(out) // int(d) for out, d in zip(sizes.reshape(-1), dims)]
    else:
        scales = constant_value(graph, node.inputs[2]) if node.inputs[2].name else None
        if scales is None or scales.size != rank or rank == 0:
            return None
        values = scales.reshape(-1).astype(np.float64)
        if not np.all(values >= 1) or not np.all(values == np.round(values)):
            return None
        factors = [int(v) for v in values]
    return factors if any(f > 1 for f in factors) else None
