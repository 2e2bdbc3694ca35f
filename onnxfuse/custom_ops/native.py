"""Program -> CUDA C++ source, and NVRTC, from Python (for tests and tools).

The code generator itself is C++ (``csrc/cuda_codegen.cc``): the library that ONNX Runtime loads
generates and compiles its kernels at session creation, so it cannot depend on Python. This module
reaches the same generator through the library's exported C functions with ctypes, and NVRTC
through ctypes too, so a machine without a GPU can still check that every generated kernel compiles:

>>> src = cuda_source(program_text)                    # doctest: +SKIP
>>> ptx = compile_ptx(src, arch="compute_90")          # doctest: +SKIP

Kernel variants (bit flags, :data:`VARIANT_ALL` is what the library compiles at run time):
:data:`VARIANT_FAST_VEC` (every input has the output's shape or one element; 128-bit loads and
stores, scalar tail), :data:`VARIANT_FAST_SCALAR` (same, any alignment), :data:`VARIANT_BROADCAST`
(per-input strides), :data:`VARIANT_BROADCAST_VEC` (per-input strides, innermost dim a multiple of the
vector width, inputs contiguous or broadcast along it: 128-bit loads and stores). Each comes with a
32-bit and a 64-bit index kernel.

Ops whose declared dtype is float16/bfloat16 (Exp, Sigmoid, Tanh, Reciprocal, Div, Softsign,
Gelu[approximate=tanh]) are generated with fast hardware approximations (``ofx_fast_*`` in the
source; error bounds stated there, all far below half precision's rounding); float32 ops keep the
accurate functions of ``csrc/ops.h``.
"""

from __future__ import annotations

import ctypes
import json
import os
from functools import lru_cache

from . import library_path, nvrtc_library_path

__all__ = [
    "VARIANT_FAST_VEC", "VARIANT_FAST_SCALAR", "VARIANT_BROADCAST", "VARIANT_BROADCAST_VEC", "VARIANT_ALL",
    "KERNEL_NAMES",
    "NvrtcError", "NvrtcNotFoundError", "check_program", "cuda_source", "compile_ptx",
    "nvrtc_version", "kernel_stats",
]

VARIANT_FAST_VEC = 1
VARIANT_FAST_SCALAR = 2
VARIANT_BROADCAST = 4
VARIANT_BROADCAST_VEC = 8
VARIANT_ALL = 15
KERNEL_NAMES = {
    VARIANT_FAST_VEC: ("ofx_fast_vec_32", "ofx_fast_vec_64"),
    VARIANT_FAST_SCALAR: ("ofx_fast_scalar_32", "ofx_fast_scalar_64"),
    VARIANT_BROADCAST: ("ofx_bcast_32", "ofx_bcast_64"),
    VARIANT_BROADCAST_VEC: ("ofx_bcast_vec_32", "ofx_bcast_vec_64"),
}


class NvrtcError(RuntimeError):
    """NVRTC rejected a source; the message carries NVRTC's log."""


class NvrtcNotFoundError(RuntimeError):
    """No libnvrtc could be loaded."""


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(library_path())
    lib.onnxfuse_check_program.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.onnxfuse_check_program.restype = ctypes.c_int
    lib.onnxfuse_cuda_source.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.onnxfuse_cuda_source.restype = ctypes.c_long
    lib.onnxfuse_cuda_stats.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.onnxfuse_cuda_stats.restype = ctypes.c_long
    return lib


def check_program(program: str) -> str | None:
    """The C++ parser's verdict: None if ``program`` is valid, else its ``line N: ...`` message."""
    err = ctypes.create_string_buffer(4096)
    ok = _lib().onnxfuse_check_program(program.encode(), err, len(err))
    return None if ok else err.value.decode()


def cuda_source(program: str, variant: int = VARIANT_ALL) -> str:
    """The CUDA source the library generates for ``program`` (``variant``: bit mask of kernels)."""
    lib = _lib()
    data = program.encode()
    need = lib.onnxfuse_cuda_source(data, variant, None, 0)
    if need < 0:
        raise ValueError(f"invalid program: {check_program(program)}")
    buf = ctypes.create_string_buffer(need + 1)
    lib.onnxfuse_cuda_source(data, variant, buf, len(buf))
    return buf.value.decode()


def kernel_stats() -> dict:
    """Counters of the library loaded in this process: NVRTC compiles, disk/memory cache hits and
    writes, disk entries rejected (failed verification, never loaded: ``disk_rejects``,
    ``last_disk_reject``), why the cache folder was refused (``disk_refused``, "" when used),
    compile and load milliseconds, target architecture, entry name, cache folder."""
    lib = _lib()
    size = 4096
    while True:  # the library returns the length it needs (paths and reasons can be long)
        buf = ctypes.create_string_buffer(size)
        need = lib.onnxfuse_cuda_stats(buf, len(buf))
        if need < size:
            return json.loads(buf.value.decode())
        size = need + 1


# --------------------------------------------------------------------------------------------- NVRTC

@lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    candidates = []
    env = os.environ.get("ONNXFUSE_NVRTC_PATH")
    if env:
        candidates += [p for p in env.split(":") if p]
    wheel = nvrtc_library_path()
    if wheel:
        candidates.append(wheel)
    candidates += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", "/usr/local/cuda/lib64/libnvrtc.so"]
    errors = []
    for c in candidates:
        try:
            lib = ctypes.CDLL(c)
        except OSError as e:
            errors.append(f"{c}: {e}")
            continue
        P = ctypes.c_void_p
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(P), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                           P, P]
        lib.nvrtcCompileProgram.argtypes = [P, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [P, ctypes.c_char_p]
        lib.nvrtcGetPTXSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetPTX.argtypes = [P, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(P)]
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib._onnxfuse_path = c
        return lib
    raise NvrtcNotFoundError("no libnvrtc found (install the nvidia-cuda-nvrtc wheel: "
                             "pip install nvidia-cuda-nvrtc); tried: " + "; ".join(errors))


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC found by :func:`compile_ptx`."""
    lib = _nvrtc()
    a, b = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
    return a.value, b.value


def compile_ptx(source: str, arch: str = "compute_90", options: tuple[str, ...] = ()) -> str:
    """Compile CUDA ``source`` with NVRTC (same options as the library) and return the PTX.

    Raises :class:`NvrtcError` with NVRTC's log when it does not compile.
    """
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"onnxfuse_fused.cu", 0, None, None)
    if r != 0:
        raise NvrtcError(f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(r).decode()}")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", "--fmad=true", "-DONNXFUSE_NVRTC=1", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        r = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        if r != 0:
            raise NvrtcError(f"NVRTC failed ({lib.nvrtcGetErrorString(r).decode()}):\n"
                             f"{log.value.decode(errors='replace')}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
