"""Folding a per-channel affine map ``y -> y*scale + shift`` into the node producing ``y``.

Shared by the fold family's rules (fold-batchnorm-*, fold-scale-bias); not a rule itself.

* :func:`f64` widens to float64; folding maths is done there so that the only rounding is the final
  :func:`cast_back` to the weight's dtype (an fp16 weight with fp32 BatchNorm statistics is then as
  exact as fp16 allows). :func:`cast_back` refuses (returns ``None``) when the cast would overflow.
* Folding rules change a node's *parameters* (a Conv's weight and bias, a Gemm's B and C), never its
  data inputs, through :func:`~onnxfuse.rewrites.engine.edit.set_param` (copy-on-write).

BatchNormalization (scale = γ/√(σ²+ε), shift = β − μ·scale) and constant Mul/Add/Sub/Div are all such
maps, so both rule families share this one implementation. ``plan_affine`` does every check and all the
arithmetic (float64, one rounding back to the weight dtype) and returns either a ``Refuse`` or a
plan whose ``apply()`` only writes the precomputed parameters.
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.engine.edit import set_param
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import constant_value, is_default_domain

#: Weight dtypes the folding rules handle (numpy has no bfloat16).
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def f64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


def cast_back(values64: np.ndarray, dtype) -> np.ndarray | None:
    """Round float64 results to ``dtype``; ``None`` when a finite value would become inf (overflow)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(values64).astype(dtype)
    if not np.array_equal(np.isfinite(out), np.isfinite(values64)):
        return None
    return out


def float_dtype_problem(*named: tuple[str, np.dtype | None]) -> Refuse | None:
    """A refusal when any of ``(what, dtype)`` is not a float dtype the folds handle."""
    for what, dtype in named:
        if dtype is None:
            continue
        if np.dtype(dtype) not in FLOAT_DTYPES:
            return Refuse(f"{what} has dtype {np.dtype(dtype).name}; only float16/float32/float64 are folded")
    return None


def broadcast_channel_problem(shape, out_rank: int, channels: int, channel_axis: int = 1):
    """Check a constant of ``shape`` against an output of rank ``out_rank`` with ``channels`` on ``channel_axis``.

    Returns a ``Refuse``, or ``None`` when the constant broadcasts per channel. The constant may be
    scalar-like (all ones) or vary along the channel axis only; it must not add dimensions to the output
    (rank above ``out_rank``) nor vary along batch or spatial axes.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) > out_rank:
        return Refuse(f"constant of shape {shape} would broadcast the rank-{out_rank} output to rank {len(shape)}")
    padded = (1,) * (out_rank - len(shape)) + shape
    for axis, d in enumerate(padded):
        if d == 1:
            continue
        if axis == channel_axis and d == channels:
            continue
        if axis == channel_axis:
            return Refuse(f"constant of shape {shape} has {d} entries on the channel axis, the output has {channels} channels")
        return Refuse(f"constant of shape {shape} varies along output axis {axis}, not only per channel")
    return None


def per_channel_vector(values: np.ndarray, out_rank: int, channels: int, channel_axis: int = 1) -> np.ndarray:
    """A float64 vector of length ``channels`` from a constant already accepted by :func:`broadcast_channel_problem`."""
    v = f64(values)
    padded = v.reshape((1,) * (out_rank - v.ndim) + v.shape)
    return np.broadcast_to(padded.reshape(-1) if padded.size > 1 else padded.reshape(1), (channels,)).copy()


# Folding a per-channel affine map ``y -> y*scale + shift`` into the node producing ``y``.
#
# BatchNormalization (scale = γ/√(σ²+ε), shift = β − μ·scale) and constant Mul/Add/Sub/Div are all such
# maps, so both rule modules share this one implementation. ``plan_affine`` does every check and all the
# arithmetic (float64, one rounding back to the weight dtype) and returns either a ``Refuse`` or a
# plan whose ``apply()`` only writes the precomputed parameters.
#: Producers an affine map can be folded into, and the channel axis of their output.
AFFINE_PRODUCERS = ("Conv", "ConvTranspose", "Gemm")


class AffinePlan:
    """Precomputed parameters for a producer; ``apply()`` writes them and returns how weights were written."""

    def __init__(self, node, writes, attrs=None):
        self.node = node
        self.writes = writes  # [(input index, values, role)]
        self.attrs = attrs or {}

    def apply(self, graph) -> dict[str, str]:
        modes = {}
        for index, values, role in self.writes:
            modes[role] = set_param(graph, self.node, index, values, role=role)
        self.node.attrs.update(self.attrs)
        return modes


def _optional_input(node, index):
    if index < len(node.inputs) and not node.inputs[index].is_empty():
        return node.inputs[index]
    return None


def _optional_constant(graph, node, index, role, weight_role, dtype):
    """The value of optional input ``index``: None when absent, else a constant of ``dtype``, else a
    ``Refuse``: the additive term a fold rewrites must be a constant of the weight's type."""
    t = _optional_input(node, index)
    if t is None:
        return None
    value = constant_value(graph, t)
    if value is None:
        return Refuse(f"{role} {t.name!r} is not a constant")
    if value.dtype != dtype:
        return Refuse(f"dtype mismatch: {role} is {value.dtype.name}, {weight_role} is {dtype.name}")
    return value


def producer_geometry(graph, node):
    """``(weight, out_rank, channels)`` for a Conv / ConvTranspose / Gemm producer, or a ``Refuse``."""
    what = node.op
    if not is_default_domain(node):
        return Refuse(f"{what} is in domain {node.domain!r}")
    if len(node.inputs) < 2 or len(node.outputs) != 1:
        return Refuse(f"{what} has an unexpected number of inputs or outputs")
    w = constant_value(graph, node.inputs[1])
    if w is None:
        return Refuse(f"{what} weight {node.inputs[1].name!r} is not a constant")
    problem = float_dtype_problem((f"{what} weight", w.dtype))
    if problem:
        return problem
    if what in ("Conv", "ConvTranspose"):
        if w.ndim < 3:
            return Refuse(f"{what} weight has rank {w.ndim}; expected at least 3")
        if what == "Conv":
            return w, w.ndim, int(w.shape[0])
        group = int(node.attrs.get("group", 1))
        if group < 1 or w.shape[0] % group:
            return Refuse(f"ConvTranspose group={group} does not divide its {w.shape[0]} input channels")
        return w, w.ndim, int(w.shape[1]) * group
    if what == "Gemm":
        if w.ndim != 2:
            return Refuse(f"Gemm B has rank {w.ndim}; expected 2")
        trans_b = int(node.attrs.get("transB", 0))
        return w, 2, int(w.shape[0] if trans_b else w.shape[1])
    return Refuse(f"cannot fold into {what}")


def plan_affine(graph, node, scale: np.ndarray, shift: np.ndarray):
    """Plan folding ``y*scale + shift`` (float64 vectors over output channels) into ``node``.

    Returns a ``Refuse``, else an ``AffinePlan``. Parameters whose value does not
    change (weights under a pure shift, a bias that would stay zero) are not rewritten, so a weight
    shared with another node is only copied when it really changes.
    """
    geometry = producer_geometry(graph, node)
    if isinstance(geometry, Refuse):
        return geometry
    w, _, channels = geometry
    scale = f64(scale).reshape(-1)
    shift = f64(shift).reshape(-1)
    if scale.shape != (channels,) or shift.shape != (channels,):
        return Refuse(f"{scale.size} channels to fold but {node.op} produces {channels}")
    if not (np.all(np.isfinite(scale)) and np.all(np.isfinite(shift))):
        return Refuse("the folded scale or shift is not finite")
    dtype = w.dtype
    scales = not np.all(scale == 1.0)
    writes = []
    attrs = {}

    if node.op in ("Conv", "ConvTranspose"):
        bias = _optional_constant(graph, node, 2, f"{node.op} bias", "weight", dtype)
        if isinstance(bias, Refuse):
            return bias
        if bias is not None and bias.shape != (channels,):
            return Refuse(f"{node.op} bias has shape {bias.shape}; expected ({channels},)")
        if scales:
            if node.op == "Conv":
                w64 = f64(w) * scale.reshape((channels,) + (1,) * (w.ndim - 1))
            else:
                group = int(node.attrs.get("group", 1))
                cin, cout_g = w.shape[0], w.shape[1]
                # output channel o = g*(C_out/group) + j lives in W[g*Cin/group:(g+1)*Cin/group, j, ...]
                grouped = f64(w).reshape((group, cin // group, cout_g) + w.shape[2:])
                grouped = grouped * scale.reshape((group, 1, cout_g) + (1,) * (w.ndim - 2))
                w64 = grouped.reshape(w.shape)
            new_w = cast_back(w64, dtype)
            if new_w is None:
                return Refuse(f"folded {node.op} weight overflows {dtype.name}")
            writes.append((1, new_w, "weight"))
        b64 = (f64(bias) if bias is not None else np.zeros(channels)) * scale + shift
        if bias is not None or np.any(b64 != 0):
            new_b = cast_back(b64, dtype)
            if new_b is None:
                return Refuse(f"folded {node.op} bias overflows {dtype.name}")
            writes.append((2, new_b, "bias"))
        return AffinePlan(node, writes)

    # Gemm: Y = alpha·A'·B' + beta·C  →  alpha·A'·(B'·diag(scale)) + (beta·C·scale + shift), beta = 1
    trans_b = int(node.attrs.get("transB", 0))
    beta = float(node.attrs.get("beta", 1.0))
    c = _optional_constant(graph, node, 2, "Gemm C", "B", dtype)
    if isinstance(c, Refuse):
        return c
    if c is not None and (c.ndim > 2 or (c.ndim >= 1 and c.shape[-1] not in (1, channels))):
        return Refuse(f"Gemm C of shape {c.shape} does not broadcast to (M, {channels})")
    if scales:
        b64 = f64(w) * (scale.reshape(channels, 1) if trans_b else scale.reshape(1, channels))
        new_b = cast_back(b64, dtype)
        if new_b is None:
            return Refuse(f"folded Gemm B overflows {dtype.name}")
        writes.append((1, new_b, "B"))
    if c is not None and beta != 0.0:
        c64 = beta * f64(c) * scale + shift  # broadcasts C's shape with (channels,)
    else:
        c64 = shift
    if c is not None or np.any(c64 != 0):
        new_c = cast_back(c64, dtype)
        if new_c is None:
            return Refuse(f"folded Gemm C overflows {dtype.name}")
        writes.append((2, new_c, "C"))
        attrs["beta"] = 1.0
    return AffinePlan(node, writes, attrs)
