"""Cleanup passes that run before the first rule and after every rule pass.

* Identity removal: an Identity only renames a tensor, so readers can read its input directly.
  When its output is a graph output, the producer of its input is made to write the graph output
  instead (the graph output keeps its name); an Identity between a graph input or initializer and a
  graph output is kept, since that rename is the only thing producing the output.
* Dead nodes and unused initializers are removed (graph inputs are kept: they are the model's
  signature), and nodes are sorted topologically, all through onnx-graphsurgeon, subgraphs included.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs


def remove_identities(graph: gs.Graph) -> int:
    removed = 0
    outputs = {id(t) for t in graph.outputs}
    graph_inputs = {id(t) for t in graph.inputs}
    for node in list(graph.nodes):
        if node.op != "Identity" or len(node.inputs) != 1 or len(node.outputs) != 1:
            continue
        src, dst = node.inputs[0], node.outputs[0]
        if id(dst) in outputs:
            producer_owned = (
                len(src.inputs) == 1
                and id(src) not in outputs
                and id(src) not in graph_inputs
                and not isinstance(src, gs.Constant)
            )
            if not producer_owned:
                continue
            producer = src.inputs[0]
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


def cleanup(graph: gs.Graph) -> dict[str, int]:
    """Run every cleanup pass; return what each removed (for the report)."""
    before = len(graph.nodes)
    identities = remove_identities(graph)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    dead = before - identities - len(graph.nodes)
    return {"identity": identities, "dead-node": max(dead, 0)}
