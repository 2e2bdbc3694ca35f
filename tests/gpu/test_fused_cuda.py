"""FusedElementwise's CUDA kernel (NVRTC-generated) on ONNX Runtime's CUDA provider.

Every op in every dtype against the unfused graph on the CUDA provider; broadcast and fast paths;
odd sizes (vector tails) and misaligned buffers; 64-bit indexing; CUDA-graph capture with IOBinding;
the on-disk kernel cache across processes (first compile vs cached load). Skipped without a GPU that
ONNX Runtime can use.

    pytest -m gpu tests/gpu/test_fused_cuda.py -s     # -s prints compile/cache timings
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

import onnxruntime as ort
from onnxfuse.custom_ops import expr, native as codegen, session_options

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fused_op_helpers", ROOT / "tests/custom_ops/test_library.py")
H = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(H)

CUDA = ["CUDAExecutionProvider"]


def _cuda_usable() -> bool:
    """Create a tiny session on the CUDA provider (ORT's log quiet) and see if it stayed there."""
    ort.set_default_logger_severity(4)
    try:
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return False
        T = onnx.TensorProto
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", T.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [1])])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        so = ort.SessionOptions()
        so.log_severity_level = 4
        s = ort.InferenceSession(m.SerializeToString(), so, providers=CUDA + ["CPUExecutionProvider"])
        return "CUDAExecutionProvider" in s.get_providers()
    except Exception:
        return False
    finally:
        ort.set_default_logger_severity(3)


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda_usable(), reason="needs a CUDA GPU usable by ONNX Runtime")]


def cuda_fused_session(text: str, shapes, *, cuda_graph: bool = False):
    """Fused model on CUDA only (no CPU fallback, so the CUDA kernel is what runs)."""
    so = session_options()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    opts = [{"enable_cuda_graph": "1"}] if cuda_graph else None
    return ort.InferenceSession(H.fused_model(text, shapes).SerializeToString(), so, providers=CUDA,
                                provider_options=opts)


# ------------------------------------------------------------------------------- every op and dtype

@pytest.mark.parametrize("op,dtype", list(H.op_cases()))
def test_op_vs_unfused_cuda(op, dtype, monkeypatch):
    monkeypatch.setattr(H, "fused_session", lambda text, shapes, providers, opts, threads=1:
                        cuda_fused_session(text, shapes))
    # GPU libm (CUDA math) differs from ORT's kernels by a few ulps on transcendental functions.
    monkeypatch.setattr(H, "LOOSE", {k: 4.0 for k in H.TRANSCENDENTAL})
    H.run_op_case(op, dtype, providers=CUDA + ["CPUExecutionProvider"], shape=(3, 5, 77))


@pytest.mark.parametrize("src", expr.DTYPES)
def test_cast_all_pairs_cuda(src):
    targets = [t for t in expr.DTYPES if t != src]
    lines = ["onnxfuse.elementwise 1", f"input x: {src}"]
    lines += [f"y{k}: {t} = Cast[to={t}](x)" for k, t in enumerate(targets)]
    lines += [f"output y{k}" for k in range(len(targets))]
    text = "\n".join(lines)
    rng = np.random.default_rng(1)
    x = H.random_input(rng, src, (4, 1001))
    if src in expr.FLOAT_DTYPES:
        x = (x.astype(np.float32) * 10).astype(x.dtype)
        if src == "bfloat16":
            x = expr.round_to_dtype(x, "bfloat16").astype(np.float32)
    got = cuda_fused_session(text, [x.shape]).run(None, {"x": x})
    want = H.fused_session(text, [x.shape]).run(None, {"x": x})  # CPU kernel (checked in CI)
    for g, w, t in zip(got, want, targets):
        np.testing.assert_array_equal(g, w, err_msg=f"Cast {src} -> {t}: CUDA vs CPU kernel")


# ------------------------------------------------------------------- layouts, sizes and alignment

@pytest.mark.parametrize("case", list(H.BROADCASTS))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_broadcast_and_fast_paths(case, dtype):
    shape_x, shape_s = H.BROADCASTS[case]
    text = H.SILU_CHAIN.replace("float32", dtype)
    rng = np.random.default_rng(2)
    x = H.random_input(rng, dtype, shape_x)
    s = H.random_input(rng, dtype, shape_s)
    got = cuda_fused_session(text, [shape_x, shape_s]).run(None, {"x": x, "s": s})
    want = H.run_positional(H.reference_session(text, [shape_x, shape_s], CUDA), [x, s])
    for g, w in zip(got, want):
        H.compare(g, w, dtype, f"{case} {dtype}", scale=4.0)


# Vectorised broadcast kernel (ofx_bcast_vec): innermost merged dim a multiple of V (4 for float32,
# 8 for half types), inputs contiguous (128-bit loads) or broadcast (one load) along it.
VEC_BROADCASTS = {
    "per-channel NCHW, W*H % 8 == 0": ((2, 3, 4, 16), (1, 3, 1, 1)),
    "row vector (s along the inner dim)": ((6, 32), (32,)),
    "column vector": ((6, 32), (6, 1)),
    "both broadcast, inner contiguous": ((2, 1, 16), (1, 3, 16)),
    "x broadcast, s full": ((1, 3, 1, 8), (5, 3, 7, 8)),
    "inner 20: vec for float32 only": ((2, 3, 4, 5), (1, 3, 1, 1)),
}


@pytest.mark.parametrize("case", list(VEC_BROADCASTS))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_vectorised_broadcast(case, dtype):
    shape_x, shape_s = VEC_BROADCASTS[case]
    text = H.SILU_CHAIN.replace("float32", dtype)
    rng = np.random.default_rng(6)
    x = H.random_input(rng, dtype, shape_x)
    s = H.random_input(rng, dtype, shape_s)
    got = cuda_fused_session(text, [shape_x, shape_s]).run(None, {"x": x, "s": s})
    want = H.fused_session(text, [shape_x, shape_s]).run(None, {"x": x, "s": s})  # CPU kernel
    for g, w in zip(got, want):
        H.compare(g, w, dtype, f"{case} {dtype}", scale=4.0)


@pytest.mark.parametrize("offset_elems", [0, 1, 4])
def test_vectorised_broadcast_misaligned_falls_back(offset_elems):
    """x and the outputs bound 4 bytes off 16-byte alignment: the scalar broadcast kernel."""
    shape_x, shape_s = (4, 3, 8, 8), (1, 3, 1, 1)
    n = int(np.prod(shape_x))
    text = H.SILU_CHAIN
    rng = np.random.default_rng(7)
    x = rng.standard_normal(n + 8).astype(np.float32)
    s = rng.standard_normal(shape_s).astype(np.float32)
    sess = cuda_fused_session(text, [shape_x, shape_s])
    xv, sv = _gpu_value(x), _gpu_value(s)
    outs = [_gpu_value(np.zeros(n + 8, np.float32)) for _ in range(2)]
    io = sess.io_binding()
    off = 4 * offset_elems
    io.bind_input("x", "cuda", 0, np.float32, list(shape_x), xv.data_ptr() + off)
    io.bind_ortvalue_input("s", sv)
    for i, o in enumerate(outs):
        io.bind_output(f"out:{i}", "cuda", 0, np.float32, list(shape_x), o.data_ptr() + off)
    sess.run_with_iobinding(io)
    xs = x[offset_elems:offset_elems + n].reshape(shape_x)
    want = H.fused_session(text, [shape_x, shape_s]).run(None, {"x": xs, "s": s})
    for o, w in zip(outs, want):
        got = o.numpy()[offset_elems:offset_elems + n].reshape(shape_x)
        H.compare(got, w, "float32", f"offset {offset_elems}", scale=4.0)


# --------------------------------------------------------- fast maths of float16/bfloat16 ops
# Ops declared float16/bfloat16 use hardware approximations (codegen.FAST ops; bounds in the
# generated source, all far below half precision's rounding). Checked on every finite value of
# the dtype: the result is the correctly rounded exact value or one ulp next to it, or within 2^-120
# of it in absolute terms (intermediates below 2^-126 flush to zero: bfloat16 has subnormals there).

def _gelu_tanh(x):
    u = np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-2 * u))  # = 0.5 x (1 + tanh(u)), without cancellation


FAST_UNARY = {
    "Exp": np.exp, "Sigmoid": lambda x: 1 / (1 + np.exp(-x)), "Tanh": np.tanh, "Reciprocal": lambda x: 1 / x,
    "Softsign": lambda x: x / (1 + np.abs(x)), "Gelu[approximate=tanh]": _gelu_tanh,
}


def _ordered(bits16: np.ndarray) -> np.ndarray:
    b = bits16.astype(np.int64)
    return np.where(b & 0x8000, -(b & 0x7FFF), b)


def _half_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return a.astype(np.float16).view(np.uint16)
    return (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)  # bf16 values


def _all_values(dtype: str) -> np.ndarray:
    bits = np.arange(65536, dtype=np.uint32)
    if dtype == "float16":
        v = bits.astype(np.uint16).view(np.float16)
    else:
        v = (bits << 16).view(np.float32)
    return v[np.isfinite(v)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fast_maths_within_one_ulp_on_every_value(dtype):
    ops = list(FAST_UNARY)
    lines = ["onnxfuse.elementwise 1", f"input x: {dtype}"]
    lines += [f"y{k}: {dtype} = {op}(x)" for k, op in enumerate(ops)]
    lines += [f"output y{k}" for k in range(len(ops))]
    text = "\n".join(lines) + "\n"
    x = _all_values(dtype)
    got = cuda_fused_session(text, [x.shape]).run(None, {"x": x})
    x64 = x.astype(np.float64)
    report = []
    for op, g in zip(ops, got):
        with np.errstate(all="ignore"):
            exact = FAST_UNARY[op](x64)
            want = exact.astype(np.float16) if dtype == "float16" else expr.round_to_dtype(
                exact.astype(np.float32), "bfloat16").astype(np.float32)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(g), nan), f"{op}: NaN pattern"
        d = np.abs(_ordered(_half_bits(g[~nan], dtype)) - _ordered(_half_bits(want[~nan], dtype)))
        with np.errstate(invalid="ignore"):  # inf - inf
            d[np.abs(g[~nan].astype(np.float64) - want[~nan].astype(np.float64)) < 2.0 ** -120] = 0
        report.append(f"{op}: max {d.max()} ulp, {np.mean(d > 0):.3%} off by one")
        assert d.max() <= 1, f"{op} ({dtype}): {d.max()} ulp at x = {x[~nan][d.argmax()]}"
    print(f"\n{dtype} fast maths vs exact (correctly rounded): " + "; ".join(report))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fast_division_within_one_ulp(dtype):
    text = f"onnxfuse.elementwise 1\ninput a: {dtype}\ninput b: {dtype}\ny: {dtype} = Div(a, b)\noutput y\n"
    rng = np.random.default_rng(8)
    vals = _all_values(dtype)
    a = rng.choice(vals, 1 << 20)
    b = rng.choice(vals, 1 << 20)
    (got,) = cuda_fused_session(text, [a.shape, b.shape]).run(None, {"a": a, "b": b})
    with np.errstate(all="ignore"):
        exact = a.astype(np.float64) / b.astype(np.float64)
        want = exact.astype(np.float16) if dtype == "float16" else expr.round_to_dtype(
            exact.astype(np.float32), "bfloat16").astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    d = np.abs(_ordered(_half_bits(got[~nan], dtype)) - _ordered(_half_bits(want[~nan], dtype)))
    with np.errstate(invalid="ignore"):  # inf - inf
        d[np.abs(got[~nan].astype(np.float64) - want[~nan].astype(np.float64)) < 2.0 ** -120] = 0
    assert d.max() <= 1, f"Div: {d.max()} ulp at {a[~nan][d.argmax()]} / {b[~nan][d.argmax()]}"


ODD_SIZES = [1, 2, 3, 7, 8, 9, 15, 17, 1023, 1025, 4097, 65_537, 1_000_003]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_odd_sizes_vector_tail(dtype):
    text = H.SILU_CHAIN.replace("float32", dtype)
    rng = np.random.default_rng(3)
    for n in ODD_SIZES:
        x = H.random_input(rng, dtype, (n,))
        s = H.random_input(rng, dtype, ())
        got = cuda_fused_session(text, [(n,), ()]).run(None, {"x": x, "s": s})
        want = H.fused_session(text, [(n,), ()]).run(None, {"x": x, "s": s})
        for g, w in zip(got, want):
            H.compare(g, w, dtype, f"n={n}", scale=4.0)


def _gpu_value(a: np.ndarray):
    return ort.OrtValue.ortvalue_from_numpy(a, "cuda", 0)


@pytest.mark.parametrize("offset_elems", [0, 1, 2, 3])
def test_misaligned_buffers(offset_elems):
    """Inputs and outputs bound at addresses that are not 16-byte aligned use the scalar kernel."""
    n = 10_001
    text = H.SILU_CHAIN
    rng = np.random.default_rng(4)
    x = rng.standard_normal(n + 8).astype(np.float32)
    s = rng.standard_normal(n + 8).astype(np.float32)
    sess = cuda_fused_session(text, [(n,), (n,)])
    xv, sv = _gpu_value(x), _gpu_value(s)
    outs = [_gpu_value(np.zeros(n + 8, np.float32)) for _ in range(2)]
    io = sess.io_binding()
    off = 4 * offset_elems
    io.bind_input("x", "cuda", 0, np.float32, [n], xv.data_ptr() + off)
    io.bind_input("s", "cuda", 0, np.float32, [n], sv.data_ptr() + off)
    for i, o in enumerate(outs):
        io.bind_output(f"out:{i}", "cuda", 0, np.float32, [n], o.data_ptr() + off)
    sess.run_with_iobinding(io)
    xs, ss = x[offset_elems:offset_elems + n], s[offset_elems:offset_elems + n]
    want = H.fused_session(text, [(n,), (n,)]).run(None, {"x": xs, "s": ss})
    for o, w in zip(outs, want):
        got = o.numpy()[offset_elems:offset_elems + n]
        H.compare(got, w, "float32", f"offset {offset_elems}", scale=4.0)


@pytest.mark.slow
def test_64bit_indexing():
    """More than 2^31-1 elements: the 64-bit index kernels (bool, 2 x 2.1 GB)."""
    n = 2**31 + 37
    text = "onnxfuse.elementwise 1\ninput x: bool\ny: bool = Not(x)\noutput y\n"
    sess = cuda_fused_session(text, [(n,)])
    x = np.zeros(n, np.bool_)
    x[::3] = True
    (y,) = sess.run(None, {"x": x})
    assert y.shape == (n,)
    for sl in (slice(0, 1000), slice(2**31 - 500, 2**31 + 37)):
        np.testing.assert_array_equal(y[sl], ~x[sl])
    assert int(y.sum()) == n - int(x.sum())


# ----------------------------------------------------------------------------------- CUDA graphs

@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_graph_capture_and_replay(dtype):
    text = H.SILU_CHAIN.replace("float32", dtype)
    shape_x, shape_s = (4, 8, 33, 17), (1, 8, 1, 1)  # broadcast kernel and a multi-output
    npdt = np.float32 if dtype == "float32" else np.float16
    sess = cuda_fused_session(text, [shape_x, shape_s], cuda_graph=True)
    rng = np.random.default_rng(5)
    x0 = rng.standard_normal(shape_x).astype(npdt)
    s0 = rng.standard_normal(shape_s).astype(npdt)
    xv, sv = _gpu_value(x0), _gpu_value(s0)
    outs = [_gpu_value(np.zeros(shape_x, npdt)) for _ in range(2)]
    io = sess.io_binding()
    io.bind_ortvalue_input("x", xv)
    io.bind_ortvalue_input("s", sv)
    io.bind_ortvalue_output("out:0", outs[0])
    io.bind_ortvalue_output("out:1", outs[1])
    ref = H.fused_session(text, [shape_x, shape_s])
    for step in range(4):  # first runs capture the graph, later ones replay it
        x = rng.standard_normal(shape_x).astype(npdt)
        s = rng.standard_normal(shape_s).astype(npdt)
        xv.update_inplace(x)
        sv.update_inplace(s)
        sess.run_with_iobinding(io)
        want = ref.run(None, {"x": x, "s": s})
        for o, w in zip(outs, want):
            H.compare(o.numpy(), w, dtype, f"CUDA graph step {step}", scale=4.0)


# ------------------------------------------------------------------------------ disk kernel cache

_CHILD = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, {root!r})
    import numpy as np, onnxruntime as ort
    from onnxfuse.custom_ops import native as codegen, session_options
    from onnx import helper
    import importlib.util
    spec = importlib.util.spec_from_file_location("h", {helpers!r})
    h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)
    text = h.SILU_CHAIN.replace("0.5", {const!r})
    so = session_options(); so.log_severity_level = 3
    t0 = time.perf_counter()
    sess = ort.InferenceSession(h.fused_model(text, [(1000,), ()]).SerializeToString(), so,
                                providers=["CUDAExecutionProvider"])
    t1 = time.perf_counter()
    x = np.ones(1000, np.float32); s = np.asarray(2.0, dtype=np.float32)  # 0-d ndarray, not a scalar
    sess.run(None, {{"x": x, "s": s}})
    print(json.dumps(dict(codegen.kernel_stats(), session_s=t1 - t0)))
""")


def _python_child(template: str, env: dict, timeout: int, **fields) -> dict:
    """``template`` (formatted with the repository root, the library tests' helpers and ``fields``) run in a
    fresh Python process with ``env``; its last line of output, read as JSON."""
    code = template.format(root=str(ROOT), helpers=str(ROOT / "tests/custom_ops/test_library.py"), **fields)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _child(cache: Path, const: str) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    env.pop("ONNXFUSE_KERNEL_CACHE", None)
    return _python_child(_CHILD, env, 300, const=const)


def test_disk_cache_across_processes(tmp_path):
    const = repr(float(np.random.default_rng().uniform(0.1, 0.9)))  # a program no cache has seen
    first = _child(tmp_path, const)
    second = _child(tmp_path, const)
    assert first["compiles"] == 1 and first["disk_writes"] == 1 and first["disk_hits"] == 0, first
    assert second["compiles"] == 0 and second["disk_hits"] == 1, second
    assert any((tmp_path / "onnxfuse" / "kernels").iterdir())
    print(f"\nfirst process: NVRTC compile {first['last_compile_ms']:.1f} ms "
          f"(session {first['session_s'] * 1e3:.0f} ms, arch {first['last_arch']}); "
          f"second process: disk cache load {second['last_disk_load_ms']:.2f} ms "
          f"(session {second['session_s'] * 1e3:.0f} ms)")
    assert second["last_disk_load_ms"] < first["last_compile_ms"]


def test_memory_cache_within_process():
    text = H.SILU_CHAIN.replace("0.5", "0.375")
    before = codegen.kernel_stats()
    cuda_fused_session(text, [(10,), ()])
    cuda_fused_session(text, [(10,), ()])
    after = codegen.kernel_stats()
    assert after["memory_hits"] >= before["memory_hits"] + 1


def test_kernel_cache_disabled(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), ONNXFUSE_KERNEL_CACHE="0")
    code = _CHILD.format(root=str(ROOT), helpers=str(ROOT / "tests/custom_ops/test_library.py"), const="0.4375")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    stats = json.loads(r.stdout.strip().splitlines()[-1])
    assert stats["compiles"] == 1 and stats["disk_writes"] == 0
    assert not (tmp_path / "onnxfuse" / "kernels").exists()


# ------------------------------------------------------------------------------- launch tuning

_TUNING_CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    import numpy as np, onnxruntime as ort
    from onnxfuse.custom_ops import native as codegen, session_options
    import importlib.util
    spec = importlib.util.spec_from_file_location("h", {helpers!r})
    h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h)
    rng = np.random.default_rng(11)
    outs = {{}}
    cases = {{  # fast path with a vector tail; per-channel (vectorised broadcast); general broadcast
        "fast": ((3 * 2**20 + 5,), ()),
        "bcast_vec": ((16, 64, 64, 64), (1, 64, 1, 1)),
        "bcast": ((16, 63, 65, 65), (1, 63, 1, 1)),
    }}
    for dtype, npdt in (("float32", np.float32), ("float16", np.float16)):
        text = h.SILU_CHAIN.replace("float32", dtype)
        for case, (sx, ss) in cases.items():
            x = rng.standard_normal(sx).astype(npdt); s = rng.standard_normal(ss).astype(npdt)
            for graph in (False, True):
                so = session_options(); so.log_severity_level = 3
                so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
                opts = [{{"enable_cuda_graph": "1"}}] if graph else None
                sess = ort.InferenceSession(h.fused_model(text, [sx, ss]).SerializeToString(), so,
                                            providers=["CUDAExecutionProvider"], provider_options=opts)
                xv = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
                sv = ort.OrtValue.ortvalue_from_numpy(s, "cuda", 0)
                ov = [ort.OrtValue.ortvalue_from_numpy(np.zeros(sx, npdt), "cuda", 0) for _ in range(2)]
                io = sess.io_binding()
                io.bind_ortvalue_input("x", xv); io.bind_ortvalue_input("s", sv)
                io.bind_ortvalue_output("out:0", ov[0]); io.bind_ortvalue_output("out:1", ov[1])
                for _ in range(3):  # with CUDA graphs: plain runs, the capture, then a replay
                    sess.run_with_iobinding(io)
                for i, o in enumerate(ov):
                    outs[f"{{dtype}}-{{case}}-{{graph}}-{{i}}"] = o.numpy()
    np.savez({out!r}, **outs)
    print(json.dumps(codegen.kernel_stats()))
""")


def _tuning_child(tmp_path: Path, tuning: str):
    out = tmp_path / f"tuning-{tuning}.npz"
    env = dict(os.environ, ONNXFUSE_LAUNCH_TUNING=tuning)
    return _python_child(_TUNING_CHILD, env, 500, out=str(out)), np.load(out)


def test_launch_tuning_changes_time_never_values(tmp_path):
    """Launches of 1M elements and more are tuned on their first run (block size and items per thread,
    timed on the GPU); the outputs are bit for bit those of the default launch, in plain runs and in a
    CUDA graph captured after the tuning run. With ONNXFUSE_LAUNCH_TUNING=0 nothing is tuned."""
    tuned, got = _tuning_child(tmp_path, "1")
    plain, want = _tuning_child(tmp_path, "0")
    assert plain["launch_tunings"] == 0, plain
    # 2 dtypes x 3 layouts; the CUDA-graph session of each reuses the module's decision.
    assert tuned["launch_tunings"] == 6, tuned
    last = tuned["last_launch_tuning"]
    assert last["candidates"] >= 5 and last["chosen_ms"] > 0 and last["default_ms"] > 0, last
    assert last["chosen_ms"] <= last["default_ms"], last
    assert sorted(got.files) == sorted(want.files) and len(got.files) == 24
    for k in want.files:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    print(f"\nlaunch tuning: {tuned['launch_tunings_changed']} of {tuned['launch_tunings']} sizes kept "
          f"another shape; last {last}")
