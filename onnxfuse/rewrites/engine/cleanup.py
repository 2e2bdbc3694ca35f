"""Cleanup passes that run before the first rule and after every rule pass.

* Identity removal: an Identity only renames a tensor, so readers can read its input directly.
  When its output is a graph output, the producer of its input is made to write the graph output
  instead (the graph output keeps its name); an Identity between a graph input or initializer and a
  graph output is kept, since that rename is the only thing producing the output. So is an Identity
  whose input comes from an enclosing graph (``scopes``): the producer belongs to another graph and
  cannot be made to write this graph's output.
* Dead nodes and unused initializers are removed (graph inputs are kept: they are the model's
  signature), and nodes are sorted topologically, all through onnx-graphsurgeon, subgraphs included.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.facts import graphs_within
from onnxfuse.rewrites.engine.scopes import Scope


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
            # Readers of src now read dst; the producer writes dst directly.
            for consumer in list(src.outputs):
                if consumer is node:
                    continue
                for i, t in enumerate(consumer.inputs):
                    if t is src:
                        consumer.inputs[i] = dst
            producer.outputs[producer.outputs.index(src)] = dst
            node.inputs.clear()
            node.outputs.clear()
        else:
            for consumer in list(dst.outputs):
                for i, t in enumerate(consumer.inputs):
                    if t is dst:
                        consumer.inputs[i] = src
            node.inputs.clear()
            node.outputs.clear()
        removed += 1
    for node in graph.nodes:
        for attr in node.attrs.values():
            if isinstance(attr, gs.Graph):
                removed += remove_identities(attr)
    return removed


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
    identities = remove_identities(graph)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    forget_dead_readers(everything, graph)
    dead = before - identities - len(graph.nodes)
    return {"identity": identities, "dead-node": max(dead, 0)}
