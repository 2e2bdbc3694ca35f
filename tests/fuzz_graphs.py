"""Random ONNX graphs for fuzzing the optimizer, and the check each one must pass.

A generated model mixes elementwise ops with MatMul, Conv (+BatchNormalization), Reshape, Transpose,
Reduce*, Softmax, Concat, Slice, Gather, Where, Cast, Expand, in float32, float16 or with an int64
detour, and nests If branches and Loop bodies that read values of the enclosing graph (including the
``y = f(x) if c else x`` shape exporters write: an else branch that is ``Identity`` of an outer value).
Values stay in safe ranges (Sqrt/Log of |x|+1, Div by |x|+1) so that a wrong result cannot hide
behind a NaN.

:func:`check_seed` optimizes one model for one target and demands:

* the output passes ``onnx.checker`` (full check) and ONNX Runtime loads it;
* on the same random inputs its outputs match the original's, both run by ONNX Runtime on the CPU
  (exact for integer and bool outputs; dtype-aware tolerances for floats, which rewrites such as
  BatchNorm folding legitimately re-round);
* a second ``optimize`` of the output changes nothing (idempotence).

``tests/test_fuzz.py`` runs a small sample in CI; ``tools/fuzz_optimize.py`` runs thousands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
N, C, H, W = 2, 4, 3, 5


@dataclass
class Value:
    name: str
    dtype: int  # TensorProto element type
    shape: tuple[int, ...]


@dataclass
class Builder:
    rng: np.random.Generator
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    pool: list = field(default_factory=list)
    counter: int = 0

    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}_{self.counter}"

    def const(self, array: np.ndarray, base: str = "c") -> str:
        name = self.fresh(base)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], out: Value, **attrs) -> Value:
        self.nodes.append(helper.make_node(op, inputs, [out.name], name=self.fresh(op.lower()), **attrs))
        self.pool.append(out)
        return out

    def pick(self, dtype: int | None = None, rank: int | None = None) -> Value | None:
        cands = [v for v in self.pool if (dtype is None or v.dtype == dtype) and (rank is None or len(v.shape) == rank)]
        return cands[int(self.rng.integers(len(cands)))] if cands else None


def _np(dtype: int):
    return helper.tensor_dtype_to_np_dtype(dtype)


def _rand(rng, shape, dtype: int, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(_np(dtype))


# No Floor/Ceil/Sign, and int casts only of graph inputs: a step function turns the one-ulp
# re-rounding that exact-in-real-arithmetic rewrites (BatchNorm folding) cause into a jump of 1,
# and ONNX Runtime's own CPU provider computes Floor(Cast<float16>(x)) without the float16 rounding
# (x = 0.99991: ONNX says 1, ONNX Runtime 0), which would make the reference itself wrong.
UNARY = ["Relu", "Neg", "Abs", "Sigmoid", "Tanh", "Erf", "Exp"]
BINARY = ["Add", "Sub", "Mul", "Max", "Min"]


def _unary(b: Builder, v: Value) -> Value:
    op = UNARY[int(b.rng.integers(len(UNARY)))]
    if v.dtype == TensorProto.INT64 and op not in ("Neg", "Abs"):
        op = "Abs"  # ONNX Runtime's CPU provider has no int64 Relu
    if op == "Exp":  # keep it finite: Exp(Tanh(x))
        v = b.node("Tanh", [v.name], Value(b.fresh("t"), v.dtype, v.shape))
    return b.node(op, [v.name], Value(b.fresh("u"), v.dtype, v.shape))


def _safe_unary(b: Builder, v: Value) -> Value:
    """Sqrt, Log or Reciprocal of |x| + 1: defined everywhere."""
    a = b.node("Abs", [v.name], Value(b.fresh("a"), v.dtype, v.shape))
    one = b.const(np.ones((), _np(v.dtype)), "one")
    p = b.node("Add", [a.name, one], Value(b.fresh("p"), v.dtype, v.shape))
    op = ["Sqrt", "Log", "Reciprocal"][int(b.rng.integers(3))]  # results only ever feed products and sums
    return b.node(op, [p.name], Value(b.fresh("s"), v.dtype, v.shape))


def _broadcast_partner(b: Builder, v: Value) -> str:
    rank = len(v.shape)
    choice = int(b.rng.integers(4))
    if choice == 0:
        shape = ()
    elif choice == 1:
        shape = (v.shape[-1],)
    elif choice == 2 and rank == 4:
        shape = (1, v.shape[1], 1, 1)
    else:
        same = [u for u in b.pool if u.shape == v.shape and u.dtype == v.dtype and u.name != v.name]
        if same:
            return same[int(b.rng.integers(len(same)))].name
        shape = v.shape
    if v.dtype == TensorProto.INT64:
        return b.const(b.rng.integers(-3, 4, size=shape).astype(np.int64))
    return b.const(_rand(b.rng, shape, v.dtype))


def _binary(b: Builder, v: Value) -> Value:
    op = BINARY[int(b.rng.integers(len(BINARY)))]
    other = _broadcast_partner(b, v)
    ins = [v.name, other] if b.rng.random() < 0.5 else [other, v.name]
    return b.node(op, ins, Value(b.fresh("b"), v.dtype, v.shape))


def _div(b: Builder, v: Value) -> Value:
    """num / (|v| + 1): the denominator is at least 1, so the quotient is well conditioned (a
    denominator such as log(|v| + 1) near 0 turns a one-ulp difference upstream into 1e-3)."""
    if v.dtype == TensorProto.INT64:
        return _binary(b, v)
    a = b.node("Abs", [v.name], Value(b.fresh("a"), v.dtype, v.shape))
    den = b.node("Add", [a.name, b.const(np.ones((), _np(v.dtype)), "one")], Value(b.fresh("den"), v.dtype, v.shape))
    num = b.pick(v.dtype, len(v.shape)) or v
    if num.shape != v.shape:
        num = v
    return b.node("Div", [num.name, den.name], Value(b.fresh("d"), v.dtype, v.shape))


def _conv_bn(b: Builder, v: Value) -> Value:
    c = v.shape[1]
    w = b.const(_rand(b.rng, (c, c, 3, 3), v.dtype, 0.3), "w")
    ins = [v.name, w]
    if b.rng.random() < 0.5:
        ins.append(b.const(_rand(b.rng, (c,), v.dtype, 0.1), "bias"))
    out = b.node("Conv", ins, Value(b.fresh("conv"), v.dtype, v.shape), pads=[1, 1, 1, 1])
    if b.rng.random() < 0.7:
        scale = b.const(_rand(b.rng, (c,), v.dtype), "gamma")
        bias = b.const(_rand(b.rng, (c,), v.dtype), "beta")
        mean = b.const(_rand(b.rng, (c,), v.dtype, 0.1), "mean")
        var = b.const((np.abs(_rand(b.rng, (c,), v.dtype)) + 0.5).astype(_np(v.dtype)), "var")
        out = b.node("BatchNormalization", [out.name, scale, bias, mean, var],
                     Value(b.fresh("bn"), v.dtype, v.shape), epsilon=1e-3)
    return out


def _matmul(b: Builder, v: Value) -> Value:
    k = v.shape[-1]
    w = b.const(_rand(b.rng, (k, k), v.dtype, 1 / np.sqrt(k)), "mm")
    out = b.node("MatMul", [v.name, w], Value(b.fresh("mm"), v.dtype, v.shape))
    if b.rng.random() < 0.5:
        out = b.node("Add", [out.name, b.const(_rand(b.rng, (k,), v.dtype, 0.1), "mb")],
                     Value(b.fresh("mb"), v.dtype, v.shape))
    return out


def _transpose(b: Builder, v: Value) -> Value:
    perm = list(range(len(v.shape)))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    shape = tuple(v.shape[p] for p in perm)
    return b.node("Transpose", [v.name], Value(b.fresh("tr"), v.dtype, shape), perm=perm)


def _reshape_roundtrip(b: Builder, v: Value) -> Value:
    flat = (v.shape[0], int(np.prod(v.shape[1:])))
    r = b.node("Reshape", [v.name, b.const(np.array(flat, np.int64), "shp")], Value(b.fresh("rs"), v.dtype, flat))
    r = _unary(b, r) if b.rng.random() < 0.5 else r
    return b.node("Reshape", [r.name, b.const(np.array(v.shape, np.int64), "shp")],
                  Value(b.fresh("rs"), v.dtype, v.shape))


def _reduce(b: Builder, v: Value) -> Value:
    op = ["ReduceMean", "ReduceSum", "ReduceMax"][int(b.rng.integers(3))]
    shape = v.shape[:-1] + (1,)
    if op == "ReduceSum":  # opset 13+: axes as an input
        red = b.node(op, [v.name, b.const(np.array([-1], np.int64), "ax")], Value(b.fresh("r"), v.dtype, shape),
                     keepdims=1)
    else:
        red = b.node(op, [v.name], Value(b.fresh("r"), v.dtype, shape), axes=[-1], keepdims=1)
    return b.node("Sub", [v.name, red.name], Value(b.fresh("centred"), v.dtype, v.shape))


def _softmax(b: Builder, v: Value) -> Value:
    return b.node("Softmax", [v.name], Value(b.fresh("sm"), v.dtype, v.shape), axis=-1)


def _concat_slice(b: Builder, v: Value) -> Value:
    other = b.pick(v.dtype, len(v.shape))
    if other is None or other.shape != v.shape:
        other = v
    cat_shape = (v.shape[0], 2 * v.shape[1]) + v.shape[2:]
    cat = b.node("Concat", [other.name, v.name], Value(b.fresh("cat"), v.dtype, cat_shape), axis=1)
    start = int(b.rng.integers(0, v.shape[1] + 1))
    return b.node("Slice", [cat.name, b.const(np.array([start], np.int64), "st"),
                            b.const(np.array([start + v.shape[1]], np.int64), "en"),
                            b.const(np.array([1], np.int64), "ax")], Value(b.fresh("sl"), v.dtype, v.shape))


def _gather(b: Builder, v: Value) -> Value:
    idx = b.rng.permutation(v.shape[1]).astype(np.int64)
    return b.node("Gather", [v.name, b.const(idx, "idx")], Value(b.fresh("ga"), v.dtype, v.shape), axis=1)


def _where(b: Builder, v: Value) -> Value:
    # Where(v > 0, v, k·v): continuous at 0, so a one-ulp re-rounding of v near 0 (BatchNorm folding
    # in float16) moves the result by an ulp, not by the distance to an unrelated value.
    zero = b.const(np.zeros((), _np(v.dtype)), "zero")
    cond = b.node("Greater", [v.name, zero], Value(b.fresh("gt"), TensorProto.BOOL, v.shape))
    k = b.const(_rand(b.rng, (v.shape[-1],), v.dtype), "k")
    scaled = b.node("Mul", [v.name, k], Value(b.fresh("kv"), v.dtype, v.shape))
    return b.node("Where", [cond.name, v.name, scaled.name], Value(b.fresh("wh"), v.dtype, v.shape))


def _cast_detour(b: Builder, v: Value) -> Value:
    if v.dtype == TensorProto.INT64:
        return b.node("Cast", [v.name], Value(b.fresh("cf"), TensorProto.FLOAT, v.shape), to=TensorProto.FLOAT)
    if v.name in ("x", "y"):  # through int64 (truncation of exact values), integer arithmetic, back
        scaled = b.node("Mul", [v.name, b.const(np.array(4, _np(v.dtype)), "k")], Value(b.fresh("k"), v.dtype, v.shape))
        i = b.node("Cast", [scaled.name], Value(b.fresh("ci"), TensorProto.INT64, v.shape), to=TensorProto.INT64)
        i = _binary(b, i) if b.rng.random() < 0.7 else _unary(b, i)
        return b.node("Cast", [i.name], Value(b.fresh("cb"), v.dtype, v.shape), to=v.dtype)
    other = TensorProto.FLOAT16 if v.dtype == TensorProto.FLOAT else TensorProto.FLOAT
    t = b.node("Cast", [v.name], Value(b.fresh("cx"), other, v.shape), to=other)
    t = _unary(b, t)
    return b.node("Cast", [t.name], Value(b.fresh("cb"), v.dtype, v.shape), to=v.dtype)


def _expand(b: Builder, v: Value) -> Value:
    src = b.const(_rand(b.rng, (1, v.shape[1]) + (1,) * (len(v.shape) - 2), v.dtype), "ex")
    e = b.node("Expand", [src, b.const(np.array(v.shape, np.int64), "eshape")], Value(b.fresh("ex"), v.dtype, v.shape))
    return b.node("Mul", [v.name, e.name], Value(b.fresh("em"), v.dtype, v.shape))


def _sub_builder(b: Builder) -> Builder:
    sub = Builder(b.rng)
    sub.counter = b.counter + 1000  # names stay unique across the nesting
    sub.pool = list(b.pool)  # outer values are readable inside
    return sub


def _branch(b: Builder, v: Value, depth: int, identity_ok: bool) -> tuple[onnx.GraphProto, Builder]:
    sub = _sub_builder(b)
    if identity_ok and b.rng.random() < 0.4:  # y = f(x) if c else x: Identity of an outer value
        out = sub.node("Identity", [v.name], Value(sub.fresh("id"), v.dtype, v.shape))
    else:
        out = v
        for _ in range(int(b.rng.integers(1, 4))):
            out = _step(sub, out, depth + 1)
            if out.shape != v.shape or out.dtype != v.dtype:
                out = sub.node("Add", [v.name, v.name], Value(sub.fresh("dbl"), v.dtype, v.shape))
    b.counter = sub.counter + 1000
    graph = helper.make_graph(sub.nodes, sub.fresh("branch"), [],
                              [helper.make_tensor_value_info(out.name, out.dtype, list(out.shape))], sub.inits)
    return graph, sub


def _if(b: Builder, v: Value, depth: int) -> Value:
    # The condition reads the graph input, so re-rounding upstream can never flip the branch taken.
    total = b.node("ReduceSum", ["x"], Value(b.fresh("tot"), v.dtype, ()), keepdims=0)
    cond = b.node("Greater", [total.name, b.const(np.zeros((), _np(v.dtype)), "z")],
                  Value(b.fresh("cond"), TensorProto.BOOL, ()))
    then_g, _ = _branch(b, v, depth, identity_ok=False)
    else_g, _ = _branch(b, v, depth, identity_ok=True)
    return b.node("If", [cond.name], Value(b.fresh("if"), v.dtype, v.shape), then_branch=then_g, else_branch=else_g)


def _loop(b: Builder, v: Value, depth: int) -> Value:
    sub = _sub_builder(b)
    it = Value(sub.fresh("iter"), TensorProto.INT64, ())
    cin = Value(sub.fresh("cond_in"), TensorProto.BOOL, ())
    carried = Value(sub.fresh("carry"), v.dtype, v.shape)
    sub.pool.append(carried)
    cout = sub.node("Identity", [cin.name], Value(sub.fresh("cond_out"), TensorProto.BOOL, ()))
    sub.pool.remove(cout)
    acc = sub.node("Add", [carried.name, v.name], Value(sub.fresh("acc"), v.dtype, v.shape))  # reads outer v
    acc = _step(sub, acc, depth + 1)
    if acc.shape != v.shape or acc.dtype != v.dtype:
        acc = sub.node("Tanh", [carried.name], Value(sub.fresh("th"), v.dtype, v.shape))
    else:
        acc = sub.node("Tanh", [acc.name], Value(sub.fresh("th"), v.dtype, v.shape))
    b.counter = sub.counter + 1000
    body = helper.make_graph(
        sub.nodes, sub.fresh("body"),
        [helper.make_tensor_value_info(it.name, it.dtype, []), helper.make_tensor_value_info(cin.name, cin.dtype, []),
         helper.make_tensor_value_info(carried.name, carried.dtype, list(carried.shape))],
        [helper.make_tensor_value_info(cout.name, cout.dtype, []),
         helper.make_tensor_value_info(acc.name, acc.dtype, list(acc.shape))], sub.inits)
    trips = b.const(np.array(int(b.rng.integers(1, 4)), np.int64), "trips")
    go = b.const(np.array(True), "go")
    return b.node("Loop", [trips, go, v.name], Value(b.fresh("loop"), v.dtype, v.shape), body=body)


def _layernorm(b: Builder, v: Value) -> Value:
    """LayerNorm over the last axis as exporters decompose it below opset 17 (contrib-layernorm)."""
    k = v.shape[-1]
    mean = b.node("ReduceMean", [v.name], Value(b.fresh("mu"), v.dtype, v.shape[:-1] + (1,)), axes=[-1])
    d = b.node("Sub", [v.name, mean.name], Value(b.fresh("d"), v.dtype, v.shape))
    sq = b.node("Pow", [d.name, b.const(np.array(2, _np(v.dtype)), "two")], Value(b.fresh("sq"), v.dtype, v.shape))
    var = b.node("ReduceMean", [sq.name], Value(b.fresh("var"), v.dtype, v.shape[:-1] + (1,)), axes=[-1])
    eps = b.node("Add", [var.name, b.const(np.array(1e-3, _np(v.dtype)), "eps")], Value(b.fresh("ve"), v.dtype, var.shape))
    std = b.node("Sqrt", [eps.name], Value(b.fresh("std"), v.dtype, var.shape))
    n = b.node("Div", [d.name, std.name], Value(b.fresh("n"), v.dtype, v.shape))
    g = b.node("Mul", [n.name, b.const(_rand(b.rng, (k,), v.dtype), "gam")], Value(b.fresh("g"), v.dtype, v.shape))
    return b.node("Add", [g.name, b.const(_rand(b.rng, (k,), v.dtype), "bet")], Value(b.fresh("ln"), v.dtype, v.shape))


def _gelu(b: Builder, v: Value) -> Value:
    """Erf GELU as exporters decompose it below opset 20 (contrib-gelu)."""
    t = b.node("Div", [v.name, b.const(np.array(np.sqrt(2), _np(v.dtype)), "r2")], Value(b.fresh("gd"), v.dtype, v.shape))
    e = b.node("Erf", [t.name], Value(b.fresh("ge"), v.dtype, v.shape))
    p = b.node("Add", [e.name, b.const(np.array(1, _np(v.dtype)), "g1")], Value(b.fresh("gp"), v.dtype, v.shape))
    m = b.node("Mul", [v.name, p.name], Value(b.fresh("gm"), v.dtype, v.shape))
    return b.node("Mul", [m.name, b.const(np.array(0.5, _np(v.dtype)), "gh")], Value(b.fresh("gelu"), v.dtype, v.shape))


STEPS = [(_unary, 6), (_binary, 6), (_safe_unary, 2), (_div, 1), (_conv_bn, 2), (_matmul, 2), (_transpose, 1),
         (_reshape_roundtrip, 1), (_reduce, 1), (_softmax, 1), (_concat_slice, 1), (_gather, 1), (_where, 1),
         (_cast_detour, 2), (_expand, 1), (_layernorm, 1), (_gelu, 1)]
NESTED = [(_if, 1), (_loop, 1)]


def _step(b: Builder, v: Value, depth: int) -> Value:
    table = STEPS + (NESTED if depth < 2 else [])
    weights = np.array([w for _, w in table], float)
    fn = table[int(b.rng.choice(len(table), p=weights / weights.sum()))][0]
    if fn in (_conv_bn,) and (len(v.shape) != 4 or v.dtype == TensorProto.INT64):
        fn = _unary
    if fn in (_if, _loop):
        return fn(b, v, depth) if v.dtype != TensorProto.INT64 else _binary(b, v)
    if v.dtype == TensorProto.INT64 and fn not in (_unary, _binary, _cast_detour, _gather, _transpose):
        fn = _binary
    return fn(b, v)


def random_model(seed: int, n_steps: int | None = None) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    b = Builder(rng)
    dtype = [TensorProto.FLOAT, TensorProto.FLOAT, TensorProto.FLOAT16][seed % 3]
    x = Value("x", dtype, (N, C, H, W))
    b.pool.append(x)
    inputs = [x]
    if rng.random() < 0.5:
        y = Value("y", dtype, (N, C, H, W))
        b.pool.append(y)
        inputs.append(y)
    cur = x
    for _ in range(n_steps or int(rng.integers(4, 14))):
        src = cur if rng.random() < 0.7 else b.pick(dtype, 4) or cur
        cur = _step(b, src, 0)
        if cur.dtype != dtype and rng.random() < 0.5:
            cur = _cast_detour(b, cur)
    produced = [v for v in b.pool if v not in inputs]
    outs = [cur] + [produced[int(i)] for i in rng.choice(len(produced), size=min(2, len(produced)), replace=False)]
    seen, outputs = set(), []
    for v in outs:
        if v.name not in seen:
            seen.add(v.name)
            outputs.append(helper.make_tensor_value_info(v.name, v.dtype, list(v.shape)))
    graph = helper.make_graph(b.nodes, f"fuzz_{seed}", [helper.make_tensor_value_info(v.name, v.dtype, list(v.shape))
                                                       for v in inputs], outputs, b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def random_inputs(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1_000_003)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
    return feeds


TARGETS = ("cuda", "contrib", "onnx")


def _run(model: onnx.ModelProto, feeds, custom: bool):
    import onnxruntime as ort

    from onnxfuse.custom_ops import session_options
    from onnxfuse.runtime.stand_ins import for_cpu

    opts = session_options() if custom else ort.SessionOptions()
    opts.log_severity_level = 3
    model = for_cpu(model)  # NhwcConv (contrib-channels-last) as its definition: CUDA has its only kernel
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _tolerance(half: bool) -> float:
    """The relative (and, times the output's scale, absolute) tolerance of the oracle's comparisons. A
    model that computes in float16 anywhere carries float16 rounding into its float32 outputs, and a
    fused float16 chain rounds once at its end where ONNX Runtime rounds after every op."""
    return 2e-2 if half else 2e-4


def _close(ref: np.ndarray, got: np.ndarray, half: bool) -> bool:
    if ref.shape != got.shape or ref.dtype != got.dtype:
        return False
    if ref.dtype.kind in "biu":
        return bool(np.array_equal(ref, got))
    r, g = ref.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(r)
    if not np.array_equal(finite, np.isfinite(g)) or not np.array_equal(r[~finite], g[~finite], equal_nan=True):
        return False  # NaN and ±inf must sit at the same places with the same values
    tol = _tolerance(half or ref.dtype == np.float16)
    scale = max(1.0, float(np.abs(r[finite]).max()) if finite.any() else 1.0)
    return bool(np.allclose(r[finite], g[finite], rtol=tol, atol=tol * scale))


def as_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every float16 tensor made float32 (initializers, Constant values, inputs, outputs,
    value infos, loop-carried and branch values, Casts to float16), in every subgraph: the same
    computation without float16's roundings, the reference a float16 model's own rounding error is
    measured against (:func:`_no_farther_from_float32`)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)

    def tensor32(t: onnx.TensorProto) -> None:
        if t.data_type == TensorProto.FLOAT16:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name))

    def walk(g: onnx.GraphProto) -> None:
        for init in g.initializer:
            tensor32(init)
        for v in [*g.input, *g.output, *g.value_info]:
            if v.type.tensor_type.elem_type == TensorProto.FLOAT16:
                v.type.tensor_type.elem_type = TensorProto.FLOAT
        for n in g.node:
            for a in n.attribute:
                if n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT16:
                    a.i = TensorProto.FLOAT
                elif a.type == onnx.AttributeProto.TENSOR:
                    tensor32(a.t)
                elif a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for sub in a.graphs:
                        walk(sub)

    walk(out.graph)
    return out


def _no_farther_from_float32(model: onnx.ModelProto, feeds: dict, index: int, ref: np.ndarray,
                             got: np.ndarray) -> bool:
    """For a float16 model whose output ``index`` differs between the original (``ref``) and the optimized
    model (``got``) beyond the float16 tolerance: whether that is the model's own float16 rounding, not the
    rewrite. The reference is the same model computed in float32 (:func:`as_float32`). The optimized
    output passes when it is no farther from it than 1.5 times the original's own distance (plus 1e-3 of
    the output's scale): a graph that amplifies rounding (a Loop of Min and Tanh over a folded Conv, seed
    413024: both 0.036 off the float32 model, in opposite directions, 0.073 apart) is then told from a
    rewrite that moves the result away from the exact one. Same NaN and infinity positions required (the
    caller's check); False when the float32 model cannot be run."""
    try:
        feeds32 = {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feeds.items()}
        truth = np.asarray(_run(as_float32(model), feeds32, custom=False)[index], np.float64)
    except Exception:
        return False
    r, g = ref.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(r) & np.isfinite(g) & np.isfinite(truth)
    if truth.shape != r.shape or not np.array_equal(finite, np.isfinite(r)) or not finite.any():
        return False
    scale = max(1.0, float(np.abs(truth[finite]).max()))
    own = float(np.abs(r[finite] - truth[finite]).max())
    ours = float(np.abs(g[finite] - truth[finite]).max())
    return ours <= 1.5 * own + 1e-3 * scale


#: comparisons whose result flips when an operand moves across the other by any amount, however small
ORDER_COMPARISONS = ("Greater", "Less", "GreaterOrEqual", "LessOrEqual")


def _flips_at_threshold(model: onnx.ModelProto, feeds: dict, index: int, ref: np.ndarray, got: np.ndarray,
                        half: bool) -> bool:
    """For a bool output ``index`` that differs between the original (``ref``) and the optimized model
    (``got``): whether every differing element is an order comparison whose float operands, in the
    original, lie within the rounding tolerance of :func:`_close` of each other, so that a rounding
    difference anywhere upstream decides it. Such a step output carries no information about the rewrite:
    seed 581359 compares Erf(Cast(softmax, float16)) with 0 where the softmax underflows to 0, and ONNX
    Runtime's CPU Erf gives 6e-8 for erf(0) while FusedElementwise gives 0 (exact); seed 581108 compares a
    Conv output within 1e-3 of 0 after a float16 Erf-Tanh chain fused with one rounding instead of two.
    A flip where the operands are farther apart than the tolerance is still a wrong result."""
    producer = next((n for n in model.graph.node if model.graph.output[index].name in n.output), None)
    if producer is None or producer.op_type not in ORDER_COMPARISONS or ref.shape != got.shape:
        return False
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    for name in producer.input:
        probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    try:
        a, b = (np.broadcast_to(np.asarray(v, np.float64), ref.shape) for v in _run(probe, feeds, custom=False))
    except Exception:
        return False
    flipped = ref != got
    tol = _tolerance(half)
    scale = np.maximum(1.0, np.maximum(np.abs(a), np.abs(b)))
    return bool(np.all(np.abs(a - b)[flipped] <= tol * scale[flipped]))


def _computes_in_half(model: onnx.ModelProto) -> bool:
    def walk(g: onnx.GraphProto) -> bool:
        if any(t.data_type == TensorProto.FLOAT16 for t in g.initializer):
            return True
        for n in g.node:
            for a in n.attribute:
                if (n.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT16) or (
                        a.type == onnx.AttributeProto.GRAPH and walk(a.g)):
                    return True
        return False
    return walk(model.graph) or any(v.type.tensor_type.elem_type == TensorProto.FLOAT16 for v in model.graph.input)


def _invalid(out: onnx.ModelProto, target: str) -> tuple[str, str] | None:
    """('invalid', detail) when ONNX's full checker refuses an optimized model, else None."""
    try:
        onnx.checker.check_model(out, full_check=True)
    except Exception as e:
        return "invalid", f"{target}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return None


def check_seed(seed: int, target: str | None = None, make=None, inputs=None, only=None) -> tuple[str, str]:
    """('ok' | 'skip' | 'ort-bug' | 'invalid' | 'unloadable' | 'wrong' | 'not-idempotent' | 'error',
    detail) for one seed. 'skip': ONNX Runtime cannot run the generated model itself; 'ort-bug': it
    runs the model but not the same graph with its dead nodes removed (its own graph optimizer breaks:
    seed 7721, LayerNormFusion binding float and float16), so no rewrite of ours is involved. ``only``:
    optimize's rule selection (``"+contrib-channels-last"`` adds an opt-in rule)."""
    import onnxfuse

    target = target or TARGETS[seed % len(TARGETS)]
    try:
        model = (make or random_model)(seed)
    except Exception as e:  # an option combination the generator cannot build
        return "skip", f"generator: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        onnx.checker.check_model(model, full_check=True)
        feeds = (inputs or random_inputs)(model, seed)
        ref = _run(model, feeds, custom=False)
    except Exception as e:  # the generator made a model ONNX Runtime rejects: not the optimizer's fault
        return "skip", f"original: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        result = onnxfuse.optimize(model, target=target, validate=False, only=only)
    except Exception as e:
        return "error", f"optimize ({target}): {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    out = result.model
    invalid = _invalid(out, target)
    if invalid:
        return invalid
    try:
        got = _run(out, feeds, custom=target == "cuda")
    except Exception as e:
        why = f"{target}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        try:  # the original with only its dead nodes removed: does ONNX Runtime's own optimizer fail too?
            _run(onnxfuse.optimize(model, rules=[], validate=False).model, feeds, custom=False)
        except Exception:
            return "ort-bug", why  # ONNX Runtime rejects the input's own live graph: not ours
        return "unloadable", why
    half = _computes_in_half(model)
    for i, (r, g) in enumerate(zip(ref, got)):
        if not _close(r, g, half):
            if half and r.shape == g.shape and r.dtype == g.dtype and r.dtype.kind == "f" and np.array_equal(
                    np.isfinite(r), np.isfinite(g)) and _no_farther_from_float32(model, feeds, i, r, g):
                continue  # the float16 model's own rounding, amplified: as near the float32 result as the original
            if r.dtype == np.bool_ and _flips_at_threshold(model, feeds, i, r, g, half):
                continue  # a comparison of two values a rounding apart: decided by rounding, not by the rewrite
            err = float(np.nanmax(np.abs(r.astype(np.float64) - g.astype(np.float64)))) if r.shape == g.shape else -1
            return "wrong", f"{target}: output {i} ({out.graph.output[i].name}) max abs err {err:.3g}"
    again = onnxfuse.optimize(out, target=target, validate=False, only=only)
    changed = {k: v for k, v in again.applied.counts.items() if v}
    if changed:
        return "not-idempotent", f"{target}: second pass applied {changed}"
    return "ok", target


def _normalized_error(ref: np.ndarray, got: np.ndarray) -> float:
    """max |got - ref| / max(1, max |ref|) over ref's finite entries (float64)."""
    r, g = ref.astype(np.float64), got.astype(np.float64)
    finite = np.isfinite(r)
    if not finite.any():
        return 0.0
    return float(np.abs(g[finite] - r[finite]).max() / max(1.0, float(np.abs(r[finite]).max())))


def check_precision_seed(seed: int, target: str | None = None) -> tuple[str, str]:
    """``optimize --precision fp16`` of a float32 random graph (``random_model``; graphs that already
    compute in float16 are skipped): ('ok' | 'refused' | 'skip' | 'invalid' | 'unloadable' | 'wrong' |
    'error', detail). Validation is on, as a user runs it: a ``ValidationFailed`` or another
    ``OnnxfuseError`` is 'refused' (one clear line, nothing written: an allowed outcome), any other exception
    'error'. A model it writes must pass the checker, load, keep float32 inputs and outputs, be finite
    wherever the float32 original is, and be no farther from the float32 original than 3x the plain
    float16 conversion's own distance (the same model converted with no rewrite, ``rules=[]``) or the default
    budget's 2e-2 of normalized error: computed here, independently of optimize's own judge. An integer
    output (a Cast of float values) equals the original's, or where it does not, the plain conversion's. The plain
    conversion is evaluated by ONNX's reference evaluator, which rounds to float16 after every op as ONNX
    specifies; ONNX Runtime's CPU provider runs float16 ops in float32 and drops the Cast pairs around them
    even with its optimizations off (seed 502770: ``Cast(x, float16)·4`` cast to int64 gave 4 there,
    float16's 1.0·4 is 5 with the offset, where onnxfuse's output rounds as specified)."""
    from onnx.reference import ReferenceEvaluator

    import onnxfuse
    from onnxfuse.errors import OnnxfuseError

    target = target or TARGETS[seed % len(TARGETS)]
    try:
        model = random_model(seed)
    except Exception as e:
        return "skip", f"generator: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if _computes_in_half(model):
        return "skip", "computes in float16 already"
    try:
        onnx.checker.check_model(model, full_check=True)
        feeds = random_inputs(model, seed)
        ref = _run(model, feeds, custom=False)
        plain = onnxfuse.optimize(model, rules=[], precision="fp16", validate=False).model
        with np.errstate(all="ignore"):  # float16 overflow in the reference's numpy: inf, as the model says
            base = [np.asarray(v) for v in ReferenceEvaluator(plain).run(None, feeds)]
    except Exception as e:  # the original, or its plain conversion, does not run: not a rewrite's doing
        return "skip", f"original or plain conversion: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    try:
        result = onnxfuse.optimize(model, target=target, precision="fp16", provider="cpu")
    except OnnxfuseError as e:
        return "refused", f"{target}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    except Exception as e:
        return "error", f"optimize ({target}, fp16): {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    out = result.model
    invalid = _invalid(out, target)
    if invalid:
        return invalid
    types = lambda vs: [v.type.tensor_type.elem_type for v in vs]  # noqa: E731
    if types(out.graph.input) != types(model.graph.input) or types(out.graph.output) != types(model.graph.output):
        return "wrong", f"{target}: input or output types changed"
    try:
        got = _run(out, feeds, custom=target == "cuda")
    except Exception as e:
        return "unloadable", f"{target}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
    for i, (r, g, b) in enumerate(zip(ref, got, base)):
        if r.dtype.kind != "f":  # an integer made from float16 values may move as float16 moves it
            moved = r != g
            if r.shape != g.shape or (moved.any() and not (b.shape == r.shape and np.array_equal(g[moved], b[moved]))):
                return "wrong", f"{target}: output {i} ({out.graph.output[i].name}) differs (integer, not as the plain conversion)"
            continue
        if r.shape != g.shape or not np.isfinite(g[np.isfinite(r)]).all():
            return "wrong", f"{target}: output {i} ({out.graph.output[i].name}) shape or non-finite values"
        ours, floor = _normalized_error(r, g), _normalized_error(r, b) if b.shape == r.shape else np.inf
        if ours > max(2e-2, 3 * floor):
            return "wrong", (f"{target}: output {i} ({out.graph.output[i].name}) normalized error {ours:.3g}, "
                             f"the plain conversion's {floor:.3g}")
    return "ok", target
