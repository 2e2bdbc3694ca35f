"""Ops the elementwise fusion leaves to ONNX Runtime's own fusions (LayerNormFusion, SkipLayerNormFusion,
BiasSoftmaxFusion), because ONNX Runtime turns them into faster kernels than any FusedElementwise split.

Part of the elementwise family (fuse-elementwise reads it); not a rule. Its matcher is looser than
contrib-layernorm's on purpose (:func:`decomposed_layernorm_nodes`).
"""

from __future__ import annotations

import onnx

from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import constant_value, consumers, dtype_of, is_op, producer_of

#: Ops a decomposed LayerNorm is made of (PyTorch's fp16 exports add Casts to float and back).
_LN_CORE = {"Cast", "Pow", "Mul", "ReduceMean", "Add", "Sqrt", "Reciprocal", "Div"}
_LN_TAIL = {"Cast", "Mul", "Add"}


def _layernorm_like_nodes(graph, rm1) -> list | None:
    """The nodes of a LayerNorm-shaped subgraph anchored at ``rm1`` = ReduceMean(x), or ``None``.

    Looser than :func:`onnxfuse.rewrites.contrib.layernorm_pattern.match_decomposed` on purpose (it tolerates Casts anywhere, as in fp16 exports,
    and does not check constants): it only decides which nodes the elementwise fusion must leave to
    ONNX Runtime's own LayerNormFusion. Shape: Sub(x, mean) → [Cast] → square → ReduceMean → Add ε →
    Sqrt → [Reciprocal] → normalize (Div/Mul) → [Cast] → [Mul γ] → [Cast] → [Add β].
    """
    if not rm1.inputs or len(rm1.outputs) != 1:
        return None
    x = rm1.inputs[0]
    subs = [c for c in consumers(rm1.outputs[0]) if is_op(c, "Sub") and c.inputs[0] is x]
    if not subs:
        return None
    found: list = [rm1, *subs]
    seen = {id(n) for n in found}
    frontier = [s for s in subs]
    norm = None
    for _ in range(10):  # the core is at most ~8 nodes deep
        nxt = []
        for n in frontier:
            for t in n.outputs:
                for c in consumers(t):
                    if id(c) in seen or c.op not in _LN_CORE:
                        continue
                    seen.add(id(c))
                    found.append(c)
                    if c.op in ("Div", "Mul") and any(is_op(producer_of(i), "Sqrt") or is_op(producer_of(i), "Reciprocal")
                                                      for i in c.inputs if i is not None):
                        norm = c
                    else:
                        nxt.append(c)
        frontier = nxt
        if not frontier:
            break
    ops = {n.op for n in found}
    if norm is None or "Sqrt" not in ops or sum(n.op == "ReduceMean" for n in found) < 2:
        return None
    # The affine tail: at most Cast, Mul γ, Cast, Add β, each read only by the next.
    tail = norm
    for _ in range(4):
        readers = consumers(tail.outputs[0]) if tail.outputs else []
        if len(readers) != 1 or readers[0].op not in _LN_TAIL:
            break
        tail = readers[0]
        found.append(tail)
        if tail.op == "Add":
            break
    return found


def _holds_bfloat16(graph, tensor) -> bool:
    """Whether ``tensor`` is bfloat16. ONNX Runtime's LayerNormFusion takes float16, float and double only
    (``supported_data_types`` in core/optimizer/layer_norm_fusion.cc, checked on every input of the
    pattern's nodes), so a bfloat16 LayerNorm (``--precision bf16``, or a bfloat16 export) stays eight
    kernels unless the elementwise fusion takes its pieces: it is not reserved. (graphsurgeon types a
    bfloat16 variable by the ONNX enum, numpy having no bfloat16; a constant reads as ml_dtypes'.)"""
    if getattr(tensor, "dtype", None) == onnx.TensorProto.BFLOAT16:
        return True
    dtype = dtype_of(graph, tensor)
    return dtype is not None and dtype.name == "bfloat16"


def _reserve_residual_add(graph, layernorm_input_reader, reserved: dict) -> None:
    p = producer_of(layernorm_input_reader.inputs[0])
    if is_op(p, "Add") and all(constant_value(graph, t) is None for t in p.inputs):
        reserved[id(p)] = Refuse("residual Add feeding a LayerNorm: ONNX Runtime fuses both (SkipLayerNormFusion)", p)


def decomposed_layernorm_nodes(graph) -> dict[int, Refuse]:
    """``{id(node): refusal}`` for the nodes of every decomposed LayerNorm still in ``graph``.

    Used by the elementwise-region fusion to keep its hands off them: where contrib-layernorm could not map a
    LayerNorm (below opset 17, say), ONNX Runtime's own LayerNormFusion still turns the decomposed form
    into one LayerNormalization kernel at session load (and a residual Add before it into
    SkipLayerNormalization), which beats any split of it into elementwise pieces around the two
    ReduceMeans. Measured on an H100 (2026-11-22): ViT-B/16 ran at 0.78× and ConvNeXt-T at 0.74× (batch 1)
    when those pieces were fused into FusedElementwise nodes; fp16 BERT-base at 0.66× (its LayerNorms
    carry Casts to float and back, which a strict matcher misses).
    """
    reserved: dict[int, Refuse] = {}
    for node in list(graph.nodes):
        if not is_op(node, "ReduceMean"):
            continue
        nodes = _layernorm_like_nodes(graph, node)
        if not nodes or any(_holds_bfloat16(graph, t) for n in nodes for t in n.inputs if t is not None):
            continue
        why = "part of a decomposed LayerNorm that ONNX Runtime fuses itself (LayerNormFusion)"
        for n in nodes:
            reserved[id(n)] = Refuse(why, n)
        _reserve_residual_add(graph, node, reserved)
    # Likewise before a LayerNorm that is already one op (contrib-layernorm's, or the model's own).
    for node in list(graph.nodes):
        if is_op(node, "LayerNormalization") and node.inputs:
            _reserve_residual_add(graph, node, reserved)
    # The attention-mask Add before a Softmax: ONNX Runtime's CUDA provider fuses the pair (BiasSoftmax).
    for node in list(graph.nodes):
        if is_op(node, "Softmax") and node.inputs:
            p = producer_of(node.inputs[0])
            if is_op(p, "Add") and len(consumers(p.outputs[0])) == 1:
                reserved[id(p)] = Refuse(
                    "Add feeding a Softmax: ONNX Runtime's CUDA provider fuses both (BiasSoftmaxFusion)", p)
    return reserved
