"""The layouts q, k and v come in, and their dimensions as the fused op reads them.

* *batch-first* (:data:`BATCH_FIRST`): the heads were cut from [B, S, E];
* *sequence-first* (:data:`SEQ_FIRST`): from [S, B, E] (``torch.nn.MultiheadAttention``);
* *given* (:data:`GIVEN`): [B, H, S, D] heads taken as the graph has them (rotated, repeated: Llama).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.edit import new_constant
from onnxfuse.rewrites.facts.graph import BF16, shape_of

#: The element types the fused ops take: float32, float16, and bfloat16 (ONNX Runtime's CUDA kernels of
#: MultiHeadAttention and Attention: :data:`~onnxfuse.rewrites.facts.graph.BF16`).
DTYPES = (np.dtype(np.float32), np.dtype(np.float16)) + BF16
#: perm of the Transpose that splits heads: [B, S, H, D] → [B, H, S, D]
HEADS = [0, 2, 1, 3]
#: perm that gives Kᵀ in one step: [B, L, H, D] → [B, H, D, L]
HEADS_T = [0, 2, 3, 1]
SWAP_LAST = [0, 1, 3, 2]
#: merging perm of the sequence-first layout: [B, H, S, D] → [S, B, H, D]
SEQ_FIRST_MERGE = [2, 0, 1, 3]
BATCH_FIRST = "batch-first"  # the heads were cut from [B, S, E]
SEQ_FIRST = "sequence-first"  # the heads were cut from [S, B, E] (torch.nn.MultiheadAttention)
GIVEN = "given-heads"  # [B, H, S, D] heads taken as the graph has them (rotated, repeated: Llama)


#: (rank, batch axis, sequence axis) of q, k or v as the fused op reads them, by layout
AXES = {BATCH_FIRST: (3, 0, 1), SEQ_FIRST: (3, 1, 0), GIVEN: (4, 0, 2)}


def dim_of(graph, tensor, layout, index: int):
    shape = shape_of(graph, tensor)
    rank = AXES[layout][0]
    return shape[AXES[layout][index]] if shape is not None and len(shape) == rank else None


def sequence_of(graph, tensor, layout=BATCH_FIRST):
    """The sequence dimension of q, k or v as the fused op reads it: [B, S, E], the sequence-first
    [S, B, E], or given [B, H, S, D] heads; None if unknown."""
    return dim_of(graph, tensor, layout, 2)


def batch_of(graph, tensor, layout=BATCH_FIRST):
    """The batch dimension of q, k or v, read as :func:`sequence_of` reads the sequence."""
    return dim_of(graph, tensor, layout, 1)


def copies_dim(target_dim, dim) -> bool:
    """A Reshape target entry that provably keeps the input's dimension at the same index."""
    return int(target_dim) == 0 or (isinstance(dim, int) and dim == int(target_dim))


def run_time_dim(graph, names, base, source, index):
    """Dimension ``index`` of ``source`` at run time, as a 1-element int64 tensor (Shape, then Slice)."""
    shape = gs.Variable(names(f"{base}/shape"), dtype=np.int64)
    graph.nodes.append(gs.Node("Shape", names(f"{base}/Shape"), inputs=[source], outputs=[shape]))
    dim = gs.Variable(names(f"{base}/dim"), dtype=np.int64)
    graph.nodes.append(gs.Node("Slice", names(f"{base}/Slice"), inputs=[
        shape, new_constant(graph, f"{base}/start", np.array([index], np.int64)),
        new_constant(graph, f"{base}/end", np.array([index + 1], np.int64))], outputs=[dim]))
    return dim
