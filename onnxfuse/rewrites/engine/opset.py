"""Raising a model's default-domain opset without changing what any of its nodes computes.

Why: ONNX ``LayerNormalization`` exists from opset 17. Below that, ONNX Runtime is left to recognise
the decomposed form itself, and it often cannot: in ConvNeXt its transpose optimizer first moves the
channels-last Transpose into the LayerNorm, and what remains runs as ReduceMean + Sub +
SimplifiedLayerNormalization (three kernels instead of one). Declaring opset 17 lets a rule emit the
standard op, which ``onnx.checker`` accepts and every runtime knows.

When it is exact: a node's meaning is given by the schema in force at the model's opset. Raising the
opset is safe for a node when the schema in force at the new opset is the same one, or differs only
by accepting more element types (Pow-15, Identity-16, Where-16…): same inputs and outputs, same
attributes with the same defaults, and every type constraint keeps at least the types it had. A short
list of optional attributes added later whose absence keeps the old behaviour (``Shape``'s
``start``/``end``, ``ScatterND``/``ScatterElements``' ``reduction``) is accepted too. Anything else
(BatchNormalization-15 regrouped its type constraints, RoiAlign-16 changed a default) blocks the raise,
with the op named. Nodes inside If/Loop/Scan bodies are checked as well.

One change is rewritten rather than refused: from opset 18 the Reduce ops (but ReduceSum, at 13) take
``axes`` as an input instead of an attribute; :func:`raise_opset` moves a node's axes into a constant
input, which means the same reduction (``noop_with_empty_axes`` defaults to 0, so no axes still reduces
all). Without it, the ReduceMax of transformers' sdpa mask kept RotaryEmbedding (opset 23) out of every
sdpa-exported decoder at opset 14 or 17.
"""

from __future__ import annotations

import onnx
import onnx_graphsurgeon as gs

import numpy as np

from onnxfuse.rewrites.engine.edit import AXES_INPUT_SINCE, new_constant
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import graphs_within, opset_of

#: Attributes added by a later schema whose absence means the old behaviour, per op.
_ADDED_OPTIONAL_ATTRS = {
    "Shape": {"start", "end"},
    "ScatterND": {"reduction"},
    "ScatterElements": {"reduction"},
    "Cast": {"saturate"},  # Cast-19: saturate only acts on float8 targets, which no Cast below 19 has
}


def _schema(op: str, opset: int):
    try:
        return onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return None


def _same_meaning(op: str, old: int, new: int) -> bool:
    a, b = _schema(op, old), _schema(op, new)
    if a is None or b is None:
        return False
    if a.since_version == b.since_version:
        return True
    io = lambda s: ([(p.name, p.option, p.type_str) for p in s.inputs],  # noqa: E731
                    [(p.name, p.option, p.type_str) for p in s.outputs])
    if io(a) != io(b):
        return False
    added = set(b.attributes) - set(a.attributes)
    if set(a.attributes) - set(b.attributes) or added - _ADDED_OPTIONAL_ATTRS.get(op, set()):
        return False
    if any(b.attributes[n].required for n in added):
        return False
    for name, attr in a.attributes.items():
        other = b.attributes[name]
        if attr.type != other.type or attr.required != other.required:
            return False
        if attr.default_value.SerializeToString() != other.default_value.SerializeToString():
            return False
    new_types = {c.type_param_str: set(c.allowed_type_strs) for c in b.type_constraints}
    for c in a.type_constraints:
        if not set(c.allowed_type_strs) <= new_types.get(c.type_param_str, set()):
            return False
    return True


def ops_changed_by_raise(ops, current: int, target: int) -> list[str]:
    """The default-domain ops among ``ops`` whose meaning differs between opsets ``current`` and
    ``target`` (sorted); empty when raising the opset is exact for all of them. Works on op names, so
    protobuf-level callers (``onnxfuse.repair``) share the rule above."""
    return sorted({op for op in ops if not _same_meaning(op, current, target)})


def _upgradable(op: str, current: int, target: int) -> bool:
    """``op`` changed between ``current`` and ``target`` only by taking ``axes`` as an input instead of an
    attribute (the Reduce family at 18, :data:`~onnxfuse.rewrites.engine.edit.AXES_INPUT_SINCE`; later
    schemas only accept more types), which :func:`raise_opset` rewrites node by node: the same axes as
    a constant input mean the same reduction (``noop_with_empty_axes`` defaults to 0: no axes still
    reduces all). The sdpa exports' mask (ReduceMax) and a lone RMSNorm (ReduceMean) at opset 14 or 17
    otherwise kept RotaryEmbedding-23 and RMSNormalization-23 out."""
    since = AXES_INPUT_SINCE.get(op)
    return since is not None and current < since <= target and _same_meaning(op, since, target)


def _axes_to_input(graph: gs.Graph, node: gs.Node) -> None:
    """``node``'s ``axes`` attribute as a constant int64 input (:func:`_upgradable`)."""
    axes = node.attrs.pop("axes", None)
    if axes is not None:
        node.inputs.append(new_constant(graph, f"{node.name or node.op}/axes", np.asarray(axes, np.int64).reshape(-1)))


def opset_raise_problem(graph: gs.Graph, target: int, replaced=()) -> Refuse | None:
    """Why ``graph``'s default-domain opset cannot be raised to ``target`` exactly, or ``None``.
    ``replaced``: nodes the caller's rewrite removes (an RMSNorm's own ReduceMean, whose meaning changes at
    18, blocks nothing once it is gone). Ops :func:`raise_opset` rewrites to their new form
    (:func:`_upgradable`) block nothing either."""
    current = opset_of(graph, default=0)
    if current >= target:
        return None
    if current <= 0:
        return Refuse("the model's default-domain opset is unknown")
    gone = {id(n) for n in replaced}
    blocking = ops_changed_by_raise({n.op for g in graphs_within(graph) for n in g.nodes
                                     if (n.domain or "") in ("", "ai.onnx") and id(n) not in gone
                                     and not _upgradable(n.op, current, target)}, current, target)
    if blocking:
        return Refuse(f"raising the model's opset {current} → {target} would change the meaning of "
                      f"{', '.join(blocking)}")
    return None


def raise_opset(graph: gs.Graph, target: int) -> None:
    """Declare default-domain opset ``target`` (checked with :func:`opset_raise_problem` first), each node
    of an op :func:`_upgradable` to it rewritten to its new form first, bodies included."""
    current = opset_of(graph, default=0)
    if current < target:
        for g in graphs_within(graph):
            for node in g.nodes:
                if (node.domain or "") in ("", "ai.onnx") and _upgradable(node.op, current, target):
                    _axes_to_input(g, node)
        graph.opset = target
