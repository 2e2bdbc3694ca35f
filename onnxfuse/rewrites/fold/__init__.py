"""Folding rules: work done once at optimization time instead of at every inference (constants, static
sizes, BatchNorm and per-channel scales folded into the weights before them). One rule per file;
``affine`` and ``batchnorm`` are the family's shared, non-rule modules."""
