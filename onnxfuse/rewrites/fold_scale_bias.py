"""Fold constant per-channel Mul/Add/Sub/Div into Conv / ConvTranspose / Gemm (work in progress)."""
from onnxfuse.rewrites.base import Rule


class FoldScaleBias(Rule):
    name = "fold-scale-bias"
    description = "Fold a constant per-channel Mul/Add/Sub/Div into the preceding Conv, ConvTranspose or Gemm"

    def match(self, graph):
        return []
