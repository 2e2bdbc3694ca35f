"""``optimize --precision fp16``: a float32 model computing in float16, with float32 inputs and outputs.

Why: ONNX Runtime's fastest CUDA kernels (flash and memory-efficient attention, tensor-core GEMMs
without TF32) need float16, and exporting a model in fp16 is a second export most pipelines do not
have. The converted model is validated against the float32 original at float16's tolerances
(``validate_models(precision="float16")``), and the drift is in every report.

What changes, and what deliberately does not:

* **Interface**: float32 graph inputs keep their type and are cast to float16 once, where they enter;
  float32 graph outputs keep their type and are cast back where they leave. Callers see no change.
* **Values**: float32 initializers and ``Constant`` / ``ConstantOfShape`` values become float16;
  ``Cast(to=float)`` becomes ``Cast(to=float16)`` (of a float16 value: a Cast to its own type, which
  cancel-cast-roundtrip then removes); float32 value annotations follow. In subgraphs
  (If/Loop/Scan bodies) too, so outer values they read keep one type.
* **Softmax islands**: a sentinel (a magnitude of 1e30 and more: ``finfo(float32).min`` in an attention
  mask, standing for -inf) that reaches a ``Softmax`` keeps everything on its way there in float32:
  the mask steps from the sentinel on, the Add (or ``Where``) that applies the mask to the scores (which
  enter through ``Cast(to=float)``), and the Softmax, whose result leaves through ``Cast(to=float16)``
  (after the dynamo exporter's ``Where(IsNaN(p), 0, p)``, which the island keeps).
  Float16 cannot hold the sentinel, and a clamped -65504 is not absorbing: ``s - 65504`` keeps the
  differences of the scores of a row whose every key is masked, which the original makes uniform
  (``s + finfo.min == finfo.min``). Measured on BERT-base with a dynamic sequence (ONNX Runtime CPU,
  two tokens): 0.24 max abs error on a fully masked row, 0.002 on the others. Every float16 attention
  kernel of ONNX Runtime computes its softmax in float32 too, and contrib-attention fuses this island
  form (with the mask as a raw ``mask_index``) exactly.
* **Other sentinels** become ±65504, float16's largest finite value: ``s + (-65504)`` still drives a
  softmax weight to 0 for any score under 100 or so, as the original did, where -inf would turn a
  fully masked row into NaN.
* **Epsilons**: non-zero magnitudes below float16's smallest subnormal (2⁻²⁴ ≈ 6e-8: LayerNorm's 1e-12
  written as an Add) become ±2⁻²⁴, not 0: an epsilon's job is to be non-zero (a constant row would
  otherwise divide by zero). Where the variance is ≥ 1e-3 this moves a LayerNorm by under 3e-5
  relative, far below float16's own rounding; and the decomposed LayerNorm stays one float16 pattern
  that contrib-layernorm fuses (its ``epsilon`` attribute is float32 whatever the data type).
* **Kept in float32**, with Casts around the node that reads it: a constant that float16 cannot hold
  (a finite magnitude above 65504 that is not a sentinel); every input of a node whose ONNX schema does
  not accept float16 there (``Resize``'s scales).
* **Other domains** (no schema here, e.g. ``com.microsoft`` ops already in the model) get float16
  inputs like the rest; ONNX Runtime's type check decides whether they take them, and a model it
  rejects is onnxfuse's own output it cannot load: an internal error (exit 5) naming the conversion.

Refused with one line (:class:`onnxfuse.errors.PrecisionError`, exit 1): a model that declares nothing in
float32 (a float16 model: float32 steps its exporter kept inside, Casts to float around a Softmax,
say, are deliberate and left alone), or
one whose converted form fails ONNX's type inference (the node is named).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxfuse.errors import PrecisionError
from onnxfuse.rewrites.facts.constants import constant_node_value
from onnxfuse.rewrites.facts.inference import onnx_inferred
from onnxfuse.model_io import defined_names, node_subgraphs, proto_graphs, rename_outer_reads, weightless
from onnxfuse.ort_types import formal_at, with_ort_types
from onnxfuse.repair import default_opset, read_as_ort

FLOAT, HALF, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
#: float16's largest finite value, and the smallest positive one (a subnormal).
HALF_MAX = float(np.finfo(np.float16).max)
HALF_TINY = 2.0 ** -24
#: Magnitudes at least this large are sentinels for infinity (finfo(float32).min/max), clamped to ±HALF_MAX.
SENTINEL = 1e30
#: ``--precision`` values: fp16 computes in float16 with float32 inputs and outputs; fp16-io also takes and
#: returns float16 (``convert_to_fp16(float16_io=True)``), for pipelines that feed float16; bf16 computes in
#: bfloat16 with float32 inputs and outputs (``convert_to_fp16(target=BFLOAT16)``).
PRECISIONS = ("fp32", "fp16", "fp16-io", "bf16")


@dataclass(frozen=True)
class LowFloat:
    """A type a float32 model can be converted to compute in: what it is called, its ONNX element type,
    its largest finite magnitude and its smallest positive one (a subnormal).

    Both clamp a sentinel (|v| >= 1e30, infinity's stand-in) to ``largest``: for bfloat16 too, because
    round-to-nearest takes ``finfo(float32).min`` (0xFF7FFFFF) up to bfloat16's -inf (0xFF80), and a
    fully masked softmax row of -inf is NaN where the original's is uniform; bfloat16's largest (3.39e38)
    absorbs any score as float32's does (``s - 3.39e38`` rounds to -3.39e38)."""
    name: str  # "float16", "bfloat16": as validation and the reports spell a type
    short: str  # "fp16", "bf16": in the names of the values and nodes the converter makes
    elem: int  # its ONNX TensorProto element type
    largest: float
    tiny: float

    def problem(self, values: np.ndarray) -> str | None:
        """Why the float32 ``values`` cannot take this type within its rounding, or None when they can
        (sentinels clamp, tiny non-zero values become the smallest positive value: see :meth:`tensor`)."""
        finite = values[np.isfinite(values)]
        big = np.abs(finite)
        if np.any((big > self.largest) & (big < SENTINEL)):
            return f"holds {float(finite[np.argmax(big * (big < SENTINEL))]):g}, beyond {self.name}'s range"
        return None

    def clamped(self, values: np.ndarray) -> np.ndarray:
        """``values`` (float32) with sentinels clamped to ±largest and non-zero magnitudes below ``tiny``
        raised to it, sign kept, instead of flushed to 0: such a value is an epsilon (LayerNorm's 1e-12)
        whose job is to be non-zero. Still float32: :meth:`tensor` rounds."""
        values = np.asarray(values, np.float32)
        small = (values != 0) & (np.abs(values) < self.tiny)
        values = np.where(small, np.copysign(np.float32(self.tiny), values), values)
        return np.clip(values, -self.largest, self.largest).astype(np.float32)

    def tensor(self, values: np.ndarray, name: str = "") -> TensorProto:
        """A TensorProto of this type holding the float32 ``values`` (:meth:`clamped`), rounded to nearest
        even. bfloat16 is written as its bits (the top half of float32's, rounded), so that no numpy
        bfloat16 type is needed: onnx's own handling of one changed across the versions we accept."""
        values = self.clamped(values)
        if self.elem == HALF:
            return numpy_helper.from_array(values.astype(np.float16), name)
        bits = values.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # (±inf were clamped)
        # a NaN stays a NaN (rounding a payload held in the low bits only would carry it into infinity)
        rounded = np.where(np.isnan(values), np.uint16(0x7FC0) | (rounded & np.uint16(0x8000)), rounded)
        out = TensorProto(name=name, data_type=self.elem, dims=list(values.shape))
        out.raw_data = rounded.tobytes()
        return out


#: The first ONNX opset whose Cast, arithmetic, MatMul and most other ops take bfloat16 (before it, a bfloat16
#: model fails ONNX's type check: 43 of ONNX Runtime's test models, at opsets 7 to 12).
BFLOAT16_OPSET = 13

FLOAT16 = LowFloat("float16", "fp16", HALF, HALF_MAX, HALF_TINY)
BFLOAT16 = LowFloat("bfloat16", "bf16", BF16, 3.3895313892515355e38, 2.0 ** -133)
#: the target type of each ``--precision`` value that converts (fp32 does not)
TARGETS = {"fp16": FLOAT16, "fp16-io": FLOAT16, "bf16": BFLOAT16}


def target_named(name: str | None) -> LowFloat:
    """The target type a judge or a report names ("float16", "bfloat16"); float16 for None (a run whose
    precision was not said: the float16 path's wording, as before bfloat16). Its ``short`` spells the flag
    (``--precision bf16``) and the conversion's culprit (``precision-bf16``)."""
    return BFLOAT16 if name == BFLOAT16.name else FLOAT16


def formal_types(schema, formal) -> set[str]:
    """The type strings an ONNX ``schema``'s formal input or output ``formal`` allows (its own list, else
    its type constraint's)."""
    return set(formal.types) or {t for c in schema.type_constraints if c.type_param_str == formal.type_str
                                 for t in c.allowed_type_strs}


def half_problem(values: np.ndarray) -> str | None:
    """Why a float32 constant cannot become float16 within float16's rounding, or None when it can
    (sentinels clamp, tiny non-zero values become the smallest float16: see :func:`to_half`)."""
    return FLOAT16.problem(values)


def to_half(values: np.ndarray) -> np.ndarray:
    """float32 → float16: sentinels (|v| >= 1e30) clamped to ±65504, and non-zero values below float16's
    smallest subnormal (2⁻²⁴) raised to it, sign kept, instead of flushed to 0: such a value is an
    epsilon (LayerNorm's 1e-12) whose job is to be non-zero."""
    return FLOAT16.clamped(values).astype(np.float16)


def convert_to_fp16(model: onnx.ModelProto, keep_nodes: dict[str, str] | None = None,
                    float16_io: bool = False, target: LowFloat = FLOAT16) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` computing in float16 with float32 inputs and outputs, and notes (what stayed
    float32 and why). The input is never modified. ``target``: :data:`BFLOAT16` converts to bfloat16 the
    same way (everything below that says float16 says the target type; ``float16_io`` then means bfloat16
    inputs and outputs).

    ``keep_nodes``: ``{node name: why}`` of main-graph nodes that compute in float32 as in the original
    (:mod:`onnxfuse.validate.float16_range` measures the nodes whose values float16 cannot hold), held as
    the softmax islands are: float16 inputs cast up, a float32 value another kept node reads passed on in
    float32, one read outside cast down (a kept graph output stays float32).

    ``float16_io``: the main graph's float32 inputs and outputs become float16 themselves (no Cast where
    they enter or leave), for pipelines that feed and read float16; a kept float32 value leaving as an
    output is cast down there."""
    opset = default_opset(model)
    if target.elem == BF16 and 0 < opset < BFLOAT16_OPSET:  # (refused before the copy and the type inference)
        raise PrecisionError(f"--precision bf16 needs ONNX opset {BFLOAT16_OPSET} or later, where Cast and the arithmetic "
                             f"ops take bfloat16; the model imports opset {opset} (--precision fp16 works at any opset)")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    notes: list[str] = []
    opsets = {o.domain or "": o.version for o in out.opset_import}
    scopes = float32_scopes(model)
    if not _declares_float32(model.graph):
        raise PrecisionError("the model declares no float32 input, output, weight or value: nothing to convert to "
                             f"{target.name} (float32 steps an exporter left inside a lower-precision model stay as "
                             "they are)")
    _Converter(opsets, notes, scopes, dict(keep_nodes or {}), float16_io, target).graph(out.graph, main=True)
    problem = _type_problem(out)
    if problem is not None and _type_problem(model) is None:  # (an input that fails alike: not the conversion's)
        raise PrecisionError(f"the {target.name} form of the model fails ONNX type inference: {problem}")
    return out, notes


def float32_nodes_left(float32_nodes: dict[str, str], output: onnx.ModelProto) -> tuple[list[str], str | None]:
    """(the names in ``float32_nodes`` that are still nodes of ``output``'s main graph, a note when the
    rewrites after the conversion fused some of them). The conversion's note names every node it kept
    float32; the rewrites that follow fuse many of them: BERT-base's 26 mask nodes, kept float32 for
    their finfo(float32).min, all become ``Attention``'s raw mask, whose fill the kernel adds in float32.
    A report that still said "26 node(s) stay float32" of an output holding none of them sends a user
    looking for nodes that are not there."""
    present = {n.name for n in output.graph.node}
    left = [name for name in float32_nodes if name in present]
    if len(left) == len(float32_nodes):
        return left, None
    return left, (f"of the {len(float32_nodes)} node(s) kept float32, {len(float32_nodes) - len(left)} were folded "
                  f"or fused into other ops by the rewrites that followed, {len(left)} are in the output as they were")


def _type_problem(model: onnx.ModelProto) -> str | None:
    """What ONNX's checker or its strict, type-checking inference says is wrong with ``model`` read as ONNX
    Runtime reads it (:func:`onnxfuse.repair.read_as_ort`: ORT's contrib ops in the ONNX domain, as
    onnxruntime-genai's builder writes them), in one line; None when nothing is."""
    try:
        with read_as_ort(model):
            onnx.checker.check_model(model)
            onnx_inferred(model, strict=True, check_type=True)
    except Exception as exc:  # noqa: BLE001  (onnx raises several types)
        return " ".join(str(exc).split())[:300]
    return None


def _declares_float32(graph: onnx.GraphProto) -> bool:
    """Whether any graph declares a float32 initializer, input, output or value annotation."""
    for g in proto_graphs(graph):
        if any(t.data_type == FLOAT for t in g.initializer):
            return True
        if any(vi.type.tensor_type.elem_type == FLOAT for vi in list(g.input) + list(g.output) + list(g.value_info)):
            return True
    return False


def float32_values(model: onnx.ModelProto) -> set[str]:
    """Names of the float32 values of ``model``'s main graph, from ONNX type inference."""
    return float32_scopes(model)[0]


def float32_scopes(model: onnx.ModelProto) -> list[set[str]]:
    """For each graph of ``model``, in :func:`~onnxfuse.model_io.proto_graphs` order (the main graph, then
    each body depth first, the order the converter visits them): the names of the float32 values that
    graph sees, from ONNX type inference (through ONNX Runtime's own ops too: :mod:`onnxfuse.ort_types`):
    the ones it defines, and the enclosing graphs' it does not
    redefine. Per graph because sibling bodies may give one name different types (optimum's merged
    decoders write the same names in both branches: an int64 in one, a float in the other). Inferred on the
    weightless copy (:func:`onnxfuse.model_io.weightless`: its initializers as typed inputs, which count as
    float32 values of the main graph as the initializers would): types only, and every conversion asks
    (the drift search's trials included)."""
    try:
        inferred = onnx_inferred(weightless(model))
    except Exception:  # noqa: BLE001  (inference is a help: what it cannot type stays as it is)
        inferred = model
    try:  # what ONNX Runtime's own ops write (ONNX has no schemas for them), and the values after them
        inferred = with_ort_types(inferred, onnx_inferred)
    except Exception:  # noqa: BLE001  (as above: what it types before a failure is kept)
        pass
    scopes: list[set[str]] = []

    def walk(g: onnx.GraphProto, outer: set[str]) -> None:
        typed = list(g.input) + list(g.output) + list(g.value_info)
        mine = (outer - defined_names(g) - {vi.name for vi in typed}) | {
            vi.name for vi in typed if vi.type.tensor_type.elem_type == FLOAT} | {
            t.name for t in g.initializer if t.data_type == FLOAT}
        scopes.append(mine)
        for node in g.node:
            for body in node_subgraphs(node):
                walk(body, mine)

    walk(inferred.graph, set())
    return scopes


#: ops whose float32 computation a sentinel mask must reach in float32 (see the module docstring)
SOFTMAX_OPS = ("Softmax", "LogSoftmax")

#: Ops whose output is float32 when an attribute is absent (found on ONNX Runtime's test models, whose float16
#: forms failed ONNX's type check at the op's reader). ConstantOfShape's ``value`` (float32 zeros) is written
#: as the target type's zeros; the random generators' ``dtype`` is left absent and their float32 output cast
#: down (ONNX Runtime's CPU provider has no float16 RandomUniform).
DEFAULT_FLOAT32_ATTRIBUTE = {"ConstantOfShape": "value", "RandomUniform": "dtype", "RandomNormal": "dtype"}


def _sentinel_values(graph: onnx.GraphProto, floats: set[str]) -> set[str]:
    """Names of the float32 constants of ``graph`` holding a sentinel (a magnitude >= 1e30)."""
    found = {t.name for t in graph.initializer if t.data_type == FLOAT and t.data_location != TensorProto.EXTERNAL
             and np.any(np.abs(numpy_helper.to_array(t)) >= SENTINEL)}
    for node in graph.node:
        if not node.output or node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "ConstantOfShape":
            value = next((numpy_helper.to_array(a.t) for a in node.attribute if a.name == "value"), None)
        else:
            value = constant_node_value(node)  # None for any other op
        # (compared in float64: a float16 constant against 1e30 would warn of an overflow on the console)
        if value is not None and value.dtype.kind == "f" and np.any(np.abs(value.astype(np.float64)) >= SENTINEL):
            found.add(node.output[0])
    return found & floats  # float32 values only


def _nan_guard(graph: onnx.GraphProto, probs: str, producers: dict) -> list | None:
    """``[IsNaN, Where]`` when ``probs`` is read only as ``Where(IsNaN(p), 0, p)`` with a constant 0 (torch's
    dynamo exporter writes it after a masked Softmax). An island takes it with its Softmax: it then stays
    float32 and its result leaves as float16, instead of the Softmax's weights going down to float16 and
    back up to meet the float32 0 (a mask constant too), which left the island's form unrecognisable
    to contrib-attention (GPT-2's dynamo export under --precision fp16: 355 nodes, no attention fused)."""
    readers = [n for n in graph.node if probs in n.input]
    isnan = next((n for n in readers if n.op_type == "IsNaN"), None)
    where = next((n for n in readers if n.op_type == "Where"), None)
    if len(readers) != 2 or isnan is None or where is None or len(where.input) != 3:
        return None
    if list(where.input) != [isnan.output[0], where.input[1], probs]:
        return None
    if sum(isnan.output[0] in n.input for n in graph.node) != 1:
        return None
    zero = next((numpy_helper.to_array(i) for i in graph.initializer if i.name == where.input[1]), None)
    if zero is None and where.input[1] in producers:
        zero = constant_node_value(producers[where.input[1]])
    if zero is None or zero.size != 1 or float(zero.reshape(())) != 0.0:
        return None
    return [isnan, where]


def softmax_islands(graph: onnx.GraphProto, floats: set[str]) -> tuple[set[int], set[str]]:
    """The float32 softmax islands of ``graph`` (module docstring): ``(node ids, values)``. The values are
    the float ones computed from a sentinel (forward, through ONNX-domain nodes without subgraphs, not
    through a Softmax) that a Softmax reads (backward from its input); the nodes are their producers,
    those Softmaxes and the ``ConstantOfShape`` nodes they read (masked_fill's zeros: written in float32
    rather than cast up at run time, and contrib-attention then sees the zeros). If a node of an island
    cannot be held (another domain, a subgraph, a graph output: the interface keeps its type), there are
    no islands and the sentinels clamp as before."""
    producers = {o: n for n in graph.node for o in n.output}
    outputs = {vi.name for vi in graph.output}

    def plain(n) -> bool:
        return n.domain in ("", "ai.onnx") and not any(
            a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute)

    reached = set(_sentinel_values(graph, floats))
    for node in graph.node:  # topological order; a Softmax bounds its island (the next layer is another)
        if plain(node) and node.op_type not in SOFTMAX_OPS and any(i in reached for i in node.input):
            reached.update(o for o in node.output if o in floats)
    softmaxes = [n for n in graph.node if n.op_type in SOFTMAX_OPS and plain(n) and n.input and n.input[0] in reached]
    needed: set[str] = set()
    stack = [n.input[0] for n in softmaxes]
    while stack:
        name = stack.pop()
        if name in needed or name not in reached:
            continue
        needed.add(name)
        p = producers.get(name)
        if p is not None:
            stack.extend(p.input)
    nodes = {id(producers[v]) for v in needed if v in producers}
    nodes |= {id(n) for n in softmaxes}
    for softmax in softmaxes:  # the dynamo exporter's NaN guard stays with its Softmax, in float32
        guard = _nan_guard(graph, softmax.output[0], producers)
        if guard:
            nodes |= {id(n) for n in guard}
            needed.add(softmax.output[0])
    for n in [n for n in graph.node if id(n) in nodes]:  # a ConstantOfShape it reads (masked_fill's zeros)
        for name in n.input:  # joins it: written in float32 rather than cast up at run time
            p = producers.get(name)
            if p is not None and p.op_type == "ConstantOfShape" and plain(p) and name in floats:
                nodes.add(id(p))
                needed.add(name)
    bad = {id(n) for n in graph.node if id(n) in nodes and (not plain(n) or any(o in outputs for o in n.output))}
    if bad:  # an island with a node it cannot hold is not an island: leave those softmaxes as they were
        return set(), set()
    return nodes, needed


class _Converter:
    def __init__(self, opsets: dict[str, int], notes: list[str], scopes: list[set[str]], keep_nodes: dict[str, str],
                 float16_io: bool = False, target: LowFloat = FLOAT16):
        self.opsets = opsets
        self.target = target  # the type the model computes in
        self.float16_io = float16_io  # main graph's float32 inputs and outputs become float16 themselves
        self.keep_nodes = keep_nodes  # main-graph node name → why it computes in float32 (measured)
        self.notes = notes
        self.scopes = scopes  # per graph, in visiting order: the float32 values it sees (float32_scopes)
        self.visited = 0
        self.floats: set[str] = set()  # the graph being converted's (only these change type)
        self.counter = 0
        self.schemas: dict[str, object] = {}  # op type → its default-domain schema at the model's opset

    def fresh(self, base: str) -> str:
        """A new float value name (every value this converter creates is a float one)."""
        self.counter += 1
        name = f"{base}/{self.target.short}_{self.counter}"
        self.floats.add(name)
        return name

    def cast(self, source: str, to: int, dest: str) -> onnx.NodeProto:
        """``Cast(source) → dest`` to float16 or float32, with a node name of its own."""
        self.counter += 1
        suffix = f"to_{self.target.short}" if to == self.target.elem else "to_fp32"
        return helper.make_node("Cast", [source], [dest], to=to, name=f"{source}/{suffix}_{self.counter}")

    def graph(self, graph: onnx.GraphProto, main: bool) -> None:
        """Convert ``graph`` (and its bodies, as its nodes are reached) with the float32 values it sees."""
        if self.visited >= len(self.scopes):
            raise PrecisionError("internal error: the float16 conversion reached more graphs than the model holds")
        outer, self.floats = self.floats, set(self.scopes[self.visited])
        self.visited += 1
        try:
            self._graph(graph, main)
        finally:
            self.floats = outer

    def _graph(self, graph: onnx.GraphProto, main: bool) -> None:
        # Node sets below are keyed by id(). protobuf (upb) hands out one Python object per node only while
        # one is alive: a node read again after its object was freed comes back as a new object, whose id
        # may be any freed object's. Holding every node's object for the whole conversion keeps each id
        # that node's own; without it, island membership depended on what the process had freed before
        # (the same model converted differently after other models: one Cast more or fewer).
        alive = list(graph.node)  # noqa: F841  (held, not read)
        inits = {t.name: t for t in graph.initializer}
        kept: dict[str, str] = {}  # float32 constant name → why it stays float32
        graph_inputs = {vi.name for vi in graph.input}
        # A constant read only where the op needs float32 (Resize's scales) stays float32 as it is:
        # rounding it through float16 could change an output size.
        reads: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
        for node in graph.node:
            for i, name in enumerate(node.input):
                reads.setdefault(name, []).append((node, i))
        schema_kept = set()
        constants = [t.name for t in graph.initializer if t.data_type == FLOAT] + [
            n.output[0] for n in graph.node if n.op_type == "Constant" and n.output and n.output[0] in self.floats]
        island, island_values = softmax_islands(graph, self.floats)
        softmax_island = bool(island)  # before the measured nodes join it: the note below is about softmaxes
        graph_outputs = {vi.name for vi in graph.output}
        if main and self.keep_nodes:
            island, island_values = set(island), set(island_values)
            measured = [n for n in graph.node if n.name in self.keep_nodes]
            island |= {id(n) for n in measured}
            for n in measured:  # a value another kept node reads (or a graph output) stays float32 as it is
                island_values.update(o for o in n.output if o in self.floats and (
                    o in graph_outputs or any(id(r) in island for r, _ in reads.get(o, []))))
            shown = ", ".join(f"{n.name!r} ({self.keep_nodes[n.name]})" for n in measured[:3])
            more = f" and {len(measured) - 3} more" if len(measured) > 3 else ""
            self.notes.append(f"{len(measured)} node(s) stay float32 (values beyond {self.target.name}'s range or "
                              f"results beyond the drift budget, measured on the validation inputs, or ops without "
                              f"a {self.target.name} kernel): {shown}{more}")
        island_kept = set()  # constants an island reads: float32 there, a clamped float16 copy elsewhere
        for name in constants:
            uses = reads.get(name, [])
            if uses and all(i in self.schema_fp32(node) for node, i in uses):
                kept[name] = "is read only where the op needs float32"
                schema_kept.add(name)
            elif any(id(node) in island for node, _ in uses):
                kept[name] = "is read by a float32 island"
                island_kept.add(name)
        if softmax_island:
            count = sum(1 for n in graph.node if id(n) in island and n.op_type in SOFTMAX_OPS)
            self.notes.append(f"{count} softmax(es) and the mask steps before them stay float32: their mask "
                              f"holds finfo(float32).min, which {self.target.name} cannot (clamped, it would change "
                              "rows whose every key is masked)")
        for t in graph.initializer:
            if t.data_type != FLOAT or t.name in kept:
                continue
            if t.data_location == TensorProto.EXTERNAL:
                raise PrecisionError(f"initializer {t.name!r} is stored as external data: --precision fp16 "
                                     "converts models whose weights are inside the .onnx file only")
            if t.name in graph_inputs:  # an overridable default: its declared type is the interface
                kept[t.name] = "is also a graph input (an overridable initializer)"
                continue
            values = numpy_helper.to_array(t)
            why = self.target.problem(values)
            if why:
                kept[t.name] = why
                continue
            t.CopyFrom(self.target.tensor(values, t.name))
        # value annotations of float tensors (intermediates, and subgraph inputs/outputs) follow
        for vi in graph.value_info:
            if vi.type.tensor_type.elem_type == FLOAT and vi.name not in kept and vi.name not in island_values:
                vi.type.tensor_type.elem_type = self.target.elem
        if not main:
            for vi in list(graph.input) + list(graph.output):
                if vi.type.tensor_type.elem_type == FLOAT and vi.name not in inits:
                    vi.type.tensor_type.elem_type = self.target.elem
        for node in graph.node:  # Constant nodes whose value float16 cannot hold stay float32
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output and node.output[0] not in kept:
                why = self.constant_problem(node)
                if why:
                    kept[node.output[0]] = why
        nodes = list(graph.node)
        new_nodes: list[onnx.NodeProto] = []
        renamed: dict[str, str] = {}
        if main:  # float32 inputs enter as float16 (or are float16, with float16_io)
            for vi in graph.input:
                if vi.type.tensor_type.elem_type == FLOAT and vi.name not in inits:
                    if self.float16_io:
                        vi.type.tensor_type.elem_type = self.target.elem
                        continue
                    half = self.fresh(vi.name)
                    new_nodes.append(self.cast(vi.name, self.target.elem, half))
                    renamed[vi.name] = half
        half_of_kept: dict[str, str] = {}
        half_of_island: dict[str, str] = {}  # an island's float32 value → its float16 copy, for other readers
        for node in nodes:
            if id(node) in island:
                new_nodes.extend(self.island_node(node, island, island_values, kept, reads, half_of_island,
                                                  graph_inputs if main and not self.float16_io else set()))
                continue
            for i, name in enumerate(node.input):
                if name in renamed:
                    node.input[i] = renamed[name]
                elif name in half_of_island:
                    node.input[i] = half_of_island[name]
            fp32_inputs = self.fp32_inputs(node, kept)
            for i in fp32_inputs:  # this input stays float32: cast a float16 value back
                name = node.input[i]
                if name in kept:
                    continue
                back = self.fresh(name)
                new_nodes.append(self.cast(name, FLOAT, back))
                node.input[i] = back
            for i, name in enumerate(node.input):  # a kept float32 constant read where float16 is expected
                if name in kept and i not in fp32_inputs:
                    if name not in half_of_kept:
                        half_of_kept[name] = self.fresh(name)
                        if name in island_kept:  # clamped as any other sentinel (a Cast would make it -inf)
                            new_nodes.append(self.half_constant(name, half_of_kept[name], graph, nodes))
                        else:
                            new_nodes.append(self.cast(name, self.target.elem, half_of_kept[name]))
                    node.input[i] = half_of_kept[name]
            if fp32_inputs and self.outputs_follow(node, fp32_inputs):
                new_nodes.append(node)
                for j, name in enumerate(node.output):
                    if name in self.floats:
                        wide = self.fresh(name)
                        node.output[j] = wide
                        new_nodes.append(self.cast(wide, self.target.elem, name))
            else:
                new_nodes.append(node)
                for j in self.schema_fp32_outputs(node):  # float32 by the schema whatever the inputs
                    wide = self.fresh(node.output[j])
                    new_nodes.append(self.cast(wide, self.target.elem, node.output[j]))
                    node.output[j] = wide
            if not (node.op_type == "Constant" and node.output and node.output[0] in kept):
                self.attributes(node, graph)
        self.note_kept({k: v for k, v in kept.items() if k not in schema_kept and k not in island_kept})
        self.note_schema_float32(nodes, island)
        if main:  # float32 outputs leave as float32 (float16_io: as float16, a float32 island's cast down)
            producers = {o: n for n in new_nodes for o in n.output}
            cast = set()  # a value listed twice among the outputs (ORT's test models have one) is cast once
            for vi in graph.output:
                if vi.type.tensor_type.elem_type != FLOAT or vi.name in kept:
                    continue
                first = vi.name not in cast
                cast.add(vi.name)
                if self.float16_io:
                    vi.type.tensor_type.elem_type = self.target.elem
                    if first and vi.name in island_values and vi.name in producers:  # island readers keep float32
                        self.exit_cast(new_nodes, producers[vi.name], vi.name, self.target.elem)
                elif first and vi.name not in island_values:  # (an island's is float32 already)
                    inner = self.fresh(vi.name)  # (named first, as the converter always has: names stay as they were)
                    if vi.name in producers:  # (an input passed straight through stays as it is)
                        # readers inside bodies read the float16 value too (below)
                        renamed[vi.name] = self.exit_cast(new_nodes, producers[vi.name], vi.name, FLOAT, inner)
        del graph.node[:]
        graph.node.extend(new_nodes)
        if renamed:  # bodies of If/Loop/Scan read outer values by name: they read the float16 one too (a body
            # that writes a value of the same name reads its own: optimum's merged decoders name the branches'
            # outputs as the If's)
            for node in graph.node:
                for body in node_subgraphs(node):
                    rename_outer_reads(body, renamed)

    def exit_cast(self, new_nodes, producer, name: str, to: int, inner: str | None = None) -> str:
        """Make the graph output ``name`` a ``Cast(to)`` of what ``producer`` writes, under a fresh name
        (``inner``, or a new one) that every reader inside the graph now reads (they keep the computing
        type); returns that name."""
        inner = inner or self.fresh(name)
        producer.output[list(producer.output).index(name)] = inner
        for other in new_nodes:
            for i, read in enumerate(other.input):
                if read == name:
                    other.input[i] = inner
        new_nodes.append(self.cast(inner, to, name))
        return inner

    def island_node(self, node, island, island_values, kept, reads, half_of_island,
                    float32_inputs: set[str]) -> list[onnx.NodeProto]:
        """``node`` of a softmax island, computing in float32 as in the original: float16 inputs from
        outside are cast up (graph inputs are read as they are, float32), its attributes are left alone
        (a ``Cast(to=float)`` stays one), and a float output read outside the island is cast down for those
        readers (the Softmax's result, under its own name; a mask value also read elsewhere, as a copy)."""
        out = []
        floats = self.float_inputs(node)
        for i, name in enumerate(node.input):
            if not name or i not in floats or name in island_values or name in kept:
                continue
            if name in float32_inputs:
                continue  # a float32 graph input: read as it is
            up = self.fresh(name)
            out.append(self.cast(name, FLOAT, up))
            node.input[i] = up
        out.append(node)
        float_outputs = self.float_outputs(node, floats)
        for j, name in enumerate(node.output):
            if j not in float_outputs:
                continue
            outside = [r for r, _ in reads.get(name, []) if id(r) not in island]
            if name not in island_values:  # leaves the island: float16 under its own name
                wide = self.fresh(name)
                node.output[j] = wide
                out.append(self.cast(wide, self.target.elem, name))
            elif outside:
                half_of_island[name] = self.fresh(name)
                out.append(self.cast(name, self.target.elem, half_of_island[name]))
        return out

    def float_inputs(self, node: onnx.NodeProto) -> set[int]:
        """Positions of ``node``'s float inputs: typed float32 by inference, or of the type variable of one
        that is (an ``Add`` of an untyped value and a float32 one: the untyped one is float too). ONNX's
        inference leaves a value untyped after a node it cannot infer, and an island node reading such a
        float16 value uncast was refused by ONNX Runtime (its test model gpt2_past_mask_one_layer.onnx)."""
        known = {i for i, name in enumerate(node.input) if name and name in self.floats}
        schema = self.schema(node)
        if not known or schema is None or not schema.inputs:
            return known
        float_vars = {formal_at(schema.inputs, i).type_str for i in known}
        return known | {i for i, name in enumerate(node.input)
                        if name and formal_at(schema.inputs, i).type_str in float_vars
                        and not formal_at(schema.inputs, i).type_str.startswith("tensor(")}

    def float_outputs(self, node: onnx.NodeProto, float_inputs: set[int]) -> set[int]:
        """Positions of ``node``'s float outputs: typed float32 by inference, or of the type variable of a
        float input (``float_inputs``: :meth:`float_inputs`), for the same reason."""
        known = {j for j, name in enumerate(node.output) if name and name in self.floats}
        schema = self.schema(node)
        if schema is None or not schema.outputs or not float_inputs:
            return known
        float_vars = {formal_at(schema.inputs, i).type_str for i in float_inputs} - {"tensor(float)"}
        return known | {j for j, name in enumerate(node.output)
                        if name and formal_at(schema.outputs, j).type_str in float_vars}

    def half_constant(self, name: str, dest: str, graph: onnx.GraphProto, nodes) -> onnx.NodeProto:
        """A ``Constant`` node writing the float32 constant ``name`` as float16 (:func:`to_half`: clamped)."""
        init = next((t for t in graph.initializer if t.name == name), None)
        if init is not None:
            values = numpy_helper.to_array(init)
        else:
            producer = next(n for n in nodes if n.output and n.output[0] == name)
            values = constant_node_value(producer)
        return helper.make_node("Constant", [], [dest], value=self.target.tensor(values),
                                name=f"{name}/{self.target.short}_copy")

    def schema(self, node: onnx.NodeProto):
        """``node``'s schema at the model's opset; None for another domain or an unknown op."""
        if (node.domain or "") not in ("", "ai.onnx"):
            return None
        if node.op_type not in self.schemas:
            try:
                self.schemas[node.op_type] = onnx.defs.get_schema(node.op_type, self.opsets.get("", 17), "")
            except onnx.defs.SchemaError:
                self.schemas[node.op_type] = None
        return self.schemas[node.op_type]

    def schema_fp32(self, node: onnx.NodeProto) -> set[int]:
        """Positions of float32 inputs where ``node``'s schema does not accept float16 (Resize's scales)."""
        schema = self.schema(node)
        if schema is None or not schema.inputs:
            return set()
        stay = set()
        for i, name in enumerate(node.input):
            if not name or name not in self.floats:
                continue
            allowed = formal_types(schema, formal_at(schema.inputs, i))
            if allowed and "tensor(float)" in allowed and f"tensor({self.target.name})" not in allowed:
                stay.add(i)
        return stay

    def absent_default(self, node: onnx.NodeProto) -> str | None:
        """The attribute of :data:`DEFAULT_FLOAT32_ATTRIBUTE` that ``node`` leaves absent, its float32 output
        being converted; None otherwise."""
        default = DEFAULT_FLOAT32_ATTRIBUTE.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if default and node.output and node.output[0] in self.floats and not any(
                a.name == default for a in node.attribute):
            return default
        return None

    def schema_fp32_outputs(self, node: onnx.NodeProto) -> set[int]:
        """Positions of float32 outputs that ``node``'s schema writes as float32 only, whatever its inputs
        (``DynamicQuantizeLinear``'s ``y_scale``), or that an absent ``dtype`` makes float32 (a random
        generator's): their readers compute in the target type, so they are cast down (left float32, a
        ``Mul`` of it and a converted input failed ONNX's type check)."""
        if self.absent_default(node) == "dtype":
            return {0}
        schema = self.schema(node)
        if schema is None or not schema.outputs:
            return set()
        fixed = set()
        for j, name in enumerate(node.output):
            if name and name in self.floats:
                allowed = formal_types(schema, formal_at(schema.outputs, j))
                if allowed == {"tensor(float)"}:
                    fixed.add(j)
        return fixed

    def fp32_inputs(self, node: onnx.NodeProto, kept: dict[str, str]) -> set[int]:
        """Input positions that must stay float32 at ``node``: its schema does not take float16 there,
        the node has no schema here (another domain), or it reads a constant float16 cannot hold."""
        schema = self.schema(node)
        if schema is None and (node.domain or "") not in ("", "ai.onnx"):
            return set()  # another domain: its nodes are left as they are (see outputs_follow)
        stay = {i for i, name in enumerate(node.input) if name in kept} | self.schema_fp32(node)
        if stay and schema is not None:
            # A type variable shared with a float16 input must match: keep every input of that variable
            by_var: dict[str, set[int]] = {}
            for i in range(len(node.input)):
                formal = formal_at(schema.inputs, i)
                by_var.setdefault(formal.type_str, set()).add(i)
            for i in list(stay):
                formal = formal_at(schema.inputs, i)
                stay |= {j for j in by_var.get(formal.type_str, ()) if node.input[j] in self.floats}
        return stay

    def outputs_follow(self, node: onnx.NodeProto, kept_inputs: set[int]) -> bool:
        """Whether a node computing in float32 (the inputs at ``kept_inputs`` kept) writes float32 outputs that
        float16 readers need cast: true when an output shares a type variable with a kept input (Add, Mul,
        ...). Only the kept inputs' variables count: Pow-13's exponent (T1, no bfloat16 there) stays float32
        while its base and result (T) are bfloat16, and a Cast of its result to its own type hid the
        LayerNorm pattern from contrib-layernorm."""
        schema = self.schema(node)
        if schema is None:
            return False
        in_vars = {formal_at(schema.inputs, i).type_str for i in kept_inputs}
        return any(o.type_str in in_vars for o in schema.outputs)

    def note_schema_float32(self, nodes, island) -> None:
        """One note per op whose nodes compute wholly in float32 because ONNX's schema at the model's opset
        takes no value of the target type there (every float input kept: ``Conv`` before opset 22 has no
        bfloat16), so that a conversion that converts little says why; a node that keeps only some inputs
        (``Resize``'s scales) still computes in the target type and is not counted."""
        whole: dict[str, int] = {}
        for node in nodes:
            floats = [i for i, name in enumerate(node.input) if name in self.floats]
            if id(node) not in island and floats and set(floats) <= self.schema_fp32(node):
                whole[node.op_type] = whole.get(node.op_type, 0) + 1
        version = self.opsets.get("", 17)
        for op, count in sorted(whole.items()):
            self.notes.append(f"{count} {op} node(s) compute in float32: ONNX's {op} at opset {version} takes no "
                              f"{self.target.name} (a later opset may; the model's opset is kept)")

    def note_kept(self, kept: dict[str, str]) -> None:
        """One note per reason (its count and an example), not one per constant: a 12-layer model keeps
        24 LayerNorm epsilons."""
        by_kind: dict[str, list[tuple[str, str]]] = {}
        for name, why in sorted(kept.items()):
            kind = why.split(",", 1)[-1].strip() if "," in why else why
            by_kind.setdefault(kind, []).append((name, why))
        for kind, items in by_kind.items():
            name, why = items[0]
            more = f" and {len(items) - 1} more" if len(items) > 1 else ""
            self.notes.append(f"{len(items)} constant(s) stay float32 ({name!r}{more}): {kind}"
                              + (f" ({why.split(',', 1)[0]})" if "," in why else ""))

    def constant_problem(self, node: onnx.NodeProto) -> str | None:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FLOAT:
                return self.target.problem(numpy_helper.to_array(attr.t))
            if attr.name in ("value_float", "value_floats"):
                return self.target.problem(np.asarray(onnx.helper.get_attribute_value(attr), np.float32))
        return None

    def attributes(self, node: onnx.NodeProto, graph: onnx.GraphProto) -> None:
        if self.absent_default(node) == "value":  # float32 zeros by ONNX's default: the target type's zeros
            node.attribute.append(helper.make_attribute("value", self.target.tensor(np.zeros(1, np.float32))))
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in list(node.attribute):  # value_float(s) give float32: write them as a float16 tensor
                if attr.name in ("value_float", "value_floats"):
                    values = np.asarray(onnx.helper.get_attribute_value(attr), np.float32)
                    if self.target.problem(values) is None:
                        node.attribute.remove(attr)
                        node.attribute.append(helper.make_attribute("value", self.target.tensor(values)))
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FLOAT:
                values = numpy_helper.to_array(attr.t)
                if self.target.problem(values) is None:
                    attr.t.CopyFrom(self.target.tensor(values, attr.t.name))
            elif attr.type == onnx.AttributeProto.INT and attr.name in ("to", "dtype") and attr.i == FLOAT:
                attr.i = self.target.elem
            elif attr.type == onnx.AttributeProto.GRAPH:
                self.graph(attr.g, main=False)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    self.graph(g, main=False)


__all__ = ["BFLOAT16", "BFLOAT16_OPSET", "FLOAT16", "PRECISIONS", "TARGETS", "LowFloat", "convert_to_fp16", "float32_values",
           "formal_types", "half_problem", "target_named", "to_half"]
