"""CUDA code generation, checked without a GPU: the source the library generates for every op in
every dtype, every Cast pair and every kernel variant compiles to PTX with NVRTC (from the
nvidia-cuda-nvrtc wheel, which runs on the CPU), and the PTX has the expected kernels and
vectorised memory accesses. The GPU tests (tests/gpu) run the same kernels."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from onnxfuse.custom_ops import expr, native


try:
    NVRTC = native.nvrtc_version()
    NVRTC_SKIP = None
except native.NvrtcNotFoundError as e:  # pragma: no cover - depends on the environment
    NVRTC, NVRTC_SKIP = None, f"NVRTC not available ({e}); install the dev extra: pip install -e '.[dev]'"

needs_nvrtc = pytest.mark.skipif(NVRTC_SKIP is not None, reason=NVRTC_SKIP or "")
ARCHS = ["compute_75", "compute_90"]
ALL_KERNELS = [n for names in native.KERNEL_NAMES.values() for n in names]


def all_ops_program(dtype: str) -> str:
    """One program applying every op that takes ``dtype`` (plus Where/comparisons/logic)."""
    lines = ["onnxfuse.elementwise 1", f"input a: {dtype}", f"input b: {dtype}", "input c: bool"]
    outs = []
    for k, (op, spec) in enumerate(expr.OP_TABLE.items()):
        if op == "Cast" or dtype not in spec.dtypes:
            continue
        args = (["c"] if spec.cond_first else []) + ["a", "b"][: spec.arity - (1 if spec.cond_first else 0)]
        res = "bool" if spec.result == "bool" else dtype
        attrs = ""
        if op == "Clip":
            attrs = "[min=-3, max=inf]" if dtype in expr.INT_DTYPES else "[min=-inf, max=2.5]"
        if op == "Gelu":
            lines.append(f"g{k}: {res} = Gelu[approximate=tanh]({', '.join(args)})")
            outs.append(f"g{k}")
        if op in ("Selu", "HardSigmoid"):
            attrs = "[alpha=0.5, " + ("gamma" if op == "Selu" else "beta") + "=0.25]"
        lines.append(f"r{k}: {res} = {op}{attrs}({', '.join(args)})")
        outs.append(f"r{k}")
    if dtype in expr.FLOAT_DTYPES:
        lines.append(f"const k0: {dtype} = nan")
        lines.append(f"const k1: {dtype} = -0.0")
        lines.append(f"kk: {dtype} = Add(k0, k1)")
        outs.append("kk")
    elif dtype == "int64":
        lines.append("const k0: int64 = -9223372036854775808")
        lines.append("kk: int64 = Add(k0, a)")
        outs.append("kk")
    lines += [f"output {o}" for o in outs] + ["output a"]
    return "\n".join(lines) + "\n"


def cast_program() -> str:
    lines = ["onnxfuse.elementwise 1"] + [f"input x{i}: {t}" for i, t in enumerate(expr.DTYPES)]
    outs = []
    for i, src in enumerate(expr.DTYPES):
        for dst in expr.DTYPES:
            lines.append(f"c{i}_{dst}: {dst} = Cast[to={dst}](x{i})")
            outs.append(f"c{i}_{dst}")
    return "\n".join(lines + [f"output {o}" for o in outs]) + "\n"


def test_source_embeds_ops_header_verbatim():
    """The device maths is the same text the CPU kernel is compiled from (csrc/ops.h)."""
    header = (Path(native.__file__).parent / "csrc" / "ops.h").read_text()
    src = native.cuda_source(all_ops_program("float32"))
    assert header in src
    for name in ALL_KERNELS:
        assert f'extern "C" __global__ void __launch_bounds__(256) {name}(' in src


def test_variant_masks():
    text = all_ops_program("float32")
    for variant, names in native.KERNEL_NAMES.items():
        src = native.cuda_source(text, variant)
        for v2, n2 in native.KERNEL_NAMES.items():
            for n in n2:
                assert (f" {n}(" in src) == (v2 == variant)


def test_invalid_program_raises():
    with pytest.raises(ValueError, match="line 2"):
        native.cuda_source("onnxfuse.elementwise 1\ninput x: float99\noutput x\n")


@needs_nvrtc
@pytest.mark.parametrize("dtype", expr.DTYPES)
def test_every_op_compiles(dtype):
    text = all_ops_program(dtype)
    for arch in ARCHS:
        ptx = native.compile_ptx(native.cuda_source(text), arch=arch)
        for name in ALL_KERNELS:
            assert f".entry {name}(" in ptx, (name, arch)


@needs_nvrtc
def test_every_cast_compiles():
    ptx = native.compile_ptx(native.cuda_source(cast_program()), arch="compute_90")
    for name in ALL_KERNELS:
        assert f".entry {name}(" in ptx


@needs_nvrtc
@pytest.mark.parametrize("variant", sorted(native.KERNEL_NAMES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_each_variant_compiles_alone(variant, dtype):
    text = f"""onnxfuse.elementwise 1
input x: {dtype}
input s: {dtype}
const half: {dtype} = 0.5
const one: {dtype} = 1
t0: {dtype} = Sigmoid(x)
t1: {dtype} = Mul(x, t0)
t2: {dtype} = Mul(t1, half)
t3: {dtype} = Add(t2, one)
t4: {dtype} = Tanh(t3)
t5: {dtype} = Mul(t4, s)
output t5
"""
    ptx = native.compile_ptx(native.cuda_source(text, variant), arch="compute_80")
    entries = re.findall(r"\.entry (\w+)\(", ptx)
    assert sorted(entries) == sorted(native.KERNEL_NAMES[variant])


@needs_nvrtc
@pytest.mark.parametrize("variant", [native.VARIANT_FAST_VEC, native.VARIANT_BROADCAST_VEC])
@pytest.mark.parametrize("dtype,vec_load", [("float32", "v4.f32"), ("float16", "v4.u32"),
                                            ("bfloat16", "v4.u32")])
def test_vector_kernels_use_128_bit_accesses(dtype, vec_load, variant):
    text = (f"onnxfuse.elementwise 1\ninput x: {dtype}\ninput s: {dtype}\nt: {dtype} = Sigmoid(x)\n"
            f"y: {dtype} = Mul(t, s)\noutput y\n")
    ptx = native.compile_ptx(native.cuda_source(text, variant), arch="compute_90")
    assert re.search(r"ld\.global(\.nc)?\." + re.escape(vec_load), ptx), "no 128-bit load"
    assert re.search(r"st\.global\." + re.escape(vec_load), ptx), "no 128-bit store"


# Ops generated with fast approximations when their declared dtype is float16/bfloat16: the rows of the
# op table that carry one (Gelu's only in its tanh form).
FAST_OPS = {("Gelu[approximate=tanh]" if name == "Gelu" else name): spec.fast
            for name, spec in expr.OP_TABLE.items() if spec.fast}


def test_the_fast_ops_are_the_expected_ones_and_each_is_defined_once():
    """The table is the one place a fast path is declared: these seven, each function defined exactly
    once in the generated source, before any use, bfloat16 Tanh's too."""
    assert set(FAST_OPS) == {"Exp", "Sigmoid", "Tanh", "Reciprocal", "Div", "Softsign", "Gelu[approximate=tanh]"}
    src = native.cuda_source(fast_ops_program("bfloat16"))
    for fn in [*FAST_OPS.values(), expr.OP_TABLE["Tanh"].fast_bf16]:
        defined = src.index(f"float {fn}(")
        assert src.count(f"float {fn}(") == 1, fn
        assert src.index(f"{fn}(") == defined + len("float "), fn  # no use before the definition


def fast_ops_program(dtype: str) -> str:
    lines = ["onnxfuse.elementwise 1", f"input a: {dtype}", f"input b: {dtype}"]
    for k, op in enumerate(FAST_OPS):
        args = "a, b" if op == "Div" else "a"
        lines.append(f"r{k}: {dtype} = {op}({args})")
    lines.append(f"g: {dtype} = Gelu[approximate=none](a)")  # erf: accurate in every dtype
    lines.append(f"l: {dtype} = Log(a)")                     # accurate in every dtype (see codegen)
    return "\n".join(lines + [f"output r{k}" for k in range(len(FAST_OPS))] + ["output g", "output l"]) + "\n"


@pytest.mark.parametrize("dtype", expr.FLOAT_DTYPES)
def test_fast_maths_only_for_half_dtypes(dtype):
    src = native.cuda_source(fast_ops_program(dtype))
    start = src.index("void ofx_eval(")
    body = src[start:src.index("\n}\n", start)]
    for op, fn in FAST_OPS.items():
        if op == "Tanh" and dtype == "bfloat16":
            fn = expr.OP_TABLE["Tanh"].fast_bf16
        assert (f" = {fn}(" in body) == (dtype != "float32"), (op, dtype)
    assert " = ofx_gelu(" in body and " = ofx_log(" in body
    if dtype == "float32":
        assert "ofx_fast_" not in body


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", expr.FLOAT_DTYPES)
def test_fast_maths_compiles_to_approximate_instructions(dtype, arch):
    """Every variant with the fast maths; tanh.approx (MUFU.TANH, sm_75+) for bfloat16 Tanh only,
    approximate division for half dtypes only (float32 keeps IEEE division)."""
    ptx = native.compile_ptx(native.cuda_source(fast_ops_program(dtype)), arch=arch)
    assert sorted(re.findall(r"\.entry (\w+)\(", ptx)) == sorted(ALL_KERNELS)
    assert ("tanh.approx.f32" in ptx) == (dtype == "bfloat16")
    assert ("div.approx" in ptx) == (dtype != "float32")
    assert "ex2.approx" in ptx  # float32's expf uses it too, after an accurate range reduction
    if dtype == "float32":
        assert "div.rn.f32" in ptx or "rcp.rn.f32" in ptx


@needs_nvrtc
def test_tanh_fallback_without_tanh_approx_compiles():
    """The pre-sm_75 path of bfloat16 Tanh (NVRTC 13 cannot target sm_70; forced by a macro here)."""
    ptx = native.compile_ptx(native.cuda_source(fast_ops_program("bfloat16")), arch="compute_90",
                              options=("-DOFX_NO_TANH_APPROX=1",))
    assert "tanh.approx" not in ptx and ".entry ofx_fast_vec_32(" in ptx


@needs_nvrtc
@pytest.mark.parametrize("out_dtype,cvt", [("float16", "cvt.rn.f16x2.f32"), ("bfloat16", "cvt.rn.bf16x2.f32")])
def test_half_outputs_converted_in_pairs(out_dtype, cvt):
    text = f"onnxfuse.elementwise 1\ninput x: float32\ny: {out_dtype} = Cast[to={out_dtype}](x)\noutput y\n"
    ptx = native.compile_ptx(native.cuda_source(text), arch="compute_90")
    assert cvt in ptx
    ptx75 = native.compile_ptx(native.cuda_source(text), arch="compute_75")  # sm_80+ instruction
    assert cvt not in ptx75


@needs_nvrtc
def test_compile_error_carries_log():
    with pytest.raises(native.NvrtcError, match="undefined"):
        native.compile_ptx("extern \"C\" __global__ void k() { undefined_fn(); }")


def test_kernel_stats_without_gpu():
    stats = native.kernel_stats()
    assert stats["compiles"] == 0 and "cache_dir" in stats


# ------------------------------------------------------------------ host side with a mock driver
# A stand-in for libcuda.so.1 that accepts modules and records launches lets the library's CUDA
# host code run here: NVRTC to CUBIN for the device's architecture, the memory and disk kernel
# caches, the choice of kernel (vector / scalar / broadcast, 32/64-bit index), grid size and the
# kernel-parameter block. Each scenario runs in a fresh process (the driver is loaded once per
# process, and must not be the mock in a process that later uses a real GPU).

MOCK_DRIVER = r"""
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
typedef int CUresult;
static char g_names[32][64]; static int g_nnames;
static unsigned g_grid, g_block; static void* g_stream; static unsigned char g_params[4096];
static char g_last[64]; static int g_loads; static int g_launches; static int g_cubin;
/* What it was asked to load (first 64 bytes of each image) and each launch's first 32 parameter bytes. */
static unsigned char g_images[16][64]; static unsigned long long g_ptrs[4096][4];
/* Simulated GPU time of the launches so far (read by MOCK_EVENTS' events): fewer threads in all is
   faster, blocks of 128 faster than 256; so launch tuning must pick 128 threads, 8 items per thread. */
static double g_cost;
static double mock_cost(unsigned gx, unsigned bx) { return (double)gx * bx * 1e-6 + (bx == 128 ? 0.0 : 1.0); }
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuDeviceGet(int* d, int o) { *d = o; return 0; }
CUresult cuDeviceGetAttribute(int* v, int a, int d) { *v = a == 75 ? 9 : 0; return 0; }
CUresult cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)0x1000; return 0; }
CUresult cuCtxPushCurrent_v2(void* c) { return 0; }
CUresult cuCtxPopCurrent_v2(void** c) { *c = (void*)0x1000; return 0; }
CUresult cuCtxGetCurrent(void** c) { *c = (void*)0x1000; return 0; }
CUresult cuCtxSetCurrent(void* c) { return 0; }
CUresult cuModuleLoadData(void** m, const void* image) {
  if (g_loads < 16) memcpy(g_images[g_loads], image, 64);
  g_loads++; g_cubin = memcmp(image, "\x7f" "ELF", 4) == 0; *m = (void*)0x2000; return 0; }
CUresult cuModuleGetFunction(void** f, void* m, const char* name) {
  if (g_nnames >= 32) return 1;
  strncpy(g_names[g_nnames], name, 63); *f = g_names[g_nnames]; g_nnames++; return 0; }
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shm, void* stream, void** params, void** extra) {
  strncpy(g_last, (const char*)f, 63); g_grid = gx; g_block = bx; g_stream = stream;
  memcpy(g_params, params[0], sizeof g_params);
  if (g_launches < 4096) memcpy(g_ptrs[g_launches], params[0], sizeof g_ptrs[0]);
  g_cost += mock_cost(gx, bx);
  g_launches++; return 0; }
CUresult cuGetErrorString(CUresult r, const char** s) { *s = "mock error"; return 0; }
int mock_state(char* last, unsigned* grid, unsigned* block, void** stream, unsigned char* params,
               int* loads, int* cubin) {
  strcpy(last, g_last); *grid = g_grid; *block = g_block; *stream = g_stream;
  memcpy(params, g_params, sizeof g_params); *loads = g_loads; *cubin = g_cubin; return g_launches; }
int mock_images(unsigned char* out) { memcpy(out, g_images, sizeof g_images); return g_loads; }
int mock_ptrs(unsigned long long* out) { memcpy(out, g_ptrs, sizeof g_ptrs); return g_launches; }
"""

# The same driver with CUDA events (elapsed time: the simulated cost of the launches between them) and
# cuStreamIsCapturing (what mock_set_capturing last set): what launch tuning needs.
MOCK_EVENTS = MOCK_DRIVER + r"""
static double g_slots[16]; static int g_nslots; static int g_capturing;
CUresult cuEventCreate(void** e, unsigned f) { *e = &g_slots[g_nslots++ % 16]; return 0; }
CUresult cuEventRecord(void* e, void* s) { *(double*)e = g_cost; return 0; }
CUresult cuEventSynchronize(void* e) { return 0; }
CUresult cuEventElapsedTime(float* ms, void* a, void* b) { *ms = (float)(*(double*)b - *(double*)a); return 0; }
CUresult cuEventDestroy_v2(void* e) { return 0; }
CUresult cuStreamIsCapturing(void* s, int* status) { *status = g_capturing; return 0; }
void mock_set_capturing(int c) { g_capturing = c; }
"""

MOCK_CHILD = r"""
import ctypes, json, os, struct, sys
sys.path.insert(0, ROOT)
from onnxfuse.custom_ops import library_path, native
lib = ctypes.CDLL(library_path())
mock = ctypes.CDLL(MOCK) if os.path.exists(MOCK) else None
lib.onnxfuse_test_cuda_create.restype = ctypes.c_void_p
lib.onnxfuse_test_cuda_create.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
lib.onnxfuse_test_cuda_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int),
    ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
    ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_size_t]
err = ctypes.create_string_buffer(8192)
exec(PRE)
programs = PROGRAM if isinstance(PROGRAM, list) else [PROGRAM]
k = lib.onnxfuse_test_cuda_create(programs[0].encode(), 0, int(PLACED), err, len(err))
out = {"created": bool(k), "error": err.value.decode(), "launches": []}
for extra in programs[1:]:
    out.setdefault("more_created", []).append(bool(lib.onnxfuse_test_cuda_create(extra.encode(), 0, int(PLACED), err, len(err))))
for shapes, in_ptrs, out_ptrs, *place in LAUNCHES:  # place: (inner, pitch, off, total) for a placed kernel
    ranks = (ctypes.c_int * len(shapes))(*[len(s) for s in shapes])
    flat = [d for s in shapes for d in s]
    dims = (ctypes.c_int64 * max(1, len(flat)))(*flat)
    ins = (ctypes.c_void_p * len(in_ptrs))(*in_ptrs)
    outs = (ctypes.c_void_p * len(out_ptrs))(*out_ptrs)
    pl = (ctypes.c_int64 * 4)(*place[0]) if place else None
    ok = lib.onnxfuse_test_cuda_launch(k, len(shapes), ranks, dims, ins, len(out_ptrs), outs, 0x77, pl, err, len(err))
    last = ctypes.create_string_buffer(64); grid = ctypes.c_uint(); block = ctypes.c_uint()
    stream = ctypes.c_void_p(); params = ctypes.create_string_buffer(4096); loads = ctypes.c_int()
    cubin = ctypes.c_int()
    n = mock.mock_state(last, ctypes.byref(grid), ctypes.byref(block), ctypes.byref(stream), params,
                        ctypes.byref(loads), ctypes.byref(cubin))
    out["launches"].append({"ok": ok, "error": err.value.decode(), "kernel": last.value.decode(),
                            "grid": grid.value, "block": block.value, "stream": stream.value,
                            "params": params.raw.hex(), "count": n, "loads": loads.value, "cubin": cubin.value})
out["stats"] = native.kernel_stats()
if mock is not None:
    images = ctypes.create_string_buffer(16 * 64)
    n = mock.mock_images(images)
    out["images"] = [images.raw[64 * i:64 * i + 64].hex() for i in range(min(n, 16))]
    ptrs = (ctypes.c_ulonglong * (4096 * 4))()
    n = mock.mock_ptrs(ptrs)
    out["ptrs"] = [list(ptrs[4 * i:4 * i + 4]) for i in range(min(n, 4096))]
print(json.dumps(out))
"""


def _build_mock(tmp_path_factory, source: str):
    import shutil
    import subprocess

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler for the mock CUDA driver")
    d = tmp_path_factory.mktemp("mockcuda")
    (d / "mock.c").write_text(source)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(d / "libcuda_mock.so"), str(d / "mock.c")],
                   check=True)
    return d / "libcuda_mock.so"


@pytest.fixture(scope="module")
def mock_driver(tmp_path_factory):
    return _build_mock(tmp_path_factory, MOCK_DRIVER)


@pytest.fixture(scope="module")
def mock_driver_with_events(tmp_path_factory):
    return _build_mock(tmp_path_factory, MOCK_EVENTS)


def run_mock(mock, cache_home, program, launches, extra_env=None, pre: str = "", placed: bool = False) -> dict:
    """Runs MOCK_CHILD in a fresh process: creates a kernel for ``program`` (or one per program of a
    list; launches use the first; ``placed``: a FusedConcat segment's kernel, each launch then
    ``(shapes, in_ptrs, out_ptrs, (inner, pitch, off, total))`` or without its placement), after running
    ``pre`` (Python) there; the child's stderr is returned as "stderr"."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, ONNXFUSE_CUDA_DRIVER=str(mock), XDG_CACHE_HOME=str(cache_home))
    env.pop("ONNXFUSE_KERNEL_CACHE", None)
    from onnxfuse.custom_ops import nvrtc_library_path

    if nvrtc_library_path():
        env["ONNXFUSE_NVRTC_PATH"] = nvrtc_library_path()
    env.update(extra_env or {})
    root = str(Path(native.__file__).resolve().parents[2])
    code = (f"ROOT = {root!r}\nMOCK = {str(mock)!r}\nPROGRAM = {program!r}\nLAUNCHES = {launches!r}\n"
            f"PRE = {pre!r}\nPLACED = {placed!r}\n" + MOCK_CHILD)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["stderr"] = r.stderr
    return out


def max_dims(nin: int, nout: int) -> int:
    """D, the size of the parameter block's dims[D] and strides[nin][D] (cuda_max_dims in C++):
    16 (the rank limit) while the block fits in 4096 bytes, else as many as fit."""
    return min(16, (4096 - 8 * (nin + nout) - 24) // (8 * (nin + 1)))


def unpack_params(hexstr: str, nin: int, nout: int) -> dict:
    import struct

    d = max_dims(nin, nout)
    b = bytes.fromhex(hexstr)
    q = struct.unpack_from(f"<{nin + nout}Q", b, 0)
    off = 8 * (nin + nout)
    n, mask = struct.unpack_from("<qq", b, off)
    (ndim,) = struct.unpack_from("<i", b, off + 16)
    dims = struct.unpack_from(f"<{d}q", b, off + 24)
    strides = [struct.unpack_from(f"<{d}q", b, off + 24 + 8 * d + 8 * d * k) for k in range(nin)]
    return {"in": list(q[:nin]), "out": list(q[nin:]), "n": n, "mask": mask, "ndim": ndim,
            "dims": list(dims[:ndim]), "strides": [list(s[:ndim]) for s in strides]}


@needs_nvrtc
def test_host_side_with_mock_driver(mock_driver, tmp_path):
    text = "onnxfuse.elementwise 1\ninput x: float32\ninput s: float16\nc: float32 = Cast[to=float32](s)\n" \
           "y: float32 = Mul(x, c)\nh: float16 = Cast[to=float16](y)\noutput y\noutput h\n"
    A, B, O1, O2 = 0x10000, 0x20000, 0x30000, 0x40000
    launches = [
        ([(1000,), (1000,)], [A, B], [O1, O2]),            # fast, aligned -> vector kernel, V = 8
        ([(1000,), ()], [A, B], [O1, O2]),                  # scalar input -> vector kernel, mask bit 1
        ([(1000,), (1000,)], [A + 4, B], [O1, O2]),         # misaligned -> scalar kernel
        ([(2, 3, 4, 5), (1, 3, 1, 1)], [A, B], [O1, O2]),   # per-channel -> broadcast kernel
        ([(2, 3), (4, 1, 3)], [A, B], [O1, O2]),            # 3-d broadcast
        ([(2**31 + 5,), ()], [A, B], [O1, O2]),             # > 2^31-1 elements -> 64-bit index
        ([(0, 3), (3,)], [A, B], [O1, O2]),                 # empty: no launch
        ([(3,), (4,)], [A, B], [O1, O2]),                   # shapes that do not broadcast
        ([(2, 3, 4, 8), (1, 3, 1, 1)], [A, B], [O1, O2]),   # per-channel, inner 32 % 8 == 0 -> bcast_vec
        ([(2, 3, 4, 8), (1, 3, 1, 1)], [A + 4, B], [O1, O2]),  # x misaligned -> bcast
        ([(2, 3, 4, 8), (1, 3, 1, 1)], [A, B + 2], [O1, O2]),  # s (one load per thread) at any address
        ([(2, 3, 4, 8), (1, 3, 1, 1)], [A, B], [O1, O2 + 8]),  # output misaligned -> bcast
        ([(2, 2**30 + 8), (2, 1)], [A, B], [O1, O2]),       # > 2^31-1 elements -> bcast_vec_64
        ([(2, 3, 4, 8), (8,)], [A, B], [O1, O2]),           # s along the inner dim (stride 1) -> bcast_vec
    ]
    first = run_mock(mock_driver, tmp_path, text, launches)
    assert first["created"], first["error"]
    L = first["launches"]
    assert L[0]["ok"] and L[0]["kernel"] == "ofx_fast_vec_32" and L[0]["block"] == 256
    assert L[0]["grid"] == (1000 // 8 + 1000 % 8 + 255) // 256 and L[0]["stream"] == 0x77
    assert L[0]["cubin"] == 1 and L[0]["loads"] == 1  # CUBIN for sm_90 (mock device 9.0)
    p = unpack_params(L[0]["params"], 2, 2)
    assert p["in"] == [A, B] and p["out"] == [O1, O2] and p["n"] == 1000 and p["mask"] == 0
    assert L[1]["kernel"] == "ofx_fast_vec_32" and unpack_params(L[1]["params"], 2, 2)["mask"] == 2
    assert L[2]["kernel"] == "ofx_fast_scalar_32" and L[2]["grid"] == 4
    assert L[3]["kernel"] == "ofx_bcast_32"
    p = unpack_params(L[3]["params"], 2, 2)
    assert p["n"] == 120 and p["dims"] == [2, 3, 20] and p["strides"] == [[60, 20, 1], [0, 1, 0]]
    p = unpack_params(L[4]["params"], 2, 2)
    assert L[4]["kernel"] == "ofx_bcast_32" and p["dims"] == [4, 2, 3]
    assert p["strides"] == [[0, 3, 1], [3, 0, 1]]
    assert L[5]["kernel"] == "ofx_fast_vec_64" and unpack_params(L[5]["params"], 2, 2)["n"] == 2**31 + 5
    assert L[6]["ok"] and L[6]["count"] == L[5]["count"]  # nothing launched for 0 elements
    assert not L[7]["ok"] and "does not broadcast" in L[7]["error"]
    # per-channel: 3 dims [2, 3, 32] after merging; x contiguous along 32, s broadcast along it
    assert L[3]["kernel"] == "ofx_bcast_32"  # inner dim 20 is not a multiple of 8
    assert L[8]["ok"] and L[8]["kernel"] == "ofx_bcast_vec_32", L[8]
    assert L[8]["grid"] == (192 // 8 + 255) // 256
    p = unpack_params(L[8]["params"], 2, 2)
    assert p["n"] == 192 and p["dims"] == [2, 3, 32] and p["strides"] == [[96, 32, 1], [0, 1, 0]]
    assert p["mask"] == 0b10  # s: one scalar load per thread
    assert L[9]["kernel"] == "ofx_bcast_32" and L[11]["kernel"] == "ofx_bcast_32"
    assert L[10]["kernel"] == "ofx_bcast_vec_32"
    assert L[12]["kernel"] == "ofx_bcast_vec_64" and L[12]["grid"] == ((2**31 + 16) // 8 + 255) // 256
    assert unpack_params(L[12]["params"], 2, 2)["mask"] == 0b10
    assert L[13]["kernel"] == "ofx_bcast_vec_32" and unpack_params(L[13]["params"], 2, 2)["mask"] == 0
    s1 = first["stats"]
    assert s1["compiles"] == 1 and s1["disk_writes"] == 1 and s1["last_arch"] == "sm_90"

    second = run_mock(mock_driver, tmp_path, text, launches[:1])  # fresh process, same cache
    s2 = second["stats"]
    assert s2["compiles"] == 0 and s2["disk_hits"] == 1 and second["launches"][0]["kernel"] == "ofx_fast_vec_32"

    third = run_mock(mock_driver, tmp_path / "off", text, launches[:1], {"ONNXFUSE_KERNEL_CACHE": "0"})
    assert third["stats"]["compiles"] == 1 and third["stats"]["disk_writes"] == 0
    assert not (tmp_path / "off" / "onnxfuse").exists()


@needs_nvrtc
def test_driver_missing_is_a_clear_error(tmp_path):
    r = run_mock(tmp_path / "no-such-libcuda.so", tmp_path, "onnxfuse.elementwise 1\ninput x: float32\noutput x\n", [])
    assert not r["created"] and "cannot load the CUDA driver" in r["error"]


@needs_nvrtc
def test_inputs_only_broadcast_do_not_force_the_broadcast_kernel(mock_driver, tmp_path):
    text = "onnxfuse.elementwise 1\ninput x: float32\ninput z: float32\ny: float32 = Relu(x)\noutput y\n"
    r = run_mock(mock_driver, tmp_path, text, [([(4, 2, 3), (4, 1, 1)], [0x10000, 0x20000], [0x30000])])
    assert r["launches"][0]["kernel"] == "ofx_fast_vec_32", r


def _strides(shape, out_rank):
    """Element strides of a contiguous ``shape`` broadcast to rank ``out_rank`` (0 where size 1)."""
    st, acc = [], 1
    for d in reversed(shape):
        st.append(0 if d == 1 else acc)
        acc *= d
    return [0] * (out_rank - len(shape)) + st[::-1]


@needs_nvrtc
def test_broadcast_of_rank_16_in_one_launch(mock_driver, tmp_path):
    """Up to the rank limit (16) the broadcast kernels of small programs take every dim: a layout
    whose 16 dims do not merge is one launch (the kernels took 8 dims, and such a layout failed)."""
    text = "onnxfuse.elementwise 1\ninput x: float32\ninput y: float32\nz: float32 = Add(x, y)\noutput z\n"
    assert "#define OFX_D 16\n" in native.cuda_source(text)
    sx = (2,) * 16
    sy = tuple(2 if i % 2 == 0 else 1 for i in range(16))
    A, B, O = 0x10000, 0x20000, 0x30000
    r = run_mock(mock_driver, tmp_path, text, [([sx, sy], [A, B], [O]),
                                               ([sx + (2,), sy + (1,)], [A, B], [O])])
    L = r["launches"]
    assert L[0]["ok"] and L[0]["kernel"] == "ofx_bcast_32" and L[0]["count"] == 1, L[0]
    p = unpack_params(L[0]["params"], 2, 1)
    assert p["ndim"] == 16 and p["dims"] == [2] * 16 and p["n"] == 2 ** 16
    assert p["strides"] == [_strides(sx, 16), _strides(sy, 16)]
    assert not L[1]["ok"] and "rank 17 exceeds FusedElementwise's limit of 16" in L[1]["error"]
    assert L[1]["count"] == 1  # nothing launched


@needs_nvrtc
def test_many_inputs_split_high_rank_layouts(mock_driver, tmp_path):
    """40 inputs leave room for 11 dims in the 4 KB parameter block: a 16-dim layout is launched
    once per coordinate of its 5 outer dims, with the pointers moved there."""
    n = 40
    lines = ["onnxfuse.elementwise 1"] + [f"input x{i}: float32" for i in range(n)]
    lines.append("t0: float32 = Add(x0, x1)")
    for i in range(2, n):
        lines.append(f"t{i - 1}: float32 = Add(t{i - 2}, x{i})")
    text = "\n".join(lines + [f"output t{n - 2}"]) + "\n"
    assert max_dims(n, 1) == 11 and "#define OFX_D 11\n" in native.cuda_source(text)
    sx = (2,) * 16
    sy = tuple(2 if i % 2 == 0 else 1 for i in range(16))
    shapes = [sx, sy] + [()] * (n - 2)
    X, Y, O = 0x100000, 0x200000, 0x300000
    ins = [X, Y] + [0x400000 + 16 * i for i in range(n - 2)]
    r = run_mock(mock_driver, tmp_path, text, [(shapes, ins, [O])])
    L = r["launches"][0]
    assert L["ok"], L["error"]
    assert L["count"] == 32 and len(r["ptrs"]) == 32  # 2**5 outer coordinates
    stx, sty = _strides(sx, 16), _strides(sy, 16)
    want = set()
    for o in range(32):
        coord = [(o >> (4 - i)) & 1 for i in range(5)]
        want.add((X + 4 * sum(c * s for c, s in zip(coord, stx)), Y + 4 * sum(c * s for c, s in zip(coord, sty))))
    assert {(p[0], p[1]) for p in r["ptrs"]} == want
    p = unpack_params(L["params"], n, 1)  # the last launch: the last block of the output
    assert p["ndim"] == 11 and p["n"] == 2 ** 11 and p["out"] == [O + 31 * 2 ** 11 * 4]
    assert p["strides"][0] == stx[5:] and p["strides"][1] == sty[5:]
    assert p["in"][2:] == ins[2:]


@needs_nvrtc
@pytest.mark.parametrize("dtype", expr.FLOAT_DTYPES)
def test_atan_compiles_to_ptx(dtype):
    """Atan (one expr.OP_TABLE row + ofx_atan in ops.h): the generator calls ofx_atan in every float
    dtype (no fast approximation), and every kernel compiles."""
    text = f"onnxfuse.elementwise 1\ninput x: {dtype}\ny: {dtype} = Atan(x)\noutput y\n"
    src = native.cuda_source(text)
    assert "= ofx_atan(v0);  // y = Atan" in src
    for arch in ARCHS:
        ptx = native.compile_ptx(src, arch=arch)
        for name in ALL_KERNELS:
            assert f".entry {name}(" in ptx, (name, arch)


# ------------------------------------------------------------------ launch tuning (mock timings)

TUNE_TEXT = "onnxfuse.elementwise 1\ninput x: float32\ninput s: float16\nc: float32 = Cast[to=float32](s)\n" \
            "y: float32 = Mul(x, c)\nh: float16 = Cast[to=float16](y)\noutput y\noutput h\n"
BIG = 1 << 22  # 4M elements: V = 8 (a float16 output), so 2^19 vector items


@needs_nvrtc
def test_launch_tuning_picks_the_fastest_shape_once_per_size(mock_driver_with_events, tmp_path):
    """The first launch of a size of 1M elements or more times the candidate shapes (through the
    mock's events, which charge fewer threads and blocks of 128 less) and launches the fastest; later
    launches of that size reuse the decision without timing; small launches are never tuned."""
    A, B, O1, O2 = 0x10000, 0x20000, 0x30000, 0x40000
    launches = [
        ([(BIG,), (BIG,)], [A, B], [O1, O2]),
        ([(BIG,), (BIG,)], [A, B], [O1, O2]),       # same size: the recorded shape, one launch
        ([(1000,), (1000,)], [A, B], [O1, O2]),     # small: the default, untimed
        ([(2, BIG // 2), (2, 1)], [A, B], [O1, O2]),  # another kernel (bcast_vec), tuned on its own
    ]
    r = run_mock(mock_driver_with_events, tmp_path, TUNE_TEXT, launches)
    assert r["created"], r["error"]
    L = r["launches"]
    items = BIG // 8
    assert L[0]["ok"] and L[0]["kernel"] == "ofx_fast_vec_32"
    assert L[0]["block"] == 128 and L[0]["grid"] == items // (128 * 8)
    # 8 candidates (the default and 7 others), each timed twice with one warm-up and 3 runs, then the launch.
    assert L[0]["count"] == 8 * 2 * 4 + 1
    assert L[1]["count"] == L[0]["count"] + 1 and (L[1]["block"], L[1]["grid"]) == (L[0]["block"], L[0]["grid"])
    assert L[2]["count"] == L[1]["count"] + 1 and L[2]["block"] == 256
    assert L[2]["grid"] == (1000 // 8 + 1000 % 8 + 255) // 256
    assert L[3]["kernel"] == "ofx_bcast_vec_32" and L[3]["count"] == L[2]["count"] + 8 * 2 * 4 + 1
    assert (L[3]["block"], L[3]["grid"]) == (128, items // (128 * 8))
    st = r["stats"]
    assert st["launch_tunings"] == 2 and st["launch_tunings_changed"] == 2
    last = st["last_launch_tuning"]
    assert last["kernel"] == "ofx_bcast_vec_32" and last["elements"] == BIG and last["threads"] == 128
    assert last["items_per_thread"] == 8 and last["candidates"] == 8
    assert last["chosen_ms"] < last["default_ms"]


@needs_nvrtc
@pytest.mark.parametrize("why", ["capturing", "turned off", "no events"])
def test_launch_tuning_steps_aside(why, mock_driver, mock_driver_with_events, tmp_path):
    """While the stream is captured into a CUDA graph (no synchronisation allowed), with
    ONNXFUSE_LAUNCH_TUNING=0, or with a driver that cannot time, the default shape is launched and
    nothing is timed or recorded."""
    driver = mock_driver if why == "no events" else mock_driver_with_events
    pre = "mock.mock_set_capturing(1)" if why == "capturing" else ""
    env = {"ONNXFUSE_LAUNCH_TUNING": "0"} if why == "turned off" else {}
    A, B, O1, O2 = 0x10000, 0x20000, 0x30000, 0x40000
    r = run_mock(driver, tmp_path, TUNE_TEXT, [([(BIG,), (BIG,)], [A, B], [O1, O2])] * 2, extra_env=env, pre=pre)
    L = r["launches"]
    assert [x["count"] for x in L] == [1, 2]
    assert all(x["block"] == 256 and x["grid"] == BIG // 8 // 256 for x in L)
    assert r["stats"]["launch_tunings"] == 0 and r["stats"]["last_launch_tuning"] is None


# ------------------------------------------------------------------ placed kernels (FusedConcat)
def test_placed_source_stores_output_0_through_the_placement_only():
    """A FusedConcat segment's kernels store output 0 at OFX_PLACE(i) and its other outputs at i; the
    parameter struct ends with the three placement fields; a plain program's source has none of it."""
    text = "onnxfuse.elementwise 1\ninput x: float32\ns: float32 = Sigmoid(x)\ny: float32 = Mul(x, s)\noutput y\noutput s\n"
    plain, placed = native.cuda_source(text), native.cuda_source(text, placed=True)
    assert "OFX_PLACE" not in plain and "place_inner" not in plain
    assert "long long place_inner;\n  long long place_pitch;\n  long long place_off;\n};" in placed
    assert placed.count("[OFX_PLACE(i)] = ") == 3  # fast scalar, fast vector's tail, broadcast
    assert placed.count("+ OFX_PLACE(base)") == 2  # fast vector, broadcast vector
    assert "p.out[1])[i] = " in placed and "p.out[1]) + base" in placed  # output 1 stays contiguous


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_placed_kernels_compile(dtype):
    text = (f"onnxfuse.elementwise 1\ninput x: {dtype}\ninput b: {dtype}\ns: {dtype} = Sigmoid(x)\n"
            f"y: {dtype} = Mul(x, s)\nz: {dtype} = Add(y, b)\noutput z\noutput y\n")
    ptx = native.compile_ptx(native.cuda_source(text, placed=True), arch="compute_90")
    for name in ("ofx_fast_vec_32", "ofx_fast_scalar_64", "ofx_bcast_32", "ofx_bcast_vec_64"):
        assert f".entry {name}" in ptx


def unpack_placement(hexstr: str, nin: int, nout: int) -> tuple[int, int, int]:
    """The three fields after strides[nin][D], D = cuda_max_dims(nin, nout + 3)."""
    import struct

    d = max_dims(nin, nout + 3)
    return struct.unpack_from("<3q", bytes.fromhex(hexstr), 8 * (nin + nout) + 24 + 8 * d + 8 * d * nin)


@needs_nvrtc
def test_placed_launches_carry_the_placement_and_vectorise_only_whole_rows(mock_driver, tmp_path):
    text = "onnxfuse.elementwise 1\ninput x: float32\ninput b: float32\ny: float32 = Add(x, b)\noutput y\noutput x\n"
    A, B, O1, O2 = 0x10000, 0x20000, 0x30000, 0x40000
    launches = [
        # [2, 8, 4] into a [2, 24, 4] concatenation at channel 8: rows of 32, pitch 96, offset 32 -> vector
        ([(2, 8, 4), (2, 8, 4)], [A, B], [O1, O2], (32, 96, 32, 192)),
        # rows of 12 (3 channels x 4), pitch 20, offset 4: all multiples of V = 4 -> vector
        ([(2, 3, 4), (2, 3, 4)], [A, B], [O1, O2], (12, 20, 4, 40)),
        # rows of 6: not a multiple of 4 -> scalar
        ([(2, 3, 2), (2, 3, 2)], [A, B], [O1, O2], (6, 10, 2, 20)),
        # per-channel bias: broadcast kernel; rows of 8 -> broadcast vector
        ([(2, 2, 8), (2, 1, 1)], [A, B], [O1, O2], (16, 40, 8, 80)),
        # the same with an offset of 6 -> plain broadcast
        ([(2, 2, 8), (2, 1, 1)], [A, B], [O1, O2], (16, 40, 6, 80)),
        # a small segment of a concatenation past 2^31 elements -> 64-bit index
        ([(2, 8), (2, 8)], [A, B], [O1, O2], (8, 2**30 + 8, 0, 2**31 + 16)),
    ]
    r = run_mock(mock_driver, tmp_path, text, launches, placed=True)
    assert r["created"], r["error"]
    L = r["launches"]
    assert all(x["ok"] for x in L), L
    assert [x["kernel"] for x in L] == ["ofx_fast_vec_32", "ofx_fast_vec_32", "ofx_fast_scalar_32",
                                        "ofx_bcast_vec_32", "ofx_bcast_32", "ofx_fast_vec_64"]
    for x, (_, _, _, place) in zip(L, launches):
        assert unpack_placement(x["params"], 2, 2) == place[:3]
    assert L[0]["grid"] == (64 // 4 + 255) // 256  # V = 4 float32 elements per thread


@needs_nvrtc
def test_a_placed_kernel_launched_without_its_placement_is_an_error(mock_driver, tmp_path):
    text = "onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Relu(x)\noutput y\n"
    child_launches = [([(4,)], [0x10000], [0x30000])]
    r = run_mock(mock_driver, tmp_path, text, child_launches, placed=True)
    assert r["created"]
    assert not r["launches"][0]["ok"] and "without its placement" in r["launches"][0]["error"]
