"""``--precision bf16``: which nodes stay float32 because ONNX Runtime's CUDA provider has no bfloat16 kernel
for their op, and whether this run can use bfloat16 at all.

Why: float16 is broadly covered by ONNX Runtime's CUDA kernels; bfloat16 less so: comparisons (``Equal``,
``Less``, ``Greater``), ``Clip``, ``Log``, ``Reciprocal``, ``ReduceMax``, ``BatchNormalization``, ``MaxPool``,
``GlobalAveragePool``, ``Resize``, ``Pad``, ``CumSum`` and the fused ``EmbedLayerNormalization`` have none in
the tables we read (ONNX Runtime 1.14's had none for ``Erf``, ``Pow``, ``Sqrt``, ``Where``, ``Conv`` or
``Attention`` either). A bfloat16 node without a CUDA kernel is placed on the CPU provider, which has
hardly any bfloat16 kernels either (not ``Add``, ``MatMul``, ``Softmax``), so the session refuses the
model. Such nodes therefore compute in float32, held as the float16 path holds its measured islands
(:func:`onnxfuse.precision.convert_to_fp16`'s ``keep_nodes``: float32 inputs cast up once, results cast
down where bfloat16 readers need them). The fused ops the rewrites then write are the ones whose
bfloat16 kernels exist: a rewrite whose op has none refuses bfloat16 by its own dtype check.

The table (:data:`CUDA_BFLOAT16_OPS`) is ONNX Runtime's ``docs/OperatorKernels.md`` (CUDA provider, the
latest version row of each op; :data:`TABLE_SOURCE`): an op not in it stays float32. It is static so that a
GPU-less run (``--no-validate``) writes the graph a GPU run starts from. A validated run (on CUDA) then loads
the conversion before any rewrite (:func:`installed_kernel_islands`): an op the installed ONNX Runtime
names as unimplemented stays float32 too, with a note; any other refusal is an internal error naming the
conversion. Also kept float32: a node that reads no float32 value but writes one that ONNX's schema at the
model's opset cannot type in bfloat16 (``ConstantOfShape`` before opset 20); the converter's own schema check
covers inputs only.

bfloat16 needs CUDA to be checked: ONNX Runtime's CPU provider cannot run the converted model, so
:func:`bfloat16_usable` refuses ``--device cpu``, ``--provider cpu``, and validation without a usable GPU
(``--no-validate`` writes the model unchecked, as it does for any precision).
"""

from __future__ import annotations

import re

import onnx

from onnxfuse.errors import InternalError, PrecisionError, RuntimeFailure, SessionRefused, UsageError
from onnxfuse.model_io import node_subgraphs, value_types
from onnxfuse.precision import LowFloat, convert_to_fp16, float32_scopes, formal_types
from onnxfuse.repair import default_opset
from onnxfuse.rewrites.facts.inference import onnx_inferred
from onnxfuse.runtime.session import make_session, resolve_provider

#: Where :data:`CUDA_BFLOAT16_OPS` comes from: ONNX Runtime's ``docs/OperatorKernels.md``, CUDA provider, the
#: latest version row of each op, in two copies: microsoft/onnxruntime at 001d12d2 (CUDA opsets up to 24)
#: and a fork tracking its main branch in August 2026 (Amlogic-NN/aml-onnxruntime at dd012d12, opsets up to
#: 28). The newer copy is taken: of the ~100 common ops compared, it adds bfloat16 for ``ReduceMean``,
#: ``Softplus``, ``TopK``, ``Sin`` and ``Cos`` and takes none away. It reads each op's latest version row, and
#: neither copy is the 1.31.1 release's own: a validated run loads the conversion on CUDA first
#: (:func:`installed_kernel_islands`), which keeps float32 whatever the installed version lacks.
TABLE_SOURCE = "ONNX Runtime docs/OperatorKernels.md (CUDA), as of Amlogic-NN/aml-onnxruntime dd012d12 (August 2026)"

_ONNX_DOMAIN = (
    "Abs", "Add", "Attention", "AveragePool", "Cast", "Compress", "Concat", "ConcatFromSequence", "ConstantOfShape",
    "Conv", "Cos", "DeformConv", "Div", "Dropout", "DynamicSlice", "Erf", "Exp", "Expand", "Flatten", "Gather",
    "GatherElements", "GatherND", "Gelu", "Gemm", "HardSigmoid", "HardSwish", "Identity", "If", "IsInf", "IsNaN",
    "LayerNormalization", "Loop", "LpNormalization", "MatMul", "Max", "Min", "Mod", "Mul", "Neg", "Pow",
    "RMSNormalization", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "ReduceMean",
    "ReduceSum", "Relu", "Reshape", "ReverseSequence", "RoiAlign", "RotaryEmbedding", "Scan", "Scatter",
    "ScatterElements", "ScatterND", "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
    "SequenceInsert", "SequenceLength", "Shape", "Sigmoid", "Sign", "SimplifiedLayerNormalization", "Sin", "Size",
    "Slice", "Softmax", "Softplus", "Softsign", "Split", "Sqrt", "Squeeze", "Sub", "Sum", "Tanh", "TensorScatter",
    "Tile", "TopK", "Transpose", "Trilu", "Unsqueeze", "Where",
)
_MICROSOFT_DOMAIN = (
    "Attention", "BiasDropout", "BiasGelu", "BitmaskBiasDropout", "BitmaskDropout", "CausalConvWithState",
    "EngramGate", "FastGelu", "FusedMatMul", "GatedAdd", "GatedDeltaNet", "GatedRMSNorm", "GatherBlockQuantized",
    "Gelu", "GemmFloat8", "GroupQueryAttention", "LinearAttention", "LinearAttentionGate", "MRotaryEmbedding",
    "MatMulBlockQuantizedFp4Weight", "MatMulBlockQuantizedFp8Weight", "MatMulBnb4", "MatMulNBits", "MoE",
    "MultiHeadAttention", "PagedAttention", "QMoE", "QuickGelu", "RotaryEmbedding", "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization", "SparseAttention", "TransposeMatMul", "Trilu", "UnfoldTensor",
    "VarlenCausalConvWithState",
)
#: ``(domain, op type)`` of the ops whose CUDA kernel (latest version) takes bfloat16 for its float inputs.
CUDA_BFLOAT16_OPS: frozenset[tuple[str, str]] = frozenset(
    [("", op) for op in _ONNX_DOMAIN] + [("com.microsoft", op) for op in _MICROSOFT_DOMAIN])

#: ops ONNX Runtime turns into initializers when it loads the model: they need no kernel
FOLDED_AT_LOAD = frozenset({"Constant"})


def has_bfloat16_kernel(node: onnx.NodeProto) -> bool:
    """Whether ONNX Runtime's CUDA provider runs ``node``'s op in bfloat16 (:data:`CUDA_BFLOAT16_OPS`)."""
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return (domain, node.op_type) in CUDA_BFLOAT16_OPS


def kernel_islands(model: onnx.ModelProto, target: LowFloat) -> dict[str, str]:
    """``{node name: why}``: the main-graph nodes that read or write a float32 value and whose op has no
    bfloat16 CUDA kernel, to stay float32 (module docstring). Refused with one line
    (:class:`~onnxfuse.errors.PrecisionError`) when such a node has no name (the converter keeps nodes by
    name) or sits in a subgraph (If/Loop/Scan bodies: the converter keeps main-graph nodes only). Which
    values are float32 is ONNX type inference's word, per graph (:func:`~onnxfuse.precision.float32_scopes`,
    in the order the converter visits the graphs), as the converter reads them."""
    scopes = iter(float32_scopes(model))
    floats = next(scopes)
    opset = default_opset(model) or 17  # none imported (load's repair adds one): a current opset's schemas
    kept: dict[str, str] = {}
    for node in model.graph.node:
        if node_subgraphs(node):
            _check_bodies(node, target, scopes, opset)
        why = _why_float32(node, floats, target, opset)
        if why is None:
            continue
        if not node.name:
            raise PrecisionError(f"an unnamed {node.op_type} node cannot compute in {target.name} ({why}) and cannot "
                                 "be kept float32 (the converter keeps nodes by name)")
        kept[node.name] = why
    return kept


def _why_float32(node: onnx.NodeProto, floats: set[str], target: LowFloat, opset: int) -> str | None:
    """Why ``node`` must compute in float32 under ``target``, or None: its op has no CUDA kernel for the
    type, or (a node that reads no float32 value but writes one: ``ConstantOfShape``, ``RandomNormal``)
    ONNX's schema at the model's opset gives its output no such type, which the converter's input-side
    schema check cannot see (``ConstantOfShape`` writes bfloat16 only from opset 20)."""
    if not _touches(node, floats) or node.op_type in FOLDED_AT_LOAD:
        return None
    if not has_bfloat16_kernel(node):
        return f"{node.op_type} has no {target.name} kernel in ONNX Runtime's CUDA provider"
    if any(v in floats for v in node.input if v) or (node.domain or "") not in ("", "ai.onnx"):
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    for formal in schema.outputs:
        allowed = formal_types(schema, formal)
        if "tensor(float)" in allowed and f"tensor({target.name})" not in allowed:
            return f"ONNX's {node.op_type} at opset {opset} writes no {target.name}"
    return None


def _touches(node: onnx.NodeProto, floats: set[str]) -> bool:
    """Whether ``node`` reads or writes one of the float32 values ``floats``."""
    return any(v in floats for v in list(node.input) + list(node.output) if v)


def _check_bodies(node: onnx.NodeProto, target: LowFloat, scopes, opset: int) -> None:
    """Refuse a body holding a float op without a bfloat16 kernel (only main-graph nodes can be kept).
    ``scopes``: the remaining per-graph float32 value sets, consumed in the converter's order (each body,
    then the bodies within it, depth first)."""
    for body in node_subgraphs(node):
        floats = next(scopes, set())
        for inner in body.node:
            if node_subgraphs(inner):
                _check_bodies(inner, target, scopes, opset)
            why = _why_float32(inner, floats, target, opset)
            if why is not None:
                raise PrecisionError(
                    f"{node.op_type} {node.name!r} holds a {inner.op_type} node that cannot compute in {target.name} "
                    f"({why}); nodes inside If/Loop/Scan bodies cannot be kept float32 (use --precision fp16, or "
                    "fp32)")


#: ONNX Runtime's words when no provider has a kernel for a node's op at its version and types
_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
#: The most op types :func:`installed_kernel_islands` adds before it gives up (each costs a conversion and a
#: session): the table misses a few ops at most, never dozens.
MAX_ROUNDS = 8


def installed_kernel_islands(model: onnx.ModelProto, target: LowFloat, keep: dict[str, str],
                             source: str = "model") -> tuple[dict[str, str], list[str]]:
    """``keep`` plus the main-graph nodes whose op the *installed* ONNX Runtime has no CUDA kernel for in
    ``target`` at the model's opset, and a note per op added. The static table reads the latest version
    row of each op; an older opset's row can lack bfloat16 where the latest has it (a model at opset 14
    gets the 14 row's kernel), and the table is not the installed release's own. So the conversion is
    loaded on CUDA (no run, no inputs): while ONNX Runtime names a node it has no implementation for, every
    node of that op that touches a float32 value stays float32 and the model is converted again.

    Raises :class:`~onnxfuse.errors.InternalError` (naming the conversion) when the session refuses the
    conversion for another reason, or names an op already kept or seen :data:`MAX_ROUNDS` times: our own
    conversion that ONNX Runtime cannot load is our error, never the user's."""
    keep, notes = dict(keep), []
    floats = float32_scopes(model)[0]
    for _ in range(MAX_ROUNDS):
        converted, _ = convert_to_fp16(model, keep_nodes=keep, target=target)
        try:
            make_session(converted, "cuda", name=f"{source} ({target.name}, no rewrite)")
            return keep, notes
        except SessionRefused as exc:
            found = _NO_KERNEL.search(str(exc))
            added = {} if found is None else {
                n.name: f"{n.op_type} has no {target.name} kernel at opset {found.group(2)} in the installed "
                        "ONNX Runtime's CUDA provider (its session said so)"
                for n in model.graph.node if n.op_type == found.group(1) and n.name and n.name not in keep
                and _touches(n, floats)}
            if not added:
                raise InternalError(f"the {target.name} conversion of the model (onnxfuse's own, before any rewrite) "
                                    f"cannot be loaded by ONNX Runtime's CUDA provider: {exc}") from None
            keep.update(added)
            op, version = found.group(1), found.group(2)
            notes.append(f"--precision {target.short}: {len(added)} {op} node(s) stay float32: the installed ONNX "
                         f"Runtime has no CUDA {target.name} kernel for {op}({version}) (the static table lists one "
                         "for the op's latest version)")
    raise InternalError(f"the {target.name} conversion still cannot be loaded on CUDA after {MAX_ROUNDS} op types "
                        "were kept float32")


def nodes_without_a_bfloat16_kernel(model: onnx.ModelProto) -> list[str]:
    """``"op name"`` of each main-graph node of ``model`` (a ``--precision bf16`` output) that reads or writes a
    bfloat16 value by ONNX's strict, type-checking inference (which raises on an ill-typed model) and whose op
    ONNX Runtime's CUDA provider runs in no bfloat16 kernel (:data:`CUDA_BFLOAT16_OPS`; onnxfuse's own ops
    take bfloat16, a ``Constant`` is folded at load): a session would refuse the model. Found a ``ReduceMax``
    of the attention's row factor this way, first on a GPU; checks GPU-less runs (the tests,
    ``tools/precision_corpus_check.py``)."""
    # start-up: the command line starts (and --help runs) without onnxfuse.custom_ops
    from onnxfuse.custom_ops import DOMAIN

    types = value_types(onnx_inferred(model, strict=True, check_type=True).graph)
    return [f"{n.op_type} {n.name}" for n in model.graph.node
            if any(types.get(t) == onnx.TensorProto.BFLOAT16 for t in [*n.input, *n.output] if t)
            and n.domain != DOMAIN and n.op_type not in FOLDED_AT_LOAD and not has_bfloat16_kernel(n)]


def bfloat16_usable(options) -> None:
    """Refuse a ``--precision bf16`` run that cannot check its result (module docstring). ``options``: the
    run's :class:`onnxfuse.pipeline.OptimizeOptions` (read here, never imported)."""
    if options.device == "cpu":
        raise UsageError("--precision bf16 is for ONNX Runtime's CUDA provider: its CPU provider has almost no "
                         "bfloat16 kernels (use --device cuda, or --precision fp32 for the CPU)")
    if not options.validate:
        return
    if (options.provider or "auto").lower() == "cpu":
        raise UsageError("--precision bf16 is validated on ONNX Runtime's CUDA provider: --provider cpu cannot run "
                         "a bfloat16 model (use --provider cuda or auto)")
    if resolve_provider(options.provider) != "cuda":
        raise RuntimeFailure("--precision bf16 is validated on ONNX Runtime's CUDA provider, and no usable CUDA GPU "
                             "was found (--no-validate writes the model unchecked)")


__all__ = ["CUDA_BFLOAT16_OPS", "MAX_ROUNDS", "TABLE_SOURCE", "bfloat16_usable", "has_bfloat16_kernel",
           "installed_kernel_islands", "kernel_islands", "nodes_without_a_bfloat16_kernel"]
