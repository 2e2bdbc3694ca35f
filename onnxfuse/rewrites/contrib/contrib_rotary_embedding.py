"""contrib-rotary-embedding: the rotary embedding (RoPE) of Llama-family exports → ONNX RotaryEmbedding.

``contrib-rotary-embedding`` (the pattern, what is proved and the maths:
:mod:`onnxfuse.rewrites.contrib.rotary_pattern`) writes, for q and for k of every layer::

    y = RotaryEmbedding(x, cos[..., :D/2], sin[..., :D/2])        (default-domain opset 23, 4-D x)

Why: the decomposed form is seven nodes per tensor (two Slices, Neg, Concat, two Muls, Add; five
kernels once fuse-elementwise has taken the arithmetic), fourteen per layer for q and k, and a KV-cache
decode step is bound by kernel launches (issue 31: 1,437 nodes for a Qwen2-0.5B-shaped decoder against
276 in onnxruntime-genai's hand-built graph). One kernel per tensor reads x and the caches once.

Which op: ONNX's ``RotaryEmbedding`` (opset 23) without ``position_ids`` takes the cos and sin caches
per token, [B, S, D/2], so the model's own cos and sin (computed from its ``position_ids`` input, any
values) are used as they are: nothing about positions is assumed. ONNX Runtime registers the op on the
CPU and on CUDA (``core/providers/cuda/llm/rotary_embedding.cc``; float, float16, bfloat16).
``com.microsoft.RotaryEmbedding`` needs a cache indexed by position, whose length the graph does not
bound. Below opset 23 the rule raises the model's opset when that changes no node's meaning
(:mod:`onnxfuse.rewrites.engine.opset`; it runs after contrib-rmsnorm, whose replaced ReduceMeans
would otherwise block the raise from 14 or 17), and refuses, naming the ops, otherwise.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.contrib.rotary_pattern import match_rotary, rotary_candidate
from onnxfuse.rewrites.engine.edit import NameAllocator, fuse, new_constant
from onnxfuse.rewrites.engine.opset import opset_raise_problem, raise_opset
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.contrib.attention.layout import run_time_dim
from onnxfuse.rewrites.facts.graph import BF16, dtype_of, shape_of

#: Default-domain opset that introduced RotaryEmbedding.
ROTARY_OPSET = 23
#: the element types ONNX Runtime's CPU and CUDA kernels both take, and bfloat16, which its CUDA kernel takes
#: (:data:`~onnxfuse.rewrites.facts.graph.BF16`; a bfloat16 model is one for CUDA)
ROTARY_DTYPES = (np.dtype(np.float32), np.dtype(np.float16)) + BF16


class ContribRotaryEmbedding(ContribRule):
    name = "contrib-rotary-embedding"
    description = ("x·cos + rotate_half(x)·sin on [B, H, S, D] heads (rotary embedding) → RotaryEmbedding "
                   "(raises opset to 23)")

    def match(self, graph):
        return [n for n in graph.nodes if rotary_candidate(n)]

    def analyze(self, graph, node):
        found = match_rotary(graph, node)
        if isinstance(found, Refuse):
            return found
        problem = dtype_problem(dtype_of(graph, found.x), ROTARY_DTYPES, "RotaryEmbedding input")
        if problem:
            return problem
        raise_problem = opset_raise_problem(graph, ROTARY_OPSET, replaced=found.nodes)
        if raise_problem:
            return Refuse(f"ONNX RotaryEmbedding needs opset {ROTARY_OPSET}, and {raise_problem.reason}")
        return found

    def apply(self, graph, node, found):
        raise_opset(graph, ROTARY_OPSET)
        names = NameAllocator(graph)
        full = [found.cos, found.sin]
        if found.broadcast_batch:  # [1, S, D] caches broadcast over x's batch: spelled out to [B, S, D]
            batch = _run_time_batch(graph, names, found.x)
            full = [_batch_expanded(graph, names, t, batch, shape_of(graph, found.x)[0]) for t in full]
        caches = [_first_half(graph, names, t, found.half) for t in full]
        if found.cache_cast is not None:  # the pattern's Cast of its Unsqueezed caches, on the halves (exact: per element)
            caches = [_cast(graph, names, t, found.cache_cast) for t in caches]
        name = f"{found.root.name}/RotaryEmbedding" if found.root.name else None
        if found.merged is not None:  # the 3-D form: [B, S, H·D] in, the merged [B, S, H·D] out
            src, heads, merge_r, _ = found.merged
            fuse(graph, found.nodes + [merge_r], "RotaryEmbedding", [src, *caches], merge_r.outputs[0], domain="",
                 attrs={"num_heads": heads}, name=name)
            return {"input": src.name, "form": "3-D, heads merged", "num_heads": heads, "head_size": 2 * found.half,
                    "replaced": len(found.nodes) + 1}
        if found.partial is not None:  # src [B, H, S, D], the first 2·half rotated, the rest passed through
            src, concat = found.partial
            fuse(graph, found.nodes, "RotaryEmbedding", [src, *caches], concat.outputs[0], domain="",
                 attrs={"rotary_embedding_dim": 2 * found.half}, name=name)
            return {"input": src.name, "form": "4-D heads, partial", "head_size": 2 * found.half,
                    "rotary_embedding_dim": 2 * found.half, "replaced": len(found.nodes)}
        fuse(graph, found.nodes, "RotaryEmbedding", [found.x, *caches], found.root.outputs[0], domain="", name=name)
        return {"input": found.x.name, "form": "4-D heads", "head_size": 2 * found.half, "replaced": len(found.nodes)}


def _run_time_batch(graph, names, x):
    """x's batch size at run time as a 1-element int64 tensor, read from a graph input that declares x's batch
    name where one does (the same nodes for every layer: cleanup merges them into one), else from x."""
    batch = shape_of(graph, x)[0]
    source, axis = x, 0
    if isinstance(batch, str) and batch:
        for tensor in graph.inputs:
            dims = list(tensor.shape or [])
            if batch in dims:
                source, axis = tensor, dims.index(batch)
                break
    return run_time_dim(graph, names, "rotary_batch", source, axis)


def _batch_expanded(graph, names, cache, batch, batch_dim):
    """``Expand(cache, Concat(batch, [1, 1]))``: the [1, S, D] cache copied to every row of the batch, as the
    original's Mul broadcast it (exact: copies)."""
    base = f"{cache.name}/batch"
    target = gs.Variable(names(f"{base}/shape"), dtype=np.int64)
    graph.nodes.append(gs.Node("Concat", names(f"{base}/Concat"), {"axis": 0}, inputs=[
        batch, new_constant(graph, f"{base}/ones", np.array([1, 1], np.int64))], outputs=[target]))
    out = gs.Variable(names(base), dtype=cache.dtype,
                      shape=None if cache.shape is None else [batch_dim, *cache.shape[1:]])
    graph.nodes.append(gs.Node("Expand", names(f"{base}/Expand"), inputs=[cache, target], outputs=[out]))
    return out


def _cast(graph, names, tensor, dtype: np.dtype):
    """``Cast(tensor, to=dtype)``; every layer's copy is a duplicate that cleanup merges into one."""
    out = gs.Variable(names(f"{tensor.name}/{dtype.name}"), dtype=dtype, shape=tensor.shape)
    graph.nodes.append(gs.Node("Cast", names(f"{tensor.name}/Cast"), {"to": int(helper.np_dtype_to_tensor_dtype(dtype))},
                               inputs=[tensor], outputs=[out]))
    return out


def _first_half(graph, names, cache, half: int):
    """``cache[..., :half]`` [B, S, D/2]: the op's per-token cache. With constant bounds, every layer's copy
    is a duplicate that cleanup merges into one."""
    base = f"{cache.name}/half"
    out = gs.Variable(names(base), dtype=cache.dtype,
                      shape=None if cache.shape is None else [*cache.shape[:-1], half])
    graph.nodes.append(gs.Node("Slice", names(f"{base}/Slice"), inputs=[
        cache, new_constant(graph, f"{base}/start", np.array([0], np.int64)),
        new_constant(graph, f"{base}/end", np.array([half], np.int64)),
        new_constant(graph, f"{base}/axis", np.array([-1], np.int64))], outputs=[out]))
    return out
