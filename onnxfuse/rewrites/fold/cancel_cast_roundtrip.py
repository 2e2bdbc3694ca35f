"""Remove a Cast to a wider type followed by a Cast straight back: ``Cast(Cast(x, to=W), to=T)`` with
T x's own type and W holding every value of T exactly is ``x``; and a Cast to x's own type, ``Cast(x,
to=type(x))``, which is ``x`` too.

Why
---
transformers' float16 Llama-family models compute ``softmax(scores, dim=-1, dtype=torch.float32)
.to(query.dtype)``; when the scores are already float16, torch's legacy exporter writes ``Softmax`` in
float16 followed by ``Cast(to=float)`` and ``Cast(to=float16)`` (Llama and Qwen2 exports with and
without a KV cache, opset 14 and 17: two Casts per layer). The pair computes nothing, but it stands
between the Softmax and the MatMul with V, so contrib-attention found no attention there ("Softmax
output is not read by exactly one MatMul"), and ONNX Runtime ran two more kernels per layer.

A Cast to its input's own type is what ``--precision fp16`` leaves of an exporter's float32 step in a
float16 model (``Cast(x16, to=float)`` becomes ``Cast(x16, to=float16)``): between the sdpa export's
repeated V heads and its attention such a Cast kept contrib-attention-inputs from seeing the repeat ("key
and value are not repeated alike"), and each one is a kernel.

Exactness
---------
Widening float16 or bfloat16 to float32 or float64, float32 to float64, or an integer type to a wider
integer of the same signedness (or a signed one wider than an unsigned one) maps every value to the
same value (NaN stays NaN, ±inf stays ±inf; NaN payloads are not part of ONNX's semantics), and the
Cast back then rounds nothing: the result is bitwise x. A Cast to x's own type changes no value. Refused: any other pair of types (a narrowing
step loses values), an input of unknown type and a Cast whose ``saturate`` is 0 (float8 targets only:
never a widening here). A wide value also read elsewhere keeps its Cast; only the way back goes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxfuse.rewrites.engine.edit import to_identity
from onnxfuse.rewrites.engine.polynomial import WIDENING_CASTS, cast_target
from onnxfuse.rewrites.engine.rule import TARGETS, Refuse, Rule
from onnxfuse.rewrites.facts.graph import consumers, dtype_of, is_graph_output, is_op, producer_of

_SIGNED = [np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64)]
_UNSIGNED = [np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64)]


def widens_exactly(source: np.dtype, wide: np.dtype) -> bool:
    """Every value of ``source`` is a value of ``wide`` (so a Cast there and back is the identity): the
    float widenings of :data:`~onnxfuse.rewrites.engine.polynomial.WIDENING_CASTS`, or an integer type
    into a wider one of the same signedness (or a signed one wider than an unsigned one)."""
    if source == wide or (source.name, wide.name) in WIDENING_CASTS:
        return True
    if source in _SIGNED and wide in _SIGNED:
        return wide.itemsize > source.itemsize
    if source in _UNSIGNED and (wide in _UNSIGNED or wide in _SIGNED):
        return wide.itemsize > source.itemsize
    return False


class CancelCastRoundtrip(Rule):
    """Cast(Cast(x, to=W), to=type(x)) with W wider than x's type → x; Cast(x, to=type(x)) → x."""

    name = "cancel-cast-roundtrip"
    description = ("a Cast to a wider type and straight back, or to its input's own type, removed (float16 → float32 → "
                   "float16: the identity)")
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Cast") and node.inputs:
                yield node

    def check(self, graph, back):
        """``(back, None)`` for a Cast to its input's own type, ``(back, up)`` for a widening round trip
        ``back(up(x))``, else a ``Refuse``."""
        if cast_target(back) is not None and cast_target(back) == dtype_of(graph, back.inputs[0]):
            return back, None
        up = producer_of(back.inputs[0])
        if not is_op(up, "Cast"):
            return Refuse("not a Cast of a Cast, nor a Cast to its input's own type")
        x = up.inputs[0] if up.inputs else None
        source, wide, target = dtype_of(graph, x) if x is not None else None, cast_target(up), cast_target(back)
        if source is None or wide is None or target is None:
            return Refuse("an element type is unknown")
        if target != source or not widens_exactly(source, wide):
            return Refuse(f"{source} → {wide} → {target} is not a widening and its way back")
        if any(int(n.attrs.get("saturate", 1)) == 0 for n in (up, back)):
            return Refuse("a Cast with saturate=0")
        return back, up

    def rewrite(self, graph, plan) -> dict[str, Any]:
        back, up = plan
        if up is None:
            report = {"node": back.name, "types": f"{cast_target(back)} → itself"}
            to_identity(back, back.inputs[0])
            return report
        x, middle = up.inputs[0], up.outputs[0]
        report = {"node": back.name, "types": f"{dtype_of(graph, x)} → {cast_target(up)} → back"}
        to_identity(back, x)
        if not consumers(middle) and not is_graph_output(graph, middle):
            up.outputs.clear()
            up.inputs.clear()
        return report
