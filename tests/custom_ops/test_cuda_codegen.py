"""CUDA code generation, checked without a GPU: the source the library generates for every op in
every dtype, every Cast pair and every kernel variant compiles to PTX with NVRTC (from the
nvidia-cuda-nvrtc wheel, which runs on the CPU), and the PTX has the expected kernels and
vectorised memory accesses. The GPU tests (tests/gpu) run the same kernels."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from onnxfuse.custom_ops import codegen, expr

try:
    NVRTC = codegen.nvrtc_version()
    NVRTC_SKIP = None
except codegen.NvrtcNotFoundError as e:  # pragma: no cover - depends on the environment
    NVRTC, NVRTC_SKIP = None, f"NVRTC not available ({e}); install the dev extra: pip install -e '.[dev]'"

needs_nvrtc = pytest.mark.skipif(NVRTC_SKIP is not None, reason=NVRTC_SKIP or "")
ARCHS = ["compute_75", "compute_90"]
ALL_KERNELS = [n for names in codegen.KERNEL_NAMES.values() for n in names]


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
    header = (Path(codegen.__file__).parent / "csrc" / "ops.h").read_text()
    src = codegen.cuda_source(all_ops_program("float32"))
    assert header in src
    for name in ALL_KERNELS:
        assert f'extern "C" __global__ void __launch_bounds__(256) {name}(' in src


def test_variant_masks():
    text = all_ops_program("float32")
    for variant, names in codegen.KERNEL_NAMES.items():
        src = codegen.cuda_source(text, variant)
        for v2, n2 in codegen.KERNEL_NAMES.items():
            for n in n2:
                assert (f" {n}(" in src) == (v2 == variant)


def test_invalid_program_raises():
    with pytest.raises(ValueError, match="line 2"):
        codegen.cuda_source("onnxfuse.elementwise 1\ninput x: float99\noutput x\n")


@needs_nvrtc
@pytest.mark.parametrize("dtype", expr.DTYPES)
def test_every_op_compiles(dtype):
    text = all_ops_program(dtype)
    for arch in ARCHS:
        ptx = codegen.compile_ptx(codegen.cuda_source(text), arch=arch)
        for name in ALL_KERNELS:
            assert f".entry {name}(" in ptx, (name, arch)


@needs_nvrtc
def test_every_cast_compiles():
    ptx = codegen.compile_ptx(codegen.cuda_source(cast_program()), arch="compute_90")
    for name in ALL_KERNELS:
        assert f".entry {name}(" in ptx


@needs_nvrtc
@pytest.mark.parametrize("variant", sorted(codegen.KERNEL_NAMES))
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
    ptx = codegen.compile_ptx(codegen.cuda_source(text, variant), arch="compute_80")
    entries = re.findall(r"\.entry (\w+)\(", ptx)
    assert sorted(entries) == sorted(codegen.KERNEL_NAMES[variant])


@needs_nvrtc
@pytest.mark.parametrize("dtype,vec_load", [("float32", "v4.f32"), ("float16", "v4.u32"),
                                            ("bfloat16", "v4.u32")])
def test_fast_kernel_uses_128_bit_accesses(dtype, vec_load):
    text = f"onnxfuse.elementwise 1\ninput x: {dtype}\ny: {dtype} = Sigmoid(x)\noutput y\n"
    ptx = codegen.compile_ptx(codegen.cuda_source(text, codegen.VARIANT_FAST_VEC), arch="compute_90")
    assert re.search(r"ld\.global(\.nc)?\." + re.escape(vec_load), ptx), "no 128-bit load"
    assert re.search(r"st\.global\." + re.escape(vec_load), ptx), "no 128-bit store"


@needs_nvrtc
def test_compile_error_carries_log():
    with pytest.raises(codegen.NvrtcError, match="undefined"):
        codegen.compile_ptx("extern \"C\" __global__ void k() { undefined_fn(); }")


def test_kernel_stats_without_gpu():
    stats = codegen.kernel_stats()
    assert stats["compiles"] == 0 and "cache_dir" in stats
