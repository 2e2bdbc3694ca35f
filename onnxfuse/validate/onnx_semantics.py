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
models that compute in float16, validated on the CPU. Up to :data:`MAX_WEIGHT_BYTES` of weights it is ONNX's
reference evaluator; above (numpy is far slower than ONNX Runtime) it is ONNX Runtime's CPU provider on the
model rewritten to round every float16 result explicitly (:func:`per_op_rounding`: each op computed in
float32 from float16 values, its result rounded to float16 by a Cast pair, optimizations off so the pair
stays), which is ONNX's semantics wherever an op's float32 result rounds to its correctly rounded float16
one (every elementwise arithmetic op; a reduction or MatMul then accumulates in float32, as GPUs do). A model
neither can evaluate (an op of another domain, a subgraph for the rewrite) gets no such run, as before.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import numpy_helper

from onnxfuse.lazy_weights import is_lazy, map_tensor, tensor_nbytes
from onnxfuse.model_io import infer_shapes, node_subgraphs, proto_graphs, value_types
from onnxfuse.runtime.compare import lowest_float_precision
from onnxfuse.runtime.session import run_samples

#: The largest model (bytes of initializers, subgraphs included) evaluated by numpy for the floor: 8 MiB of
#: float16 weights, 4 M parameters; the 0.43 MB Phi-3 export above evaluates in 0.05 s per sample.
MAX_WEIGHT_BYTES = 8 << 20


def onnx_semantics_runs(original: onnx.ModelProto, samples: list, provider: str) -> list[dict] | None:
    """The original's outputs on each sample as ONNX's reference evaluator computes them (a dict of outputs
    per sample), or None where this run does not apply or fails (module docstring)."""
    if provider != "cpu" or lowest_float_precision(original) != "float16":
        return None
    if sum(tensor_nbytes(t) for g in proto_graphs(original.graph) for t in g.initializer) > MAX_WEIGHT_BYTES:
        return _rounded_runs(original, samples)
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


def _rounded_runs(original: onnx.ModelProto, samples: list) -> list[dict] | None:
    """:func:`per_op_rounding`'s model on each sample on ONNX Runtime's CPU provider (optimizations off), or
    None where the rewrite or the run does not apply."""
    try:  # a model shape inference or ONNX Runtime refuses in float32: no such run, as before
        rounded = per_op_rounding(original)
        if rounded is None:
            return None
        return run_samples(rounded, samples, "cpu", name="the original rounded as ONNX specifies")
    except Exception:  # noqa: BLE001
        return None


#: Attributes that name an element type (ONNX's ``dtype`` of EyeLike and the Random ops); Cast's ``to`` is
#: handled on its own (a float16 Cast keeps its rounding).
_DTYPE_ATTRS = {"dtype"}
_F16, _F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT


def per_op_rounding(original: onnx.ModelProto, low: int = _F16) -> onnx.ModelProto | None:
    """``original`` computing in float32 with every float16 result rounded to float16 explicitly: float16
    initializers and constants become float32 (exact), each float16 graph input is cast up, each node output
    that is float16 in ``original`` (ONNX's shape inference) is followed by ``Cast(to=float16)`` and
    ``Cast(to=float32)`` (a float16 ``Cast`` keeps its own rounding and gets the second only), and each float16
    graph output is the rounded float16 tensor under its own name. None for models with subgraphs (If, Loop,
    Scan: their bodies would need the same rewrite).

    ``low``: the low type's ONNX element type, ``TensorProto.BFLOAT16`` for a bfloat16 model: the same
    rewrite, which is also how a bfloat16 model runs on ONNX Runtime's CPU provider at all (it has bfloat16
    ``Cast`` but few bfloat16 kernels besides), each result rounded as CUDA's bfloat16 kernels round it."""
    if any(node_subgraphs(n) for n in original.graph.node):
        return None
    g = infer_shapes(original).graph  # best effort: a tensor it cannot type is computed in float32, unrounded
    types = value_types(g)
    outputs = {o.name for o in g.output}
    renamed: dict[str, str] = {}  # a float16 tensor's name -> its float32 copy's
    nodes = []
    for vi in g.input:
        if types.get(vi.name) == low:
            renamed[vi.name] = f"{vi.name}__as_f32"
            nodes.append(onnx.helper.make_node("Cast", [vi.name], [renamed[vi.name]], to=_F32))
    initializers = []
    for t in g.initializer:
        if t.data_type == low:  # weights held on disk (lazy_weights) are read through their mapping
            values = map_tensor(t) if is_lazy(t) else numpy_helper.to_array(t)
            t = numpy_helper.from_array(np.asarray(values).astype(np.float32), t.name)
        initializers.append(t)
    for node in g.node:
        node = _widened(node, low)
        node.input[:] = [renamed.get(i, i) for i in node.input]
        is_half_cast = node.op_type == "Cast" and node.domain in ("", "ai.onnx") and any(
            a.name == "to" and a.i == low for a in node.attribute)
        rounding = []
        for k, out in enumerate(node.output):
            if not out or types.get(out) != low:
                continue
            half = out  # a float16 Cast rounds by itself; its readers take the float32 copy below
            if not is_half_cast:  # computed in float32, rounded by a Cast (under the output's name if a graph output)
                node.output[k] = f"{out}__f32_result"
                half = out if out in outputs else f"{out}__rounded"
                rounding.append(onnx.helper.make_node("Cast", [node.output[k]], [half], to=low))
            renamed[out] = f"{out}__as_f32"
            rounding.append(onnx.helper.make_node("Cast", [half], [renamed[out]], to=_F32))
        nodes.append(node)
        nodes.extend(rounding)
    graph = onnx.helper.make_graph(nodes, g.name, list(original.graph.input), list(original.graph.output),
                                   initializers)
    model = onnx.helper.make_model(graph, opset_imports=list(original.opset_import))
    model.ir_version = original.ir_version
    return model


def _widened(node: onnx.NodeProto, low: int = _F16) -> onnx.NodeProto:
    """A copy of ``node`` whose float16 (``low``) constants (Constant's and ConstantOfShape's ``value``) and
    element type attributes (``dtype``) are float32."""
    node = onnx.NodeProto.FromString(node.SerializeToString())
    for a in node.attribute:
        if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == low:
            a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
        elif a.name in _DTYPE_ATTRS and a.type == onnx.AttributeProto.INT and a.i == low:
            a.i = _F32
    return node
