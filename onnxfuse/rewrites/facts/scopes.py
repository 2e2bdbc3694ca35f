"""Where a value comes from: which graph a node belongs to, and which graph defines a tensor.

ONNX subgraphs (If branches, Loop and Scan bodies) may read any value of an enclosing graph by name.
onnx-graphsurgeon shares one ``Tensor`` object between the graph that defines it and every subgraph
that reads it, so for a tensor seen from a subgraph, ``tensor.inputs[0]`` (its producer) may be a node
of an *outer* graph and ``tensor.outputs`` (its readers) may include nodes of *inner* graphs.

A rewrite of one graph must therefore never move, rewire or delete a node that belongs to another
graph, and must never make a graph's output a value that no node of that graph produces (ONNX:
"Graph output is not an output of any node in graph"). Exporters write exactly this for
``y = f(x) if c else x``: an ``If`` whose else branch is ``Identity`` of an outer value.

Used by cleanup's Identity removal, the one pass that rewires producers inside subgraphs, and by the
elementwise region analysis, which treats a body's reader of a value as a reader in the graph whose
node holds the body (:meth:`Scope.holder`).
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxfuse.rewrites.facts.graph import graphs_within, subgraphs


class Scope:
    """The nodes one graph owns; membership is by object identity, O(1), built once per pass."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self._nodes = {id(n) for n in graph.nodes}
        self._holders: dict[int, gs.Node] | None = None  # id(node in a body) -> node of this graph holding it

    def owns_node(self, node: gs.Node) -> bool:
        return id(node) in self._nodes

    def producer(self, tensor: gs.Tensor) -> gs.Node | None:
        """The node of *this graph* that writes ``tensor``; None for inputs, constants and values
        that come from an enclosing graph."""
        if len(tensor.inputs) == 1 and self.owns_node(tensor.inputs[0]):
            return tensor.inputs[0]
        return None

    def holder(self, node: gs.Node) -> gs.Node | None:
        """The node of *this graph* that is ``node`` or holds it in a body (If/Loop/Scan, at any depth);
        None for a node of an enclosing or unrelated graph."""
        if id(node) in self._nodes:
            return node
        if self._holders is None:
            self._holders = {}
            for top in self.graph.nodes:
                for sub in subgraphs(top):
                    for g in graphs_within(sub):
                        for n in g.nodes:
                            self._holders[id(n)] = top
        return self._holders.get(id(node))
