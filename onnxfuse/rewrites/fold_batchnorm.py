"""Fold BatchNormalization into Conv / ConvTranspose / Gemm (work in progress)."""
from onnxfuse.rewrites.base import Rule


class FoldBatchNormIntoConv(Rule):
    name = "fold-batchnorm-conv"
    description = "Fold an inference BatchNormalization into the preceding Conv"

    def match(self, graph):
        return []


class FoldBatchNormIntoConvTranspose(Rule):
    name = "fold-batchnorm-convtranspose"
    description = "Fold an inference BatchNormalization into the preceding ConvTranspose"

    def match(self, graph):
        return []


class FoldBatchNormIntoGemm(Rule):
    name = "fold-batchnorm-gemm"
    description = "Fold an inference BatchNormalization into the preceding Gemm or MatMul"

    def match(self, graph):
        return []
