"""transformers' ``repeat_kv`` (each key/value head repeated n times) as one ``Gather`` along the heads axis.

Why
---
Grouped-query attention models (Llama, Qwen2, Mistral, Gemma: H query heads sharing H_kv key/value
heads) repeat each key and value head n = H / H_kv times before the attention::

    Reshape(Expand(Unsqueeze(x [B, H_kv, L, D], 2), [B, H_kv, n, L, D]), [B, H_kv·n, L, D])

three kernels per tensor, six per layer, and the Expand's target is computed from Shape reads on the
CPU at every run (issue 31: a KV-cache decode step is bound by kernel launches). The same values are
``Gather(x, [0, …, 0, 1, …, 1, …], axis=1)``, each index h // n repeated n times: one kernel, no shape
arithmetic.

Exactness
---------
With x' = Unsqueeze(x, a) (a 1 inserted at axis a), ``Expand`` to a target that is 1 or x's own
dimension everywhere except n at axis a gives y[…, i, j, …] = x[…, i, …] for every j < n. A row-major
Reshape that merges axes a − 1 and a (and keeps every other dimension) sends (i, j) to i·n + j, so the
result at head h is x's head h // n: exactly the Gather. Pure data movement, bitwise equal.

What is proved: the Unsqueeze inserts one axis a ≥ 1; the Expand's target (a constant or a Shape chain,
:func:`~onnxfuse.rewrites.facts.shape_values.shape_value`) has a static n > 0 at a and elsewhere 1 or
x's dimension (the same static size or the same symbolic name: ONNX's contract that a name is one
size; an entry that adds sizes read from ``Shape``, the dynamo KV-cache export's ``past_sequence +
sequence``, is x's length there only where a Concat along that axis makes x, proved term by term:
:func:`~onnxfuse.rewrites.facts.shape_values.concat_length`); the Reshape's target keeps every other
dimension (0 before axis a − 1, x's own size or name, or a single -1 with every other entry fixed) and has H_kv·n at axis a − 1, with H_kv static. Refused
otherwise, with the reason; an Expand or Unsqueeze also read elsewhere stays (only the Reshape is
replaced).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import NameAllocator, new_constant
from onnxfuse.rewrites.engine.rule import TARGETS, Plan, Refuse, Rule
from onnxfuse.rewrites.facts.graph import axes_of, is_op, producer_of, shape_of
from onnxfuse.rewrites.facts.shape_values import DimSum, concat_length, shape_value


def _same(entry, dim, summed=None) -> bool:
    """A target entry that is provably ``dim`` (the same static size, or the same symbolic name), or a sum
    of sizes (:class:`DimSum`) equal term by term to ``summed``, the length a Concat proves for that axis
    (a KV-cache export's ``past_sequence + sequence``)."""
    if isinstance(entry, DimSum):
        return summed is not None and entry == summed
    return entry is not None and dim is not None and not (isinstance(entry, int) and entry < 0) and entry == dim


class RepeatHeadsGather(Rule):
    """Reshape(Expand(Unsqueeze(x, a), […, n, …]), merging a−1 and a) → Gather(x, [h // n], axis=a−1)."""

    name = "repeat-heads-gather"
    description = "repeat_kv's Unsqueeze → Expand → Reshape (each head n times) → one Gather along the heads axis"
    targets = frozenset(TARGETS)

    def match(self, graph):
        for node in graph.nodes:
            if is_op(node, "Reshape") and len(node.inputs) == 2 and is_op(producer_of(node.inputs[0]), "Expand"):
                yield node

    def check(self, graph, reshape):
        expand = producer_of(reshape.inputs[0])
        unsqueeze = producer_of(expand.inputs[0])
        if not is_op(unsqueeze, "Unsqueeze"):
            return Refuse("the Expand does not read an Unsqueeze")
        x = unsqueeze.inputs[0]
        dims = shape_of(graph, x)
        axes = axes_of(graph, unsqueeze)
        if dims is None or axes is None or len(axes) != 1:
            return Refuse("the Unsqueeze's input rank or its one axis is unknown")
        rank = len(dims)
        axis = axes[0] + rank + 1 if axes[0] < 0 else axes[0]
        if not 1 <= axis <= rank:
            return Refuse("the repeated axis has no axis before it to merge into")
        heads = dims[axis - 1]
        if not isinstance(heads, int) or heads <= 0:
            return Refuse("the number of heads (the axis before the repeat) is not static")
        widened = list(dims[:axis]) + [1] + list(dims[axis:])
        summed = [concat_length(graph, x, i) for i in range(rank)]  # per axis of x, where a Concat makes it
        summed_widened = summed[:axis] + [None] + summed[axis:]
        target = shape_value(graph, expand.inputs[1], sums=True)
        if target is None or len(target) != rank + 1:
            return Refuse("the Expand's target is not known as a list of the output's rank")
        n = target[axis]
        if not isinstance(n, int) or n <= 0:
            return Refuse("the repeat count is not a static positive size")
        if any(i != axis and not (t == 1 or _same(t, widened[i], summed_widened[i])) for i, t in enumerate(target)):
            return Refuse("the Expand also broadcasts another axis")
        merged = shape_value(graph, reshape.inputs[1], sums=True)
        if merged is None or len(merged) != rank or int(reshape.attrs.get("allowzero", 0)):
            return Refuse("the Reshape's target is not known (or allowzero=1)")
        out = list(dims[:axis - 1]) + [heads * n] + list(dims[axis:])
        summed_out = summed[:axis - 1] + [None] + summed[axis:]
        if merged[axis - 1] != heads * n:
            return Refuse(f"the Reshape does not merge the {heads} heads and their {n} copies")
        free = [i for i, t in enumerate(merged) if t == -1]
        for i, t in enumerate(merged):  # a single -1 is inferred as out[i] once every other entry is proven
            if i == axis - 1 or (t == -1 and len(free) == 1):
                continue
            if not (_same(t, out[i], summed_out[i]) or (t == 0 and i < axis - 1)):
                return Refuse("the Reshape changes another dimension")
        return Plan(reshape, (x, axis - 1, heads, n))

    def rewrite(self, graph, plan: Plan) -> dict[str, Any]:
        reshape = plan.anchor
        x, axis, heads, n = plan.found
        names = NameAllocator(graph)
        base = reshape.name or "repeat_heads"
        index = new_constant(graph, f"{base}/head_index", np.repeat(np.arange(heads, dtype=np.int64), n))
        out = reshape.outputs[0]
        reshape.inputs.clear()
        reshape.outputs.clear()
        graph.nodes.append(gs.Node("Gather", names(f"{base}/Gather"), {"axis": axis}, inputs=[x, index], outputs=[out]))
        return {"node": base, "heads": heads, "copies": n}
