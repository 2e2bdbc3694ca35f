"""Rules inside subgraphs: each If branch, Loop body and Scan body of the main graph rewritten as a
model of its own.

Why
---
The apply loop (:func:`onnxfuse.rewrites.apply_rules`) runs the pattern rules on the main graph only:
graphsurgeon shares one tensor between a graph and the subgraphs that read it, and every rule's
matching, rewiring and cleanup assumes one scope (:mod:`onnxfuse.rewrites.facts.scopes`). So optimum's
merged decoders, which hold the first-step and the with-past decoder as the two branches of an ``If``
(``decoder_model_merged.onnx``, what optimum's runtime loads by default), kept every attention
decomposed although the same decoders exported apart fuse (issue 31).

How
---
1. A body becomes a model: its own nodes, inputs (a Loop's iteration number, condition and carried
   values; a Scan's) and outputs, plus each value it reads from the main graph (its free names): an
   initializer of the main graph as a copy of that initializer, so that rules see its constant values,
   anything else as a graph input of the type shape inference gave it there.
2. That model is rewritten by the caller's ``rewrite`` with the rules that write only ONNX Runtime's
   own ops or standard ONNX ones (:func:`body_rules`): ONNX Runtime ran a custom op inside an ``If``
   branch on its CPU provider (docs/benchmarks.md 5.32), so no rule that writes ours runs in a body;
   fuse-elementwise enters bodies on its own, in the main pass, as before.
3. The result goes back as the body: the added inputs and the copied initializers that are unchanged
   leave again (the body reads the outer values by name, as before), the standalone inference's invented
   dimension names get the body's own prefix (they would meet a sibling body's; the outputs keep the
   original's declarations), an output the rewrite folded to
   an initializer is written by a ``Constant`` node again, and any name the rewrite created that an
   enclosing graph also defines is renamed inside the body (ONNX scopes: a subgraph must not redefine
   an outer name). A rule that raised the body's opset (RMSNormalization is opset 23) raises the
   model's, where every node of the model means the same at the new opset
   (:func:`~onnxfuse.rewrites.engine.opset.ops_changed_by_raise`).

The main pass then runs as before. Bodies of bodies are left to that pass (one level).

Left as it was, with the reason in the report (:class:`BodySkipped`): a body that reads an outer value
whose element type shape inference does not know (the standalone model would not be valid), a body
whose rewrite makes one of its outputs a value it does not compute (ONNX: a graph output must be
written by a node of that graph), and a body whose rewrite raised the opset where the rest of the
model cannot follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx

from onnxfuse import model_io
from onnxfuse.repair import default_opset
from onnxfuse.rewrites.engine.opset import ops_changed_by_raise
from onnxfuse.rewrites.engine.rule import ApplyReport, Rule, unnamed_label

#: Bodies with fewer nodes hold no pattern a rule could take (an Identity, one op).
MIN_BODY_NODES = 4
#: The targets whose rules write only ops ONNX Runtime runs on its own kernels in any graph.
BODY_TARGETS = frozenset({"contrib", "onnx"})


@dataclass(frozen=True)
class BodyRewrite:
    """A body the rules ran in: the node holding it, the attribute, what the rules did there."""

    node: str
    attribute: str
    report: ApplyReport


@dataclass(frozen=True)
class BodySkipped:
    """A body left as it was: the node holding it, the attribute (``then_branch``, ``body``…), why."""

    node: str
    attribute: str
    reason: str


def left_note(bodies: list[dict]) -> str | None:
    """One line for the bodies the rules did not run in (``ApplyReport.bodies`` entries with ``left``), or
    None: what a user reading the console should know, since the rule counts say nothing of them."""
    left = [b for b in bodies if "left" in b]
    if not left:
        return None
    first = left[0]
    more = f" (and {len(left) - 1} more body)" if len(left) == 2 else f" (and {len(left) - 1} more bodies)" if len(left) > 2 else ""
    return f"rules did not run inside {first['node']} {first['attribute']}{more}: {first['left']}"


def body_rules(rules: list[Rule]) -> list[Rule]:
    """The rules of ``rules`` that may run inside a body: those of a target without our custom ops."""
    return [r for r in rules if r.targets & BODY_TARGETS]


def bodies_read_new_constants(before: onnx.ModelProto, after: onnx.ModelProto) -> bool:
    """Whether a body of ``after``'s main graph (one :func:`rewrite_bodies` rewrites) reads an outer value
    that is an initializer of ``after`` and was computed in ``before``: the main pass folded what the body
    reads, after the body was rewritten with it as an input. Rewritten again, the body folds what reads it:
    fuzz seed 573593's If branch took Abs, Add and Log of a main-graph Mul of constants only on a second
    optimize (graphsurgeon's folding inside the branch gives up on its nested Loop)."""
    was = {t.name for t in before.graph.initializer}
    now = {t.name for t in after.graph.initializer} - was
    if not now:
        return False
    return any(name in now for node in after.graph.node for attr in node.attribute
               if attr.type == onnx.AttributeProto.GRAPH and len(attr.g.node) >= MIN_BODY_NODES
               for name in model_io.free_names(attr.g))


def rewrite_bodies(model: onnx.ModelProto, rewrite: Callable[[onnx.ModelProto], tuple[onnx.ModelProto, ApplyReport]]
                   ) -> tuple[onnx.ModelProto, list[BodyRewrite], list[BodySkipped]]:
    """``model`` with the body of every main-graph node that holds one (at least :data:`MIN_BODY_NODES`
    nodes) rewritten by ``rewrite`` as a model of its own (the module docstring says how); ``model``
    itself is never modified, and is returned as it is when it has no such body. Also: what each
    rewrite did, and the bodies left as they were."""
    holders = [(k, a) for k, node in enumerate(model.graph.node) for a, attr in enumerate(node.attribute)
               if attr.type == onnx.AttributeProto.GRAPH and len(attr.g.node) >= MIN_BODY_NODES]
    if not holders:
        return model, [], []
    types = _value_types(model_io.infer_shapes(model))
    keep = model_io.overridable_initializers(model)
    initializers = {t.name: t for t in model.graph.initializer if t.name not in keep}
    outer = model_io.defined_names(model.graph)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    reports, skipped = [], []
    for k, a in holders:
        node, attr = out.graph.node[k], out.graph.node[k].attribute[a]
        label = node.name or unnamed_label(node.op_type, node.output[0] if node.output else "")
        standalone, added = _standalone(model, attr.g, types, initializers)
        if isinstance(standalone, str):
            skipped.append(BodySkipped(label, attr.name, standalone))
            continue
        rewritten, report = rewrite(standalone)
        body = _put_back(rewritten.graph, added, initializers, outer, attr.g, tag=f"body{k}_{a}")
        if isinstance(body, str):
            skipped.append(BodySkipped(label, attr.name, body))
            continue
        previous = onnx.GraphProto()
        previous.CopyFrom(attr.g)
        attr.g.CopyFrom(body)
        current, wanted = default_opset(out), default_opset(rewritten)
        if wanted > current:  # a rule raised the body's opset (RMSNormalization is opset 23): the whole model's
            blocking = ops_changed_by_raise(_ops_outside(out.graph, k, a), current, wanted)
            if blocking:
                attr.g.CopyFrom(previous)
                skipped.append(BodySkipped(label, attr.name, f"its rewrite needs opset {wanted}, and raising the "
                                           f"model's {current} would change the meaning of {', '.join(blocking)}"))
                continue
            for imp in out.opset_import:
                if imp.domain in ("", "ai.onnx"):
                    imp.version = wanted
        _add_opsets(out, rewritten)
        reports.append(BodyRewrite(label, attr.name, report))
    return (out if reports else model), reports, skipped


def _value_types(inferred: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """The tensor type of every main-graph value shape inference knows the element type of, by name."""
    g = inferred.graph
    types = {t.name: onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        if vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.elem_type:
            types.setdefault(vi.name, vi.type)
    return types


def _standalone(model: onnx.ModelProto, body: onnx.GraphProto, types, initializers
                ) -> tuple[onnx.ModelProto | str, set[str]]:
    """``body`` as a model of its own (step 1), and the names of the inputs added for outer values; or
    why not."""
    graph = onnx.GraphProto()
    graph.CopyFrom(body)
    added = set()
    for name in model_io.free_names(body):
        if name in initializers:
            graph.initializer.append(initializers[name])
        elif name in types:
            graph.input.append(onnx.helper.make_value_info(name, types[name]))
            added.add(name)
        else:
            return f"it reads {name!r}, whose type shape inference does not know", added
    standalone = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    standalone.ir_version = model.ir_version
    standalone.functions.extend(model.functions)
    return standalone, added


def _put_back(graph: onnx.GraphProto, added: set[str], initializers, outer: set[str],
              original: onnx.GraphProto, tag: str = "body") -> onnx.GraphProto | str:
    """The rewritten standalone ``graph`` as a body again (step 3), or why it cannot be one."""
    body = onnx.GraphProto()
    body.CopyFrom(graph)
    del body.input[:]
    body.input.extend(vi for vi in graph.input if vi.name not in added)
    del body.initializer[:]
    body.initializer.extend(model_io.inline_lazy(  # the rewrite's new weights, spilled in the standalone model
        t for t in graph.initializer if not (t.name in initializers and model_io.same_tensor(t, initializers[t.name]))))
    _outputs_as_constants(body)
    # The standalone model's shape inference invented its own ``unk__N`` names, which a sibling body's
    # inference reuses for other sizes: left as they are, the main pass would read them as one size across
    # both branches (proved dimensions are renamed across every graph). They get the body's own prefix;
    # its outputs keep the original's declarations.
    for vi in body.value_info:
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param.startswith("unk__"):
                d.dim_param = f"{tag}_{d.dim_param}"
    declared = {vi.name: vi for vi in original.output}
    for vi in body.output:
        if vi.name in declared:
            vi.CopyFrom(declared[vi.name])
    produced = {o for n in body.node for o in n.output if o} | {vi.name for vi in body.input}
    missing = [vi.name for vi in body.output if vi.name not in produced]
    if missing:
        return f"its rewrite made output {missing[0]!r} a value the body does not compute"
    before = model_io.defined_names(original)
    clashes = sorted((model_io.defined_names(body) - before) & outer)
    if clashes:
        taken = outer | _all_names(body)
        _rename(body, {name: _fresh(name, taken) for name in clashes})
    return body


def _outputs_as_constants(body: onnx.GraphProto) -> None:
    """A body output the rewrite made an initializer (a folded constant: optimum's empty cross-attention
    presents) goes back to a ``Constant`` node writing it, as bodies write constant outputs."""
    outputs = {vi.name for vi in body.output}
    constant = [t for t in body.initializer if t.name in outputs]
    if not constant:
        return
    kept = [t for t in body.initializer if t.name not in outputs]
    del body.initializer[:]
    body.initializer.extend(kept)
    for t in constant:
        body.node.append(onnx.helper.make_node("Constant", [], [t.name], name=f"{t.name}/constant", value=t))


def _all_names(graph: onnx.GraphProto) -> set[str]:
    names = {o for g in model_io.proto_graphs(graph) for n in g.node for o in [*n.input, *n.output] if o}
    return names | model_io.defined_names(graph) | {vi.name for vi in graph.output}


def _fresh(name: str, taken: set[str]) -> str:
    k = 1
    while f"{name}__body{k}" in taken:
        k += 1
    taken.add(f"{name}__body{k}")
    return f"{name}__body{k}"


def _rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename ``mapping``'s names (defined by ``graph``) where ``graph`` defines and reads them, and where its
    own bodies read them (:func:`~onnxfuse.model_io.rename_outer_reads`)."""
    for t in graph.initializer:
        t.name = mapping.get(t.name, t.name)
    for vi in [*graph.value_info, *graph.output]:
        vi.name = mapping.get(vi.name, vi.name)
    for node in graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
        node.output[:] = [mapping.get(n, n) for n in node.output]
        for body in model_io.node_subgraphs(node):
            model_io.rename_outer_reads(body, mapping)


def _ops_outside(graph: onnx.GraphProto, k: int, a: int) -> set[str]:
    """The default-domain ops of ``graph`` and all its subgraphs but the body in attribute ``a`` of node
    ``k`` (whose own rewrite checked its nodes at the raised opset)."""
    ops = set()
    for j, node in enumerate(graph.node):
        if (node.domain or "") in ("", "ai.onnx"):
            ops.add(node.op_type)
        for b, attr in enumerate(node.attribute):
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            if (j, b) != (k, a):
                ops |= {n.op_type for sub in subs for g in model_io.proto_graphs(sub) for n in g.node
                        if (n.domain or "") in ("", "ai.onnx")}
    return ops


def _add_opsets(model: onnx.ModelProto, rewritten: onnx.ModelProto) -> None:
    """The domains a body's rewrite brought in (``com.microsoft``), at the rewrite's versions (a raised
    default domain never comes here: :func:`rewrite_bodies` leaves that body as it was)."""
    have = {o.domain for o in model.opset_import}
    model.opset_import.extend(onnx.helper.make_opsetid(o.domain, o.version) for o in rewritten.opset_import
                              if o.domain not in have and o.domain not in ("", "ai.onnx"))
