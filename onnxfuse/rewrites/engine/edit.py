"""Edit helpers: fresh names, new constants, weights written copy-on-write, nodes replaced or bypassed.

* :func:`fresh_name` / :func:`unique_name` / :class:`NameAllocator` hand out unused tensor names.
* :func:`set_param` writes a new value for one input of one node. When the old tensor is read by that
  node alone, it is updated in place (its name is kept); when anything else reads it (weights shared by
  two convolutions, a Constant node's output, a graph output) the node gets a fresh *copy* and every
  other reader keeps the original. In a large model the new weight goes to the spill file at once.
* :func:`append_axes_op` writes a Squeeze, Unsqueeze or Reduce* with its axes as the graph's opset wants.
* :func:`bypass` makes one node write another's output; :func:`fuse` replaces a set of nodes by one
  node writing the last node's output tensor, so downstream names (graph outputs included) are kept.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.facts.graph import MS_DOMAIN, is_graph_output, opset_of


def _owned_by(graph, tensor, node) -> bool:
    """True when ``node`` is the only reader of the initializer ``tensor`` (so it may change in place)."""
    return (
        isinstance(tensor, gs.Constant)
        and len(tensor.outputs) == 1
        and tensor.outputs[0] is node
        and sum(1 for t in node.inputs if t is tensor) == 1
        and not is_graph_output(graph, tensor)
        and not any(t is tensor for t in graph.inputs)
    )


def fresh_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2`` … : the first name not in ``taken``, which then holds it."""
    name, i = base, 1
    while name in taken:
        name = f"{base}_{i}"
        i += 1
    taken.add(name)
    return name


def unique_name(graph, base: str) -> str:
    """``base``, or ``base_1``, ``base_2`` … : the first name no tensor of ``graph`` uses."""
    return fresh_name(set(graph.tensors().keys()), base)


class NameAllocator:
    """Hands out names no tensor and no node of ``graph`` uses, tracking the ones it gave (for several new
    tensors and nodes at once). Node names count too: ONNX requires them unique, and two rewrites of
    unnamed nodes would otherwise both name their new node after the same base."""

    def __init__(self, graph):
        self._graph = graph
        self._used: set[str] | None = None

    def __call__(self, base: str) -> str:
        if self._used is None:
            self._used = set(self._graph.tensors().keys()) | {n.name for n in self._graph.nodes if n.name}
        return fresh_name(self._used, base)


def set_param(graph, node, index: int, values: np.ndarray, role: str = "param") -> str:
    """Give ``node.inputs[index]`` the value ``values``, copy-on-write (see :func:`_place_param`).

    In a large model's graph the new weight goes to the spill file at once
    (:func:`onnxfuse.model_io.store_weight`), so folded weights do not pile up in memory until the
    export: the 2.25 GiB benchmark's rewrite peak was 1.47x its weights with all nine folded weights held,
    0.59x through this (docs/large-models.md).
    """
    # import cycle: importing onnxfuse.model_io imports this module
    from onnxfuse.model_io import store_weight

    mode = _place_param(graph, node, index, values, role)
    placed = node.inputs[index]
    placed.values = store_weight(graph, placed._values)
    return mode


def _place_param(graph, node, index: int, values: np.ndarray, role: str = "param") -> str:
    """Give ``node.inputs[index]`` the value ``values``, copy-on-write.

    Returns ``"in-place"`` (the initializer was read by ``node`` alone and keeps its name), ``"copy"`` (the
    old tensor is shared, a Constant node's output or a graph output: ``node`` now reads a new initializer
    named ``<old>_folded`` and every other reader keeps the original) or ``"new"`` (an absent optional input,
    such as a Conv bias or a Gemm C, was added; ``index`` may be ``len(node.inputs)``).
    """
    values = np.ascontiguousarray(values)
    old = node.inputs[index] if index < len(node.inputs) else None
    if old is not None and not old.is_empty() and _owned_by(graph, old, node):
        old.values = values
        return "in-place"
    if old is not None and not old.is_empty():
        base = f"{old.name}_folded"
    else:
        base = f"{node.name or node.op}_{role}"
    fresh = gs.Constant(unique_name(graph, base), values)
    if index < len(node.inputs):
        node.inputs[index] = fresh
    else:
        while len(node.inputs) < index:
            node.inputs.append(gs.Variable.empty())
        node.inputs.append(fresh)
    return "copy" if old is not None and not old.is_empty() else "new"


def replace_reads(old, new) -> None:
    """Make every node that reads ``old`` read ``new`` instead (subgraph nodes reading it as an outer value
    included: graphsurgeon lists them among ``old``'s readers)."""
    for node in list(old.outputs):
        for i, x in enumerate(node.inputs):
            if x is old:
                node.inputs[i] = new


def to_identity(node, source) -> None:
    """Make ``node`` an ``Identity`` of ``source``: its output keeps its name and readers, and cleanup then
    makes those readers read ``source`` directly (or keeps the Identity where the output is a graph output)."""
    node.op = "Identity"
    node.domain = ""
    node.attrs.clear()
    node.inputs.clear()
    node.inputs.append(source)


def bypass(graph, first, second) -> None:
    """Make ``first`` write ``second``'s output and disconnect ``second`` (cleanup removes it).

    Downstream tensor names, including graph outputs, are kept.
    """
    out = second.outputs[0]
    second.inputs.clear()
    second.outputs.clear()
    first.outputs[0] = out  # graphsurgeon's synchronized lists also detach the old tensor from ``first``


def fuse(graph, nodes, op: str, inputs, output, attrs=None, domain: str = MS_DOMAIN, name: str | None = None):
    """Replace ``nodes`` by one ``op`` node reading ``inputs`` and writing ``output`` (an existing tensor).

    The replaced nodes are disconnected; cleanup removes them. Returns the new node.
    """
    for n in nodes:
        n.outputs.clear()
    for n in nodes:
        n.inputs.clear()
    node = gs.Node(op=op, name=name, attrs=dict(attrs or {}), inputs=list(inputs), outputs=[output], domain=domain)
    graph.nodes.append(node)
    return node


def empty_input():
    return gs.Variable.empty()


def new_constant(graph, base: str, values: np.ndarray) -> gs.Constant:
    """A new initializer named after ``base`` (made unique in ``graph``)."""
    return gs.Constant(NameAllocator(graph)(base), np.ascontiguousarray(values))


#: The default-domain opset from which an op takes ``axes`` as an input instead of an attribute.
AXES_INPUT_SINCE = {"Squeeze": 13, "Unsqueeze": 13, "ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18,
                    "ReduceMin": 18, "ReduceProd": 18, "ReduceL1": 18, "ReduceL2": 18, "ReduceLogSum": 18,
                    "ReduceLogSumExp": 18, "ReduceSumSquare": 18}


def append_axes_op(graph, op: str, name: str, data, axes, output, attrs=None) -> gs.Node:
    """Append ``op(data)`` over ``axes`` writing ``output``: ``axes`` an attribute below
    :data:`AXES_INPUT_SINCE` ``[op]`` at the graph's opset, a constant int64 input from there on (the two
    spellings of the same op, so one call serves every opset)."""
    attrs = dict(attrs or {})
    axes = [int(a) for a in axes]
    if opset_of(graph) >= AXES_INPUT_SINCE[op]:
        inputs = [data, new_constant(graph, f"{name}/axes", np.array(axes, np.int64))]
    else:
        inputs, attrs["axes"] = [data], axes
    node = gs.Node(op, name, attrs, inputs=inputs, outputs=[output])
    graph.nodes.append(node)
    return node


def append_split(graph, base: str, data, sizes, outputs, names: "NameAllocator", axis: int = -1) -> gs.Node:
    """Append ``Split(data)`` along ``axis`` into parts of ``sizes`` writing ``outputs``, named
    ``base/Split`` (by ``names``): the sizes a constant int64 input ``base/sizes`` from opset 13, the
    ``split`` attribute below it (one call for every opset)."""
    sizes = [int(v) for v in sizes]
    if opset_of(graph) >= 13:
        node = gs.Node("Split", names(f"{base}/Split"), {"axis": axis},
                       inputs=[data, new_constant(graph, f"{base}/sizes", np.array(sizes, np.int64))], outputs=outputs)
    else:
        node = gs.Node("Split", names(f"{base}/Split"), {"axis": axis, "split": sizes}, inputs=[data], outputs=outputs)
    graph.nodes.append(node)
    return node
