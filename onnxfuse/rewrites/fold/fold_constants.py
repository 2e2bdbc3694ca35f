"""Fold constant subgraphs, including size arithmetic that shape inference proves static.

Why this rule exists
--------------------
Exporters compute sizes at run time (``Shape → Gather → Div → Concat → Reshape``) even where the
weights fix them. torch's ``MultiheadAttention`` computes its scale ``sqrt(1/sqrt(head_dim))`` from
``Shape(q)`` after a Reshape whose target shape is itself computed, so ONNX shape inference (and with
it ONNX Runtime's own constant folding) loses ``head_dim``: ONNX Runtime evaluates that glue on the
CPU at every inference, copies the scale to the GPU and multiplies q and k by it in two extra
kernels per layer. Iterating shape inference (with data propagation) and onnx-graphsurgeon's
constant folding (which folds ``Shape → Gather/Slice`` of static dimensions) until nothing changes
recovers ``head_dim = 192 / 3`` and turns the scale into a constant, which
``contrib-fused-matmul-scale`` then folds into the attention MatMul.

Safety
------
* Only static dimensions (``dim_value``) are folded; dynamic ones (``dim_param`` or unknown) stay
  computed. The model's own ``value_info`` is dropped before inference, so a stale annotation
  written by an exporter cannot freeze a dynamic dimension: shapes come from the graph inputs'
  declarations and the weights only.
* Values are computed by ONNX Runtime's CPU provider (what onnx-graphsurgeon uses), i.e. by the
  same kernels ONNX Runtime's constant folding uses on the original model: the rewrite is exact.
* Results over :data:`SIZE_LIMIT` bytes stay unfolded, so a model never grows by more than that per
  folded tensor (ONNX Runtime folds those itself at session start).
* Only ONNX-domain ops are evaluated; if the evaluation fails, the graph stays as it was.
* Nodes that read or write bfloat16 are not given to ONNX Runtime's CPU provider, which has almost no
  bfloat16 kernels (one such node failed the whole evaluation); small bfloat16 arithmetic is folded by
  :mod:`~onnxfuse.rewrites.fold.bfloat16_scalars` instead, to the values ONNX Runtime's CUDA kernels give.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, replace_reads, to_identity
from onnxfuse.rewrites.engine.rule import GraphPass
from onnxfuse.rewrites.facts.graph import BF16, constant_value, dtype_of, graphs_within, is_default_domain
from onnxfuse.rewrites.facts.inference import inferred_and_proven
from onnxfuse.rewrites.facts.shape_values import shape_value
from onnxfuse.rewrites.facts.shapes import weights_as_inputs
from onnxfuse.rewrites.fold import SIZE_LIMIT
from onnxfuse.rewrites.fold.bfloat16_scalars import fold_bfloat16_scalars

#: Rounds of (shape inference, constant folding); each round can uncover sizes for the next.
MAX_ROUNDS = 6


def _count_compute_nodes(graph: gs.Graph) -> int:
    """Nodes other than Constant (turning a Constant node into an initializer folds nothing)."""
    return sum(1 for n in graph.nodes if n.op != "Constant")


def _ort_severity(level: int) -> None:
    # start-up: the command line starts (and --help runs) without onnxfuse.ort_runtime
    from onnxfuse.ort_runtime import import_onnxruntime

    try:
        import_onnxruntime().set_default_logger_severity(level)
    except Exception:  # onnxruntime missing, broken or too old: graphsurgeon then folds nothing anyway
        pass


def folded_copy(graph: gs.Graph) -> gs.Graph | None:
    """A folded copy of ``graph``, or None when folding removes no computing node."""
    # import cycle: importing onnxfuse.model_io imports this module
    from onnxfuse.model_io import infer_shapes, quiet_graphsurgeon

    before = _count_compute_nodes(graph)
    work, stand_ins = weights_as_inputs(graph, SIZE_LIMIT)
    model = gs.export_onnx(work, do_type_check=False)
    del work
    del model.graph.value_info[:]
    _ort_severity(3)  # graphsurgeon's evaluation sessions would print ONNX Runtime's warnings
    try:
        with quiet_graphsurgeon():  # it warns for every subgraph it cannot evaluate: expected here
            folded = None
            for _ in range(MAX_ROUNDS):
                model = infer_shapes(model)
                g = gs.import_onnx(model)
                n0 = len(g.nodes)
                try:
                    # All foldable nodes in one evaluation. Ops outside the ONNX domain are never
                    # evaluated (ONNX Runtime's CPU provider lacks some com.microsoft kernels, and ours
                    # needs a library): one failure would stop the whole evaluation. graphsurgeon's
                    # partition-by-partition mode copies the graph per partition and recursed without
                    # end on such a failure here, so it is not used. Loop and Scan are never evaluated
                    # either: graphsurgeon's copy of a Loop whose inputs are all constant gave ONNX Runtime a
                    # body with the wrong number of inputs, and that one failure left every other
                    # constant chain unfolded until a second optimize (fuzz seed 3358). Nor a node that
                    # reads or writes bfloat16 (--precision bf16): ONNX Runtime's CPU provider has almost no
                    # bfloat16 kernels, and one such node in the evaluation left a GPT-2's whole size
                    # arithmetic unfolded (39 folds against float16's 110; 110 nodes against 22).
                    g.fold_constants(fold_shapes=True, partitioning=None, error_ok=True, size_threshold=SIZE_LIMIT,
                                     should_exclude_node=lambda n: not is_default_domain(n) or n.op in ("Loop", "Scan")
                                     or _touches_bfloat16(g, n))
                except Exception:  # graphsurgeon bug on an unusual graph: keep what we have
                    break
                fold_bfloat16_scalars(g)  # what the CPU evaluation left for want of bfloat16 kernels
                g.cleanup(remove_unused_graph_inputs=False).toposort()
                _body_outputs_written(g)
                folded = g
                if len(g.nodes) == n0:
                    break
                model = gs.export_onnx(g, do_type_check=False)
    finally:
        _ort_severity(2)  # ONNX Runtime's default
    if folded is None or _count_compute_nodes(folded) >= before:
        return None
    # Re-import from a fully inferred model, so later rules see shapes on every tensor.
    result = inferred_and_proven(gs.export_onnx(folded, do_type_check=False))
    return _with_large_constants(result, graph, stand_ins)


def _touches_bfloat16(graph, node) -> bool:
    """Whether ``node`` reads or writes a bfloat16 tensor (graphsurgeon types one by ONNX's enum, or as
    ml_dtypes' bfloat16 for a constant): :func:`~onnxfuse.rewrites.facts.graph.dtype_of`'s reading."""
    return any(dtype_of(graph, t) in BF16 for t in [*node.inputs, *node.outputs] if t is not None and t.name)


def _body_outputs_written(graph: gs.Graph) -> None:
    """Each If/Loop/Scan body output that folding made a constant is written by a ``Constant`` node again
    (the constant itself renamed): ONNX wants a body's outputs produced by its nodes, and graphsurgeon folds
    inside bodies too. Without this fuzz seed 120249's If branch failed the checker, and the pipeline
    dropped fold-constants for the whole model (a second optimize folded what the first had not)."""
    for body in list(graphs_within(graph))[1:]:
        for i, out in enumerate(body.outputs):
            if not isinstance(out, gs.Constant):
                continue
            written = gs.Variable(out.name, dtype=out.dtype, shape=list(out.shape))
            out.name = f"{out.name}/folded"
            body.nodes.append(gs.Node("Constant", f"{written.name}/constant", {"value": out}, outputs=[written]))
            body.outputs[i] = written


def _with_large_constants(folded: gs.Graph, original: gs.Graph, names: list[str]) -> gs.Graph:
    """Put the original large constants back in place of their stand-in graph inputs."""
    if not names:
        return folded
    constants = original.tensors()
    tensors = folded.tensors()
    for name in names:
        stand_in, constant = tensors.get(name), constants[name]
        if stand_in is None:  # no longer read by anything
            continue
        replace_reads(stand_in, constant)
        folded.outputs = [constant if x is stand_in else x for x in folded.outputs]
    wanted = set(names)
    folded.inputs = [t for t in folded.inputs if t.name not in wanted]
    return folded


def _install(graph: gs.Graph, new: gs.Graph) -> None:
    """Make ``graph`` (the object the caller holds) contain ``new``'s nodes and signature.

    The replaced nodes (subgraphs' included) are disconnected first: ``new`` reads the original large
    constants (:func:`_with_large_constants`), and graphsurgeon lists every node still holding a tensor
    among its readers, so a discarded node would stay a reader of each weight (``facts.consumers``) for
    every rule after this one."""
    for node in [n for g in graphs_within(graph) for n in g.nodes]:
        node.inputs.clear()
        node.outputs.clear()
    graph.nodes = new.nodes
    graph.inputs = new.inputs
    graph.outputs = new.outputs


#: Where a graph keeps the nodes fold-constants left after its last run (``pending`` looks past them).
_LEFT = "onnxfuse_fold_constants_left"
#: Where a graph keeps the nodes that read static sizes at fold-constants' last run (and were left).
_STATIC_LEFT = "onnxfuse_fold_constants_static_left"


def _result_bytes(node) -> int:
    """A cheap estimate of a constant node's result size, without evaluating it or loading weights."""
    sizes = []
    for t in node.inputs:
        if isinstance(t, gs.Constant):
            try:
                sizes.append(int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize)
            except Exception:
                return SIZE_LIMIT + 1
    if node.op == "Expand" and len(node.inputs) == 2:
        try:
            target = [int(d) for d in np.asarray(node.inputs[1].values).reshape(-1)]
            shape = np.broadcast_shapes(tuple(node.inputs[0].shape), tuple(target))
            return int(np.prod(shape, dtype=np.int64)) * np.dtype(node.inputs[0].dtype).itemsize
        except Exception:
            return SIZE_LIMIT + 1
    return max(sizes, default=0)


def _reads_static_dims(graph, node) -> bool:
    """``Slice`` or ``Gather`` of a ``Shape`` chain that :func:`~onnxfuse.rewrites.facts.shape_values.
    shape_value` evaluates to static sizes only: size arithmetic this pass folds (a rule that reads a
    static S from ``Shape`` at run time leaves one)."""
    if node.op not in ("Slice", "Gather") or not node.outputs:
        return False
    values = shape_value(graph, node.outputs[0])
    return bool(values) and all(isinstance(v, (int, np.integer)) for v in values)


def _static_size_reads_to_constants(graph, candidates: set[int]) -> None:
    """Each ``Slice`` or ``Gather`` of a ``Shape`` chain among ``candidates`` (node ids) that reads
    static sizes only (:func:`_reads_static_dims`) becomes an ``Identity`` of those sizes, for the
    evaluation after it to fold. The shapes it reads are the graph's own facts, which the ONNX model
    that evaluation infers again without its value_info can lack: a YOLOv8 head's ``Shape(view(b, 4,
    a))[1]`` is 4 by the graph's facts and unknown to the plain inference, and stayed computed. Exact: a
    static dimension is the value ``Shape`` gives at run time.

    ``candidates`` are the reads this pass left at its last run that read static sizes only since: the
    shapes they read then come from onnxfuse's own inference (:func:`~onnxfuse.rewrites.facts.inference.
    reinferred_and_proven`, value_info dropped), never from an exporter's annotation, which can be
    stale (traced at batch 1, it would freeze a dynamic batch to 1: test_fold_constants'
    stale-value_info test)."""
    names = NameAllocator(graph)
    for node in list(graph.nodes):
        if id(node) not in candidates or not _reads_static_dims(graph, node):
            continue
        out = node.outputs[0]
        values = np.asarray(shape_value(graph, out), dtype=np.int64)
        if node.op == "Gather":  # a Gather of a 1-D shape has its index's rank: a scalar index gives a scalar
            index = constant_value(graph, node.inputs[1])
            if index is None or index.ndim > 1:
                continue
            values = values.reshape(index.shape)
        # not new_constant: np.ascontiguousarray makes a scalar 1-D (an Unsqueeze after it then gave
        # a Qwen2 decoder's Concat of sizes a rank-2 part)
        to_identity(node, gs.Constant(names(f"{out.name}/static"), values))


class FoldConstants(GraphPass):
    """Evaluate every subgraph whose inputs are constant or static sizes, once, at optimization time.

    A whole-graph pass, run once per ``apply_rules``: its count is the number of computing nodes
    folding removes, its detail the ops folded away (by type).
    """

    name = "fold-constants"
    description = "Fold constant subgraphs, static size arithmetic included (Shape→Gather→Div→Reshape)"

    def pending(self, graph) -> bool:
        """A node of the ONNX domain whose inputs are all constants and whose result (estimated: an
        Expand's broadcast shape, else its largest input) stays within :data:`SIZE_LIMIT`: what a
        later rule can leave (contrib-attention expanding a constant mask to a static shape) and a
        second optimize would fold (issue 29: 6.5% of random attention graphs were not idempotent).
        Also a size read (``Shape → Gather``) this pass left that reads static sizes now: a later rule
        made the shape inferable (``constant-reshape-target``): a YOLOv8-style head exported with a
        dynamic batch reads its box distances' sizes from ``Shape`` of a Reshape whose computed target
        only that rule makes constant, and the ``chunk`` Slices reading them kept an unknown rank, so the
        box decoding after them stayed unfused."""
        left = {id(n) for n in graph.__dict__.get(_LEFT, ())}  # this pass already saw them and kept them
        static_left = graph.__dict__.get(_STATIC_LEFT, set())
        for node in graph.nodes:
            if id(node) not in static_left and _reads_static_dims(graph, node):
                return True  # a new size read, or one left that a later rule made static since
            if node.op in ("Constant", "Loop", "Scan", "If") or not is_default_domain(node) or not node.inputs \
                    or id(node) in left:
                continue
            present = [t for t in node.inputs if not (isinstance(t, gs.Variable) and not t.name)]
            if present and all(isinstance(t, gs.Constant) for t in present) and _result_bytes(node) <= SIZE_LIMIT:
                return True
        return False

    def run(self, graph) -> tuple[int, dict[str, Any] | None]:
        became_static = {id(n) for n in graph.__dict__.get(_LEFT, ())} - graph.__dict__.get(_STATIC_LEFT, set())
        n, detail = self._fold(graph, became_static)
        graph.__dict__[_LEFT] = list(graph.nodes)  # the objects themselves: their ids stay theirs
        graph.__dict__[_STATIC_LEFT] = {id(n) for n in graph.nodes if _reads_static_dims(graph, n)}
        return n, detail

    def _fold(self, graph, became_static: set[int]) -> tuple[int, dict[str, Any] | None]:
        before = _count_compute_nodes(graph)
        old_ops = {}
        for n in graph.nodes:
            if n.op != "Constant":
                old_ops[n.op] = old_ops.get(n.op, 0) + 1
        _static_size_reads_to_constants(graph, became_static)
        new = folded_copy(graph)  # folds the Identities of constants the line above left, and what they feed
        if new is None:
            return 0, None
        removed = before - _count_compute_nodes(new)
        if removed <= 0:
            return 0, None
        for n in new.nodes:
            if n.op in old_ops:
                old_ops[n.op] -= 1
        _install(graph, new)
        return removed, {"folded_ops": {op: k for op, k in sorted(old_ops.items()) if k > 0}}
