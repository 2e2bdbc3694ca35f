"""Tests of the FusedElementwise program language (onnxfuse/custom_ops/expr.py).

The numpy evaluator is checked against an *independent* reference: ONNX Runtime (CPU) running the
unfused standard-ONNX model that onnx_equivalent_model builds. Ops that IEEE arithmetic defines
exactly (+ - * / sqrt, comparisons, rounding, casts, ...) must agree bit for bit; transcendental ones
within a few ulps.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from onnxfuse.custom_ops.expr import (
    DTYPES,
    FLOAT_DTYPES,
    INT_DTYPES,
    OP_TABLE,
    Const,
    Op,
    Program,
    ProgramBuilder,
    ProgramError,
    evaluate,
    numpy_dtype,
    onnx_equivalent_model,
    parse,
    print_program,
    round_to_dtype,
)

BF16 = np.dtype(ml_dtypes.bfloat16)

# --------------------------------------------------------------------------------------------------
# ONNX Runtime reference
# --------------------------------------------------------------------------------------------------

_SO = ort.SessionOptions()
_SO.intra_op_num_threads = 1
_SO.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # no fusions of its own


def ort_run(program: Program, inputs: list[np.ndarray]) -> list[np.ndarray]:
    model = onnx_equivalent_model(program, [x.shape for x in inputs], bfloat16_io="float32")
    sess = ort.InferenceSession(model.SerializeToString(), _SO, providers=["CPUExecutionProvider"])
    feeds = {}
    for gi, x in zip(sess.get_inputs(), inputs):
        feeds[gi.name] = x.astype(np.float32) if x.dtype == BF16 else x
    outs = sess.run(None, feeds)
    return [o.astype(BF16) if dt == "bfloat16" else o for o, dt in zip(outs, program.output_dtypes())]


def _as_f64(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float64)


# Transcendental ops: ONNX Runtime's float32 kernels are a few ulps off the exact value.
_INEXACT = {"Pow", "Exp", "Log", "Sin", "Cos", "Atan", "Tanh", "Erf", "Sigmoid", "Softplus", "Softsign", "Mish",
            "HardSwish", "LeakyRelu", "Elu", "Celu", "Selu", "HardSigmoid", "Gelu", "Reciprocal"}
_TOL = {"float32": (1e-6, 1e-6), "float16": (1e-3, 1e-4), "bfloat16": (8e-3, 1e-3)}


def assert_same(got: np.ndarray, want: np.ndarray, dtype: str, exact: bool, what: str = ""):
    assert got.dtype == want.dtype == numpy_dtype(dtype), (got.dtype, want.dtype, dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    if exact or dtype not in FLOAT_DTYPES:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        rtol, atol = _TOL[dtype]
        np.testing.assert_allclose(_as_f64(got), _as_f64(want), rtol=rtol, atol=atol, err_msg=what)


def check_against_ort(program: Program, inputs: list[np.ndarray], exact: bool, what: str = ""):
    got = evaluate(program, inputs)
    want = ort_run(program, inputs)
    assert len(got) == len(want) == len(program.outputs)
    for g, w, dt in zip(got, want, program.output_dtypes()):
        assert_same(g, w, dt, exact, what + "\n" + program.to_text())


# --------------------------------------------------------------------------------------------------
# Every op, every dtype, against ONNX Runtime
# --------------------------------------------------------------------------------------------------

RNG_SEED = 1234


def _values(rng, op: str, dtype: str, shape, arg: int) -> np.ndarray:
    """Inputs inside each op's domain (no NaN; ONNX leaves some NaN/overflow behaviour open)."""
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in INT_DTYPES:
        if op == "Div" and arg == 1:
            v = rng.integers(1, 9, shape) * rng.choice([-1, 1], shape)
        elif op == "Mul":
            v = rng.integers(-1000, 1000, shape)
        else:
            v = rng.integers(-50, 50, shape)
        return v.astype(numpy_dtype(dtype))
    if op in ("Log", "Sqrt", "Reciprocal") or (op == "Pow" and arg == 0):
        v = rng.uniform(0.05, 4.0, shape)
    elif op == "Div" and arg == 1:
        v = rng.uniform(0.5, 3.0, shape) * rng.choice([-1, 1], shape)
    elif op == "Pow":
        v = rng.uniform(-2.0, 2.0, shape)
    elif op in ("Round", "Floor", "Ceil", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
                "Min", "Max"):
        v = rng.integers(-8, 8, shape) / 2.0  # exact halves: ties for Round, equal values to compare
        v = v + rng.choice([0.0, 0.0, 0.25], shape)
    elif op == "Cast":
        v = rng.uniform(-100.0, 100.0, shape)
        v[..., :2] = 0.0
    else:
        v = rng.uniform(-4.0, 4.0, shape)
        v.flat[0] = 0.0
    return round_to_dtype(v, dtype)


_ATTR_VARIANTS = {
    "LeakyRelu": [{}, {"alpha": 0.2}],
    "Elu": [{}, {"alpha": 0.5}],
    "Celu": [{}, {"alpha": 2.0}],
    "Selu": [{}, {"alpha": 1.5, "gamma": 0.75}],
    "HardSigmoid": [{}, {"alpha": 0.3, "beta": 0.4}],
    "Gelu": [{}, {"approximate": "tanh"}],
}


def _op_cases():
    for name, spec in OP_TABLE.items():
        for dt in DTYPES:
            if dt not in spec.dtypes:
                continue
            if name == "Cast":
                for to in DTYPES:
                    yield pytest.param(name, dt, {"to": to}, id=f"Cast-{dt}-{to}")
            elif name == "Clip":
                if dt in INT_DTYPES:
                    variants = [{}, {"min": -5}, {"max": 7}, {"min": -5, "max": 7}]
                else:
                    variants = [{}, {"min": -0.1}, {"min": -1.5, "max": 0.3}]
                for i, v in enumerate(variants):
                    yield pytest.param(name, dt, v, id=f"Clip-{dt}-{i}")
            else:
                for i, v in enumerate(_ATTR_VARIANTS.get(name, [{}])):
                    yield pytest.param(name, dt, v, id=f"{name}-{dt}-{i}")


@pytest.mark.parametrize("op_type,dtype,attrs", list(_op_cases()))
def test_op_matches_onnxruntime(op_type, dtype, attrs):
    spec = OP_TABLE[op_type]
    rng = np.random.default_rng(RNG_SEED)
    b = ProgramBuilder()
    shapes = [(2, 3, 4, 5), (1, 3, 1, 1), (5,)][: spec.arity]
    names, inputs = [], []
    for i, shp in enumerate(shapes):
        d = "bool" if (spec.cond_first and i == 0) else dtype
        names.append(b.input(d))
        inputs.append(_values(rng, op_type, d, shp, i))
    b.output(b.op(op_type, names, **attrs))
    p = b.build()
    check_against_ort(p, inputs, exact=op_type not in _INEXACT)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_float_extremes_of_exact_ops(dtype):
    """Overflow, subnormals and signed zeros through exact ops agree bit for bit."""
    big = float(np.finfo(numpy_dtype(dtype)).max) if dtype != "bfloat16" else float(ml_dtypes.finfo(BF16).max)
    tiny = float(ml_dtypes.finfo(BF16).smallest_subnormal if dtype == "bfloat16"
                 else np.finfo(numpy_dtype(dtype)).smallest_subnormal)
    vals = np.array([big, -big, tiny, -tiny, 0.0, -0.0, 1.0, 3.0, math.inf, -math.inf])
    x = round_to_dtype(vals, dtype)
    y = round_to_dtype(vals[::-1].copy(), dtype)
    b = ProgramBuilder()
    a, c = b.input(dtype), b.input(dtype)
    for op in ("Add", "Sub", "Mul", "Min", "Max"):
        b.output(b.op(op, [a, c]))
    b.output(b.op("Mul", [a, 0.5]))
    b.output(b.op("Sqrt", [b.op("Abs", [a])]))
    b.output(b.op("Cast", [a], to="float32"))
    b.output(b.op("Cast", [b.op("Cast", [a], to="float32")], to=dtype))
    check_against_ort(b.build(), [x, y], exact=True)


def test_cast_rounding_between_floats():
    """float32 -> float16/bfloat16 round to nearest even, including ties (checked against ORT)."""
    base = np.float32(1.0)
    bits = np.arange(0, 1 << 17, 97, dtype=np.uint32)  # walk the low mantissa bits, hits ties
    x = (base.view(np.uint32) + bits).view(np.float32)
    x = np.concatenate([x, -x, x * np.float32(2.0**-20), np.float32([65519.0, 65520.0, 1e-8])])
    for to in ("float16", "bfloat16", "int32", "bool"):
        b = ProgramBuilder()
        b.output(b.op("Cast", [b.input("float32")], to=to))
        check_against_ort(b.build(), [x], exact=True, what=to)


def test_float64_to_bfloat16_rounds_once():
    # 1 + 2^-8 + 2^-30 is just above the tie between 1 and 1 + 2^-7 (the bfloat16 neighbours);
    # rounding through float32 first would drop the 2^-30 and round the tie to even (1.0).
    x = np.float64(1 + 2**-8 + 2**-30)
    assert float(round_to_dtype(x, "bfloat16").astype(np.float64)) == 1 + 2**-7
    assert float(round_to_dtype(-x, "bfloat16").astype(np.float64)) == -(1 + 2**-7)
    assert float(round_to_dtype(np.float64(1 + 2**-8), "bfloat16").astype(np.float64)) == 1.0


def test_int_div_truncates_and_round_half_even_like_onnxruntime():
    a = np.array([-7, 7, -7, 7, -1, 0, 9, -9], dtype=np.int32)
    d = np.array([2, -2, -2, 2, 3, -5, 4, 4], dtype=np.int32)
    b = ProgramBuilder()
    x, y = b.input("int32"), b.input("int32")
    b.output(b.op("Div", [x, y]))
    p = b.build()
    assert evaluate(p, [a, d])[0].tolist() == [-3, -3, 3, 3, 0, 0, 2, -2]  # C semantics
    check_against_ort(p, [a, d], exact=True)
    b = ProgramBuilder()
    b.output(b.op("Round", [b.input("float32")]))
    r = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 0.49999997], dtype=np.float32)
    check_against_ort(b.build(), [r], exact=True)


def test_int64_wraparound_and_large_constants():
    b = ProgramBuilder()
    x = b.input("int64")
    b.output(b.op("Add", [x, 2**62]))
    b.output(b.op("Mul", [x, -(2**63)]))
    b.output(b.op("Clip", [x], min=-(2**63), max=2**40))
    xs = np.array([2**62, -1, 3, 2**63 - 1, -(2**63)], dtype=np.int64)
    check_against_ort(b.build(), [xs], exact=True)


# --------------------------------------------------------------------------------------------------
# Broadcasting and multiple outputs
# --------------------------------------------------------------------------------------------------

BROADCAST_CASES = [
    [(2, 3, 4, 5), (1, 3, 1, 1), (5,), ()],
    [(), (), (), ()],
    [(1, 1, 1, 5), (5,), (1,), (4, 1)],
    [(3, 1), (1, 4), (), (1, 1, 1, 1)],
]


@pytest.mark.parametrize("shapes", BROADCAST_CASES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_broadcasting_and_multi_output(shapes, dtype):
    rng = np.random.default_rng(7)
    b = ProgramBuilder()
    x, scale, bias, s = (b.input(dtype, name) for name in ("x", "scale", "bias", "s"))
    t = b.op("Mul", [x, scale])
    u = b.op("Add", [t, bias])
    v = b.op("Sigmoid", [u])
    w = b.op("Mul", [u, v])
    b.output(w)
    b.output(b.op("Mul", [scale, 2.0]))  # depends on one input only: must still get the full shape
    b.output(s)  # an input output directly
    b.output(s)  # and twice
    b.output(b.op("Cast", [b.op("Greater", [bias, s])], to="int64"))
    b.output(b.op("Where", [b.op("Less", [x, 0.0]), x, b.op("Neg", [x])]))
    p = b.build()
    inputs = [round_to_dtype(rng.uniform(-3, 3, shp), dtype) for shp in shapes]
    got = evaluate(p, inputs)
    full = np.broadcast_shapes(*shapes)
    assert all(g.shape == full for g in got)
    check_against_ort(p, inputs, exact=False)


def test_int_and_bool_program():
    b = ProgramBuilder()
    i, j, m = b.input("int32"), b.input("int32"), b.input("bool")
    s = b.op("Sub", [i, j])
    b.output(b.op("Where", [m, b.op("Abs", [s]), b.op("Relu", [s])]))
    b.output(b.op("Xor", [m, b.op("GreaterOrEqual", [i, j])]))
    b.output(b.op("Where", [m, m, b.op("Not", [m])]))
    b.output(b.op("Cast", [s], to="float16"))
    b.output(b.op("Cast", [m], to="int64"))
    b.output(b.op("Max", [b.op("Cast", [i], to="int64"), 3]))
    rng = np.random.default_rng(3)
    inputs = [rng.integers(-9, 9, (4, 1)).astype(np.int32), rng.integers(-9, 9, (3,)).astype(np.int32),
              rng.random((1, 3)) < 0.5]
    check_against_ort(b.build(), inputs, exact=True)


def test_spec_example_against_onnxruntime():
    text = open_spec_example()
    p = parse(text)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((2, 8, 3)).astype(np.float32), rng.standard_normal((8, 1)).astype(np.float32)]
    check_against_ort(p, inputs, exact=False)


def open_spec_example() -> str:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "program-language.md").read_text()
    return doc.split("```")[1]


# --------------------------------------------------------------------------------------------------
# Random programs: exact ops agree with ONNX Runtime bit for bit
# --------------------------------------------------------------------------------------------------

_EXACT_FLOAT_OPS = ["Add", "Sub", "Mul", "Div", "Min", "Max", "Neg", "Abs", "Sign", "Relu", "Floor",
                    "Ceil", "Round", "Sqrt", "Clip", "Identity", "Where", "Equal", "Less",
                    "GreaterOrEqual", "Not", "And", "Or", "Xor"]
_EXACT_INT_OPS = ["Add", "Sub", "Mul", "Min", "Max", "Neg", "Abs", "Sign", "Relu", "Clip", "Identity",
                  "Where", "Equal", "Greater", "LessOrEqual", "Not", "And", "Or"]


@st.composite
def exact_programs(draw):
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16", "int32", "int64"]))
    ops = _EXACT_FLOAT_OPS if dtype in FLOAT_DTYPES else _EXACT_INT_OPS
    shapes_pool = [(2, 3), (3,), (1, 3), (), (2, 1)]
    b = ProgramBuilder()
    n_in = draw(st.integers(1, 3))
    vals = {dtype: [], "bool": []}
    shapes = []
    for _ in range(n_in):
        vals[dtype].append(b.input(dtype))
        shapes.append(draw(st.sampled_from(shapes_pool)))
    small = st.sampled_from([-2.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 3.0, 4.0])
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(ops))
        spec = OP_TABLE[op]
        d = "bool" if spec.dtypes == frozenset({"bool"}) else dtype
        if d == "bool" and not vals["bool"]:
            vals["bool"].append(b.op("Less", [draw(st.sampled_from(vals[dtype])), 1]))
        pool = vals[d]
        args = []
        if spec.cond_first:
            if not vals["bool"]:
                vals["bool"].append(b.op("Greater", [draw(st.sampled_from(vals[dtype])), 0.0]))
            args.append(draw(st.sampled_from(vals["bool"])))
        for _ in range(spec.arity - len(args)):
            if d != "bool" and draw(st.integers(0, 4)) == 0:
                args.append(draw(small) if d in FLOAT_DTYPES else int(draw(small) * 2))
            else:
                args.append(draw(st.sampled_from(pool)))
        if all(not isinstance(a, str) for a in args[1 if spec.cond_first else 0:]):
            args[-1] = draw(st.sampled_from(pool))
        attrs = {}
        if op == "Clip":
            lo = draw(small)
            attrs = {"min": lo if d in FLOAT_DTYPES else int(lo * 2), "max": 10 if d in INT_DTYPES else 2.5}
        name = b.op(op, args, **attrs)
        vals[b.dtype_of(name)].append(name)
    outs = draw(st.lists(st.sampled_from(vals[dtype] + vals["bool"]), min_size=1, max_size=3))
    for o in outs:
        b.output(o)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    inputs = []
    for shp in shapes:
        v = rng.integers(-6, 7, shp) / 2.0
        inputs.append(round_to_dtype(v, dtype) if dtype in FLOAT_DTYPES
                      else rng.integers(-100, 100, shp).astype(numpy_dtype(dtype)))
    return b.build(), inputs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exact_programs())
def test_random_exact_programs_match_onnxruntime(case):
    p, inputs = case
    # NaN and infinities are where ONNX leaves kernels free (Relu(NaN), Max(NaN, x)); stay finite.
    all_values = Program(p.version, p.inputs, p.consts, p.ops, tuple(o.name for o in p.ops))
    for v in evaluate(all_values, inputs):
        if v.dtype.kind == "f" or v.dtype == BF16:
            assume(np.isfinite(v.astype(np.float64)).all())
    check_against_ort(p, inputs, exact=True)


# --------------------------------------------------------------------------------------------------
# Text round trip
# --------------------------------------------------------------------------------------------------

AWKWARD_FLOATS = [0.1, 1e-45, 5e-324, -0.0, 0.0, math.inf, -math.inf, math.nan, 1.7976931348623157e308,
                  1 / 3, 2.0**-149, 65504.0, 1e16, -1.5e-7, 123456789.125]


def _roundtrip(p: Program):
    text = print_program(p)
    q = parse(text)
    assert q == p
    assert q.to_text() == text
    assert p.validate() == p
    return text


def test_roundtrip_hand_written():
    text = """
        # comments and blank lines are fine
        onnxfuse.elementwise 1   # header

        input   x :float32
        input mask: bool
        const a: float32 = 0x1.8p+1       # hex float
        const b: float32 = -1e-05
        const n: float32 = nan
        const ninf: float32 = -inf
        const z: float32 = -0.0
        const big: int64 = -9223372036854775808
        const one: bool = 1
        t0: float32 = Mul(x,a)
        t1: float32=Clip[min=-1, max=2.5](t0)
        t2: float32 = Gelu[approximate=tanh](t1)
        t3: float32 = Selu(t2)
        t4: bool = And(mask, one)
        t5: float32 = Where(t4, t3, z)
        t6: int64 = Cast[to=int64](t5)
        t7: int64 = Max(t6, big)
        t8: float32 = Max(t5, n)
        t9: float32 = Max(t8, ninf)
        t10: float32 = Add(t9, b)
        output t7
        output t10
        output x
    """
    p = parse(text)
    assert p.inputs == (("x", "float32"), ("mask", "bool"))
    assert [c.value for c in p.consts][:2] == [3.0, -1e-05]
    assert math.isnan(p.consts[2].value) and math.copysign(1, p.consts[4].value) == -1
    assert p.ops[1].attrs == {"min": -1.0, "max": 2.5}
    assert p.ops[3].attrs == {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875}
    assert p.outputs == ("t7", "t10", "x")
    canon = _roundtrip(p)
    assert "t1: float32 = Clip[min=-1.0, max=2.5](t0)" in canon
    assert "const a: float32 = 3.0" in canon


def test_const_interleaved_with_ops_and_printed_first():
    p = parse("onnxfuse.elementwise 1\ninput x: float16\nt0: float16 = Relu(x)\n"
              "const k: float16 = 0.1\nt1: float16 = Mul(t0, k)\noutput t1\n")
    text = _roundtrip(p)
    assert text.splitlines()[2] == "const k: float16 = 0.1"


@st.composite
def random_programs(draw):
    b = ProgramBuilder()
    by_dtype: dict[str, list[str]] = {d: [] for d in DTYPES}
    for _ in range(draw(st.integers(1, 3))):
        d = draw(st.sampled_from(DTYPES))
        by_dtype[d].append(b.input(d))

    def const(d):
        if d in FLOAT_DTYPES:
            v = draw(st.sampled_from(AWKWARD_FLOATS) | st.floats(allow_nan=True, allow_infinity=True))
            # Constants made through parse keep the float64 value exactly: test that path too.
            return b.const(v, d) if draw(st.booleans()) else _raw_const(b, v, d)
        if d == "bool":
            return b.const(draw(st.booleans()), d)
        info = np.iinfo(numpy_dtype(d))
        v = draw(st.sampled_from([int(info.min), int(info.max), 0, -1]) | st.integers(int(info.min), int(info.max)))
        return b.const(v, d)

    for _ in range(draw(st.integers(1, 10))):
        op = draw(st.sampled_from(sorted(OP_TABLE)))
        spec = OP_TABLE[op]
        d = draw(st.sampled_from(sorted(spec.dtypes)))
        args = []
        if spec.cond_first:
            args.append(draw(st.sampled_from(by_dtype["bool"])) if by_dtype["bool"] and draw(st.booleans())
                        else const("bool"))
        while len(args) < spec.arity:
            pool = by_dtype[d]
            args.append(draw(st.sampled_from(pool)) if pool and draw(st.booleans()) else const(d))
        attrs = {}
        for a in spec.attrs:
            if not a.required and draw(st.booleans()):
                continue
            if a.kind == "float":
                attrs[a.name] = draw(st.sampled_from(AWKWARD_FLOATS) | st.floats())
            elif a.kind == "bound":
                if d in INT_DTYPES:
                    info = np.iinfo(numpy_dtype(d))
                    attrs[a.name] = draw(st.integers(int(info.min), int(info.max)) | st.just(math.inf))
                else:
                    attrs[a.name] = draw(st.sampled_from(AWKWARD_FLOATS) | st.floats())
            elif a.kind == "dtype":
                attrs[a.name] = draw(st.sampled_from(DTYPES))
            else:
                attrs[a.name] = draw(st.sampled_from(a.choices))
        name = b.op(op, args, **attrs)
        by_dtype[b.dtype_of(name)].append(name)
    everything = [n for names in by_dtype.values() for n in names]
    for o in draw(st.lists(st.sampled_from(everything), min_size=1, max_size=4)):
        b.output(o)
    return b.build()


def _raw_const(b: ProgramBuilder, v: float, d: str) -> str:
    """A constant with an explicit name, bypassing the builder's shortest-text normalisation."""
    name = f"k{len(b._scope.consts)}"
    b._scope.add_const(name, d, v)
    return name


@settings(max_examples=300, deadline=None)
@given(random_programs())
def test_roundtrip_random_programs(p):
    _roundtrip(p)


@settings(max_examples=100, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(FLOAT_DTYPES))
def test_float_constant_text_is_exact(v, dtype):
    p = Program(1, (("x", dtype),), (Const("c", dtype, v),), (Op("y", "Add", dtype, ("x", "c"), {}),), ("y",))
    q = parse(p.to_text())
    got = q.consts[0].value
    assert (math.isnan(got) and math.isnan(v)) or (got == v and math.copysign(1, got) == math.copysign(1, v))


# --------------------------------------------------------------------------------------------------
# Builder
# --------------------------------------------------------------------------------------------------


def test_builder_names_dedupe_and_inference():
    b = ProgramBuilder()
    x = b.input("float32")
    y = b.input("float32", name="y")
    assert (x, y) == ("x0", "y")
    c1 = b.const(0.5, "float32")
    assert b.const(np.float32(0.5), "float32") == c1
    assert b.const(0.5, "float16") != c1
    n1, n2 = b.const(math.nan, "float32"), b.const(float("-nan"), "float32")
    assert n1 == n2
    assert b.const(-0.0, "float32") != b.const(0.0, "float32")
    assert b.const(np.float32(0.1), "float32") == b.const(0.1, "float32")
    t = b.op("Greater", [x, y])
    assert b.dtype_of(t) == "bool"
    assert b.dtype_of(b.op("Cast", [t], to="float16")) == "float16"
    assert b.dtype_of(b.op("Where", [t, x, 1.0])) == "float32"
    b.output(t)
    p = b.build()
    assert "const c0: float32 = 0.5" in p.to_text()
    assert "= 0.1\n" in p.to_text()  # a float32 0.1 is printed short, not 0.10000000149011612
    assert parse(p.to_text()) == p


def test_builder_errors():
    b = ProgramBuilder()
    x = b.input("float32")
    with pytest.raises(ProgramError, match="already defined"):
        b.input("float32", name=x)
    with pytest.raises(ProgramError, match="invalid name"):
        b.input("float32", name="1x")
    with pytest.raises(ProgramError, match="reserved"):
        b.input("float32", name="output")
    with pytest.raises(ProgramError, match="does not take int32"):
        b.op("Exp", [b.input("int32")])
    with pytest.raises(ProgramError, match="declared float16"):
        b.op("Relu", [x], dtype="float16")
    with pytest.raises(ProgramError, match="no attribute 'beta'"):
        b.op("LeakyRelu", [x], beta=1.0)
    with pytest.raises(ProgramError, match="no output"):
        b.build()
    with pytest.raises(ProgramError, match="no input"):
        ProgramBuilder().build()


def test_evaluate_checks_inputs():
    p = parse("onnxfuse.elementwise 1\ninput x: float16\ninput y: float16\nt: float16 = Add(x, y)\noutput t\n")
    with pytest.raises(ValueError, match="declared float16 but has numpy dtype float32"):
        evaluate(p, [np.zeros(3, np.float32), np.zeros(3, np.float16)])
    with pytest.raises(ValueError, match="takes 2 inputs"):
        evaluate(p, [np.zeros(3, np.float16)])
    with pytest.raises(ValueError, match="do not broadcast"):
        evaluate(p, [np.zeros(3, np.float16), np.zeros(4, np.float16)])


# --------------------------------------------------------------------------------------------------
# Parse errors: every kind names its line
# --------------------------------------------------------------------------------------------------

H = "onnxfuse.elementwise 1\n"
X = H + "input x: float32\n"

PARSE_ERRORS = [
    ("", 1, "empty program"),
    ("# only a comment\n\n", 1, "empty program"),
    ("input x: float32\n", 1, "expected header"),
    ("onnxfuse.elementwise\n", 1, "malformed header"),
    ("onnxfuse.elementwise 1 2\n", 1, "malformed header"),
    ("\n\nonnxfuse.elementwise 2\n", 3, "unsupported language version"),
    ("onnxfuse.elementwise 1.0\n", 1, "unsupported language version"),
    (H + "output x\n", 2, "not defined"),
    (H + "input x: float32\n", 2, "no output"),
    (H + "const c: float32 = 1\noutput c\n", 3, "no input"),
    (X + "input x: float16\noutput x\n", 3, "already defined"),
    (X + "const x: float32 = 1\noutput x\n", 3, "already defined"),
    (X + "y: float32 = Relu(x)\ny: float32 = Relu(x)\noutput y\n", 4, "already defined"),
    (X + "input y: float33\noutput y\n", 3, "unknown dtype 'float33'"),
    (X + "y: double = Relu(x)\noutput y\n", 3, "unknown dtype 'double'"),
    (X + "y: float32 = Relu(z)\noutput y\n", 3, "'z' is not defined"),
    (X + "y: float32 = Relu(y)\noutput y\n", 3, "'y' is not defined"),
    (X + "y: float32 = Frobnicate(x)\noutput y\n", 3, "unknown op 'Frobnicate'"),
    (X + "y: float32 = relu(x)\noutput y\n", 3, "unknown op 'relu'"),
    (X + "y: float32 = Add(x)\noutput y\n", 3, "takes 2 arguments, got 1"),
    (X + "y: float32 = Relu(x, x)\noutput y\n", 3, "takes 1 argument, got 2"),
    (X + "y: float32 = Relu()\noutput y\n", 3, "takes 1 argument, got 0"),
    (X + "input i: int32\ny: float32 = Add(x, i)\noutput y\n", 4, "share one dtype"),
    (X + "input i: int32\ny: int32 = Exp(i)\noutput y\n", 4, "does not take int32"),
    (X + "y: float32 = Not(x)\noutput y\n", 3, "does not take float32"),
    (X + "y: float32 = Less(x, x)\noutput y\n", 3, "gives bool, declared float32"),
    (X + "y: float16 = Relu(x)\noutput y\n", 3, "gives float32, declared float16"),
    (X + "y: float32 = Where(x, x, x)\noutput y\n", 3, "condition must be bool"),
    (X + "y: float16 = Cast(x)\noutput y\n", 3, "needs attribute to"),
    (X + "y: float16 = Cast[to=half](x)\noutput y\n", 3, "must be a dtype"),
    (X + "y: float16 = Cast[to=1](x)\noutput y\n", 3, "takes a word"),
    (X + "y: float32 = LeakyRelu[alpha=big](x)\noutput y\n", 3, "takes a number"),
    (X + "y: float32 = LeakyRelu[beta=1](x)\noutput y\n", 3, "no attribute 'beta'"),
    (X + "y: float32 = Relu[alpha=1](x)\noutput y\n", 3, "no attribute 'alpha'"),
    (X + "y: float32 = LeakyRelu[alpha=1, alpha=2](x)\noutput y\n", 3, "given twice"),
    (X + "y: float32 = Gelu[approximate=erf](x)\noutput y\n", 3, "must be one of none, tanh"),
    (X + "input i: int32\ny: int32 = Clip[min=0.5](i)\noutput y\n", 4, "integer literal"),
    (X + "input i: int32\ny: int32 = Clip[max=3000000000](i)\noutput y\n", 4, "out of range"),
    (X + "const c: int32 = 1.5\noutput x\n", 3, "integer literal"),
    (X + "const c: int32 = 1e3\noutput x\n", 3, "integer literal"),
    (X + "const c: int32 = 2147483648\noutput x\n", 3, "out of range"),
    (X + "const c: int64 = 9223372036854775808\noutput x\n", 3, "out of range"),
    (X + "const c: bool = 2\noutput x\n", 3, "bool constant must be 0 or 1"),
    (X + "const c: float32 = 1_000\noutput x\n", 3, "unexpected"),
    (X + "const c: float32 = Infinity\noutput x\n", 3, "expected a number"),
    (X + "const c: float32 = 0x1.8\noutput x\n", 3, "unexpected"),
    (X + "const c: float32 =\noutput x\n", 3, "expected a number"),
    (X + "y: float32 = Relu(x) extra\noutput y\n", 3, "unexpected 'extra'"),
    (X + "y: float32 = Relu(x\noutput y\n", 3, "expected ',' or ')'"),
    (X + "y: float32 = Add(x,)\noutput y\n", 3, "expected an argument name"),
    (X + "y: float32 = LeakyRelu[](x)\noutput y\n", 3, "expected an attribute name"),
    (X + "y: float32 = LeakyRelu[alpha=0.1(x)\noutput y\n", 3, "expected ',' or ']'"),
    (X + "y float32 = Relu(x)\noutput y\n", 3, "expected ':'"),
    (X + "y: float32 Relu(x)\noutput y\n", 3, "expected '='"),
    (X + "y: float32 = Relu(x) # fine\n$\noutput y\n", 4, "unexpected character '$'"),
    (X + "output x y\n", 3, "unexpected 'y'"),
    (X + "output\n", 3, "expected a name after 'output'"),
    (X + "input: float32 = Relu(x)\noutput x\n", 3, "reserved"),
    (X + "const inf: float32 = 1\noutput x\n", 3, "expected a name after 'const'"),
    (X + "output x\ny: float32 = Relu(x)\n", 4, "after an output line"),
    (X + "output x\nconst c: float32 = 1\n", 4, "after an output line"),
    (X + "y: float32 = Relu(x)\ninput z: float32\noutput y\n", 4, "input after an operation"),
    (H + "const c: float32 = 1\ny: float32 = Relu(c)\noutput y\n", 3, "operation before any input"),
]


@pytest.mark.parametrize("text,line,fragment", PARSE_ERRORS, ids=[e[2] + f"@{e[1]}" for e in PARSE_ERRORS])
def test_parse_errors_name_the_line(text, line, fragment):
    with pytest.raises(ProgramError) as ei:
        parse(text)
    msg = str(ei.value)
    assert msg.startswith(f"line {line}: "), msg
    assert fragment in msg, msg
    assert ei.value.line == line
    assert isinstance(ei.value, ValueError)


def test_accepted_lexical_forms():
    p = parse("  onnxfuse.elementwise\t1  \r\n"
              "input x:float32\r\n"
              "const a: float32 = .5\n"
              "const b: float32 = 5.\n"
              "const c: float32 = +1E+2\n"
              "const d: float32 = -0X1P-3\n"
              "const e: float32 = +inf\n"
              "const info: int32 = 007\n"
              "y:float32=Clip[min=a_not_used_here_is_an_error_if_word, max=1](x)\n".replace(
                  "a_not_used_here_is_an_error_if_word", "-1")
              + "output y\n")
    assert [c.value for c in p.consts] == [0.5, 5.0, 100.0, -0.125, math.inf, 7]
    _roundtrip(p)


def test_equivalent_model_uses_standard_ops_only():
    p = parse(open_spec_example())
    m = onnx_equivalent_model(p, [(2, 3), (3,)])
    assert {n.domain for n in m.graph.node} <= {""}
    assert m.opset_import[0].version == 20
    assert [o.name for o in m.graph.output] == ["out:0", "out:1"]
