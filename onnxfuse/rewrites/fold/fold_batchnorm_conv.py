"""fold-batchnorm-conv: an inference BatchNormalization folded into the Conv before it.

    Conv:           W'[o, ...] = W[o, ...]·s[o]                    b' = (b − μ)·s + β  (b = 0 when absent)

The maths, the refusals and the copy-on-write of shared weights: :mod:`onnxfuse.rewrites.fold.batchnorm`.
"""

from __future__ import annotations

from onnxfuse.rewrites.fold.batchnorm import FoldBatchNorm


class FoldBatchNormIntoConv(FoldBatchNorm):
    name = "fold-batchnorm-conv"
    description = "Fold an inference BatchNormalization into the Conv before it (any groups, N-d)"
    producers = ("Conv",)
