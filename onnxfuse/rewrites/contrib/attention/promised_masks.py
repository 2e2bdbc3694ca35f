"""Which packed ``Attention`` raw masks a ``--right-padded NAME`` promise covers: the proof the two rules
that rewrite such a mask share (contrib-promised-keep-bias writes it as a keep ``attention_bias``,
contrib-mask-lengths as 1-D key lengths).

The promise is about input NAME: each of its rows is n >= 1 ones, then zeros. A mask is covered when it
is a 2-D int32 ``mask_index`` [B, L] computed from promised inputs and from no other input's values
(shape reads do not count), on a bidirectional ``Attention`` with no ``past`` and no ``attention_bias``
(the forms are verified without them). The rules do not prove that the mask's rows are NAME's rows, and
need not: validation draws right-padded values for NAME (:mod:`onnxfuse.runtime.right_padding`), so a
model whose mask rearranges NAME's rows fails validation and the rule is named.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import dtype_of, int_attr, is_ms_op, is_op, value_sources
from onnxfuse.rewrites.facts.shape_values import proved_rank


def raw_mask_attentions(graph) -> list[gs.Node]:
    """The packed ``Attention`` nodes with a ``mask_index`` that is not already 1-D lengths."""
    return [n for n in graph.nodes if is_ms_op(n, "Attention") and len(n.inputs) > 3
            and not n.inputs[3].is_empty() and proved_rank(graph, n.inputs[3]) != 1]


def promised_mask(graph, node, right_padded: frozenset[str]) -> tuple[gs.Tensor, list[str]] | Refuse:
    """(``node``'s ``mask_index``, the promised inputs it reads) when the ``--right-padded`` promise of
    ``right_padded`` covers it (module docstring), else a :class:`Refuse` saying why not."""
    mask = node.inputs[3]
    if int_attr(node, "unidirectional", 0):
        return Refuse("causal (unidirectional) Attention: the promised forms are verified only for bidirectional attention")
    if any(not t.is_empty() for t in node.inputs[4:]):
        return Refuse("Attention also has past or attention_bias inputs: the promised forms are verified without them")
    rank = proved_rank(graph, mask)
    if rank != 2:
        return Refuse(f"mask_index is not a raw [B, L] mask (rank {rank if rank is not None else 'unknown'})")
    cast = mask.inputs[0] if mask.inputs else None
    if dtype_of(graph, mask) != np.dtype(np.int32) and not (is_op(cast, "Cast") and int_attr(cast, "to", 0) == 6):
        return Refuse("mask_index is not int32")
    sources = value_sources(mask)
    if sources is None:
        return Refuse("mask_index is computed through control flow (If/Loop/Scan): its inputs are not traced")
    promised = sorted(sources & right_padded)
    others = sorted(sources - right_padded)
    if not promised:
        return Refuse(f"mask_index does not derive from an input promised right-padded "
                      f"(--right-padded {', '.join(sorted(right_padded))})")
    if others:
        return Refuse(f"mask_index also reads input(s) {', '.join(others)}, not promised right-padded")
    return mask, promised


def bool_keep_source(mask) -> gs.Tensor | None:
    """The bool tensor when ``mask`` is ``Cast(to=int32)`` of one (what contrib-attention writes): the mask
    then holds only 0 and 1, and the bool tensor is True exactly where it keeps a key. Else None."""
    cast = mask.inputs[0] if mask.inputs else None
    if (is_op(cast, "Cast") and int_attr(cast, "to", 0) == 6
            and cast.inputs[0].dtype is not None and np.dtype(cast.inputs[0].dtype) == np.bool_):
        return cast.inputs[0]
    return None
