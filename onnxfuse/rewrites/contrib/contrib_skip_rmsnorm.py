"""contrib-skip-rmsnorm: a residual Add feeding a decomposed RMSNorm → com.microsoft
SkipSimplifiedLayerNormalization.

``contrib-skip-rmsnorm``: when the RMSNorm's input x (:mod:`onnxfuse.rewrites.contrib.rmsnorm_pattern`:
the maths, the accepted forms, the conditions) is ``Add(a, b)`` of two run-time tensors of provably
equal shape (rank 2 or 3, as ONNX Runtime's kernels take; dims equal as numbers or as the same named
dim-param), the Add and the RMSNorm become::

    output, _, _, input_skip_bias_sum = com.microsoft.SkipSimplifiedLayerNormalization(a, b, γ, epsilon=ε)

    s = a + b;   output = s / √(mean(s²) + ε) · γ   (over the last axis);   input_skip_bias_sum = s

the op onnxruntime-genai's builder writes for every pre-norm residual of Llama, Qwen2 and Mistral.
When the Add's result is read elsewhere too (the residual stream of a pre-norm decoder, read again by
the next residual Add), it becomes the op's fourth output, ``input_skip_bias_sum`` (the Add's own
value; the mean and inv_std_var outputs stay unused). Registered by ONNX Runtime in com.microsoft on
CPU (float, double, float16, bfloat16) and CUDA (float, float16); a custom domain, so ``onnx.checker``
accepts it at any opset. Element types here: float16/float32.

Refused: an Add with a constant or a broadcast operand (no skip then), x not an Add, shapes not
provably equal, an unknown hidden size, the conditions of the shared matcher (axes, ε, γ, private
intermediates, an island not cast back). Not done: a 1-D bias Add before the residual Add (the op's
``bias`` input; Llama, Qwen2 and Mistral have no output-projection bias).

Precision (decided here): the ops compute s in x's type as the Add did (the residual stream output is
the Add's own value: bit-identical on ONNX Runtime's CPU, tested), then the statistics. The CPU kernel
accumulates them in float, at least as accurate as the float32 island of Hugging Face's exports. The
CUDA kernel, by default, computes a float16 model's Σ (s/d)·s, adds ε and takes the reciprocal square
root in float16 (source read: ``contrib_ops/cuda/bert/skip_layer_norm_impl.cu``, ``layer_norm.cuh``;
the CUDA provider option ``enable_skip_layer_norm_strict_mode=1`` takes ONNX Runtime's float path).
That kernel emulated in numpy (float16 products, per-thread sums of 4, a pairwise tree), Gaussian rows,
ε = 1e-6, against float64: max relative error ≤ 1.3e-3 for row RMS 0.1–100 (d = 896 and 4096; the
float32 island's own float16 rounding: 4.9e-4), 5.4e-3 at RMS 0.03 with d = 4096, and beyond float16's
tolerance (rtol 1e-2) for rows of RMS ≤ 0.01 (1.5e-2 at d = 896, 0.11 at d = 4096: the terms s²/d fall
below float16's subnormals) or RMS ≥ 256 (Σ s²/d overflows: the row becomes 0). Accepted, as the kernel
onnxruntime-genai's float16 models and ONNX Runtime's own SkipLayerNormFusion already run; validation on
the GPU judges each model with its own weights. Float32 models are exact up to float32 rounding.
"""

from __future__ import annotations

import numpy as np

from onnxfuse.rewrites.contrib.matching import ContribRule, dtype_problem
from onnxfuse.rewrites.contrib.rmsnorm_pattern import RMS_DTYPES, match_rmsnorm, rms_candidate, rmsnorm_gamma
from onnxfuse.rewrites.engine.edit import empty_input, fuse
from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.graph import constant_value, is_op, only_read_by, producer_of, shape_of, shapes_equal


class ContribSkipRmsNorm(ContribRule):
    name = "contrib-skip-rmsnorm"
    description = "Add(a, b) of equal shapes → RMSNorm becomes com.microsoft SkipSimplifiedLayerNormalization"

    def match(self, graph):
        return [n for n in graph.nodes if rms_candidate(n)]

    def analyze(self, graph, node):
        m = match_rmsnorm(graph, node)
        if isinstance(m, Refuse):
            return m
        add = producer_of(m.x)
        if not is_op(add, "Add") or len(add.inputs) != 2:
            return Refuse("RMSNorm input is not produced by an Add")
        a, b = add.inputs
        if constant_value(graph, a) is not None or constant_value(graph, b) is not None:
            return Refuse("the Add before the RMSNorm adds a constant (a bias, not a residual)")
        sa, sb = shape_of(graph, a), shape_of(graph, b)
        if sa is None or sb is None:
            return Refuse("shapes of the Add's inputs unknown (run shape inference first)")
        if len(sa) not in (2, 3) or not shapes_equal(sa, sb):
            return Refuse(f"Add inputs of shapes {sa} and {sb} are not provably equal rank-2/3 shapes")
        if not isinstance(sa[-1], (int, np.integer)):
            return Refuse("hidden size (last dimension) unknown")
        problem = dtype_problem(m.dtype, RMS_DTYPES, "SkipSimplifiedLayerNormalization input")
        if problem:
            return problem
        gamma = rmsnorm_gamma(graph, m, "skip_rms_scale")
        if isinstance(gamma, Refuse):
            return gamma
        # Read elsewhere too (the residual stream): the sum becomes the op's fourth output.
        keep_sum = only_read_by(graph, m.x, m.x_readers) is not None
        return (m, add, gamma, keep_sum)

    def apply(self, graph, node, plan):
        m, add, gamma, keep_sum = plan
        a, b = add.inputs
        fused = fuse(graph, list(m.nodes) + [add], "SkipSimplifiedLayerNormalization", [a, b, gamma],
                     m.root.outputs[0], attrs={"epsilon": m.eps},
                     name=f"{m.root.name}/SkipRMSNorm" if m.root.name else None)
        if keep_sum:  # outputs: output, (mean), (inv_std_var), input_skip_bias_sum
            fused.outputs.extend([empty_input(), empty_input(), m.x])
        return {"op": "com.microsoft.SkipSimplifiedLayerNormalization", "input": a.name, "skip": b.name,
                "epsilon": m.eps, "sum_output": keep_sum, "replaced": len(m.nodes) + 1}
