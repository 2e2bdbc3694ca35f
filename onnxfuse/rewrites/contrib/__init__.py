"""ONNX Runtime contrib-op rules: patterns that ONNX Runtime runs as one kernel of domain
``com.microsoft`` (attention, GELU family, LayerNorm, FusedMatMul, FusedConv). One rule per file; ``matching``,
``activation``, ``layernorm_pattern`` and ``matmul`` are the family's shared, non-rule modules."""
