"""Shape inference again, mid-rewrite, so that later rules can prove what an earlier one made provable.

Why
---
Shapes are inferred once, on the input model, and rules prove equalities from them (``facts.graph.shapes_equal``:
same value or same symbolic name). Inference on an exporter's graph loses dimensions wherever a Reshape
target is computed at run time: BERT's head merge ``Reshape(ctx, Concat(Shape(ctx)[:2], [768]))`` comes
out as ``(unk__1, unk__2, 768)`` while the residual it is added to is ``(batch, 128, 768)``.
``constant-reshape-target`` turns that target into the constant ``[0, -1, 768]``, from which ONNX infers
``(batch, 128, 768)`` exactly; but only if inference runs again. Without it, ``contrib-skip-layernorm``
refused every attention-output residual of BERT-base (24 of 36 LayerNorms) as "not provably equal".

How
---
:func:`refresh_shapes` infers shapes on a skeleton of the current graph (every weight over
:data:`SKELETON_WEIGHT_BYTES` a typed graph input, as :func:`weights_as_inputs` makes it, so kilobytes
are serialized, not the model) and writes the result onto every computed tensor, subgraphs included.

Symbolic names are only comparable within one inference run: ONNX numbers the ``unk__N`` it invents
afresh each time. So every computed tensor takes this run's shape, with two exceptions that hold
across runs (rewrites never change a surviving tensor's shape): a dimension the new run leaves
invented or unknown keeps the size or *declared* name (one on the model's inputs, ``batch``) it had;
and a tensor this run cannot infer at all (an output of a contrib or custom op, for which ONNX has no
schema) keeps its shape minus the invented names of the old run, which become unknown. The first
matters because a rewrite can also lose what inference knew: GPT-2's ``Reshape(Gemm(..), [-1, 128,
2304])`` (constant-reshape-target's -1 for a batch read from another tensor) is ``batch`` by data
propagation through the original Concat, but ``unk`` from the constant, since ONNX does no symbolic
division. Graph inputs and constants are never touched. Where the kept dimension meets a symbol the
new run invented, that symbol is the kept dimension everywhere in the new run (it shares a symbol only
between dimensions it proved equal), so the equality is not lost between the tensor that kept the name
and those that only have the symbol (:func:`_kept_symbols`). After a refresh the apply loop runs
:func:`~onnxfuse.rewrites.facts.proven_dims.prove_dims`, for what no ONNX inference derives.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import replace_reads
from onnxfuse.rewrites.facts.graph import graphs_within, is_default_domain

#: Weights larger than this travel to shape inference as typed graph inputs (their values cannot matter
#: to any shape: nothing computed from a whole large weight is a size).
SKELETON_WEIGHT_BYTES = 1 << 20


def _nbytes(t: gs.Constant) -> int:
    try:
        return int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
    except Exception:
        return 0


def _is_string(t: gs.Constant) -> bool:
    try:
        return np.dtype(t.dtype).kind in "OSU"
    except Exception:
        return False


def weights_as_inputs(graph: gs.Graph, limit: int = SKELETON_WEIGHT_BYTES) -> tuple[gs.Graph, list[str]]:
    """A copy of ``graph`` in which every constant over ``limit`` bytes is a graph input of the same type
    and shape, and the names of those constants. Exporting it serializes kilobytes instead of the
    model's weights (ViT-B/16: 40 s → a few seconds on 2 cores), and every shape is still known.

    String constants always become inputs: graphsurgeon cannot export them (``tobytes()`` of an object
    array), and one such failure used to stop constant folding for the whole model."""
    work = graph.copy()
    names = []
    for name, t in list(work.tensors().items()):
        if not isinstance(t, gs.Constant) or (_nbytes(t) <= limit and not _is_string(t)):
            continue
        stand_in = gs.Variable(name, dtype=t.dtype, shape=list(t.shape))
        replace_reads(t, stand_in)
        work.outputs = [stand_in if x is t else x for x in work.outputs]
        work.inputs.append(stand_in)
        names.append(name)
    return work, names


def _proto_shape(vi: onnx.ValueInfoProto):
    t = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    if t is None or not t.HasField("shape"):
        return None
    return [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


#: ops ONNX infers no shape for (contrib ops; LayerNormalization before opset 17) whose listed outputs have
#: their input 0's shape: normalizations over the last axis, elementwise activations with a bias over it
SAME_SHAPE_OUTPUTS = {
    "LayerNormalization": (0,), "SimplifiedLayerNormalization": (0,), "SkipLayerNormalization": (0, 3),
    "SkipSimplifiedLayerNormalization": (0, 3), "BiasGelu": (0,), "FastGelu": (0,), "Gelu": (0,),
    "QuickGelu": (0,),
}
#: contrib ops whose output 0 has input 0's leading dimensions ([B, S, ·]): read as Identity when the last
#: dimension is the same too (self-attention with E_out = E_in), else cut like any other
LEADING_SHAPE_OUTPUTS = ("Attention", "MultiHeadAttention")


def _same_shape_outputs(node) -> tuple[int, ...] | None:
    """The outputs of ``node`` that have its input 0's shape, when ONNX cannot infer them itself
    (:data:`SAME_SHAPE_OUTPUTS`, :data:`LEADING_SHAPE_OUTPUTS`); else None."""
    if not node.inputs or not node.outputs:
        return None
    if node.op in LEADING_SHAPE_OUTPUTS and node.domain == "com.microsoft":
        x_shape, out_shape = node.inputs[0].shape, node.outputs[0].shape
        same_last = x_shape and out_shape and isinstance(x_shape[-1], int) and x_shape[-1] == out_shape[-1]
        return (0,) if same_last else None
    if is_default_domain(node) or node.domain == "com.microsoft":
        return SAME_SHAPE_OUTPUTS.get(node.op)
    return None


def _identity_stand_ins(work: gs.Graph, declared: set[str]) -> None:
    """In the inference skeleton ``work`` only, so that ONNX carries dimensions (and their names) on
    through ops it has no schema for, in one inference run:

    * an op with :func:`_same_shape_outputs` becomes ``Identity`` nodes from its input 0 to those
      outputs (left as it is when another of its outputs is read: that one would have no producer);
    * any other op of a non-ONNX domain whose outputs all have a declared shape is cut, its outputs then
      typed graph inputs of those shapes, sizes and ``declared`` names only (an invented name of an
      earlier run could meet the same name invented by this one).

    Without them every shape after the first contrib op kept what an earlier run knew, or nothing:
    ViT's LayerNorm outputs lost the batch that the Concat before them had."""
    changed = False
    for node in list(work.nodes):
        kept = _same_shape_outputs(node)
        if kept is not None:
            if any(i not in kept and (t.outputs or t in work.outputs) for i, t in enumerate(node.outputs)):
                continue
            x = node.inputs[0]
            outputs = [t for i, t in enumerate(node.outputs) if i in kept and not t.is_empty()]
            work.nodes += [gs.Node("Identity", inputs=[x], outputs=[t]) for t in outputs]
        elif not is_default_domain(node) and all(t.shape is not None and t.dtype is not None for t in node.outputs):
            for t in node.outputs:
                t.shape = [d if not isinstance(d, str) or d in declared else None for d in t.shape]
            work.inputs.extend(t for t in node.outputs if t not in work.outputs)
        else:
            continue
        node.outputs.clear()
        node.inputs.clear()
        changed = True
    if changed:
        work.cleanup(remove_unused_graph_inputs=False).toposort()


def _inferred_shapes(graph: gs.Graph) -> dict[str, list | None]:
    # import cycle: importing onnxfuse.model_io imports this module
    from onnxfuse.model_io import infer_shapes, proto_graphs

    work, _ = weights_as_inputs(graph)
    _identity_stand_ins(work, _declared_symbols(graph))
    model = gs.export_onnx(work, do_type_check=False)
    del work
    # A graph output's declared shape wins over what ONNX infers for it: an invented name of an earlier
    # run there would stay, unshared with the tensors this run proves equal to it. Only sizes and
    # declared names are declarations.
    for vi in model.graph.output:
        for d in vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []:
            if d.HasField("dim_param") and d.dim_param.startswith("unk__"):
                d.ClearField("dim_param")
    inferred = infer_shapes(model)
    if inferred is model:  # inference failed: nothing new is known
        return {}
    shapes = {}
    for g in proto_graphs(inferred.graph):
        for vi in list(g.value_info) + list(g.output):
            shape = _proto_shape(vi)
            if shape is not None:
                shapes[vi.name] = shape
    return shapes


def _computed_tensors(graph: gs.Graph):
    """Every tensor a node of ``graph`` or of its subgraphs writes (not a graph's own inputs, not a constant)."""
    for g in graphs_within(graph):
        own_inputs = {id(t) for t in g.inputs}
        for node in g.nodes:
            for t in node.outputs:
                if isinstance(t, gs.Variable) and id(t) not in own_inputs:
                    yield t


def _declared_symbols(graph: gs.Graph) -> set[str]:
    return {d for t in graph.inputs for d in (t.shape or []) if isinstance(d, str) and d}


def _merged(old, new, declared: set[str]):
    """One tensor's shape after a new inference run: the new dims, except where the old shape knew more
    in a way that holds across runs (a size, or a name the model declares, against an invented name
    or nothing). Invented names of the old run are never kept (see the module docstring)."""
    if new is None:
        return None if old is None else [d if not isinstance(d, str) or d in declared else None for d in old]
    if old is None or len(old) != len(new):
        return list(new)
    out = []
    for o, n in zip(old, new):
        stable_old = isinstance(o, int) or (isinstance(o, str) and o in declared)
        stable_new = isinstance(n, int) or (isinstance(n, str) and n in declared)
        out.append(o if stable_old and not stable_new else n)
    return out


def _kept_symbols(tensors, shapes: dict, declared: set[str]) -> dict[str, object]:
    """``{symbol: dim}`` for each symbol the new run invented where a tensor's old shape had a size or a
    declared name (``dim``) at the same position: the new run shares that symbol only between
    dimensions it proved equal, so it is ``dim`` wherever it occurs. Without this, a symbol shared by
    two tensors became a declared name on one (kept from the old run) and stayed invented on the other,
    and their equality was lost (DistilBERT's second layer: its mask ``sequence``, its input ``unk__15``).
    A symbol met with two different old dimensions is left alone."""
    found: dict[str, object] = {}
    clash: set[str] = set()
    for t in tensors:
        old, new = t.shape, shapes.get(t.name)
        if old is None or new is None or len(old) != len(new):
            continue
        for o, n in zip(old, new):
            stable_old = isinstance(o, int) or (isinstance(o, str) and o in declared)
            if stable_old and isinstance(n, str) and n not in declared and n.startswith("unk__"):
                if found.setdefault(n, o) != o:
                    clash.add(n)
    return {k: v for k, v in found.items() if k not in clash}


def refresh_shapes(graph: gs.Graph) -> int:
    """Infer shapes again and write them onto ``graph``'s computed tensors (see the module docstring).
    Returns how many tensors changed shape."""
    shapes = _inferred_shapes(graph)
    if not shapes:
        return 0
    declared = _declared_symbols(graph)
    tensors = list(_computed_tensors(graph))
    kept = _kept_symbols(tensors, shapes, declared)
    changed = 0
    for t in tensors:
        inferred = shapes.get(t.name)
        if inferred is not None and kept:
            inferred = [kept.get(d, d) if isinstance(d, str) else d for d in inferred]
        new = _merged(t.shape, inferred, declared)
        if new is not None and (t.shape is None or list(t.shape) != new):
            t.shape = new
            changed += 1
    return changed


def dims_proven_equal(old, new) -> dict[str, object]:
    """``{a: b}`` for each position where ``old`` has a symbolic name ``a`` and the proven shape ``new`` has
    another name or a size ``b`` (for :func:`unify_dims`)."""
    if old is None or new is None or len(old) != len(new):
        return {}
    return {a: b for a, b in zip(old, new) if isinstance(a, str) and a and b is not None and a != b}


def unify_dims(graph: gs.Graph, same: dict[str, object]) -> None:
    """Rename symbolic dimensions proven equal (``same[a] = b``: a is b, a name or a size) on every computed
    tensor of ``graph`` and its subgraphs. Names the model declares on its inputs are kept: a declared
    name is never replaced by an invented one (the mapping is turned around)."""
    if not same:
        return
    declared = _declared_symbols(graph)
    for a, b in list(same.items()):
        if a in declared and isinstance(b, str) and b not in declared:
            del same[a]
            same.setdefault(b, a)

    def resolve(d, depth=0):
        while isinstance(d, str) and d in same and depth < 64:
            d, depth = same[d], depth + 1
        return d

    for t in _computed_tensors(graph):
        if t.shape is not None and any(isinstance(d, str) and d in same for d in t.shape):
            t.shape = [resolve(d) for d in t.shape]
