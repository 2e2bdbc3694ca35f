"""Graph outputs whose declared shape the rewritten graph provably contradicts get the proven shape.

Why: a model may declare an output shape its graph never computes, and the checker cannot tell while
the shape is computed at run time. ORT's ``reshape_fusion_with_graph_inputs.onnx`` declares
``[10, 20, unk]`` for ``Reshape(x[1, 200, 50], Concat([-1], Shape(q)[1]))``, which is [200, 50] on
every run (ONNX Runtime runs it and at most warns); ``reshape_fusion_distillbert.onnx`` declares
``[1, -1, 2, 4]`` (-1: dynamic, as ORT reads it) for what is [1, 1, 2, 4]. Once fold-constants makes the target a constant,
shape inference proves [200, 50] and ``onnx.checker.check_model(full_check=True)`` refuses the output
although it passed for the input. The rewrites are exact, so the output computes what the original
computes; a declaration contradicted by proof was false for the original too. Replacing it (rank
differs: the proven shape; same rank: each contradicted dimension) makes the output as valid as the
input was, and changes no value. Declarations inference cannot contradict are left alone.
"""

from __future__ import annotations

import onnx


def _dims(shape: onnx.TensorShapeProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]


def correct_output_shapes(model: onnx.ModelProto) -> list[str]:
    """Fix, in place, the main graph's output shapes that shape inference contradicts; return their names.
    (Inference runs once, with the outputs' shapes set aside and put back: no copy of the weights.)"""
    # start-up: it loads graphsurgeon, which importing this module does not
    from onnxfuse import model_io

    outputs = [o for o in model.graph.output
               if o.type.HasField("tensor_type") and o.type.tensor_type.HasField("shape")]
    if not outputs:
        return []
    saved = []
    for o in outputs:
        kept = onnx.TensorShapeProto()
        kept.CopyFrom(o.type.tensor_type.shape)
        saved.append(kept)
        o.type.tensor_type.ClearField("shape")
    try:
        inferred = model_io.infer_shapes(model)
    finally:
        for o, kept in zip(outputs, saved):
            o.type.tensor_type.shape.CopyFrom(kept)
    if inferred is model:
        return []
    proven = {o.name: o.type.tensor_type.shape for o in inferred.graph.output
              if o.type.HasField("tensor_type") and o.type.tensor_type.HasField("shape")}
    fixed = []
    for o in outputs:
        shape = proven.get(o.name)
        if shape is None:
            continue
        declared = o.type.tensor_type.shape
        if len(shape.dim) != len(declared.dim):
            declared.CopyFrom(shape)
            fixed.append(o.name)
            continue
        changed = False
        for d, p in zip(declared.dim, shape.dim):
            if d.HasField("dim_value") and p.HasField("dim_value") and d.dim_value != p.dim_value:
                d.CopyFrom(p)
                changed = True
        if changed:
            fixed.append(o.name)
    return fixed
