"""The mask steps between the scaled scores and the Softmax, and the NaN guard after it.

**Mask steps** (:func:`mask_terms`), between the scaled scores x and the Softmax, outermost first,
become one ``attention_bias`` built innermost first (:mod:`~onnxfuse.rewrites.contrib.attention.bias`):

* ``x + M``, M any tensor of the scores' element type, rank ≤ 4, not computed from a MatMul (that tells
  it from the scores), however it was built (``(1 - mask)·c``, a constant causal triangle, ...): M is
  added to the bias. One Add alone is M itself; a second Add reassociates ``(x + b) + M`` as
  ``x + (b + M)``, exact for 0 / finfo.min-valued masks and a rounding difference otherwise.
* ``Where(c, x, f)`` or ``Where(c, f, x)`` (``masked_fill``; GPT-2's ``Where(causal, x, finfo.min)``,
  DistilBERT's ``Where(mask == 0, finfo.min, x)``), c a bool tensor of known rank ≤ 4, f a scalar
  constant: around an earlier bias b it is ``x + Where(c, b, f)`` (b = 0 when none). Exact where c
  keeps x; where c picks f it needs ``x + f == f``, true in float32 for every |x| < ulp(f)/2 when f is
  finite and ≤ -1e30 (≥ 3.7e22 for f = -1e30, 1.01e31 for finfo.min; a larger score would leave the
  masked entry a few of f's ulps away from f, not f). Otherwise refused with the reason: a float16
  fill (finfo.min is -65504, which a score of 16 already moves; only a raw keep mask takes it:
  :mod:`~onnxfuse.rewrites.contrib.attention.keep_masks`), a fill like -10000 or -inf (``x + -inf``
  is NaN where x = +inf). Two fills that meet (f + f = -inf after a Where and an Add of finfo.min)
  are -inf in both models.
* element-type-preserving Casts (GPT-2 exports ``.to(dtype)`` as Cast to float) are identities: removed.

**The NaN guard** ``Where(IsNaN(p), 0, p)`` on the Softmax's weights (torch's dynamo exporter writes it
after every masked scaled_dot_product_attention) turns a row whose every score is -inf, NaN after the
Softmax, into zeros. When every mask step adds finite values (a Where's finite fill, a constant without
±inf, or ``Where(c, a, b)`` of finite scalars: :func:`finite_masks`), finite scores give finite
masked scores, a Softmax row is never NaN and the guard is the identity: it goes with the pattern.
NaN or infinite scores (an overflow upstream) would be zeroed by the guard and stay NaN in the fused
op: outside what validation's finite inputs can reach, and no real attention's. A mask that may hold -inf
(torch's legacy export of transformers' default sdpa attention: ``Where(keep, 0, -inf)``) fuses when it is
a keep mask the op takes raw: the guard is then emulated by zeroing the rows that keep no key
(:func:`~onnxfuse.rewrites.contrib.attention.plan.plan_attention`, ``zero_empty_rows``); any other such
mask is refused with the guard, with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.facts import is_noop_cast, is_upcast, scalar_factor, single_reader
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import (
    BF16,
    FP32,
    constant_value,
    consumers,
    dtype_of,
    is_graph_output,
    is_op,
    producer_of,
    scalar_constant,
    shape_of,
)

#: a Where fill f is absorbing in float32 when f <= this: s + f == f for |s| < ulp(f)/2 (>= 3.7e22)
ABSORBING_FILL = -1e30
#: float16's finfo.min, the fill of torch's ``masked_fill(mask, finfo(float16).min)`` in a float16 export
FP16_MIN = float(np.finfo(np.float16).min)


def _reaches_matmul(graph, tensor, depth: int = 8) -> bool:
    """Whether ``tensor`` is a MatMul's output behind the ops the score path may hold (no-op Cast, the
    float16 → float32 Cast of a softmax island, scalar Mul/Div, Add, Where): tells the scores from the
    mask."""
    p = producer_of(tensor)
    if p is None or depth == 0:
        return False
    if is_op(p, "MatMul"):
        return True
    if is_noop_cast(graph, p) or is_upcast(graph, p) or scalar_factor(graph, p) is not None:
        return _reaches_matmul(graph, p.inputs[0] if is_op(p, "Cast") else scalar_factor(graph, p)[1], depth - 1)
    if is_op(p, "Add", "Where"):
        return any(_reaches_matmul(graph, t, depth - 1) for t in p.inputs)
    return False


@dataclass
class MaskTerm:
    """One step between the scaled scores x and the Softmax: ``x + mask`` (kind "add") or
    ``Where(cond, x, fill)`` / ``Where(cond, fill, x)`` (kind "where"; ``scores_if_true`` tells which)."""

    kind: str
    mask: gs.Tensor | None = None
    cond: gs.Tensor | None = None
    fill: float = 0.0
    scores_if_true: bool = True
    #: ``s + fill == fill`` (a float32 fill <= ABSORBING_FILL); False only for a float16 fill of
    #: :data:`FP16_MIN`, which only a raw keep mask may take (keep_masks: "Float16 masked_fill")
    absorbing: bool = True


def mask_terms(graph, tensor, nodes, dtype) -> tuple[list[MaskTerm], gs.Tensor] | Refuse:
    """Peel the mask steps (Add of a tensor not computed from the scores, Where with a scalar fill, no-op
    Casts) off the Softmax input ``tensor``; returns them outermost first and the tensor inside them."""
    terms: list[MaskTerm] = []
    while True:
        p = producer_of(tensor)
        if p is None:
            return terms, tensor
        if is_noop_cast(graph, p):
            nodes.append(p)
            tensor = p.inputs[0]
            continue
        if is_op(p, "Add") and len(p.inputs) == 2:
            sides = [_reaches_matmul(graph, t) for t in p.inputs]
            if sides == [True, True]:
                return Refuse("both operands of the mask Add are computed from a MatMul")
            if sides == [False, False]:
                return Refuse("the Softmax input is an Add with no Q·Kᵀ MatMul behind it")
            x, mask = p.inputs if sides[0] else p.inputs[::-1]
            if dtype_of(graph, mask) != dtype:
                return Refuse("the mask's element type differs from the scores'")
            m_shape = shape_of(graph, mask)
            if m_shape is None or len(m_shape) > 4:
                return Refuse("the mask's rank is unknown or above 4")
            terms.append(MaskTerm("add", mask=mask))
            nodes.append(p)
            tensor = x
            continue
        if is_op(p, "Where") and len(p.inputs) == 3:
            cond, a, b = p.inputs
            fill_a, fill_b = scalar_constant(graph, a), scalar_constant(graph, b)
            if (fill_a is None) == (fill_b is None):
                return Refuse("the Where on the scores does not select between the scores and a scalar fill")
            scores_if_true = fill_b is not None
            fill = float(np.asarray(fill_b if scores_if_true else fill_a, np.float64).reshape(()))
            # bfloat16 scores too: f is a float32 value, and s + f rounds to f in bfloat16 as in float32
            absorbing = dtype in (FP32,) + BF16 and np.isfinite(fill) and fill <= ABSORBING_FILL
            if not absorbing and not (dtype == np.dtype(np.float16) and fill == FP16_MIN):
                return Refuse(f"Where-mask fill {fill:g} ({dtype}) is not absorbing: Where(c, s, f) = s + Where(c, 0, f) "
                              f"needs s + f == f, proved only for a finite float32 f <= {ABSORBING_FILL:g}")
            c_shape = shape_of(graph, cond)
            if dtype_of(graph, cond) != np.dtype(bool) or c_shape is None or len(c_shape) > 4:
                return Refuse("the Where-mask condition is not a bool tensor of known rank <= 4")
            terms.append(MaskTerm("where", cond=cond, fill=fill, scores_if_true=scores_if_true, absorbing=absorbing))
            nodes.append(p)
            tensor = a if scores_if_true else b
            continue
        return terms, tensor


def nan_guard(graph, probs) -> list | None:
    """``[IsNaN, Where]`` when ``probs`` (the Softmax's weights) is read only as ``Where(IsNaN(p), 0, p)``:
    torch's dynamo exporter (onnxscript's scaled_dot_product_attention with a mask) writes it to turn the
    NaN row of a Softmax whose every score is -inf into zeros. Else None."""
    readers = consumers(probs)
    if len(readers) != 2 or is_graph_output(graph, probs):
        return None
    isnan = next((n for n in readers if is_op(n, "IsNaN")), None)
    where = next((n for n in readers if is_op(n, "Where")), None)
    if isnan is None or where is None or len(where.inputs) != 3 or len(isnan.outputs) != 1:
        return None
    cond, zero, kept = where.inputs
    if cond is not isnan.outputs[0] or kept is not probs or not single_reader(graph, cond):
        return None
    value = scalar_constant(graph, zero)
    if value is None or float(np.asarray(value).reshape(())) != 0.0:
        return None
    return [isnan, where]


def finite_masks(graph, terms) -> bool:
    """Every mask step adds finite values: a Where term (its fill is a finite scalar, checked by
    :func:`mask_terms`), or an Add of a constant whose values are all finite or of ``Where(c, a, b)`` with
    a and b finite scalar constants (transformers' ``sdpa_mask`` as float). Then, for finite scores, no
    Softmax row is all -inf and none is NaN: a NaN guard after it (:func:`nan_guard`) changes nothing."""
    for term in terms:
        if term.kind == "where":
            if not np.isfinite(term.fill):
                return False
            continue
        value = constant_value(graph, term.mask)
        if value is not None:
            if not np.all(np.isfinite(value)):
                return False
            continue
        where = producer_of(term.mask)
        if not is_op(where, "Where") or len(where.inputs) != 3:
            return False
        branches = [scalar_constant(graph, t) for t in where.inputs[1:]]
        if any(b is None or not np.all(np.isfinite(b)) for b in branches):
            return False
    return True
