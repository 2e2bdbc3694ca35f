"""Is the raw 2-D mask the gap to tx-opt? Rewrites an optimized model's ``Attention`` masks as ONNX
Runtime's transformers optimizer writes them: 1-D sequence lengths, ``ReduceSum(Cast(attention_mask,
int32), axes=[1])``, then lets ``onnxfuse bench`` time both.

A measurement tool only: a 1-D mask_index reads the mask as "the first n keys are kept", which is
wrong for any mask that is not right-padded (holes, left padding). onnxfuse writes it only under the
user's promise (``optimize --right-padded NAME``, rule contrib-mask-lengths), and then from the mask the
model computed, keeping its preparation chain; this tool reads ``attention_mask`` directly and so drops
that chain too, which is what its 3.7% measured (docs/benchmarks.md 5.9, 5.10).

    python3 benchmarks/mask_index_forms.py ours.onnx ours_lengths.onnx --mask-input attention_mask
    python3 -m onnxfuse bench ours.onnx ours_lengths.onnx --batch 16 --sessions 3
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
from onnx import helper, numpy_helper


def with_length_masks(model: onnx.ModelProto, mask_input: str) -> int:
    """Every ``Attention`` with a mask_index reads the 1-D lengths instead; returns how many."""
    graph = model.graph
    axes = numpy_helper.from_array(np.array([1], np.int64), "lengths_axes")
    graph.initializer.append(axes)
    graph.node.extend([
        helper.make_node("Cast", [mask_input], ["mask_int32_for_lengths"], to=onnx.TensorProto.INT32),
        helper.make_node("ReduceSum", ["mask_int32_for_lengths", "lengths_axes"], ["mask_lengths"], keepdims=0),
    ])
    changed = 0
    for node in graph.node:
        if node.op_type == "Attention" and len(node.input) > 3 and node.input[3]:
            node.input[3] = "mask_lengths"
            kept = [a for a in node.attribute if a.name != "mask_filter_value"]
            del node.attribute[:]
            node.attribute.extend(kept)
            changed += 1
    # topological order: the two new nodes read only a graph input, so they can go first
    nodes = list(graph.node)
    nodes = nodes[-2:] + nodes[:-2]
    while True:  # drop the raw mask's nodes, now read by nothing
        read = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
        alive = [n for n in nodes if any(o in read for o in n.output)]
        if len(alive) == len(nodes):
            break
        nodes = alive
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--mask-input", default="attention_mask", help="the graph input holding the 0/1 mask")
    args = parser.parse_args()
    model = onnx.load(args.model)
    print(f"{with_length_masks(model, args.mask_input)} Attention masks now 1-D lengths")
    onnx.save(model, args.out)


if __name__ == "__main__":
    main()
