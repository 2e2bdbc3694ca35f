"""``--batch N``: input shapes with the batch dimension set, for :func:`onnxfuse.runtime.inputs.make_inputs`."""

from __future__ import annotations

import onnx

from onnxfuse.errors import InputsError, UsageError
from onnxfuse.runtime.inputs import input_specs


def batch_shapes(model: onnx.ModelProto, batch: int | None, shapes: dict[str, list[int]] | None = None
                 ) -> tuple[dict[str, list[int]], list[str]]:
    """``shapes`` plus, for every input not named there, a shape whose batch dimension is ``batch``.

    The batch dimension is an input's first dynamic dimension; other dynamic dimensions become 1 (and
    a note says so). An input with no dynamic dimension keeps its shape when its first dimension already
    equals ``batch``; otherwise :class:`InputsError` explains that the model fixes it. Scalars are left alone.
    Returns ``(shapes, notes)``.
    """
    out = {k: list(v) for k, v in (shapes or {}).items()}
    notes: list[str] = []
    if batch is None:
        return out, notes
    if batch < 1:
        raise UsageError("--batch must be >= 1")
    for spec in input_specs(model):
        if spec.name in out or not spec.shape:
            continue
        dynamic = [i for i, d in enumerate(spec.shape) if not isinstance(d, int)]
        if not dynamic:
            if spec.shape[0] != batch:
                raise InputsError(
                    f"--batch {batch}: input {spec.name!r} has the fixed shape {spec.shape}; its first "
                    "dimension cannot change (export the model with a dynamic batch dimension)"
                )
            continue
        shape = [d if isinstance(d, int) else 1 for d in spec.shape]
        shape[dynamic[0]] = batch
        out[spec.name] = shape
        rest = [str(spec.shape[i] or "?") for i in dynamic[1:]]
        if rest:
            notes.append(f"input {spec.name!r}: dynamic dimension(s) {', '.join(rest)} set to 1 "
                         f"(use --shape {spec.name}:{','.join(map(str, shape))} to choose)")
    return out, notes
