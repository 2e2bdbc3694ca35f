"""The FusedElementwise custom-op library on ONNX Runtime's CPU provider.

Every op of the language (expr.OP_TABLE) in every dtype it takes runs as a FusedElementwise node
and is compared with the same computation as an *unfused* graph of standard ONNX ops on ONNX Runtime
(expr.onnx_equivalent_model), with a few hand-built reference graphs as an independent check, and
with expr.evaluate (numpy, ONNX semantics). Also: broadcasting layouts, multiple outputs, large
tensors (ONNX Runtime's thread pool), Cast between every pair of dtypes, and malformed programs,
which both parsers must reject, naming the same line, when the session is created.

The helpers at the top are reused by tests/gpu/test_fused_cuda.py.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxfuse.custom_ops import DOMAIN, OPSET_VERSION, make_node, session_options
from onnxfuse.custom_ops import expr

ONNX_TYPE = {"float32": 1, "float16": 10, "bfloat16": 16, "int32": 6, "int64": 7, "bool": 9}
# Tolerances of the fused kernels vs an unfused ONNX Runtime graph (fp32 maths for half types).
RTOL = {"float32": 1e-6, "float16": 1e-2, "bfloat16": 2e-2}
ATOL = {"float32": 1e-6, "float16": 1e-2, "bfloat16": 2e-2}


def io_dtype(dtype: str) -> str:
    """onnxruntime's Python API cannot feed/fetch bfloat16: such graph inputs/outputs are float32."""
    return "float32" if dtype == "bfloat16" else dtype


def fused_model(text: str, shapes, *, ir_version: int = 10) -> onnx.ModelProto:
    """A model with one FusedElementwise node running ``text``; graph inputs are the program inputs,
    outputs ``out:i``. bfloat16 inputs/outputs are float32 at the graph boundary with exact Casts."""
    prog = expr.parse(text)
    pre, post, inputs, outputs, node_ins, node_outs = [], [], [], [], [], []
    for (name, dt), shape in zip(prog.inputs, shapes):
        inputs.append(helper.make_tensor_value_info(name, ONNX_TYPE[io_dtype(dt)], list(shape)))
        if dt == "bfloat16":
            pre.append(helper.make_node("Cast", [name], [name + ":bf16"], to=ONNX_TYPE["bfloat16"]))
            node_ins.append(name + ":bf16")
        else:
            node_ins.append(name)
    for i, dt in enumerate(prog.output_dtypes()):
        out = f"out:{i}"
        if dt == "bfloat16":
            node_outs.append(out + ":bf16")
            post.append(helper.make_node("Cast", [out + ":bf16"], [out], to=ONNX_TYPE["float32"]))
        else:
            node_outs.append(out)
        outputs.append(helper.make_tensor_value_info(out, ONNX_TYPE[io_dtype(dt)], None))
    nodes = pre + [make_node(text, node_ins, node_outs, name="fused")] + post
    graph = helper.make_graph(nodes, "fused", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20),
                                                   helper.make_opsetid(DOMAIN, OPSET_VERSION)],
                             ir_version=ir_version)


def reference_model(text: str, shapes) -> onnx.ModelProto:
    return expr.onnx_equivalent_model(expr.parse(text), shapes, bfloat16_io="float32")


def random_input(rng: np.random.Generator, dtype: str, shape, kind: str = "any") -> np.ndarray:
    """Test data for one input; ``kind``: any, positive, nonzero, small."""
    shape = tuple(shape)
    # Always an ndarray: for shape () numpy 2 returns numpy *scalars* from arithmetic on 0-d arrays
    # (``rng.standard_normal(()) * 2.0`` is an np.float64), and InferenceSession.run rejects those.
    return np.asarray(_random_values(rng, dtype, shape, kind))


def _random_values(rng: np.random.Generator, dtype: str, shape, kind: str):
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in ("int32", "int64"):
        lo = 1 if kind == "positive" else -50
        a = rng.integers(lo, 50, size=shape).astype(dtype)
        if kind in ("nonzero", "positive"):
            a[a == 0] = 7
        return a
    if kind == "positive":
        a = rng.uniform(0.1, 4.0, size=shape)
    elif kind == "small":
        a = rng.uniform(-2.0, 2.0, size=shape)
    else:
        a = np.asarray(rng.standard_normal(shape) * 2.0)
        if kind == "nonzero":
            a[np.abs(a) < 0.05] = 0.5
    a = a.astype(np.float32)
    if dtype == "float16":
        return a.astype(np.float16)
    if dtype == "bfloat16":  # bfloat16-representable float32 values
        return expr.round_to_dtype(a, "bfloat16").astype(np.float32)
    return a


def compare(got: np.ndarray, want: np.ndarray, dtype: str, what: str = "", scale: float = 1.0) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if dtype in RTOL:
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=RTOL[dtype] * scale,
                                   atol=ATOL[dtype] * scale, equal_nan=True, err_msg=what)
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)




# ------------------------------------------------------------------------------------------ sessions

import onnxruntime as ort  # noqa: E402

ort.set_default_logger_severity(3)


def fused_session(text: str, shapes, providers=("CPUExecutionProvider",), provider_options=None,
                  threads: int = 1):
    so = session_options()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    model = fused_model(text, shapes)
    return ort.InferenceSession(model.SerializeToString(), so, providers=list(providers),
                                provider_options=provider_options)


def reference_session(text: str, shapes, providers=("CPUExecutionProvider",), provider_options=None):
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(reference_model(text, shapes).SerializeToString(), so,
                                providers=list(providers), provider_options=provider_options)


def run_positional(sess, arrays) -> list:
    """Run with inputs given in graph-input order (names differ between fused and reference)."""
    return sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), arrays)})


def feeds_for(text: str, arrays) -> dict:
    prog = expr.parse(text)
    return {name: a for (name, _), a in zip(prog.inputs, arrays)}


def numpy_reference(text: str, arrays) -> list:
    """expr.evaluate on the declared dtypes, outputs as fetched from ORT (bfloat16 -> float32)."""
    prog = expr.parse(text)
    ins = [expr.round_to_dtype(a, dt) if dt == "bfloat16" else a for a, (_, dt) in zip(arrays, prog.inputs)]
    outs = expr.evaluate(prog, ins)
    return [o.astype(np.float32) if dt == "bfloat16" else o for o, dt in zip(outs, prog.output_dtypes())]


# Test data per op: which inputs need special ranges.
DATA_KIND = {"Log": "positive", "Sqrt": "positive", "Reciprocal": "nonzero", "Div": "nonzero",
             "Pow": "positive", "Exp": "small", "Sin": "small", "Cos": "small", "Elu": "small",
             "Celu": "small", "Selu": "small", "Mish": "small", "Softplus": "small"}
# Per-op tolerance multipliers. Empty on the CPU: every op agrees with ONNX Runtime's CPU kernels
# within rtol=atol=1e-6 (float32). tests/gpu widens transcendental ops (CUDA's libm differs by ulps).
LOOSE: dict[str, float] = {}
TRANSCENDENTAL = ("Erf", "Gelu", "Tanh", "Mish", "Softplus", "Sigmoid", "Pow", "Exp", "Log", "Sin", "Cos", "Atan",
                  "Selu", "Elu", "Celu", "Softsign", "HardSwish", "Sqrt", "Reciprocal", "Div")


def single_op_program(op: str, dtype: str) -> tuple[str, list[str]]:
    """Program text applying ``op`` to fresh inputs of ``dtype`` (Where: bool condition)."""
    spec = expr.OP_TABLE[op]
    ins = []
    if spec.cond_first:
        ins.append(("c", "bool"))
    for k in range(spec.arity - len(ins)):
        ins.append((f"x{k}", dtype))
    res = "bool" if spec.result == "bool" else dtype
    attrs = ""
    if op == "Clip":
        attrs = "[min=-1, max=2]" if dtype in ("int32", "int64") else "[min=-1.5, max=2.25]"
    elif op == "LeakyRelu":
        attrs = "[alpha=0.2]"
    elif op == "Gelu":
        attrs = ""
    lines = ["onnxfuse.elementwise 1"] + [f"input {n}: {t}" for n, t in ins]
    lines.append(f"y: {res} = {op}{attrs}({', '.join(n for n, _ in ins)})")
    lines.append("output y")
    return "\n".join(lines) + "\n", [t for _, t in ins]


def op_cases():
    for op, spec in expr.OP_TABLE.items():
        if op == "Cast":
            continue
        for dt in expr.DTYPES:
            if dt in spec.dtypes:
                yield op, dt


def run_op_case(op: str, dtype: str, providers=("CPUExecutionProvider",), provider_options=None,
                shape=(3, 5, 7)) -> None:
    text, in_dtypes = single_op_program(op, dtype)
    rng = np.random.default_rng(abs(hash((op, dtype))) % 2**32)
    kind = DATA_KIND.get(op, "any")
    arrays = []
    for k, dt in enumerate(in_dtypes):
        arrays.append(random_input(rng, dt, shape, kind if (k == 1 or op not in ("Div", "Pow")) else "any"))
    if op == "Pow":
        arrays[1] = rng.uniform(-2, 2, size=shape).astype(np.float32)
        arrays[1] = arrays[1].astype(np.float16) if dtype == "float16" else (
            expr.round_to_dtype(arrays[1], "bfloat16").astype(np.float32) if dtype == "bfloat16" else arrays[1])
    if op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Min", "Max") and dtype != "bool":
        arrays[1].reshape(-1)[::3] = arrays[0].reshape(-1)[::3]  # some ties
    shapes = [a.shape for a in arrays]
    feeds = feeds_for(text, arrays)
    got = fused_session(text, shapes, providers, provider_options).run(None, feeds)
    want = run_positional(reference_session(text, shapes, providers, provider_options), arrays)
    out_dt = "bool" if expr.OP_TABLE[op].result == "bool" else dtype
    scale = LOOSE.get(op, 1.0)
    for g, w in zip(got, want):
        compare(g, w, out_dt, f"{op}({dtype}) vs unfused ONNX Runtime", scale)
    for g, w in zip(got, numpy_reference(text, arrays)):
        compare(g, w, out_dt, f"{op}({dtype}) vs expr.evaluate", scale)


# ------------------------------------------------------------------------------------------- tests

def test_constants_and_library():
    from onnxfuse import custom_ops

    assert (custom_ops.DOMAIN, custom_ops.OP_TYPE, custom_ops.OPSET_VERSION, custom_ops.PROGRAM_ATTR) == (
        expr.DOMAIN, expr.OP_TYPE, expr.DOMAIN_OPSET, "program")
    import os

    assert os.path.isfile(custom_ops.library_path())


def test_op_table_matches_cpp():
    """The C++ parser knows exactly the ops of expr.OP_TABLE."""
    from onnxfuse.custom_ops.native import check_program

    for op in expr.OP_TABLE:
        if op == "Cast":
            continue
        dt = "bool" if "float32" not in expr.OP_TABLE[op].dtypes else "float32"
        text, _ = single_op_program(op, dt)
        assert check_program(text) is None, (op, check_program(text))
    bad = "onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Softmax(x)\noutput y\n"
    assert "line 3" in check_program(bad) and "Softmax" in check_program(bad)


@pytest.mark.parametrize("op,dtype", list(op_cases()))
def test_op_vs_unfused_graph(op, dtype):
    run_op_case(op, dtype)


@pytest.mark.parametrize("src", expr.DTYPES)
def test_cast_all_pairs(src):
    targets = [t for t in expr.DTYPES if t != src]
    lines = ["onnxfuse.elementwise 1", f"input x: {src}"]
    for k, t in enumerate(targets):
        lines.append(f"y{k}: {t} = Cast[to={t}](x)")
    lines += [f"output y{k}" for k in range(len(targets))]
    text = "\n".join(lines)
    rng = np.random.default_rng(1)
    if src in expr.FLOAT_DTYPES:  # keep float -> int casts defined (in range)
        x = random_input(rng, src, (4, 33), "any") * 10
        x = x.astype(np.float16) if src == "float16" else x
        if src == "bfloat16":
            x = expr.round_to_dtype(x, "bfloat16").astype(np.float32)
        x.reshape(-1)[:4] = [0.0, -0.0, 0.5, -2.5]
    else:
        x = random_input(rng, src, (4, 33))
    got = fused_session(text, [x.shape]).run(None, {"x": x})
    want = run_positional(reference_session(text, [x.shape]), [x])
    for g, w, t in zip(got, want, targets):
        np.testing.assert_array_equal(g, w, err_msg=f"Cast {src} -> {t}")
    for g, w, t in zip(got, numpy_reference(text, [x]), targets):
        np.testing.assert_array_equal(g, w, err_msg=f"Cast {src} -> {t} (numpy)")


SILU_CHAIN = """onnxfuse.elementwise 1
input x: float32
input s: float32
const half: float32 = 0.5
const one: float32 = 1
t0: float32 = Sigmoid(x)
t1: float32 = Mul(x, t0)
t2: float32 = Mul(t1, half)
t3: float32 = Add(t2, one)
t4: float32 = Tanh(t3)
t5: float32 = Mul(t4, s)
output t5
output t1
"""


def handmade_reference(shape_x, shape_s):
    """tanh(x*sigmoid(x)*0.5+1)*s and x*sigmoid(x) as plain ONNX nodes (independent of expr.py)."""
    T = onnx.TensorProto
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["t0"]),
        helper.make_node("Mul", ["x", "t0"], ["t1"]),
        helper.make_node("Mul", ["t1", "half"], ["t2"]),
        helper.make_node("Add", ["t2", "one"], ["t3"]),
        helper.make_node("Tanh", ["t3"], ["t4"]),
        helper.make_node("Mul", ["t4", "s"], ["out:0"]),
        helper.make_node("Mul", ["t1", "ones"], ["out:1"]),  # broadcast t1 to the full shape
    ]
    full = np.broadcast_shapes(shape_x, shape_s)
    inits = [helper.make_tensor("half", T.FLOAT, [], [0.5]), helper.make_tensor("one", T.FLOAT, [], [1.0]),
             onnx.numpy_helper.from_array(np.ones(full, np.float32), "ones")]
    g = helper.make_graph(nodes, "ref", [helper.make_tensor_value_info("x", T.FLOAT, list(shape_x)),
                                         helper.make_tensor_value_info("s", T.FLOAT, list(shape_s))],
                          [helper.make_tensor_value_info("out:0", T.FLOAT, None),
                           helper.make_tensor_value_info("out:1", T.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


BROADCASTS = {
    "same": ((2, 3, 4, 5), (2, 3, 4, 5)),
    "scalar": ((2, 3, 4, 5), ()),
    "one-element": ((2, 3, 4, 5), (1, 1, 1, 1)),
    "per-channel NCHW": ((2, 3, 4, 5), (1, 3, 1, 1)),
    "per-channel CHW": ((2, 3, 4, 5), (3, 1, 1)),
    "trailing": ((2, 3, 4, 5), (5,)),
    "leading ones": ((1, 1, 4, 5), (2, 3, 1, 1)),
    "both broadcast": ((2, 1, 4, 1), (1, 3, 1, 5)),
    "x smaller": ((4, 5), (2, 3, 4, 5)),
    "zero-size": ((0, 3, 4), (3, 1)),
    "scalar x": ((), (7,)),
}


@pytest.mark.parametrize("case", list(BROADCASTS))
def test_broadcast_layouts(case):
    shape_x, shape_s = BROADCASTS[case]
    rng = np.random.default_rng(2)
    x = rng.standard_normal(shape_x).astype(np.float32)
    s = rng.standard_normal(shape_s).astype(np.float32)
    got = fused_session(SILU_CHAIN, [shape_x, shape_s]).run(None, {"x": x, "s": s})
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(handmade_reference(shape_x, shape_s).SerializeToString(), so,
                               providers=["CPUExecutionProvider"])
    want = ref.run(None, {"x": x, "s": s})
    for g, w in zip(got, want):
        compare(g, w, "float32", case, scale=4.0)
    for g, w in zip(got, numpy_reference(SILU_CHAIN, [x, s])):
        compare(g, w, "float32", case + " (numpy)", scale=4.0)


def test_output_shape_and_types_inferred():
    text = SILU_CHAIN.replace("output t5\noutput t1", "t6: float16 = Cast[to=float16](t1)\n"
                              "t7: bool = Less(x, s)\noutput t5\noutput t6\noutput t7\noutput x")
    sess = fused_session(text, [("N", 3, 1, 5), (3, 4, 1)])
    outs = sess.get_outputs()
    assert [o.type for o in outs] == ["tensor(float)", "tensor(float16)", "tensor(bool)", "tensor(float)"]
    assert outs[0].shape == ["N", 3, 4, 5]
    x = np.random.default_rng(3).standard_normal((2, 3, 1, 5)).astype(np.float32)
    s = np.ones((3, 4, 1), np.float32)
    res = sess.run(None, {"x": x, "s": s})
    assert [r.shape for r in res] == [(2, 3, 4, 5)] * 4  # every output has the broadcast shape
    np.testing.assert_array_equal(res[3], np.broadcast_to(x, (2, 3, 4, 5)))


def test_multi_output_mixed_dtypes_and_repeats():
    text = """onnxfuse.elementwise 1
input a: float16
input b: int64
input m: bool
const k: int64 = 3
const z: float16 = 0
b3: int64 = Mul(b, k)
bf: float16 = Cast[to=float16](b3)
s: float16 = Add(a, bf)
r: float16 = Relu(s)
w: float16 = Where(m, r, z)
nm: bool = Not(m)
output w
output b3
output w
output nm
output a
"""
    rng = np.random.default_rng(4)
    a = rng.standard_normal((8, 16)).astype(np.float16)
    b = rng.integers(-5, 5, (16,)).astype(np.int64)
    m = rng.random((8, 1)) < 0.5
    feeds = {"a": a, "b": b, "m": m}
    got = fused_session(text, [a.shape, b.shape, m.shape]).run(None, feeds)
    want = run_positional(reference_session(text, [a.shape, b.shape, m.shape]), [a, b, m])
    for g, w, dt in zip(got, want, ["float16", "int64", "float16", "bool", "float16"]):
        compare(g, w, dt, "multi-output")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_large_tensor_thread_pool(dtype):
    """Several blocks and ONNX Runtime's intra-op thread pool (ParallelFor), odd size."""
    text = SILU_CHAIN.replace("float32", dtype)
    rng = np.random.default_rng(5)
    x = random_input(rng, dtype, (3, 100_003))
    s = random_input(rng, dtype, (3, 1))
    feeds = {"x": x, "s": s}
    got = fused_session(text, [x.shape, s.shape], threads=2).run(None, feeds)
    want = run_positional(reference_session(text, [x.shape, s.shape]), [x, s])
    for g, w in zip(got, want):
        compare(g, w, dtype, "large", scale=4.0)


def test_half_intermediates_are_kept_in_float32():
    """float16 arithmetic is carried out in float32 and rounded at outputs (spec: Data types)."""
    text = """onnxfuse.elementwise 1
input x: float16
const big: float16 = 60000
a: float16 = Add(x, big)
b: float16 = Sub(a, big)
output b
"""
    x = np.array([1.0, 2.0, 3.0], np.float16)
    (got,) = fused_session(text, [x.shape]).run(None, {"x": x})
    np.testing.assert_array_equal(got, x)  # 60001 would round to 60000 in float16


def test_special_values():
    text = """onnxfuse.elementwise 1
input x: float32
const pinf: float32 = inf
const ninf: float32 = -inf
const qnan: float32 = nan
const hx: float32 = 0x1.8p+1
a: float32 = Min(x, pinf)
b: float32 = Max(a, ninf)
c: float32 = Add(b, hx)
d: bool = Equal(x, qnan)
e: float32 = Clip[min=-inf, max=inf](c)
output e
output d
"""
    x = np.array([0.0, -1.0, np.inf, -np.inf, 2.5], np.float32)
    e, d = fused_session(text, [x.shape]).run(None, {"x": x})
    np.testing.assert_array_equal(e, x + 3.0)
    assert not d.any()


def test_int_semantics():
    text = """onnxfuse.elementwise 1
input a: int32
input b: int32
q: int32 = Div(a, b)
c: int32 = Clip[min=-3, max=4](a)
n: int32 = Neg(a)
output q
output c
output n
"""
    a = np.array([7, -7, 7, -7, 0, 2147483647, -2147483647], np.int32)
    b = np.array([2, 2, -2, -2, 5, 1, 3], np.int32)
    q, c, n = fused_session(text, [a.shape, b.shape]).run(None, {"a": a, "b": b})
    np.testing.assert_array_equal(q, [3, -3, -3, 3, 0, 2147483647, -715827882])  # toward zero
    np.testing.assert_array_equal(c, np.clip(a, -3, 4))
    np.testing.assert_array_equal(n, -a)


# ------------------------------------------------------------------------------- malformed programs

BAD_PROGRAMS = [
    ("", 1, "header"),
    ("onnxfuse.elementwise 2\ninput x: float32\noutput x\n", 1, "version"),
    ("onnxfuse.elementwise 1\ninput x: float32\n\ny: float32 = Sigmoidx(x)\noutput y\n", 4, "Sigmoidx"),
    ("onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Add(x)\noutput y\n", 3, "argument"),
    ("onnxfuse.elementwise 1\ninput x: float32\ny: float16 = Relu(x)\noutput y\n", 3, "float16"),
    ("onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Relu(z)\noutput y\n", 3, "'z'"),
    ("onnxfuse.elementwise 1\ninput x: float32\nx: float32 = Relu(x)\noutput x\n", 3, "'x'"),
    ("onnxfuse.elementwise 1\ninput x: int32\ny: int32 = Exp(x)\noutput y\n", 3, "Exp"),
    ("onnxfuse.elementwise 1\ninput x: float32\ny: float32 = LeakyRelu[beta=1](x)\noutput y\n", 3, "beta"),
    ("onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Cast(x)\noutput y\n", 3, "to"),
    ("onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Gelu[approximate=fast](x)\noutput y\n", 3, "approximate"),
    ("onnxfuse.elementwise 1\ninput x: float32\nconst c: int32 = 1.5\noutput x\n", 3, "1.5"),
    ("onnxfuse.elementwise 1\ninput x: float32\nconst c: float32 = 1_000\noutput x\n", 3, ""),
    ("onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Relu(x\noutput y\n", 3, ""),
    ("onnxfuse.elementwise 1\ninput x: float32\noutput y\n", 3, "'y'"),
    ("onnxfuse.elementwise 1\ninput x: float32\n", 2, "output"),
    ("onnxfuse.elementwise 1\ninput x: float32\noutput x\ny: float32 = Relu(x)\n", 4, "output"),
    ("onnxfuse.elementwise 1\ninput x: float32 $\noutput x\n", 2, ""),
    ("onnxfuse.elementwise 1\ninput x: float99\noutput x\n", 2, "float99"),
    ("onnxfuse.elementwise 1\ninput x: int32\ny: int32 = Clip[min=0.5](x)\noutput y\n", 3, "Clip"),
    ("onnxfuse.elementwise 1\ninput x: bool\ny: bool = Less(x, x)\noutput y\n", 3, "Less"),
    ("onnxfuse.elementwise 1\ninput x: float32\nc: float32 = Where(x, x, x)\noutput c\n", 3, "bool"),
    ("onnxfuse.elementwise 1\ninput x: float32\ninf: float32 = Relu(x)\noutput inf\n", 3, ""),
]


@pytest.mark.parametrize("text,line,word", BAD_PROGRAMS, ids=[f"bad{i}" for i in range(len(BAD_PROGRAMS))])
def test_malformed_program_rejected_at_session_creation(text, line, word):
    from onnxfuse.custom_ops.native import check_program

    with pytest.raises(expr.ProgramError) as py_err:
        expr.parse(text)
    assert py_err.value.line == line
    cpp = check_program(text)
    assert cpp is not None and cpp.startswith(f"line {line}:"), cpp
    assert word in cpp, cpp
    node = make_node(text, ["x"], ["y"])
    T = onnx.TensorProto
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", T.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)],
                          ir_version=10)
    with pytest.raises(Exception) as e:
        so = session_options()
        so.log_severity_level = 3
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    msg = str(e.value)
    assert f"line {line}:" in msg and "invalid program" in msg, msg


def _mutations(text: str):
    """Deterministic single-edit variants of a valid program (for parser agreement)."""
    lines = text.split("\n")
    subs = [("float32", "float16"), ("float32", "int32"), ("(", "["), (")", ""), (",", ""), (":", ""),
            ("=", "=="), ("x", "inf"), ("0.5", "0x1p-1"), ("0.5", "5e-1"), ("0.5", "0x1.0"), ("0.5", ".5e"),
            ("1", "01"), ("1", "+1"), ("1", "1.0"), ("Mul", "mul"), ("t1", "t9"), ("output", "output output"),
            ("input", "const"), ("half", "input"), (" ", "  "), ("alpha=0.01", "alpha=nan"),
            ("alpha=0.01", "alpha=x"), ("alpha=0.01", "alpha=inf"), ("alpha=0.01", ""), ("[alpha=0.01]", "[]")]
    for i, ln in enumerate(lines):
        yield "\n".join(lines[:i] + lines[i + 1:])  # drop a line
        yield "\n".join(lines[:i] + [ln, ln] + lines[i + 1:])  # repeat a line
        for a, b in subs:
            if a in ln:
                yield "\n".join(lines[:i] + [ln.replace(a, b, 1)] + lines[i + 1:])


def test_parsers_agree_on_mutations():
    """The C++ and Python parsers accept and reject the same programs, naming the same line."""
    from onnxfuse.custom_ops.native import check_program

    base = """onnxfuse.elementwise 1
input x: float32
input k: int64
const half: float32 = 0.5
t0: float32 = Sigmoid(x)
t1: float32 = Mul(x, t0)
t2: float32 = Mul(t1, half)
t3: float32 = LeakyRelu[alpha=0.01](t2)  # comment
t4: float16 = Cast[to=float16](t3)
c1: int64 = Clip[min=1, max=inf](k)
output t4
output t1
output c1
"""
    n = 0
    for text in _mutations(base):
        try:
            expr.parse(text)
            py = None
        except expr.ProgramError as e:
            py = e.line
        cpp = check_program(text)
        cpp_line = None if cpp is None else int(cpp.split(":")[0].split()[1])
        assert (py is None) == (cpp is None) and py == cpp_line, f"python: {py}, C++: {cpp!r}\n{text}"
        n += 1
    assert n > 100


def test_all_scalar_inputs_give_rank0_outputs():
    x, s = np.array(1.5, np.float32), np.array(2.0, np.float32)
    got = fused_session(SILU_CHAIN, [(), ()]).run(None, {"x": x, "s": s})
    assert [g.shape for g in got] == [(), ()]
    for g, w in zip(got, numpy_reference(SILU_CHAIN, [x, s])):
        compare(g, w, "float32", "rank 0", scale=4.0)


def test_shapes_that_do_not_broadcast_fail_clearly():
    sess = fused_session(SILU_CHAIN, [("a",), ("b",)])
    with pytest.raises(Exception, match="does not broadcast"):
        sess.run(None, {"x": np.ones(3, np.float32), "s": np.ones(4, np.float32)})


def test_node_program_mismatch_fails_at_session_creation():
    """Two node inputs for a one-input program: refused when the session is created."""
    text = "onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Relu(x)\noutput y\n"
    T = onnx.TensorProto
    g = helper.make_graph([make_node(text, ["x", "z"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [3]),
                           helper.make_tensor_value_info("z", T.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)],
                          ir_version=10)
    so = session_options()
    so.log_severity_level = 3
    with pytest.raises(Exception, match="2 inputs and 1 outputs but its program declares 1 inputs"):
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_layout_cache_follows_changing_shapes():
    # One session (one kernel instance) run with shapes that change between calls and come back:
    # the cached broadcast layout must be recomputed whenever the shapes differ.
    text = "onnxfuse.elementwise 1\ninput x0: float32\ninput x1: float32\nt0: float32 = Mul(x0, x1)\noutput t0\n"
    sess = fused_session(text, [["a", "b"], ["c", "d"]])
    rng = np.random.default_rng(3)
    for sx, sy in [((2, 5), (2, 5)), ((4, 5), (1, 5)), ((2, 5), (2, 5)), ((3, 1), (1, 7)), ((4, 5), (1, 5))]:
        x = rng.standard_normal(sx).astype(np.float32)
        y = rng.standard_normal(sy).astype(np.float32)
        (got,) = run_positional(sess, [x, y])
        np.testing.assert_array_equal(got, x * y, err_msg=f"{sx} x {sy}")


def test_many_high_rank_inputs_take_the_uncached_path():
    # 40 inputs of rank 8 make a shape key longer than the library keeps on the stack (256 entries).
    n, shape = 40, (1, 2, 1, 2, 1, 2, 1, 3)
    lines = ["onnxfuse.elementwise 1"] + [f"input x{i}: float32" for i in range(n)]
    lines.append("t0: float32 = Add(x0, x1)")
    for i in range(2, n):
        lines.append(f"t{i - 1}: float32 = Add(t{i - 2}, x{i})")
    lines.append(f"output t{n - 2}")
    text = "\n".join(lines) + "\n"
    sess = fused_session(text, [shape] * n)
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
    for _ in range(2):
        (got,) = run_positional(sess, arrays)
        np.testing.assert_allclose(got, np.sum(arrays, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ rank limit
# The library's broadcast rank limit (kMaxRank, custom_ops.MAX_RANK). Before it was checked, a rank-17
# broadcast whose dims do not merge wrote past the CPU kernel's coordinate array (AddressSanitizer:
# stack-buffer-overflow in gather) and half the results were wrong.

RANK_ADD = "onnxfuse.elementwise 1\ninput x: float32\ninput y: float32\nz: float32 = Add(x, y)\noutput z\n"


def unmergeable_shapes(rank: int):
    """x: all 2s; y: 2 and 1 alternating, so no two neighbouring dims merge (rank dims remain)."""
    return (2,) * rank, tuple(2 if i % 2 == 0 else 1 for i in range(rank))


def rank_model(shapes) -> onnx.ModelProto:
    T = onnx.TensorProto
    g = helper.make_graph([make_node(RANK_ADD, ["x", "y"], ["z"], name="add")], "g",
                          [helper.make_tensor_value_info(n, T.FLOAT, None if s is None else list(s))
                           for n, s in zip("xy", shapes)],
                          [helper.make_tensor_value_info("z", T.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, OPSET_VERSION)],
                             ir_version=10)


def rank_session(shapes):
    so = session_options()
    so.log_severity_level = 4
    so.intra_op_num_threads = 2
    return ort.InferenceSession(rank_model(shapes).SerializeToString(), so, providers=["CPUExecutionProvider"])


def test_max_rank_matches_library():
    import ctypes

    from onnxfuse.custom_ops import MAX_RANK, library_path

    assert ctypes.CDLL(library_path()).onnxfuse_max_rank() == MAX_RANK == 16


@pytest.mark.parametrize("rank", [15, 16])
def test_unmergeable_broadcast_up_to_the_limit(rank):
    sx, sy = unmergeable_shapes(rank)
    rng = np.random.default_rng(rank)
    x, y = rng.standard_normal(sx).astype(np.float32), rng.standard_normal(sy).astype(np.float32)
    for shapes in ([sx, sy], [None, None]):
        (z,) = rank_session(shapes).run(None, {"x": x, "y": y})
        np.testing.assert_array_equal(z, x + y)


def test_rank_above_the_limit_fails_clearly():
    sx, sy = unmergeable_shapes(17)
    # Known ranks: refused when the session is created (shape inference).
    with pytest.raises(Exception, match="rank 17 exceeds FusedElementwise's limit of 16"):
        rank_session([sx, sy])
    # Unknown ranks: refused when the node runs, before anything is computed.
    sess = rank_session([None, None])
    x, y = np.ones(sx, np.float32), np.ones(sy, np.float32)
    with pytest.raises(Exception, match="rank 17 exceeds FusedElementwise's limit of 16"):
        sess.run(None, {"x": x, "y": y})
    # Even when the dims would merge (same shapes): the limit is on the rank, whatever the layout.
    with pytest.raises(Exception, match="rank 17 exceeds FusedElementwise's limit of 16"):
        sess.run(None, {"x": x, "y": x})
    (z,) = sess.run(None, {"x": x[0], "y": y[0]})  # the session still works at rank 16
    np.testing.assert_array_equal(z, x[0] + y[0])


def _chain_model(rank: int) -> onnx.ModelProto:
    """x (rank ``rank``, dims that do not merge with y's) -> Add y -> Relu -> Neg -> Abs."""
    sx, sy = unmergeable_shapes(rank)
    T = onnx.TensorProto
    nodes = [helper.make_node("Add", ["x", "y"], ["a"], name="add"), helper.make_node("Relu", ["a"], ["b"], name="relu"),
             helper.make_node("Neg", ["b"], ["c"], name="neg"), helper.make_node("Abs", ["c"], ["z"], name="abs")]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", T.FLOAT, list(sx)),
                                           helper.make_tensor_value_info("y", T.FLOAT, list(sy))],
                          [helper.make_tensor_value_info("z", T.FLOAT, list(sx))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_fuse_elementwise_refuses_ranks_above_the_limit():
    from helpers import optimize

    from onnxfuse.custom_ops import MAX_RANK

    out, report = optimize(_chain_model(MAX_RANK + 1), only="fuse-elementwise")
    assert [n.op_type for n in out.graph.node] == ["Add", "Relu", "Neg", "Abs"]
    reasons = {r.node: r.reason for r in report.refusals if r.rule == "fuse-elementwise"}
    assert reasons == {n: "rank 17 exceeds FusedElementwise's limit of 16" for n in ("add", "relu", "neg", "abs")}
    # At the limit the chain is one node, and it runs.
    out, report = optimize(_chain_model(MAX_RANK), only="fuse-elementwise")
    assert [n.op_type for n in out.graph.node] == ["FusedElementwise"]
    sx, sy = unmergeable_shapes(MAX_RANK)
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal(sx).astype(np.float32), rng.standard_normal(sy).astype(np.float32)
    so = session_options()
    so.log_severity_level = 3
    (z,) = ort.InferenceSession(out.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x, "y": y})
    np.testing.assert_array_equal(z, np.abs(-np.maximum(x + y, 0)))


# ------------------------------------------------------------------------------------------ float16 forced to float32
# ONNX Runtime runs an "isolated" float16 CPU node in float32 (InsertCastTransformer): when every
# producer of its float16 inputs and every consumer of its float16 outputs lacks a float16 CPU kernel
# (ThresholdedRelu, Softmax), it casts the node's float16 inputs to float32, makes its float16
# outputs float32 and expects a float32 kernel. The library used to infer float16 outputs anyway,
# and ONNX Runtime refused to load the model ("Type (tensor(float)) of output arg
# (InsertedPrecisionFreeCast_c) of node ... does not match expected type (tensor(float16))").


def _fp16_sandwich(middle: list, extra_inputs=(), opset=17) -> onnx.ModelProto:
    """x (float16 [2, 8]) -> ThresholdedRelu -> ``middle`` (reads "a", writes "c") -> Softmax -> y."""
    T = onnx.TensorProto
    nodes = [helper.make_node("ThresholdedRelu", ["x"], ["a"], alpha=0.5, name="tr"), *middle,
             helper.make_node("Softmax", ["c"], ["y"], axis=-1, name="sm")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT16, [2, 8]), *extra_inputs],
                          [helper.make_tensor_value_info("y", T.FLOAT16, [2, 8])])
    imports = [helper.make_opsetid("", opset)]
    if any(n.domain == DOMAIN for n in middle):
        imports.append(helper.make_opsetid(DOMAIN, OPSET_VERSION))
    return helper.make_model(g, opset_imports=imports, ir_version=8)


def _run_cpu(model: onnx.ModelProto, feeds: dict, fused: bool = True, saved=None):
    """Outputs on ONNX Runtime's CPU provider; ``saved``: a path for the graph as ONNX Runtime rewrote it."""
    so = session_options() if fused else ort.SessionOptions()
    so.log_severity_level = 3
    if saved is not None:
        so.optimized_model_filepath = str(saved)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _forced_to_fp32(saved) -> bool:
    """True when ONNX Runtime fed the FusedElementwise node float32 (casts it inserted around it)."""
    m = onnx.shape_inference.infer_shapes(onnx.load(str(saved)))
    types = {v.name: v.type.tensor_type.elem_type for v in list(m.graph.value_info) + list(m.graph.input)}
    node = next(n for n in m.graph.node if n.op_type == "FusedElementwise")
    return types.get(node.input[0]) == onnx.TensorProto.FLOAT


def test_fp16_chain_between_ops_without_fp16_kernels_loads_after_optimize(tmp_path):
    from helpers import optimize

    model = _fp16_sandwich([helper.make_node("Neg", ["a"], ["b"], name="neg"),
                            helper.make_node("Abs", ["b"], ["c"], name="abs")])
    out, _ = optimize(model)  # the default target (cuda): Neg + Abs become one FusedElementwise node
    assert [n.op_type for n in out.graph.node] == ["ThresholdedRelu", "FusedElementwise", "Softmax"]
    prog = expr.parse(next(a.s.decode() for a in out.graph.node[1].attribute if a.name == "program"))
    assert prog.output_dtypes() == ["float16"]  # the program keeps the model's dtype
    x = np.random.default_rng(7).standard_normal((2, 8)).astype(np.float16)
    (got,) = _run_cpu(out, {"x": x}, saved=tmp_path / "ort.onnx")
    assert _forced_to_fp32(tmp_path / "ort.onnx")
    (want,) = _run_cpu(model, {"x": x}, fused=False)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3, atol=1e-4)


def test_fp16_node_forced_to_fp32_with_mixed_dtypes(tmp_path):
    """Only float16 inputs and outputs are stored as float32; the float32 input, the bool output and
    the program's own maths are unchanged; a Cast to float16 inside still rounds."""
    text = ("onnxfuse.elementwise 1\ninput a: float16\ninput s: float32\n"
            "sh: float16 = Cast[to=float16](s)\nm: float16 = Mul(a, sh)\nc: float16 = Neg(m)\n"
            "k: bool = Less(m, sh)\noutput c\noutput k\n")
    T = onnx.TensorProto
    fused = make_node(text, ["a", "s"], ["c", "k"], name="fused")
    # k goes to a node, not to the graph outputs (a node producing a graph output keeps float16).
    model = _fp16_sandwich([fused, helper.make_node("Not", ["k"], ["nk"], name="not")],
                           [helper.make_tensor_value_info("s", T.FLOAT, [8])])
    model.graph.output.append(helper.make_tensor_value_info("nk", T.BOOL, [2, 8]))
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 8)).astype(np.float16)
    s = (rng.standard_normal(8) * 3).astype(np.float32)
    y, nk = _run_cpu(model, {"x": x, "s": s}, saved=tmp_path / "ort.onnx")
    assert _forced_to_fp32(tmp_path / "ort.onnx")
    k = ~nk
    a = np.where(x > 0.5, x, 0).astype(np.float32)
    sh = s.astype(np.float16).astype(np.float32)
    c = -(a * sh)  # float32: not rounded to float16 between the node and Softmax
    e = np.exp(c - c.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(y.astype(np.float32), e / e.sum(axis=-1, keepdims=True), rtol=2e-3, atol=1e-3)
    np.testing.assert_array_equal(k, a * sh < sh)


def test_other_dtype_mismatches_still_fail_at_session_creation():
    """Only float16 -> float32 is accepted (what ONNX Runtime's forcing produces); anything else is
    the clear error it always was, also a float16 input beside one that was already float32."""
    T = onnx.TensorProto
    cases = [("input x: float32\ny: float32 = Relu(x)\noutput y\n", [T.INT32], "declared float32"),
             ("input x: float16\ninput z: float16\ny: float16 = Add(x, z)\noutput y\n", [T.FLOAT, T.FLOAT16],
              "declared float16 in the program (stored as float32)")]
    for body, types, words in cases:
        names = ["x", "z"][: len(types)]
        g = helper.make_graph([make_node("onnxfuse.elementwise 1\n" + body, names, ["y"])], "g",
                              [helper.make_tensor_value_info(n, t, [3]) for n, t in zip(names, types)],
                              [helper.make_tensor_value_info("y", T.FLOAT, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
        so = session_options()
        so.log_severity_level = 4
        with pytest.raises(Exception, match=re.escape(words)):
            ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


# ------------------------------------------------------------------ Atan (issue 13: an op added in two places)

@pytest.mark.parametrize("dtype", expr.FLOAT_DTYPES)
def test_atan_cpu_kernel_matches_numpy(dtype):
    """Atan, added as one expr.OP_TABLE row and one ops.h function: the CPU interpreter against
    numpy's arctan (float64, rounded once to the dtype), edge values included; and against the
    unfused ONNX Runtime graph on random data."""
    text = f"onnxfuse.elementwise 1\ninput x: {dtype}\ny: {dtype} = Atan(x)\noutput y\n"
    special = [-np.inf, -1e30, -3.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 0.5, 1.0, 2.0, 1e4, 1e30, np.inf, np.nan]
    rng = np.random.default_rng(13)
    x = np.concatenate([np.array(special), rng.uniform(-20, 20, 241)]).astype(np.float32)
    if dtype == "float16":
        x = np.where(np.isfinite(x) & (np.abs(x) > 6e4), np.sign(x) * 6e4, x).astype(np.float16)
    elif dtype == "bfloat16":
        x = expr.round_to_dtype(x, "bfloat16").astype(np.float32)
    got = fused_session(text, [x.shape]).run(None, {"x": x})[0]
    want = expr.round_to_dtype(np.arctan(x.astype(np.float64)), dtype)
    want = want.astype(np.float32) if dtype == "bfloat16" else want
    compare(got, want, dtype, f"Atan({dtype}) vs numpy")
    assert np.signbit(got[5]) and not np.signbit(got[6])  # atan(-0) = -0, atan(+0) = +0
    assert got[0] == want[0] and got[13] == want[13]  # -pi/2, pi/2 rounded to the dtype
    assert np.isnan(got[14])
    compare(got, numpy_reference(text, [x])[0], dtype, f"Atan({dtype}) vs expr.evaluate")
    run_op_case("Atan", dtype)


def test_atan_is_fused_by_fuse_elementwise():
    """A new op is a table row: fuse-elementwise asks OP_TABLE, so Atan fuses with no change in rewrites/."""
    from helpers import optimize

    model = onnx.parser.parse_model("""<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 3] x) => (float[2, 3] y) { a = Atan(x) b = Mul(a, x) y = Exp(b) }""")
    out, _ = optimize(model, only=["fuse-elementwise"])
    assert [n.op_type for n in out.graph.node] == ["FusedElementwise"]
    import onnxruntime as ort

    from onnxfuse.custom_ops import session_options

    x = np.array([[-1e3, -1.5, -0.0], [0.25, 2.0, 7e4]], np.float32)
    (y,) = ort.InferenceSession(out.SerializeToString(), session_options(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})
    with np.errstate(over="ignore"):  # exp(atan(7e4)·7e4) is +inf in the reference too
        want = np.exp(np.arctan(x.astype(np.float64)) * x)
    np.testing.assert_allclose(y, want, rtol=1e-5)
