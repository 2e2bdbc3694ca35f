"""A Concat of FusedElementwise results becomes one ``FusedConcat`` node that writes each result into its
slice of the concatenation (target ``cuda``).

Why
---
On the zoo's YOLO-style detector (CSP/C2f blocks: a Concat of SiLU results, then a 1x1 Conv), at batch 16
in float32 on an H200, ONNX Runtime's Concat kernels take 0.48 ms of our output's 5.14 ms of kernels
(docs/benchmarks.md 5.27), and torch.compile (inductor) stays 5-6% ahead of our output (4.650 against
4.915 ms and 4.575 against 4.842 ms, docs/benchmarks.md 5.61) because its pointwise kernels write into the
concatenation's buffer instead (``triton_poi_fused_add_cat_silu_split``). A Concat of FusedElementwise
results costs a read and a write of everything it concatenates; writing each result into its slice costs
nothing more than writing it. Measured with the rule (H200, batch 16, docs/benchmarks.md 5.65): the
detector 2-4% faster in float32 and float16 (4.787/4.852 against 4.891/5.033 ms in float32), less than the
Concats' whole time because each C2f block's first part is read by the bottlenecks that feed the same
Concat and so stays a copy (below).

What
----
The op's contract is in :mod:`onnxfuse.custom_ops` (``CONCAT_OP_TYPE``): programs ``program_0`` ..
``program_{K-1}``, one per *segment*, and a non-negative ``axis``; output 0 is the concatenation of the
segments' output 0, then each segment's outputs 1.. as tensors of their own. Every input of a
default-domain ``Concat`` that reads at least one ``FusedElementwise`` output of its own graph (main graph
or an If/Loop/Scan body, each on its own as fuse-elementwise does) becomes one segment, in order:

* *absorbed*: the output ``t`` of a FusedElementwise node ``F`` of the same graph. ``F`` is removed and its
  program becomes the segment's, its outputs reordered so that ``t`` is output 0. Every other output of
  ``F`` that something besides this Concat reads (or that is a graph output) stays an output of the new
  node under its own name, in ``F``'s order; ``t`` itself too when something else reads it (the program
  then lists it twice: once for the slice, once as its own tensor).
* *repeat*: a second input written by an ``F`` already absorbed by an earlier segment (the same tensor
  twice, or another output of ``F``): the segment runs ``F``'s program again over the same inputs, that
  output alone. A copy would read a tensor the new node writes itself (or no longer writes at all): a
  cycle.
* *copy*: anything else (a graph input, an initializer, another op's output, a FusedElementwise of an
  enclosing graph, or one that cannot be absorbed, below): a program of one ``Identity``.

An ``F`` whose outputs reach the Concat again through another node (an SPPF block's MaxPools, a C2f
bottleneck's next Conv) cannot be absorbed: the new node would read what it writes. It becomes a copy
segment, named in the report's ``kept``; the rule refuses when no segment is left to absorb. Any one ``F``
is enough to save the Concat's read and write of that segment, so the others need not be absorbed too.

The new node is named after the Concat, takes its place in the graph (which is sorted topologically again:
a reader of ``F``'s other outputs may have sat between ``F`` and the Concat), writes the Concat's output
tensor first and then the extra outputs in segment order.

Refused, each with its reason: the Concat has one input (nothing to save); no input is a FusedElementwise
output of its graph that can be absorbed; an input's rank is unknown, ranks differ or exceed the library's
:data:`~onnxfuse.custom_ops.MAX_RANK`; the axis is out of range; an absorbed output's dtype or shape is
unknown; the dtypes differ or one is not in the program language; a copied tensor is computed from a
Loop/Scan/If output (ONNX Runtime may not know its rank, and hands a custom op an unknown shape as a
scalar's: ``regions.runtime_shape_unknown``, the walk fuse-elementwise's region analysis makes); a
program would exceed what one CUDA kernel takes (:data:`MAX_PROGRAM_INPUTS` inputs, :data:`MAX_PROGRAM_OUTPUTS` outputs, and the rank within the dimensions
one launch of its placed kernel takes, :func:`placed_kernel_dims`: 16 up to 28 inputs, 9 at 48).

Exact: every segment computes what the FusedElementwise node computed (the same program, its outputs in
another order) or copies its input.

``onnxfuse.fused_values`` (``custom_ops.FUSED_VALUES_KEY``, the tensors each FusedElementwise node
computes internally, for ``diff --intermediates``): an absorbed node's entry is dropped, since the node is
gone (the report's ``absorbed_nodes``, read by ``pipeline._stamp``). Its values stay computed inside the
FusedConcat, where ``expose_fused_values`` (FusedElementwise only) does not look.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx_graphsurgeon as gs

from onnxfuse.custom_ops import (
    CONCAT_AXIS_ATTR, CONCAT_OP_TYPE, DOMAIN, MAX_RANK, OP_TYPE, PROGRAM_ATTR, concat_program_attr,
)
from onnxfuse.rewrites.elementwise.regions import runtime_shape_unknown
from onnxfuse.rewrites.engine.edit import fresh_name
from onnxfuse.rewrites.engine.rule import Plan, Refuse, Rule, unnamed_label
from onnxfuse.rewrites.facts.graph import (
    dtype_of, graphs_within, is_alive, is_graph_output, is_op, shape_of,
)
from onnxfuse.rewrites.facts.scopes import Scope

#: What one CUDA kernel takes, as custom_ops/csrc/cuda_codegen.h says (``kCudaMaxInputs``, ``kCudaMaxOutputs``,
#: ``kCudaParamBytes``, ``kPlacedParamSlots``; a test checks they agree); each segment's program is one kernel,
#: a *placed* one (it stores output 0 into its slice: three more 8-byte fields in its parameter block).
MAX_PROGRAM_INPUTS = 48
MAX_PROGRAM_OUTPUTS = 64
KERNEL_PARAM_BYTES = 4096
PLACED_PARAM_SLOTS = 3


def placed_kernel_dims(n_inputs: int, n_outputs: int) -> int:
    """The dimensions one launch of a placed kernel takes (``cuda_max_dims(nin, nout + kPlacedParamSlots)``:
    dims[] and strides[nin][] must fit in the parameter block). A FusedElementwise kernel with more merged
    dims launches once per outer coordinate; a placed one cannot, and the library counts on this rule to
    keep every segment within it (``CudaKernel::launch``)."""
    fixed = 8 * (n_inputs + n_outputs + PLACED_PARAM_SLOTS) + 24
    return max(0, min(MAX_RANK, (KERNEL_PARAM_BYTES - fixed) // (8 * (n_inputs + 1))))


def _expr():
    # start-up: the command line starts (and --help runs) without onnxfuse.custom_ops.expr
    from onnxfuse.custom_ops import expr

    return expr


def _is_fused(node) -> bool:
    return node is not None and node.op == OP_TYPE and node.domain == DOMAIN


def _label(node) -> str:
    return repr(node.name) if node.name else unnamed_label(node.op, node.outputs[0].name if node.outputs else "")


def _program(node):
    """The parsed program of the FusedElementwise ``node``, or the Refuse saying why it cannot be used."""
    expr = _expr()
    text = node.attrs.get(PROGRAM_ATTR)
    if text is None:
        return Refuse(f"FusedElementwise {_label(node)} has no program", node)
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    try:
        program = expr.parse(text)
    except expr.ProgramError as exc:
        return Refuse(f"the program of FusedElementwise {_label(node)} does not parse: {exc.problem}", node)
    if len(program.outputs) != len(node.outputs) or len(program.inputs) != len(node.inputs):
        return Refuse(f"FusedElementwise {_label(node)}'s inputs or outputs are not its program's", node)
    return program


def _with_outputs(program, outputs):
    """``program`` computing ``outputs`` (value names, a name may repeat) in that order, without the
    operations and constants none of them needs. Every input stays: each takes part in the broadcast shape."""
    expr = _expr()
    needed = set(outputs)
    for op in reversed(program.ops):
        if op.name in needed:
            needed.update(op.args)
    body = [op for op in program.ops if op.name in needed]
    consts = [c for c in program.consts if c.name in needed]
    return expr.Program(program.version, program.inputs, consts, body, list(outputs)).validate()


def _identity_program(dtype: str):
    expr = _expr()
    b = expr.ProgramBuilder()
    b.output(b.op("Identity", [b.input(dtype)]))
    return b.build()


def _read_elsewhere(graph, tensor, concat) -> bool:
    """``tensor`` is a graph output or is read by a node other than ``concat`` (a reader in a body too)."""
    return is_graph_output(graph, tensor) or any(r is not concat for r in tensor.outputs)


def _way_back(scope: Scope, fused, concat):
    """The first node of a path from ``fused``'s outputs back to ``concat`` through another node (absorbing
    ``fused`` would then make the new node read what it writes), or None. A reader inside a body counts as
    the node of this graph holding it."""
    stack = []
    for out in fused.outputs:
        for reader in out.outputs:
            holder = scope.holder(reader)
            if holder is not None and holder is not concat:
                stack.append((holder, holder))
    seen: set[int] = set()
    while stack:
        node, first = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for out in node.outputs:
            for reader in out.outputs:
                holder = scope.holder(reader)
                if holder is concat:
                    return first
                if holder is not None and id(holder) not in seen:
                    stack.append((holder, first))
    return None


@dataclass
class _Segment:
    """One Concat input as a program. ``kind``: ``absorbed`` (``node``'s program, ``node`` removed),
    ``repeat`` (the program of a node an earlier segment absorbed, for another of its outputs) or ``copy``.
    ``extras``: the tensors the segment writes besides its slice, in program output order from 1."""

    kind: str
    tensor: Any
    inputs: list
    program: Any = None
    extras: list = field(default_factory=list)
    node: Any = None
    whole: Any = None  # absorbed: the node's program as it was (a repeat segment starts from it)


def _dtype_name(graph, tensor):
    """``tensor``'s program dtype name, None when unknown, or a Refuse for a dtype the language lacks."""
    expr = _expr()
    dt = dtype_of(graph, tensor)
    if dt is None:
        return None
    try:
        return expr.dtype_from_numpy(dt)
    except ValueError:
        return Refuse(f"input {tensor.name!r} has dtype {dt}, which the program language does not have")


def _plan(graph, concat) -> dict[str, Any] | Refuse:
    """``concat``'s segments and what the new node needs, or why it is refused."""
    inputs = list(concat.inputs)
    if len(inputs) < 2:
        return Refuse("the Concat has a single input: nothing to save")
    if "axis" not in concat.attrs:
        return Refuse("the Concat's axis is not known")
    scope = Scope(graph)
    producers = [scope.producer(t) for t in inputs]
    if not any(_is_fused(p) for p in producers):
        return Refuse("no input is a FusedElementwise output of this graph")
    for p in producers:
        if _is_fused(p) and any(t is concat.outputs[0] for t in p.inputs):
            return Refuse(f"FusedElementwise {_label(p)} reads the Concat's own output (a cycle)", p)

    ranks = []
    for t, p in zip(inputs, producers):
        shape = shape_of(graph, t)
        if shape is None:
            if _is_fused(p):
                return Refuse(f"the shape of {t.name!r}, an output of FusedElementwise {_label(p)}, is not known", p)
            return Refuse(f"the rank of input {t.name!r} is not known")
        ranks.append(len(shape))
    if len(set(ranks)) != 1:
        return Refuse(f"the inputs' ranks differ ({', '.join(str(r) for r in ranks)})")
    rank = ranks[0]
    if rank > MAX_RANK:
        return Refuse(f"rank {rank} exceeds the library's limit of {MAX_RANK}")
    axis = int(concat.attrs["axis"])
    if not -rank <= axis < rank:
        return Refuse(f"axis {axis} is out of range for rank {rank}")

    programs: dict[int, Any] = {}  # id(F) -> its program, or the Refuse saying why F stays
    kept: list[dict[str, str]] = []  # the FusedElementwise nodes left in the graph, and why
    absorbed: dict[int, _Segment] = {}
    segments: list[_Segment] = []
    dtypes: list[str | None] = []
    memo: dict[str, bool] = {}  # runtime_shape_unknown's answers
    for t, p in zip(inputs, producers):
        fused = _is_fused(p)
        if fused and id(p) in absorbed:  # another output of an absorbed node, or the same tensor again
            first = absorbed[id(p)]
            index = next(j for j, o in enumerate(p.outputs) if o is t)
            segments.append(_Segment("repeat", t, list(first.inputs),
                                     _with_outputs(first.whole, [first.whole.outputs[index]])))
            dtypes.append(first.whole.output_dtypes()[index])
            continue
        if fused and id(p) not in programs:
            program = _program(p)
            if not isinstance(program, Refuse):
                back = _way_back(scope, p, concat)
                if back is not None:
                    program = Refuse(f"the outputs of FusedElementwise {_label(p)} reach the Concat again through "
                                     f"{back.op} {_label(back)}: absorbing it would make a cycle", p)
            programs[id(p)] = program
            if isinstance(program, Refuse):
                kept.append({"node": p.name, "reason": program.reason})
        program = programs[id(p)] if fused else None
        if program is not None and not isinstance(program, Refuse):
            index = next(j for j, o in enumerate(p.outputs) if o is t)
            # t first (the slice), then every output of F something else still reads, in F's order (t too,
            # where something else reads it).
            extras = [j for j, o in enumerate(p.outputs) if _read_elsewhere(graph, o, concat)]
            order = [program.outputs[index]] + [program.outputs[j] for j in extras]
            seg = _Segment("absorbed", t, list(p.inputs), _with_outputs(program, order),
                           [p.outputs[j] for j in extras], p, program)
            absorbed[id(p)] = seg
            segments.append(seg)
            dtypes.append(program.output_dtypes()[index])
            continue
        name = _dtype_name(graph, t)
        if isinstance(name, Refuse):
            return name
        if runtime_shape_unknown(t, memo):
            return Refuse(f"input {t.name!r} is computed from a Loop, Scan or If output, whose shape ONNX Runtime "
                          "may not know")
        segments.append(_Segment("copy", t, [t]))
        dtypes.append(name)
    if not absorbed:
        return Refuse(f"no FusedElementwise can be absorbed: {kept[0]['reason']}")

    out_dtype = _dtype_name(graph, concat.outputs[0])
    if isinstance(out_dtype, Refuse):  # the inputs' dtypes decide; one outside the language has refused
        out_dtype = None
    known = {d for d in dtypes + [out_dtype] if d is not None}
    if len(known) != 1:
        return Refuse(f"the dtypes differ ({', '.join(sorted(known))})")
    dtype = known.pop()
    for k, seg in enumerate(segments):
        if seg.kind == "copy":
            seg.program = _identity_program(dtype)
        n_in, n_out = len(seg.program.inputs), len(seg.program.outputs)
        if n_in > MAX_PROGRAM_INPUTS or n_out > MAX_PROGRAM_OUTPUTS:
            return Refuse(f"segment {k}'s program would have {n_in} inputs and {n_out} outputs; one CUDA kernel "
                          f"takes at most {MAX_PROGRAM_INPUTS} and {MAX_PROGRAM_OUTPUTS}")
        if rank > placed_kernel_dims(n_in, n_out):  # merged dims are at most the rank
            return Refuse(f"segment {k}'s program ({n_in} inputs, {n_out} outputs) takes at most "
                          f"{placed_kernel_dims(n_in, n_out)} dimensions in one CUDA launch; the rank is {rank}")
    return {"segments": segments, "axis": axis % rank, "dtype": dtype, "kept": kept}


class ConcatIntoElementwise(Rule):
    """Replace a Concat of FusedElementwise results (and other tensors) by one FusedConcat node that
    computes each result into its slice (module docstring)."""

    name = "concat-into-elementwise"
    description = "A Concat of FusedElementwise results becomes one FusedConcat writing each result into its slice"
    targets = frozenset({"cuda"})

    def match(self, graph):
        found = []
        for g in graphs_within(graph):
            scope = None
            for node in g.nodes:
                if not is_op(node, "Concat"):
                    continue
                scope = scope or Scope(g)
                if any(_is_fused(scope.producer(t)) for t in node.inputs):
                    found.append((node, g))
        return found

    def check(self, graph, match):
        concat, g = match
        if not is_alive(concat):
            return Refuse("the Concat changed during this pass")
        found = _plan(g, concat)
        return found if isinstance(found, Refuse) else Plan(concat, (g, found))

    def rewrite(self, graph, plan: Plan):
        expr = _expr()
        concat, (g, found) = plan.anchor, plan.found
        segments: list[_Segment] = found["segments"]
        out = concat.outputs[0]
        taken = {n.name for sub in graphs_within(graph) for n in sub.nodes if n.name}
        name = fresh_name(taken, f"{concat.name or out.name}/{CONCAT_OP_TYPE}")
        if out.dtype is None:
            out.dtype = expr.numpy_dtype(found["dtype"])
        attrs: dict[str, Any] = {CONCAT_AXIS_ATTR: found["axis"]}
        for k, seg in enumerate(segments):
            attrs[concat_program_attr(k)] = expr.print_program(seg.program)
        inputs = [t for seg in segments for t in seg.inputs]
        outputs = [out] + [t for seg in segments for t in seg.extras]
        absorbed = [seg.node for seg in segments if seg.kind == "absorbed"]
        for node in [concat, *absorbed]:
            node.inputs.clear()
            node.outputs.clear()
        new = gs.Node(op=CONCAT_OP_TYPE, name=name, domain=DOMAIN, attrs=attrs, inputs=inputs,
                      outputs=outputs)
        g.nodes.insert(next(i for i, n in enumerate(g.nodes) if n is concat) + 1, new)
        # The new node writes the absorbed nodes' other outputs where the Concat was: a reader of them
        # may sit before it (one that does not lead to the Concat, which _way_back ruled out).
        g.toposort(recurse_subgraphs=False, recurse_functions=False)
        return {
            "node": name,
            "concat": concat.name or out.name,
            "axis": found["axis"],
            "segments": len(segments),
            "copies": sum(seg.kind == "copy" for seg in segments),
            "repeats": sum(seg.kind == "repeat" for seg in segments),
            "absorbed_nodes": [n.name for n in absorbed],  # their fused_values entries are dropped (pipeline._stamp)
            "outputs": [t.name for t in outputs],
            **({"kept": found["kept"]} if found["kept"] else {}),
        }
