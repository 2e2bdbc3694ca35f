"""The region analysis fuse-elementwise and conv-bias-into-elementwise share (the elementwise family's
public module; not a rule).

* :func:`infer_value_info`, :func:`bcast_shapes`, :func:`fits`: dtypes and shapes of every value (ONNX
  shape inference plus symbolic broadcasting), and the shape proofs the op's contract needs;
* :func:`lower_node` / :class:`Lowering`: one ONNX node as program statements (or a refusal);
* :class:`RegionAnalysis`: one graph's fusible nodes, their dependencies and the judge the partition
  (:mod:`.partition`) asks; ``regions()`` returns every :class:`Region` (fusible, or refused with a reason);
* :func:`build_program`: a region as a FusedElementwise program;
* :func:`candidate_ops`: the ops the analysis looks at (the language's, lowered ones, refused ones).

What a region is and why: :mod:`onnxfuse.rewrites.elementwise.fuse_elementwise`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxfuse.rewrites.elementwise.ort_fusions import decomposed_layernorm_nodes
from onnxfuse.rewrites.elementwise.partition import partition
from onnxfuse.rewrites.engine.rule import Refuse, Refused
from onnxfuse.rewrites.facts.constants import constant_node_value
from onnxfuse.rewrites.facts.inference import onnx_inferred
from onnxfuse.rewrites.facts.graph import constant_producer, declared_shape, is_default_domain, opset_of, subgraphs
from onnxfuse.rewrites.facts.scopes import Scope

# Elementwise ONNX ops the language may lack: fused once OP_TABLE has them (a new op is a table row,
# nothing here), otherwise reported with a reason, never fused.
_UNSUPPORTED_ELEMENTWISE = frozenset({
    "Mod", "IsNaN", "IsInf", "BitShift", "ThresholdedRelu", "Shrink", "Tan", "Asin", "Acos", "Atan",
    "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot",
    "CastLike",
})
# Lowered (not 1:1 with the language).
_LOWERED = frozenset({"Sum", "Mean", "Min", "Max", "Clip", "PRelu"})
# com.microsoft ops whose first output has the dtype and shape of their first input.
_CONTRIB_SAME_SHAPE = frozenset({
    "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "LayerNormalization", "SkipLayerNormalization",
    "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "BiasAdd",
})
# Node attributes that do not change the value computed for the dtypes the language has.
_IGNORED_ATTRS = {"Cast": {"saturate", "round_mode"}}


def _expr():
    # start-up: the command line starts (and --help runs) without onnxfuse.custom_ops.expr
    from onnxfuse.custom_ops import expr

    return expr


# --------------------------------------------------------------------------------------------------
# Shapes and dtypes
# --------------------------------------------------------------------------------------------------

Dim = "int | str | None"


def _dims_from_proto(tp: onnx.TypeProto):
    if not tp.HasField("tensor_type"):
        return None, None
    tt = tp.tensor_type
    elem = tt.elem_type or None
    if not tt.HasField("shape"):
        return elem, None
    dims = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return elem, tuple(dims)


def _np_to_onnx(dt) -> int | None:
    if dt is None:
        return None
    try:
        return int(onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dt)))
    except Exception:
        return None


def infer_value_info(graph: gs.Graph) -> dict[str, tuple[int | None, tuple | None]]:
    """name -> (ONNX elem type or None, shape tuple or None) for every tensor we can learn about."""
    info: dict[str, tuple[int | None, tuple | None]] = {}
    for name, t in graph.tensors().items():
        if isinstance(t, gs.Constant):
            info[name] = (_np_to_onnx(t.dtype), tuple(int(d) for d in t.shape))
        else:
            info[name] = (_np_to_onnx(t.dtype), declared_shape(t))
    try:
        model = gs.export_onnx(graph, do_type_check=False)
    except Exception:
        return info
    contrib = [n for n in model.graph.node if n.domain == "com.microsoft" and n.op_type in _CONTRIB_SAME_SHAPE]
    for _ in range(4):
        try:
            inferred = onnx_inferred(model)
        except Exception:
            break
        for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
            elem, dims = _dims_from_proto(vi.type)
            old_elem, old_dims = info.get(vi.name, (None, None))
            info[vi.name] = (elem or old_elem, dims if dims is not None else old_dims)
        changed = False
        known = {vi.name for vi in model.graph.value_info}
        for n in contrib:
            if not n.input or not n.output:
                continue
            src, dst = n.input[0], n.output[0]
            s_elem, s_dims = info.get(src, (None, None))
            d_elem, d_dims = info.get(dst, (None, None))
            if s_elem and (d_elem is None or d_dims is None) and dst not in known:
                info[dst] = (d_elem or s_elem, d_dims if d_dims is not None else s_dims)
                vi = onnx.helper.make_tensor_value_info(dst, info[dst][0], list(info[dst][1]) if info[dst][1] is not None else None)
                model.graph.value_info.append(vi)
                changed = True
        if not changed:
            break
    return info


def bcast_dim(a, b):
    if a == 1:
        return b
    if b == 1:
        return a
    if a is None or b is None:
        other = b if a is None else a
        return other if isinstance(other, int) else None
    if a == b:
        return a
    return None


def bcast_shapes(shapes):
    """Multidirectional broadcast of shapes with symbolic/unknown dims; None if a rank is unknown."""
    if any(s is None for s in shapes):
        return None
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for s in shapes:
        for k, d in enumerate(s):
            j = rank - len(s) + k
            out[j] = bcast_dim(out[j], d)
    return tuple(out)


def fits(small, big) -> bool:
    """True when broadcasting ``small`` into ``big`` provably leaves ``big`` unchanged."""
    if small is not None and len(small) == 0:
        return True
    if small is None or big is None or len(small) > len(big):
        return False
    for d, b in zip(reversed(small), reversed(big)):
        if d == 1:
            continue
        if d is None or b is None or d != b:
            return False
    return True


def _fmt_shape(s) -> str:
    if s is None:
        return "unknown"
    return "[" + ",".join("?" if d is None else str(d) for d in s) + "]"


# --------------------------------------------------------------------------------------------------
# Lowering one ONNX node to program steps
# --------------------------------------------------------------------------------------------------


def const_value(t: gs.Tensor, max_size: int = 1):
    """The value of a constant tensor (initializer or Constant node output) if it has at most
    ``max_size`` elements, else None. Returns (array, True) or (None, is_constant)."""
    if isinstance(t, gs.Constant):
        if int(np.prod(t.shape)) > max_size:
            return None, True
        return np.asarray(t.values), True
    node = constant_producer(t)
    if node is None:
        return None, False
    arr = constant_node_value(node)
    if arr is None or arr.size > max_size:
        return None, True
    return arr, True


def _scalar(arr: np.ndarray, dtype: str):
    """The single element of ``arr`` as a Python number (exact) for a program of ``dtype``."""
    flat = np.asarray(arr).reshape(-1)
    if dtype == "bool":
        return bool(flat[0])
    if dtype in ("int32", "int64"):
        return int(flat[0])
    return float(flat.astype(np.float64)[0])


@dataclass
class Lowering:
    """How one ONNX node becomes program statements.

    ``operands``: the node inputs the program reads as data. ``steps``: (op_type, args, attrs) where
    an arg is an operand index (int), ("s", j) for the result of step j, or ("n", number) for a
    number in the operands' dtype. The last step's result is the node's output.
    """

    node: Any
    operands: list
    steps: list
    dtype: str = ""
    shape: tuple | None = None
    folded: dict = field(default_factory=dict)  # operand index -> python scalar

    def run_steps(self, operands: list, apply, number=lambda x: x) -> list:
        """Every step's result, in order: each arg resolved (operand index i → ``operands[i]``, ("s", j) →
        step j's result, ("n", x) → ``number(x)``) and passed with the op and its attributes to
        ``apply(op_type, args, attrs)``. One walk for the dtype pass and the program builder."""
        results: list = []
        for op_type, args, attrs in self.steps:
            resolved = [operands[a] if isinstance(a, int) else results[a[1]] if a[0] == "s" else number(a[1])
                        for a in args]
            results.append(apply(op_type, resolved, attrs))
        return results


def lower_node(node, graph, dtype_of) -> Lowering:
    """A :class:`Lowering` for ``node``, or raise :class:`Refused` carrying the ``Refuse`` (an exception
    here because the checks sit in nested helpers and in :meth:`RegionAnalysis._type`, several calls
    deep; :class:`RegionAnalysis` catches it and keeps the value)."""
    expr = _expr()
    op = node.op
    if not is_default_domain(node):
        raise Refused(Refuse(f"op {node.domain}::{op} is not a standard ONNX op", node))
    if any(isinstance(v, gs.Graph) for v in node.attrs.values()):
        raise Refused(Refuse("op has a subgraph", node))
    if len(node.outputs) != 1:
        raise Refused(Refuse(f"{op} with {len(node.outputs)} outputs", node))
    inputs = [t for t in node.inputs]
    present = [t for t in inputs if t.name != ""]

    def need_attrs_subset(allowed):
        extra = set(node.attrs) - set(allowed) - _IGNORED_ATTRS.get(op, set())
        if extra:
            raise Refused(Refuse(f"attribute {sorted(extra)[0]} is not supported", node))

    def _const_scalar(t, what):
        arr, is_const = const_value(t)
        if arr is None or arr.size != 1:
            raise Refused(Refuse(f"{what} is not a constant scalar", node))
        return arr

    if op in _UNSUPPORTED_ELEMENTWISE and op not in _expr().OP_TABLE:
        raise Refused(Refuse(f"{op} is not in the FusedElementwise language", node))
    if op in ("Sum", "Min", "Max", "Mean"):
        need_attrs_subset(())
        if not present or len(present) != len(inputs):
            raise Refused(Refuse(f"{op} with missing inputs", node))
        base = {"Sum": "Add", "Mean": "Add", "Min": "Min", "Max": "Max"}[op]
        if len(present) == 1:
            steps = [("Identity", [0], {})]
        else:
            steps = [(base, [0, 1], {})]
            for k in range(2, len(present)):
                steps.append((base, [("s", len(steps) - 1), k], {}))
        if op == "Mean" and len(present) > 1:
            steps.append(("Div", [("s", len(steps) - 1), ("n", float(len(present)))], {}))
        return Lowering(node, present, steps)
    if op == "Clip":
        if not inputs or inputs[0].name == "":
            raise Refused(Refuse("Clip without input", node))
        attrs = {}
        if opset_of(graph) < 11 or len(inputs) == 1:
            need_attrs_subset(("min", "max"))
            if "min" in node.attrs:
                attrs["min"] = float(node.attrs["min"])
            if "max" in node.attrs:
                attrs["max"] = float(node.attrs["max"])
        else:
            need_attrs_subset(())
        d = dtype_of(inputs[0])
        for k, key in ((1, "min"), (2, "max")):
            if len(inputs) > k and inputs[k].name != "":
                arr = _const_scalar(inputs[k], f"Clip {key}")
                attrs[key] = _scalar(arr, d if d else "float32")
        return Lowering(node, [inputs[0]], [("Clip", [0], attrs)])
    if op == "PRelu":
        need_attrs_subset(())
        return Lowering(node, present, [("Less", [0, ("n", 0)], {}), ("Mul", [0, 1], {}),
                                        ("Where", [("s", 0), ("s", 1), 0], {})])
    spec = expr.op_spec(op)
    if spec is None:
        raise Refused(Refuse(f"{op} is not elementwise", node))
    if op == "Gelu" and opset_of(graph) < 20:
        raise Refused(Refuse("Gelu needs opset 20", node))
    if len(present) != spec.arity or len(inputs) != spec.arity:
        raise Refused(Refuse(f"{op} with {len(present)} inputs", node))
    need_attrs_subset([a.name for a in spec.attrs])
    attrs = {}
    for a in spec.attrs:
        if a.name in node.attrs:
            v = node.attrs[a.name]
            if a.kind == "dtype":
                if not isinstance(v, (int, np.integer)):
                    v = _np_to_onnx(v) or 0
                name = expr.DTYPE_FROM_ONNX.get(int(v))
                if name is None:
                    name = onnx.TensorProto.DataType.Name(int(v)).lower()
                    raise Refused(Refuse(f"Cast to ONNX dtype {name} is not supported", node))
                v = name
            elif isinstance(v, bytes):
                v = v.decode()
            attrs[a.name] = v
    if op == "Cast" and "to" not in attrs:
        raise Refused(Refuse("Cast without 'to'", node))
    return Lowering(node, present, [(op, list(range(len(present))), attrs)])


# --------------------------------------------------------------------------------------------------
# Analysis of a graph: fusible nodes, their dtypes and shapes
# --------------------------------------------------------------------------------------------------

_CANDIDATES = None

#: Ops whose outputs' shapes come from a subgraph (see runtime_shape_unknown).
_CONTROL_FLOW = frozenset({"Loop", "Scan", "If"})

#: Ops whose output rank ONNX's inference knows whatever its data inputs' shapes (Shape: 1, Size: 0,
#: Range: 1, NonZero: 2; Reshape when its target is a constant: the target's length): an unknown shape
#: upstream of them does not reach their consumers (runtime_shape_unknown).
_RANK_FIXING = frozenset({"Shape", "Size", "Range", "NonZero"})


def _fixes_rank(node) -> bool:
    """ONNX Runtime knows ``node``'s output rank whatever its data inputs' shapes (:data:`_RANK_FIXING`, a
    Reshape to a constant target). A node without data inputs needs no test here: the walk finds none to
    follow."""
    if node.op in _RANK_FIXING:
        return True
    return node.op == "Reshape" and len(node.inputs) > 1 and const_value(node.inputs[1])[1]


def runtime_shape_unknown(t, memo: dict[str, bool]) -> bool:
    """``t`` comes from a Loop, Scan or If output through ops whose output shape ONNX Runtime infers
    from their inputs' shapes (every op but :data:`_RANK_FIXING` and a Reshape to a constant target):
    ONNX's inference may know its shape from the subgraph, or a graph output's declaration may state
    it, while ONNX Runtime's inference leaves it unknown, which a custom op is told as rank 0.
    Through reductions and MatMuls too: fuzz seed 342992's Loop output went through ReduceMean and
    MatMul (a graph output declared rank 4) into a fused Sigmoid, declared a scalar, and the Conv after
    it made the model unloadable. Walked with a stack, not recursion (a residual stream of Adds runs
    through a whole network). ``memo``: the answers so far by tensor name, shared by the calls of one
    region analysis (or one rule's plan)."""
    stack, open_names = [t], set()
    while stack:
        cur = stack[-1]
        if cur.name in memo:
            stack.pop()
            continue
        source = cur.inputs[0] if cur.inputs else None
        if source is None or source.op in _CONTROL_FLOW or _fixes_rank(source):
            memo[cur.name] = source is not None and source.op in _CONTROL_FLOW
            stack.pop()
            continue
        data = [x for x in source.inputs if x.name and not const_value(x)[1]]
        pending = [x for x in data if x.name not in memo and x.name not in open_names]
        if pending and cur.name not in open_names:
            open_names.add(cur.name)
            stack.extend(pending)
            continue
        memo[cur.name] = any(memo.get(x.name, False) for x in data)
        open_names.discard(cur.name)
        stack.pop()
    return memo[t.name]


def candidate_ops() -> frozenset:
    global _CANDIDATES
    if _CANDIDATES is None:
        _CANDIDATES = frozenset(_expr().OP_TABLE) | _LOWERED | _UNSUPPORTED_ELEMENTWISE
    return _CANDIDATES


@dataclass
class Region:
    nodes: list  # gs nodes in topological order
    inputs: list  # gs tensors, node input order
    outputs: list  # gs tensors, node output order
    lowerings: list
    refusal: Refuse | None = None  # why the region is not fused (None: it is)
    analysis: Any = None  # the RegionAnalysis that found it (dtypes and shapes of its graph)
    graph: Any = None  # the graph (top level or an If/Loop/Scan body) the fused node goes into
    node_names: set = field(default_factory=set)  # node names taken in the whole model (shared by one match)


# Ops whose output depends on their input's shape only but is not a function of it.
_NONDETERMINISTIC = frozenset({"RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial"})


def _shape_derived_tensors(nodes) -> set[int]:
    """ids of the tensors whose values depend only on tensor *sizes*: constants, ``Constant``,
    ``Shape`` and ``Size`` results, and anything computed from those alone. Bodies of If/Loop/Scan,
    other domains and values from an enclosing graph count as data. ``nodes`` need not be in
    topological order (rewrites append nodes): the set grows until it stops changing."""
    derived: set[int] = set()
    pending = []
    for n in nodes:
        if not is_default_domain(n):
            continue
        if n.op in ("Shape", "Size", "Constant"):
            derived.update(id(t) for t in n.outputs)
        elif n.op not in _NONDETERMINISTIC and not any(True for _ in subgraphs(n)):
            ins = [t for t in n.inputs if t.name or isinstance(t, gs.Constant)]
            if ins:
                pending.append((n, ins))
    changed = True
    while changed:
        changed, rest = False, []
        for n, ins in pending:
            if all(isinstance(t, gs.Constant) or id(t) in derived for t in ins):
                derived.update(id(t) for t in n.outputs)
                changed = True
            else:
                rest.append((n, ins))
        pending = rest
    return derived


class _Summary:
    """A group's region inputs (by tensor id) and the values its members produce (tensor id -> member)."""

    __slots__ = ("inputs", "produced")

    def __init__(self, inputs: dict, produced: dict):
        self.inputs, self.produced = inputs, produced


class RegionAnalysis:
    def __init__(self, graph: gs.Graph):
        expr = _expr()
        self.graph = graph
        self.nodes = list(graph.nodes)
        self.index = {id(n): i for i, n in enumerate(self.nodes)}
        self.info = infer_value_info(graph)
        self.graph_outputs = {id(t) for t in graph.outputs}
        self.graph_inputs = {id(t) for t in graph.inputs}
        # A reader inside a body counts as the node of this graph that holds the body.
        self.scope = Scope(graph)
        self.dtypes: dict[str, str | None] = {}
        self.shapes: dict[str, tuple | None] = {}
        self.lowered: dict[int, Lowering] = {}
        self.refused: dict[int, Refuse] = {}
        self.runtime_unknown: dict[str, bool] = {}  # _runtime_shape_unknown's answers, by tensor name
        self.shape_derived = _shape_derived_tensors(self.nodes)
        cands = candidate_ops()
        left_to_ort = decomposed_layernorm_nodes(graph)
        for i, n in enumerate(self.nodes):
            if n.op not in cands or not is_default_domain(n):
                continue
            if id(n) in left_to_ort:
                self.refused[i] = left_to_ort[id(n)]
                continue
            try:
                low = lower_node(n, graph, self.dtype_of)
                self._type(low)
                self.lowered[i] = low
            except Refused as r:
                self.refused[i] = r.refusal
            except expr.ProgramError as e:
                self.refused[i] = Refuse(e.problem, n)
        self.consumers: list[list[int]] = [[] for _ in self.nodes]
        self.producers: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for t in n.outputs:
                for c in t.outputs:
                    j = self._top(c)
                    if j is not None and j != i and j not in self.consumers[i]:
                        self.consumers[i].append(j)
                        self.producers[j].append(i)

    def _top(self, node) -> int | None:
        holder = self.scope.holder(node)
        return None if holder is None else self.index[id(holder)]

    # dtype / shape of any tensor
    def dtype_of(self, t) -> str | None:
        if t.name in self.dtypes:
            return self.dtypes[t.name]
        elem = self.info.get(t.name, (None, None))[0]
        return _expr().DTYPE_FROM_ONNX.get(elem) if elem else None

    def elem_name(self, t) -> str:
        elem = self.info.get(t.name, (None, None))[0]
        if not elem:
            return "unknown"
        return onnx.TensorProto.DataType.Name(elem).lower()

    def _runtime_shape_unknown(self, t) -> bool:
        """:func:`runtime_shape_unknown`, memoized for this analysis."""
        return runtime_shape_unknown(t, self.runtime_unknown)

    def shape_of(self, t):
        if t.name in self.shapes:
            return self.shapes[t.name]
        return self.info.get(t.name, (None, None))[1]

    def _type(self, low: Lowering):
        """Fill ``low.dtype``/``shape``/``folded``; refuse on unsupported dtypes or constants only."""
        expr = _expr()
        node = low.node
        op_dtypes = []
        for t in low.operands:
            d = self.dtype_of(t)
            if d is None:
                reason = (f"input {t.name!r} has dtype {self.elem_name(t)}, not supported by the language"
                          if self.info.get(t.name, (None,))[0] else f"dtype of input {t.name!r} is unknown")
                raise Refused(Refuse(reason, node))
            op_dtypes.append(d)
        consts = []
        for t in low.operands:
            arr, is_const = const_value(t)
            consts.append((arr, is_const))
        if all(c for _, c in consts):
            raise Refused(Refuse("all inputs are constant (constant folding, not fusion)", node))
        shapes = [self.shape_of(t) for t in low.operands]
        for t, shape, (_, is_const) in zip(low.operands, shapes, consts):
            if not is_const and (shape is None or self._runtime_shape_unknown(t)):
                # ONNX Runtime hands a custom op's shape inference an input of unknown shape as rank 0,
                # the same as a scalar: the fused op would then declare a wrong rank (a Loop output
                # fused before a Gather made the model unloadable, fuzz seed 60; Abs of a Loop output
                # before a ReduceMax, seed 2819, where ONNX's inference knew the shape and ONNX
                # Runtime's did not).
                raise Refused(Refuse(f"input {t.name!r} has an unknown rank (the fused op's shape inference would "
                                     "take it for a scalar)", node))
        # Scalar constants fold into the program unless they would raise the op's rank.
        for k, (arr, is_const) in enumerate(consts):
            if arr is None or arr.size != 1:
                continue
            others = [shapes[j] for j in range(len(shapes)) if j != k and not (consts[j][0] is not None)]
            rank_ok = arr.ndim == 0 or any(s is not None and len(s) >= arr.ndim for s in others)
            if rank_ok:
                low.folded[k] = _scalar(arr, op_dtypes[k])
        # Pow's exponent may have another dtype in ONNX; a folded constant takes the base's dtype.
        if node.op == "Pow" and op_dtypes[1] != op_dtypes[0]:
            if 1 in low.folded and op_dtypes[0] in expr.FLOAT_DTYPES:
                v = low.folded[1]
                if float(v) != float(np.float32(v)):
                    raise Refused(Refuse("Pow exponent not exactly representable", node))
                low.folded[1] = float(v)
                op_dtypes[1] = op_dtypes[0]
            else:
                raise Refused(Refuse(f"Pow of {op_dtypes[0]} by {op_dtypes[1]}", node))
        # Result dtype through the steps (validates dtypes against OP_TABLE).
        def step_dtype(op_type, arg_dt, attrs):  # a number takes its data operands' dtype
            data = [d for d in arg_dt if d is not None]
            fill = data[1] if expr.op_spec(op_type).cond_first and len(data) > 1 else (data[0] if data else None)
            return expr.result_dtype(op_type, [d if d is not None else fill for d in arg_dt], attrs)

        low.dtype = low.run_steps(op_dtypes, step_dtype, number=lambda _: None)[-1]
        out = node.outputs[0]
        inferred = self.info.get(out.name, (None, None))
        if inferred[0] and expr.DTYPE_FROM_ONNX.get(inferred[0]) not in (None, low.dtype):
            raise Refused(Refuse(f"inferred dtype of {out.name!r} disagrees with the op's", node))
        mine = bcast_shapes(shapes)
        theirs = inferred[1]
        if mine is None:
            shape = theirs
        elif theirs is not None and len(theirs) == len(mine):
            shape = tuple(m if m is not None else t for m, t in zip(mine, theirs))
        else:
            shape = mine
        # start-up: the command line starts (and --help runs) without onnxfuse.custom_ops
        from onnxfuse.custom_ops import MAX_RANK

        rank = max([len(s) for s in shapes + [shape] if s is not None], default=0)
        if rank > MAX_RANK:
            # The op's broadcast rank limit; a region's rank is the largest of its ops' ranks.
            raise Refused(Refuse(f"rank {rank} exceeds FusedElementwise's limit of {MAX_RANK}", node))
        ints = ("int32", "int64")
        if shape is not None and len(shape) <= 1 and (low.dtype in ints or any(d in ints for d in op_dtypes)):
            # Shape arithmetic (Shape -> Gather -> Add/Div -> Slice...): ONNX Runtime keeps it on
            # the CPU; a custom op there would cost device round trips and block constant folding.
            raise Refused(Refuse(f"shape computation (integer op of rank {len(shape)}): left to ONNX Runtime", node))
        if shape is not None and all(d == 1 for d in shape) and not self._reads_graph_input(low):
            # One-element arithmetic, e.g. attention's scale sqrt(1/sqrt(d)) computed from Shape:
            # ONNX Runtime runs it on the CPU beside the shape ops. Fusing it (or folding it into the
            # full-size op that reads it) saves no memory pass and made ViT-B/16 slower (docs/benchmarks.md).
            raise Refused(Refuse("scalar computation (one element): left to ONNX Runtime", node))
        if all(id(t) in self.shape_derived for t in low.operands):
            # Index and mask arithmetic on Range/Shape results (transformers' attention-mask
            # construction, testdata/bert_tiny_opset14.onnx): it depends on tensor sizes only. ONNX
            # Runtime keeps such chains beside its CPU shape ops; a CUDA custom op in the middle of
            # them would add host-device copies and saves no memory pass on the GPU's real data.
            raise Refused(Refuse("shape-derived computation (its inputs depend on tensor sizes only, not on "
                                 "data): left to ONNX Runtime", node))
        low.shape = shape
        self.dtypes[out.name] = low.dtype
        self.shapes[out.name] = shape

    def _reads_graph_input(self, low: Lowering) -> bool:
        """True when a one-element op reads a graph input directly (a model's own scalar
        arithmetic, which the user asked to fuse, rather than shape-derived glue)."""
        return any(id(t) in self.graph_inputs for t in low.operands)

    # ---- region checks ----------------------------------------------------------------------------
    def dynamic_operands(self, i):
        low = self.lowered[i]
        return [t for k, t in enumerate(low.operands) if k not in low.folded]

    def region_io(self, members):
        """(inputs, outputs) tensors of a region given by node indices (sorted)."""
        produced = {}
        for i in members:
            produced[id(self.nodes[i].outputs[0])] = i
        inputs, seen = [], set()
        for i in sorted(members):
            for t in self.dynamic_operands(i):
                if id(t) not in produced and id(t) not in seen:
                    seen.add(id(t))
                    inputs.append(t)
        return inputs, produced

    def escapes(self, i, contains, final: bool, upto: int) -> bool:
        t = self.nodes[i].outputs[0]
        if id(t) in self.graph_outputs:
            return True
        for c in t.outputs:
            j = self._top(c)
            if j is None or contains(j):
                continue
            if final or j not in self.lowered or j < upto or self.index.get(id(c)) is None:
                return True
        return False

    def ancestors_inputs(self, i, produced_by):
        seen_nodes, stack, ins = {i}, [i], set()
        while stack:
            x = stack.pop()
            for t in self.dynamic_operands(x):
                p = produced_by(id(t))
                if p is None:
                    ins.add(id(t))
                elif p not in seen_nodes:
                    seen_nodes.add(p)
                    stack.append(p)
        return ins

    # ---- the region judge (see partition.Judge): summaries of groups, joined as groups merge ------
    def state(self, members) -> "_Summary":
        inputs, produced = self.region_io(members)
        return _Summary({id(t): t for t in inputs}, produced)

    def join(self, states: list["_Summary"], i: int) -> "_Summary":
        big = states[0]
        for s in states[1:]:
            big.produced.update(s.produced)
        big.produced[id(self.nodes[i].outputs[0])] = i
        merged = {}
        for s in states:
            for tid, t in s.inputs.items():
                if tid not in big.produced:
                    merged[tid] = t
        for t in self.dynamic_operands(i):
            if id(t) not in big.produced:
                merged[id(t)] = t
        big.inputs = merged
        return big

    def verdict(self, states, i, contains, boundary, final: bool, upto: int):
        """The shape contract of the fused op: a value that leaves the region must have the region's
        broadcast shape, i.e. no region input that is not its ancestor may broadcast it larger."""
        out_i = id(self.nodes[i].outputs[0]) if i is not None else None

        def produced_by(tid):
            for s in states:
                m = s.produced.get(tid)
                if m is not None:
                    return m
            return i if tid == out_i else None

        inputs = {}
        for s in states:
            for tid, t in s.inputs.items():
                if produced_by(tid) is None:
                    inputs[tid] = t
        if i is not None:
            for t in self.dynamic_operands(i):
                if produced_by(id(t)) is None:
                    inputs[id(t)] = t
        for m in boundary:
            if not self.escapes(m, contains, final, upto):
                continue
            v = self.nodes[m].outputs[0]
            vshape = self.shapes.get(v.name)
            larger = [t for t in inputs.values() if not fits(self.shape_of(t), vshape)]
            if not larger:
                continue
            anc = self.ancestors_inputs(m, produced_by)  # only when needed: it walks the region
            for t in larger:
                if id(t) not in anc:
                    return m, Refuse(f"{v.name!r} {_fmt_shape(vshape)} is used outside but region input "
                                     f"{t.name!r} {_fmt_shape(self.shape_of(t))} may broadcast it larger",
                                     self.nodes[m])
        return None

    def regions(self) -> list[Region]:
        n = len(self.nodes)
        fusible = [i in self.lowered for i in range(n)]
        sink = [id(node.outputs[0]) in self.graph_outputs if node.outputs else False for node in self.nodes]
        parts, notes = partition(n, fusible, self.consumers, self.producers, self, sink=sink,
                                 label=lambda i: f"{self.nodes[i].op} {self.nodes[i].name!r}")
        out: list[Region] = []
        for i, why in sorted(self.refused.items()):
            out.append(Region([self.nodes[i]], [], [], [], refusal=why))
        for members in parts:
            nodes = [self.nodes[i] for i in members]
            if len(members) == 1:
                note = notes.get(members[0])
                single = "single op" + (f" ({note.reason})" if note else "")
                out.append(Region(nodes, [], [], [], refusal=Refuse(single, nodes[0])))
                continue
            inputs, _ = self.region_io(set(members))
            inside = set(members)
            outputs = [self.nodes[i].outputs[0] for i in members if self.escapes(i, inside.__contains__, True, n)]
            out.append(Region(nodes, inputs, outputs, [self.lowered[i] for i in members]))
        return out


def build_program(region: Region, dtype_of):
    """``(program, values)`` for ``region`` (ProgramBuilder validates every statement); ``values`` maps
    each member's output tensor name to its value name in the program."""
    expr = _expr()
    b = expr.ProgramBuilder()
    names: dict[int, str] = {}
    values: dict[str, str] = {}
    for t in region.inputs:
        names[id(t)] = b.input(dtype_of(t))
    for low in region.lowerings:
        op_names = []
        for k, t in enumerate(low.operands):
            if k in low.folded:
                dt = dtype_of(t)
                if low.node.op == "Pow" and k == 1:
                    dt = dtype_of(low.operands[0])
                op_names.append(b.const(low.folded[k], dt))
            else:
                op_names.append(names[id(t)])
        results = low.run_steps(op_names, lambda op_type, real, attrs: b.op(op_type, real, **attrs))
        names[id(low.node.outputs[0])] = results[-1]
        values[low.node.outputs[0].name] = results[-1]
    for t in region.outputs:
        b.output(names[id(t)])
    return b.build(), values
