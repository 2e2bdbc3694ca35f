"""If ONNX Runtime runs a model, onnxfuse accepts it: exact repairs of what ``onnx.checker`` refuses.

Why: ONNX Runtime loads models ``onnx.checker`` rejects, and its own tools write them (its BERT and GPT-2
test generators write ``LayerNormalization`` at opset 11-16; onnxruntime-genai's builder writes
``SimplifiedLayerNormalization`` in the ONNX domain). Of 272 of ORT's fusion test models that its CPU
provider runs, 85 were refused at load before this module (docs/ort-corpus.md). Each repair below
changes how the model is *written*, never what it computes, and each is what ONNX Runtime itself does
when it reads the model:

* **Nodes sorted topologically** (every graph, If/Loop/Scan bodies included; a node that reads an outer
  value through its subgraph comes after that value's producer). ORT sorts the graph itself when it
  resolves it; order carries no meaning in ONNX beyond that. The sort is stable (Kahn's algorithm taking
  the earliest ready node, so a sorted graph keeps its order). A real cycle, or a value nobody
  produces, cannot be sorted: the graph stays as it is and the checker's refusal stands.
* **Missing opset imports** for domains the nodes use: ``com.microsoft`` (and its ``nchwc`` /
  ``experimental`` siblings) at version 1, the only version there is; for ONNX's own domains
  (``ai.onnx.ml``, ...) the newest version of the schemas the nodes use. ORT gives a domain without an
  import its latest version, which resolves each op to its newest schema: the same schemas.
* **Initializers listed as graph inputs** below IR version 4, where the format requires it. Below IR 4
  an initializer listed as an input is a constant (ORT does not let a caller override it), so the
  signature a caller sees and every value are unchanged (:func:`onnxfuse.model_io.to_model` keeps the
  list for the output).
* **Graph outputs (or inputs) declared without a shape or type** get the type and shape ONNX shape
  inference gives them: what the graph provably computes (contrib ops that keep input 0's type and
  shape, FastGelu or SkipLayerNormalization, are read as Identity for that inference only). Where
  inference finds the dtype but not the rank, only the dtype is declared: the checker wants a shape
  field, but an empty one means a scalar, and an unknown rank cannot be written. Such a value is then
  checked as ORT reads it (next point): a missing shape means any shape.
* **``LayerNormalization`` below opset 17**: ORT registers its own LayerNormalization kernel in the
  ONNX domain for opsets 1-16 (``contrib_defs.cc``; same inputs, outputs, attributes and defaults as
  ONNX's opset-17 op; on the CPU both kernels are ORT's ``LayerNormImpl``, not simplified). The model's opset is raised to 17
  when every other op means the same there (:func:`~onnxfuse.rewrites.engine.opset.ops_changed_by_raise`,
  the rule ``contrib-layernorm`` uses) and each LayerNormalization's X and Scale (and B) share one
  dtype (ORT's op lets Y follow Scale's dtype; ONNX's wants one T). Then the op is ONNX's, which the
  checker accepts and the rules understand. Otherwise it stays ORT's op (next point).
* **ORT's contrib ops in the ONNX domain** (:data:`ORT_ONNX_DOMAIN_OPS`, read from ORT's
  ``cpu_contrib_kernels.cc``: SimplifiedLayerNormalization, LayerNormalization below 17 and the old
  experimental ops) are left as they are, since ORT runs them there and nowhere else
  (SimplifiedLayerNormalization has no com.microsoft kernel). :func:`validity_problem` checks a model as
  ORT reads it: such nodes are checked as contrib ops (domain ``com.microsoft`` during the check only),
  and main-graph inputs and outputs with a dtype but no shape as of any shape (an empty shape during
  the check only). The output then fails ``onnx.checker`` exactly as the input did, and loads wherever
  the input loads. The LayerNorm rules leave ORT's LayerNormalization alone where X and Scale differ in
  dtype (``layernorm_pattern.match_standard``): the fused ops take one type.

Not repaired: a value produced by two nodes (ORT's ``gpt2_past.onnx`` has two Constants writing
``284``, 12 and 2): which one a reader sees is ORT's implementation detail, not the model's meaning.
Sorting goes further than ORT in one place: ORT refuses an unsorted If/Loop/Scan body, which is sorted
here like the main graph.

Anything else the checker refuses is still refused with its one line; so is anything ORT cannot run.
"""

from __future__ import annotations

import contextlib
import heapq

import onnx

#: ORT's CPU kernels registered in the ONNX domain for ops ONNX has no schema for at those opsets:
#: op -> (first, last) default-domain opset the kernel covers (None: no end). ORT's
#: ``onnxruntime/contrib_ops/cpu/cpu_contrib_kernels.cc``.
ORT_ONNX_DOMAIN_OPS = {
    "LayerNormalization": (1, 16),
    "SimplifiedLayerNormalization": (1, None),
    "Affine": (1, None),
    "Crop": (1, None),
    "DynamicSlice": (1, None),
    "ImageScaler": (1, None),
    "MeanVarianceNormalization": (1, 8),
    "ParametricSoftplus": (1, None),
    "ScaledTanh": (1, None),
    "ThresholdedRelu": (1, 9),
    "Scale": (1, None),
}

#: Domains of ORT's contrib ops, each with its one opset version.
ORT_DOMAINS = {"com.microsoft": 1, "com.microsoft.nchwc": 1, "com.microsoft.experimental": 1}
#: ONNX's own domains: a missing import gets the newest version of the schemas used.
ONNX_DOMAINS = ("", "ai.onnx.ml", "ai.onnx.preview.training", "ai.onnx.training")
#: Metadata key of the output model naming what was repaired (the report's note says the same).
METADATA_KEY = "onnxfuse.repaired"
#: The opset from which LayerNormalization is an ONNX op.
LAYERNORM_OPSET = 17


def repaired(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``(model, [])`` when ``onnx.checker`` accepts ``model``; else a repaired copy and what was repaired
    (short phrases, possibly none when nothing applied). ``model`` itself is never modified. Whether the
    result is acceptable is :func:`validity_problem`'s to say."""
    # import cycle (importing onnxfuse.model_io imports this module); also loads graphsurgeon
    from onnxfuse import model_io

    if model_io.validity_problem(model) is None:
        return model, []
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy, repair_model(copy)


def repair_model(model: onnx.ModelProto) -> list[str]:
    """Apply every repair in place (order matters: inference needs sorted nodes and the opset raised);
    return what was repaired."""
    done = [_opset_imports(model), _sort_nodes(model), _initializer_inputs(model), _layernorm_opset(model),
            _declared_types(model)]
    kept = ort_onnx_domain_ops(model)
    if kept:  # not a change: said so the user knows why the output fails onnx.checker as the input does
        done.append(f"ONNX Runtime's ONNX-domain op kept as ORT runs it ({', '.join(kept)}: onnx.checker "
                    "has no schema for it, so the output fails the checker as the input does)")
    return [d for d in done if d]


def note(repairs: list[str]) -> str:
    """The one note line for a report."""
    return ("the input was repaired as ONNX Runtime reads it, before any rule (onnx.checker refused it; "
            "the repairs change no value): " + "; ".join(repairs))


def validity_problem(model: onnx.ModelProto) -> str | None:
    """``onnx.checker``'s one-line complaint about ``model`` read as ONNX Runtime reads it (None when
    valid): ORT's contrib ops in the ONNX domain are checked as contrib ops (:func:`read_as_ort`)."""
    # import cycle (importing onnxfuse.model_io imports this module); also loads graphsurgeon
    from onnxfuse import model_io

    with read_as_ort(model):
        return model_io.validity_problem(model)


@contextlib.contextmanager
def read_as_ort(model: onnx.ModelProto):
    """For the block, ``model`` as ONNX's checker and type inference can read what ONNX Runtime runs: ORT's
    contrib ops in the ONNX domain (``SimplifiedLayerNormalization``, as onnxruntime-genai's builder writes
    it) moved to com.microsoft, which ONNX has no schemas for and leaves alone, and graph inputs and outputs
    without a shape given an empty one (the checker wants the field; ORT reads its absence as "any shape").
    Restored after, in place: no copy of the weights."""
    # import cycle (importing onnxfuse.model_io imports this module); also loads graphsurgeon
    from onnxfuse import model_io

    opset = default_opset(model)
    moved = [n for g in model_io.proto_graphs(model.graph) for n in g.node if _ort_onnx_domain_op(n, opset)]
    shapeless = [v.type.tensor_type for v in list(model.graph.input) + list(model.graph.output)
                 if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type
                 and not v.type.tensor_type.HasField("shape")]
    added = None
    if moved and "com.microsoft" not in {o.domain for o in model.opset_import}:
        added = model.opset_import.add(domain="com.microsoft", version=1)
    try:
        for n in moved:
            n.domain = "com.microsoft"
        for t in shapeless:
            t.shape.SetInParent()
        yield model
    finally:
        for n in moved:
            n.domain = ""
        for t in shapeless:
            t.ClearField("shape")
        if added is not None:
            model.opset_import.remove(added)


def ort_onnx_domain_ops(model: onnx.ModelProto) -> list[str]:
    """Names of the ORT-only ONNX-domain ops ``model`` uses (sorted)."""
    # import cycle (importing onnxfuse.model_io imports this module); also loads graphsurgeon
    from onnxfuse import model_io

    opset = default_opset(model)
    return sorted({n.op_type for g in model_io.proto_graphs(model.graph) for n in g.node
                   if _ort_onnx_domain_op(n, opset)})


# ---------------------------------------------------------------------------------------------------


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain (ONNX) opset version, 0 when it imports none."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _has_schema(op: str, opset: int, domain: str = "") -> bool:
    try:
        onnx.defs.get_schema(op, opset, domain)
        return True
    except onnx.defs.SchemaError:
        return False


def _ort_onnx_domain_op(node: onnx.NodeProto, opset: int) -> bool:
    span = ORT_ONNX_DOMAIN_OPS.get(node.op_type)
    if node.domain not in ("", "ai.onnx") or span is None:
        return False
    first, last = span
    return first <= opset and (last is None or opset <= last) and not _has_schema(node.op_type, opset)


def _opset_imports(model: onnx.ModelProto) -> str | None:
    # import cycle (importing onnxfuse.model_io imports this module); also loads graphsurgeon
    from onnxfuse import model_io

    used: dict[str, set[str]] = {}
    for g in model_io.proto_graphs(model.graph):
        for n in g.node:
            used.setdefault("" if n.domain == "ai.onnx" else n.domain, set()).add(n.op_type)
    known = {"" if o.domain == "ai.onnx" else o.domain for o in model.opset_import}
    added = []
    for domain in sorted(set(used) - known):
        version = ORT_DOMAINS.get(domain)
        if version is None and domain in ONNX_DOMAINS:
            versions = [onnx.defs.get_schema(op, domain).since_version for op in used[domain]
                        if _has_schema(op, onnx.defs.onnx_opset_version() + 100, domain)]
            version = max(versions, default=None)
        if version is not None:
            model.opset_import.append(onnx.helper.make_opsetid(domain, version))
            added.append(f"{domain or 'ai.onnx'} {version}")
    return f"opset import added ({', '.join(added)})" if added else None


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read that they do not define (outer-scope values)."""
    from onnxfuse import model_io  # import cycle: model_io repairs at load

    return {name for body in model_io.node_subgraphs(node) for name in model_io.free_names(body)}


def _sort_graph(g: onnx.GraphProto) -> bool:
    """Stable topological sort of ``g``'s nodes in place; True when the order changed. Values no node of
    ``g`` produces (inputs, initializers, outer scope) count as available."""
    produced: dict[str, int] = {}
    for i, n in enumerate(g.node):
        for o in n.output:
            if o:
                produced.setdefault(o, i)
    needs = []
    for i, n in enumerate(g.node):
        reads = set(n.input) | _subgraph_reads(n)
        needs.append({produced[r] for r in reads if r in produced and produced[r] != i})
    readers: dict[int, list[int]] = {}
    for i, deps in enumerate(needs):
        for d in deps:
            readers.setdefault(d, []).append(i)
    waiting = [len(d) for d in needs]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for r in readers.get(i, ()):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(g.node) or order == list(range(len(g.node))):
        return False  # a cycle (left for the checker to refuse), or already sorted
    nodes = [g.node[i] for i in order]
    copies = []
    for n in nodes:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        copies.append(c)
    del g.node[:]
    g.node.extend(copies)
    return True


def _sort_nodes(model: onnx.ModelProto) -> str | None:
    # import cycle (importing onnxfuse.model_io imports this module); also loads graphsurgeon
    from onnxfuse import model_io

    changed = sum(_sort_graph(g) for g in list(model_io.proto_graphs(model.graph)))
    return ("nodes sorted topologically" + (f" ({changed} graphs)" if changed > 1 else "")) if changed else None


def _initializer_inputs(model: onnx.ModelProto) -> str | None:
    # import cycle (importing onnxfuse.model_io imports this module); also loads graphsurgeon
    from onnxfuse import model_io

    if model.ir_version >= model_io.OVERRIDABLE_IR_VERSION:
        return None
    listed = {v.name for v in model.graph.input}
    missing = [t for t in model.graph.initializer if t.name not in listed]
    for t in missing:
        model.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return f"initializers listed as graph inputs ({len(missing)}, IR version {model.ir_version})" if missing else None


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types of the model's values, ORT's normalizations read as Identity (Y typed as X): sound
    for judging whether every LayerNormalization has one dtype, since the first one (in order) that
    does not is seen with correct types upstream of it."""
    inferred = _inferred(_with_identity_stand_ins(model))
    types = {}
    for g in (inferred.graph, model.graph):
        for v in list(g.input) + list(g.value_info) + list(g.output):
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                types.setdefault(v.name, v.type.tensor_type.elem_type)
        for t in g.initializer:
            types.setdefault(t.name, t.data_type)
    return types


def _layernorm_opset(model: onnx.ModelProto) -> str | None:
    # import cycle (importing onnxfuse.model_io imports this module); also loads graphsurgeon
    from onnxfuse import model_io
    # import cycle (importing onnxfuse.rewrites.engine.opset imports this module); also loads graphsurgeon
    from onnxfuse.rewrites.engine.opset import ops_changed_by_raise

    opset = default_opset(model)
    if not 0 < opset < LAYERNORM_OPSET:
        return None
    graphs = list(model_io.proto_graphs(model.graph))
    norms = [n for g in graphs for n in g.node if n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx")]
    if not norms:
        return None
    others = {n.op_type for g in graphs for n in g.node if n.domain in ("", "ai.onnx")} - {"LayerNormalization"}
    if ops_changed_by_raise(others, opset, LAYERNORM_OPSET):
        return None
    types = _elem_types(model)
    for n in norms:
        dtypes = {types.get(i) for i in list(n.input)[:3] if i}
        if len(dtypes) != 1 or None in dtypes:
            return None
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = LAYERNORM_OPSET
    return f"opset raised to {LAYERNORM_OPSET} for LayerNormalization (from {opset}: ONNX Runtime's op below 17 is ONNX's)"


def _inferred(model: onnx.ModelProto) -> onnx.ModelProto:
    # import cycle (importing onnxfuse.model_io imports this module); also loads graphsurgeon
    from onnxfuse import model_io

    return model_io.infer_shapes(model)


def _declared_types(model: onnx.ModelProto) -> str | None:
    def incomplete(v: onnx.ValueInfoProto) -> bool:
        if not v.HasField("type"):
            return True
        return v.type.HasField("tensor_type") and (not v.type.tensor_type.elem_type
                                                   or not v.type.tensor_type.HasField("shape"))

    values = [v for v in list(model.graph.input) + list(model.graph.output) if incomplete(v)]
    if not values:
        return None
    inferred = _inferred(_with_identity_stand_ins(model))
    mixed = _mixed_norms(model, inferred)
    if mixed:  # Y follows Scale's dtype there, not X's: no stand-in for those
        inferred = _inferred(_with_identity_stand_ins(model, skip=mixed))
    known = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)
             if not incomplete(v)}
    typed = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)
             if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    fixed = []
    for v in values:
        if v.name in known:
            v.type.CopyFrom(known[v.name].type)
            fixed.append(v.name)
        elif v.name in typed and not (v.HasField("type") and v.type.tensor_type.elem_type):
            v.type.CopyFrom(typed[v.name].type)  # a dtype only: the shape stays unknown, as ORT reads it
            fixed.append(f"{v.name}: dtype only")
    return f"output types declared from shape inference ({', '.join(fixed)})" if fixed else None


#: Contrib ops whose listed outputs have input 0's type and shape (ORT's schemas: one type T for input
#: and output; bias and skip broadcast over input 0). Read as Identity for inference only.
_SAME_AS_INPUT = {"FastGelu": (0,), "BiasGelu": (0,), "Gelu": (0,), "QuickGelu": (0,),
                  "SkipLayerNormalization": (0, 3), "SkipSimplifiedLayerNormalization": (0, 3)}


#: ORT's normalizations in the ONNX domain: Y has X's shape and Scale's dtype.
_NORMS = {"LayerNormalization": (0,), "SimplifiedLayerNormalization": (0,)}


def _stand_in(n: onnx.NodeProto, opset: int):
    if n.domain == "com.microsoft":
        return _SAME_AS_INPUT.get(n.op_type)
    return _NORMS.get(n.op_type) if _ort_onnx_domain_op(n, opset) else None


def _mixed_norms(model: onnx.ModelProto, inferred: onnx.ModelProto) -> set[str]:
    """Output names of ORT's ONNX-domain normalizations whose X and Scale dtypes differ (or are unknown)."""
    opset = default_opset(model)
    types = {}
    for v in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        types[v.name] = v.type.tensor_type.elem_type
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return {n.output[0] for n in model.graph.node
            if n.op_type in _NORMS and _ort_onnx_domain_op(n, opset) and len(n.input) > 1
            and (not types.get(n.input[0]) or types.get(n.input[0]) != types.get(n.input[1]))}


def _with_identity_stand_ins(model: onnx.ModelProto, skip=frozenset()) -> onnx.ModelProto:
    """A copy of ``model`` for shape inference only, where the contrib ops of :data:`_SAME_AS_INPUT` and
    ORT's ONNX-domain normalizations (whose other outputs nothing reads; not those whose output 0 is in
    ``skip``) are ``Identity`` nodes: ONNX has no schema for them, and without a stand-in every type
    after the first one is lost (ORT's GPT-2 test models end so)."""
    work = onnx.ModelProto()
    work.CopyFrom(model)
    g = work.graph
    opset = default_opset(model)
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    nodes = []
    for n in g.node:
        kept = _stand_in(n, opset) if n.output and n.output[0] not in skip else None
        if kept and n.input and all(i in kept or not o or o not in read for i, o in enumerate(n.output)):
            nodes.extend(onnx.helper.make_node("Identity", [n.input[0]], [n.output[i]])
                         for i in kept if i < len(n.output) and n.output[i])
        else:
            nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    return work
