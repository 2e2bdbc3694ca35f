"""A small float16 model run as ONNX specifies it: one more legitimate run of the original for the noise floor
on the CPU provider.

Why: ONNX rounds every float16 op's result to float16; ONNX Runtime's CPU provider computes chains of
float16 ops in float32 and rounds once (ORT 1.32, a float16 MatMul + Add of random 64x64 values,
optimizations off: 99.95% of the outputs equal one rounding of the exact sum, 71% two roundings; an
explicit Cast pair, Identity or Reshape between them changes nothing). Our kernels round as ONNX says
(FusedElementwise, MixedRMSNorm, AttentionInputs' bias), as ONNX Runtime's CUDA provider does. So on the
CPU a float16 model's rewritten outputs differ from the original's by float16 rounding that is not the
rewrite's fault, while the original's floor (optimizations off against on) is often exactly 0: optimum's
float16 Phi-3 export (two layers, hidden 64) failed on ``logits`` by 0.00354 against an atol of 0.0031,
and the original run by ONNX's reference evaluator is 0.00342 from its own CPU run (docs/benchmarks.md
5.38). On a GPU the floor already holds the original's CPU-against-CUDA difference, which is this one.

The run: ``onnx.reference.ReferenceEvaluator`` (numpy, ONNX's own semantics) on each sample, made by
:meth:`onnxfuse.validate.verdict.Validator.validate` when a candidate first fails (numpy's cost, about a
third of the contrib rewrite tests' time when it ran for every float16 model, is then paid only where it
can change a verdict). Only for
models that compute in float16, validated on the CPU, with at most :data:`MAX_WEIGHT_BYTES` of weights
(numpy is far slower than ONNX Runtime); a model it cannot evaluate (an op of another domain, say) gets no
such run, as before.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx

from onnxfuse.lazy_weights import tensor_nbytes
from onnxfuse.model_io import proto_graphs
from onnxfuse.runtime.compare import lowest_float_precision

#: The largest model (bytes of initializers, subgraphs included) evaluated by numpy for the floor: 8 MiB of
#: float16 weights, 4 M parameters; the 0.43 MB Phi-3 export above evaluates in 0.05 s per sample.
MAX_WEIGHT_BYTES = 8 << 20


def onnx_semantics_runs(original: onnx.ModelProto, samples: list, provider: str) -> list[dict] | None:
    """The original's outputs on each sample as ONNX's reference evaluator computes them (a dict of outputs
    per sample), or None where this run does not apply or fails (module docstring)."""
    if provider != "cpu" or lowest_float_precision(original) != "float16":
        return None
    if sum(tensor_nbytes(t) for g in proto_graphs(original.graph) for t in g.initializer) > MAX_WEIGHT_BYTES:
        return None
    try:
        # start-up: onnx.reference loads every op's numpy implementation; only this run needs them
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(original)
        names = [o.name for o in original.graph.output]
        runs = []
        with warnings.catch_warnings(), np.errstate(all="ignore"):  # masked rows: the original's own NaNs
            warnings.simplefilter("ignore")
            for sample in samples:
                feeds = sample if isinstance(sample, dict) else sample.feeds
                runs.append(dict(zip(names, evaluator.run(None, feeds))))
        return runs
    except Exception:  # noqa: BLE001  (the evaluator raises anything an op's numpy code does)
        return None
