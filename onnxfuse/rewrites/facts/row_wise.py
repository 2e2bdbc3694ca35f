"""A Gemm applied row by row to a 3-D tensor through two Reshapes (torch's ``Conv1D``, GPT-2's projections).

``Reshape(Gemm(Reshape(x, t₁), W, C), t₂)`` is ``x·W (+ C)`` on x [B, S, K] itself when

* x is [B, S, K] with K static, and the first Reshape gives [M, K]: the row-major flatten, row b·S + s
  holding x[b, s];
* the Gemm has alpha = beta = 1 and transA = 0: row r of its result is row r of A times W (plus C);
* C (if any) is a constant of N values ([N] or [1, N]): the same bias for every row;
* the second Reshape sends the rows back to [B, S, N]: its target is the constant [-1, S, N] with S =
  x's static sequence size, so that -1 = (B·S·N) / (S·N) = B, or [B, -1, N] with B static (the
  sequence-first [S, B, ·] of torch.nn.MultiheadAttention's output projection: -1 = S·B·N / (S·N)), or
  [B, S, N] with both static, or, for a
  computed target, its inferred output dimensions are provably x's (equal sizes or the same name);
* the two intermediate tensors are read only by the next op of the chain (and are no graph outputs).

Two rules need that proof: ``gemm-rows-to-matmul`` rewrites the chain as MatMul (+ Add), and
``contrib-attention`` packs GPT-2's q/k/v projection when it sees the chain itself (run alone, with
``--only contrib-attention``). One proof serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import constant_value, dims_equal, is_op, only_read_by, producer_of, shape_of


@dataclass
class RowWiseGemm:
    back: object  # the Reshape back to [B, S, N] (the chain's last node)
    gemm: object
    flat: object  # the Reshape of x to rows
    x: object  # [B, S, K]
    n: int  # N, the Gemm's output size
    bias: np.ndarray | None  # C's values, when the Gemm has a C


def row_wise_gemm(graph, back) -> RowWiseGemm | Refuse:
    """The chain ``back`` ends when it is a row-wise Gemm chain (module docstring), else a ``Refuse``.

    W is only required to have a known [K, N] / [N, K] (transB) shape; whether it must be a constant is
    the caller's business."""
    gemm = producer_of(back.inputs[0]) if is_op(back, "Reshape") and len(back.inputs) == 2 else None
    if not is_op(gemm, "Gemm"):
        return Refuse("the Reshape does not read a Gemm")
    flat = producer_of(gemm.inputs[0])
    if not is_op(flat, "Reshape"):
        return Refuse("the Gemm's A is not a Reshape")
    if (float(gemm.attrs.get("alpha", 1.0)) != 1.0 or float(gemm.attrs.get("beta", 1.0)) != 1.0
            or int(gemm.attrs.get("transA", 0)) != 0):
        return Refuse("the Gemm scales (alpha/beta ≠ 1) or transposes A")
    for tensor, reader in ((gemm.inputs[0], gemm), (back.inputs[0], back)):
        problem = only_read_by(graph, tensor, [reader])
        if problem:
            return problem
    x = flat.inputs[0]
    xs, fs, outs = shape_of(graph, x), shape_of(graph, gemm.inputs[0]), shape_of(graph, back.outputs[0])
    if xs is None or len(xs) != 3 or not isinstance(xs[2], int):
        return Refuse("the flattened tensor is not of rank 3 with a static last dimension")
    if fs is None or len(fs) != 2 or fs[1] != xs[2]:
        return Refuse(f"the first Reshape does not flatten the rows (gives {fs}, from {xs})")
    w_shape = shape_of(graph, gemm.inputs[1])
    if w_shape is None or len(w_shape) != 2:
        return Refuse("W's shape is unknown")
    n = w_shape[0] if int(gemm.attrs.get("transB", 0)) else w_shape[1]
    if not isinstance(n, int):
        return Refuse("W's output size is unknown")
    c = None
    if len(gemm.inputs) > 2 and not gemm.inputs[2].is_empty():
        c = constant_value(graph, gemm.inputs[2])
        if c is None or c.size != n or c.shape[-1] != n:
            return Refuse("C is not a constant bias of N values")
    target = constant_value(graph, back.inputs[1])
    if target is not None:  # decided by the target alone: [-1, S, N], [B, -1, N] or [B, S, N]
        t = [int(v) for v in target.reshape(-1)]
        kept = [isinstance(xs[i], int) and xs[i] > 0 and t[i] == xs[i] for i in (0, 1)] if len(t) == 3 else []
        rows_back = len(t) == 3 and t[2] == n and (all(kept) or (t[0] == -1 and kept[1])
                                                    or (t[1] == -1 and kept[0]))
    else:
        rows_back = (outs is not None and len(outs) == 3 and dims_equal(outs[0], xs[0])
                     and dims_equal(outs[1], xs[1]) and dims_equal(outs[2], n))
    if not rows_back:
        return Refuse("the second Reshape does not provably give back x's [B, S] rows")
    return RowWiseGemm(back, gemm, flat, x, n, c)
