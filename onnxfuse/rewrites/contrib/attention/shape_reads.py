"""``Shape`` reads of tensors the rewrite removes, found at check time and recomputed at rewrite time.

**Shape reads** of a tensor the rewrite removes (GPT-2 and DistilBERT read ``Shape`` of the scores and of
the heads to build their masks; GPT-2 also transposes the key heads only to read a Shape) are replaced,
batch-first only, by the same dims named from the pattern ([B,H,S,L] for the scores, [B,H,S,D] for the
q heads, ...): B and S read from q's shape, L from k's, H, D, E constants; a Transpose read only by such
Shapes permutes the names.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.contrib.attention.layout import BATCH_FIRST, run_time_dim
from onnxfuse.rewrites.engine.edit import new_constant
from onnxfuse.rewrites.facts.graph import consumers, is_op, perm_of

def find_shape_reads(graph, nodes, merge_r, q, k, v, qk, pv, merge_t):
    """The readers outside the pattern when all are ``Shape`` of a batch-first pattern tensor whose dims
    are known by name ([B, H, S, L] for the scores...), as (node, dims); None when some other reader (or
    a graph output) is the problem, or they are Shapes the rewrite cannot recompute (the caller then
    refuses with the pattern's own reason)."""
    if not (q.layout == k.layout == v.layout == BATCH_FIRST):
        return None
    roles = {}

    def tag(node, letters):
        roles[id(node.outputs[0])] = letters

    tag(q.nodes[1], "BSHD"), tag(q.nodes[0], "BHSD")
    if len(k.nodes) == 3:
        tag(k.nodes[0], "BHDL"), tag(k.nodes[1], "BHLD"), tag(k.nodes[2], "BLHD")
    else:
        tag(k.nodes[0], "BHDL"), tag(k.nodes[1], "BLHD")
    tag(v.nodes[0], "BHLD"), tag(v.nodes[1], "BLHD")
    tag(qk, "BHSL"), tag(pv, "BHSD"), tag(merge_t, "BSHD")
    inside = {id(n) for n in nodes} | {id(merge_r)}
    for _ in range(len(nodes)):  # scalar scales, no-op Casts, mask steps and the Softmax keep their input's dims
        for n in nodes:
            if id(n.outputs[0]) not in roles and n.inputs and id(n.inputs[0]) in roles:
                roles[id(n.outputs[0])] = roles[id(n.inputs[0])]
            elif id(n.outputs[0]) not in roles and len(n.inputs) > 1 and any(id(t) in roles for t in n.inputs[1:]):
                if not is_op(n, "Where"):
                    roles[id(n.outputs[0])] = next(roles[id(t)] for t in n.inputs if id(t) in roles)
                elif id(n.inputs[1]) in roles or id(n.inputs[2]) in roles:
                    roles[id(n.outputs[0])] = roles.get(id(n.inputs[1])) or roles[id(n.inputs[2])]
    reads = []
    for n in nodes:
        if n is merge_r:
            continue
        for out in n.outputs:
            if any(t is out for t in graph.outputs):
                return None
            for c in out.outputs:
                if id(c) in inside:
                    continue
                if id(out) not in roles:
                    return None
                letters = roles[id(out)]
                readers = [c]
                if is_op(c, "Transpose") and sorted(perm_of(c)) == list(range(len(letters))) and not any(
                        t is c.outputs[0] for t in graph.outputs):  # a Transpose read only for its shape
                    letters = "".join(letters[i] for i in perm_of(c))
                    readers = consumers(c.outputs[0])
                for r in readers:
                    if not is_op(r, "Shape") or r.attrs.get("start", 0) or "end" in r.attrs:
                        return None
                    reads.append((r, letters))
    return reads


def replace_shape(graph, plan, names, base, node, letters, query, key):
    """``Shape(t)`` of a tensor the rewrite removes, computed instead from the dims it is made of: B and
    S from ``query``'s shape, L from ``key``'s ([B, S, E] and [B, L, E]), H, D and E constants."""
    dims = {}
    for source, letter, index in ((query, "B", 0), (query, "S", 1), (key, "L", 1)):
        if letter in letters:
            dims[letter] = run_time_dim(graph, names, base, source, index)
    constants = {"H": plan.heads, "D": plan.head_size, "E": plan.heads * plan.head_size}
    pieces = [dims[c] if c in dims else new_constant(graph, f"{base}/{c}", np.array([constants[c]], np.int64))
              for c in letters]
    out = node.outputs[0]
    node.outputs.clear()
    node.inputs.clear()
    graph.nodes.append(gs.Node("Concat", names(f"{base}/shape_of_removed"), {"axis": 0}, inputs=pieces,
                               outputs=[out]))
