"""Facts about a graphsurgeon graph: the one place rules read constants, shapes, dtypes, domains,
producers, readers and subgraphs.

* :func:`constant_value` reads a tensor that is fixed at run time: an initializer (``gs.Constant``) or
  the output of an ONNX ``Constant`` node (every value attribute: ``value``, ``value_float(s)``,
  ``value_int(s)``, through :func:`.constants.constant_node_value`, the reader
  protobuf graphs use too). A graph input is never constant, even when an
  initializer of the same name gives it a default, because the caller may feed it.
* :func:`shape_of` / :func:`declared_shape` give shapes as tuples of ints, dim-param strings and
  ``None`` (unknown); :func:`dtype_of` the numpy dtype.
* :func:`is_default_domain` is the ONNX-domain test (``""``, ``"ai.onnx"`` or unset).
* :func:`producer_of`, :func:`consumers`, :func:`sole_consumer_problem`, :func:`only_read_by`,
  :func:`internal_problem` describe the structure a rewrite relies on; :func:`subgraphs` and
  :func:`graphs_within` the If/Loop/Scan bodies (which graph owns which node: :mod:`.scopes`);
  :func:`value_sources` the graph inputs whose values a tensor is computed from (what a user's promise
  about an input, ``--right-padded``, can vouch for).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.engine.rule import Refuse
from onnxfuse.rewrites.facts.constants import constant_node_value

#: Domain of ONNX Runtime's contrib operators.
MS_DOMAIN = "com.microsoft"

FP16, FP32, FP64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)
try:  # bfloat16 where numpy knows it (ml_dtypes, shipped with onnx)
    import ml_dtypes

    #: bfloat16's numpy dtype, as onnx reads a bfloat16 tensor; the tuple is empty without ml_dtypes, so that a
    #: rule's dtype list can always say ``(FP16, FP32) + BF16``. A contrib rule lists it where ONNX Runtime's
    #: CUDA provider has a bfloat16 kernel of the op it writes: read from onnxruntime-gpu 1.31.1's
    #: ``libonnxruntime_providers_cuda.so``, whose kernel classes' type names (``strings``) show the
    #: instantiations for ``BFloat16``: Attention, MultiHeadAttention, FastGelu, BiasGelu (its kernels),
    #: QuickGelu, SkipLayerNorm (plain and simplified), LayerNorm (LayerNormalization and
    #: SimplifiedLayerNormalization), RMSNorm, RotaryEmbedding and GroupQueryAttention; not com.microsoft
    #: Gelu. Their CPU kernels take no bfloat16, and a bfloat16 model is validated on CUDA only
    #: (:mod:`onnxfuse.precision_kernels`).
    BF16: tuple[np.dtype, ...] = (np.dtype(ml_dtypes.bfloat16),)
except ImportError:  # an onnx without ml_dtypes: no rule takes bfloat16
    BF16 = ()

#: The narrow float types a softmax island (a float32 Softmax between Casts) or a fused op computes in:
#: float16, and bfloat16 where numpy knows it.
LOW_FLOATS: tuple[np.dtype, ...] = (FP16,) + BF16


def is_float_dtype(dtype) -> bool:
    """A floating-point element type: numpy's kind "f", or bfloat16 (ml_dtypes' kind is "V")."""
    return dtype is not None and (np.dtype(dtype).kind == "f" or np.dtype(dtype) in BF16)


def float_eps(dtype) -> float:
    """The machine epsilon of a float element type (bfloat16's is 2⁻⁷), float32's for anything else."""
    if dtype is not None and np.dtype(dtype) in BF16:
        return float(ml_dtypes.finfo(np.dtype(dtype)).eps)
    return float(np.finfo(dtype if is_float_dtype(dtype) else FP32).eps)


# --- domains and ops -------------------------------------------------------------------------------


def is_default_domain(node) -> bool:
    return node.domain in ("", "ai.onnx", None)


def is_op(node, *ops: str) -> bool:
    """``node`` is one of ``ops`` in the ONNX domain (``None`` is no op)."""
    return node is not None and node.op in ops and is_default_domain(node)


def is_ms_op(node, *ops: str) -> bool:
    return node is not None and node.op in ops and node.domain == MS_DOMAIN


def nodes_of(graph, *ops: str):
    return [n for n in graph.nodes if is_op(n, *ops)]


def int_attr(node, name, default):
    return int(node.attrs.get(name, default))


def opset_of(graph, default: int = 13) -> int:
    """The graph's default-domain opset (``default`` when unset)."""
    return int(getattr(graph, "opset", None) or default)


# --- constants ---------------------------------------------------------------------------------------


def constant_producer(tensor):
    """The ONNX ``Constant`` node writing ``tensor``, or ``None``."""
    if len(tensor.inputs) == 1:
        node = tensor.inputs[0]
        if node.op == "Constant" and is_default_domain(node):
            return node
    return None


def constant_value(graph, tensor) -> np.ndarray | None:
    """The value of ``tensor`` when it is fixed at run time, else ``None``."""
    if tensor is None or tensor.is_empty():
        return None
    if any(t is tensor for t in graph.inputs):
        return None
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    node = constant_producer(tensor)
    return constant_node_value(node) if node is not None else None


def scalar_constant(graph, tensor) -> np.ndarray | None:
    """The value of a size-1 float constant (any rank), else ``None``. A bfloat16 one (onnx reads it as
    ml_dtypes' bfloat16, whose numpy kind is "V", not "f") comes as float32, which holds it exactly: its
    readers use the number (an ε, an exponent, a scale), and the constant itself stays as it is."""
    value = constant_value(graph, tensor)
    if value is not None and value.dtype.name == "bfloat16":
        value = value.astype(np.float32)
    if value is None or value.size != 1 or value.dtype.kind != "f":
        return None
    return value


def unit_range_limit(graph, node):
    """The limit of ``node`` when it is ``Range(0, limit, 1)`` (start and delta size-1 constants equal to
    0 and 1), else None: the index grid whose length is its limit."""
    if not is_op(node, "Range") or len(node.inputs) != 3:
        return None
    start, delta = constant_value(graph, node.inputs[0]), constant_value(graph, node.inputs[2])
    if start is None or delta is None or start.size != 1 or delta.size != 1:
        return None
    return node.inputs[1] if float(start.reshape(-1)[0]) == 0 and float(delta.reshape(-1)[0]) == 1 else None


def is_whole_shape_read(node) -> bool:
    """``node`` is ``Shape(t)`` of all of t's dimensions (no start or end)."""
    return is_op(node, "Shape") and not node.attrs.get("start", 0) and node.attrs.get("end") is None


# --- shapes and dtypes ---------------------------------------------------------------------------------


def perm_of(node) -> list[int] | None:
    """The ``perm`` of a Transpose node ([] when the attribute is absent: all axes reversed, which no
    caller matches), None for any other node."""
    return [int(v) for v in node.attrs.get("perm", [])] if is_op(node, "Transpose") else None


def axes_of(graph, node) -> list[int] | None:
    """The ``axes`` of a Squeeze/Unsqueeze/Reduce node: the attribute (before opset 13/18) or the constant
    second input; None when neither is given (all axes, or not known here)."""
    if len(node.inputs) > 1 and not node.inputs[1].is_empty():
        value = constant_value(graph, node.inputs[1])
        return None if value is None else [int(v) for v in np.asarray(value).reshape(-1)]
    axes = node.attrs.get("axes")
    return None if axes is None else [int(v) for v in axes]


def declared_shape(tensor):
    """The shape graphsurgeon holds for ``tensor`` as a tuple of ints / dim-param strings / ``None``
    (unknown dimension), or ``None`` when the rank is unknown."""
    shape = getattr(tensor, "shape", None)
    if shape is None:
        return None
    return tuple(int(d) if isinstance(d, (int, np.integer)) and d >= 0 else (d if isinstance(d, str) and d else None)
                 for d in shape)


def shape_of(graph, tensor):
    """A constant's shape, else the declared one (:func:`declared_shape`)."""
    value = constant_value(graph, tensor)
    if value is not None:
        return tuple(int(d) for d in value.shape)
    return declared_shape(tensor)


def rank_of(graph, tensor) -> int | None:
    s = shape_of(graph, tensor)
    return None if s is None else len(s)


def dims_equal(a, b) -> bool:
    """True when two dimensions are provably equal (same value, or the same named dim-param)."""
    if a is None or b is None:
        return False
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    return int(a) == int(b)


def shapes_equal(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(dims_equal(x, y) for x, y in zip(a, b))


def last_dim(graph, tensor) -> int | None:
    """The last dimension of ``tensor`` when known: from its shape, else from a MatMul/Gemm with constant B."""
    s = shape_of(graph, tensor)
    if s and isinstance(s[-1], (int, np.integer)):
        return int(s[-1])
    p = producer_of(tensor)
    if is_op(p, "MatMul"):
        b = constant_value(graph, p.inputs[1])
        if b is not None and b.ndim >= 2:
            return int(b.shape[-1])
    if is_op(p, "Gemm"):
        b = constant_value(graph, p.inputs[1])
        if b is not None and b.ndim == 2:
            return int(b.shape[0] if int_attr(p, "transB", 0) else b.shape[1])
    return None


#: Pointwise ops of the ONNX domain: each output element is a function of the inputs' elements at its
#: broadcast index alone (numpy broadcasting, no axis attribute, any layout).
POINTWISE = frozenset({
    "Abs", "Add", "BitShift", "Cast", "Ceil", "Celu", "Clip", "Cos", "Div", "Elu", "Equal", "Erf", "Exp",
    "Floor", "Gelu", "Greater", "GreaterOrEqual", "HardSigmoid", "HardSwish", "Identity", "IsInf", "IsNaN",
    "LeakyRelu", "Less", "LessOrEqual", "Log", "Max", "Mean", "Min", "Mish", "Mod", "Mul", "Neg", "Not",
    "Pow", "PRelu", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Softplus",
    "Softsign", "Sqrt", "Sub", "Sum", "Tan", "Tanh", "ThresholdedRelu", "Where", "And", "Or", "Xor",
})


#: Ops whose output elements are elements of their first input: a property of the values that holds
#: through them (non-negative sizes here; 0/1 keep masks in ``attention/keep_masks.promised_zero_one``).
REARRANGING = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten", "Gather", "Slice", "Expand",
                          "Transpose", "Tile"})


def provably_nonnegative(graph, tensor, depth: int = 0) -> bool:
    """True when every element of the integer ``tensor`` is ≥ 0 by construction: a ``Shape`` or ``Size``
    (sizes are never negative), a constant with no negative element, an integer ``Range`` from a start
    ≥ 0 by a step > 0 (an index grid: its values are start + k·step), or elements picked, rearranged,
    concatenated, added, multiplied, divided or maximised from such values. Casts between integer types count
    only when widening or keeping the width (a narrowing cast could wrap a size to a negative number).
    Sums and products of sizes are taken not to overflow int64 (a tensor of 2⁶³ elements cannot exist)."""
    value = constant_value(graph, tensor)
    if value is not None:
        return value.dtype.kind in "iub" and bool(np.all(value >= 0))
    node = producer_of(tensor)
    if node is None or depth > 16 or not is_default_domain(node):
        return False
    if node.op in ("Shape", "Size"):
        return True
    if node.op == "Range" and len(node.inputs) == 3:  # start + k·delta, k = 0, 1, ...
        start, delta = constant_value(graph, node.inputs[0]), constant_value(graph, node.inputs[2])
        return (start is not None and delta is not None and start.size == 1 and delta.size == 1
                and start.dtype.kind in "iu" and float(start.reshape(-1)[0]) >= 0 and float(delta.reshape(-1)[0]) > 0)
    if node.op in REARRANGING:
        return provably_nonnegative(graph, node.inputs[0], depth + 1)
    if node.op in ("Concat", "Add", "Mul", "Max", "Div"):  # integer Div of sizes: ≥ 0, or a division error
        return all(provably_nonnegative(graph, t, depth + 1) for t in node.inputs)
    if node.op == "Cast":
        src, to = dtype_of(graph, node.inputs[0]), int(node.attrs.get("to", 0))
        widths = {6: 4, 7: 8}  # TensorProto.INT32, INT64
        return (src is not None and src.kind == "i" and to in widths and widths[to] >= src.itemsize
                and provably_nonnegative(graph, node.inputs[0], depth + 1))
    return False


def dtype_of(graph, tensor) -> np.dtype | None:
    """The numpy element type of ``tensor``, or None where unknown. graphsurgeon keeps a type numpy lacks
    as its ONNX enum (bfloat16: 16), which is read through onnx's own table (ml_dtypes' bfloat16)."""
    value = constant_value(graph, tensor)
    if value is not None:
        return value.dtype
    dtype = getattr(tensor, "dtype", None)
    if dtype is None:
        return None
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        try:
            return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(dtype))
        except (KeyError, TypeError, ValueError):
            return None
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def first_known_dtype(graph, *tensors):
    for t in tensors:
        d = dtype_of(graph, t)
        if d is not None:
            return d
    return None


# --- producers and readers -------------------------------------------------------------------------------


def is_alive(node) -> bool:
    """A node is alive until a rewrite disconnects it (clears its outputs)."""
    return bool(node.outputs)


def producer_of(tensor):
    """The node writing ``tensor``, or ``None`` (graph input, initializer)."""
    return tensor.inputs[0] if len(tensor.inputs) == 1 else None


def slice_bounds(graph, node, constant_ends: bool = True):
    """(starts, ends, axes, steps) of a Slice as int lists (attributes before opset 10, constant inputs
    from it), or None when any is not constant; with ``constant_ends=False``, ends computed at run time
    give ``ends = None`` instead (the caller proves them otherwise)."""
    if "starts" in node.attrs:
        starts, ends = list(node.attrs["starts"]), list(node.attrs["ends"])
        axes = list(node.attrs.get("axes", range(len(starts))))
        return starts, ends, axes, [1] * len(starts)
    given = [t if not t.is_empty() else None for t in node.inputs[1:5]]
    given += [None] * (4 - len(given))  # axes and steps are optional
    starts, ends, axes, steps = (None if t is None else constant_value(graph, t) for t in given)
    if starts is None or (ends is None and (constant_ends or given[1] is None)) \
            or (given[2] is not None and axes is None) or (given[3] is not None and steps is None):
        return None  # a bound given but computed at run time
    starts = [int(v) for v in starts.reshape(-1)]
    ends = None if ends is None else [int(v) for v in ends.reshape(-1)]
    axes = list(range(len(starts))) if axes is None else [int(v) for v in axes.reshape(-1)]
    steps = [1] * len(starts) if steps is None else [int(v) for v in steps.reshape(-1)]
    return starts, ends, axes, steps


def computed_from(tensors, sources: set, except_shape_reads: bool = False) -> bool:
    """Whether any of ``tensors`` is, or is computed from, a tensor whose ``id`` is in ``sources``;
    ``except_shape_reads``: not counting a path through a ``Shape`` of one of them (its size only, which
    a rewrite may re-derive). A rewrite that makes ``sources`` from ``tensors`` would otherwise close a
    cycle."""
    seen, stack = set(), list(tensors)
    while stack:
        tensor = stack.pop()
        if id(tensor) in sources:
            return True
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        node = producer_of(tensor)
        if node is not None and not (except_shape_reads and is_op(node, "Shape") and id(node.inputs[0]) in sources):
            stack.extend(node.inputs)
    return False


#: Ops that read only their input's shape, never its values.
SHAPE_READS = ("Shape", "Size")


def value_sources(tensor) -> set[str] | None:
    """The graph inputs whose values ``tensor`` is computed from (constants and initializers are not
    inputs; the input of a Shape or Size contributes only its shape, so it is not followed), or None
    when the computation passes through a node with subgraphs (their outer-scope reads are implicit)."""
    sources: set[str] = set()
    seen: set[int] = set()
    stack = [tensor]
    while stack:
        t = stack.pop()
        if id(t) in seen or isinstance(t, gs.Constant):
            continue
        seen.add(id(t))
        if not t.inputs:
            if t.name:
                sources.add(t.name)
            continue
        node = t.inputs[0]
        if next(subgraphs(node), None) is not None:
            return None
        if is_op(node, *SHAPE_READS):
            continue
        stack.extend(i for i in node.inputs if not i.is_empty())
    return sources


def consumers(tensor) -> list:
    """Distinct nodes reading ``tensor`` (a node reading it twice appears once)."""
    seen, out = set(), []
    for n in tensor.outputs:
        if id(n) not in seen:
            seen.add(id(n))
            out.append(n)
    return out


def other_input(node, tensor):
    """The input of a binary ``node`` that is not ``tensor`` (``None`` when both are)."""
    a, b = node.inputs[0], node.inputs[1]
    if a is tensor and b is not tensor:
        return b
    if b is tensor and a is not tensor:
        return a
    return None


def is_graph_output(graph, tensor) -> bool:
    return any(t is tensor for t in graph.outputs)


def sole_consumer_problem(graph, tensor, consumer) -> Refuse | None:
    """A refusal unless ``consumer`` is the only reader of ``tensor`` and it is not a graph output."""
    if is_graph_output(graph, tensor):
        return Refuse(f"intermediate tensor {tensor.name!r} is also a graph output")
    readers = [n for n in tensor.outputs if n is not consumer]
    if readers:
        return Refuse(f"intermediate tensor {tensor.name!r} is also read by {readers[0].name or readers[0].op!r}")
    if sum(1 for t in consumer.inputs if t is tensor) != 1:
        return Refuse(f"intermediate tensor {tensor.name!r} is read more than once by {consumer.name!r}")
    return None


def sole_reader(graph, tensor):
    """The one node reading ``tensor`` when exactly one does and it is not a graph output (so removing
    its producer with that reader orphans nothing), else None."""
    readers = consumers(tensor)
    if len(readers) != 1 or is_graph_output(graph, tensor):
        return None
    return readers[0]


def only_read_by(graph, tensor, allowed) -> Refuse | None:
    """A refusal unless every reader of ``tensor`` is in ``allowed`` and it is not a graph output."""
    if is_graph_output(graph, tensor):
        return Refuse(f"intermediate tensor {tensor.name!r} is also a graph output")
    ids = {id(n) for n in allowed}
    for n in tensor.outputs:
        if id(n) not in ids:
            return Refuse(f"intermediate tensor {tensor.name!r} is also read by {n.name or n.op!r}", n)
    return None


def internal_problem(graph, nodes, root) -> Refuse | None:
    """Every node in ``nodes`` except ``root`` must be read only from inside ``nodes`` (and not be an output)."""
    inside = {id(n) for n in nodes}
    for n in nodes:
        if n is root:
            continue
        for out in n.outputs:
            if is_graph_output(graph, out):
                return Refuse(f"intermediate tensor {out.name!r} is also a graph output", n)
            for c in out.outputs:
                if id(c) not in inside:
                    return Refuse(f"intermediate tensor {out.name!r} is also read by {c.name or c.op!r}", c)
    return None


# --- subgraphs ---------------------------------------------------------------------------------------------


def subgraphs(node):
    """The graphs held in ``node``'s attributes (If branches, Loop and Scan bodies)."""
    for value in node.attrs.values():
        for sub in (value if isinstance(value, list) else [value]):
            if isinstance(sub, gs.Graph):
                yield sub


def graphs_within(graph):
    """``graph`` and every subgraph below it, outermost first."""
    yield graph
    for node in graph.nodes:
        for sub in subgraphs(node):
            yield from graphs_within(sub)
