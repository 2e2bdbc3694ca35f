"""Where a value comes from: which graph a node belongs to, and which graph defines a tensor.

ONNX subgraphs (If branches, Loop and Scan bodies) may read any value of an enclosing graph by name.
onnx-graphsurgeon shares one ``Tensor`` object between the graph that defines it and every subgraph
that reads it, so for a tensor seen from a subgraph, ``tensor.inputs[0]`` (its producer) may be a node
of an *outer* graph and ``tensor.outputs`` (its readers) may include nodes of *inner* graphs.

A rewrite of one graph must therefore never move, rewire or delete a node that belongs to another
graph, and must never make a graph's output a value that no node of that graph produces (ONNX:
"Graph output is not an output of any node in graph"). Exporters write exactly this for
``y = f(x) if c else x``: an ``If`` whose else branch is ``Identity`` of an outer value. Every rule
and cleanup asks this module, not ``tensor.inputs`` directly, when it needs "the producer *in this
graph*".
"""

from __future__ import annotations

import onnx_graphsurgeon as gs


class Scope:
    """The nodes and the values one graph owns (its inputs, its initializers and its nodes' outputs).

    Built once per graph and pass; membership tests are by object identity, O(1).
    """

    def __init__(self, graph: gs.Graph):
        self.graph = graph
        self._nodes = {id(n) for n in graph.nodes}
        self._values = {id(t) for t in graph.inputs}
        for node in graph.nodes:
            self._values.update(id(t) for t in node.outputs)

    def owns_node(self, node: gs.Node) -> bool:
        return id(node) in self._nodes

    def defines(self, tensor: gs.Tensor) -> bool:
        """True when ``tensor`` is this graph's input or a node output of this graph (constants are
        values of no particular graph: a ``gs.Constant`` is defined wherever it is read)."""
        return isinstance(tensor, gs.Constant) or id(tensor) in self._values

    def producer(self, tensor: gs.Tensor) -> gs.Node | None:
        """The node of *this graph* that writes ``tensor``; None for inputs, constants and values
        that come from an enclosing graph."""
        if len(tensor.inputs) == 1 and self.owns_node(tensor.inputs[0]):
            return tensor.inputs[0]
        return None

    def readers(self, tensor: gs.Tensor) -> list[gs.Node]:
        """The nodes of *this graph* that read ``tensor`` (readers in subgraphs are not included)."""
        return [n for n in tensor.outputs if self.owns_node(n)]

    def read_elsewhere(self, tensor: gs.Tensor) -> bool:
        """True when a node outside this graph (in a subgraph or an enclosing graph) reads ``tensor``."""
        return any(not self.owns_node(n) for n in tensor.outputs)
