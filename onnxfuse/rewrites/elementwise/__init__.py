"""Elementwise rules: regions of elementwise ops become one FusedElementwise node (``fuse_elementwise``),
and a Conv's bias moves into the region after it (``conv_bias_into_elementwise``). ``regions`` (the
region analysis both use), ``partition`` (the partition algorithm) and ``ort_fusions`` (what is left to
ONNX Runtime's own fusions) are the family's shared, non-rule modules."""
