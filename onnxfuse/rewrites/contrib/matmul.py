"""MatMul with scales / transposes → com.microsoft FusedMatMul: what contrib-fused-matmul-scale and
contrib-fused-matmul-transpose share (one file each); not a rule.

**FusedMatMul** computes ``Y = alpha · op(A) · op(B)`` where ``op`` transposes the last two axes when
``transA`` / ``transB`` is set (batch axes broadcast as in MatMul).

Element types float16/float/double (FusedMatMul's CUDA kernel; bfloat16 has no numpy dtype here).
"""

from __future__ import annotations

from onnxfuse.rewrites.facts.graph import FP16, FP32, FP64, first_known_dtype, is_ms_op, is_op, scalar_constant


MATMUL_DTYPES = (FP16, FP32, FP64)


def scale_of(graph, node, operand):
    """``(factor, source)`` when ``node`` is ``operand·s``, ``s·operand`` or ``operand/s``; else ``None``.

    ``operand`` is the tensor on the MatMul side (None = find it: the non-constant input).
    """
    if not is_op(node, "Mul", "Div") or len(node.inputs) != 2 or len(node.outputs) != 1:
        return None
    if node.op == "Div":
        s = scalar_constant(graph, node.inputs[1])
        if s is None or float(s.reshape(())) == 0.0 or scalar_constant(graph, node.inputs[0]) is not None:
            return None
        return 1.0 / float(s.reshape(())), node.inputs[0], s
    for j in (1, 0):
        s = scalar_constant(graph, node.inputs[j])
        if s is not None and scalar_constant(graph, node.inputs[1 - j]) is None:
            return float(s.reshape(())), node.inputs[1 - j], s
    return None


def matmul_attrs(node):
    if node.op == "MatMul":
        return {}
    return dict(node.attrs)


def is_matmul(node):
    return is_op(node, "MatMul") or is_ms_op(node, "FusedMatMul")


def matmul_dtype(graph, node, extra=()):
    return first_known_dtype(graph, *extra, *node.inputs, *node.outputs)
