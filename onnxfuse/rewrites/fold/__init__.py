"""Folding rules: work done once at optimization time instead of at every inference (constants, static
sizes, BatchNorm and per-channel scales folded into the weights before them). One rule per file;
``affine`` and ``batchnorm`` are the family's shared, non-rule modules, ``bfloat16_scalars`` fold-constants' helper."""

#: Largest constant, in bytes, a fold may add to the model when the tensor it replaces stays stored
#: too (fold-constants' results; fold-weight-transpose of a weight something else also reads).
SIZE_LIMIT = 1 << 20
