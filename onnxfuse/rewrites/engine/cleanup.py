"""Cleanup passes that run before the first rule and after every rule pass.

* Identity removal: an Identity only renames a tensor, so readers can read its input directly.
  When its output is a graph output, the producer of its input is made to write the graph output
  instead (the graph output keeps its name); an Identity between a graph input or initializer and a
  graph output is kept, since that rename is the only thing producing the output. So is an Identity
  whose input comes from an enclosing graph (``scopes``): the producer belongs to another graph and
  cannot be made to write this graph's output.
* Identity Reshapes: ``Reshape(x, t)`` with a constant ``t`` that provably gives back ``x``'s own shape
  becomes an Identity (then removed as above): ``x`` of known rank ``len(t)`` and every entry of
  ``t`` either 0 (copy, when ``allowzero`` is 0), the static dimension already there, or the single
  -1, which is then inferred as the one dimension left (the element count is unchanged). Exporters
  write these as often as not (BERT's ``Reshape(x, [-1])`` of a 1-D size vector), and rules leave
  them (contrib-attention's merge Reshape reads an [B, S, E] output and asks for [B, S, E]); each is
  a kernel launch at run time and, worse, ONNX shape inference does not propagate values through
  Reshape, so sizes that pass through one stop being known.
* One-input Concats: ``Concat(x)`` is ``x`` (ONNX allows a single input and copies it); it becomes an
  Identity (then removed as above). The legacy exporter writes one for transformers' cache of the first
  layer (``Concat(past_key_values.0.key)``): a copy of that layer's whole key cache on every decode step.
* Whole Slices and empty Concat inputs: a ``Slice`` that keeps every element of its input (static sizes,
  step 1, clamped bounds 0 and d) becomes an Identity; a ``Concat`` input of static length 0 along the
  axis is dropped (a one-input Concat is then an Identity). Phi-3's export slices the rotated part of
  each head and concatenates the rest back even when the rotation covers the whole head. Reported with
  the identity Reshapes.
* Duplicates (common subexpressions): two ONNX-domain nodes of one graph with the same op, the same
  attributes and the same inputs compute the same outputs, so the later one's readers read the
  earlier one's outputs. Inputs count as the same when they are the same tensor or small constants
  (≤ :data:`SMALL_CONSTANT_BYTES`) of equal type, shape and bytes; two ``Shape`` nodes read the same
  value when their inputs' shapes are provably equal (every dimension a size or a name, as
  ``facts.graph.dims_equal`` proves them), but not by a name two graph inputs declare (``input_ids`` and
  ``attention_mask`` both ``[batch, sequence]``): ONNX Runtime does not check that those agree, and a
  merged ``Shape(attention_mask)`` read ``input_ids``' sizes (found 2026-11-24; for GPT-2's zoo export
  and BERT-base the node counts are unchanged, the tiny GPT-2 in testdata keeps one more Shape). Never merged: ops with a random
  or stateful result (:data:`NOT_PURE`), nodes holding subgraphs, nodes writing a graph output.
  Exporters repeat per layer what is the same for every layer: GPT-2 builds its causal mask from
  ``Shape``/``Slice``/``Where`` twelve times, one per block.
* Dead nodes and unused initializers are removed (graph inputs are kept: they are the model's
  signature), and nodes are sorted topologically, all through onnx-graphsurgeon, subgraphs included.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import replace_reads, to_identity
from onnxfuse.rewrites.facts.graph import (
    constant_value,
    graphs_within,
    int_attr,
    is_default_domain,
    is_op,
    shape_of,
)
from onnxfuse.rewrites.facts.scopes import Scope
from onnxfuse.rewrites.facts.shape_values import whole_slice
from onnxfuse.rewrites.facts.shapes import dims_proven_equal, unify_dims


def _is_identity_reshape(graph: gs.Graph, node: gs.Node) -> bool:
    if not is_op(node, "Reshape") or len(node.inputs) != 2 or len(node.outputs) != 1:
        return False
    target = constant_value(graph, node.inputs[1])
    shape = shape_of(graph, node.inputs[0])
    if target is None or target.ndim != 1 or target.dtype.kind != "i" or shape is None or len(shape) != target.size:
        return False
    copy_zero = int_attr(node, "allowzero", 0) == 0
    inferred = 0
    for want, have in zip(target.tolist(), shape):
        if want == -1:
            inferred += 1
        elif not ((want == 0 and copy_zero) or (want > 0 and isinstance(have, int) and have == want)):
            return False
    return inferred <= 1


def identity_reshapes_to_identity(graph: gs.Graph) -> int:
    """Turn every provably identity Reshape (module docstring) into an Identity, subgraphs included.

    An identity Reshape also proves its output's dimensions equal to its input's. Shape inference could
    not know that (it invents ``unk__9`` for a -1 it cannot compute symbolically), and every tensor it
    inferred downstream carries the invented name; :func:`unify_dims` renames it everywhere, so that a
    rule later sees DistilBERT's attention output and its residual as the same [batch, seq, E]."""
    changed = 0
    same: dict[str, object] = {}
    for g in graphs_within(graph):
        for node in g.nodes:
            if _is_identity_reshape(g, node):
                same.update(dims_proven_equal(node.outputs[0].shape, shape_of(g, node.inputs[0])))
                to_identity(node, node.inputs[0])
                changed += 1
    unify_dims(graph, same)
    return changed


def single_concats_to_identity(graph: gs.Graph) -> int:
    """Turn every ``Concat`` of one input into an Identity of it (module docstring), subgraphs included."""
    changed = 0
    for g in graphs_within(graph):
        for node in g.nodes:
            if node.op == "Concat" and is_default_domain(node) and len(node.inputs) == 1 \
                    and len(node.outputs) == 1 and not node.inputs[0].is_empty():
                to_identity(node, node.inputs[0])
                changed += 1
    return changed


def whole_slices_to_identity(graph: gs.Graph) -> int:
    """Turn every Slice that keeps its whole input into an Identity, subgraphs included. Phi-3's export
    rotates ``q[..., :rotary_dim]`` and concatenates ``q[..., rotary_dim:]`` back even when rotary_dim is
    the whole head: a copy, and a pattern the rotary and attention rules then see through."""
    changed = 0
    for g in graphs_within(graph):
        for node in g.nodes:
            if whole_slice(g, node):
                to_identity(node, node.inputs[0])
                changed += 1
    return changed


def empty_concat_inputs_removed(graph: gs.Graph) -> int:
    """Drop from each Concat the inputs of static length 0 along its axis (nothing to copy), keeping at
    least one input; subgraphs included. Phi-3's ``Concat(rotated, q[..., head:])`` then has one input."""
    changed = 0
    for g in graphs_within(graph):
        for node in g.nodes:
            if node.op != "Concat" or not is_default_domain(node) or len(node.inputs) < 2:
                continue
            axis = int_attr(node, "axis", 0)
            keep = []
            for t in node.inputs:
                shape = shape_of(g, t)
                a = axis + len(shape) if shape is not None and axis < 0 else axis
                empty = shape is not None and 0 <= a < len(shape) and shape[a] == 0 and isinstance(shape[a], int)
                if not empty:
                    keep.append(t)
            if not keep:
                keep = [node.inputs[0]]
            if len(keep) < len(node.inputs):
                changed += len(node.inputs) - len(keep)
                node.inputs.clear()
                node.inputs.extend(keep)
    return changed


def remove_identities(graph: gs.Graph) -> int:
    removed = 0
    outputs = {id(t) for t in graph.outputs}
    scope = Scope(graph)
    for node in list(graph.nodes):
        if node.op != "Identity" or len(node.inputs) != 1 or len(node.outputs) != 1:
            continue
        src, dst = node.inputs[0], node.outputs[0]
        if id(dst) in outputs:
            producer = scope.producer(src)  # None for inputs, constants and outer values
            if producer is None or id(src) in outputs:
                continue
        node.inputs.clear()
        node.outputs.clear()
        if id(dst) in outputs:  # readers of src now read dst; the producer writes dst directly
            replace_reads(src, dst)
            producer.outputs[producer.outputs.index(src)] = dst
        else:
            replace_reads(dst, src)
        removed += 1
    for node in graph.nodes:
        for attr in node.attrs.values():
            if isinstance(attr, gs.Graph):
                removed += remove_identities(attr)
    return removed


#: Constants up to this size are compared by value when looking for duplicate nodes.
SMALL_CONSTANT_BYTES = 1 << 20
#: Ops whose outputs are not a function of their inputs and attributes alone.
NOT_PURE = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                      "Bernoulli", "Dropout"})


def _value_key(value) -> tuple:
    arr = np.asarray(value)
    return ("value", arr.dtype.str, arr.shape, arr.tobytes())


def _tensor_key(t) -> tuple:
    if t.is_empty():
        return ("empty",)
    if isinstance(t, gs.Constant):
        try:
            if t.values.nbytes <= SMALL_CONSTANT_BYTES:
                return _value_key(t.values)
        except Exception:  # a lazy weight that cannot be read: compared by identity
            pass
    return ("tensor", id(t))


def _attr_key(value):
    if isinstance(value, gs.Graph):
        raise TypeError("subgraph")
    if isinstance(value, gs.Constant):
        return _value_key(value.values)
    if isinstance(value, np.ndarray):
        return _value_key(value)
    if isinstance(value, (list, tuple)):
        return tuple(_attr_key(v) for v in value)
    return (type(value).__name__, repr(value))


def _shared_declared_names(graph: gs.Graph) -> set[str]:
    """Dimension names two or more graph inputs declare (``input_ids`` and ``attention_mask``, both
    ``[batch, sequence]``): ONNX Runtime does not check that they agree, and validation draws them unequal,
    so two Shapes whose equality rests on such a name may differ at run time."""
    seen: dict[str, int] = {}
    for t in graph.inputs:
        for d in set(d for d in (t.shape or []) if isinstance(d, str) and d):
            seen[d] = seen.get(d, 0) + 1
    return {d for d, n in seen.items() if n > 1}


def merge_duplicates(graph: gs.Graph) -> int:
    """Make readers of a duplicate node read the first node's outputs (module docstring); the duplicate
    is then dead. Returns how many were merged. The graph must be in topological order."""
    outputs = {id(t) for t in graph.outputs}
    shared = _shared_declared_names(graph)
    seen: dict[tuple, gs.Node] = {}
    merged = 0
    for node in graph.nodes:
        if not is_default_domain(node) or node.op in NOT_PURE or not node.outputs:
            continue
        if any(id(t) in outputs for t in node.outputs):
            continue
        try:
            inputs = tuple(_tensor_key(t) for t in node.inputs)
            if node.op == "Shape" and (dims := shape_of(graph, node.inputs[0])) is not None and None not in dims \
                    and not shared.intersection(d for d in dims if isinstance(d, str)):
                inputs = (("dims", tuple(dims)),)  # the same shape, proven (sizes, one run's names): the same value
            key = (node.op, tuple(sorted((k, _attr_key(v)) for k, v in node.attrs.items())), inputs,
                   len(node.outputs))
        except TypeError:  # holds a subgraph
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = node
            continue
        for mine, theirs in zip(node.outputs, first.outputs):
            if mine.is_empty() != theirs.is_empty():
                break
        else:
            for mine, theirs in zip(node.outputs, first.outputs):
                replace_reads(mine, theirs)
            merged += 1
    return merged


def _all_nodes(graph: gs.Graph) -> list[gs.Node]:
    return [n for g in graphs_within(graph) for n in g.nodes]


def forget_dead_readers(before: list[gs.Node], graph: gs.Graph) -> None:
    """Unlink every node of ``before`` that is no longer in ``graph`` or its subgraphs.

    onnx-graphsurgeon removes a dead node from its graph, but the nodes *inside* a dead If/Loop stay
    registered as readers of the outer values they read. A later rule would then see a reader that
    no longer exists ("intermediate tensor is also read by ...") and refuse a rewrite that a second
    run, importing the model afresh, makes: the optimizer was not idempotent (fuzz seeds 894, 2762).
    """
    live = {id(n) for n in _all_nodes(graph)}
    for node in before:
        if id(node) not in live:
            node.inputs.clear()
            node.outputs.clear()


def cleanup(graph: gs.Graph) -> dict[str, int]:
    """Run every cleanup pass; return what each removed (for the report)."""
    before = len(graph.nodes)
    everything = _all_nodes(graph)
    empty = empty_concat_inputs_removed(graph)
    reshapes = identity_reshapes_to_identity(graph) + whole_slices_to_identity(graph) + single_concats_to_identity(graph)
    identities = max(remove_identities(graph) - reshapes, 0)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    duplicates = merge_duplicates(graph)
    if duplicates:
        graph.cleanup(remove_unused_graph_inputs=False).toposort()
    forget_dead_readers(everything, graph)
    dead = before - identities - reshapes - duplicates - len(graph.nodes)
    reshapes += empty  # reported with the identity Reshapes: each is a copy that did nothing
    return {"identity": identities, "identity-reshape": reshapes, "duplicate": duplicates, "dead-node": max(dead, 0)}
