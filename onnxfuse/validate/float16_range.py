"""Which nodes of a float32 model float16 cannot hold, measured on the validation inputs (``--precision fp16``).

Why: float16 holds magnitudes up to 65504. A node whose values go beyond that in the float32 original
(a sum over many large terms, an unnormalized attention score, a squared activation before its mean)
overflows to ±inf in float16, and everything after it is lost: a plain conversion then fails validation,
or passes on the validation inputs and breaks on the user's. ONNX Runtime's automatic mixed precision and
Polygraphy's precision fallbacks find such nodes by running the model; so does this.

What is measured: the float32 original runs on the validation samples with every float32 value of its
main graph made an output; a value whose largest finite magnitude over the samples exceeds
:data:`LIMIT` (a quarter of float16's range: headroom for inputs larger than the samples) is *out of
range*. A node stays float32 when it writes or reads an out-of-range value: the writer because float16
would overflow there, every reader because a float16 copy of the value would be ±inf (so the reader of a
large sum that divides it back into range, a mean, computes in float32 and hands float16 its small
result). Values that are ±inf or NaN in the original itself are not counted: float16 cannot do worse.

Not measured here: rounding error that stays in range (float16's 2⁻¹¹ relative step). The float16 judge
(the conversion's own drift, ``precision_judge.CONVERSION_MULTIPLE``) accepts what a plain conversion gives.

Cost: one session of the original with all its float32 values as outputs, one run per sample, each
value reduced to one number as it arrives; nodes inside If/Loop bodies and of other domains are not
considered (the converter leaves other domains alone).
"""

from __future__ import annotations

import numpy as np
import onnx

from onnxfuse.runtime.session import make_session, run_session
from onnxfuse.precision import float32_values

#: float16's largest finite magnitude, and the magnitude from which a float32 value is out of range.
HALF_MAX = float(np.finfo(np.float16).max)
LIMIT = HALF_MAX / 4


def largest_magnitudes(model: onnx.ModelProto, samples: list, provider: str = "auto",
                       name: str = "model") -> dict[str, float]:
    """Per float32 value of ``model``'s main graph, its largest finite magnitude over ``samples``."""
    written = {o for n in model.graph.node for o in n.output if o}
    values = sorted(float32_values(model) & written)  # main-graph values a node writes (the converter's view)
    if not values:
        return {}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    declared = {o.name for o in probe.graph.output}
    for value in values:
        if value not in declared:
            out = probe.graph.output.add()
            out.name = value
            out.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    session = make_session(probe, provider=provider, name=name)
    largest = dict.fromkeys(values, 0.0)
    for sample in samples:
        feeds = sample if isinstance(sample, dict) else sample.feeds
        outputs = run_session(session, feeds, name=name, output_names=values)
        for value in values:
            array = np.asarray(outputs.pop(value))
            finite = np.abs(array[np.isfinite(array)]) if array.size else array
            if finite.size:
                largest[value] = max(largest[value], float(finite.max()))
    return largest


def out_of_range_nodes(model: onnx.ModelProto, largest: dict[str, float], limit: float = LIMIT) -> dict[str, str]:
    """``{node name: why}`` for the main-graph nodes (ONNX domain, no subgraph) that write or read a value
    beyond ``limit`` (:func:`largest_magnitudes`). Unnamed nodes are left out: the converter keeps nodes by
    name, and an exporter names every node."""
    large = {v: m for v, m in largest.items() if m > limit}
    found: dict[str, str] = {}
    for node in model.graph.node:
        if not node.name or (node.domain or "") not in ("", "ai.onnx") or any(
                a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        written = [(o, large[o]) for o in node.output if o in large]
        read = [(i, large[i]) for i in node.input if i in large]
        if written:
            value, magnitude = max(written, key=lambda p: p[1])
            found[node.name] = f"{node.op_type} writes {value!r} up to {magnitude:.3g}"
        elif read:
            value, magnitude = max(read, key=lambda p: p[1])
            found[node.name] = f"{node.op_type} reads {value!r} up to {magnitude:.3g}"
    return found


__all__ = ["HALF_MAX", "LIMIT", "largest_magnitudes", "out_of_range_nodes"]
