"""Shape inference: the one call of ONNX's, and "infer, then prove" for a graph the rewrites work on.

Why one place: each caller wants ONNX's inference with its own options (the pipeline's best effort with
data propagation, precision's strict check of a float16 model, drift's and the elementwise regions' plain
typing), and written out at each call site the options drifted apart unseen. :func:`onnx_inferred` is
ONNX's ``shape_inference.infer_shapes`` with the two options onnxfuse varies named; every other module
calls it or :func:`onnxfuse.model_io.infer_shapes` (the pipeline's: value_info set aside, large weights
kept out of the serialized copy, data propagation, ``Range`` lengths; never raises), which calls it.

Why the pair: ONNX's inference leaves dimensions it cannot derive invented (``unk__N``), and several of
them :func:`~onnxfuse.rewrites.facts.proven_dims.prove_dims` proves (a ``Range``'s length, a reshaped
tensor's size). Rules compare shapes only after both, so a graph is inferred and proved in one step
(:func:`inferred_and_proven` for a model about to be rewritten, :func:`reinferred_and_proven` for a
graph mid-rewrite).
"""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.facts.proven_dims import prove_dims
from onnxfuse.rewrites.facts.shapes import refresh_shapes


def onnx_inferred(model: onnx.ModelProto, *, strict: bool = False, data_prop: bool = False,
                  check_type: bool = False) -> onnx.ModelProto:
    """A copy of ``model`` with ONNX's shape inference applied; raises what ONNX raises (callers decide
    what a failure means). ``strict``: an op whose inference fails raises instead of being skipped (a
    check, as :func:`onnxfuse.precision.convert_to_fp16` makes one); ``data_prop``: shape values are
    propagated through ``Shape``/``Gather``/``Concat`` chains (the pipeline's inference); ``check_type``:
    the inputs' types are checked against the schemas too (two inputs of one type variable that differ:
    ONNX's default does not look)."""
    return onnx.shape_inference.infer_shapes(model, check_type=check_type, strict_mode=strict, data_prop=data_prop)


def inferred_and_proven(model: onnx.ModelProto, importer=gs.import_onnx) -> gs.Graph:
    """``model`` with its shapes inferred (:func:`onnxfuse.model_io.infer_shapes`), imported as a
    graphsurgeon graph by ``importer`` (the pipeline passes :func:`onnxfuse.model_io.to_graph`, which keeps
    overridable initializers and lazy weights as they were loaded), its invented dimensions proven."""
    from onnxfuse.model_io import infer_shapes  # import cycle: model_io imports facts (range_dims, this module)

    graph = importer(infer_shapes(model))
    prove_dims(graph)
    return graph


def reinferred_and_proven(graph: gs.Graph) -> None:
    """``graph``'s shapes inferred again mid-rewrite (:func:`~onnxfuse.rewrites.facts.shapes.refresh_shapes`),
    then its invented dimensions proven, in place."""
    refresh_shapes(graph)
    prove_dims(graph)
