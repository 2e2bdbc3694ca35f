"""Fuse connected regions of elementwise ops into one ``FusedElementwise`` node (target ``cuda``).

What it does
------------
Every op the FusedElementwise language can express (``onnxfuse.custom_ops.expr.OP_TABLE``, plus
lowerings: n-ary Sum/Min/Max/Mean become binary chains, Clip with constant bounds becomes
``Clip[min=, max=]``, PRelu becomes ``Where(Less(x, 0), Mul(x, slope), x)``) is a *fusible node*.
Maximal connected groups of fusible nodes become one node of domain ``ai.onnxfuse`` whose
``program`` attribute holds the computation as readable text (docs/program-language.md):

* the node's inputs are the region's inputs (in order of first use), including non-scalar constant
  tensors (initializers stay initializers);
* scalar constants (one element, and not raising the rank of the op that reads them) are written
  into the program as ``const`` lines, exactly (ProgramBuilder prints the shortest text that
  reads back to the same value);
* the node's outputs are the values the rest of the graph still needs: values read outside the
  region (also by nodes inside If/Loop bodies) and graph outputs. They keep their tensor objects,
  hence their names, so nothing is recomputed or lost. Intermediate values disappear.

The op's contract is that *every output has the broadcast shape of all node inputs*. So a value
that leaves the region must be provably that large. Shapes come from ONNX shape inference (plus a
small pass giving known shape-preserving com.microsoft ops the shape of their first input) merged
with our own symbolic broadcasting; a dimension is known (int), symbolic (``dim_param``, equal only
to the same name) or unknown. An input ``i`` fits an output ``v`` when ``i`` is an ancestor of
``v`` in the region (then it is part of ``v``'s broadcast) or when, dimension by dimension from the
right, ``i``'s dim is 1 or provably equal to ``v``'s, with ``rank(i) <= rank(v)``; scalars always fit.
Unknown shapes therefore only fuse when the proof goes through (e.g. all inputs share one symbolic
shape, or the others are per-channel constants of known shape).

Region algorithm: see :mod:`onnxfuse.rewrites.elementwise.partition` (greedy growth in topological order with
a contracted-graph cycle check, then splitting regions whose outputs break the shape contract).
Single-op regions are left alone (refusal "single op"): one fused node saves nothing.
Subgraphs (If branches, Loop/Scan bodies) are fused too, each on its own: a value a body reads
from an enclosing graph is a region input there and counts as read outside any region of the
enclosing graph; a body's outputs keep their names; regions never cross a graph boundary.
"""

from __future__ import annotations

from dataclasses import replace

import onnx_graphsurgeon as gs

from onnxfuse.rewrites.elementwise.regions import Region, RegionAnalysis, build_program
from onnxfuse.rewrites.engine.edit import fresh_name
from onnxfuse.rewrites.engine.rule import Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import graphs_within, is_alive


class FuseElementwiseRegions(Rule):
    """Replace each maximal connected region of elementwise ops by one FusedElementwise node.

    Region algorithm (details in :mod:`onnxfuse.rewrites.elementwise.partition`): nodes are visited in
    topological order; a fusible node joins the regions of its fusible producers unless that would
    create a cycle once regions are contracted, or would make a value that certainly leaves the
    region smaller than the region's broadcast shape. Then every region is checked with its final
    membership and split where an outgoing value could be smaller than the fused op's output shape
    (its contract: every output has the broadcast shape of all inputs). Regions of one op are
    refused ("single op"); every op that could not join a region is reported with a reason.
    """

    name = "fuse-elementwise"
    description = "Fuse connected regions of elementwise ops into one FusedElementwise node (ai.onnxfuse)"
    targets = frozenset({"cuda"})

    def match(self, graph):
        graphs = list(graphs_within(graph))
        node_names = {n.name for g in graphs for n in g.nodes}
        regions = []
        # Each body is analysed on its own: values it reads from an enclosing graph are region
        # inputs, its graph outputs are kept, and the fused node goes into the body.
        for g in graphs:
            analysis = RegionAnalysis(g)
            for r in analysis.regions():
                r.analysis, r.graph, r.node_names = analysis, g, node_names
                regions.append(r)
        return regions

    def anchor(self, match: Region):
        return match.nodes[0]

    def anchor_name(self, match) -> str:
        n = match.nodes[0]
        return n.name or n.op

    def check(self, graph, match: Region):
        if match.refusal:
            # A later pass over the same graph sees the ops refused earlier again (often with less
            # context, since their neighbours are fused by then): report each op once, the first time.
            return replace(match.refusal, once_per_anchor=True)
        if not all(is_alive(n) for n in match.nodes):
            return Refuse("region changed during this pass")
        try:
            program, values = build_program(match, match.analysis.dtype_of)
        except Exception as exc:  # ProgramError: a lowering bug, never a broken model
            return Refuse(f"program rejected: {getattr(exc, 'problem', exc)}")
        return Plan(match, (program, values))

    def rewrite(self, graph, plan: Plan):
        # start-up: the command line starts (and --help runs) without onnxfuse.custom_ops.expr
        from onnxfuse.custom_ops import expr

        match, (program, values) = plan.anchor, plan.found
        text = program.to_text()
        first = match.nodes[0].name or match.nodes[0].op
        name = fresh_name(match.node_names, f"{first}/FusedElementwise")
        dtypes = program.output_dtypes()
        kept = {id(t) for t in match.outputs}
        absorbed = [n.outputs[0].name for n in match.nodes if n.outputs and id(n.outputs[0]) not in kept]
        for node in match.nodes:
            node.inputs.clear()
            node.outputs.clear()
        for t, dt in zip(match.outputs, dtypes):
            t.dtype = expr.numpy_dtype(dt)
            shape = match.analysis.shapes.get(t.name)
            t.shape = list(shape) if shape is not None else None
        fused = gs.Node(op=expr.OP_TYPE, name=name, domain=expr.DOMAIN, attrs={"program": text},
                        inputs=list(match.inputs), outputs=list(match.outputs))
        (match.graph if match.graph is not None else graph).nodes.append(fused)
        return {
            "node": name,
            "ops": [n.name or n.op for n in match.nodes],
            "op_types": [n.op for n in match.nodes],
            "inputs": [t.name for t in match.inputs],
            "outputs": [t.name for t in match.outputs],
            "absorbed": absorbed,
            "values": {t: values[t] for t in absorbed if t in values},  # for diff --intermediates
            "program": text,
        }
