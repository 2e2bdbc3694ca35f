"""Where a value comes from: which graph a node belongs to, and which graph defines a tensor.

ONNX subgraphs (If branches, Loop and Scan bodies) may read any value of an enclosing graph by name.
onnx-graphsurgeon shares one ``Tensor`` object between the graph that defines it and every subgraph
that reads it, so for a tensor seen from a subgraph, ``tensor.inputs[0]`` (its producer) may be a node
of an *outer* graph and ``tensor.outputs`` (its readers) may include nodes of *inner* graphs.

A rewrite of one graph must therefore never move, rewire or delete a node that belongs to another
graph, and must never make a graph's output a value that no node of that graph produces (ONNX:
"Graph output is not an output of any node in graph"). Exporters write exactly this for
``y = f(x) if c else x``: an ``If`` whose else branch is ``Identity`` of an outer value.

Used by cleanup's Identity removal, the one pass that rewires producers inside subgraphs.
fuse-elementwise keeps its own owner map (``_Analysis._top``, which maps subgraph nodes to the
top-level node holding them); folding the two together belongs to the rewrite-engine issue (13).
"""

from __future__ import annotations

import onnx_graphsurgeon as gs


class Scope:
    """The nodes one graph owns; membership is by object identity, O(1), built once per pass."""

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self._nodes = {id(n) for n in graph.nodes}

    def owns_node(self, node: gs.Node) -> bool:
        return id(node) in self._nodes

    def producer(self, tensor: gs.Tensor) -> gs.Node | None:
        """The node of *this graph* that writes ``tensor``; None for inputs, constants and values
        that come from an enclosing graph."""
        if len(tensor.inputs) == 1 and self.owns_node(tensor.inputs[0]):
            return tensor.inputs[0]
        return None
