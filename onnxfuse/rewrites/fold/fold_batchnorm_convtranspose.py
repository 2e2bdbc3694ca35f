"""fold-batchnorm-convtranspose: an inference BatchNormalization folded into the ConvTranspose before it.

    ConvTranspose:  W has layout (C_in, C_out/g, k...): output channel o = g·(C_out/g) + j lives in
                    W[g·C_in/g : (g+1)·C_in/g, j, ...], which is scaled by s[o];  b' as for Conv
                    (b' = (b − μ)·s + β, b = 0 when absent)

The maths, the refusals and the copy-on-write of shared weights: :mod:`onnxfuse.rewrites.fold.batchnorm`.
"""

from __future__ import annotations

from onnxfuse.rewrites.fold.batchnorm import FoldBatchNorm


class FoldBatchNormIntoConvTranspose(FoldBatchNorm):
    name = "fold-batchnorm-convtranspose"
    description = "Fold an inference BatchNormalization into the ConvTranspose before it (any groups)"
    producers = ("ConvTranspose",)
